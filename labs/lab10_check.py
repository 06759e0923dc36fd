"""Lab 10's checker: run your fixed script on 2 CPU ranks beside the course's reference, judge what it does.

    python labs/lab10_check.py                  # checks labs/lab10_slow_ddp.py (every check fails)
    python labs/lab10_check.py my_lab10.py      # your copy; exit status 0 = every check passed

One line per check: PASS, FAIL with the measured evidence and a hint naming where the course teaches
the concept, or BLOCKED with the reason it could not be decided. The checker itself, and what each
check measures, is in ddp_course/checking/lab10.py; the timeline it reads is ddp_course/timeline.py.
About a minute on a quiet 2-core CPU.
"""

import sys

from ddp_course.checking.lab10 import main

if __name__ == "__main__":
    sys.exit(main())
