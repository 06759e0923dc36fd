"""Count non-zero exits of gloo jobs that did their work: the kinds of torchrun jobs the test suite launches.

    python benchmarks/teardown_stability.py [--runs 400] [--kinds lab3_sheet,lab6] [--parallel 1] [--keep DIR]
    python benchmarks/teardown_stability.py --from-log LOG   # count the launches of a whole test run

`--from-log` reads the launch log that ddp_course.launch writes when DDP_COURSE_LAUNCH_LOG=LOG is set
(`DDP_COURSE_LAUNCH_LOG=/tmp/launches.jsonl pytest --nbval` logs every job the suite starts, notebooks
included) and reports per script: launches, non-zero exits (the suite's negative tests exit non-zero on
purpose) and aborts at exit, which must be 0; ranks killed by SIGABRT/SIGSEGV are listed with their test.

Every test and notebook that launches torchrun depends on its job exiting 0 once its work is done. A
gloo job whose DDP model is still alive at destroy_process_group() can die at exit with "terminate
called without an active exception" (guide, section 6); ddp_course's teardown (drop the model,
gc.collect(), then destroy) made that rare, not impossible. This script launches the kinds of jobs the
suite runs, round-robin (so `--runs 400` is 400 consecutive launches of mixed kinds), and reports per
kind: launches, non-zero exits, and how many of them were aborts at exit.

Each failed launch's full output goes to DIR/<kind>-<n>.txt. The jobs run with PYTHONFAULTHANDLER=1,
so a worker killed by SIGABRT prints every thread's Python stack: where the interpreter was when it
died. The exit status is 0 only when every launch exited 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ddp_course.launch import REPO_ROOT, RunResult, run_torchrun
from ddp_course.resume import RESTART_SAFE_ENV


@dataclass(frozen=True)
class JobKind:
    name: str
    script: str  # relative to the repository root
    args: tuple[str, ...]  # "{out}" stands for a fresh directory of this launch
    nproc: int = 2
    env: tuple[tuple[str, str], ...] = ()  # extra environment variables

    def launch(self, out: Path) -> RunResult:
        args = [arg.replace("{out}", str(out)) for arg in self.args]
        env = {"PYTHONFAULTHANDLER": "1", **dict(self.env)}
        return run_torchrun(REPO_ROOT / self.script, args, nproc=self.nproc, timeout_s=300, env=env)


# The jobs the suite launches, at the sizes the tests and notebooks use.
KINDS = (
    JobKind("lab3_quickstart", "labs/lab3_ddp.py", ()),  # the README's first command: 10 epochs
    JobKind("lab3_sheet", "labs/lab3_ddp.py", ("--max-steps", "46", "--metrics-json", "{out}/m.json", "--save", "{out}/w.pt")),
    JobKind("lab3_accumulation_save", "labs/lab3_ddp.py",
            ("--batch-size", "64", "--accumulation-steps", "3", "--max-steps", "6", "--save", "{out}/w.pt")),
    JobKind("lab3_checkpoints", "labs/lab3_ddp.py", ("--max-steps", "30", "--checkpoint-dir", "{out}/ckpt")),
    JobKind("lab3_short", "labs/lab3_ddp.py", ("--max-steps", "3",)),
    JobKind("lab1_checks", "labs/lab1_collectives.py", ("--checks-json", "{out}/checks.json")),
    JobKind("lab2_sampler", "labs/lab2_sampler.py", ("--json", "{out}/s.json")),
    JobKind("lab2_join", "labs/lab2_join.py", ("--join", "--json", "{out}/j.json")),
    JobKind("lab5", "labs/lab5_scaling.py",
            ("--config", "comm_bound", "--warmup-steps", "1", "--steps", "2", "--repeats", "1", "--json", "{out}/l5.json")),
    JobKind("lab6", "labs/lab6_ddp_from_scratch.py",
            ("--module", "solutions", "--impl", "all", "--check-steps", "3", "--warmup-steps", "1", "--steps", "2", "--repeats", "1")),
    JobKind("lab7", "labs/lab7_fault_tolerance.py", ("--max-steps", "20", "--checkpoint-dir", "{out}/ckpt"),
            env=tuple(RESTART_SAFE_ENV.items())),  # lab 7 refuses torchrun without it
    JobKind("lecture4_demos", "lectures/scripts/ddp_internals_demos.py", ("--json", "{out}/r.json", "--trace-dir", "{out}/t")),
    JobKind("ddp_minimal", "labs/ddp_minimal.py", ("--epochs", "2", "--save", "{out}/w.pt")),  # lecture 1's script
    JobKind("my_ddp_3_ranks", "solutions/my_ddp.py", ("--epochs", "2", "--save", "{out}/w.pt"), nproc=3),  # the conversion check
    JobKind("minifsdp_check", "tests/scripts/minifsdp_check.py", ("--timeout-s", "30")),  # FSDP from scratch (lab 8)
    JobKind("lecture5_perf", "lectures/scripts/perf_ddp_job.py", ("--out-dir", "{out}", "--parts", "profile,hooks,accumulation,zero,gradscaler")),
)  # fmt: skip


def summarize_log(path: Path) -> int:
    """Per script in a launch log: launches, non-zero exits, aborts at exit. Exit status 1 if any launch
    aborted at exit. Ranks killed by SIGABRT/SIGSEGV are listed with their test but not counted: some
    negative tests crash on purpose (lab 6's ready-order BucketedDDP makes gloo abort on mismatched sizes)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        raise SystemExit(f"{path}: no launches logged (was DDP_COURSE_LAUNCH_LOG set for the run?)")
    by_script: dict[str, list[dict]] = {}
    for record in records:
        by_script.setdefault(record["script"], []).append(record)
    print(f"{'script':<32} launches  non-zero  timed out  aborts at exit")
    for script, runs in sorted(by_script.items()):
        non_zero = sum(r["returncode"] != 0 for r in runs)
        aborts = sum(r["aborted_at_exit"] for r in runs)
        print(f"{script:<32} {len(runs):>8}  {non_zero:>8}  {sum(r['timed_out'] for r in runs):>9}  {aborts:>14}")
    aborted = [r for r in records if r["aborted_at_exit"]]
    signalled = [r for r in records if r["killed_by_signal"] and not r["aborted_at_exit"]]
    print(
        f"{len(records)} launches, {len(aborted)} aborted at exit"
        + "".join(f"\n  aborted at exit: {r['script']} ({r['launched_by']})" for r in aborted)
        + "".join(f"\n  a rank killed by a signal (check that the test expects it): {r['script']} ({r['launched_by']})" for r in signalled)
    )
    return 1 if aborted else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-log", type=Path, help="summarize a launch log (DDP_COURSE_LAUNCH_LOG) instead of launching")
    parser.add_argument("--runs", type=int, default=len(KINDS), help="launches in all, round-robin over the kinds")
    parser.add_argument("--kinds", help="comma-separated kind names (default: all)")
    parser.add_argument("--parallel", type=int, default=1, help="launches at once (2 loads a 2-core machine fully)")
    parser.add_argument("--keep", type=Path, help="where failed launches' outputs go (default: a temporary folder)")
    args = parser.parse_args()
    if args.from_log:
        if not args.from_log.is_file():
            parser.error(f"--from-log {args.from_log}: no such file")
        return summarize_log(args.from_log)
    kinds = [kind for kind in KINDS if not args.kinds or kind.name in args.kinds.split(",")]
    if not kinds or args.runs < 1 or args.parallel < 1:
        parser.error(f"need --runs >= 1, --parallel >= 1 and kinds from: {', '.join(kind.name for kind in KINDS)}")
    root = args.keep or Path(tempfile.mkdtemp(prefix="teardown_"))
    root.mkdir(parents=True, exist_ok=True)

    launches, failures, aborts = Counter(), Counter(), Counter()
    started = time.perf_counter()

    def one(number: int) -> None:
        kind = kinds[number % len(kinds)]
        out = Path(tempfile.mkdtemp(prefix=f"{kind.name}_", dir=root))
        result = kind.launch(out)
        launches[kind.name] += 1
        if not result.ok:
            failures[kind.name] += 1
            aborts[kind.name] += result.aborted_at_exit
            (root / f"{kind.name}-{number}.txt").write_text(result.describe())
            print(
                f"launch {number + 1}: {kind.name} exit {result.returncode}"
                f"{' (abort at exit)' if result.aborted_at_exit else ''} -> {root}/{kind.name}-{number}.txt",
                flush=True,
            )

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        list(pool.map(one, range(args.runs)))

    print(f"{'kind':<24} launches  non-zero  aborts at exit")
    for kind in kinds:
        print(f"{kind.name:<24} {launches[kind.name]:>8}  {failures[kind.name]:>8}  {aborts[kind.name]:>14}")
    total_failures = sum(failures.values())
    print(
        f"{total_failures} of {args.runs} launches exited non-zero ({sum(aborts.values())} aborts at exit), "
        f"{args.parallel} at a time, {time.perf_counter() - started:.0f} s"
    )
    return 1 if total_failures else 0


if __name__ == "__main__":
    sys.exit(main())
