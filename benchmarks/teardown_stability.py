"""Count aborted exits of short gloo DDP jobs: the teardown trap every torchrun test depends on.

    python benchmarks/teardown_stability.py [--runs 40]

On our 2-core machines a gloo job whose DDP model is still alive at destroy_process_group() dies
with "terminate called without an active exception" about 1 run in 5. ddp_course's teardown
(drop the model, gc.collect(), then destroy) should make that 0: this script checks it on lab 3.
"""

import argparse
import sys

from ddp_course.launch import REPO_ROOT, run_torchrun


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    failures = 0
    for run in range(1, args.runs + 1):
        result = run_torchrun(REPO_ROOT / "labs" / "lab3_ddp.py", ["--max-steps", "3"], nproc=2, timeout_s=120)
        if not result.ok:
            failures += 1
            print(f"run {run}: exit {result.returncode}{' (abort at exit)' if result.aborted_at_exit else ''}", flush=True)
    print(f"{failures} of {args.runs} runs failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
