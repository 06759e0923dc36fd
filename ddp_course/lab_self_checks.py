"""The lab sheets' self-checks (ddp_course/self_check.py): one Question per core lab sheet, asked at the end
of its `## Summary [core]` section. The lectures keep theirs in their own lectureNN_checks.py; the labs
have no such module, so theirs live here, one block per lab in route order.
"""

from ddp_course.self_check import Question

# --- lab 3: real DDP training -----------------------------------------------------------------------

# --- lab 1: collectives -----------------------------------------------------------------------------

# --- lab 2: the sampler -----------------------------------------------------------------------------

# --- lab 4: the broken DDP script -------------------------------------------------------------------

# Section 2's minimal hang with rank 0 given 5 batches and rank 1 given 3: both ranks run the same
# all-reduces #0-#2, then rank 0 enters all-reduce #3 while rank 1 enters the barrier as its #3.
LAB4_SELF_CHECK = Question(
    name="self-check",
    expected=3,
    why="the ranks agree on the 3 all-reduces both run (#0, #1, #2); the first disagreement is the next one, #3",
    hint="reread section 2 (let torch.distributed check every collective): count the collectives both ranks "
    "still call alike, from 0, as the stored run's #2 does for 3 and 2 batches",
    relative_tolerance=0.0,
)

# --- lab 5: scaling ---------------------------------------------------------------------------------

# --- lab 7: fault tolerance -------------------------------------------------------------------------

# --- lab 9: FSDP in practice ------------------------------------------------------------------------

__all__ = ["Question"]
