"""Lecture 7 (sharded data parallelism): its exercise checks can fail, and what nbval's outputs do not prove.

- The solutions pass their checks; the lecture's stubs say "not solved yet"; plausible wrong answers
  (forgetting a stage's shards, all-reducing instead of reduce-scattering, the GatherRows backward the
  lecture shows) get "not yet". So a check that cannot fail turns a test red.
- The lecture's exercise cells are the solutions' with the marked blocks removed, the check cells are
  identical, and the shared set-up cells are copies (tests/test_exercises_in_step.py does this for the
  other lectures; its LECTURES list does not hold lecture 7 yet).
- The check's stored measurements (MEASURED_FSDP_WIRE_BYTES) are what the lecture's job reported, and
  the ring-cost prediction the lecture quotes is ddp_course.sharding's.
- The demo script refuses a single rank with one line, not a traceback.
- The self-check's answer is the stage the lecture's own byte counts choose; classic mistakes get the hint.
- The overlap story says what a gloo trace can show (review finding 2): the order of issue, with every
  gloo collective inside the FSDP span that issued it; the claims it replaced are gone everywhere.
"""

import math
import re

import nbformat
import pytest
import torch

from ddp_course import lecture07_checks as checks
from ddp_course.launch import REPO_ROOT, run_torchrun
from ddp_course.authoring.notebooks import cells_titled, run_source
from ddp_course.sharding import predicted_bytes_per_step

NAME = "07_sharded_data_parallelism"
LECTURE = REPO_ROOT / "lectures" / f"{NAME}.ipynb"
SOLUTIONS_PATH = f"solutions/{NAME}_solutions.ipynb"
SOLUTIONS = REPO_ROOT / SOLUTIONS_PATH
SCRIPT = REPO_ROOT / "lectures" / "scripts" / "sharding_demos.py"
FUNCTIONS = {1: "per_rank_bytes", 2: "fsdp_wire_bytes", 3: "shard_gradient"}


def verdict(check, answer) -> str:
    """The last line a check printed for this answer."""
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        check(answer)
    return printed.getvalue().strip().splitlines()[-1]


@pytest.fixture(scope="module")
def solved():
    """The solutions' namespace: their set-up and exercise cells run in one namespace (a second or two)."""
    namespace = {"__name__": "solutions07"}
    for cell in nbformat.read(SOLUTIONS, as_version=4).cells:
        if cell.cell_type == "code" and not cell.source.startswith("# Check exercise"):
            run_source(cell.source, namespace)
    return namespace


# --- the checks accept the solutions and reject the stubs and wrong answers ----------------------


@pytest.mark.timeout(60)
def test_the_solutions_pass_their_checks(solved):
    for number, name in FUNCTIONS.items():
        assert verdict(getattr(checks, f"check_exercise_{number}"), solved[name]) == f"exercise {number}: correct"


@pytest.mark.timeout(60)
def test_the_lecture_stubs_say_not_solved_yet(solved):
    namespace = dict(solved)
    for title, (stub, _) in cells_titled(LECTURE, "# Exercise ").items():
        number = int(re.match(r"# Exercise (\d+):", title).group(1))
        run_source(stub, namespace)
        name = FUNCTIONS[number]
        assert verdict(getattr(checks, f"check_exercise_{number}"), namespace[name]) == (f"exercise {number}: not solved yet - fill in {name} above")


def stage_bytes(shard_parameters=True, shard_gradients=True, optimizer_bytes=8, ddp_shards_optimizer=False):
    """per_rank_bytes with one mistake switched off/on."""

    def per_rank_bytes(count, world, stage):
        level = {"ddp": 1 if ddp_shards_optimizer else 0, "zero1": 1, "zero2": 2, "zero3": 3}[stage]
        return {
            "parameters": 4 * count / (world if level >= 3 and shard_parameters else 1),
            "gradients": 4 * count / (world if level >= 2 and shard_gradients else 1),
            "optimizer_state": optimizer_bytes * count / (world if level >= 1 else 1),
        }

    return per_rank_bytes


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "wrong",
    [
        stage_bytes(shard_parameters=False),  # ZeRO-3 that keeps full parameters
        stage_bytes(shard_gradients=False),  # ZeRO-2 that keeps full gradients
        stage_bytes(optimizer_bytes=4),  # Adam with one moment
        stage_bytes(ddp_shards_optimizer=True),  # DDP counted as ZeRO-1
        lambda count, world, stage: {"parameters": 4 * count, "gradients": 4 * count},  # a term missing
    ],
)
def test_check_1_rejects_wrong_bytes(wrong):
    assert stage_bytes()(39_312, 4, "zero3")["parameters"] == 39_312  # the right one, for contrast
    assert verdict(checks.check_exercise_1, stage_bytes()) == "exercise 1: correct"
    assert verdict(checks.check_exercise_1, wrong).startswith("exercise 1: not yet")


def wire(all_gathers_when_resharded=2, reduce_factor=1, one_way=lambda n: (n - 1) / n, dtype_aware=True):
    def fsdp_wire_bytes(parameter_bytes, world, reshard_after_forward=True, param_dtype_bytes=4):
        gathered = parameter_bytes * (param_dtype_bytes / 4 if dtype_aware else 1)
        gathers = all_gathers_when_resharded if reshard_after_forward else 1
        return one_way(world) * (gathers * gathered + reduce_factor * parameter_bytes)

    return fsdp_wire_bytes


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "wrong",
    [
        wire(all_gathers_when_resharded=1),  # forgets the all-gather before backward
        wire(reduce_factor=2),  # all-reduces the gradients instead of reduce-scattering
        wire(one_way=lambda n: 1.0),  # sends every byte, not (N-1)/N of it
        wire(dtype_aware=False),  # the bf16 all-gather counted in float32
        lambda s, n, reshard=True, dtype=4: 3 * (n - 1) / n * s,  # ignores both options
    ],
)
def test_check_2_rejects_wrong_wire_bytes(wrong):
    assert verdict(checks.check_exercise_2, wire()) == "exercise 2: correct"
    assert verdict(checks.check_exercise_2, wrong).startswith("exercise 2: not yet")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "wrong",
    [
        lambda grads, rank: grads[rank].chunk(len(grads))[rank],  # the lecture's GatherRows backward
        lambda grads, rank: sum(grads).chunk(len(grads))[rank],  # a sum: N times too large
        lambda grads, rank: (sum(grads) / len(grads)).chunk(len(grads))[len(grads) - 1 - rank],  # wrong rows
        lambda grads, rank: sum(grads) / len(grads),  # the full gradient, not the shard
    ],
)
def test_check_3_rejects_wrong_backward(wrong):
    assert verdict(checks.check_exercise_3, wrong).startswith("exercise 3: not yet")


# --- the notebooks stay in step ------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_check_cells_are_identical_and_stored_verdicts_are_honest():
    solution_checks, lecture_checks = cells_titled(SOLUTIONS, "# Check exercise "), cells_titled(LECTURE, "# Check exercise ")
    assert solution_checks.keys() == lecture_checks.keys() and len(solution_checks) == 3
    for title, (source, stdout) in solution_checks.items():
        number = re.match(r"# Check exercise (\d+)", title).group(1)
        assert source == lecture_checks[title][0], title
        assert stdout.strip().splitlines()[-1] == f"exercise {number}: correct", title
        assert lecture_checks[title][1].strip().splitlines()[-1].startswith(f"exercise {number}: not solved yet"), title


@pytest.mark.timeout(30)
def test_first_and_last_lines_and_word_budget():
    cells = nbformat.read(LECTURE, as_version=4).cells
    markdown = [cell.source for cell in cells if cell.cell_type == "markdown"]
    title, _, before = markdown[0].splitlines()[:3]  # the title, then the route's line, as in every notebook
    assert title.startswith("# Lecture 7") and before.startswith("**Before:** lab 7 (fault tolerance)")  # tests/test_route.py
    assert markdown[-1].splitlines()[-1].startswith("**Next:** lab 8 (sharded data parallelism")
    assert sum(len(text.split()) for text in markdown) <= 4500


# --- numbers the check and the text quote --------------------------------------------------------


@pytest.mark.timeout(30)
def test_the_checks_stored_measurements_are_the_jobs():
    """MEASURED_FSDP_WIRE_BYTES must be what the lecture's (nbval-compared) job reported: read from the
    lecture's stored output of the bytes table and the mixed-precision cell."""
    outputs = "".join("".join(out.get("text", "")) for cell in nbformat.read(LECTURE, as_version=4).cells if cell.cell_type == "code" for out in cell.outputs)
    for n, expected in ((2, checks.MEASURED_FSDP_WIRE_BYTES[(2, True, 4)]), (4, checks.MEASURED_FSDP_WIRE_BYTES[(4, True, 4)])):
        assert re.search(rf"N={n} ZeRO-3 \(fully_shard\)\s+all_gather 2S, reduce_scatter 1S\s+ring model\s+{expected:,} B", outputs)
    assert "bf16 params, fp32 reduce   all_gather 1.0S, reduce_scatter 1.0S: ring model 2.0 x (N-1)/N S" in outputs
    assert "keep             all-gathers: 4 in forward, 0 in backward" in outputs
    assert checks.DEMO_PARAMETER_BYTES == 4 * 39_312
    # the counted values are the ring-cost formulas, as the lecture says
    for (n, reshard, dtype_bytes), measured in checks.MEASURED_FSDP_WIRE_BYTES.items():
        assert math.isclose(checks.reference_fsdp_wire_bytes(checks.DEMO_PARAMETER_BYTES, n, reshard, dtype_bytes), measured)
    assert math.isclose(predicted_bytes_per_step("fsdp", 1.0, 0.0, 4) / predicted_bytes_per_step("ddp", 1.0, 0.0, 4), 1.5)


@pytest.mark.timeout(30)
def test_gather_rows_is_wrong_and_the_reduce_scatter_is_right():
    """Exercise 3's premise: the slice-only backward differs from one process; the averaged one does not."""
    shards, one_process = checks.simulated_shard_gradients(lambda grads, rank: grads[rank].chunk(len(grads))[rank])
    assert (torch.cat(shards) - one_process).abs().max() > 1e-3
    shards, one_process = checks.simulated_shard_gradients(lambda grads, rank: (sum(grads) / len(grads)).chunk(len(grads))[rank])
    assert torch.allclose(torch.cat(shards), one_process, atol=1e-12)


@pytest.mark.timeout(120)
def test_the_demo_script_refuses_one_rank_with_one_line(tmp_path):
    result = run_torchrun(SCRIPT, ["--json", tmp_path / "r.json", "--checkpoint-dir", tmp_path / "c"], nproc=1, timeout_s=100)
    assert result.returncode not in (0, None), result.describe()
    assert "sharding_demos.py: error: run it under torchrun on 2 or more ranks" in result.stderr
    # torchrun's own failure report follows (the agent's traceback); the script itself raised nothing
    assert 'sharding_demos.py", line' not in result.stderr, result.describe()
    assert result.stderr.count("sharding_demos.py: error:") == 1, result.describe()
    assert not (tmp_path / "r.json").exists()


@pytest.mark.timeout(30)
def test_the_overlap_story_says_what_a_gloo_trace_can_show():
    """Review finding 2: FSDP2 issues its collectives with async_op=False and CPU streams do nothing, so on
    gloo each collective blocks the main thread; the lecture's trace shows the order of issue, and the job
    measures that each gloo collective ran inside the FSDP span that issued it (the stored, compared
    output). The claims that taught overlap from that trace are gone from every text that made them."""
    cells = nbformat.read(LECTURE, as_version=4).cells
    outputs = "".join("".join(out.get("text", "")) for cell in cells if cell.cell_type == "code" for out in cell.outputs)
    assert re.search(
        r"reshard: 8 all-gathers and 4 reduce-scatters issued; gloo ran 12 collectives, "
        r"each entirely inside the FSDP span that issued it: True",
        outputs,
    )
    markdown = " ".join(" ".join(cell.source.split()) for cell in cells if cell.cell_type == "markdown")
    assert "`async_op=False`" in markdown and "On CPU with gloo nothing overlaps" in markdown
    texts = {
        "lecture 7": markdown,
        "lab 8 sheet": " ".join(" ".join(c.source.split()) for c in nbformat.read(REPO_ROOT / "labs" / "lab8_fsdp.ipynb", as_version=4).cells),
        "lab 8 answers": " ".join((REPO_ROOT / "solutions" / "lab8_fsdp_answers.md").read_text().split()),
        "minifsdp": " ".join((REPO_ROOT / "solutions" / "minifsdp.py").read_text().split()),
    }
    for wrong in (
        "forward prefetch is explicit",
        "here gloo runs them on its own threads",
        "reduce-scatter overlaps unit 4's backward",
        "is what makes this FSDP as fast as torch's (lab 8",
        "although `fully_shard` prefetches",
    ):
        assert not [name for name, text in texts.items() if wrong in text], wrong
    assert "on CPU its prefetch hides nothing" in texts["lab 8 answers"] and "this FSDP would lose there" in texts["minifsdp"]


@pytest.mark.timeout(30)
def test_the_lecture_measures_what_gloo_writes_beside_the_ring_model():
    """Section 2's lesson ("ZeRO-2 sends DDP's bytes") is the ring model, true for NCCL; the job also measured
    what each process wrote on gloo (nbval re-checks these stored lines against a fresh job): ZeRO-2 1.5x
    DDP's, ZeRO-3 2x, as gloo's reduce-scatter is an all-reduce of the whole input."""
    outputs = "".join("".join(out.get("text", "")) for cell in nbformat.read(LECTURE, as_version=4).cells if cell.cell_type == "code" for out in cell.outputs)
    for n in (2, 4):
        assert re.search(rf"N={n} ZeRO-2 .* ring model .* = 1\.00 x DDP .*; gloo wrote 1\.5 x DDP's", outputs)
        assert re.search(rf"N={n} ZeRO-3 \(fully_shard\) .* = 1\.50 x DDP .*; gloo wrote 2\.0 x DDP's", outputs)
        assert re.search(rf"N={n} DDP .*; gloo wrote 1\.0 x DDP's", outputs)


# --- the self-check at the end of the Summary (ddp_course/self_check.py) -------------------------------


@pytest.mark.timeout(30)
def test_the_self_check_picks_the_stage_that_fits_and_sends_least():
    from ddp_course.self_check import verdict
    from ddp_course.sharding import STAGES, predicted_state_bytes

    def choice(parameters=7e9, ranks=8, room=40e9, state=predicted_state_bytes):
        """Of the stages whose model state fits in `room` bytes per rank, the one that sends the fewest
        bytes (ties: the lower stage, which shards less); its number, 0 for DDP."""
        weights = 4 * parameters
        fits = [stage for stage in STAGES if state(stage, weights, 0.0, ranks) <= room]
        return STAGES.index(min(fits, key=lambda stage: (predicted_bytes_per_step(stage, weights, 0.0, ranks), STAGES.index(stage))))

    right = choice()
    assert right == checks.SELF_CHECK.expected
    assert verdict(checks.SELF_CHECK, right).startswith("self-check: correct")

    def ddp_divided_by_n(stage, sharded, replicated, ranks):  # as if DDP's replicas were shards
        return predicted_state_bytes(stage, sharded, replicated, ranks) / (ranks if stage == "ddp" else 1)

    least_memory = min(STAGES, key=lambda stage: predicted_state_bytes(stage, 4 * 7e9, 0.0, 8))
    mistakes = {
        "the least memory, whatever it sends": STAGES.index(least_memory),
        "the first stage that shards": 1,
        "DDP's state divided by N": choice(state=ddp_divided_by_n),
    }
    for mistake, answer in mistakes.items():
        assert answer != right, mistake
        assert verdict(checks.SELF_CHECK, answer) == f"self-check: not yet - {checks.SELF_CHECK.hint}", mistake
    assert "section 1" in checks.SELF_CHECK.hint and "section 7" in checks.SELF_CHECK.hint
    cells = cells_titled(LECTURE, "from ddp_course.lecture07_checks import SELF_CHECK")
    assert len(cells) == 1
    source, stdout = next(iter(cells.values()))
    assert "answer = None" in source and "self_check(SELF_CHECK, answer)" in source
    assert stdout.strip() == verdict(checks.SELF_CHECK, None)
