"""Lab 10, fixed: the training script of labs/lab10_slow_ddp.py with its nine faults removed.

Each fix carries a comment "fix N" that says what was wrong and why the new line is right; the lab
sheet (labs/lab10_no_faster.ipynb) shows how each one was found from measurements first.

    laptop, 2 CPU processes (gloo):  torchrun --standalone --nproc_per_node=2 solutions/lab10_slow_ddp.py
    one process, no torchrun:         python solutions/lab10_slow_ddp.py --accum-steps 1
    N GPUs on one machine (NCCL):     torchrun --standalone --nproc_per_node=N solutions/lab10_slow_ddp.py --amp

The GPU command is written with care but NOT YET RUN on a GPU. With the defaults on 2 CPU ranks it
trains 2 epochs at a global batch of 64 (16 per rank x 2 micro-batches x 2 ranks) and ends near the
held-out accuracy one process reaches at the batch of 16 the learning rate was tuned for.
"""

import argparse
import contextlib
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from ddp_course.amp import choose_amp
from ddp_course.checkpoint import atomic_save, atomic_write_json
from ddp_course.cli import CourseArgumentParser, CourseError, non_negative_int, positive_float, positive_int
from ddp_course.data import load_digits
from ddp_course.distributed import BACKENDS, log, log_error, setup_distributed, teardown_distributed
from ddp_course.models import DigitsCNN
from ddp_course.seeding import seed_everything


def parse_args(argv=None) -> argparse.Namespace:
    parser = CourseArgumentParser(prog="lab10_slow_ddp.py", description="Train DigitsCNN with DDP (see the docstring).")
    parser.add_argument("--epochs", type=positive_int, default=2)
    parser.add_argument("--max-steps", type=positive_int, help="stop after this many optimizer steps")
    parser.add_argument("--batch-size", type=positive_int, default=16, help="per rank and micro-batch")
    parser.add_argument("--accum-steps", type=positive_int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=positive_float, default=0.01, help="SGD learning rate tuned for one process at --base-batch")
    parser.add_argument("--base-batch", type=positive_int, default=16, help="the global batch --lr was tuned for")
    parser.add_argument("--warmup-steps", type=non_negative_int, default=5, help="steps of linear learning-rate warm-up")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="auto: nccl with a GPU per rank, else gloo")
    parser.add_argument("--amp", action="store_true", help="bf16 autocast on GPUs (fp16 + GradScaler where bf16 is not native)")
    parser.add_argument("--save", help="rank 0 writes the trained weights here after every epoch")
    parser.add_argument("--slow-storage-s", type=float, default=0.0, help="pretend each save takes this long (network storage)")
    parser.add_argument("--save-timeout-s", type=positive_float, default=600.0, help="how long the others wait for a save")
    parser.add_argument("--metrics-json", help="write the job's metrics as JSON to this file")
    parser.add_argument("--timeout-s", type=positive_float, default=20.0, help="process-group timeout, seconds")
    args = parser.parse_args(argv)
    if args.slow_storage_s < 0:
        parser.error(f"--slow-storage-s must be >= 0, got {args.slow_storage_s:g}")
    return args


def standardize(images: torch.Tensor) -> torch.Tensor:
    """Each image to zero mean and unit variance, a whole batch (B, 1, 8, 8) in three tensor operations.

    Fix 2: the broken script did this per sample in Python inside the Dataset, and the step waited
    for it: the data-wait share of the timeline was most of the step.
    """
    mean = images.mean(dim=(1, 2, 3), keepdim=True)
    std = images.std(dim=(1, 2, 3), keepdim=True).clamp_min(1e-6)
    return (images - mean) / std


def usable_cores() -> int:
    """The cores this process may run on (a container or taskset may allow fewer than the machine has)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@torch.no_grad()
def count_correct(model, loader, ctx) -> torch.Tensor:
    """[correct, seen] over what loader holds, on this rank alone."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=ctx.device)
    for images, labels in loader:
        images, labels = standardize(images.to(ctx.device)), labels.to(ctx.device)
        counts[0] += (model(images).argmax(dim=1) == labels).sum()
        counts[1] += labels.numel()
    model.train()
    return counts


def held_out_accuracy(model, loader, ctx) -> float:
    """The job's accuracy on the whole held-out set: each rank scores its slice, the counts are summed."""
    counts = count_correct(model, loader, ctx)
    dist.all_reduce(counts)
    return int(counts[0]) / int(counts[1])


def learning_rate(args, step: int, global_batch: int) -> float:
    """Fix 7: the linear scaling rule with warm-up (Goyal et al., 2017).

    --lr was tuned for a global batch of --base-batch; a batch k times bigger takes k times fewer
    steps per epoch, so each step is allowed k times the learning rate, reached gradually over
    --warmup-steps steps because the first steps of a fresh model cannot take the full size.
    """
    peak = args.lr * global_batch / args.base_batch
    return peak * min(1.0, (step + 1) / args.warmup_steps) if args.warmup_steps else peak


def save_checkpoint(model, args, ctx, checkpoint_group) -> None:
    """Rank 0 writes the weights; nobody goes on before the file is complete.

    Fix 8: the others used to wait in a barrier of the default group, whose timeout (--timeout-s)
    is there to catch a hung collective in seconds; a save slower than that killed a healthy job.
    They now wait on a group made for this phase, with its own, longer timeout. Raising the
    default group's timeout instead would make every real hang take that long to surface.
    """
    if ctx.is_main:
        atomic_save(model.state_dict(), args.save)  # the bare model's names: loadable without DDP
        time.sleep(args.slow_storage_s)  # what writing to slow network storage costs
    dist.barrier(group=checkpoint_group)


def train(ctx, args) -> dict:
    splits = load_digits()
    seed_everything(args.seed)  # same seed on every rank: identical initial weights
    model = DigitsCNN(splits.num_classes, batch_norm=True).to(ctx.device)
    # Fix 9: each BatchNorm layer normalises with the statistics of the batch it is given, on each rank
    # alone: here a whole micro-batch of --batch-size images. The broken script cut every micro-batch
    # into 8 for less memory (same global batch, 8 times the micro-batches), so BatchNorm saw 2 images
    # at a time: noisy statistics in training, poor running averages for evaluation. On CPU, where
    # SyncBatchNorm raises, enough images per rank is the fix (or GroupNorm/LayerNorm, which use no
    # batch statistics); a bigger batch per rank would be a bigger global batch, for fix 7 to scale to.
    # Fix 4: DDP's own bucket size (bucket_cap_mb=None), not 0.01 MB: the 0.6 MB of gradients go in
    # one all-reduce instead of paying gloo's per-call latency once per tiny bucket.
    # Fix 5: no find_unused_parameters: every parameter gets a gradient in every step, so the search
    # for unused ones (a walk of the autograd graph after every forward) found nothing, at a cost.
    ddp_model = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr, momentum=0.9)
    amp = choose_amp(ctx.device, args.amp)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=amp.use_grad_scaler)
    sampler = DistributedSampler(splits.train, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=args.seed)
    loader = DataLoader(splits.train, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    eval_loader = DataLoader(Subset(splits.test, range(ctx.rank, len(splits.test), ctx.world_size)), batch_size=256)
    # Fix 8: a group for the checkpoint phase only, with a timeout that fits a slow save.
    checkpoint_group = dist.new_group(timeout=timedelta(seconds=args.save_timeout_s)) if args.save else None
    global_batch = args.batch_size * args.accum_steps * ctx.world_size
    log(f"config: world_size={ctx.world_size} backend={ctx.backend} threads/rank={torch.get_num_threads()} "
        f"batch={args.batch_size}/rank x {args.accum_steps} micro-batches -> global_batch={global_batch} "
        f"lr={learning_rate(args, args.warmup_steps, global_batch):g} (x{global_batch / args.base_batch:g} of --lr, "
        f"warm-up {args.warmup_steps} steps) epochs={args.epochs} amp={amp.dtype_name} timeout={args.timeout_s:g}s")  # fmt: skip

    step, history, started = 0, [], time.perf_counter()
    max_steps = args.max_steps or math.inf
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for micro, (images, labels) in enumerate(loader):
            images, labels = standardize(images.to(ctx.device)), labels.to(ctx.device)
            last_micro = (micro + 1) % args.accum_steps == 0
            # Fix 3: only the last micro-batch of a step all-reduces; the others add to .grad locally.
            with ddp_model.no_sync() if not last_micro else contextlib.nullcontext():
                with torch.autocast(ctx.device.type, dtype=amp.dtype, enabled=amp.enabled):
                    loss = F.cross_entropy(ddp_model(images), labels) / args.accum_steps
                scaler.scale(loss).backward()
            if not last_micro:
                continue
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(args, step, global_batch)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            # Fix 6: nothing here that only rank 0 does; the held-out accuracy is computed once
            # per epoch, below, by every rank on its slice.
            if step >= max_steps:
                break
        accuracy = held_out_accuracy(model, eval_loader, ctx)
        history.append({"epoch": epoch + 1, "step": step, "eval_accuracy": accuracy})
        log(f"epoch {epoch + 1}/{args.epochs} step {step} | held-out accuracy {accuracy:.2%}")
        if args.save:
            save_checkpoint(model, args, ctx, checkpoint_group)
        if step >= max_steps:
            break
    return {"world_size": ctx.world_size, "global_batch_size": global_batch, "steps": step,
            "eval_accuracy": history[-1]["eval_accuracy"], "history": history, "train_s": time.perf_counter() - started}  # fmt: skip


def main(args) -> int:
    try:
        ctx = setup_distributed(args.backend, timeout_s=args.timeout_s)
        # Fix 1: torchrun gives each rank OMP_NUM_THREADS=1; the broken script asked every rank for
        # all the machine's cores, so N ranks ran N x cores threads on cores cores. Split them.
        torch.set_num_threads(max(1, min(torch.get_num_threads(), usable_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))
        metrics = train(ctx, args)  # returns plain numbers: the DDP model is out of reach now
        if args.metrics_json and ctx.is_main:
            atomic_write_json(metrics, args.metrics_json)
        return 0
    except CourseError as error:
        log_error(str(error))
        return 1
    finally:
        teardown_distributed()  # gc.collect(), then destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(parse_args()))
