"""Lab 3: train a real model with DistributedDataParallel - same script on CPUs and on GPUs.

Launch from the repository root:

    laptop, 2 CPU processes (gloo):  torchrun --standalone --nproc_per_node=2 labs/lab3_ddp.py
    N GPUs on one machine (NCCL):     torchrun --standalone --nproc_per_node=N labs/lab3_ddp.py \
                                          --dataset cifar10 --data-dir data --amp
    2 nodes x 8 GPUs (on each node):  torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
                                          --rdzv-endpoint=NODE0_HOST:29400 --rdzv-id=lab3 \
                                          labs/lab3_ddp.py --dataset cifar10 --data-dir data
    resume after a crash:             add --checkpoint-dir ckpt (and --resume on the restart)
    a 4x bigger global batch:         add --accumulation-steps 4 (4 micro-batches per optimizer step)

What you should see with the defaults: rank 0 prints the configuration (global batch 64 = 32 per rank x 2
ranks) and one line per epoch; the job-wide train loss falls from about 1.9 after the first epoch to about
0.001, and the held-out accuracy passes 97% by epoch 3 and ends near 99%, in about 10 s on a 2-core CPU.
Every number printed is for the whole job (all-reduced over ranks), not for rank 0 alone; samples/s is this
epoch's, data loading included. --metrics-json also records the learning curve: "history", the job-wide
train loss every --log-every optimizer steps (default 10: 23 points over 230 steps), and "epochs", one per epoch.

Where it has run: the course's tests run every CPU path (gloo, 1 and 2 processes); NCCL and --amp
have run on one GPU (README, "What has run on a GPU"), never on several: your first multi-GPU run is their test.
"""

import argparse
import contextlib
import itertools
import math
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddp_course.amp import choose_amp
from ddp_course.checkpoint import atomic_save, atomic_write_json, latest_checkpoint
from ddp_course.cli import CourseArgumentParser, CourseError, non_negative_int, positive_float, positive_int
from ddp_course.data import DATASETS, load_dataset
from ddp_course.distributed import BACKENDS, DistContext, agree_across_nodes, choose_backend, join_failure, log, log_error, teardown_distributed
from ddp_course.models import MODEL_FOR_DATASET, build_model
from ddp_course.seeding import dataloader_seed, seed_everything
from ddp_course.training import (
    copy_rank0_buffers, cpu_state_dict, evaluate, held_out_loader, rank0_decides, restore_training_state,
    save_training_state,
)  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    parser = CourseArgumentParser(prog="lab3_ddp.py", description="Train a model with DDP (see the docstring).")
    parser.add_argument("--dataset", choices=DATASETS, default="digits", help="digits works offline")
    parser.add_argument("--data-dir", default="data", help="where CIFAR-10 is, or is downloaded to")
    parser.add_argument("--epochs", type=positive_int, default=10)
    parser.add_argument("--max-steps", type=positive_int, help="stop after this many optimizer steps in total")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="per rank and micro-batch")
    parser.add_argument("--accumulation-steps", type=positive_int, default=1, help="micro-batches per optimizer step; global batch = batch x this x world size")
    parser.add_argument("--lr", type=positive_float, default=0.05, help="SGD learning rate (momentum 0.9)")
    parser.add_argument("--seed", type=int, default=0, help="model initialization and data order")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout probability in the digits model (0: none)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="auto: nccl with a GPU per rank, else gloo")
    parser.add_argument(
        "--amp",
        action="store_true",
        help="mixed precision on CUDA: bf16 autocast on GPUs with native bf16 (compute capability 8.0+), "
        "else fp16 autocast with a GradScaler (refused on the CPU)",
    )
    parser.add_argument("--workers", type=non_negative_int, help="DataLoader workers per rank (default: auto)")
    parser.add_argument("--checkpoint-dir", help="save a checkpoint here every epoch")
    parser.add_argument("--checkpoint-every", type=positive_int, help="also save every N optimizer steps")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --checkpoint-dir")
    parser.add_argument("--save", help="write the final model state_dict (plain keys) to this file")
    parser.add_argument("--metrics-json", help="write the job's metrics as JSON to this file")
    parser.add_argument("--log-every", type=positive_int, default=10, help="record the job-wide train loss in the JSON's history every N optimizer steps")
    parser.add_argument("--timeout-s", type=positive_float, default=300.0, help="process-group timeout, seconds")
    args = parser.parse_args(argv)
    if (args.resume or args.checkpoint_every) and not args.checkpoint_dir:
        parser.error("--resume and --checkpoint-every need --checkpoint-dir")
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout: must be at least 0 and below 1, got {args.dropout}")
    if args.dropout and args.dataset != "digits":
        parser.error("--dropout: only the digits model has a dropout layer")
    return args


def join_process_group(requested_backend: str, timeout_s: float) -> DistContext:
    """Join the job torchrun started (plain `python`: a group of one) and choose this rank's device: the
    steps of ddp_course.distributed.setup_distributed(), which the other labs call, written out."""
    launched_by_torchrun = "RANK" in os.environ  # torchrun tells each process who it is
    rank = int(os.environ.get("RANK", "0"))  # unique in the job: 0 .. world_size - 1
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # unique on this node: which of its GPUs
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    timeout = timedelta(seconds=timeout_s)  # bounds every wait in the group, joining included: a lost rank is an error
    backend = choose_backend(requested_backend, local_world_size)  # auto: nccl if every process here has a GPU
    store = None
    try:
        if launched_by_torchrun and requested_backend == "auto" and world_size != local_world_size:
            # Nodes can differ (GPUs on one, none on another), and ranks on two backends never meet:
            # the ranks agree on one through torchrun's store, then form the group with that store.
            backend, store = agree_across_nodes(rank, world_size, backend, timeout)
        # The GPU comes from LOCAL_RANK, never from RANK: on node 1 of a 2x8 job RANK is 8..15.
        device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
        options = {"backend": backend, "timeout": timeout}
        if backend == "nccl":
            torch.cuda.set_device(device)  # before the group forms: NCCL works on the current device
            options["device_id"] = device  # binds the group to this GPU (no guessing at the first barrier)
        if store is not None:
            dist.init_process_group(store=store, rank=rank, world_size=world_size, **options)
        elif launched_by_torchrun:
            dist.init_process_group(**options)  # env://: reads MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
        else:  # an in-memory store: a group of one needs no network port
            dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **options)
    except RuntimeError as error:  # torch's DistError family, and gloo's connect failures
        raise join_failure(rank, backend, error) from None  # one line naming this rank, not a traceback
    return DistContext(rank, local_rank, world_size, backend, device)


@dataclass
class TrainingState:
    """Everything a restart needs, as one object: the model, optimizer and scaler, the optimizer steps done,
    and where training continues (in `epoch`, after `step_in_epoch` of its micro-batches). The checkpoint
    adds every rank's RNG state (ddp_course.training); save and load are collectives: every rank calls them."""

    model_name: str
    model: torch.nn.Module  # the bare model, not the DDP wrapper: its keys have no "module."
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    epoch: int = 0
    step_in_epoch: int = 0
    global_step: int = 0

    def save(self, directory, ctx) -> None:
        position = {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch}
        save_training_state(directory, self.global_step, ctx, self.model_name, self.model, self.optimizer, self.scaler, **position)

    def load(self, path, ctx) -> None:
        saved = restore_training_state(path, self.model_name, self.model, self.optimizer, self.scaler, ctx, ("epoch", "step_in_epoch"))
        self.epoch, self.step_in_epoch, self.global_step = saved["epoch"], saved["step_in_epoch"], saved["global_step"]


def restore(state: TrainingState, args, ctx) -> None:
    """With --resume, load the newest checkpoint into state; else keep step 0 and refuse a directory that has one."""
    if not args.checkpoint_dir:
        return
    # Rank 0 lists the directory for every rank: on a shared filesystem another node may still see
    # an older listing, and ranks must never load different checkpoints (ddp_course.training.rank0_decides).
    path = rank0_decides(lambda: latest_checkpoint(args.checkpoint_dir), ctx)
    if not args.resume:
        if path is not None:  # refuse, rather than overwrite another run's checkpoints
            raise CourseError(f"{args.checkpoint_dir} already holds checkpoints: add --resume, or use an empty directory")
    elif path is None:
        log(f"no checkpoint in {args.checkpoint_dir} yet: starting from step 0")
    else:
        state.load(path, ctx)
        log(f"resumed from {path}: epoch {state.epoch}, step {state.global_step}")


def train(ctx, args) -> dict:
    if args.amp and ctx.device.type != "cuda":
        raise CourseError("--amp needs a CUDA GPU (bf16 or fp16 autocast); on the CPU run without --amp")
    splits = load_dataset(args.dataset, args.data_dir)  # every rank calls it: CIFAR-10's preparation is collective
    model_name = MODEL_FOR_DATASET[args.dataset]
    seed_everything(args.seed)  # same seed on every rank: identical initial weights
    model = build_model(model_name, splits.num_classes, args.dropout).to(ctx.device)
    # From here on randomness must differ per rank (dropout masks; the DataLoader workers' crops and
    # flips for CIFAR-10 are seeded from seed, rank and epoch: seeding.dataloader_seed).
    seed_everything(args.seed + ctx.rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # bf16 where the GPU does it natively (no loss scaling needed); older GPUs get fp16 + GradScaler.
    amp = choose_amp(ctx.device, args.amp)
    scaler = torch.amp.GradScaler("cuda", enabled=amp.use_grad_scaler)
    accumulation = args.accumulation_steps
    global_batch = args.batch_size * accumulation * ctx.world_size
    log(
        f"config: dataset={args.dataset} ({len(splits.train)} train / {len(splits.test)} held-out) "
        f"model={model_name} world_size={ctx.world_size} backend={ctx.backend} device={ctx.device.type} "
        f"batch={args.batch_size}/rank accumulation={accumulation} global_batch={global_batch} lr={args.lr} "
        f"epochs={args.epochs} max_steps={args.max_steps} amp={amp.dtype_name} seed={args.seed}"
    )
    log(f"local_rank {ctx.local_rank} trains on {ctx.device}", every_rank=True)
    state = TrainingState(model_name, model, optimizer, scaler)
    restore(state, args, ctx)
    first_epoch, first_skip = state.epoch, state.step_in_epoch  # where this run starts: after a resume, mid-epoch

    # DDP broadcasts rank 0's weights to all ranks, then all-reduces gradients during backward().
    ddp_model = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None)
    # Each rank reads a disjoint 1/world_size of a permutation drawn from (seed + epoch).
    sampler = DistributedSampler(splits.train, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=args.seed)
    workers = args.workers if args.workers is not None else (0 if args.dataset == "digits" else 4)
    # The loader's own generator, reseeded every epoch: iter(loader) must not draw from the default
    # generator that dropout uses, or a resume puts every later mask one draw out of step (seeding.dataloader_seed).
    loader_generator = torch.Generator()
    loader = DataLoader(
        splits.train, batch_size=args.batch_size, sampler=sampler, num_workers=workers,
        pin_memory=ctx.device.type == "cuda", persistent_workers=workers > 0, generator=loader_generator,
    )  # fmt: skip
    # Held-out: rank r takes samples r, r + world_size, ... - uneven slices, no padding duplicates.
    eval_loader = held_out_loader(splits.test, ctx, num_workers=min(workers, 2))

    samples_per_rank = len(sampler)  # the same on every rank: DistributedSampler pads the last shard
    train_loss, accuracy, last_saved_step, epochs, history = None, None, None, [], []
    interval_loss = torch.zeros(2, device=ctx.device)  # [loss sum, samples] since the last history point
    max_steps = args.max_steps or math.inf
    for epoch in range(first_epoch, args.epochs):
        if state.global_step >= max_steps:
            break
        sampler.set_epoch(epoch)  # without it every epoch repeats epoch 0's order
        loader_generator.manual_seed(dataloader_seed(args.seed, ctx.rank, epoch))
        skip = first_skip if epoch == first_epoch else 0  # batches done before a resume
        epoch_loss = torch.zeros(2, device=ctx.device)  # [sum of per-sample losses, samples] on this rank
        batches_done, epoch_start = skip, time.perf_counter()
        for images, labels in itertools.islice(loader, skip, None):
            images = images.to(ctx.device, non_blocking=True)
            labels = labels.to(ctx.device, non_blocking=True)
            # One optimizer step per `accumulation` micro-batches (the epoch's last group may be shorter).
            group_start = batches_done - batches_done % accumulation
            group_size = min(accumulation, len(loader) - group_start)
            last_of_group = batches_done + 1 == group_start + group_size
            group_samples = samples_in_group(group_start, group_size, args.batch_size, samples_per_rank)
            # no_sync(): this micro-batch's gradient stays local and adds up in .grad; the backward of
            # the group's last micro-batch all-reduces the sum, once per optimizer step.
            with contextlib.nullcontext() if last_of_group else ddp_model.no_sync():
                with torch.autocast(ctx.device.type, dtype=amp.dtype, enabled=amp.enabled):
                    loss_sum = F.cross_entropy(ddp_model(images), labels, reduction="sum")
                # Sum over the micro-batch / samples in the whole group: every sample weighs the same,
                # also in a short last micro-batch (a mean per micro-batch / K would overweight it).
                # .grad ends as the per-sample mean over the group; DDP's average over ranks, which
                # all hold group_samples samples, makes it the mean over the global batch.
                scaler.scale(loss_sum / group_samples).backward()
            batches_done += 1
            epoch_loss[0] += loss_sum.detach().float()
            epoch_loss[1] += labels.numel()
            interval_loss[0] += loss_sum.detach().float()
            interval_loss[1] += labels.numel()
            if not last_of_group:
                continue
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            state.global_step += 1
            if state.global_step % args.log_every == 0:  # every rank reaches the same steps: the all-reduce matches
                history.append(history_point(interval_loss, state.global_step, epoch))
            if args.checkpoint_every and state.global_step % args.checkpoint_every == 0:
                state.epoch, state.step_in_epoch = resume_position(epoch, batches_done, len(loader))
                state.save(args.checkpoint_dir, ctx)
                last_saved_step = state.global_step
            if state.global_step >= max_steps:
                break

        dist.all_reduce(epoch_loss)  # the job's loss, not rank 0's: sum over ranks, then divide
        train_loss = float(epoch_loss[0] / epoch_loss[1])  # float() waits for the GPU, so the clock is fair
        # This epoch's throughput, not a running average: the job's samples over the seconds of this
        # epoch's loop, DataLoader waits included (so it measures the input pipeline too).
        epoch_seconds = time.perf_counter() - epoch_start
        samples_per_s = int(epoch_loss[1]) / max(epoch_seconds, 1e-9)
        if not math.isfinite(train_loss):
            raise CourseError(f"the train loss became {train_loss} in epoch {epoch}: lower --lr (now {args.lr})")
        copy_rank0_buffers(model)
        correct, total = evaluate(model, eval_loader, ctx)
        accuracy = correct / total
        epochs.append({
            "epoch": epoch + 1, "step": state.global_step, "train_loss": train_loss, "eval_accuracy": accuracy,
            "samples": int(epoch_loss[1]), "train_seconds": epoch_seconds, "samples_per_s": samples_per_s,
        })  # fmt: skip
        log(
            f"epoch {epoch + 1}/{args.epochs} step {state.global_step} | train loss {train_loss:.4f} | "
            f"held-out accuracy {accuracy:.2%} ({correct}/{total}) | {samples_per_s:.0f} samples/s"
        )
        if args.checkpoint_dir and last_saved_step != state.global_step:
            state.epoch, state.step_in_epoch = resume_position(epoch, batches_done, len(loader))
            state.save(args.checkpoint_dir, ctx)
            last_saved_step = state.global_step

    if int(interval_loss[1]) > 0:  # the steps after the last history point (the same count on every rank)
        history.append(history_point(interval_loss, state.global_step, epoch))
    if args.save and ctx.is_main:
        atomic_save(cpu_state_dict(model), args.save)
    return {
        "world_size": ctx.world_size, "backend": ctx.backend, "device": ctx.device.type,
        "dataset": args.dataset, "model": model_name, "per_rank_batch_size": args.batch_size,
        "accumulation_steps": accumulation, "global_batch_size": global_batch, "lr": args.lr, "amp": amp.dtype_name, "steps": state.global_step,
        "samples_per_s_after_first_epoch": throughput_after_first_epoch(epochs),
        "train_loss": train_loss, "eval_accuracy": accuracy, "log_every": args.log_every,
        "history": history, "epochs": epochs,
    }  # fmt: skip


def history_point(interval_loss: torch.Tensor, global_step: int, epoch: int) -> dict:
    """The job-wide mean train loss over the micro-batches since the last point; resets interval_loss.

    A collective: every rank must call it at the same step (they all run the same number of steps).
    """
    dist.all_reduce(interval_loss)  # sums over ranks: the job's loss, not rank 0's
    train_loss = float(interval_loss[0] / interval_loss[1])
    samples = int(interval_loss[1])
    interval_loss.zero_()
    return {"step": global_step, "epoch": epoch + 1, "train_loss": train_loss, "samples": samples}


def throughput_after_first_epoch(epochs: list[dict]) -> float | None:
    """samples/s over this run's epochs after its first, which pays start-up costs (None: one epoch only)."""
    later = epochs[1:]
    seconds = sum(entry["train_seconds"] for entry in later)
    return sum(entry["samples"] for entry in later) / seconds if later else None


def samples_in_group(group_start: int, group_size: int, batch_size: int, samples_per_rank: int) -> int:
    """Samples this rank trains on in micro-batches group_start .. group_start + group_size - 1 of an epoch."""
    first = group_start * batch_size
    return min(first + group_size * batch_size, samples_per_rank) - first


def resume_position(epoch: int, batches_done: int, batches_per_epoch: int) -> tuple[int, int]:
    """(epoch, batches to skip) at which a restart continues after batches_done batches of epoch."""
    return (epoch + 1, 0) if batches_done >= batches_per_epoch else (epoch, batches_done)


def main(args) -> int:
    started = time.perf_counter()
    try:
        ctx = join_process_group(args.backend, timeout_s=args.timeout_s)
        metrics = train(ctx, args)  # returns plain numbers: the DDP model is out of reach now
        metrics["wall_s"] = time.perf_counter() - started
        if args.metrics_json and ctx.is_main:
            atomic_write_json(metrics, args.metrics_json)
        return 0
    except CourseError as error:
        log_error(str(error))
        return 1
    finally:
        # dist.destroy_process_group(), after a gc.collect() that is no part of DDP: a gloo exit quirk
        # (the DDP wrapper's reference cycles keep the group alive; CONTRIBUTING.md, "gloo teardown").
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_args()))
