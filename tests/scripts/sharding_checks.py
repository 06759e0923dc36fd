"""Test helper: the from-scratch DDP checks of lab 6 and FSDP checks of lab 8 in one torchrun job.

    torchrun --standalone --nproc_per_node=2 tests/scripts/sharding_checks.py --minddp-suite wrappers --minddp-json W.json
    torchrun --standalone --nproc_per_node=4 tests/scripts/sharding_checks.py --minddp-suite zero --minddp-json Z.json

One job instead of two per world size: every launch costs each process seconds of torch imports, and
the two check scripts need the same thing, a gloo group of N ranks. First minddp_check.py's suite
(rank 0 writes its records to --minddp-json), then every case of minifsdp_check.py (rank 0 prints one
PASS/FAIL line per case and "done: ..."). Each script still runs alone too; this only calls their
functions in one group. Exit status 1 when a minifsdp case failed or a check raised; which one, the
JSON file (written only when the minddp suite finished) and the "done:" line tell.
"""

import argparse
import sys
from pathlib import Path

from ddp_course.distributed import setup_distributed, teardown_distributed
from ddp_course.launch import REPO_ROOT, import_script

SCRIPTS = REPO_ROOT / "tests" / "scripts"
minddp_check = import_script(SCRIPTS / "minddp_check.py", "minddp_check")
minifsdp_check = import_script(SCRIPTS / "minifsdp_check.py", "minifsdp_check")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minddp-suite", choices=("wrappers", "zero"), required=True)
    parser.add_argument("--minddp-json", type=Path, required=True)
    parser.add_argument("--timeout-s", type=float, default=30.0, help="the longest any collective may wait")
    args = parser.parse_args()
    ctx = setup_distributed("gloo", timeout_s=args.timeout_s)
    try:
        minddp_check.run_suite(ctx, args.minddp_suite, args.minddp_json)
        # Both halves build and drop their wrappers inside these calls: none is reachable at teardown.
        failures = minifsdp_check.run_and_report(ctx)
    finally:
        teardown_distributed()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
