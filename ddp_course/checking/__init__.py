"""Checking and grading: the code that judges a learner's work by running it.

A learner never edits anything here; the front ends they type (`python labs/lab3_convert_check.py`,
`python labs/lab4_check.py`, `python -m ddp_course.grade`) are short and call into this package.
Every checker reports the same way: a list of `Verdict`s (`ddp_course/checking/verdict.py`), one
line each - PASS, FAIL with the evidence and a hint naming where the course teaches the concept, or
BLOCKED with the reason the check could not be decided - and one result line with the exit status.
What the checkers' command lines share (the script argument, finding it from any folder, printing the
verdicts) is `front_end.py`.
"""
