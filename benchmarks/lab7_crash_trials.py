"""Crash-and-resume trials for lab 7: does every crashed and restarted run end with the weights of
the run without a crash, bit for bit?

    python benchmarks/lab7_crash_trials.py --trials 10

One uninterrupted run, then N runs under `torchrun --max-restarts=1` in which one rank kills
itself (SIGKILL) at a different step each time, rank 1 and rank 0 in turn, all with the environment
lab 7's docstring asks for (ddp_course.resume.RESTART_SAFE_ENV). The model has dropout
(--dropout 0.1), so every step draws random numbers: a resume that restored the generators wrongly,
or drew from them once more than the uninterrupted run, would end with other weights. A trial passes when the job
exits 0, its second attempt resumed from the newest checkpoint before the crash, it reports the
expected number of recomputed steps, and its final weights equal the uninterrupted run's
(torch.equal on every tensor). One line per trial, then "K of N trials passed"; the exit status
is 1 unless all passed. tests/test_lab7_fault_tolerance.py runs three of these trials (one of them
through a driver that gives rank 1 a stale view of the checkpoint directory).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from ddp_course.launch import REPO_ROOT, run_torchrun
from ddp_course.resume import RESTART_SAFE_ENV

LAB7 = REPO_ROOT / "labs" / "lab7_fault_tolerance.py"
MAX_STEPS = 30  # 23 steps per epoch on 2 ranks x 32: the runs cross into epoch 2
CHECKPOINT_EVERY = 5
DROPOUT = 0.1  # a model that draws random numbers at every step (digits CNN, lab 7's --dropout)


def lab7_flags(directory: Path, name: str) -> list:
    return [
        "--max-steps", MAX_STEPS, "--checkpoint-every", CHECKPOINT_EVERY, "--timeout-s", 60, "--dropout", DROPOUT,
        "--checkpoint-dir", directory / f"{name}_checkpoints", "--save", directory / f"{name}.pt",
    ]  # fmt: skip


def uninterrupted_run(directory: Path, timeout_s: float = 300):
    """The reference: the same flags, no crash, no restarts allowed."""
    return run_torchrun(LAB7, lab7_flags(directory, "straight"), nproc=2, timeout_s=timeout_s, env=RESTART_SAFE_ENV)


def crash_flags(directory: Path, crash_step: int, crash_rank: int) -> list:
    """The lab's flags for a crash trial: the reference's, saving to crash<step>_rank<rank>.pt, and the crash."""
    name = f"crash{crash_step}_rank{crash_rank}"
    return [*lab7_flags(directory, name), "--crash-at-step", crash_step, "--crash-rank", crash_rank]


def crash_run(directory: Path, crash_step: int, crash_rank: int, timeout_s: float = 400, driver=None):
    """Rank crash_rank dies at crash_step; torchrun restarts both ranks once.

    driver=(script, args): torchrun starts `script args... LAB7 flags...` instead of the lab, a script
    that changes something in each worker and then runs the lab's main() (the test's stale node).
    """
    flags = crash_flags(directory, crash_step, crash_rank)
    script, args = (LAB7, flags) if driver is None else (driver[0], [*driver[1], LAB7, *flags])
    return run_torchrun(script, args, nproc=2, timeout_s=timeout_s, env=RESTART_SAFE_ENV, torchrun_args=["--max-restarts=1"])


def trial_plan(trials: int) -> list[tuple[int, int]]:
    """(crash step, crash rank) per trial: steps spread over both epochs, on and off checkpoints,
    rank 1 and rank 0 (which writes the checkpoints) in turn: (4, 1), (15, 0), (26, 1), (8, 0), ..."""
    return [(1 + (3 + 11 * i) % (MAX_STEPS - 1), (i + 1) % 2) for i in range(trials)]


def expected_recomputed(crash_step: int) -> int:
    return crash_step % CHECKPOINT_EVERY  # steps since the newest checkpoint at or before the crash


def same_weights(path_a: Path, path_b: Path) -> bool:
    a, b = (torch.load(path, map_location="cpu", weights_only=True) for path in (path_a, path_b))
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def judge(result, directory: Path, crash_step: int, crash_rank: int) -> str | None:
    """None when the trial passed, else what went wrong (one line)."""
    name = f"crash{crash_step}_rank{crash_rank}"
    recomputed = expected_recomputed(crash_step)
    if not result.ok:
        status = "timed out" if result.timed_out else f"exit status {result.returncode}"
        last_error = next((line for line in reversed(result.stderr.splitlines()) if "Error" in line), "no error line")
        return f"{status}: {last_error.strip()[:300]}"
    if f"[rank {crash_rank}] crashing on purpose at step {crash_step} (attempt 0)" not in result.stdout:
        return "the planned crash did not happen"
    resumed = [line for line in result.stdout.splitlines() if line.startswith("attempt 1: ")]
    if len(resumed) != 1 or not resumed[0].endswith(f": {recomputed} steps recomputed"):
        return f"no resume line with {recomputed} steps recomputed: {resumed}"
    if not same_weights(directory / f"{name}.pt", directory / "straight.pt"):
        return "final weights differ from the uninterrupted run"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error("--trials: must be a positive integer")
    with tempfile.TemporaryDirectory(prefix="lab7_trials_") as temporary:
        directory = Path(temporary)
        reference = uninterrupted_run(directory)
        if not reference.ok:
            print(f"the uninterrupted run failed:\n{reference.describe()}")
            return 1
        passed = 0
        for number, (step, rank) in enumerate(trial_plan(args.trials), start=1):
            result = crash_run(directory, step, rank)
            failure = judge(result, directory, step, rank)
            passed += failure is None
            verdict = "passed" if failure is None else f"FAILED: {failure}"
            print(f"trial {number}: rank {rank} killed at step {step}, {expected_recomputed(step)} steps recomputed: "
                  f"{verdict} ({result.wall_s:.0f} s)", flush=True)  # fmt: skip
        print(f"{passed} of {args.trials} trials passed")
    return 0 if passed == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
