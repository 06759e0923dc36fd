"""Lecture 5's exercises and their solutions never drift apart, and the checks can tell them apart.

As for lecture 2 (tests/test_02_collectives_exercises.py, whose two notebook helpers this reuses):
each exercise cell of the lecture is the solution cell with the block between "# BEGIN SOLUTION"
and "# END SOLUTION" replaced by a placeholder; the check cells are the same in both notebooks;
the set-up cells the solutions copy are the lecture's. The cells then run in-process (no kernel, a
few seconds): each solution passes its check, the open exercise reports "not done yet", and each
check rejects plausible wrong answers - a check that cannot fail would prove nothing.
"""

import contextlib
import io
import math

import nbformat
import pytest
from test_02_collectives_exercises import cells_by_tag, without_solution

from ddp_course.launch import REPO_ROOT
from ddp_course.notebooks import run_source

LECTURE = REPO_ROOT / "lectures" / "05_scaling_performance.ipynb"
SOLUTIONS = REPO_ROOT / "solutions" / "05_scaling_performance_solutions.ipynb"
EXERCISES = (1, 2, 3)
CHECK_FUNCTIONS = {1: "check_predicted_step", 2: "check_largest_batch", 3: "check_powersgd_elements"}


@pytest.mark.timeout(30)
def test_exercises_are_the_solutions_with_the_marked_blocks_removed():
    lecture, solutions = cells_by_tag(LECTURE), cells_by_tag(SOLUTIONS)
    for number in EXERCISES:
        [solution], [exercise] = solutions[f"solution-{number}"], lecture[f"exercise-{number}"]
        assert solution.count("# BEGIN SOLUTION") == solution.count("# END SOLUTION") == 1, number
        assert exercise == without_solution(solution) != solution, number
        assert lecture[f"check-{number}"] == solutions[f"check-{number}"], number


@pytest.mark.timeout(30)
def test_solutions_copy_the_lecture_set_up_cells():
    lecture, solutions = cells_by_tag(LECTURE), cells_by_tag(SOLUTIONS)
    assert solutions["shared"] and solutions["shared"] == lecture["shared"]


@pytest.mark.timeout(30)
def test_stored_outputs_show_the_exercises_open_in_the_lecture_and_solved_in_the_solutions():
    def check_outputs(path):
        return ["".join(out.get("text", "") for out in cell.outputs) for cell in nbformat.read(path, as_version=4).cells
                if any(tag.startswith("check-") for tag in cell.get("metadata", {}).get("tags", []))]  # fmt: skip

    for path in (LECTURE, SOLUTIONS):  # nbval compares nothing in a cell stored without being run
        code_cells = [cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]
        assert all(cell.execution_count is not None for cell in code_cells), f"{path.name} is stored unexecuted"
    assert [text.startswith("not done yet") for text in check_outputs(LECTURE)] == [True] * 3
    assert [text.split(":")[0] for text in check_outputs(SOLUTIONS)] == [f"exercise {n}" for n in EXERCISES]
    assert all(": correct" in text for text in check_outputs(SOLUTIONS))


@pytest.fixture(scope="module")
def shared_namespace():
    """The solutions notebook's set-up cells, run once; each test copies the namespace."""
    namespace = {"__name__": "lecture05"}
    for source in cells_by_tag(SOLUTIONS)["shared"]:
        run_source(source, namespace)
    return namespace


def run_cells(namespace, *sources) -> tuple[dict, str]:
    namespace, printed = dict(namespace), io.StringIO()
    with contextlib.redirect_stdout(printed):
        for source in sources:
            exec(compile(source, "<notebook cell>", "exec"), namespace)
    return namespace, printed.getvalue()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("number", EXERCISES)
def test_each_solution_passes_its_check_and_the_open_exercise_does_not(shared_namespace, number):
    [check] = cells_by_tag(SOLUTIONS)[f"check-{number}"]
    [solution] = cells_by_tag(SOLUTIONS)[f"solution-{number}"]
    [exercise] = cells_by_tag(LECTURE)[f"exercise-{number}"]
    assert f"exercise {number}: correct" in run_cells(shared_namespace, solution, check)[1]
    assert run_cells(shared_namespace, exercise, check)[1].startswith("not done yet")


def wrong_answers(namespace) -> dict[int, dict]:
    """Plausible mistakes for each exercise."""

    def ring_without_n_factor(compute_s, gradient_bytes, world_size, link, buckets=1, overlap=1.0):  # 2 S beta, whatever N
        if world_size == 1:
            return compute_s
        ring_s = buckets * 2 * (world_size - 1) * link[0] + 2 * gradient_bytes / link[1]
        return compute_s + max(0.0, ring_s - overlap * 2 / 3 * compute_s)

    def latency_once(compute_s, gradient_bytes, world_size, link, buckets=1, overlap=1.0):  # buckets ignored
        if world_size == 1:
            return compute_s
        ring_s = 2 * (world_size - 1) * link[0] + 2 * (world_size - 1) / world_size * gradient_bytes / link[1]
        return compute_s + max(0.0, ring_s - overlap * 2 / 3 * compute_s)

    def overlap_can_go_negative(compute_s, gradient_bytes, world_size, link, buckets=1, overlap=1.0):  # no max(0, ...)
        if world_size == 1:
            return compute_s
        ring_s = buckets * 2 * (world_size - 1) * link[0] + 2 * (world_size - 1) / world_size * gradient_bytes / link[1]
        return compute_s + ring_s - overlap * 2 / 3 * compute_s

    def whole_step_hides(compute_s, gradient_bytes, world_size, link, buckets=1, overlap=1.0):  # all of compute, not backward
        if world_size == 1:
            return compute_s
        ring_s = buckets * 2 * (world_size - 1) * link[0] + 2 * (world_size - 1) / world_size * gradient_bytes / link[1]
        return compute_s + max(0.0, ring_s - overlap * compute_s)

    def forgets_buckets(memory, parameters, per_sample, optimizer="adam", bucket_view=False, zero1_ranks=1):
        state = {"sgd": 0, "momentum": 4, "adam": 8}[optimizer] * parameters / zero1_ranks
        return max(0, int((memory - 8 * parameters - state) // per_sample))

    def adam_is_one_moment(memory, parameters, per_sample, optimizer="adam", bucket_view=False, zero1_ranks=1):
        state = {"sgd": 0, "momentum": 4, "adam": 4}[optimizer] * parameters / zero1_ranks
        fixed = 8 * parameters + (0 if bucket_view else 4 * parameters) + state
        return max(0, int((memory - fixed) // per_sample))

    def zero1_shards_gradients_too(memory, parameters, per_sample, optimizer="adam", bucket_view=False, zero1_ranks=1):
        state = {"sgd": 0, "momentum": 4, "adam": 8}[optimizer] * parameters / zero1_ranks
        fixed = 4 * parameters + 4 * parameters / zero1_ranks + (0 if bucket_view else 4 * parameters) + state
        return max(0, int((memory - fixed) // per_sample))

    def rounds_up(memory, parameters, per_sample, optimizer="adam", bucket_view=False, zero1_ranks=1):
        state = {"sgd": 0, "momentum": 4, "adam": 8}[optimizer] * parameters / zero1_ranks
        fixed = 8 * parameters + (0 if bucket_view else 4 * parameters) + state
        return max(0, math.ceil((memory - fixed) / per_sample))

    def compresses_everything(shapes, rank, min_compression_rate=2.0):
        return sum((s[0] + math.prod(s[1:])) * min(s[0], math.prod(s[1:]), rank) for s in shapes)

    def counts_only_p(shapes, rank, min_compression_rate=2.0):
        total = 0
        for s in shapes:
            n, m = s[0], math.prod(s[1:])
            r = min(n, m, rank)
            total += n * r if (n + m) * r * min_compression_rate < n * m else n * m
        return total

    def convolutions_uncompressed(shapes, rank, min_compression_rate=2.0):  # only 2-D weights compressed
        total = 0
        for s in shapes:
            n, m = s[0], math.prod(s[1:])
            total += (n + m) * min(n, m, rank) if len(s) == 2 and (n + m) * min(n, m, rank) * min_compression_rate < n * m else n * m
        return total

    def second_dimension_only(shapes, rank, min_compression_rate=2.0):  # a conv weight read as n x in_channels
        total = 0
        for s in shapes:
            n, m = s[0], s[1] if len(s) > 1 else 1
            r = min(n, m, rank)
            total += (n + m) * r if (n + m) * r * min_compression_rate < n * m else n * m
        return total

    return {
        1: {"2 S beta": ring_without_n_factor, "latency once": latency_once, "negative exposure": overlap_can_go_negative,
            "the whole step hides": whole_step_hides},
        2: {"no bucket copy": forgets_buckets, "Adam = one moment": adam_is_one_moment,
            "ZeRO-1 shards gradients": zero1_shards_gradients_too, "rounds up": rounds_up},
        3: {"compresses everything": compresses_everything, "only P": counts_only_p,
            "convolutions uncompressed": convolutions_uncompressed, "m = shape[1]": second_dimension_only},
    }  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize("number", EXERCISES)
def test_each_check_rejects_wrong_answers(shared_namespace, number):
    [check] = cells_by_tag(SOLUTIONS)[f"check-{number}"]
    [exercise] = cells_by_tag(LECTURE)[f"exercise-{number}"]
    do_not_run_yet = "def run_check(check, solution):\n    pass"  # define the check, run it below on each answer
    namespace, _ = run_cells(shared_namespace, do_not_run_yet, exercise, check)
    for mistake, answer in wrong_answers(namespace)[number].items():
        with pytest.raises(AssertionError), contextlib.redirect_stdout(io.StringIO()):
            namespace[CHECK_FUNCTIONS[number]](answer)
        print(f"exercise {number}: the check rejects '{mistake}'")
