"""Lecture 5a's exercise checks: each is one call in the notebook, `check_exercise_1(hierarchical_phases)`.

Each prints "exercise N: correct", "... not yet" with the first case that failed, or "... not solved
yet" while the function still raises NotImplementedError. tests/test_lecture05_exercises.py shows
that every check rejects plausible wrong answers.
"""

from __future__ import annotations

import json
import math

import torch

from ddp_course.calculators import BUCKET_BYTES, NVLINK, allreduce_seconds, gpt2_parameters, network_link
from ddp_course.launch import REPO_ROOT
from ddp_course.self_check import Question

LECTURE5_REFERENCE = REPO_ROOT / "solutions" / "lecture5_reference" / "lecture5_reference.json"


def print_verdict(number, name, check):
    """Run check(); turn what it raised into the one-line verdict a learner reads."""
    try:
        extra = check()
    except NotImplementedError:
        print(f"exercise {number}: not solved yet - fill in {name} above")
    except AssertionError as problem:
        print(f"  {problem}\nexercise {number}: not yet")
    else:
        for line in extra:
            print(f"  {line}")
        print(f"exercise {number}: correct")


def check_exercise_1(hierarchical_phases):
    """Worked examples, then the three phases must add up to allreduce_seconds on 200 random set-ups."""

    def check():
        # Worked out by hand: (bytes, g, nodes, inside, between, buckets, expected seconds of the three phases).
        cases = [
            (800e6, 8, 4, (0.0, 100e9), (0.0, 12.5e9), 1, (0.007, 0.012, 0.007)),  # 7/8 x 800 MB / 100 GB/s; 2 x 3/4 x 100 MB / 12.5 GB/s
            (80e6, 4, 2, (2e-6, 50e9), (1e-5, 10e9), 10, (0.00126, 0.0022, 0.00126)),  # 10 x 3 x 2 us + 1.2 ms; 10 x 2 x 10 us + 2 ms
            (80e6, 4, 1, (2e-6, 50e9), None, 10, (0.00126, 0.0, 0.00126)),
        ]  # one node: nothing crosses the network
        for n_bytes, g, nodes, inside, between, buckets, expected in cases:
            got = tuple(hierarchical_phases(n_bytes, g, nodes, inside, between, buckets))
            assert len(got) == 3 and all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15) for a, b in zip(got, expected)), (
                f"{n_bytes:g} bytes, {g} GPUs x {nodes} nodes, inside {inside}, between {between}, {buckets} buckets: expected {expected}, got {got}"
            )
        generator = torch.Generator().manual_seed(0)
        for _ in range(200):  # the three phases add up to section 2's allreduce_seconds
            n_bytes, alpha_in, alpha_net, net_gbs = (torch.rand(4, generator=generator) + 0.01).tolist()
            g, nodes, buckets = (int(v) for v in torch.randint(1, 17, (3,), generator=generator))
            inside, between = (alpha_in * 1e-5, 200e9), (alpha_net * 1e-4, net_gbs * 50e9)
            phases = hierarchical_phases(n_bytes * 1e9, g, nodes, inside, between, buckets)
            total = allreduce_seconds(n_bytes * 1e9, g, nodes, inside, between, buckets)
            assert math.isclose(sum(phases), total, rel_tol=1e-9, abs_tol=1e-15), (
                f"{n_bytes * 1e9:g} bytes, {g} GPUs x {nodes} nodes, {buckets} buckets: phases add up to {sum(phases):g} s, allreduce_seconds says {total:g} s"
            )
        n_bytes = 4 * gpt2_parameters()
        phases = hierarchical_phases(n_bytes, 8, 2, NVLINK, network_link("100 Gb/s per node", 8), math.ceil(n_bytes / BUCKET_BYTES))
        return [
            "GPT-2 small, 2 nodes x 8, 100 Gb/s: reduce-scatter {:.2f} ms, across nodes {:.2f} ms, all-gather {:.2f} ms".format(
                *(seconds * 1e3 for seconds in phases)
            )
        ]

    print_verdict(1, "hierarchical_phases", check)


def check_exercise_2(powersgd_elements):
    """Hand cases, torch's own compress-or-not decision on 300 random shapes, and the bytes the
    reference run's 2-rank job sent for the digits CNN."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    from ddp_course.models import DigitsCNN

    shapes = [tuple(p.shape) for p in DigitsCNN().parameters()]
    measured_bytes = json.loads(LECTURE5_REFERENCE.read_text())["comm_bound"]["hooks"]["powerSGD"]["bytes_per_step"]

    def check():
        assert powersgd_elements([(10,)], 4) == 10, "a bias vector is sent as it is"
        assert powersgd_elements([(100, 100)], 2) == 400, "100 x 100 at rank 2: P and Q, 200 numbers each"
        assert powersgd_elements([(4, 4)], 2) == 16, "4 x 4 at rank 2 would save less than half: sent as it is"
        assert powersgd_elements([(64, 32, 3, 3)], 1) == 64 + 288, "a convolution is a 64 x 288 matrix"
        generator = torch.Generator().manual_seed(0)
        for _ in range(300):  # torch's own test of what to compress, on random shapes
            dims = torch.randint(1, 40, (int(torch.randint(1, 5, (1,), generator=generator)),), generator=generator).tolist()
            rank, rate = int(torch.randint(1, 5, (1,), generator=generator)), float(torch.randint(1, 4, (1,), generator=generator))
            n, m = dims[0], math.prod(dims[1:])
            compress, uncompressed, compressed = _should_compress(n, m, min(n, m, rank), rate)
            assert powersgd_elements([tuple(dims)], rank, rate) == (compressed if compress else uncompressed), f"shape {dims}, rank {rank}, rate {rate}"
        assert 4 * powersgd_elements(shapes, 1) == measured_bytes, f"the digits CNN at rank 1: the job measured {measured_bytes:,} bytes per step"
        lines = [f"the digits CNN at rank 1: {4 * powersgd_elements(shapes, 1):,} bytes per step, as the reference run's job measured"]
        for rank in (1, 4, 16):
            ratio = sum(math.prod(s) for s in shapes) / powersgd_elements(shapes, rank)
            lines.append(f"digits CNN at rank {rank:>2}: {ratio:5.1f}x fewer numbers than the plain all-reduce")
        return lines

    print_verdict(2, "powersgd_elements", check)


# --- the self-check (ddp_course/self_check.py), asked at the end of the Summary --------------------------
# Section 2's model, strong scaling: T(8) = T_1 / 8 + max(0, T_comm - o f_b T_1 / 8). The computation of
# 192 ms splits into 24 ms per GPU; the ring sends 2 x 7/8 x 1 GB over 100 GB/s = 17.5 ms; backward, 2/3
# of 24 ms = 16 ms, hides all of it but 1.5 ms. tests/test_lecture05_exercises.py recomputes it.
SELF_CHECK = Question(
    name="self-check",
    expected=25.5,
    why="24 ms of computation per GPU, plus what the 17.5 ms all-reduce leaves after 16 ms of backward hid it",
    hint="reread section 2 (Amdahl's law with a communication term): what does each GPU compute, what does "
    "a ring send, and which part of the step can hide it?",
    relative_tolerance=0.02,
)
