"""Checking and grading: the code that judges a learner's work by running it.

A learner never edits anything here; the front ends they type (`python labs/lab3_convert_check.py`,
`python labs/lab4_check.py`, `python -m ddp_course.grade`; for labs 6 and 8 the lab scripts themselves,
`labs/lab6_ddp_from_scratch.py` and `labs/lab8_fsdp.py`, whose checks are `lab6.py` and `lab8.py`) are
short and call into this package.
The lab 3, 4 and 10 checkers report the same way: a list of `Verdict`s (`ddp_course/checking/verdict.py`),
one line each - PASS, FAIL with the evidence and a hint naming where the course teaches the concept, or
BLOCKED with the reason the check could not be decided - and one result line with the exit status.
What their command lines share (the script argument, finding it from any folder, printing the
verdicts) is `front_end.py`. Labs 6 and 8 keep the lines their sheets and the grader read (lab 8's
`--part` checks are `Verdict`s printed in that format) and end with one error line and exit status 1.
"""
