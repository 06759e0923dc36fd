"""Lecture 6's helpers: the checkpoint-interval model and its calculator, and the exercise checks.

The model (lecture 6, section 4; derived in section 7.2): a segment is tau seconds of work followed by
a checkpoint of C seconds; failures arrive as a Poisson process with mean time between failures M
(the whole job's); a failure costs the time spent in the segment so far plus a restart of R seconds,
and the segment starts over. Then

    E[segment] = (M + R) (exp((tau + C) / M) - 1),   waste(tau) = E[segment] / tau - 1.

Young (CACM 17(9), 1974) minimises the first-order expansion C/tau + tau/(2M): tau = sqrt(2 C M).
Daly (FGCS 22(3), 2006) adds higher-order terms. The exact minimiser of waste() solves
exp((tau + C)/M) (1 - tau/M) = 1 (R drops out), which best_interval() finds by bisection.

A check is one call in the notebook: `check_exercise_2(checkpoint_every_steps)`. Each prints what
it found and ends with one verdict line: "exercise N: correct", "exercise N: not yet" or
"exercise N: not solved yet - fill in NAME above".
"""

from __future__ import annotations

import copy
import io
import math
from concurrent.futures import Future, ThreadPoolExecutor

from ddp_course.self_check import Question

# ----------------------------------------------------------------------------- the model


def expected_segment_s(tau: float, checkpoint_s: float, mtbf_s: float, restart_s: float) -> float:
    """Expected wall time of tau seconds of work plus a checkpoint, failures Poisson with mean mtbf_s."""
    return (mtbf_s + restart_s) * math.expm1((tau + checkpoint_s) / mtbf_s)


def waste_fraction(tau: float, checkpoint_s: float, mtbf_s: float, restart_s: float) -> float:
    """Fraction of the wall time not spent on useful work: E[segment] / tau - 1."""
    return expected_segment_s(tau, checkpoint_s, mtbf_s, restart_s) / tau - 1


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum, sqrt(2 C M) seconds."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order estimate (2006, eq. 37): good also when C is not small next to M."""
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    ratio = checkpoint_s / (2 * mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - checkpoint_s


def best_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """The tau that minimises waste_fraction exactly: the root of exp((tau + C)/M) (1 - tau/M) = 1 in (0, M).

    The left side is exp(C/M) > 1 at tau = 0 and 0 at tau = M, and it falls in between (its
    derivative is -(tau/M) exp(...)/M), so bisection finds the one root. The restart cost R does not move it.
    """
    low, high = 0.0, mtbf_s
    for _ in range(200):
        middle = (low + high) / 2
        if math.exp((middle + checkpoint_s) / mtbf_s) * (1 - middle / mtbf_s) > 1:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def interval_grid(checkpoint_s: float, mtbf_s: float, points: int = 300) -> list[float]:
    """Checkpoint intervals to draw: log-spaced from C/10 to 3 M (the curve's whole useful range)."""
    low, high = math.log10(max(checkpoint_s / 10, 1.0)), math.log10(3 * mtbf_s)
    return [10 ** (low + (high - low) * i / (points - 1)) for i in range(points)]


def waste_curve_facts(checkpoint_s: float, mtbf_s: float, restart_s: float) -> dict:
    """The numbers the figure and the calculator show: the three intervals and the waste at each."""
    young, daly, best = young_interval(checkpoint_s, mtbf_s), daly_interval(checkpoint_s, mtbf_s), best_interval(checkpoint_s, mtbf_s)
    return {
        "young_s": young,
        "daly_s": daly,
        "best_s": best,
        "waste_at_young": waste_fraction(young, checkpoint_s, mtbf_s, restart_s),
        "waste_at_daly": waste_fraction(daly, checkpoint_s, mtbf_s, restart_s),
        "waste_at_best": waste_fraction(best, checkpoint_s, mtbf_s, restart_s),
        "restart_share": restart_s / mtbf_s,
    }


def describe(facts: dict) -> str:
    """One line per interval, minutes and percent: what the calculator prints under its curve."""
    return (
        f"best interval {facts['best_s'] / 60:.1f} min (waste {facts['waste_at_best']:.1%}) | "
        f"Young sqrt(2CM) {facts['young_s'] / 60:.1f} min ({facts['waste_at_young']:.1%}) | "
        f"Daly {facts['daly_s'] / 60:.1f} min ({facts['waste_at_daly']:.1%}) | restarts alone R/M {facts['restart_share']:.1%}"
    )


def draw_waste_curve(ax, checkpoint_s: float, mtbf_s: float, restart_s: float) -> dict:
    """Waste (%) against the checkpoint interval (minutes, log scale), Young's and the exact optimum marked."""
    facts = waste_curve_facts(checkpoint_s, mtbf_s, restart_s)
    taus = interval_grid(checkpoint_s, mtbf_s)
    minutes = [tau / 60 for tau in taus]
    ax.plot(minutes, [100 * waste_fraction(t, checkpoint_s, mtbf_s, restart_s) for t in taus], label="model")
    ax.plot(minutes, [100 * (checkpoint_s / t + t / (2 * mtbf_s)) for t in taus], "--", label=r"first order: $C/\tau + \tau/2M$")
    ax.axvline(facts["young_s"] / 60, color="grey", linestyle=":", label=r"Young: $\sqrt{2CM}$")
    ax.plot([facts["best_s"] / 60], [100 * facts["waste_at_best"]], "o", color="black", label="exact optimum")
    top = min(100.0, max(20.0, 300 * facts["waste_at_best"]))
    ax.set(
        xscale="log",
        xlabel=r"checkpoint interval $\tau$ (minutes)",
        ylabel="time wasted (%)",
        ylim=(0, top),
        title=f"C = {checkpoint_s:.0f} s, M = {mtbf_s / 3600:.1f} h, R = {restart_s:.0f} s",
    )
    ax.legend(fontsize=8)
    return facts


class WasteCalculator:
    """Sliders for C, M and R; the curve (a PNG in an Image widget) and a summary line follow them.

    The figure is rendered to PNG bytes rather than shown through an Output widget, so the widget's
    state - `image.value` and `summary.value` - is what a browser displays, and a test can read it.
    """

    def __init__(self, checkpoint_s: float = 60.0, mtbf_h: float = 3.1, restart_s: float = 300.0):
        import ipywidgets as widgets

        style = {"description_width": "150px"}
        layout = widgets.Layout(width="520px")
        self.checkpoint = widgets.FloatLogSlider(
            value=checkpoint_s, base=10, min=0, max=3.5, step=0.05, description="checkpoint cost C (s)", style=style, layout=layout
        )
        self.mtbf = widgets.FloatLogSlider(value=mtbf_h, base=10, min=-1, max=3, step=0.05, description="job MTBF M (hours)", style=style, layout=layout)
        self.restart = widgets.FloatLogSlider(value=restart_s, base=10, min=0, max=3.5, step=0.05, description="restart R (s)", style=style, layout=layout)
        self.image = widgets.Image(format="png")
        self.summary = widgets.HTML()
        for slider in (self.checkpoint, self.mtbf, self.restart):
            slider.observe(self.update, names="value")
        self.widget = widgets.VBox([self.checkpoint, self.mtbf, self.restart, self.image, self.summary])
        self.update()

    def update(self, _change=None) -> None:
        from matplotlib.figure import Figure  # no pyplot: nothing is shown twice in a notebook

        facts_args = (self.checkpoint.value, self.mtbf.value * 3600, self.restart.value)
        figure = Figure(figsize=(6, 3.2))
        facts = draw_waste_curve(figure.subplots(), *facts_args)
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", dpi=80)
        self.image.value = buffer.getvalue()
        self.summary.value = f"<code>{describe(facts)}</code>"
        self.facts = facts


def waste_calculator(**defaults):
    """The calculator's widget, ready to display: `display(waste_calculator())` or as a cell's last line."""
    return WasteCalculator(**defaults).widget


# ----------------------------------------------------------------------------- start-up jobs


def start_plain_ranks_in_background(command: list, world_size_by_rank: dict, timeout_s: float = 180) -> "Future[dict]":
    """ddp_course.faults.run_plain_ranks in a background thread; `.result()` waits for {rank: RunResult}."""
    from ddp_course.faults import run_plain_ranks

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plain-ranks")
    future = pool.submit(run_plain_ranks, command, world_size_by_rank, timeout_s)
    pool.shutdown(wait=False)  # the thread ends with the job
    return future


# ----------------------------------------------------------------------------- exercise checks


def _not_solved(number: int, name: str) -> None:
    print(f"exercise {number}: not solved yet - fill in {name} above")


def _entry(seq, name="gloo:all_reduce", sizes=((4,),)):
    return {"collective_seq_id": seq, "profiling_name": name, "input_sizes": [list(s) for s in sizes]}


def check_exercise_1(first_disagreement) -> None:
    """first_disagreement(entries_by_rank) against dumps whose ring buffers start at different numbers."""
    ar = [_entry(s) for s in range(1, 9)]
    cases = [
        ({0: ar[:2], 1: [ar[0], _entry(2, "gloo:barrier", ())]}, 2),  # the section 2 dump
        ({0: ar[:3], 1: [ar[0], ar[1], _entry(3, sizes=((3,),))]}, 3),  # same name, another shape
        ({0: ar[:3], 1: ar[:2]}, 3),  # rank 1 never ran #3
        ({0: ar[4:8], 1: ar[2:6] + [_entry(7, "gloo:broadcast"), ar[7]]}, 7),  # buffers start at 5 and 3
        ({0: ar[4:8], 1: ar[2:8]}, None),  # the same collectives; #3 and #4 fell out of rank 0's buffer
        ({0: ar[:6], 1: ar[:5], 2: ar[:3] + [_entry(4, "gloo:all_gather")] + ar[4:6]}, 4),  # three ranks
        ({0: ar[:4], 1: ar[:4]}, None),
    ]
    try:
        answers = [first_disagreement(copy.deepcopy(dumps_by_rank)) for dumps_by_rank, _ in cases]
    except NotImplementedError:
        return _not_solved(1, "first_disagreement")
    for (_, expected), answer in zip(cases, answers):
        print(f"  expected {expected}, got {answer}")
    print("exercise 1:", "correct" if answers == [expected for _, expected in cases] else "not yet")


def _waste_per_step(k, step_s, checkpoint_s, node_mtbf_s, nodes, restart_s):
    """waste_fraction for an interval of k steps (k: one number or a float64 tensor of them)."""
    import torch

    mtbf = node_mtbf_s / nodes
    k = torch.as_tensor(k, dtype=torch.float64)
    return (mtbf + restart_s) * torch.expm1((k * step_s + checkpoint_s) / mtbf) / (k * step_s) - 1


def check_exercise_2(checkpoint_every_steps) -> None:
    """checkpoint_every_steps(...) within 1% of the best integer's waste, also where Young is not good."""
    import torch

    year = 365 * 24 * 3600.0
    # (step_s, checkpoint_s, node_mtbf_s, nodes, restart_s); the last: checkpoints almost as slow as failures
    cases = [(1.0, 60.0, 5 * year, 2048, 300.0), (0.25, 20.0, 3 * year, 512, 120.0), (2.0, 120.0, 5 * year, 16384, 600.0), (0.5, 900.0, year, 8192, 60.0)]
    ok = True
    for case in cases:
        try:
            k = checkpoint_every_steps(*case)
        except NotImplementedError:
            return _not_solved(2, "checkpoint_every_steps")
        steps = torch.arange(1, 200_000, dtype=torch.float64)
        best = int(steps[torch.argmin(_waste_per_step(steps, *case))])
        good = isinstance(k, int) and k >= 1 and float(_waste_per_step(k, *case)) <= 1.01 * float(_waste_per_step(best, *case))
        print(f"  step {case[0]} s, checkpoint {case[1]:.0f} s, {case[3]} nodes: every {k} steps ({'ok' if good else 'wastes too much'})")
        ok = ok and good
    print("exercise 2:", "correct" if ok else "not yet")


def check_exercise_3(replica_fingerprint) -> None:
    """replica_fingerprint(model): <= 64 elements, equal for copies, different for swaps and one-ulp moves."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    before = copy.deepcopy(model.state_dict())
    try:
        base = replica_fingerprint(model)
    except NotImplementedError:
        return _not_solved(3, "replica_fingerprint")
    variants = {name: copy.deepcopy(model) for name in ("two weights swapped", "one weight one float32 step up", "two layers trade weights")}
    w = variants["two weights swapped"][0].weight.data
    w[0, 0], w[3, 5] = w[3, 5].clone(), w[0, 0].clone()
    b = variants["one weight one float32 step up"][4].bias.data
    b[1] = torch.nextafter(b[1], torch.tensor(float("inf")))
    first, second = variants["two layers trade weights"][0].weight.data, variants["two layers trade weights"][2].weight.data
    saved = first.clone()
    first.copy_(second)
    second.copy_(saved)
    ok = isinstance(base, torch.Tensor) and base.numel() <= 64
    ok = ok and torch.equal(base, replica_fingerprint(copy.deepcopy(model)))
    for label, variant in variants.items():
        differs = not torch.equal(base, replica_fingerprint(variant))
        print(f"  {label}: {'detected' if differs else 'missed'}")
        ok = ok and differs
    ok = ok and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    print("exercise 3:", "correct" if ok else "not yet")


# --- the self-check (ddp_course/self_check.py), asked at the end of the Summary --------------------------
# Section 4: the position is the count of samples of the epoch's permutation the checkpoint's job consumed,
# 6 steps x 16 samples x 4 ranks = 384, whatever world size resumes (ddp_course.resume.samples_consumed;
# tests/test_lecture06_exercises.py recomputes it and resumes a sampler there).
SELF_CHECK = Question(
    name="self-check",
    expected=384,
    why="the checkpoint of step 6 saw 6 x 16 x 4 samples; steps 7-9 are lost, and 2 ranks deal out the rest",
    hint="reread section 4 (checkpoints for resumable jobs), 'Resuming on another number of ranks': "
    "which checkpoint survives the crash, and what does the position count?",
    relative_tolerance=0.0,
)
