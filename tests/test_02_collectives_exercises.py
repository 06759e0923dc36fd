"""Lecture 2's exercises and their solutions never drift apart, and the checks can tell them apart.

solutions/02_collectives_solutions.ipynb is run by `pytest --nbval` (its checks print "correct").
That each exercise cell of the lecture is what `python -m ddp_course.authoring.exercises --notebooks` makes of
its solution cell, and that the check cells are the same in both notebooks, is tested with every
lecture's in tests/test_exercises_in_step.py. This test proves that the set-up cells the solutions
copy are the lecture's. It also runs the cells
in-process (no kernel, about a second): each solution passes its check, the unsolved exercise
reports "not done yet", and each check rejects typical wrong answers - a check that cannot fail
would prove nothing - with the lecture's own cost model.
"""

import contextlib
import io
import math

import nbformat
import pytest
import torch

from ddp_course import lecture02_checks
from ddp_course.launch import REPO_ROOT
from ddp_course.self_check import verdict

LECTURE = REPO_ROOT / "lectures" / "02_collectives.ipynb"
SOLUTIONS = REPO_ROOT / "solutions" / "02_collectives_solutions.ipynb"
EXERCISES = (1, 2, 3)


def cells_by_tag(path) -> dict[str, list[str]]:
    found = {}
    for cell in nbformat.read(path, as_version=4).cells:
        for tag in cell.get("metadata", {}).get("tags", []):
            found.setdefault(tag, []).append(cell.source)
    return found


@pytest.mark.timeout(30)
def test_stored_outputs_show_the_exercises_open_in_the_lecture_and_solved_in_the_solutions():
    def check_outputs(path):
        texts = []
        for cell in nbformat.read(path, as_version=4).cells:
            if "check" in "".join(cell.get("metadata", {}).get("tags", [])):
                texts.append("".join(out.get("text", "") for out in cell.outputs))
        return texts

    for path in (LECTURE, SOLUTIONS):  # nbval compares nothing in a cell stored without being run
        code_cells = [cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]
        assert all(cell.execution_count is not None for cell in code_cells), f"{path.name} is stored unexecuted"
    assert all(text.startswith("not done yet") for text in check_outputs(LECTURE))
    assert [text.split(":")[0] for text in check_outputs(SOLUTIONS)] == [f"exercise {n}" for n in EXERCISES]
    assert all(": correct" in text for text in check_outputs(SOLUTIONS))


def run_cells(*sources) -> tuple[dict, str]:
    """Execute cell sources in one fresh namespace, as a kernel would; return it and what they printed."""
    namespace, printed = {}, io.StringIO()
    with contextlib.redirect_stdout(printed):
        for source in sources:
            exec(compile(source, "<notebook cell>", "exec"), namespace)
    return namespace, printed.getvalue()


def shared_and_check(number) -> tuple[list[str], str]:
    solutions = cells_by_tag(SOLUTIONS)
    [check] = solutions[f"check-{number}"]
    return solutions["shared"], check


@pytest.mark.timeout(60)
@pytest.mark.parametrize("number", EXERCISES)
def test_each_solution_passes_its_check_and_the_open_exercise_does_not(number):
    shared, check = shared_and_check(number)
    [solution] = cells_by_tag(SOLUTIONS)[f"solution-{number}"]
    [exercise] = cells_by_tag(LECTURE)[f"exercise-{number}"]
    assert f"exercise {number}: correct" in run_cells(*shared, solution, check)[1]
    assert run_cells(*shared, exercise, check)[1].startswith("not done yet")


def wrong_answers(namespace) -> dict[int, dict]:
    """Plausible mistakes for each exercise, built from the notebook's own functions."""
    ring_seconds = namespace["ring_seconds"]

    def tree_with_ring_rounds(ranks):  # the right sums, but N-1 rounds each way
        return [torch.stack(ranks).sum(dim=0) for _ in ranks], 2 * (len(ranks) - 1)

    def tree_sharing_one_tensor(ranks):  # the right sums and rounds, but every rank holds the same tensor object
        return [torch.stack(ranks).sum(dim=0)] * len(ranks), 2 * math.ceil(math.log2(len(ranks)))

    def one_bucket(sizes, cap):  # ignores the cap
        return [list(range(len(sizes)))] if sizes else []

    def closes_early(sizes, cap):  # a new bucket for every tensor
        return [[index] for index in range(len(sizes))]

    def log_rounds_once(n_bytes, world_size, alpha, beta):  # forgets that the doubling mirrors the halving
        return 0.0 if world_size == 1 else math.log2(world_size) * alpha + 2 * (world_size - 1) / world_size * n_bytes / beta

    def whole_message_per_round(n_bytes, world_size, alpha, beta):  # the tree's bytes, not the halving's
        return 0.0 if world_size == 1 else 2 * math.log2(world_size) * (alpha + n_bytes / 2 / beta)

    def seconds_per_byte(n_bytes, world_size, alpha, beta):  # the right formula, with beta read as seconds per byte
        return 0.0 if world_size == 1 else 2 * (math.log2(world_size) * alpha + (world_size - 1) / world_size * n_bytes * beta)

    return {
        1: {"N-1 rounds": tree_with_ring_rounds, "shared tensor": tree_sharing_one_tensor},
        2: {"one bucket": one_bucket, "one tensor per bucket": closes_early},
        3: {
            "the ring's cost": ring_seconds,
            "log N latencies once": log_rounds_once,
            "half the message every round": whole_message_per_round,
            "beta as seconds per byte": seconds_per_byte,
        },
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize("number", EXERCISES)
def test_each_check_rejects_wrong_answers(number):
    shared, _ = shared_and_check(number)
    namespace, _ = run_cells(*shared)
    check = getattr(lecture02_checks, f"check_exercise_{number}")
    for mistake, answer in wrong_answers(namespace)[number].items():
        with pytest.raises(AssertionError), contextlib.redirect_stdout(io.StringIO()):
            check(answer)
        print(f"exercise {number}: the check rejects '{mistake}'")


@pytest.mark.timeout(30)
def test_the_checks_price_answers_with_the_lectures_own_cost_model():
    shared, _ = shared_and_check(1)
    namespace, _ = run_cells(*shared)
    assert (lecture02_checks.ALPHA, lecture02_checks.BETA) == (namespace["ALPHA"], namespace["BETA"])
    for name in ("ring_seconds", "tree_seconds"):
        for n_bytes, world_size in [(1e3, 1), (1e6, 2), (25e6, 8), (1e9, 1024)]:
            ours = getattr(lecture02_checks, name)(n_bytes, world_size, 5e-6, 25e9)
            assert ours == namespace[name](n_bytes, world_size, 5e-6, 25e9), (name, n_bytes, world_size)


@pytest.mark.timeout(30)
def test_beta_is_a_bandwidth_in_bytes_per_second():
    """README notation: beta is bytes/s, so a faster link (larger beta) gives a shorter time, and S bytes
    over one link of beta bytes/s between 2 ranks (one ring step each way) take alpha + S/beta each."""
    shared, _ = shared_and_check(1)
    namespace, _ = run_cells(*shared)
    assert namespace["BETA"] == lecture02_checks.BETA == 25e9
    for name in ("ring_seconds", "tree_seconds", "naive_seconds"):
        seconds = namespace[name]
        assert seconds(1e6, 8, 0.0, 50e9) == pytest.approx(seconds(1e6, 8, 0.0, 25e9) / 2), name
    assert namespace["ring_seconds"](1e6, 2, 1e-6, 25e9) == pytest.approx(2 * (1e-6 + 1e6 / 2 / 25e9))


@pytest.mark.timeout(30)
def test_the_self_check_is_the_latency_one_bucket_saves_by_the_lectures_ring():
    """The expected saving from the lecture's own ring (its trace gives the steps and each step's chunk)
    and its own link (the shared cell's ALPHA and BETA), not from the formula the Question states."""
    lecture = nbformat.read(LECTURE, as_version=4).cells
    [ring_cell] = [cell.source for cell in lecture if cell.source.startswith("def ring_reduce_scatter(")]
    shared = [cell.source for cell in lecture if "shared" in cell.metadata.get("tags", [])]
    namespace, _ = run_cells(*shared, ring_cell)
    world_size, gradients, gradient_bytes = 8, 100, 40e3
    trace = []
    namespace["ring_all_reduce"]([torch.zeros(world_size)] * world_size, trace=trace)
    steps = len(trace) - 1  # the first entry is the starting state
    assert all(sizes == [1] * world_size for sizes in (step["sizes"] for step in trace[1:]))  # one N-th each step

    def ring_microseconds(n_bytes):  # every step: one message of an N-th of the data over every link at once
        return 1e6 * steps * (namespace["ALPHA"] + n_bytes / world_size / namespace["BETA"])

    saved = gradients * ring_microseconds(gradient_bytes) - ring_microseconds(gradients * gradient_bytes)
    question = lecture02_checks.SELF_CHECK
    assert question.expected == pytest.approx(saved)
    assert verdict(question, saved).startswith("self-check: correct - ")
    latency = 1e6 * namespace["ALPHA"]
    forgot_the_buckets_own_latency = gradients * steps * latency  # 7000
    one_latency_per_all_reduce = (gradients - 1) * latency  # 495: alpha once, not once per ring step
    one_phase_only = (gradients - 1) * (world_size - 1) * latency  # 3465: the reduce-scatter's steps only
    for wrong in (forgot_the_buckets_own_latency, one_latency_per_all_reduce, one_phase_only):
        assert verdict(question, wrong) == f"self-check: not yet - {question.hint}", wrong
    [(source, outputs)] = [(c.source, c.outputs) for c in lecture if c.cell_type == "code" and "self_check(SELF_CHECK, answer)" in c.source]
    assert "from ddp_course.lecture02_checks import SELF_CHECK" in source and "answer = None" in source
    assert "".join(out.get("text", "") for out in outputs).strip() == verdict(question, None)
