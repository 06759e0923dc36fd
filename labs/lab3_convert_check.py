"""Lab 3 conversion checker: run your DDP version of labs/train_realistic.py on 3 CPU ranks and judge it by behaviour.

    cp labs/train_realistic.py labs/my_ddp.py     # then turn labs/my_ddp.py into a DDP script
    python labs/lab3_convert_check.py             # checks labs/my_ddp.py (about half a minute)
    python labs/lab3_convert_check.py SCRIPT      # checks another file
    python labs/lab3_convert_check.py --part A    # part A (lab 3 section 7): its 8 checks; the 5 others wait for part B
    python labs/lab3_convert_check.py --show-output SCRIPT    # also prints what SCRIPT printed
    python labs/lab3_convert_check.py --job-timeout-s 400 SCRIPT  # a slow machine: give the whole job longer

Keep labs/train_realistic.py's flags (with --batch-size per process), its model, its checkpoint's
keys and the form of its printed lines. One line per check (labs/convert_checklist.md lists the
thirteen decisions): PASS, FAIL with the evidence and a hint naming where the course teaches it, or
BLOCKED with the reason the check could not be decided. The exercise has two parts: part A (lab 3
section 7: process group, sampler, schedule, printed numbers) is judged with --part A, part B (lecture 6
section 9: clipping, BatchNorm, checkpoint and resume, accumulation) by all thirteen checks, the default. The checker never reads your source; what
it observes and how it judges is in ddp_course/checking/conversion.py.
"""

import sys

from ddp_course.checking.conversion import main

if __name__ == "__main__":
    sys.exit(main())
