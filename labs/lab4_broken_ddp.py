"""Lab 4: a DDP training script that runs, looks right, and is wrong - debug it.

A colleague wrote this script to train DigitsCNN on the offline digits data (1,438 training and 359
held-out 8x8 images) with DistributedDataParallel. What it is meant to do:

- N ranks together train exactly as one process would on the global batch (N x --batch-size):
  every epoch the training set is shuffled anew and each sample is used once, by one rank;
- after every epoch rank 0 prints the job's train loss and its accuracy on all 359 held-out images;
- --save writes the trained weights in a file that a bare DigitsCNN loads (for inference or a new
  job); --metrics-json records the job's metrics (eval_accuracy is the held-out accuracy);
- nothing waits forever: --timeout-s (20 s by default) turns a rank stuck in a collective of the
  training into an error (joining the job, slow on a busy machine, has START_TIMEOUT_S).

It has seven bugs of the kind real teams ship. Find them with the method of the lab sheet,
labs/lab4_broken_ddp.ipynb (reproduce on 2 CPU ranks, log per rank, TORCH_DISTRIBUTED_DEBUG,
short timeouts, compare with one process), fix them in a copy, and check your copy:

    cp labs/lab4_broken_ddp.py my_lab4.py                   # work on a copy
    python labs/lab4_check.py                               # checks this file: one line per check
    python labs/lab4_check.py my_lab4.py                    # checks your copy; exit status 0 = all fixed

The checker runs the script on 2 CPU ranks and judges what it does, not how it is written.
Launch from the repository root:

    laptop, 2 CPU processes (gloo):  torchrun --standalone --nproc_per_node=2 labs/lab4_broken_ddp.py
    one process, no torchrun:         python labs/lab4_broken_ddp.py
    N GPUs on one machine (NCCL):     torchrun --standalone --nproc_per_node=N labs/lab4_broken_ddp.py
    2 nodes x 8 GPUs (on each node):  torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
                                          --rdzv-endpoint=NODE0_HOST:29400 --rdzv-id=lab4 \
                                          labs/lab4_broken_ddp.py

What a correct version prints with the defaults: the configuration (global batch 64 = 32 per rank x
2 ranks), then one line per epoch; the train loss falls from about 1.9 to about 0.05 and the
held-out accuracy ends near 98% after 5 epochs, in a few seconds of training on a 2-core CPU.
"""

import argparse
import math
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from ddp_course.checkpoint import atomic_save, atomic_write_json
from ddp_course.cli import CourseArgumentParser, CourseError, positive_float, positive_int
from ddp_course.data import load_digits
from ddp_course.distributed import BACKENDS, START_TIMEOUT_S, log, log_error, setup_distributed, teardown_distributed, training_group
from ddp_course.models import DigitsCNN
from ddp_course.seeding import seed_everything


def parse_args(argv=None) -> argparse.Namespace:
    parser = CourseArgumentParser(prog="lab4_broken_ddp.py", description="Train DigitsCNN with DDP (see the docstring).")
    parser.add_argument("--epochs", type=positive_int, default=5)
    parser.add_argument("--max-steps", type=positive_int, help="stop after this many optimizer steps in total")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="per rank; global = this x world size")
    parser.add_argument("--lr", type=positive_float, default=0.05, help="SGD learning rate (momentum 0.9)")
    parser.add_argument("--seed", type=int, default=0, help="model initialization and data order")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="auto: nccl with a GPU per rank, else gloo")
    parser.add_argument("--save", help="write the final model state_dict to this file")
    parser.add_argument("--metrics-json", help="write the job's metrics as JSON to this file")
    # Short on purpose: a rank left waiting in a collective fails after this many seconds, not 30 minutes.
    parser.add_argument("--timeout-s", type=positive_float, default=20.0, help="how long a rank waits for a peer in training, seconds")
    return parser.parse_args(argv)


@torch.no_grad()
def evaluate(model, loader, ctx) -> tuple[int, int]:
    """(correct, total) on the held-out set."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=ctx.device)  # [correct, seen] on this rank
    for images, labels in loader:
        images, labels = images.to(ctx.device), labels.to(ctx.device)
        counts[0] += (model(images).argmax(dim=1) == labels).sum()
        counts[1] += labels.numel()
    model.train()
    return int(counts[0]), int(counts[1])


def train(ctx, args) -> dict:
    splits = load_digits()
    seed_everything(args.seed)  # same seed on every rank: identical initial weights
    model = DigitsCNN(splits.num_classes).to(ctx.device)
    group = training_group(args.timeout_s)  # every rank has started: from here on a rank gives up after --timeout-s
    # DDP broadcasts rank 0's weights, then averages gradients over ranks inside backward().
    ddp_model = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None, process_group=group)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr, momentum=0.9)
    # Each rank reads its own 1/world_size of a permutation drawn from (seed + epoch).
    sampler = DistributedSampler(splits.train, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=args.seed)
    loader = DataLoader(splits.train, batch_size=args.batch_size, shuffle=True)
    # Held-out: rank r scores images r, r + world_size, ... (uneven slices, nothing padded in).
    eval_slice = Subset(splits.test, range(ctx.rank, len(splits.test), ctx.world_size))
    eval_loader = DataLoader(eval_slice, batch_size=256)
    global_batch = args.batch_size * ctx.world_size
    log(
        f"config: digits ({len(splits.train)} train / {len(splits.test)} held-out) world_size={ctx.world_size} "
        f"backend={ctx.backend} batch={args.batch_size}/rank global_batch={global_batch} lr={args.lr} "
        f"epochs={args.epochs} max_steps={args.max_steps} seed={args.seed} timeout={args.timeout_s:g}s"
    )

    global_step, history, started = 0, [], time.perf_counter()
    max_steps = args.max_steps or math.inf
    for epoch in range(args.epochs):
        if global_step >= max_steps:
            break
        loss_sum = torch.zeros(2, device=ctx.device)  # [sum of per-sample losses, samples] on this rank
        for images, labels in loader:
            images, labels = images.to(ctx.device), labels.to(ctx.device)
            loss = F.cross_entropy(ddp_model(images), labels)  # mean over this rank's batch
            (loss / ctx.world_size).backward()  # each rank contributes 1/world_size of the gradient
            optimizer.step()
            global_step += 1
            loss_sum[0] += loss.detach() * labels.numel()
            loss_sum[1] += labels.numel()
            if global_step >= max_steps:
                break

        correct, total = evaluate(model, eval_loader, ctx)
        if ctx.is_main:
            dist.all_reduce(loss_sum, group=group)  # the job's loss, for the log line
        train_loss = float(loss_sum[0] / loss_sum[1])
        if not math.isfinite(train_loss):
            raise CourseError(f"the train loss became {train_loss} in epoch {epoch}: lower --lr (now {args.lr})")
        history.append({"epoch": epoch + 1, "step": global_step, "train_loss": train_loss, "eval_accuracy": correct / total})
        if ctx.is_main:
            log(
                f"epoch {epoch + 1}/{args.epochs} step {global_step} | train loss {train_loss:.4f} | "
                f"held-out accuracy {correct / total:.2%} ({correct}/{total})"
            )
            if args.save:  # every epoch, so that a crash keeps the last finished epoch's weights
                atomic_save(ddp_model.state_dict(), args.save)  # the trained weights
        dist.barrier(group=group)  # no rank starts the next epoch, or exits, while rank 0 is still writing

    final = history[-1]
    return {
        "world_size": ctx.world_size, "backend": ctx.backend, "per_rank_batch_size": args.batch_size,
        "global_batch_size": global_batch, "lr": args.lr, "steps": global_step,
        "train_loss": final["train_loss"], "eval_accuracy": final["eval_accuracy"], "history": history,
        "train_s": time.perf_counter() - started,
    }  # fmt: skip


def main(args) -> int:
    try:
        ctx = setup_distributed(args.backend, timeout_s=START_TIMEOUT_S)  # a slow start is not a hang: see training_group
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
