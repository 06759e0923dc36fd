"""Lecture 7's from-scratch FSDP (solutions/minifsdp.py) and its exercise (labs/minifsdp.py).

Two torchrun launches are shared by the tests below: tests/scripts/minifsdp_check.py's cases on 2 and on
4 gloo ranks, each run by tests/scripts/sharding_checks.py in the same job as lab 6's minddp checks
(conftest.py's `sharding_checks`: one launch per world size serves this module and tests/test_minddp.py). The script runs every case and prints one "PASS name (world_size N): details" or
"FAIL ..." line per case; each test asserts on one case's lines. Most of a launch's time is importing torch
and, at the first optimizer.step(), torch._dynamo, in every rank (the cases themselves take about 4 s).
The in-process tests check the row split, and that the exercise is the solution with its marked regions
replaced by TODOs that raise.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys

import pytest
import torch

from ddp_course.authoring.exercises import exercise_header, find_regions, make_exercise
from ddp_course.launch import REPO_ROOT, import_script

SOLUTION = REPO_ROOT / "solutions" / "minifsdp.py"
EXERCISE = REPO_ROOT / "labs" / "minifsdp.py"
minifsdp = import_script(SOLUTION, "minifsdp")
LINE = re.compile(r"^(?P<verdict>PASS|FAIL) (?P<case>\w+) \(world_size (?P<world_size>\d+)\): (?P<details>.*)$")
CASES = [
    "sgd_matches_single",
    "adamw_matches_single",
    "gradients_local_float32_and_replicated_equal",
    "tied_weight_gathered_once",
    "full_weights_only_around_use",
    "block_units_gather_only_around_use",
    "float16_matches_float16_reference",
    "negative_sum_not_average",
    "negative_no_regather",
    "optimizer_state_is_the_slices",
    "exercise_refuses_part_by_part",
]


def verdicts_of(result, nproc: int) -> dict:
    """{case: (verdict, details)} from the lines one launch on nproc ranks printed."""
    assert not result.timed_out and result.returncode in (0, 1), result.describe()  # 1: some case failed
    verdicts = {}
    for line in result.stdout.splitlines():
        match = LINE.match(line)
        if match:
            assert int(match["world_size"]) == nproc, line
            verdicts[match["case"]] = (match["verdict"], match["details"])
    assert list(verdicts) == CASES, result.describe()
    assert f"done: {sum(v == 'PASS' for v, _ in verdicts.values())} passed" in result.stdout, result.describe()
    return verdicts


@pytest.fixture(scope="module")
def runs(sharding_checks):
    """runs(nproc) -> {case: (verdict, details)}, from the launch this module shares with tests/test_minddp.py."""
    return lambda nproc: verdicts_of(sharding_checks(nproc)[0], nproc)


def verdict(runs, nproc: int, case: str) -> tuple[str, str]:
    return runs(nproc)[case]


@pytest.mark.timeout(480)
@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_case_passes(runs, nproc, case):
    """Every case on 2 and 4 ranks. What each checks is in its docstring in tests/scripts/minifsdp_check.py:
    SGD and AdamW (3 steps) equal one process on the global batch within the derived float32 bound; the
    tied embedding gathered once in backward and reduce-scattered once; float16 compute equal to a
    one-process float16 reference within 1e-4 (and the float32 run outside it); both negative controls
    fail the same comparison; optimizer state holds the slices only; the exercise stops at part 1, 2, 3."""
    result, details = verdict(runs, nproc, case)
    assert result == "PASS", f"{case} on {nproc} ranks: {details}"


@pytest.mark.timeout(480)
@pytest.mark.parametrize("nproc", [2, 4])
def test_optimizer_state_falls_with_the_ranks(runs, nproc):
    """The moments' ratio to an unsharded AdamW: 1/N plus the padding rows and the replicated vectors."""
    _, details = verdict(runs, nproc, "optimizer_state_is_the_slices")
    ratio = float(re.search(r"ratio (\d\.\d+)", details)[1])
    assert 1 / nproc < ratio < 1 / nproc + 0.1, details


# --- the row split (no processes needed) ---------------------------------------------------------------


def test_rows_are_split_evenly_with_zero_padding_at_the_end():
    full = torch.arange(13 * 2, dtype=torch.float32).view(13, 2)
    slices = [minifsdp.shard_rows(full, rank, 4) for rank in range(4)]
    assert minifsdp.rows_per_rank(13, 4) == 4 and all(s.shape == (4, 2) for s in slices)
    assert torch.equal(torch.cat(slices)[:13], full)  # the slices, in rank order, are the matrix
    assert torch.equal(torch.cat(slices)[13:], torch.zeros(3, 2))  # then three padding rows
    assert minifsdp.rows_per_rank(3, 4) == 1 and minifsdp.shard_rows(full[:3], 3, 4).abs().sum() == 0  # all padding
    assert minifsdp.shard_rows(full.double(), 0, 2).dtype == torch.float32  # master weights are float32


# --- the exercise -------------------------------------------------------------------------------------


def test_committed_exercise_is_generated_from_the_solution():
    header = exercise_header("solutions/minifsdp.py", "labs/minifsdp.py")
    assert EXERCISE.read_text() == make_exercise(SOLUTION.read_text(), header), (
        "labs/minifsdp.py differs from what solutions/minifsdp.py generates: python -m ddp_course.authoring.exercises solutions/minifsdp.py labs/minifsdp.py"
    )
    command = [sys.executable, "-m", "ddp_course.authoring.exercises", SOLUTION, EXERCISE, "--check"]
    assert subprocess.run(command, capture_output=True, cwd=REPO_ROOT).returncode == 0


def definitions(path):
    """{qualified name: (signature dump, docstring)} of every class and function."""
    found = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef)):
                name = prefix + child.name
                is_function = isinstance(child, ast.FunctionDef)
                signature = ast.dump(child.args) if is_function else ast.dump(ast.List(child.bases))
                found[name] = (signature, ast.get_docstring(child))
                visit(child, name + ".")

    visit(ast.parse(path.read_text()), "")
    return found


def test_exercise_has_the_solutions_interface_and_docstrings():
    solution, exercise = definitions(SOLUTION), definitions(EXERCISE)
    assert exercise == solution
    for name in ("FSDP", "FSDP.finish_gradient_synchronization", "FSDP.gather_full_params", "ShardedParameter"):
        assert solution[name][1], f"{name} lacks a docstring"


def todo_raises(path):
    """Messages of every `raise NotImplementedError("TODO...")` in a file, in file order."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        call = node.exc if isinstance(node, ast.Raise) else None
        if isinstance(call, ast.Call) and getattr(call.func, "id", "") == "NotImplementedError" and call.args:
            found.append((node.lineno, call.args[0].value))
    return [message for _, message in sorted(found)]


def test_every_todo_of_the_exercise_raises_its_hint():
    regions = find_regions(SOLUTION.read_text().split("\n"))
    assert todo_raises(EXERCISE) == [region.message for region in regions]
    assert sorted({region.part for region in regions}) == [1, 2, 3]
    assert all(region.message.startswith(f"TODO(lab 8, part {region.part}): ") for region in regions)
    assert todo_raises(SOLUTION) == []
    exercise = EXERCISE.read_text()
    assert "# END SOLUTION" not in exercise and "reduce_scatter_single(mine" not in exercise


def test_the_todos_state_contracts_with_one_design_question_per_part():
    """Issue 31 / review finding 7: each TODO says what must hold ("afterwards ...", "return ...", "from now
    on ..."), one per part asks a design question, and the mechanisms stay open: the exercise names neither
    the hook that tells when a gradient is complete nor the one that triggers the gather before backward.
    The recipes are in solutions/lab8_hints.md, one tier per part: a nudge, then "Stuck?"."""
    regions = find_regions(SOLUTION.read_text().split("\n"))
    for part in (1, 2, 3):
        asked = [region for region in regions if region.part == part and "Design question:" in region.message]
        assert len(asked) == 1, (part, [region.message for region in asked])
    for region in regions:
        contract = region.message.split(": ", 1)[1]
        assert contract.startswith(("afterwards", "return", "from now on", "full[name] =")), region.message
    exercise = EXERCISE.read_text()
    for mechanism in ("register_post_accumulate_grad_hook", "register_hook", "resize_(handle.full_bytes)", "owner.__dict__[name] ="):
        assert mechanism not in exercise, mechanism
    hints = (REPO_ROOT / "solutions" / "lab8_hints.md").read_text()
    for part in (1, 2, 3):
        section = hints.split(f"## Part {part}:")[1].split("## Part")[0]
        assert "**Goal.**" in section and "**Nudge" in section and section.index("**Nudge") < section.index("**Stuck?**"), part
    assert "--part 1" in hints and "labs/lab8_fsdp.py --part" in EXERCISE.read_text()
