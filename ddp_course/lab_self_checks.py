"""The lab sheets' self-checks (ddp_course/self_check.py): one Question per core lab sheet, asked at the end
of its `## Summary [core]` section. Labs 1, 2, 7 and 9 became deep dives as a whole (issue 38) and keep theirs,
asked at the end of their Check your understanding sections, since it reads deep-dive sections. The lectures keep
theirs in their own lectureNN_checks.py; the labs have no such module, so theirs live here, one block
per lab in route order.
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
    hint="reread section 2 (what each collective returns) and section 3: for each check, does any rank's result depend on rank 0's first value?",
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

# comm_bound trains 4 samples per rank (section 2's table); on 16 ranks one step sees 64 samples, and the
# linear scaling rule takes a recipe tuned at lr 0.1 for batch 32 to 0.1 x 64 / 32 (section 4, question 3).
LAB5_SELF_CHECK = Question(
    name="self-check",
    expected=0.2,
    why="one step sees the global batch, 16 ranks x 4 samples = 64, twice the recipe's 32: twice its learning rate",
    hint="reread section 4, assessment question 3 (effective batch size): which batch does the learning rate "
    "follow, and how many samples does each comm_bound rank bring to it (section 2's table)?",
)

# --- lab 7: fault tolerance -------------------------------------------------------------------------

# Section 3's job with --checkpoint-every 4 and --crash-at-step 10: the newest checkpoint is step 8's, so
# the restart runs steps 9 and 10 again (the stored run: every 5, crash after 8, 3 steps recomputed).
LAB7_SELF_CHECK = Question(
    name="self-check",
    expected=2,
    why="the restart resumes from the newest checkpoint, step 8's, so steps 9 and 10 run twice",
    hint="reread section 3 (a crash, the restart, and what was recomputed): from which checkpoint does "
    "every worker start again, and which steps had run since it?",
    relative_tolerance=0.0,
)

# --- lab 9: FSDP in practice ------------------------------------------------------------------------

# fully_shard's ring-model bytes per rank per step: an all-gather in forward, another in backward and a
# reduce-scatter, each (N-1)/N of the weights' S = 3.105 MiB (DDP's row on 2 ranks, 2 x 1/2 x S):
# 3 x 7/8 x 3.105 MiB = 8.15 MiB on 8 ranks.
LAB9_SELF_CHECK = Question(
    name="self-check",
    expected=8.15,
    why="three collectives of (N-1)/N of the weights each: 3 x 7/8 x 3.105 MiB; more ranks bring it nearer 3S, never past",
    hint="reread section 2 (memory over a whole step) and its bytes table: find the weights' size S from DDP's "
    "2-rank row, then count fully_shard's collectives per step and what each sends on N ranks",
)

__all__ = ["Question"]
