"""Test helper: several runs of lab 3's train() in one torchrun job, one after another.

    torchrun --standalone --nproc_per_node=2 tests/scripts/lab3_runs.py labs/lab3_ddp.py PLAN.json

Every torchrun launch costs seconds (process start-up, torch imports and a rendezvous on every
rank), while a 6-step run of lab 3 takes well under one; tests that compare ten short runs share
one job instead of ten. The runs share one process group: under torchrun a gloo group cannot be
formed a second time in the same process, so the lab's main(), which forms and destroys its own,
cannot be called per run. Each run is what main() does between the two: train(ctx, args) with the
run's flags, rank 0 writes --metrics-json, and a CourseError ends the run with rank 0's one error
line. The lab's own main() and its exit codes are tested by the tests' real launches.

PLAN.json is a list of runs, done in order:

    {"name": "k3", "args": ["--batch-size", "64", ...], "copy": [[source, target], ...], "stale_listing": true}

For each run rank 0 copies the "copy" files and writes "=== run NAME" on stdout and on stderr, so
that a test can cut the output into runs. After the run every rank writes
"[rank r] run NAME: ok" or ": CourseError", and the seconds it took: a test sees that every rank
stopped on a user mistake, not only the rank that printed the message. Any other exception is a
bug; its traceback ends the job with a non-zero exit.
"stale_listing": rank 1 lists a checkpoint directory without its newest file, as a node of a shared
filesystem with a stale cache may (NFS attribute caching): every rank must resume from rank 0's choice.

An entry with "check" instead of "args" runs one of CHECKS, a check of one of the lab's functions that
needs a process group of 2 (it would otherwise cost a launch of its own), with the same markers:

    {"name": "rank0_buffers", "check": "rank0_buffers"}
"""

import gc
import json
import shutil
import sys
import time

import torch
import torch.distributed as dist

from ddp_course.checkpoint import list_checkpoints
from ddp_course.cli import CourseError
from ddp_course.distributed import log, log_error, setup_distributed, teardown_distributed
from ddp_course.launch import import_script

# A rank stuck in a collective fails after this, instead of after the lab's default 300 s.
GROUP_TIMEOUT_S = 60


def stale_listing(directory):
    """The newest checkpoint but one: what a node with a stale directory listing sees as the newest."""
    return list_checkpoints(directory)[-2]


def check_rank0_buffers(lab, ctx) -> str:
    """lab.copy_rank0_buffers gives every rank rank 0's BatchNorm statistics; each rank prints what it holds."""
    model = torch.nn.BatchNorm1d(4)
    # What each rank holds after training: running statistics from its own last micro-batch.
    model.running_mean.fill_(ctx.rank + 1.0)
    model.num_batches_tracked.fill_(10 + ctx.rank)
    lab.copy_rank0_buffers(model)
    # log() writes each line in one write: two ranks' print() calls can interleave on the shared pipe.
    log(f"mean {model.running_mean.tolist()} batches {int(model.num_batches_tracked)}", every_rank=True)
    return "ok"


CHECKS = {"rank0_buffers": check_rank0_buffers}


def run_one(lab, run, ctx) -> str:
    """One run of the plan as main() runs it (or one of CHECKS); returns "ok" or "CourseError"."""
    if "check" in run:
        return CHECKS[run["check"]](lab, ctx)
    args = lab.parse_args(run["args"])
    if ctx.is_main:
        for source, target in run.get("copy", []):
            shutil.copy(source, target)
    dist.barrier()  # the copies exist before any rank looks for checkpoints
    original_latest = lab.latest_checkpoint
    if run.get("stale_listing") and ctx.rank == 1:
        lab.latest_checkpoint = stale_listing
    try:
        metrics = lab.train(ctx, args)
        if args.metrics_json and ctx.is_main:
            lab.atomic_write_json(metrics, args.metrics_json)
        return "ok"
    except CourseError as error:
        log_error(str(error))
        return "CourseError"
    finally:
        lab.latest_checkpoint = original_latest
        gc.collect()  # the run's DDP model and loaders go now, not at the end of the job


def main(lab_path, plan_path) -> int:
    lab = import_script(lab_path)
    sys.argv = [lab_path]  # error lines start with the lab's name, as when it runs itself
    with open(plan_path) as file:
        plan = json.load(file)
    try:
        ctx = setup_distributed("auto", timeout_s=GROUP_TIMEOUT_S)
        for run in plan:
            if ctx.is_main:  # one write per stream: the marker lands whole, before the run's lines
                for stream in (sys.stdout, sys.stderr):
                    stream.write(f"=== run {run['name']}\n")
                    stream.flush()
            dist.barrier()
            started = time.perf_counter()
            outcome = run_one(lab, run, ctx)
            log(f"run {run['name']}: {outcome} in {time.perf_counter() - started:.1f} s", every_rank=True)
            dist.barrier()  # every rank's outcome line is written before the next marker
        return 0
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
