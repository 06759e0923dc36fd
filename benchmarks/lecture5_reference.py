"""Record lecture 5a's reference run: the measurements too long for the notebook's 30 seconds.

    flock /tmp/ddp_heavy.lock python benchmarks/lecture5_reference.py

(a few minutes on a 2-vCPU machine; run it on an otherwise idle machine, then re-execute the lecture:
`python -m ddp_course.authoring.notebooks lectures/05a_step_time.ipynb`.) It launches
lectures/scripts/perf_ddp_job.py twice under torchrun with 2 CPU ranks (gloo, one thread each):

1. --parts profile,buckets,hooks on lab 5's comm_bound configuration: 5 profiled steps, lab 5's
   DDP / no_sync timing at bucket caps default,1,25,100 (10 steps x 3 repeats, medians), and the
   digits CNN trained for 300 steps with each communication hook;
2. --parts buckets on lab 5's resnet18 at 16 images per rank: a deep network, whose long backward
   pass gives the buckets something to overlap with.

It reads the profiled steps back (ddp_course.profiling) and keeps, per rank and step, the phase
times and the communication left after the last gradient computation, then writes everything,
with the machine it ran on, to OUT/lecture5_reference.json (default OUT:
solutions/lecture5_reference). Traces themselves are not kept (hundreds of kB each).
"""

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

from ddp_course import profiling
from ddp_course.checkpoint import atomic_write_json
from ddp_course.launch import REPO_ROOT, run_torchrun

JOB = REPO_ROOT / "lectures" / "scripts" / "perf_ddp_job.py"
COMM_BOUND_JOB = ["--parts", "profile,buckets,hooks", "--profile-steps", "5", "--timing-steps", "10",
                  "--timing-repeats", "3", "--hook-steps", "300", "--hooks", "allreduce,bf16_autocast,fp16,bf16,powerSGD"]  # fmt: skip
RESNET_JOB = ["--parts", "buckets", "--bucket-config", "resnet18", "--bucket-batch", "16", "--timing-steps", "5", "--timing-repeats", "3"]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_job(flags: list[str], out_dir: Path) -> dict:
    job = run_torchrun(JOB, ["--out-dir", out_dir, *flags], nproc=2, timeout_s=1800)
    if not job.ok:
        print(job.describe(), file=sys.stderr)
        raise SystemExit(f"lecture5_reference.py: error: the job {' '.join(flags)} failed (its output is above)")
    return json.loads((out_dir / "perf.json").read_text())


def profiled_steps(trace_dir: Path) -> list[dict]:
    """Per rank and traced step: phase times, all-reduce count, and what backward spent after its last
    gradient computation (waiting for the all-reduces it could not hide), in milliseconds."""
    rows = []
    for rank, timelines in profiling.read_traces(trace_dir).items():
        for t in timelines:
            phases = {name: span.duration_us / 1e3 for name, span in t.phases.items()}
            exposed = (t.phases["backward"].end_us - t.gradient_compute_end_us) / 1e3
            rows.append({"rank": rank, "step": t.step, "step_ms": t.span.duration_us / 1e3, "phase_ms": phases,
                         "all_reduces": len(t.communication), "backward_after_last_gradient_ms": exposed})  # fmt: skip
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO_ROOT / "solutions" / "lecture5_reference"), help="folder for the JSON")
    args = parser.parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    with tempfile.TemporaryDirectory(prefix="lecture5_reference_") as scratch:
        comm_bound = run_job(COMM_BOUND_JOB, Path(scratch) / "comm_bound")
        comm_bound["profile"]["steps_profiled"] = profiled_steps(Path(scratch) / "comm_bound" / "traces")
        resnet = run_job(RESNET_JOB, Path(scratch) / "resnet18")
    record = {
        "machine": {
            "cpu": cpu_model(),
            "logical_cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },  # fmt: skip
        "recorded_utc": started.strftime("%Y-%m-%d %H:%M"),
        "command": "python benchmarks/lecture5_reference.py",
        "jobs": {"comm_bound": " ".join(COMM_BOUND_JOB), "resnet18": " ".join(RESNET_JOB)},
        "comm_bound": comm_bound,
        "resnet18": resnet,
    }
    path = Path(args.out) / "lecture5_reference.json"
    atomic_write_json(record, path)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
