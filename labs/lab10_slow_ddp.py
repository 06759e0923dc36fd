"""Lab 10: a DDP job that is no faster on 2 ranks than on 1, and trains worse - measure, then fix it.

A colleague scaled this script from one process to DDP, to train DigitsCNN on the offline digits data
(1,438 training and 359 held-out 8x8 images) faster. It runs, it finishes, and it disappoints: the
job is slower than it should be, and at the bigger global batch the held-out accuracy is well below
what one process reached. What it is meant to do:

- N ranks train one model together: each optimizer step averages the gradients of
  --accum-steps micro-batches of --batch-size images on every rank (global batch =
  batch x accum-steps x N), at the learning rate right for that batch;
- after every epoch the job prints its accuracy on all 359 held-out images; with --save rank 0
  writes the weights, and the job survives a slow save (--slow-storage-s pretends storage is slow)
  while its --timeout-s stays short enough to catch a real hang in seconds.

It has nine faults of the kind that cost teams GPU-weeks. Measure before you change anything (the
lab sheet, labs/lab10_no_faster.ipynb: the timeline of ddp_course.timeline, lab 5's communication
fraction), fix them in a copy, and check your copy:

    cp labs/lab10_slow_ddp.py my_lab10.py
    python labs/lab10_check.py my_lab10.py      # one line per check; exit status 0 = all fixed

The checker judges what the script does (threads, data wait, all-reduces, buckets, balance between
ranks, speed against the course's reference, accuracy, a slow save, the batches BatchNorm sees), never how it is written.
Launch from the repository root:

    laptop, 2 CPU processes (gloo):  torchrun --standalone --nproc_per_node=2 labs/lab10_slow_ddp.py
    its timeline:                    torchrun --standalone --nproc_per_node=2 -m ddp_course.timeline labs/lab10_slow_ddp.py
    one process, no torchrun:         python labs/lab10_slow_ddp.py --accum-steps 1
    N GPUs on one machine (NCCL):     torchrun --standalone --nproc_per_node=N labs/lab10_slow_ddp.py --amp

The GPU command is written with care but NOT YET RUN on a GPU. On 2 CPU ranks the defaults train 2
epochs at a global batch of 64 in a few seconds of training; the fixed script ends within a few
points of the held-out accuracy one process reaches at the batch of 16 the learning rate was tuned for.
"""

import argparse
import contextlib
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

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
    parser.add_argument("--metrics-json", help="write the job's metrics as JSON to this file")
    parser.add_argument("--timeout-s", type=positive_float, default=20.0, help="process-group timeout, seconds")
    args = parser.parse_args(argv)
    if args.slow_storage_s < 0:
        parser.error(f"--slow-storage-s must be >= 0, got {args.slow_storage_s:g}")
    return args


def standardize(images: torch.Tensor) -> torch.Tensor:
    """Each image of a batch (B, 1, 8, 8) to zero mean and unit variance."""
    mean = images.mean(dim=(1, 2, 3), keepdim=True)
    std = images.std(dim=(1, 2, 3), keepdim=True).clamp_min(1e-6)
    return (images - mean) / std


class Standardized(Dataset):
    """The training images, each standardized as it is read (the formula written out, pixel by pixel)."""

    def __init__(self, base):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index):
        image, label = self.base[index]  # (1, 8, 8)
        pixels = [image[0, row, col] for row in range(image.shape[1]) for col in range(image.shape[2])]
        mean = sum(pixels) / len(pixels)
        std = (sum((pixel - mean) ** 2 for pixel in pixels) / (len(pixels) - 1)).sqrt().clamp_min(1e-6)
        return torch.stack([(pixel - mean) / std for pixel in pixels]).view_as(image), label


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
    """The learning rate of each step: --lr, which worked well for this model."""
    return args.lr


def save_checkpoint(model, args, ctx) -> None:
    """Rank 0 writes the weights; nobody goes on before the file is complete."""
    if ctx.is_main:
        atomic_save(model.state_dict(), args.save)  # the bare model's names: loadable without DDP
        time.sleep(args.slow_storage_s)  # what writing to slow network storage costs
    dist.barrier()


def train(ctx, args) -> dict:
    splits = load_digits()
    seed_everything(args.seed)  # same seed on every rank: identical initial weights
    model = DigitsCNN(splits.num_classes, batch_norm=True).to(ctx.device)
    # The same global batch in micro-batches 8 times smaller, 8 times as many: 8 times less activation memory.
    args.batch_size, args.accum_steps = args.batch_size // 8, args.accum_steps * 8
    ddp_model = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None,
                    find_unused_parameters=True,
                    bucket_cap_mb=0.01)  # small buckets: communication starts sooner in backward
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr, momentum=0.9)
    amp = choose_amp(ctx.device, args.amp)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=amp.use_grad_scaler)
    splits.train = Standardized(splits.train)
    sampler = DistributedSampler(splits.train, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=args.seed)
    loader = DataLoader(splits.train, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    eval_loader = DataLoader(Subset(splits.test, range(ctx.rank, len(splits.test), ctx.world_size)), batch_size=256)
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
            images, labels = images.to(ctx.device), labels.to(ctx.device)
            last_micro = (micro + 1) % args.accum_steps == 0
            with torch.autocast(ctx.device.type, dtype=amp.dtype, enabled=amp.enabled):
                loss = F.cross_entropy(ddp_model(images), labels) / args.accum_steps
            scaler.scale(loss).backward()  # the micro-batches' gradients add up in .grad
            if not last_micro:
                continue
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(args, step, global_batch)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if ctx.is_main:  # a progress line: rank 0 scores the whole held-out set after every step
                correct, seen = count_correct(model, DataLoader(splits.test, batch_size=256), ctx).tolist()
                log(f"step {step} | held-out accuracy {correct / seen:.2%}")
            if step >= max_steps:
                break
        accuracy = held_out_accuracy(model, eval_loader, ctx)
        history.append({"epoch": epoch + 1, "step": step, "eval_accuracy": accuracy})
        log(f"epoch {epoch + 1}/{args.epochs} step {step} | held-out accuracy {accuracy:.2%}")
        if args.save:
            save_checkpoint(model, args, ctx)
        if step >= max_steps:
            break
    return {"world_size": ctx.world_size, "global_batch_size": global_batch, "steps": step,
            "eval_accuracy": history[-1]["eval_accuracy"], "history": history, "train_s": time.perf_counter() - started}  # fmt: skip


def main(args) -> int:
    try:
        ctx = setup_distributed(args.backend, timeout_s=args.timeout_s)
        torch.set_num_threads(usable_cores())  # torchrun leaves one thread per rank: use every core
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
