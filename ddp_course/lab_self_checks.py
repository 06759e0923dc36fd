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

# --- lab 2: the sampler -----------------------------------------------------------------------------

# --- lab 4: the broken DDP script -------------------------------------------------------------------

# --- lab 5: scaling ---------------------------------------------------------------------------------

# --- lab 7: fault tolerance -------------------------------------------------------------------------

# --- lab 9: FSDP in practice ------------------------------------------------------------------------

__all__ = ["Question"]
