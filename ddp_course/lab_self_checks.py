"""The lab sheets' self-checks (ddp_course/self_check.py): one Question per core lab sheet, asked at the end
of its `## Summary [core]` section. The lectures keep theirs in their own lectureNN_checks.py; the labs
have no such module, so theirs live here, one block per lab in route order.
"""

from ddp_course.self_check import Question

# --- lab 3: real DDP training -----------------------------------------------------------------------

# --- lab 1: collectives -----------------------------------------------------------------------------

# --- lab 2: the sampler -----------------------------------------------------------------------------

# --- lab 4: the broken DDP script -------------------------------------------------------------------

# --- lab 5: scaling ---------------------------------------------------------------------------------

# --- lab 7: fault tolerance -------------------------------------------------------------------------

# --- lab 9: FSDP in practice ------------------------------------------------------------------------

__all__ = ["Question"]
