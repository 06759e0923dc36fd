"""Test helper: lab 6's from-scratch DDP checks, lab 8's and lab 9's checks, in one torchrun job per world size.

    torchrun --standalone --nproc_per_node=2 tests/scripts/sharding_checks.py --minddp-suite wrappers --minddp-json W.json \
        --lab8-json L8.json --lab9-json L9.json --lab9-parts memory,meta,checkpoint,clip
    torchrun --standalone --nproc_per_node=4 tests/scripts/sharding_checks.py --minddp-suite zero --minddp-json Z.json \
        --lab9-json L9.json --lab9-parts memory,hsdp,resume

One job instead of five per world size: every launch costs each process seconds of torch imports, and
every check needs the same thing, a gloo group of N ranks. In order: minddp_check.py's suite (rank 0
writes its records to --minddp-json); every case of minifsdp_check.py (rank 0 prints one PASS/FAIL line
per case and "done: ..."); with --lab8-json, lab8_mutants.py's rows - lab 8 on every implementation and
on wrong FSDPs - (rank 0 writes them there); with --lab9-json, lab 9's judge() on --lab9-parts (rank 0
writes its report there, and lab 9's printed lines and exit status beside it). Each script still runs
alone too; this only calls their functions in one group. Exit status 1 when a minifsdp case failed or a
check raised; which one, the JSON files (each written when its part finished) and the "done:" line tell.
"""

import argparse
import json
import sys
from pathlib import Path

from ddp_course.checking.rows import captured
from ddp_course.distributed import setup_distributed, teardown_distributed
from ddp_course.launch import REPO_ROOT, import_script

SCRIPTS = REPO_ROOT / "tests" / "scripts"
minddp_check = import_script(SCRIPTS / "minddp_check.py", "minddp_check")
minifsdp_check = import_script(SCRIPTS / "minifsdp_check.py", "minifsdp_check")
lab8_mutants = import_script(SCRIPTS / "lab8_mutants.py", "lab8_mutants")
lab9 = import_script(REPO_ROOT / "labs" / "lab9_fsdp_practice.py", "lab9_fsdp_practice")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minddp-suite", choices=("wrappers", "zero"), required=True)
    parser.add_argument("--minddp-json", type=Path, required=True)
    parser.add_argument("--lab8-json", type=Path, help="run lab 8's rows (tests/scripts/lab8_mutants.py) and write them here")
    parser.add_argument("--lab9-json", type=Path, help="run lab 9 on --lab9-parts and write its report here")
    parser.add_argument("--lab9-parts", default="memory", help="lab 9's --parts")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="the longest any collective may wait")
    args = parser.parse_args()
    ctx = setup_distributed("gloo", timeout_s=args.timeout_s)
    try:
        minddp_check.run_suite(ctx, args.minddp_suite, args.minddp_json)
        # Both halves build and drop their wrappers inside these calls: none is reachable at teardown.
        failures = minifsdp_check.run_and_report(ctx)
        if args.lab8_json:
            write_json(ctx, args.lab8_json, lab8_mutants.run_rows(ctx))
        if args.lab9_json:  # its report goes beside the JSON; its checkpoints into temporary folders it removes
            write_json(ctx, args.lab9_json, run_lab9(ctx, args.lab9_parts, args.lab9_json.with_suffix(".report.json")))
    finally:
        teardown_distributed()
    return 1 if failures else 0


def run_lab9(ctx, parts: str, report_path: Path) -> dict:
    """Lab 9's judge() on these parts: its exit status, what rank 0 printed, and its --json report."""
    args = lab9.parse_args(["--parts", parts, "--json", str(report_path)])
    result = captured(lambda: lab9.judge(args, ctx), lab9.__file__)
    result["report"] = json.loads(report_path.read_text()) if ctx.is_main and report_path.exists() else None
    return result


def write_json(ctx, path: Path, content) -> None:
    if ctx.is_main:
        path.write_text(json.dumps(content, indent=1))


if __name__ == "__main__":
    sys.exit(main())
