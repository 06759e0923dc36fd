"""Lecture 1's exercise checks (and the optional notebook's) accept the solutions and reject plausible wrong answers.

The checks live in ddp_course/lecture01_checks.py, so a notebook's check cell is one call such as
`check_exercise_1(accumulate_step)`. Here each check is called with the solution (taken from the
solutions notebook), with the lecture's untouched stub, and with wrong answers a learner might
write: "correct", "not solved yet" and "not yet" respectively. A check that cannot fail, or a
solution that stops passing, turns a test red. The optional notebook's exercise, its solution and
their shared cells are kept in step here (tests/test_exercises_in_step.py does it for lecture 1).
"""

import contextlib
import io
import threading

import nbformat
import pytest
import torch
import torch.nn.functional as F

from ddp_course import lecture01_checks as checks
from ddp_course.launch import REPO_ROOT, import_script
from ddp_course.self_check import verdict as self_check_verdict
from ddp_course.authoring.notebooks import cells_titled

LECTURE = REPO_ROOT / "lectures" / "01_data_parallelism.ipynb"
SOLUTIONS = REPO_ROOT / "solutions" / "01_data_parallelism_solutions.ipynb"
OPTIONAL = REPO_ROOT / "lectures" / "optional_beyond_data_parallelism.ipynb"
OPTIONAL_SOLUTIONS_PATH = "solutions/optional_beyond_data_parallelism_solutions.ipynb"
OPTIONAL_SOLUTIONS = REPO_ROOT / OPTIONAL_SOLUTIONS_PATH


def printed_by(function, *args) -> str:
    """What a check printed; its verdict is the last line."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        function(*args)
    return out.getvalue()


def verdict(function, *args) -> str:
    return printed_by(function, *args).strip().splitlines()[-1]


def exercise_function(path, number, name):
    """Run the notebook's "# Exercise N: ..." cell in a namespace with the names it may use; return `name`."""
    [source] = [source for title, (source, _) in cells_titled(path, "# Exercise ").items() if title.startswith(f"# Exercise {number}:")]
    namespace = {"torch": torch, "F": F}
    exec(compile(source, str(path), "exec"), namespace)
    return namespace[name]


def cells_tagged(path, tag) -> list[str]:
    return [cell.source for cell in nbformat.read(path, as_version=4).cells if tag in cell.metadata.get("tags", [])]


@pytest.mark.timeout(60)
def test_the_solutions_pass_their_checks():
    printed = printed_by(checks.check_exercise_1, exercise_function(SOLUTIONS, 1, "accumulate_step"))
    assert printed.strip().splitlines() == ["real tokens per micro-batch: rank 0: 15 + 4, rank 1: 6 + 2", "exercise 1: correct"]
    printed = printed_by(checks.check_tensor_parallel_backward, exercise_function(OPTIONAL_SOLUTIONS, 1, "rank_backward"))
    assert "all-reduces in the backward pass: 1, of shapes [(3, 8)]" in printed
    assert printed.strip().endswith("exercise 1: correct")


@pytest.mark.timeout(60)
def test_the_stubs_say_not_solved_yet():
    assert verdict(checks.check_exercise_1, exercise_function(LECTURE, 1, "accumulate_step")) == ("exercise 1: not solved yet - fill in accumulate_step above")
    assert verdict(checks.check_tensor_parallel_backward, exercise_function(OPTIONAL, 1, "rank_backward")) == (
        "exercise 1: not solved yet - fill in rank_backward above"
    )


def masked_sum(model, inputs, targets, mask):
    return (F.cross_entropy(model(inputs).transpose(1, 2), targets, reduction="none") * mask).sum()


def global_token_count(micro_batches, all_reduce):
    return all_reduce(sum(mask.sum() for *_, mask in micro_batches))


@pytest.mark.timeout(60)
def test_exercise_1_rejects_the_classic_mistakes_and_says_which_concept(monkeypatch):
    """Each wrong answer a learner might write gets "not yet" with the concept it misses."""
    monkeypatch.setattr(checks, "EXERCISE_1_WAIT_S", 2.0)  # only all_reduce_on_rank_0_only waits it out; the others meet in ms

    def mean_per_rank(model, micro_batches, world_size, all_reduce):
        model.zero_grad()
        tokens = sum(mask.sum() for *_, mask in micro_batches)  # this rank's count: ranks weigh the same
        for batch in micro_batches:
            (masked_sum(model, *batch) / tokens).backward()

    def mean_over_k(model, micro_batches, world_size, all_reduce):
        model.zero_grad()
        for inputs, targets, mask in micro_batches:
            # each micro-batch's token mean / k: a token of the short micro-batch weighs more
            (masked_sum(model, inputs, targets, mask) / mask.sum() / len(micro_batches)).backward()

    def padding_counted(model, micro_batches, world_size, all_reduce):
        model.zero_grad()
        positions = all_reduce(torch.tensor(sum(mask.numel() for *_, mask in micro_batches)))  # padding counted
        for batch in micro_batches:
            (masked_sum(model, *batch) * world_size / positions).backward()

    def forgets_world_size(model, micro_batches, world_size, all_reduce):
        model.zero_grad()
        tokens = global_token_count(micro_batches, all_reduce)
        for batch in micro_batches:
            (masked_sum(model, *batch) / tokens).backward()  # DDP's mean then divides by N once more

    def one_backward(model, micro_batches, world_size, all_reduce):
        model.zero_grad()
        tokens = global_token_count(micro_batches, all_reduce)
        (sum(masked_sum(model, *batch) for batch in micro_batches) * world_size / tokens).backward()  # all activations at once

    def all_reduce_on_rank_0_only(model, micro_batches, world_size, all_reduce):
        model.zero_grad()
        tokens = sum(mask.sum() for *_, mask in micro_batches)
        if micro_batches[0][2].sum() == 15:  # rank 0 (15 real tokens in its first micro-batch)
            tokens = all_reduce(tokens)  # rank 1 never joins: in a job, a hang
        for batch in micro_batches:
            (masked_sum(model, *batch) * world_size / tokens).backward()

    expected = {
        mean_per_rank: "the tokens are not weighted equally",
        mean_over_k: "the tokens are not weighted equally",
        padding_counted: "the right direction, 0.375 times the right size",  # 27 real tokens of 72 positions
        forgets_world_size: "the right direction, 0.5 times the right size",
        one_backward: "backward() ran [1, 1] times per rank",
        all_reduce_on_rank_0_only: "the ranks called all_reduce a different number of times",
    }
    for wrong, concept in expected.items():
        said = verdict(checks.check_exercise_1, wrong)
        assert said.startswith(f"exercise 1: not yet - {concept}"), (wrong.__name__, said)


def local_gradients(x, w1_r, w2_r, grad_y):
    """A rank's own gradients by autograd on its partial output: (partial grad_x, grad_w1_r, grad_w2_r)."""
    leaves = [t.clone().requires_grad_() for t in (x, w1_r, w2_r)]
    partial = F.gelu(leaves[0] @ leaves[1]) @ leaves[2]
    return torch.autograd.grad(partial, leaves, grad_y)


@pytest.mark.timeout(60)
def test_tensor_parallel_check_accepts_autograd_inside_a_rank():
    def with_autograd(x, w1_r, w2_r, grad_y, all_reduce):
        grad_x, grad_w1_r, grad_w2_r = local_gradients(x, w1_r, w2_r, grad_y)
        return all_reduce(grad_x), grad_w1_r, grad_w2_r

    assert verdict(checks.check_tensor_parallel_backward, with_autograd) == "exercise 1: correct"


@pytest.mark.timeout(60)
def test_tensor_parallel_check_rejects_misplaced_or_extra_all_reduces():
    def no_communication(x, w1_r, w2_r, grad_y, all_reduce):
        return local_gradients(x, w1_r, w2_r, grad_y)  # grad_x misses the other ranks' columns

    def all_reduce_everything(x, w1_r, w2_r, grad_y, all_reduce):
        return tuple(all_reduce(g) for g in local_gradients(x, w1_r, w2_r, grad_y))  # weight shards are not copies

    def average_grad_y(x, w1_r, w2_r, grad_y, all_reduce):
        grad_x, grad_w1_r, grad_w2_r = local_gradients(x, w1_r, w2_r, grad_y / 4)  # as if y were a mean
        return all_reduce(grad_x), grad_w1_r, grad_w2_r

    def two_all_reduces(x, w1_r, w2_r, grad_y, all_reduce):
        grad_x, grad_w1_r, grad_w2_r = local_gradients(x, all_reduce(w1_r) * 0 + w1_r, w2_r, grad_y)  # a wasted one
        return all_reduce(grad_x), grad_w1_r, grad_w2_r

    for wrong in (no_communication, all_reduce_everything, average_grad_y, two_all_reduces):
        assert verdict(checks.check_tensor_parallel_backward, wrong) == "exercise 1: not yet", wrong.__name__


@pytest.mark.timeout(60)
def test_a_collective_only_one_rank_calls_is_an_error_after_the_timeout_not_a_hang():
    torch.manual_seed(0)
    x = torch.randn(3, 8, dtype=torch.float64)
    w1 = list(torch.randn(8, 32, dtype=torch.float64).chunk(4, dim=1))
    w2 = list(torch.randn(32, 8, dtype=torch.float64).chunk(4, dim=0))
    args = [(x, w1_r, w2_r, torch.randn(3, 8, dtype=torch.float64)) for w1_r, w2_r in zip(w1, w2)]

    def only_rank_0_reduces(x, w1_r, w2_r, grad_y, all_reduce):
        grad_x, grad_w1_r, grad_w2_r = local_gradients(x, w1_r, w2_r, grad_y)
        if w1_r is w1[0]:
            grad_x = all_reduce(grad_x)  # the other ranks never join
        return grad_x, grad_w1_r, grad_w2_r

    with pytest.raises(threading.BrokenBarrierError):
        checks.run_virtual_ranks(only_rank_0_reduces, args, timeout_s=1)


@pytest.mark.timeout(30)
def test_the_optional_exercise_and_its_stored_verdicts():
    """(That its cells are what the generator makes of the solutions: tests/test_exercises_in_step.py.)"""
    solutions, exercises = cells_titled(OPTIONAL_SOLUTIONS, "# Exercise "), cells_titled(OPTIONAL, "# Exercise ")
    assert list(solutions) == list(exercises) == ["# Exercise 1: the backward pass of a tensor-parallel MLP"]
    solution_checks, lecture_checks = cells_titled(OPTIONAL_SOLUTIONS, "# Check exercise "), cells_titled(OPTIONAL, "# Check exercise ")
    assert {t: s for t, (s, _) in solution_checks.items()} == {t: s for t, (s, _) in lecture_checks.items()}
    # the stored verdicts: solved in the solutions, open in the notebook
    assert [out.strip().splitlines()[-1] for _, out in solution_checks.values()] == ["exercise 1: correct"]
    assert [out.strip().splitlines()[-1] for _, out in lecture_checks.values()] == ["exercise 1: not solved yet - fill in rank_backward above"]


@pytest.mark.timeout(30)
def test_the_optional_notebook_opens_and_closes_on_the_route():
    cells = nbformat.read(OPTIONAL, as_version=4).cells
    markdown = [cell.source for cell in cells if cell.cell_type == "markdown"]
    assert markdown[0].splitlines()[2].startswith("**Before:** lecture 2 (optional reading, any time after it")  # it uses lecture 2's all-reduce
    assert markdown[-1].strip().splitlines()[-1] == "**Next:** back to the route where you left it."
    lecture_text = "\n".join(cell.source for cell in nbformat.read(LECTURE, as_version=4).cells)
    assert "(optional_beyond_data_parallelism.ipynb)" in lecture_text  # lecture 1 links to it


def stored_self_check_cell(path):
    """The notebook's self-check code cell: (source, stored stdout)."""
    [cell] = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code" and "self_check(SELF_CHECK, answer)" in c.source]
    return cell.source, "".join(out.get("text", "") for out in cell.outputs if out.output_type == "stream")


@pytest.mark.timeout(30)
def test_the_self_check_is_the_linear_scaling_rule_applied_to_lab_3s_defaults():
    lab3 = import_script(REPO_ROOT / "labs" / "lab3_ddp.py")
    defaults = lab3.parse_args([])  # the lab's per-rank batch and learning rate, on 2 ranks, no accumulation
    old_global_batch = defaults.batch_size * 2 * defaults.accumulation_steps
    new_global_batch = defaults.batch_size * 8 * 2  # 8 GPUs, 2 micro-batches per optimizer step
    scaled_lr = defaults.lr * new_global_batch / old_global_batch
    assert checks.SELF_CHECK.expected == pytest.approx(scaled_lr)
    assert self_check_verdict(checks.SELF_CHECK, scaled_lr).startswith("self-check: correct - ")
    forgot_accumulation = defaults.lr * 8 / 2  # scaled by the world size only
    scaled_from_one_gpu = defaults.lr * 8 * 2  # as if 0.05 were a one-rank learning rate
    for wrong in (forgot_accumulation, scaled_from_one_gpu, defaults.lr):
        assert self_check_verdict(checks.SELF_CHECK, wrong) == f"self-check: not yet - {checks.SELF_CHECK.hint}", wrong
    source, stored = stored_self_check_cell(LECTURE)
    assert "from ddp_course.lecture01_checks import SELF_CHECK" in source and "answer = None" in source
    assert stored.strip() == self_check_verdict(checks.SELF_CHECK, None)
