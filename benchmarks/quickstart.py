"""Measure the README's main job as a learner runs it: wall time (torchrun's start to exit) and accuracy.

    python benchmarks/quickstart.py [--runs 3]

Runs `torchrun --standalone --nproc_per_node=2 labs/lab3_ddp.py` word for word, several times,
and reports each run's wall-clock time and final held-out accuracy (read from its last epoch line).
The course promises at least 97% held-out accuracy in at most 30 s on a 2-core CPU.
"""

import argparse
import re
import shutil
import statistics
import sys

from ddp_course.launch import REPO_ROOT, run_command

ACCURACY_TARGET, SECONDS_TARGET = 0.97, 30.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torchrun = shutil.which("torchrun") or sys.exit("torchrun is not on PATH: pip install -r requirements.txt")
    command = [torchrun, "--standalone", "--nproc_per_node=2", "labs/lab3_ddp.py"]

    times, accuracies = [], []
    for run in range(1, args.runs + 1):
        # No OMP_NUM_THREADS from us: torchrun sets 1 per worker, as on a learner's machine.
        result = run_command(command, timeout_s=300, threads_per_rank=None, cwd=REPO_ROOT)
        last_epoch = re.findall(r"held-out accuracy ([\d.]+)%", result.stdout)
        if not result.ok or not last_epoch:
            print(result.describe())
            return 1
        times.append(result.wall_s)
        accuracies.append(float(last_epoch[-1]) / 100)
        print(f"run {run}: {result.wall_s:.1f} s, held-out accuracy {accuracies[-1]:.2%}", flush=True)

    ok = min(accuracies) >= ACCURACY_TARGET and max(times) <= SECONDS_TARGET
    print(
        f"wall time median {statistics.median(times):.1f} s, max {max(times):.1f} s (target <= {SECONDS_TARGET:.0f} s); "
        f"accuracy min {min(accuracies):.2%} (target >= {ACCURACY_TARGET:.0%}): {'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
