"""The lab sheets' self-checks (ddp_course/self_check.py): one Question per core lab sheet, asked at the end
of its `## Summary [core]` section. The lectures keep theirs in their own lectureNN_checks.py; the labs
have no such module, so theirs live here, one block per lab in route order.
"""

from ddp_course.self_check import Question

# --- lab 3: real DDP training -----------------------------------------------------------------------

# The conversion's hardest count (checklist row 9): a converted script's schedule needs the optimizer
# steps of one rank's epoch, not the one-process script's. The checker's stored run on the solution
# (solutions/lab3_reference/convert_check_pass.txt) counted 8 steps in its 2 epochs.
LAB3_SELF_CHECK = Question(
    name="self-check",
    expected=4,
    why="each rank reads 480 of the 1,440 padded digits: 10 micro-batches of 48, in groups of 3 = 4 steps,"
    " the last of one micro-batch (the checker counted 8 in its 2 epochs)",
    hint="reread section 3 (steps per epoch, then accumulation): a rank reads only its share of the digits,"
    " and an epoch's last, shorter group of micro-batches is a step too",
)

# --- lab 1: collectives -----------------------------------------------------------------------------

# Section 3's self-test, the other way round: which results read the corrupted value? With rank 0
# corrupted (100.5 instead of 100), the element-wise maximum still takes rank 1's 200.
LAB1_SELF_CHECK = Question(
    name="self-check",
    expected="all_reduce_max",
    why="the maximum of 100.5 and 200 is still rank 1's 200: the corrupted value changes no result",
    hint="reread section 2 (what each collective returns) and section 3: for each check, does any rank's"
    " result depend on rank 0's first value?",
)

# --- lab 2: the sampler -----------------------------------------------------------------------------

# Section 6's Join run: rank 0 has 15 batches, rank 1 has 30 (the run printed "steps per rank: [15, 30]").
# A joined rank shadows every collective the others still make, so it takes part in all of them.
LAB2_SELF_CHECK = Question(
    name="self-check",
    expected=30,
    why="15 with its own gradients, then 15 more with zeros while rank 1 finishes: one per step of the longest rank",
    hint="reread section 6 (uneven shards, Join): what does rank 0 do while rank 1 still calls backward()?",
)

# --- lab 4: the broken DDP script -------------------------------------------------------------------

# --- lab 5: scaling ---------------------------------------------------------------------------------

# --- lab 7: fault tolerance -------------------------------------------------------------------------

# --- lab 9: FSDP in practice ------------------------------------------------------------------------

__all__ = ["Question"]
