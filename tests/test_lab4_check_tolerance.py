"""Lab 4's checks 2 (fresh-gradients) and 7 (gradient-scale) judge the bug, not the CPU's rounding.

Both compare the gradient a job held at an optimizer step with one recomputed by the checker. Two
float32 computations of one gradient differ by rounding, by more where the sum cancels, and a
pre-activation within rounding of 0 can land on either side of a ReLU: that switches one sample's
gradient through one unit on or off. With a fixed tolerance of 1e-3, the loss scaled by the world
size was reported to fail check 2 as well as check 7 on a CPU with AVX-512, and to pass check 2
under ATEN_CPU_CAPABILITY=default. The tolerance is now derived from the numbers compared
(ddp_course/checking/lab4.py, rounding_tolerance).

The first tests build the step records the observer writes (ddp_course/checking/observer.py) in this process,
with a ReLU switched as rounding can switch it: no launch, the same on every CPU. The last ones run
the checker on the loss-times-world-size script under each CPU capability this machine has.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector

from ddp_course.authoring.notebooks import stored_cell
from ddp_course.launch import REPO_ROOT, RunResult

from ddp_course.checking import lab4 as lab4_check

WORLD_SIZE, BATCH = lab4_check.WORLD_SIZE, lab4_check.BATCH_SIZE
STEPS = 3
SOLUTION = REPO_ROOT / "solutions" / "lab4_broken_ddp.py"
# The loss multiplied by the world size, "to undo DDP's average" (tests/test_checkers.py has the same row).
TIMES_WORLD_SIZE = (
    "            loss.backward()  # DDP all-reduces: every rank now holds the gradient averaged over ranks\n",
    "            (loss * ctx.world_size).backward()  # each rank's loss as if it held the whole batch\n",
)


def hidden_pre_activations(model, images):
    """The classifier's hidden layer before its ReLU: (samples, 128)."""
    with torch.no_grad():
        return model.classifier[1](model.classifier[0](model.features(images)))


def rank_gradient(model, images, labels, switched=None):
    """This rank's mean-loss gradient; switched=(sample, unit): that ReLU decides the other way.

    The switched unit's pre-activation is the one nearest 0, so its output moves by less than its
    tiny value: what two roundings of the same forward pass can do. Its gradient, switched on or
    off, moves by that sample's whole contribution through the unit.
    """
    hook = None
    if switched is not None:
        sample, unit = switched

        def switch(module, inputs, output):
            z = inputs[0]
            flipped = torch.where(z > 0, z.detach() * 0, z)  # on -> off (no gradient), off -> on (gradient 1)
            mask = torch.zeros_like(z, dtype=torch.bool)
            mask[sample, unit] = True
            return torch.where(mask, flipped, output)

        hook = model.classifier[2].register_forward_hook(switch)
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(images), labels).backward()
    if hook is not None:
        hook.remove()
    return parameters_to_vector(p.grad for p in model.parameters()).detach().clone()


def nearest_to_zero(model, images):
    z = hidden_pre_activations(model, images)
    flat = int(z.abs().argmin())
    return divmod(flat, z.shape[1])


def write_steps(folder: Path, observed_gradients, batches, params) -> lab4_check.Observation:
    """The step records the observer writes for STEPS steps; every rank holds the (averaged) observed gradient."""
    shapes = [list(p.shape) for p in lab4_check.DigitsCNN().parameters()]
    for step, (observed, ranks_batches) in enumerate(zip(observed_gradients, batches), start=1):
        for rank in range(WORLD_SIZE):
            record = {"step": step, "shapes": shapes, "params": params, "grads": observed, "missing_grads": [],
                      "batch": ranks_batches[rank]}  # fmt: skip
            torch.save(record, folder / f"step-r{rank}-{step}.pt")
    run = RunResult(["(records written by the test)"], 0, "", "", 0.0, False)
    return lab4_check.Observation(run, folder)


@pytest.fixture(scope="module")
def job():
    """Lab 4's model at its seed, STEPS steps of disjoint per-rank batches, and each step's gradients:
    per rank as computed, and rank 0's with its ReLU nearest 0 switched."""
    torch.manual_seed(0)
    model = lab4_check.DigitsCNN()
    images, labels = lab4_check.digits().train.tensors
    order = torch.randperm(len(labels)).tolist()
    batches, exact, switched = [], [], []
    for step in range(STEPS):
        start = step * WORLD_SIZE * BATCH
        ranks = [order[start + rank * BATCH : start + (rank + 1) * BATCH] for rank in range(WORLD_SIZE)]
        per_rank = [rank_gradient(model, images[ranks[r]], labels[ranks[r]]) for r in range(WORLD_SIZE)]
        first = torch.tensor(ranks[0])
        one_switch = rank_gradient(model, images[first], labels[first], nearest_to_zero(model, images[first]))
        batches.append(ranks)
        # DDP divides each rank's gradient by the world size, then all-reduces (sums) them.
        exact.append(sum(g / WORLD_SIZE for g in per_rank))
        switched.append(sum(g / WORLD_SIZE for g in [one_switch, *per_rank[1:]]))
    params = parameters_to_vector(model.parameters()).detach().clone()
    return {"model": model, "batches": batches, "exact": exact, "switched": switched, "params": params}


@pytest.fixture(scope="module")
def references(job, tmp_path_factory):
    """lab4_check.gradient_steps on the records of the job: each step's reference gradient and tolerance."""
    obs = write_steps(tmp_path_factory.mktemp("records"), job["exact"], job["batches"], job["params"])
    steps, problem = lab4_check.gradient_steps(obs, lab4_check.digits().train)
    assert problem is None and len(steps) == STEPS
    return steps


def judge_gradients(observed, references):
    """Checks 7 and 2 on these observed gradients, as lab4_check.judge runs them."""
    steps = [lab4_check.GradientStep(o, step.reference, step.tolerance) for o, step in zip(observed, references)]
    obs = lab4_check.Observation(RunResult(["(none)"], 0, "", "", 0.0, False), Path("(none)"))
    scale_verdict, scale = lab4_check.check_gradient_scale(steps, None, obs)
    return scale_verdict, lab4_check.check_fresh_gradients(steps, None, scale, obs)


def test_one_relu_switched_by_rounding_moves_the_gradient_past_the_old_fixed_tolerance(job):
    """The premise: a switch that rounding can cause is not a rounding-sized difference."""
    moved = [lab4_check.relative(s, e) for s, e in zip(job["switched"], job["exact"])]
    assert all(m > 1e-3 for m in moved), moved  # the fixed tolerance the derived one replaced


def test_a_relu_switched_by_rounding_passes_checks_2_and_7(job, references):
    scale_verdict, fresh_verdict = judge_gradients(job["switched"], references)
    assert scale_verdict.status == "PASS", scale_verdict.line()
    assert fresh_verdict.status == "PASS", fresh_verdict.line()
    for step, switched in zip(references, job["switched"]):
        assert lab4_check.best_multiple(switched, step.reference)[1] < step.tolerance / 2  # with a margin


def test_the_loss_times_the_world_size_with_a_switched_relu_fails_gradient_scale_only(job, references):
    """What was reported on the AVX-512 CPU, on any CPU: the loss times the world size, and in step 3
    a ReLU that rounding switched. The fixed tolerance said of check 2: "step 3's gradient is neither
    its own batch's gradient nor that plus step 2's"."""
    observed = [2 * job["exact"][0], 2 * job["exact"][1], 2 * job["switched"][2]]
    scale_verdict, fresh_verdict = judge_gradients(observed, references)
    assert scale_verdict.status == "FAIL" and "step 1's gradient is 2.00 x the gradient" in scale_verdict.evidence
    assert fresh_verdict.status == "PASS", fresh_verdict.line()


def test_gradients_that_pile_up_still_fail_fresh_gradients(job, references):
    piled = [job["switched"][0]]
    for gradient in job["switched"][1:]:
        piled.append(piled[-1] + gradient)  # no zero_grad(): backward() adds to what .grad holds
    scale_verdict, fresh_verdict = judge_gradients(piled, references)
    assert scale_verdict.status == "PASS"  # step 1 starts from empty gradients either way
    assert fresh_verdict.status == "FAIL" and "gradients pile up from step to step" in fresh_verdict.evidence


@pytest.mark.parametrize("times_tolerance, status", [(0.5, "PASS"), (2.0, "FAIL")])
def test_the_tolerance_is_the_bound_the_checker_derives(references, times_tolerance, status):
    """A difference in a direction no bug produces: within the derived bound it passes, past it it fails."""
    generator = torch.Generator().manual_seed(1)
    moved = []
    for step in references:
        direction = torch.randn(step.reference.shape, generator=generator)
        direction -= (direction @ step.reference) / (step.reference @ step.reference) * step.reference  # not a rescaling
        moved.append(step.reference + times_tolerance * step.tolerance * step.reference.norm() * direction / direction.norm())
    scale_verdict, fresh_verdict = judge_gradients(moved, references)
    assert scale_verdict.status == status, scale_verdict.line()
    if status == "FAIL":
        assert "step 1's gradient is not the gradient of the mean loss" in scale_verdict.evidence
    assert fresh_verdict.status == ("PASS" if status == "PASS" else "BLOCKED")


def test_the_tolerance_follows_the_cancellation_in_the_sums_it_bounds(references):
    """Derived, not fixed: about 2e-2 here, each step its own, from n = 2 x 128 samples x 64 positions + 2."""
    n = WORLD_SIZE * BATCH * 64 + WORLD_SIZE
    gamma = n * 2.0**-24 / (1 - n * 2.0**-24)
    for step in references:
        cancellation = step.tolerance / (2 * gamma)  # |sum of |terms||| / |sum of terms|
        assert 1 < cancellation < 100 and 5e-3 < step.tolerance < 5e-2, step.tolerance
    assert len({round(step.tolerance, 6) for step in references}) == STEPS


def test_the_absolute_sums_are_those_of_the_terms_each_gradient_adds_up(job):
    """AbsoluteTerms against the sums written out, term by term, on 3 samples."""
    model, (images, labels) = job["model"], lab4_check.digits().train.tensors
    images, labels = images[:3], labels[:3]
    model.zero_grad(set_to_none=True)
    with lab4_check.AbsoluteTerms(model) as absolute:
        F.cross_entropy(model(images), labels).backward()
    sums, positions = absolute.sums(), absolute.positions
    assert positions == 64 and sums.numel() == sum(p.numel() for p in model.parameters())
    assert torch.all(sums >= parameters_to_vector(p.grad for p in model.parameters()).abs() - 1e-7)
    # The first convolution's weight, written out: for every sample and output position, |grad out| x |input|.
    conv, (inputs, grad_output) = model.features[0], absolute.seen[model.features[0]]
    padded = F.pad(inputs, (1, 1, 1, 1)).abs()
    expected = torch.zeros_like(conv.weight)
    for o in range(conv.out_channels):
        for kh in range(3):
            for kw in range(3):
                window = padded[:, 0, kh : kh + 8, kw : kw + 8]
                expected[o, 0, kh, kw] = (grad_output[:, o].abs() * window).sum()
    torch.testing.assert_close(sums[: conv.weight.numel()], expected.reshape(-1))


def test_the_largest_relu_switch_of_the_hidden_layer_is_within_the_tolerance(job, references):
    """rounding_tolerance's claim: one switch in the classifier's hidden layer, whichever unit and sample, stays inside."""
    model, (images, labels) = job["model"], lab4_check.digits().train.tensors
    for step, ranks in zip(references, job["batches"]):
        batch = torch.tensor([index for rank in ranks for index in rank])
        with torch.no_grad():
            features = model.classifier[0](model.features(images[batch]))
            hidden = model.classifier[1](features).relu()
            error = (model.classifier[3](hidden).softmax(dim=1) - F.one_hot(labels[batch], 10)) / len(batch)
            through_unit = (error @ model.classifier[3].weight).abs()  # (samples, units): d loss / d unit's output
            # The switched sample's contribution to that unit's weights (its features) and bias.
            moved = through_unit * (features.pow(2).sum(dim=1, keepdim=True) + 1).sqrt()
        assert float(moved.max() / step.reference.norm()) < step.tolerance


# --- the checker itself, on the loss times the world size, under each CPU capability ----------------------


def capabilities_here() -> list[str]:
    """ATEN_CPU_CAPABILITY values torch can run here: default always, avx2 and avx512 where the CPU has them."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    found = ["default"]
    if re.search(r"\bavx2\b", flags):
        found.append("avx2")
    if re.search(r"\bavx512f\b", flags):
        found.append("avx512")
    return found


@pytest.mark.timeout(300)
@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_the_loss_times_the_world_size_fails_gradient_scale_only_under_each_cpu_capability(tmp_path, capability):
    if capability not in capabilities_here():
        pytest.skip(f"this CPU has no {capability.upper()} (ATEN_CPU_CAPABILITY={capability} would fall back)")
    if capability == torch.backends.cpu.get_cpu_capability().lower():
        # The same mutant at the CPU's own capability is a row of tests/test_checkers.py's shared launch
        # (each bug fails its own check only): one more launch here would only repeat it.
        pytest.skip(f"{capability.upper()} is this CPU's own: tests/test_checkers.py runs this mutant under it")
    source = SOLUTION.read_text()
    old, new = TIMES_WORLD_SIZE
    assert source.count(old) == 1
    script = tmp_path / "lab4_times_world_size.py"
    script.write_text(source.replace(old, new))
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}  # the checker's own process and the ranks alike
    done = subprocess.run([sys.executable, str(REPO_ROOT / "labs" / "lab4_check.py"), "--job-timeout-s", "120", str(script)],
                          capture_output=True, text=True, timeout=280, env=env, cwd=REPO_ROOT)  # fmt: skip
    lines = {int(m.group(1)): m for m in re.finditer(r"^(\d) (\S+) +(PASS|FAIL|BLOCKED) +(.*)$", done.stdout, flags=re.MULTILINE)}
    assert sorted(lines) == list(range(1, 8)), done.stdout + done.stderr
    assert lines[7].group(3) == "FAIL" and lines[7].group(4).startswith("step 1's gradient is 2.00 x the gradient"), done.stdout
    assert all(lines[number].group(3) == "PASS" for number in range(1, 7)), done.stdout
    assert done.returncode == 1


# --- the sheet's self-check (labs/lab4_broken_ddp.ipynb, Summary): where DETAIL stops an uneven job --------


def collectives_called(minimal, rank, monkeypatch):
    """The collectives lab4_minimal_hang.py's rank calls, in order, recorded instead of run (no group)."""
    calls = []
    monkeypatch.setattr(minimal.dist, "all_reduce", lambda tensor: calls.append("ALLREDUCE"))
    monkeypatch.setattr(minimal.dist, "barrier", lambda: calls.append("BARRIER"))
    minimal.run_uneven_steps(rank)
    return calls


def first_mismatch(rank_0_calls, rank_1_calls):
    """The position, from 0, of the first collective the two ranks do not call alike: where DETAIL stops."""
    return next(position for position, (a, b) in enumerate(zip(rank_0_calls, rank_1_calls)) if a != b)


def test_the_self_check_predicts_where_detail_stops_a_job_with_five_and_three_batches(monkeypatch):
    from ddp_course.lab_self_checks import LAB4_SELF_CHECK
    from ddp_course.launch import import_script
    from ddp_course.self_check import verdict

    notebook = REPO_ROOT / "labs" / "lab4_broken_ddp.ipynb"
    minimal = import_script(REPO_ROOT / "labs" / "lab4_minimal_hang.py")
    calls = [collectives_called(minimal, rank, monkeypatch) for rank in (0, 1)]
    assert calls[0].count("ALLREDUCE") == 3 and calls[1].count("ALLREDUCE") == 2
    # The model (the first position where the call sequences differ) reproduces the sheet's stored DETAIL run.
    position = first_mismatch(*calls)
    _, detail_output = stored_cell(notebook, "detail_mismatches(checked.stdout)")
    for rank in (0, 1):
        assert f"rank {rank} stopped at its collective #{position}: {calls[rank][position]}" in detail_output
    # The question's job: rank 0 runs 5 gradient all-reduces, rank 1 runs 3, then each its barrier.
    five_and_three = first_mismatch(["ALLREDUCE"] * 5 + ["BARRIER"], ["ALLREDUCE"] * 3 + ["BARRIER"])
    assert LAB4_SELF_CHECK.expected == five_and_three
    assert verdict(LAB4_SELF_CHECK, five_and_three).startswith("self-check: correct - ")
    for mistake in (5, 4, 2):  # rank 0's batch count; counted from 1; the stored run's position copied
        assert verdict(LAB4_SELF_CHECK, mistake) == f"self-check: not yet - {LAB4_SELF_CHECK.hint}"
