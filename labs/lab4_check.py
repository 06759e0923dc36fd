"""Lab 4 checker: run a DDP training script on 2 CPU ranks, watch what it does, judge seven checks.

    python labs/lab4_check.py                            # checks labs/lab4_broken_ddp.py
    python labs/lab4_check.py path/to/your_fixed_copy.py
    python labs/lab4_check.py --show-output SCRIPT       # also print what the script itself printed
    python labs/lab4_check.py --job-timeout-s 120 SCRIPT # a slow machine: give the whole job longer

One line per check: PASS, FAIL with the evidence and a hint naming where the course teaches the
concept, or BLOCKED with the reason the check could not be observed. Exit status 0 only when all
seven pass. The checker never reads the script's source; how it watches and judges the run is in
ddp_course/checking/lab4.py (and the observer it launches, ddp_course/checking/observer.py).
"""

import sys

from ddp_course.checking.lab4 import main

if __name__ == "__main__":
    sys.exit(main())
