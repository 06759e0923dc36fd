"""Lecture 6's checkpoint-interval calculator: its numbers are the model's, and it follows its sliders.

The numbers: waste_fraction is the closed form E[segment]/tau - 1 (checked against a simulation of
Poisson failures), best_interval is its exact minimiser (checked against a dense grid and against
the stationarity equation), Young's and Daly's intervals are their published formulas, and the
calculator prints what waste_curve_facts computes. "In a browser it follows its sliders": setting a
slider's `.value` (what dragging it does) changes the widget's image and summary to the new values'.
"""

import math

import pytest
import torch

from ddp_course import lecture06_checks as model
from ddp_course.launch import REPO_ROOT

HOUR = 3600.0
LLAMA3 = (60.0, 54 * 24 * HOUR / 419, 300.0)  # the lecture's example: C, M, R in seconds
CASES = [LLAMA3, (10.0, 24 * HOUR, 60.0), (600.0, 2 * HOUR, 900.0), (1800.0, 1 * HOUR, 30.0)]


def dense_argmin(checkpoint_s, mtbf_s, restart_s, points=200_001):
    taus = torch.logspace(math.log10(checkpoint_s / 100), math.log10(3 * mtbf_s), points, dtype=torch.float64)
    mtbf = torch.tensor(mtbf_s, dtype=torch.float64)
    waste = (mtbf + restart_s) * torch.expm1((taus + checkpoint_s) / mtbf) / taus - 1
    return float(taus[torch.argmin(waste)])


@pytest.mark.parametrize("case", CASES)
def test_best_interval_is_the_minimum_of_the_waste_curve_and_r_does_not_move_it(case):
    checkpoint_s, mtbf_s, restart_s = case
    best = model.best_interval(checkpoint_s, mtbf_s)
    assert best == pytest.approx(dense_argmin(*case), rel=1e-3)
    assert math.exp((best + checkpoint_s) / mtbf_s) * (1 - best / mtbf_s) == pytest.approx(1, abs=1e-9)
    assert best == pytest.approx(dense_argmin(checkpoint_s, mtbf_s, 10 * restart_s + 1000), rel=1e-3)
    for other in (0.9 * best, 1.1 * best):
        assert model.waste_fraction(best, *case) < model.waste_fraction(other, *case)


@pytest.mark.parametrize("case", CASES)
def test_young_and_daly_are_their_formulas_and_daly_is_closer_to_the_exact_optimum(case):
    checkpoint_s, mtbf_s, _ = case
    assert model.young_interval(checkpoint_s, mtbf_s) == pytest.approx(math.sqrt(2 * checkpoint_s * mtbf_s))
    x = checkpoint_s / (2 * mtbf_s)
    daly = math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint_s
    assert model.daly_interval(checkpoint_s, mtbf_s) == pytest.approx(daly)
    best = model.best_interval(checkpoint_s, mtbf_s)
    assert abs(model.daly_interval(checkpoint_s, mtbf_s) - best) < abs(model.young_interval(checkpoint_s, mtbf_s) - best)


def test_young_is_the_limit_for_cheap_checkpoints_and_the_waste_near_sqrt_2c_over_m():
    mtbf_s = 24 * HOUR
    for checkpoint_s in (0.1, 1.0):
        assert model.young_interval(checkpoint_s, mtbf_s) == pytest.approx(model.best_interval(checkpoint_s, mtbf_s), rel=0.01)
        young_waste = model.waste_fraction(model.young_interval(checkpoint_s, mtbf_s), checkpoint_s, mtbf_s, 0.0)
        assert young_waste == pytest.approx(math.sqrt(2 * checkpoint_s / mtbf_s), rel=0.01)


@pytest.mark.parametrize("tau_min", [5, 19, 120])
def test_the_closed_form_matches_a_simulation_of_poisson_failures(tau_min):
    checkpoint_s, mtbf_s, restart_s = LLAMA3
    tau, trials = tau_min * 60.0, 40_000
    generator = torch.Generator().manual_seed(tau_min)
    total = torch.zeros(trials, dtype=torch.float64)
    pending = torch.ones(trials, dtype=torch.bool)
    while pending.any():
        failure_at = torch.empty(trials, dtype=torch.float64).exponential_(1 / mtbf_s, generator=generator)
        survives = failure_at >= tau + checkpoint_s
        cost = torch.where(survives, torch.full_like(total, tau + checkpoint_s), failure_at + restart_s)
        total += torch.where(pending, cost, torch.zeros_like(total))
        pending &= ~survives
    assert float(total.mean()) == pytest.approx(model.expected_segment_s(tau, *LLAMA3), rel=0.02)


def test_the_calculator_follows_its_sliders():
    pytest.importorskip("ipywidgets")
    calculator = model.WasteCalculator()
    assert calculator.summary.value == f"<code>{model.describe(model.waste_curve_facts(*LLAMA3[:1], 3.1 * HOUR, 300.0))}</code>"
    for slider, value in ((calculator.checkpoint, 600.0), (calculator.mtbf, 24.0), (calculator.restart, 30.0)):
        image, summary = calculator.image.value, calculator.summary.value
        slider.value = value  # what dragging the slider in a browser does
        assert calculator.image.value != image and calculator.summary.value != summary, slider.description
    expected = model.waste_curve_facts(600.0, 24.0 * HOUR, 30.0)
    assert calculator.facts == pytest.approx(expected)
    assert calculator.summary.value == f"<code>{model.describe(expected)}</code>"
    assert bytes(calculator.image.value).startswith(b"\x89PNG")


def test_the_lecture_uses_this_module_for_its_numbers():
    import json

    cells = json.loads((REPO_ROOT / "lectures" / "06_debugging_fault_tolerance.ipynb").read_text())["cells"]
    code = "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")
    assert "from ddp_course.lecture06_checks import" in code and "waste_calculator(" in code
    assert "def waste_fraction" not in code and "def expected_segment_s" not in code  # one definition, here
