"""GPU smoke run: every lab once with NCCL on all visible GPUs, small sizes, one line per lab.

    python benchmarks/gpu_smoke.py [--only lab1,lab3] [--keep DIR]

Run it first on any GPU machine, before teaching from it: each lab script runs under
`torchrun --standalone --nproc_per_node=<GPU count> ... --backend nccl` with a timeout, and the
script prints one line per lab - PASS or FAIL, wall time, the lab's key figure (lab 1: bus
bandwidth at the largest message; lab 2: checks passed; lab 3: held-out accuracy; lab 4: the
solution's accuracy; lab 5: samples/s and the communication fraction; lab 6: every from-scratch wrapper's check and
BucketedDDP's step time against torch DDP's; lab 7: accuracy after a checkpointed run, and the Join
scenario of the hang lab, which needs 2 GPUs) - then `N passed, M failed`.
The exit status is 0 only when every lab passed. On a machine without a CUDA GPU it says so in one
line and exits 0 (pytest covers the CPU path).

LAB_RUNS is the table of small per-lab commands. tests/test_device_discipline.py runs the same
commands on 2 gloo ranks with every collective's devices checked. To add a lab, add a row and a
key-figure function.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ddp_course.launch import REPO_ROOT, RunResult, run_torchrun


class KeyFigureError(Exception):
    """The lab ran but its output does not show success (a failed check, a missing file)."""


def read_json(path: Path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise KeyFigureError(f"no readable {Path(path).name} ({type(error).__name__})") from None


def lab1_figure(out: Path) -> str:
    """Bus bandwidth at the largest message of lab 1's --json benchmark records."""
    records = read_json(out / "lab1.json")
    if not records:
        raise KeyFigureError("lab1.json holds no benchmark record")
    largest = max(records, key=lambda record: record["bytes"])
    return f"busbw {largest['busbw_gbps']:.2f} GB/s at {largest['bytes'] / 2**20:g} MiB"


def lab2_sampler_figure(out: Path) -> str:
    checks = read_json(out / "lab2.json")["checks"]
    failed = sorted(name for name, passed in checks.items() if not passed)
    if failed:
        raise KeyFigureError(f"checks failed: {', '.join(failed)}")
    return f"{len(checks)}/{len(checks)} sampler checks passed"


def lab2_join_figure(out: Path) -> str:
    report = read_json(out / "join.json")
    if not report["same_weights_on_every_rank"]:
        raise KeyFigureError("the ranks' weights differ after Join")
    return f"steps per rank {report['steps_per_rank']}, identical weights, accuracy {report['eval_accuracy']:.1%}"


def accuracy_figure(file_name: str) -> Callable[[Path], str]:
    def figure(out: Path) -> str:
        return f"held-out accuracy {read_json(out / file_name)['eval_accuracy']:.1%}"

    return figure


def lab6_figure(out: Path) -> str:
    """Every from-scratch wrapper passed lab 6's check; BucketedDDP's step time against torch DDP's."""
    records = {record["impl"]: record for record in read_json(out / "lab6.json")}
    failed = sorted(impl for impl, record in records.items() if not record["check_passed"])
    if failed:
        raise KeyFigureError(f"check failed for {', '.join(failed)}")
    return f"{len(records)}/{len(records)} impls match one process; bucketed/torch step time {records['bucketed']['vs_torch_ddp']:.2f}"


def lab7_hangs_figure(out: Path) -> str:
    """The Join scenario finished with identical weights that follow the Join rule."""
    report = read_json(out / "hangs.json")
    line = report["line"]
    proofs = ("identical weights on every rank: True", "equal to the Join rule computed in one process: True")
    if report["status"] != 0 or not all(proof in line for proof in proofs):
        raise KeyFigureError(f"the Join scenario did not end correctly: {line}")
    return f"{line.split(';')[0]}, identical weights equal to the Join rule"


def lab5_figure(out: Path) -> str:
    record = read_json(out / "lab5.json")
    return f"{record['samples_per_s']:.0f} samples/s, comm fraction {record['comm_fraction']:.2f}"


@dataclass(frozen=True)
class LabRun:
    name: str
    script: str  # relative to the repository root
    args: tuple[str, ...]  # "{out}" stands for a fresh directory of this run
    key_figure: Callable[[Path], str]
    gpu_only: bool = False  # e.g. --amp, which the labs refuse on the CPU
    min_ranks: int = 1  # a lab that needs more processes than the machine has GPUs is skipped
    timeout_s: float = 300

    def command_args(self, out: Path, backend: str) -> list[str]:
        return [arg.replace("{out}", str(out)) for arg in self.args] + ["--backend", backend]


LAB_RUNS = (
    LabRun("lab1", "labs/lab1_collectives.py",
           ("--bench", "--max-bytes", "4M", "--factor", "4", "--warmup", "1", "--iters", "3", "--json", "{out}/lab1.json"), lab1_figure),
    LabRun("lab2_sampler", "labs/lab2_sampler.py", ("--train-steps", "2", "--eval-size", "64", "--json", "{out}/lab2.json"), lab2_sampler_figure),
    LabRun("lab2_join", "labs/lab2_join.py", ("--join", "--json", "{out}/join.json"), lab2_join_figure),
    LabRun("lab3", "labs/lab3_ddp.py",
           ("--epochs", "1", "--checkpoint-dir", "{out}/checkpoints", "--metrics-json", "{out}/lab3.json"), accuracy_figure("lab3.json")),
    LabRun("lab3_amp", "labs/lab3_ddp.py", ("--epochs", "1", "--amp", "--metrics-json", "{out}/lab3.json"), accuracy_figure("lab3.json"), gpu_only=True),
    LabRun("lab4_solution", "solutions/lab4_broken_ddp.py", ("--max-steps", "10", "--metrics-json", "{out}/lab4.json"), accuracy_figure("lab4.json")),
    LabRun("lab5", "labs/lab5_scaling.py",
           ("--config", "comm_bound", "--warmup-steps", "1", "--steps", "2", "--repeats", "1", "--json", "{out}/lab5.json"), lab5_figure),
    LabRun("lab6", "labs/lab6_ddp_from_scratch.py",
           ("--module", "solutions", "--impl", "all", "--zero", "--check-steps", "3", "--warmup-steps", "1", "--steps", "2",
            "--repeats", "1", "--json", "{out}/lab6.json"), lab6_figure),
    LabRun("lab7", "labs/lab7_fault_tolerance.py",
           ("--max-steps", "20", "--checkpoint-dir", "{out}/checkpoints", "--metrics-json", "{out}/lab7.json"), accuracy_figure("lab7.json")),
    LabRun("lab7_hangs_join", "labs/lab7_hangs.py", ("--scenario", "uneven-join", "--json", "{out}/hangs.json"), lab7_hangs_figure,
           min_ranks=2),
    LabRun("lab5_resnet18_amp", "labs/lab5_scaling.py",
           ("--config", "resnet18", "--amp", "--warmup-steps", "2", "--steps", "5", "--repeats", "1", "--json", "{out}/lab5.json"), lab5_figure, gpu_only=True),
)  # fmt: skip


@dataclass(frozen=True)
class Outcome:
    name: str
    passed: bool
    wall_s: float
    detail: str  # the key figure, or why it failed


def judge(lab: LabRun, result: RunResult, out: Path) -> Outcome:
    """PASS needs exit status 0 and a key figure that shows success; anything else is a FAIL with a reason."""
    if result.timed_out:
        return Outcome(lab.name, False, result.wall_s, f"timed out after {lab.timeout_s:g} s")
    if not result.ok:
        return Outcome(lab.name, False, result.wall_s, f"exit status {result.returncode}: {last_error_line(result.stderr)}")
    try:
        return Outcome(lab.name, True, result.wall_s, lab.key_figure(out))
    except (KeyFigureError, KeyError, TypeError) as error:
        return Outcome(lab.name, False, result.wall_s, f"ran, but {error}")


def last_error_line(stderr: str) -> str:
    """The most telling line of a failed run's stderr: the last one that names an error."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in reversed(lines):
        if "error" in line.lower() or "exception" in line.lower():
            return line[:200]
    return lines[-1][:200] if lines else "no output on stderr"


def format_line(outcome: Outcome) -> str:
    return f"{'PASS' if outcome.passed else 'FAIL'}  {outcome.name:<18} {outcome.wall_s:6.1f} s  {outcome.detail}"


def summary(outcomes: list[Outcome]) -> tuple[str, int]:
    """The final line and the exit status (0 only when every lab passed and at least one ran)."""
    passed = sum(outcome.passed for outcome in outcomes)
    failed = len(outcomes) - passed
    return f"{passed} passed, {failed} failed", 0 if outcomes and failed == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated lab names from the table (default: all)")
    parser.add_argument("--keep", type=Path, help="keep every run's files under this directory")
    args = parser.parse_args()

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0:
        print("gpu_smoke: no CUDA GPU is visible on this machine; nothing to run (pytest covers the CPU/gloo path)")
        return 0
    names = args.only.split(",") if args.only else [lab.name for lab in LAB_RUNS]
    unknown = sorted(set(names) - {lab.name for lab in LAB_RUNS})
    if unknown:
        parser.error(f"unknown lab(s) {', '.join(unknown)}; the table has {', '.join(lab.name for lab in LAB_RUNS)}")

    print(f"gpu_smoke: {gpus} GPU(s) ({torch.cuda.get_device_name(0)}), torch {torch.__version__}, NCCL, {gpus} rank(s) per lab", flush=True)
    root = args.keep or Path(tempfile.mkdtemp(prefix="gpu_smoke_"))
    outcomes = []
    for lab in (lab for lab in LAB_RUNS if lab.name in names):
        if gpus < lab.min_ranks:
            print(f"SKIP  {lab.name:<18} needs {lab.min_ranks} GPUs, this machine has {gpus}", flush=True)
            continue
        out = root / lab.name
        out.mkdir(parents=True, exist_ok=True)
        result = run_torchrun(REPO_ROOT / lab.script, lab.command_args(out, "nccl"), nproc=gpus, timeout_s=lab.timeout_s, use_gpus=True)
        (out / "output.txt").write_text(result.describe())  # everything, for a FAIL's post-mortem
        outcomes.append(judge(lab, result, out))
        print(format_line(outcomes[-1]), flush=True)
    line, status = summary(outcomes)
    print(f"{line} (each run's output: {root}/<lab>/output.txt)")
    return status


if __name__ == "__main__":
    sys.exit(main())
