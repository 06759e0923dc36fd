"""Lecture 5b's exercise check: one call in the notebook, `check_exercise_1(largest_batch)`.

It prints "exercise 1: correct", "... not yet" with the first case that failed, or "... not solved
yet" while the function still raises NotImplementedError (the verdict lines are lecture 5a's);
tests/test_lecture05_exercises.py shows that it rejects plausible wrong answers.
"""

from __future__ import annotations

from ddp_course.lecture05a_checks import print_verdict
from ddp_course.self_check import Question


def check_exercise_1(largest_batch):
    """Worked examples for 1 B parameters on an 80 GB H100, and more memory never gives a smaller batch."""
    GB = 1e9

    def check():
        cases = [
            ((80 * GB, 1e9, 0.1 * GB), {}, 600),  # 80 - 4 - 4 - 4 - 8 = 60 GB of activations
            ((80 * GB, 1e9, 0.1 * GB), {"bucket_view": True}, 640),  # no bucket copy
            ((80 * GB, 1e9, 0.1 * GB), {"optimizer": "momentum"}, 640),
            ((80 * GB, 1e9, 0.1 * GB), {"optimizer": "sgd", "bucket_view": True}, 720),
            ((80 * GB, 1e9, 0.1 * GB), {"zero1_ranks": 8}, 670),
            ((80 * GB, 1e9, 0.3 * GB), {}, 200),
            ((80 * GB, 1e9, 0.7 * GB), {}, 85),  # 60 / 0.7 = 85.7: whole samples only
            ((16 * GB, 1e9, 0.1 * GB), {}, 0),
        ]  # the model's state alone does not fit
        for arguments, options, expected in cases:
            got = largest_batch(*arguments, **options)
            assert got == expected, f"{arguments}, {options}: expected {expected}, got {got}"
        for memory_gb in range(20, 200, 7):  # more memory never means a smaller batch
            assert largest_batch((memory_gb + 7) * GB, 1e9, 0.1 * GB) >= largest_batch(memory_gb * GB, 1e9, 0.1 * GB), "not monotonic"
        return [
            f"1 B parameters, Adam, 80 GB, ZeRO-1 over {ranks} rank(s): batch {largest_batch(80 * GB, 1e9, 0.1 * GB, zero1_ranks=ranks)}" for ranks in (1, 8)
        ]

    print_verdict(1, "largest_batch", check)


# --- the self-check (ddp_course/self_check.py), asked at the end of the Summary --------------------------
# Section 3's table on one rank of a DDP job: 1 B fp32 parameters, Adam, default buckets -> 4 + 4 + 4 + 8 =
# 20 GB whatever N is; a global batch of 256 over 8 ranks is 32 samples per rank at 1 GB each -> 32 GB.
# tests/test_lecture05_exercises.py recomputes it with memory_breakdown.
SELF_CHECK = Question(
    name="self-check",
    expected=52,
    why="16P of weights, gradients and Adam state plus 4P of buckets, on every rank, and 32 samples' activations",
    hint="reread section 3 (what one rank holds): which terms shrink as N grows, which DDP adds, and how many samples does one rank hold?",
    relative_tolerance=0.02,
)
