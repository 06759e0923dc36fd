"""Lecture 1's communication calculator: its bars are the ring all-reduce formula, and it follows its sliders.

The lecture draws one bar per link with ddp_course.lecture01_checks.draw_link_bars (a static figure
that nbval compares) and then shows communication_calculator(), the widget. Its numbers are checked
here against the formula written out independently,

    t >= 2 (N - 1) / N x S / beta,   S = P x bytes per value,

and the widget is built by the same function the notebook calls; a test moves each control (sets
`.value`, as a browser does) and reads what its Output widget now shows.
"""

import base64
import math

import pytest

from ddp_course import lecture01_checks as calculator

GPT2_SMALL = 124_439_808  # parameters, the lecture's count


def formula_ms(parameters, world_size, bytes_per_value, beta):
    return 2 * (world_size - 1) / world_size * parameters * bytes_per_value / beta * 1e3


def test_links_are_the_h100_reference_figures():
    # NVLink 4 on an H100 SXM: 900 GB/s both directions -> 450 GB/s each way (NVIDIA H100 datasheet).
    assert calculator.LINKS["NVLink 4"] == 450e9
    # PCIe Gen5 x16: 32 GT/s x 16 lanes x 128/130 / 8 bits per byte, per direction.
    assert calculator.LINKS["PCIe Gen5 x16"] == pytest.approx(32e9 * 16 * 128 / 130 / 8, rel=0.02)
    assert calculator.LINKS["100 GbE"] == 100e9 / 8


@pytest.mark.parametrize("parameters", [151_306, 11_173_962, GPT2_SMALL, 7e9])
@pytest.mark.parametrize("world_size", [2, 8, 256])
@pytest.mark.parametrize("bytes_per_value", [4, 2])
def test_bars_equal_the_ring_formula(parameters, world_size, bytes_per_value):
    bars = calculator.link_milliseconds(parameters, world_size, bytes_per_value)
    assert list(bars) == list(calculator.LINKS)
    for link, beta in calculator.LINKS.items():
        assert bars[link] == pytest.approx(formula_ms(parameters, world_size, bytes_per_value, beta), rel=1e-12)


def test_the_drawn_bars_have_the_computed_heights():
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    ax = Figure().add_subplot()
    returned = calculator.draw_link_bars(ax, GPT2_SMALL, 8, 4)
    heights = [patch.get_height() for patch in ax.patches]
    assert heights == pytest.approx(list(returned.values()))
    assert heights == pytest.approx([formula_ms(GPT2_SMALL, 8, 4, beta) for beta in calculator.LINKS.values()])
    # the lecture's reading of the table: about 2 ms on NVLink 4 and 70 ms on 100 GbE for GPT-2 small on 8 GPUs
    assert round(returned["NVLink 4"]) == 2 and round(returned["100 GbE"]) == 70


def shown(widget):
    """(text, png bytes) of what the calculator's Output widget displays now."""
    output = widget.children[-1]
    [display] = output.outputs
    return display["data"]["text/plain"], base64.b64decode(display["data"]["image/png"])


def parse_bars(text):
    """{link: milliseconds} from the text beside the drawing: '..., NVLink 4 1.936 ms, PCIe Gen5 x16 13.61 ms, ...'."""
    bars = {}
    for link in calculator.LINKS:
        value = text.split(f"{link} ", 1)[1].split(" ms", 1)[0]
        bars[link] = float(value.replace(",", ""))
    return bars


def test_the_widget_opens_with_the_static_figures_numbers():
    text, png = shown(calculator.communication_calculator(millions_of_parameters=124.4, world_size=8))
    assert png.startswith(b"\x89PNG")
    for link, ms in parse_bars(text).items():
        assert ms == pytest.approx(formula_ms(124.4e6, 8, 4, calculator.LINKS[link]), rel=1e-3)


@pytest.mark.parametrize(
    "control, value, expected",
    [(0, 1000.0, (1000e6, 8, 4)), (1, 64, (124.4e6, 64, 4)), (2, 2, (124.4e6, 8, 2))],
    ids=["P slider", "N slider", "precision"],
)
def test_moving_a_control_redraws_the_bars(control, value, expected):
    widget = calculator.communication_calculator(millions_of_parameters=124.4, world_size=8, bytes_per_value=4)
    before_text, before_png = shown(widget)
    widget.children[control].value = value  # what a browser does when the reader moves it
    after_text, after_png = shown(widget)
    assert after_text != before_text and after_png != before_png
    parameters, world_size, bytes_per_value = expected
    for link, ms in parse_bars(after_text).items():
        assert ms == pytest.approx(formula_ms(parameters, world_size, bytes_per_value, calculator.LINKS[link]), rel=1e-3)
    assert not math.isclose(parse_bars(after_text)["NVLink 4"], parse_bars(before_text)["NVLink 4"])
