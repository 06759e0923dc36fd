"""Lecture 01's exercise checks accept the solutions and reject plausible wrong answers.

The solutions notebook's code cells run once in one namespace (module fixture, a few seconds). Each
test swaps one function for a wrong answer a learner might write, runs the exercise's own check and
expects "not yet"; the lecture's stubs must make the checks say "not solved yet". A check that
cannot fail, or a solution that stops passing, turns a test red.
"""

import pytest
import torch
import torch.nn.functional as F

from ddp_course.launch import REPO_ROOT
from ddp_course.notebooks import not_solved_verdicts, run_all_cells, run_check, stub_verdicts

LECTURE = REPO_ROOT / "lectures" / "01_data_parallelism.ipynb"
SOLUTIONS = REPO_ROOT / "solutions" / "01_data_parallelism_solutions.ipynb"


@pytest.fixture(scope="module")
def solved():
    """The solutions notebook's namespace after running every cell, and each cell's output."""
    return run_all_cells(SOLUTIONS)



@pytest.mark.timeout(60)
def test_the_solutions_pass_their_checks(solved):
    _, outputs = solved
    for number in (1, 2, 3):
        assert f"exercise {number}: correct" in outputs[f"# Check exercise {number} (run after the cell above)"]
    assert "all-reduces in the backward pass: 1, of shapes [(3, 8)]" in outputs["# Check exercise 3 (run after the cell above)"]


@pytest.mark.timeout(60)
def test_the_lecture_stubs_fail_the_same_checks(solved):
    namespace, _ = solved
    functions = {1: "rank_token_loss", 2: "accumulate_gradients", 3: "rank_backward"}
    assert stub_verdicts(namespace, LECTURE, functions) == not_solved_verdicts(functions)


@pytest.mark.timeout(60)
def test_exercises_1_and_2_reject_the_classic_mistakes(solved):
    namespace, _ = solved

    def mean_per_rank(token_losses, mask, global_real_tokens, world_size):
        return (token_losses * mask).sum() / mask.sum()  # weights a rank's tokens by its own count

    def sum_of_means(model, micro_batches):
        model.zero_grad()
        for images, labels in micro_batches:
            F.cross_entropy(model(images), labels).backward()  # not divided by the number of micro-batches

    assert "exercise 1: not yet" in run_check(namespace, 1, rank_token_loss=mean_per_rank)
    assert "exercise 2: not yet" in run_check(namespace, 2, accumulate_gradients=sum_of_means)


def local_gradients(x, w1_r, w2_r, grad_y):
    """A rank's own gradients by autograd on its partial output: (partial grad_x, grad_w1_r, grad_w2_r)."""
    leaves = [t.clone().requires_grad_() for t in (x, w1_r, w2_r)]
    partial = F.gelu(leaves[0] @ leaves[1]) @ leaves[2]
    return torch.autograd.grad(partial, leaves, grad_y)


@pytest.mark.timeout(60)
def test_exercise_3_accepts_autograd_inside_a_rank(solved):
    namespace, _ = solved

    def with_autograd(x, w1_r, w2_r, grad_y, all_reduce):
        grad_x, grad_w1_r, grad_w2_r = local_gradients(x, w1_r, w2_r, grad_y)
        return all_reduce(grad_x), grad_w1_r, grad_w2_r

    assert "exercise 3: correct" in run_check(namespace, 3, rank_backward=with_autograd)


@pytest.mark.timeout(60)
def test_exercise_3_rejects_misplaced_or_extra_all_reduces(solved):
    namespace, _ = solved

    def no_communication(x, w1_r, w2_r, grad_y, all_reduce):
        return local_gradients(x, w1_r, w2_r, grad_y)  # grad_x misses the other ranks' columns

    def all_reduce_everything(x, w1_r, w2_r, grad_y, all_reduce):
        return tuple(all_reduce(g) for g in local_gradients(x, w1_r, w2_r, grad_y))  # weight shards are not copies

    def average_grad_y(x, w1_r, w2_r, grad_y, all_reduce):
        grad_x, grad_w1_r, grad_w2_r = local_gradients(x, w1_r, w2_r, grad_y / 4)  # as if y were a mean
        return all_reduce(grad_x), grad_w1_r, grad_w2_r

    def only_rank_0_reduces(x, w1_r, w2_r, grad_y, all_reduce):
        grad_x, grad_w1_r, grad_w2_r = local_gradients(x, w1_r, w2_r, grad_y)
        if torch.equal(w1_r, namespace["_first_shard"]):
            grad_x = all_reduce(grad_x)  # the other ranks never join: they must not hang the check
        return grad_x, grad_w1_r, grad_w2_r

    for wrong in (no_communication, all_reduce_everything, average_grad_y):
        assert "exercise 3: not yet" in run_check(namespace, 3, rank_backward=wrong), wrong.__name__

    # A collective that only one rank calls is an error after the timeout, not a hang.
    torch.manual_seed(0)
    x = torch.randn(3, 8, dtype=torch.float64)
    shards = list(torch.randn(8, 32, dtype=torch.float64).chunk(4, dim=1))
    namespace["_first_shard"] = shards[0]
    w2 = list(torch.randn(32, 8, dtype=torch.float64).chunk(4, dim=0))
    args = [(x, w1_r, w2_r, torch.randn(3, 8, dtype=torch.float64)) for w1_r, w2_r in zip(shards, w2)]
    import threading

    with pytest.raises(threading.BrokenBarrierError):
        namespace["run_virtual_ranks"](only_rank_0_reduces, args, timeout_s=1)
