"""Lab 5, the scaling assessment: how fast does DDP train on N processes, and where does time go?

One run (under torchrun) times training steps of one configuration twice: with DDP's gradient
all-reduce, and under `ddp_model.no_sync()`, which skips it. The difference is the communication
that the backward pass could not hide:  comm_fraction = 1 - step_time(no_sync) / step_time(DDP).

    one measurement, 2 CPU processes:  torchrun --standalone --nproc_per_node=2 labs/lab5_scaling.py --config comm_bound
    the checkpoint sweep (no torchrun): python labs/lab5_scaling.py --sweep 1,2 --json runs/scaling.json
    bucket sizes too:                   python labs/lab5_scaling.py --sweep 1,2 --bucket-caps default,1,25,100 --json runs/b.json
    fp16 gradient compression:          python labs/lab5_scaling.py --sweep 1,2 --comm-hook fp16 --json runs/fp16.json
    strong scaling (fixed global batch): python labs/lab5_scaling.py --sweep 1,2 --global-batch 64 --json runs/s.json

GPU commands (NCCL). Written with care but NOT YET RUN on a GPU: the course has only ever run this
lab on CPUs with gloo. --amp picks bf16 on GPUs with native bf16 (compute capability 8.0+), else
fp16 with a GradScaler (ddp_course.amp); the record says which ("amp").
    8 GPUs:  python labs/lab5_scaling.py --sweep 1,2,4,8 --configs resnet18 --amp --json runs/gpu.json
    2 nodes: on each node, torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
             --rdzv-endpoint=NODE0_HOST:29400 --rdzv-id=lab5 labs/lab5_scaling.py --config resnet18 --amp --json runs/2x8.json

How it copes with noise: inside one job, DDP and no_sync timings alternate --repeats times and each
mode keeps the MEDIAN of its repeats; the sweep (labs/lab5_sweep.py, started by --sweep) runs every
point in --rounds interleaved jobs and keeps the FASTEST round (see run_sweep there). So: median of
repeats within a job, fastest of rounds across jobs.

What you should see on a 2-core CPU: the sweep runs 8 short torchrun jobs and prints a table in
about a minute and a half (80-84 s in three sweeps on the course's 2-vCPU machine; machines of the
same kind differ about 2x). compute_bound (a small CNN, 0.4 MB of gradients per step) keeps most of
its per-rank throughput at 2 ranks (weak-scaling efficiency 0.87-0.98 in those sweeps); comm_bound
(a wide MLP, 52 MB of gradients per step) loses about half of it (0.34-0.59: its short steps make
it the noisier of the two), and its comm_fraction says why. The sweep pins one
thread per rank (OMP_NUM_THREADS=1) so that 1 and 2 ranks compare fairly.
"""

import contextlib
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.amp import choose_amp
from ddp_course.checkpoint import atomic_write_json
from ddp_course.cli import CourseArgumentParser, CourseError, int_list, name_list, positive_float, positive_int
from ddp_course.distributed import BACKENDS, log, log_error, setup_distributed, teardown_distributed
from ddp_course.models import build_model
from ddp_course.reporting import format_table
from lab5_sweep import cap_label, run_sweep  # the file beside this one: the sweep's bookkeeping


@dataclass(frozen=True)
class Config:
    model: str
    input_shape: tuple
    batch_size: int  # per rank, unless --global-batch sets it
    purpose: str


CONFIGS = {
    "comm_bound": Config("wide_mlp", (256,), 4, "13 M parameters, 26 MFLOP per sample: gradient traffic dominates"),
    "compute_bound": Config("conv_net", (3, 32, 32), 64, "0.1 M parameters, 77 MFLOP per image: arithmetic dominates"),
    "resnet18": Config("resnet18", (3, 32, 32), 128, "11 M parameters on CIFAR-sized images: the realistic GPU case"),
}
# Gradient compression: the hook casts each bucket to 16 bits before the all-reduce (half the bytes)
# and back afterwards. Both run on gloo too (bf16 checked on torch 2.14.1; lecture 5a section 7).
COMM_HOOKS = {"none": None, "fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}
# DDP's own default is bucket_cap_mb=None, NOT 25: buckets of 25 MiB except the first one (the last
# gradients of the model), which is capped at 1 MiB so that communication starts early. Passing 25
# explicitly switches that small first bucket off. Source: _BucketCapacityConfig.create in
# torch/nn/parallel/distributed.py (torch 2.14): is_using_default = bucket_cap_mb is None, and then
# first_bucket_bytes_cap = dist._DEFAULT_FIRST_BUCKET_BYTES (1 MiB).
DEFAULT_BUCKETS = "default"


def bucket_cap(text: str):
    """--bucket-cap-mb value: "default" (DDP's own choice, bucket_cap_mb=None) or a size in MiB."""
    return DEFAULT_BUCKETS if text.strip() == DEFAULT_BUCKETS else positive_float(text)


def bucket_cap_list(text: str) -> list:
    """ "default,1,25" -> ["default", 1.0, 25.0]."""
    return [bucket_cap(part) for part in text.split(",")]


def parse_args(argv=None):
    parser = CourseArgumentParser(prog="lab5_scaling.py", description="Measure DDP throughput and communication.")
    parser.add_argument("--config", choices=CONFIGS, default="compute_bound", help="what one torchrun job measures")
    parser.add_argument("--batch-size", type=positive_int, help="per rank (default: the config's)")
    parser.add_argument("--global-batch", type=positive_int, help="strong scaling: split this batch over the ranks")
    parser.add_argument(
        "--bucket-cap-mb",
        type=bucket_cap,
        default=DEFAULT_BUCKETS,
        help="DDP gradient bucket size in MiB, or 'default' (DDP's: 1 MiB first bucket, then 25 MiB)",
    )
    # Two warm-up steps at least: DDP rebuilds its buckets in the second iteration's forward (in
    # the order the gradients became ready), and that one-off cost must stay out of the timings.
    parser.add_argument("--warmup-steps", type=positive_int, default=2, help="untimed steps first (2: past DDP's bucket rebuild)")
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps per repeat")
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="alternate DDP/no_sync timings this many times; each mode keeps the median of its repeats (within a job)",
    )
    parser.add_argument("--comm-hook", choices=COMM_HOOKS, default="none", help="compress gradients before the all-reduce")
    parser.add_argument("--amp", action="store_true", help="autocast on CUDA: bf16, or fp16 + GradScaler on GPUs without native bf16")
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    parser.add_argument("--timeout-s", type=positive_float, default=120.0)
    parser.add_argument("--json", help="write the result (or, with --sweep, the list of results) here")
    sweep = parser.add_argument_group("sweep driver (run with plain python, not torchrun)")
    sweep.add_argument("--sweep", type=int_list, help="world sizes, e.g. 1,2 or 1,2,4,8")
    sweep.add_argument("--configs", type=name_list, default="compute_bound,comm_bound", help="configs to sweep")
    sweep.add_argument("--bucket-caps", type=bucket_cap_list, default=[DEFAULT_BUCKETS], help="bucket sizes: 'default' and/or MiB, e.g. default,1,25,100")
    sweep.add_argument("--rounds", type=positive_int, default=2, help="measure every point in this many interleaved jobs; keep the fastest round (across jobs)")
    sweep.add_argument("--threads-per-rank", type=positive_int, default=1, help="OMP_NUM_THREADS of every rank")
    sweep.add_argument("--plot", help="figure path (default: next to --json, .png)")
    args = parser.parse_args(argv)
    if args.sweep and "RANK" in os.environ:
        parser.error("--sweep launches torchrun itself: run it with plain python")
    if args.sweep and not args.json:
        parser.error("--sweep needs --json PATH for its results")
    unknown = [name for name in args.configs if name not in CONFIGS]
    if unknown:
        parser.error(f"unknown config(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    return args


def check_measurement(ctx, args) -> None:
    """Refuse, on every rank alike, a measurement this machine cannot make (one line, no traceback)."""
    if args.amp and ctx.device.type != "cuda":
        raise CourseError("--amp needs a CUDA GPU (bf16 or fp16 autocast); on the CPU run without --amp")
    if args.global_batch and args.global_batch % ctx.world_size:
        raise CourseError(f"--global-batch {args.global_batch} does not split evenly over {ctx.world_size} ranks")


def seconds_per_step(ddp_model, optimizer, scaler, inputs, labels, steps, sync, ctx, amp) -> float:
    """Average time of one training step on this rank; sync=False skips the gradient all-reduce."""
    skip_sync = contextlib.nullcontext if sync else ddp_model.no_sync
    dist.barrier()  # start together, so no rank's clock includes waiting for a late peer
    start = time.perf_counter()
    for _ in range(steps):
        with skip_sync():
            with torch.autocast(ctx.device.type, dtype=amp.dtype, enabled=amp.enabled):
                loss = F.cross_entropy(ddp_model(inputs), labels)
            scaler.scale(loss).backward()  # with sync, DDP all-reduces gradient buckets while backward runs
        scaler.step(optimizer)  # a plain optimizer.step() unless fp16 needs loss scaling
        scaler.update()
        # Zero in place rather than set_to_none: the gradients stay views into DDP's buckets in both
        # modes. Set to None, a no_sync backward must allocate fresh gradients every step (52 MB for
        # comm_bound), which made no_sync slower than DDP on one rank and hid the communication.
        optimizer.zero_grad(set_to_none=False)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()  # GPU work is asynchronous: wait for it before reading the clock
    return (time.perf_counter() - start) / steps


def gather_from_every_rank(ctx, values: list[float]) -> list[torch.Tensor]:
    """all_gather of a few numbers: one float64 tensor per rank, in rank order, on this rank's device.

    The input AND every tensor of the output list live on ctx.device: NCCL moves only GPU memory,
    and an output list left on the CPU would hand it host memory (expected to crash the job, by
    reading c10d's NCCL code; never run here, the course has no GPU). tests/test_lab5_scaling.py
    checks the devices on a fake "meta" rank.
    """
    mine = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    every_rank = [torch.zeros_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(every_rank, mine)
    return every_rank


def bucket_sizes_mib(ddp_model) -> list[float] | None:
    """The gradient buckets DDP all-reduces, in MiB, in the order it sends them (after its rebuild).

    Read from the reducer's private _get_zeros_like_grad_buckets (torch 2.14): there is no public
    accessor. None if a later torch renames it; the measurement does not depend on it.
    """
    get_buckets = getattr(ddp_model.reducer, "_get_zeros_like_grad_buckets", None)
    if get_buckets is None:
        return None
    return [round(bucket.buffer().numel() * bucket.buffer().element_size() / 2**20, 2) for bucket in get_buckets()]


def measure(ctx, args) -> dict:
    check_measurement(ctx, args)
    config = CONFIGS[args.config]
    batch = args.global_batch // ctx.world_size if args.global_batch else (args.batch_size or config.batch_size)
    amp = choose_amp(ctx.device, args.amp)  # bf16 where the GPU has it natively, else fp16 + GradScaler
    log(f"config: {args.config} world_size={ctx.world_size} backend={ctx.backend} device={ctx.device.type} "
        f"batch={batch}/rank {cap_label(args.bucket_cap_mb)} comm_hook={args.comm_hook} amp={amp.dtype_name}")  # fmt: skip

    torch.manual_seed(0)
    model = build_model(config.model).to(ctx.device)
    # gradient_as_bucket_view: each .grad is a view into DDP's communication buckets, which saves a
    # copy of every gradient per step (and its memory); without it a 1-rank "all-reduce" still copies.
    device_ids = [ctx.local_rank] if ctx.device.type == "cuda" else None
    cap_mb = None if args.bucket_cap_mb == DEFAULT_BUCKETS else args.bucket_cap_mb
    ddp_model = DDP(model, device_ids=device_ids, bucket_cap_mb=cap_mb, gradient_as_bucket_view=True)
    if COMM_HOOKS[args.comm_hook]:
        ddp_model.register_comm_hook(state=None, hook=COMM_HOOKS[args.comm_hook])
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=amp.use_grad_scaler)
    # Synthetic data already on the device: we time the training step, not data loading.
    inputs = torch.randn(batch, *config.input_shape, device=ctx.device)
    labels = torch.randint(0, 10, (batch,), device=ctx.device)

    step = (ddp_model, optimizer, scaler, inputs, labels)
    seconds_per_step(*step, args.warmup_steps, True, ctx, amp)
    timings = {True: [], False: []}
    for _ in range(args.repeats):  # alternate, so drift in machine load hits both modes alike
        for sync in (True, False):
            timings[sync].append(seconds_per_step(*step, args.steps, sync, ctx, amp))
    medians = [sorted(timings[sync])[len(timings[sync]) // 2] for sync in (True, False)]
    every_rank = [times.cpu().tolist() for times in gather_from_every_rank(ctx, medians)]
    # The job moves at the pace of its slowest rank: every step ends in the same all-reduce.
    step_time = max(times[0] for times in every_rank)
    step_time_no_sync = max(times[1] for times in every_rank)
    gradient_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    return {
        "config": args.config, "model": config.model, "world_size": ctx.world_size, "backend": ctx.backend,
        "device": ctx.device.type, "per_rank_batch": batch, "global_batch": batch * ctx.world_size,
        "bucket_cap_mb": args.bucket_cap_mb, "bucket_sizes_mib": bucket_sizes_mib(ddp_model),
        "comm_hook": args.comm_hook, "amp": amp.dtype_name, "gradient_mb": round(gradient_mb, 3),
        "threads_per_rank": torch.get_num_threads(), "step_time_s": step_time,
        "step_time_no_sync_s": step_time_no_sync, "comm_fraction": max(0.0, 1 - step_time_no_sync / step_time),
        "samples_per_s": batch * ctx.world_size / step_time,
        "per_rank_samples_per_s": [batch / times[0] for times in every_rank],
    }  # fmt: skip


def main(args) -> int:
    try:
        if args.sweep:
            return run_sweep(args)
        ctx = setup_distributed(args.backend, timeout_s=args.timeout_s)
        record = measure(ctx, args)  # returns plain numbers: the DDP model is out of reach now
        columns = ["config", "world_size", "per_rank_batch", "samples_per_s", "step_time_s", "step_time_no_sync_s", "comm_fraction"]
        log(format_table([record], columns))
        if args.json and ctx.is_main:
            atomic_write_json(record, args.json)
        return 0
    except CourseError as error:
        log_error(str(error))
        return 1
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_args()))
