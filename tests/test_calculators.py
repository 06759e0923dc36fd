"""Lectures 5a and 5b's calculators: their numbers are the formulas', and their output follows their sliders.

"In a browser it follows its sliders" is checked the way a browser drives a widget: each test builds
the calculator with the same builder the notebook calls, sets a control's `.value` (what dragging a
slider does through the kernel), and reads the Output widget's new content.
"""

import math

import matplotlib
import pytest

matplotlib.use("Agg")

from ddp_course import calculators as calc  # noqa: E402

GB = 1e9


def output_text(box):
    """The text line the calculator's Output widget holds now (and that it holds a figure)."""
    outputs = box.output.outputs
    assert any("image/png" in out.get("data", {}) for out in outputs), "the calculator draws its figure"
    return "".join(out["text"] for out in outputs if out.get("output_type") == "stream")


def test_allreduce_seconds_is_lecture_2s_ring_and_its_hierarchical_form():
    # A flat ring: 2 (N-1)/N S / beta + 2 (N-1) alpha per bucket.
    assert math.isclose(calc.allreduce_seconds(100e6, 8, 1, (0.0, 25e9)), 2 * 7 / 8 * 100e6 / 25e9)
    assert math.isclose(calc.allreduce_seconds(0, 8, 1, (1e-6, 25e9), buckets=3), 3 * 2 * 7 * 1e-6)
    # Two nodes of one GPU each: a flat ring of 2 on the network.
    assert math.isclose(calc.allreduce_seconds(1e6, 1, 2, (1e-6, 1e11), (5e-6, 1e10)), 2 * 5e-6 + 1e6 / 1e10)
    # Hierarchical: only 1/g of the bytes cross the network.
    inside, between = (0.0, 100e9), (0.0, 10e9)
    expected = 2 * 3 / 4 * 80e6 / 100e9 + 2 * 1 / 2 * (80e6 / 4) / 10e9
    assert math.isclose(calc.allreduce_seconds(80e6, 4, 2, inside, between), expected)


def test_network_link_shares_a_node_card_among_its_gpus():
    alpha, bandwidth = calc.network_link("100 Gb/s per node", 8)
    assert alpha == 5e-6 and math.isclose(bandwidth, 0.8 * 100e9 / 8 / 8)
    assert math.isclose(calc.network_link("400 Gb/s per GPU", 8)[1], 0.8 * 400e9 / 8)


def test_step_time_is_compute_plus_exposed_allreduce():
    parameters, flops = 124e6, 7e12
    t = calc.step_time(parameters, flops, 8, 2, "100 Gb/s per node", overlap=0.5)
    compute = flops / (0.40 * 989e12)
    ring = calc.allreduce_seconds(
        4 * parameters, 8, 2, calc.NVLINK, calc.network_link("100 Gb/s per node", 8), buckets=math.ceil(4 * parameters / (25 * 2**20))
    )
    exposed = max(0.0, ring - 0.5 * 2 / 3 * compute)
    assert math.isclose(t["compute_s"], compute) and math.isclose(t["allreduce_s"], ring)
    assert math.isclose(t["exposed_s"], exposed) and math.isclose(t["step_s"], compute + exposed)
    assert math.isclose(t["efficiency"], compute / (compute + exposed))
    # One node on NVLink: the link between nodes is never used.
    assert calc.step_time(parameters, flops, 8, 1, "100 Gb/s per node") == calc.step_time(parameters, flops, 8, 1, "400 Gb/s per GPU")


def test_step_time_reproduces_the_lectures_gpt2_prediction():
    """Lecture 5a, section 3: GPT-2 small on 2 nodes x 8 at 100 Gb/s, no overlap: 70.46 ms, efficiency 0.2527."""
    t = calc.step_time(calc.gpt2_parameters(), 8 * 1024 * (6 * calc.gpt2_parameters() + 12 * 12 * 768 * 1024), 8, 2, "100 Gb/s per node", overlap=0.0)
    assert round(t["step_s"] * 1e3, 2) == 70.46 and round(t["efficiency"], 4) == 0.2527


def test_memory_breakdown_terms():
    P, a, B = 1e9, 0.1 * GB, 10
    plain = calc.memory_breakdown(P, B, a)
    assert plain == {"weights": 4 * P, "gradients": 4 * P, "DDP buckets": 4 * P, "optimizer state": 8 * P, "16-bit weight copies": 0, "activations": a * B}
    assert calc.memory_breakdown(P, B, a, optimizer="SGD")["optimizer state"] == 0
    assert calc.memory_breakdown(P, B, a, optimizer="SGD + momentum")["optimizer state"] == 4 * P
    assert calc.memory_breakdown(P, B, a, bucket_view=True)["DDP buckets"] == 0
    assert calc.memory_breakdown(P, B, a, zero1_ranks=8)["optimizer state"] == P  # 8P / 8; gradients untouched
    assert calc.memory_breakdown(P, B, a, zero1_ranks=8)["gradients"] == 4 * P
    amp = calc.memory_breakdown(P, B, a, amp=True)
    assert amp["activations"] == a * B / 2 and amp["16-bit weight copies"] == 2 * P
    # s segments of L layers: s segment inputs (s/L) + one segment recomputed (1/s).
    assert math.isclose(calc.memory_breakdown(P, B, a, checkpoint_segments=4, layers=16)["activations"], a * B * (4 / 16 + 1 / 4))


def test_memory_breakdown_agrees_with_exercise_2s_worked_example():
    """80 GB, 1 B parameters, Adam, DDP: 60 GB left for activations (lecture 5b, exercise 1)."""
    fixed = sum(calc.memory_breakdown(1e9, 0, 0.1 * GB).values())
    assert fixed == 20 * GB


@pytest.mark.timeout(60)
def test_step_time_calculator_follows_its_sliders():
    box = calc.step_time_calculator()
    defaults = {name: control.value for name, control in box.controls.items()}
    t = calc.step_time(**defaults)
    before = output_text(box)
    assert f"step {t['step_s'] * 1e3:.2f} ms" in before and f"efficiency {t['efficiency']:.0%}" in before
    box.controls["nodes"].value = 1  # one NVLink node
    after = output_text(box)
    one_node = calc.step_time(**(defaults | {"nodes": 1}))
    assert after != before and f"step {one_node['step_s'] * 1e3:.2f} ms" in after and after.startswith("8 GPUs")
    box.controls["nodes"].value = 2
    box.controls["overlap"].value = 0.0
    assert f"step {calc.step_time(**(defaults | {'overlap': 0.0}))['step_s'] * 1e3:.2f} ms" in output_text(box)


@pytest.mark.timeout(60)
def test_memory_calculator_follows_its_sliders():
    box = calc.memory_calculator()
    defaults = {name: control.value for name, control in box.controls.items()}
    total = sum(calc.memory_breakdown(**defaults).values())
    before = output_text(box)
    assert before.startswith(f"{total / GB:.1f} GB per rank")
    box.controls["zero1_ranks"].value = 8
    after = output_text(box)
    sharded = sum(calc.memory_breakdown(**(defaults | {"zero1_ranks": 8})).values())
    assert after != before and after.startswith(f"{sharded / GB:.1f} GB per rank") and sharded < total
    box.controls["optimizer"].value = "SGD"
    assert "optimizer state" not in output_text(box)  # a zero term is not listed
    box.controls["batch"].value = 256  # 256 x 2 GB of activations: far past 80 GB
    assert "does NOT fit" in output_text(box)
