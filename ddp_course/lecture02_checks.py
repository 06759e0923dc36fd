"""Checks for lecture 2's exercises (lectures/02_collectives.ipynb): one call each, with the learner's function.

    check_exercise_1(tree_all_reduce)
    check_exercise_2(make_buckets)
    check_exercise_3(halving_doubling_seconds)

Each prints "exercise N: correct - ..." when the answer is right, raises AssertionError with the first
property that fails when it is wrong, and prints "not done yet: ..." while the exercise still raises
NotImplementedError. The checks price answers with the lecture's alpha-beta model of section 3, with
beta a link's bandwidth in bytes/s (the README's notation): a message of S bytes takes alpha + S/beta
seconds. ring_seconds and tree_seconds below are the lecture's formulas;
tests/test_02_collectives_exercises.py proves they equal the notebook's own functions.
"""

from __future__ import annotations

import functools
import math

import torch

from ddp_course.self_check import Question

# The lecture's illustrative link: 5 microseconds per message, 25 GB/s per direction.
ALPHA = 5e-6  # s
BETA = 25e9  # bytes/s

# The self-check at the end of the Summary: 100 gradients of 40 kB on 8 ranks, one by one or in one bucket.
# Both ways move the same bytes (2 x 280 microseconds of bandwidth terms cancel); each all-reduce pays
# 2(N-1) = 14 latencies of 5 microseconds, so the bucket saves 99 x 70 = 6930 microseconds.
SELF_CHECK = Question(
    name="self-check",
    expected=6930.0,
    why="each all-reduce pays 2(N-1) alpha = 70 microseconds whatever its size, and both ways send the same "
    "bytes, so one bucket instead of 100 saves 99 x 70 = 6930",
    hint="reread section 3 (the alpha-beta model): which term of T_ring grows with the number of all-reduces, "
    "which only with the total bytes, and how many latencies does one ring pay?",
    relative_tolerance=0.005,  # 7000 (forgetting that the bucket pays its own latency) is 1% off
)

# DigitsCNN's 8 gradient tensors (numel), in float32: what the bucket check prices.
DIGITS_CNN_TENSOR_BYTES = [4 * numel for numel in (288, 32, 18432, 64, 131072, 128, 1280, 10)]


def tree_seconds(n_bytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Binomial tree: 2 ceil(log2 N) rounds, each moving the whole message."""
    return 2 * math.ceil(math.log2(world_size)) * (alpha + n_bytes / beta)


def ring_seconds(n_bytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Ring: 2(N-1) steps, each moving one N-th of the message over every link at once."""
    return 2 * (world_size - 1) * alpha + 2 * (world_size - 1) / world_size * n_bytes / beta


def _reports_unfinished(check):
    """A NotImplementedError from the learner's function means "not done yet", not a failure."""

    @functools.wraps(check)
    def run(answer):
        try:
            check(answer)
        except NotImplementedError:
            print("not done yet: complete the cell above (solution in solutions/02_collectives_solutions.ipynb)")

    return run


@_reports_unfinished
def check_exercise_1(tree_all_reduce) -> None:
    """The sum on every rank, in 2 ceil(log2 N) rounds, each rank owning its own tensor (N = 1..9)."""
    generator = torch.Generator().manual_seed(0)
    for world_size in range(1, 10):
        ranks = [torch.randn(5, dtype=torch.float64, generator=generator) for _ in range(world_size)]
        results, rounds = tree_all_reduce(ranks)
        expected = torch.stack(ranks).sum(dim=0)
        assert len(results) == world_size, f"N={world_size}: one result per rank"
        # float64, at most 9 terms: different addition orders agree far inside allclose's tolerance
        assert all(torch.allclose(r, expected) for r in results), f"N={world_size}: not the sum on every rank"
        assert rounds == 2 * math.ceil(math.log2(world_size)), f"N={world_size}: {rounds} rounds"
        results[0] += 1  # each rank must own its result, not share one tensor with the others
        assert world_size == 1 or not torch.equal(results[0], results[-1]), "ranks share one tensor"
    print("exercise 1: correct - the sum on every rank in 2*ceil(log2 N) rounds, for N = 1..9")


@_reports_unfinished
def check_exercise_2(make_buckets) -> None:
    """Every tensor once, in order; no bucket over the cap (unless one tensor alone); filled greedily."""
    generator = torch.Generator().manual_seed(0)
    for cap in (1, 100, 1000, 10**9):
        sizes = torch.randint(1, 400, (30,), generator=generator).tolist()
        buckets = make_buckets(sizes, cap)
        assert [i for bucket in buckets for i in bucket] == list(range(len(sizes))), "every tensor once, in order"
        for bucket, following in zip(buckets, buckets[1:] + [None]):
            total = sum(sizes[i] for i in bucket)
            assert total <= cap or len(bucket) == 1, f"cap {cap}: bucket {bucket} holds {total} bytes"
            if following:  # greedy: the next tensor really did not fit
                assert total + sizes[following[0]] > cap, f"cap {cap}: bucket {bucket} closed too early"
    assert make_buckets([], 10) == [], "no tensors, no buckets"
    print("exercise 2: correct - buckets keep the order, respect the cap and are filled greedily")

    # What buckets buy: the digits CNN's gradients all-reduced over 8 ranks, in the lecture's model.
    sizes = DIGITS_CNN_TENSOR_BYTES
    for cap in (1, 64 * 1024, 25 * 2**20):
        buckets = make_buckets(sizes, cap)
        seconds = sum(ring_seconds(sum(sizes[i] for i in b), 8, ALPHA, BETA) for b in buckets)
        print(f"  cap {cap:>10,} bytes: {len(buckets)} all-reduce(s), {seconds * 1e6:6.1f} microseconds modelled")


@_reports_unfinished
def check_exercise_3(halving_doubling_seconds) -> None:
    """Cases worked out by hand (one without latency, one without bandwidth), then: never slower than ring or tree."""
    # (bytes, N, alpha in s, beta in bytes/s, expected seconds); the derivation is the exercise.
    # beta = inf: a link with no bandwidth term (S / inf = 0), so only the latency term is left.
    cases = [(1e6, 8, 5e-6, 25e9, 100e-6), (64e6, 4, 0.0, 32e9, 3e-3), (1e3, 1024, 2e-6, math.inf, 40e-6)]
    for n_bytes, world_size, alpha, beta, expected in cases:
        got = halving_doubling_seconds(n_bytes, world_size, alpha, beta)
        assert math.isclose(got, expected), f"{n_bytes:g} bytes, N={world_size}, alpha={alpha:g} s, beta={beta:g} B/s: expected {expected:g} s, got {got:g} s"
    assert halving_doubling_seconds(1e6, 1, ALPHA, BETA) == 0.0, "one rank sends nothing"
    for world_size in (2, 4, 8, 16, 64, 1024):
        for n_bytes in (1e3, 1e6, 1e9):
            hd = halving_doubling_seconds(n_bytes, world_size, ALPHA, BETA)
            # 1e-12: room for the last bits of a different order of the same additions
            assert hd <= ring_seconds(n_bytes, world_size, ALPHA, BETA) * (1 + 1e-12), "never slower than the ring"
            assert hd <= tree_seconds(n_bytes, world_size, ALPHA, BETA) * (1 + 1e-12), "never slower than the tree"
    print("exercise 3: correct - as little data as the ring, as few rounds as the tree")
    for world_size in (8, 1024):
        ring, hd = (f(100e6, world_size, ALPHA, BETA) * 1e3 for f in (ring_seconds, halving_doubling_seconds))
        print(f"  100 MB over {world_size:>4} ranks, milliseconds: ring {ring:5.2f}, halving-doubling {hd:5.2f}")


# --- section 1's pictures (the drawing, out of the reader's way; the notebook calls them in one line) ---

RANK_COLOURS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]


def draw_ranks(ax, tensors, title: str) -> None:
    """One row per rank, one box per value; colour = the hundreds digit (rank r+1), grey = a sum."""
    import matplotlib.pyplot as plt  # only when drawing: the checks above run without matplotlib

    for rank, tensor in enumerate(tensors):
        ax.text(-0.3, -rank, f"rank {rank}", ha="right", va="center", fontsize=8)
        if tensor is None:
            ax.text(0, -rank, "undefined", va="center", fontsize=8, color="0.5")
            continue
        for column, value in enumerate(tensor.tolist()):
            owner = int(value // 100) - 1
            colour = RANK_COLOURS[owner] if owner < len(tensors) else "0.8"
            ax.add_patch(plt.Rectangle((column, -rank - 0.4), 0.95, 0.8, color=colour, alpha=0.6))
            ax.text(column + 0.47, -rank, f"{value:g}", ha="center", va="center", fontsize=7)
    ax.set_xlim(-1.6, 9.2)
    ax.set_ylim(-len(tensors) + 0.4, 0.6)
    ax.set_title(title, fontsize=9)
    ax.axis("off")


def draw_barrier(arrivals: list[float], departures: list[float]) -> None:
    """Each rank's work (colour), its wait at the barrier (hatched) and the common departure (dashed)."""
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=(6, 1.8))
    for rank, (arrive, leave) in enumerate(zip(arrivals, departures)):
        ax.barh(rank, arrive, color=RANK_COLOURS[rank], alpha=0.6)
        ax.barh(rank, leave - arrive, left=arrive, color="none", edgecolor="0.4", hatch="//")
    ax.axvline(max(arrivals), color="black", linestyle="--")
    ax.set(yticks=range(len(arrivals)), yticklabels=[f"rank {r}" for r in range(len(arrivals))], xlabel="time (s)",
           title="barrier: work (colour), waiting (hatched), everyone leaves together (dashed)")  # fmt: skip
    ax.invert_yaxis()
