"""The job labs 6, 8 and 9 share: a character-level transformer, its global batch, and how they judge and time it.

Labs 6 (DDP from scratch), 8 (FSDP from scratch) and 9 (FSDP in practice) all train
ddp_course.models.CharTransformer on the standard library's own source (no download) and compare an
implementation with one process: every rank draws the same global batch and takes its own rows, a
difference is judged against a tolerance derived from float32's eps, a verdict holds when it holds on
every rank, and a step's time is the slowest rank's. Those shared parts live here, so that each lab's
script holds what that lab teaches.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_course.cli import CourseError
from ddp_course.data import TEXT_VOCAB_SIZE, sample_windows
from ddp_course.distributed import log
from ddp_course.launch import REPO_ROOT, import_script
from ddp_course.models import CharTransformer

CONTEXT = 64  # characters per window
MODEL_SHAPE = {"context": CONTEXT, "d_model": 128, "n_layers": 4, "n_heads": 4}
CHECK_LR = 0.1  # plain SGD for the checks: its update is linear in the gradient, so rounding stays rounding
# Differences between two correct runs come from summing in another order: about eps relative per
# operation, compounded over the layers and the steps. 64 eps per step, relative to the largest weight,
# leaves a margin of about 100x above the differences seen (1e-7 to 6e-7) and 10x below the control.
EPS_PER_STEP = 64


def new_model(args, ctx):
    torch.manual_seed(args.seed)  # every rank and every implementation starts from the same weights
    return CharTransformer(TEXT_VOCAB_SIZE, **MODEL_SHAPE).to(ctx.device)


def global_batch(tokens, generator, args, ctx):
    """The job's batch, (world_size x batch_size, CONTEXT) inputs and targets; every rank draws the same."""
    inputs, targets = sample_windows(tokens, args.batch_size * ctx.world_size, CONTEXT, generator)
    return inputs.to(ctx.device), targets.to(ctx.device)


def my_rows(tensor, ctx):
    """This rank's shard: rows [rank x B, (rank + 1) x B) of the global batch."""
    per_rank = len(tensor) // ctx.world_size
    return tensor[ctx.rank * per_rank : (ctx.rank + 1) * per_rank]


def job_max(value: float, ctx) -> float:
    """The largest value over all ranks."""
    tensor = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def seconds_per_step(step, steps: int, ctx) -> float:
    """This job's time per step: the slowest rank's, since every step ends in the same all-reduce."""
    dist.barrier()  # start together, so no rank's clock includes waiting for a late peer
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()  # GPU work is asynchronous: wait for it before reading the clock
    return job_max((time.perf_counter() - start) / steps, ctx)


def median_ratio(times: dict, impl: str, other: str) -> float | None:
    """Median over repeats of impl's time / other's time IN THE SAME REPEAT: the two ran back to back,
    so a change in the machine's load between repeats cancels out (a ratio of medians would not)."""
    if not times.get(impl) or not times.get(other):
        return None
    return statistics.median(mine / theirs for mine, theirs in zip(times[impl], times[other]))


@contextmanager
def deadline(seconds: float, case: str):
    """Turn a hang into a FAIL line: if the block is still running after `seconds`, say so and end this
    process (torchrun then stops the other ranks). A timer thread, not only the process group's timeout,
    so that a Python loop waiting for a gradient that never comes is caught too."""

    def give_up():
        log(f"  {case}   FAIL: still running after {seconds:g} s (--case-timeout-s): a hang", every_rank=True)
        sys.stderr.write(f"{Path(sys.argv[0]).name}: error: the check FAILED: {case.split()[0]} hung\n")
        sys.stderr.flush()
        os._exit(1)  # the main thread may be stuck inside a collective: no clean teardown is possible

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def load_learner_module(folder: str, stem: str, file: str | None = None, root: Path = REPO_ROOT):
    """The learner's labs/<stem>.py or the finished solutions/<stem>.py (or a file of their own), imported
    by path: labs/ and solutions/ are not packages, and both hold a module of the same name. root is the
    course's folder as the calling lab finds it from its own file (a test may run a copy elsewhere)."""
    path = Path(file) if file else root / folder / f"{stem}.py"
    if not path.is_file():
        raise CourseError(f"{path} is missing: --module {folder} needs it")
    return import_script(path, name=f"{path.stem if file else folder}_{stem}")
