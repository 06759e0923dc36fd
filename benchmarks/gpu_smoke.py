"""GPU smoke run: every command the course tells a learner to run by hand, once, on a GPU machine.

    python benchmarks/gpu_smoke.py [--only lab1,lab3] [--keep DIR]

Run it first on any GPU machine, before teaching from it. The labs and lectures 5a-5b's job run under
`torchrun --standalone --nproc_per_node=<GPU count> ... --backend nccl` with a timeout, at small
sizes; lab 5's sweep driver runs with plain python, as the learner runs it. Two lecture scripts
are CPU-only by design and start gloo even where GPUs are visible (lecture 4's demos and lecture
6's faults demos): they run here on 2 gloo ranks, without --backend, with the GPUs visible, as a
learner's command would - exactly the case that once crashed lecture 4's script (review finding
1). Lectures 5a-5b's job runs on NCCL, one rank per GPU, like the labs.

The script prints one line per row - PASS or FAIL, wall time, the key figure (lab 1: bus bandwidth
at the largest message; lab 2: checks passed; lab 3: held-out accuracy; lab 4: the solution's
accuracy; lab 5: samples/s and the communication fraction, and the sweep's scaling efficiency;
lab 6: every from-scratch wrapper's check and BucketedDDP's step time against torch DDP's; lab 8: the
check of DDP, the from-scratch FSDP and fully_shard, and FSDP's model state against DDP's; lab 9: every
part's verdict and torch.cuda's peak per implementation; lab 7:
accuracy after a checkpointed run and after a crash that torchrun restarted, and the Join scenario
of the hang lab; lectures 4-6: what each script's report must show) - then `N passed, M failed`.
Rows that need 2 ranks (min_ranks=2: the Join scenario, the 1,2 sweep, labs 8 and 9) are skipped on a 1-GPU
machine with a SKIP line. The exit status is 0 only when every row that ran passed. On a machine without a CUDA GPU it says
so in one line and exits 0 (pytest covers the CPU path).

Not here: lab 4's checker and the benchmarks/ scripts launch their jobs with the GPUs hidden (gloo
on the CPU, by design), so a GPU machine runs them exactly as pytest does; the hang demos that end
in a timeout on purpose (lab 2 without --join, lab 7's broken scenarios) run on gloo by default and
are tested by pytest; multi-node and elastic commands need several machines.

LAB_RUNS is the table of small per-row commands. tests/test_device_discipline.py runs the same
torchrun commands on 2 gloo ranks with every collective's devices checked (two of them in the launches
of the lecture tests that already run them: its CHECKED_ELSEWHERE). To add a command, add a row and a
key-figure function.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ddp_course.checking.verdict import Verdict
from ddp_course.launch import REPO_ROOT, RunResult, run_command, run_torchrun
from ddp_course.resume import RESTART_SAFE_ENV


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
    size = f"{largest['bytes'] / 2**20:g} MiB"
    if largest["world_size"] == 1:  # busbw = algbw * 2(n-1)/n is 0 on one rank: nothing crosses a link
        return f"algbw {largest['algbw_gbps']:.2f} GB/s at {size} (1 rank: no bus traffic, busbw 0)"
    return f"busbw {largest['busbw_gbps']:.2f} GB/s at {size}"


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


def lab8_figure(out: Path) -> str:
    """DDP, the from-scratch FSDP and fully_shard passed lab 8's check (weights, bytes, gathering only around
    use); FSDP's model state against DDP's."""
    records = {record["impl"]: record for record in read_json(out / "lab8.json")}
    failed = sorted(impl for impl, record in records.items() if not record["passed"])
    if failed:
        raise KeyFigureError(f"check failed for {', '.join(failed)}")
    return (
        f"{len(records)}/{len(records)} impls match one process; model state vs DDP: fsdp {records['fsdp']['state_vs_ddp']:.2f}, "
        f"fully_shard {records['fully_shard']['state_vs_ddp']:.2f}"
    )


def lab9_figure(out: Path) -> str:
    """Every part lab 9 ran passed; per implementation the counted peak over the formula and the allocator's
    measured peak less the formula, in W (torch.cuda's on a GPU, absolute since before the model was built);
    on a GPU, the memory snapshots too."""
    report = read_json(out / "lab9.json")
    parts = [part for part in ("memory", "meta", "checkpoint", "clip", "hsdp", "resume") if part in report]
    failed = [part for part in parts if not report[part]["passed"]]
    if failed:
        raise KeyFigureError(f"parts failed: {', '.join(failed)}")
    impls = report["memory"]["impls"]
    if report["device"] == "cuda" and not sorted((out / "snapshots").glob("*.pickle")):
        raise KeyFigureError("no memory snapshot in snapshots/")
    figures = ", ".join(f"{impl} {facts['counted_vs_predicted']:.2f} / {facts['measured_minus_predicted_in_w']:+.2f} W" for impl, facts in impls.items())
    where = "torch.cuda" if report["device"] == "cuda" else "CPU allocator"
    return f"{len(parts)} parts passed ({', '.join(parts)}); counted peak / formula, {where} peak - formula: {figures}"


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


def lab5_sweep_figure(out: Path) -> str:
    """The sweep driver measured every world size it was asked for, with an efficiency for each."""
    records = read_json(out / "sweep.json")
    sizes = sorted(record["world_size"] for record in records)
    if sizes != [1, 2]:
        raise KeyFigureError(f"the sweep measured world sizes {sizes}, not [1, 2]")
    two = next(record for record in records if record["world_size"] == 2)
    return f"world sizes 1 and 2 measured, weak-scaling efficiency at 2: {two['weak_scaling_efficiency']:.2f}"


def lab7_restart_figure(out: Path) -> str:
    """torchrun restarted the crashed job once and it resumed from the step-10 checkpoint."""
    record = read_json(out / "lab7.json")
    if (record["attempt"], record["resumed_from_step"], record["recomputed_steps"]) != (1, 10, 5):
        raise KeyFigureError(f"expected attempt 1 resumed from step 10 with 5 steps recomputed, got attempt {record['attempt']}, "
                             f"step {record['resumed_from_step']}, {record['recomputed_steps']} recomputed")  # fmt: skip
    return f"restarted once, resumed from step 10, 5 steps recomputed, held-out accuracy {record['eval_accuracy']:.1%}"


def lecture4_figure(out: Path) -> str:
    """Lecture 4's demos all ran, on gloo on every rank, and wrote their profiler traces."""
    report = read_json(out / "report.json")
    backends = sorted({facts["backend"] for facts in report["environment"]})
    if backends != ["gloo"]:
        raise KeyFigureError(f"the demos ran on {backends}, not gloo (they use CPU tensors)")
    if not report.get("overlap_traces") or not sorted((out / "traces").glob("*/*.json")):
        raise KeyFigureError("no profiler traces in traces/")
    return f"{len(report)} demos on gloo, {len(report['environment'])} ranks, traces written"


def lecture5_figure(out: Path) -> str:
    """Lectures 5a-5b's job wrote every part, and the fp16 hook sent half of the plain all-reduce's bytes."""
    perf = read_json(out / "perf.json")
    missing = [part for part in LECTURE5_PARTS if part not in perf]
    if missing:
        raise KeyFigureError(f"perf.json lacks part(s) {', '.join(missing)}")
    plain, fp16 = perf["hooks"]["allreduce"]["bytes_per_step"], perf["hooks"]["fp16"]["bytes_per_step"]
    if fp16 * 2 != plain:
        raise KeyFigureError(f"the fp16 hook sent {fp16} bytes per step, not half of {plain}")
    return f"{len(LECTURE5_PARTS)} parts on {perf['backend']}, fp16 hook sends half the bytes, comm fraction {perf['buckets'][0]['comm_fraction']:.2f}"


def lecture6_figure(out: Path) -> str:
    """Lecture 6's demos show what the lecture says: silent divergence, an error on every rank, a recorded hang."""
    ranks = read_json(out / "faults.json")["per_rank"]
    expected = {"load_after_wrap_on_rank0": False, "load_before_wrap_everywhere": True}
    if any(facts["replicas_identical"] != expected for facts in ranks):
        raise KeyFigureError(f"replicas after loading: {[facts['replicas_identical'] for facts in ranks]}, expected {expected}")
    if any(facts["unused_parameter"]["raised_at_iteration"] != 1 for facts in ranks):
        raise KeyFigureError("the unused parameter did not raise at iteration 1 on every rank")
    if any(facts["flight_recorder"]["entries"] == 0 for facts in ranks):
        raise KeyFigureError("a rank's flight recorder holds no entry of the hang demo")
    return f"{len(ranks)} ranks: load after wrap diverges, unused parameter raises at iteration 1, flight recorder dumped"


def lecture7_figure(out: Path) -> str:
    """Lecture 7: fully_shard holds about 1/N of DDP's bytes, sends 1.5x, and DCP reloads equal weights."""
    report = read_json(out / "report.json")
    n = report["world_size"]
    ddp, fsdp = report["memory"][f"ddp/{n}"][0], report["memory"][f"fsdp/{n}"][0]
    if not (report["checkpoint"]["equal_on_4"] and report["checkpoint"]["equal_on_1"]):
        raise KeyFigureError("the DCP checkpoint reloaded different weights")
    return (
        f"{n} ranks: fully_shard holds {fsdp['held']['total'] / ddp['held']['total']:.2f}x DDP's bytes, "
        f"sends {fsdp['wire'] / ddp['wire']:.2f}x; DCP 2 -> {n} ranks and -> 1 process equal"
    )


@dataclass(frozen=True)
class LabRun:
    name: str
    script: str  # relative to the repository root
    args: tuple[str, ...]  # "{out}" stands for a fresh directory of this run
    key_figure: Callable[[Path], str]
    gpu_only: bool = False  # e.g. --amp, which the labs refuse on the CPU
    min_ranks: int = 1  # a lab that needs more processes than the machine has GPUs is skipped
    timeout_s: float = 300
    gloo_by_design: bool = False  # CPU tensors only: always 2 gloo ranks, no --backend flag (GPUs stay visible)
    torchrun_args: tuple[str, ...] = ()  # e.g. --max-restarts=1
    env: tuple[tuple[str, str], ...] = ()  # extra environment for torchrun and its workers
    plain_python: bool = False  # a driver the learner runs with python; it launches its own torchrun jobs

    def command_args(self, out: Path, backend: str) -> list[str]:
        args = [arg.replace("{out}", str(out)) for arg in self.args]
        return args if self.gloo_by_design else args + ["--backend", backend]

    def ranks(self, gpus: int) -> int:
        """Processes per run on a machine with this many GPUs: one per GPU, or 2 for a CPU-only script."""
        return 2 if self.gloo_by_design else gpus


def run_row(lab: LabRun, out: Path, gpus: int) -> RunResult:
    """Launch one row as a learner would on this machine: GPUs visible, NCCL unless the script is CPU-only."""
    args = lab.command_args(out, "nccl")
    if lab.plain_python:
        return run_command([sys.executable, str(REPO_ROOT / lab.script), *args], timeout_s=lab.timeout_s, use_gpus=True)
    return run_torchrun(REPO_ROOT / lab.script, args, nproc=lab.ranks(gpus), timeout_s=lab.timeout_s, use_gpus=True,
                        env=dict(lab.env), torchrun_args=list(lab.torchrun_args))  # fmt: skip


LAB_RUNS = (
    LabRun("lab1", "labs/lab1_collectives.py",
           ("--bench", "--max-bytes", "4M", "--factor", "4", "--warmup", "1", "--iters", "3", "--json", "{out}/lab1.json"), lab1_figure),
    LabRun("lab2_sampler", "labs/lab2_sampler.py", ("--train-steps", "2", "--eval-size", "64", "--json", "{out}/lab2.json"), lab2_sampler_figure),
    LabRun("lab2_join", "labs/lab2_join.py", ("--join", "--json", "{out}/join.json"), lab2_join_figure),
    LabRun("lab3", "labs/lab3_ddp.py",
           ("--epochs", "1", "--checkpoint-dir", "{out}/checkpoints", "--metrics-json", "{out}/lab3.json"), accuracy_figure("lab3.json")),
    LabRun("lab3_amp", "labs/lab3_ddp.py", ("--epochs", "1", "--amp", "--metrics-json", "{out}/lab3.json"), accuracy_figure("lab3.json"), gpu_only=True),
    LabRun("lab4_solution", "solutions/lab4_broken_ddp.py", ("--max-steps", "10", "--metrics-json", "{out}/lab4.json"), accuracy_figure("lab4.json")),
    # Lab 5's rows warm up 2 steps, the lab's default: on one H200, 1 warm-up step left DDP's bucket rebuild
    # in the timed steps (comm fraction 0.87 and 0.91 on one rank; 0.27 and 0.33 with 2 warm-up steps).
    LabRun("lab5", "labs/lab5_scaling.py",
           ("--config", "comm_bound", "--warmup-steps", "2", "--steps", "2", "--repeats", "1", "--json", "{out}/lab5.json"), lab5_figure),
    # Labs 6 and 8 warm up as many steps as their defaults (3 and 2): 1 left torch DDP's bucket rebuild in lab 5's
    # timed steps on one H200 (above); their rows used 1 until 2026-11-30, not yet re-run on a GPU.
    LabRun("lab6", "labs/lab6_ddp_from_scratch.py",
           ("--module", "solutions", "--impl", "all", "--zero", "--check-steps", "3", "--warmup-steps", "3", "--steps", "2",
            "--repeats", "1", "--json", "{out}/lab6.json"), lab6_figure),
    # Lab 8: torch DDP, the from-scratch FSDP and fully_shard (a DeviceMesh of every GPU) on NCCL. Sharding
    # over one rank shards nothing (the lab refuses it): 2+ GPUs.
    LabRun("lab8", "labs/lab8_fsdp.py",
           ("--module", "solutions", "--impl", "ddp", "--impl", "fsdp", "--impl", "fully_shard", "--check-steps", "2",
            "--warmup-steps", "2", "--steps", "1", "--repeats", "1", "--json", "{out}/lab8.json"), lab8_figure, min_ranks=2),
    # Lab 9 on every GPU: its 4-rank parts (HSDP, resuming) run where the GPU count is even and 4 or more, and say
    # "skipped" otherwise; the memory part writes a torch.cuda memory snapshot per implementation.
    LabRun("lab9", "labs/lab9_fsdp_practice.py",
           ("--json", "{out}/lab9.json", "--checkpoint-dir", "{out}/checkpoints", "--snapshot-dir", "{out}/snapshots"), lab9_figure,
           min_ranks=2),
    # Lecture 7's demos, one rank per GPU (NCCL, cuda:LOCAL_RANK); its 2-rank numbers use ranks 0-1, so 2+ GPUs.
    LabRun("lecture7_sharding", "lectures/scripts/sharding_demos.py",
           ("--json", "{out}/report.json", "--checkpoint-dir", "{out}/checkpoint"), lecture7_figure, min_ranks=2),
    # Lab 7 refuses torchrun's shared agent store on every launch (its docstring), restarts or not.
    LabRun("lab7", "labs/lab7_fault_tolerance.py",
           ("--max-steps", "20", "--checkpoint-dir", "{out}/checkpoints", "--metrics-json", "{out}/lab7.json"), accuracy_figure("lab7.json"),
           env=tuple(RESTART_SAFE_ENV.items())),
    LabRun("lab7_hangs_join", "labs/lab7_hangs.py", ("--scenario", "uneven-join", "--json", "{out}/hangs.json"), lab7_hangs_figure,
           min_ranks=2),
    LabRun("lab5_resnet18_amp", "labs/lab5_scaling.py",
           ("--config", "resnet18", "--amp", "--warmup-steps", "2", "--steps", "5", "--repeats", "1", "--json", "{out}/lab5.json"), lab5_figure, gpu_only=True),
    # The README's and lab 5 sheet's sweep: the driver starts a 1-rank and a 2-rank job on the GPUs it sees.
    LabRun("lab5_sweep", "labs/lab5_scaling.py",
           ("--sweep", "1,2", "--configs", "comm_bound", "--warmup-steps", "2", "--steps", "2", "--repeats", "1", "--rounds", "1",
            "--json", "{out}/sweep.json"), lab5_sweep_figure, min_ranks=2, plain_python=True),
    # The README's crash-and-restart run; rank 0 crashes, so that it runs on one GPU too.
    LabRun("lab7_restart", "labs/lab7_fault_tolerance.py",
           ("--max-steps", "20", "--checkpoint-dir", "{out}/checkpoints", "--crash-at-step", "15", "--crash-rank", "0",
            "--metrics-json", "{out}/lab7.json"), lab7_restart_figure,
           torchrun_args=("--max-restarts=1",), env=tuple(RESTART_SAFE_ENV.items())),
    # Lab 10's fixed script on NCCL (the sheet's GPU track, section 6): one epoch's steps, then its accuracy.
    LabRun("lab10_solution", "solutions/lab10_slow_ddp.py", ("--max-steps", "10", "--metrics-json", "{out}/lab10.json"),
           accuracy_figure("lab10.json")),
    LabRun("lecture4_demos", "lectures/scripts/ddp_internals_demos.py", ("--json", "{out}/report.json", "--trace-dir", "{out}/traces"),
           lecture4_figure, gloo_by_design=True),
    LabRun("lecture5_perf_job", "lectures/scripts/perf_ddp_job.py",
           ("--out-dir", "{out}", "--hook-steps", "11", "--profile-steps", "2", "--bucket-caps", "default,25", "--timing-steps", "1",
            "--timing-repeats", "1", "--accumulation-steps", "2"), lecture5_figure),
    LabRun("lecture6_faults", "lectures/scripts/faults_demos.py", ("--json", "{out}/faults.json", "--trace-dir", "{out}/flight_recorder"),
           lecture6_figure, gloo_by_design=True),
)  # fmt: skip
LECTURE5_PARTS = ("profile", "hooks", "buckets", "accumulation", "zero", "gradscaler")  # perf_ddp_job.py's default --parts


@dataclass(frozen=True)
class Outcome(Verdict):
    """One lab's smoke run: the course's Verdict (PASS with the key figure, or FAIL with why) and its wall time."""

    wall_s: float = 0.0

    @classmethod
    def of(cls, name: str, passed: bool, wall_s: float, detail: str) -> Outcome:
        return cls(name, "PASS" if passed else "FAIL", detail, wall_s=wall_s)

    @property
    def name(self) -> str:
        return self.check

    @property
    def detail(self) -> str:
        return self.evidence


def judge(lab: LabRun, result: RunResult, out: Path) -> Outcome:
    """PASS needs exit status 0 and a key figure that shows success; anything else is a FAIL with a reason."""
    if result.timed_out:
        return Outcome.of(lab.name, False, result.wall_s, f"timed out after {lab.timeout_s:g} s")
    if not result.ok:
        return Outcome.of(lab.name, False, result.wall_s, f"exit status {result.returncode}: {last_error_line(result.stderr)}")
    try:
        return Outcome.of(lab.name, True, result.wall_s, lab.key_figure(out))
    except (KeyFigureError, KeyError, TypeError) as error:
        return Outcome.of(lab.name, False, result.wall_s, f"ran, but {error}")


def last_error_line(stderr: str) -> str:
    """The most telling line of a failed run's stderr: the ranks' last line that names an error, else their last line.

    torchrun's own report (its log lines, and everything from its "failed (exitcode" line on) is left out:
    it names an error in every failed run ("ChildFailedError", ".../elastic/errors.html") but never its cause.
    """
    ranks_lines = []
    for line in (line.strip() for line in stderr.splitlines()):
        if "failed (exitcode" in line:
            break
        if line and not TORCHRUN_LOG_LINE.match(line):
            ranks_lines.append(line)
    for line in reversed(ranks_lines):
        if "error" in line.lower() or "exception" in line.lower():
            return line[:200]
    return ranks_lines[-1][:200] if ranks_lines else "no output on stderr before torchrun's failure report"


TORCHRUN_LOG_LINE = re.compile(r"[IWE]\d{4} \d\d:\d\d:\d\d")  # glog style: W1130 00:28:23.980000 807 api.py:1012] ...


def format_line(outcome: Outcome) -> str:
    return f"{outcome.status}  {outcome.name:<18} {outcome.wall_s:6.1f} s  {outcome.detail}"


def summary(outcomes: list[Outcome]) -> tuple[str, int]:
    """The final line and the exit status (0 only when every lab passed and at least one ran)."""
    passed = sum(outcome.passed for outcome in outcomes)
    failed = len(outcomes) - passed
    return f"{passed} passed, {failed} failed", 0 if outcomes and failed == 0 else 1


def pinned_torch_range() -> tuple[str, str] | None:
    """("2.14", ">=2.14,<2.15") from requirements.txt's torch line, or None if it has none of that form."""
    for line in (REPO_ROOT / "requirements.txt").read_text().splitlines():
        match = re.match(r"torch\s*(>=(\d+\.\d+)[^\s#]*)", line)
        if match:
            return match.group(2), match.group(1)
    return None


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

    print(
        f"gpu_smoke: {gpus} GPU(s) ({torch.cuda.get_device_name(0)}), torch {torch.__version__}, NCCL, {gpus} rank(s) per lab "
        "(the CPU-only lecture scripts: 2 gloo ranks)",
        flush=True,
    )
    pinned = pinned_torch_range()
    if pinned and not torch.__version__.startswith(pinned[0]):
        print(f"note: requirements.txt pins torch {pinned[1]}; on torch {torch.__version__} a row that uses a newer API fails", flush=True)
    root = args.keep or Path(tempfile.mkdtemp(prefix="gpu_smoke_"))
    outcomes = []
    for lab in (lab for lab in LAB_RUNS if lab.name in names):
        if gpus < lab.min_ranks and not lab.gloo_by_design:
            print(f"SKIP  {lab.name:<18} needs {lab.min_ranks} GPUs, this machine has {gpus}", flush=True)
            continue
        out = root / lab.name
        out.mkdir(parents=True, exist_ok=True)
        result = run_row(lab, out, gpus)
        (out / "output.txt").write_text(result.describe())  # everything, for a FAIL's post-mortem
        outcomes.append(judge(lab, result, out))
        print(format_line(outcomes[-1]), flush=True)
    line, status = summary(outcomes)
    print(f"{line} (each run's output: {root}/<lab>/output.txt)")
    return status


if __name__ == "__main__":
    sys.exit(main())
