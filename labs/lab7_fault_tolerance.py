"""Lab 7: a training job that survives crashes - torchrun restarts it and it loses nothing.

Launch from the repository root (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every torchrun line: see
"Restarts and torchrun's store" below):

    crash rank 1 at step 25, restart:  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone \
                                           --nproc_per_node=2 --max-restarts=1 labs/lab7_fault_tolerance.py \
                                           --checkpoint-dir ckpt_crash --crash-at-step 25 --crash-rank 1 --save crash.pt
    the same run without a crash:      TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone \
                                           --nproc_per_node=2 labs/lab7_fault_tolerance.py \
                                           --checkpoint-dir ckpt_straight --save straight.pt
    lose a node (two terminals, the same free PORT; start the first, then the second, then
    Ctrl-C the second while it trains; add --step-delay-s 0.2 to have time):
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:2 --nproc_per_node=1 --max-restarts=3 \
            --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT --rdzv-id=lab7 \
            labs/lab7_fault_tolerance.py --checkpoint-dir ckpt_elastic --record-samples samples
    8 GPUs per node, N nodes: the same torchrun line with --nnodes=N (or MIN:MAX) --nproc_per_node=8 and
        a shared --checkpoint-dir; labs/slurm/lab3.sbatch shows the multi-node launch.

What you should see: the crashed run prints "[rank 1] crashing on purpose at step 25", torchrun's
report of the failure, a second start "attempt 1: resumed from .../checkpoint_step00000020.pt" with
"5 steps recomputed", and at the end the same held-out accuracy as the run without a crash. The
two --save files are equal bit for bit (on the CPU; on GPUs see the README on determinism). The
elastic run goes on with world_size=1 after the second agent is gone, from the newest checkpoint.
--dropout 0.1 gives the digits model a dropout layer: the crash run is still bit for bit the run
without a crash (the tests run it so), because the checkpoint restores every rank's generators and
the DataLoader draws from a generator of its own (ddp_course.seeding.dataloader_seed).

How: every --checkpoint-every steps rank 0 writes model, optimizer, step, the position in the epoch
and every rank's RNG state atomically, then all ranks meet at a barrier (ddp_course.training).
Every start - the first, each restart, a start with fewer or more ranks - resumes from the newest
checkpoint in --checkpoint-dir; rank 0 alone chooses it and tells the others, who may see an
older listing on a shared filesystem (ddp_course.training.rank0_decides). The position is a count
of the epoch's shuffled samples already trained on, not of batches, so it means the same on any
number of ranks; ResumableDistributedSampler (ddp_course.resume) deals the rest of the epoch over
the ranks there are now.

Restarts and torchrun's store: torchrun (2.4 and later) lets the workers share its rendezvous
TCPStore (TORCHELASTIC_USE_AGENT_STORE=True), and it keeps ONE such store for all attempts (its
comment says "we create a new TCPStore for every retry", but the server is made once per agent and
reused). The workers' keys carry no attempt number (the default group's prefix is "default_pg"),
so a restarted worker finds the keys of the dead attempt, reads a dead rank's address, and fails
with "connectFullMesh ... Connection refused" or waits. Measured on gloo (8 of 8 restarts failed
so here); the cause is backend-independent: NCCL's unique id is exchanged through the same store.
With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment every attempt gets a fresh
store (restarts never failed here, see benchmarks/lab7_crash_trials.py). The variable is read by
the torchrun agent, not by this script, so it goes on the command line (and in
labs/slurm/lab3.sbatch). The script refuses to run on a shared agent store whether or not
--max-restarts is set: an elastic job (--nnodes=MIN:MAX) restarts its workers when a node joins
even with zero restarts allowed, and the agent does not tell the workers its --nnodes, so the
script cannot tell an elastic job from a fixed one.
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from ddp_course.checkpoint import atomic_save, atomic_write_json, latest_checkpoint
from ddp_course.cli import CourseArgumentParser, CourseError, non_negative_int, positive_float, positive_int
from ddp_course.data import DATASETS, load_dataset
from ddp_course.distributed import BACKENDS, log, log_error, setup_distributed, teardown_distributed
from ddp_course.models import MODEL_FOR_DATASET, build_model
from ddp_course.resume import RESTART_SAFE_ENV, ResumableDistributedSampler, samples_consumed
from ddp_course.seeding import dataloader_seed, seed_everything
from ddp_course.training import (
    cpu_state_dict, evaluate, held_out_loader, rank0_decides, restore_training_state, save_training_state,
)  # fmt: skip

POSITION_KEYS = ("epoch", "samples_consumed")  # samples of the epoch's permutation trained on
PROGRESS_FILE = "progress.json"  # the furthest step any attempt reached: what a restart recomputes


def parse_args(argv=None) -> argparse.Namespace:
    parser = CourseArgumentParser(prog="lab7_fault_tolerance.py", description="Crash, restart, resume (see the docstring).")
    parser.add_argument("--dataset", choices=DATASETS, default="digits", help="digits works offline")
    parser.add_argument("--data-dir", default="data", help="where CIFAR-10 is, or is downloaded to")
    parser.add_argument("--epochs", type=positive_int, default=2)
    parser.add_argument("--max-steps", type=positive_int, help="stop after this many optimizer steps in total")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="per rank")
    parser.add_argument("--lr", type=positive_float, default=0.05, help="SGD learning rate (momentum 0.9)")
    parser.add_argument("--seed", type=int, default=0, help="model initialization and data order")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout probability in the digits model (0: none)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="auto: nccl with a GPU per rank, else gloo")
    parser.add_argument("--checkpoint-dir", required=True, help="every start resumes from the newest checkpoint here")
    parser.add_argument("--checkpoint-every", type=positive_int, default=10, help="optimizer steps between checkpoints")
    parser.add_argument("--crash-at-step", type=positive_int, help="kill --crash-rank after this step, first attempt only")
    parser.add_argument("--crash-rank", type=non_negative_int, default=1, help="the rank --crash-at-step kills (1)")
    parser.add_argument("--step-delay-s", type=float, default=0.0, help="sleep after each step: time to kill a node")
    parser.add_argument("--record-samples", help="every rank appends the sample ids of each step to a file here")
    parser.add_argument("--save", help="write the final model state_dict (plain keys) to this file")
    parser.add_argument("--metrics-json", help="write the job's metrics as JSON to this file")
    parser.add_argument("--timeout-s", type=positive_float, default=300.0, help="process-group timeout, seconds")
    args = parser.parse_args(argv)
    if args.step_delay_s < 0:
        parser.error(f"--step-delay-s: must be 0 or more, got {args.step_delay_s}")
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout: must be at least 0 and below 1, got {args.dropout}")
    if args.dropout and args.dataset != "digits":
        parser.error("--dropout: only the digits model has a dropout layer")
    return args


def attempt() -> int:
    """0 for the first start, k for torchrun's k-th restart of the workers (--max-restarts)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def check_restarts_are_safe() -> None:
    """Refuse a torchrun whose restarts would find the dead attempt's keys in its store (module docstring).

    Any torchrun that shares its store: --max-restarts and --nnodes=MIN:MAX restart the workers,
    and the script cannot see whether the job is elastic.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        variable, value = next(iter(RESTART_SAFE_ENV.items()))
        raise CourseError(f"torchrun's restarts (--max-restarts, --nnodes=MIN:MAX) need {variable}={value} in its environment: put it before torchrun")


def read_progress(directory) -> dict:
    path = Path(directory) / PROGRESS_FILE
    return json.loads(path.read_text()) if path.exists() else {"global_step": 0, "recomputed_steps": 0}


def resume(args, model_name, model, optimizer, scaler, ctx) -> dict:
    """Load the newest checkpoint, if any; return where to continue and how many steps are done again."""
    # Rank 0 lists the directory and reads the progress (before anyone writes) for every rank: on a
    # shared filesystem another node may still see an older listing (ddp_course.training.rank0_decides).
    directory = args.checkpoint_dir
    path, progress = rank0_decides(lambda: (latest_checkpoint(directory), read_progress(directory)), ctx)
    start = {"epoch": 0, "samples_consumed": 0, "global_step": 0}
    if path is not None:
        state = restore_training_state(path, model_name, model, optimizer, scaler, ctx, POSITION_KEYS)
        start = {key: state[key] for key in start}
    recomputed_now = progress["global_step"] - start["global_step"]
    if path is not None or recomputed_now:
        where = f"resumed from {path}" if path else "no checkpoint yet: started again from step 0"
        log(
            f"attempt {attempt()}: {where} (epoch {start['epoch']}, {start['samples_consumed']} samples of it done, "
            f"step {start['global_step']}); the job had reached step {progress['global_step']}: "
            f"{recomputed_now} steps recomputed"
        )
    start["recomputed_steps"] = progress["recomputed_steps"] + recomputed_now
    return start


def crash(step: int) -> None:
    """Die as a crash does: SIGKILL to ourselves, so no finally, no atexit, no flush, no goodbye to the group."""
    log(f"crashing on purpose at step {step} (attempt {attempt()})", every_rank=True)
    os.kill(os.getpid(), signal.SIGKILL)


def train(ctx, args) -> dict:
    splits = load_dataset(args.dataset, args.data_dir)
    model_name = MODEL_FOR_DATASET[args.dataset]
    seed_everything(args.seed)  # same seed on every rank: identical initial weights
    model = build_model(model_name, splits.num_classes, args.dropout).to(ctx.device)
    seed_everything(args.seed + ctx.rank)  # per-rank randomness from here (augmentation, dropout)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda", enabled=False)  # no AMP in this lab; kept so checkpoints match lab 3's
    if args.crash_at_step and args.crash_rank >= ctx.world_size:
        raise CourseError(f"--crash-rank {args.crash_rank} does not exist in a job of {ctx.world_size} ranks")
    log(
        f"config: dataset={args.dataset} ({len(splits.train)} train) model={model_name} world_size={ctx.world_size} "
        f"backend={ctx.backend} batch={args.batch_size}/rank global_batch={args.batch_size * ctx.world_size} "
        f"lr={args.lr} dropout={args.dropout} epochs={args.epochs} max_steps={args.max_steps} "
        f"checkpoint_every={args.checkpoint_every} attempt={attempt()} max_restarts={os.environ.get('TORCHELASTIC_MAX_RESTARTS', '0')}"
    )
    start = resume(args, model_name, model, optimizer, scaler, ctx)

    # DDP broadcasts rank 0's weights (the restored ones) to every rank, then averages gradients.
    ddp_model = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None)
    num_samples = len(splits.train)
    sampler = ResumableDistributedSampler(num_samples, ctx.world_size, ctx.rank, seed=args.seed)
    workers = 0 if args.dataset == "digits" else 4  # CIFAR-10's augmentation runs in worker processes
    # The loader's own generator, reseeded every epoch: iter(loader) must not draw from the default
    # generator that dropout uses, or a resume puts every later mask one draw out of step (seeding.dataloader_seed).
    loader_generator = torch.Generator()
    loader = DataLoader(splits.train, batch_size=args.batch_size, sampler=sampler, num_workers=workers, generator=loader_generator)
    recorder = open_recorder(args.record_samples, ctx)
    global_step, max_steps = start["global_step"], args.max_steps or float("inf")
    for epoch in range(start["epoch"], args.epochs):
        if global_step >= max_steps:
            break
        first = start["samples_consumed"] if epoch == start["epoch"] else 0
        sampler.set_epoch(epoch, first)  # this rank's share of the samples not yet trained on
        loader_generator.manual_seed(dataloader_seed(args.seed, ctx.rank, epoch))
        batch_ids = list(sampler)  # the ids the loader will read, in order (for --record-samples)
        for batch, (images, labels) in enumerate(loader):
            images, labels = images.to(ctx.device), labels.to(ctx.device)
            loss = F.cross_entropy(ddp_model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients here
            optimizer.step()
            global_step += 1
            consumed = samples_consumed(first, batch + 1, args.batch_size, ctx.world_size, num_samples)
            record(recorder, global_step, epoch, batch_ids[batch * args.batch_size :][: len(labels)])
            if ctx.is_main:  # cheap (a few bytes, no fsync): how far this attempt got, for the next one
                progress = {"global_step": global_step, "recomputed_steps": start["recomputed_steps"]}
                atomic_write_json(progress, Path(args.checkpoint_dir) / PROGRESS_FILE)
            done = global_step >= max_steps or (epoch + 1 == args.epochs and consumed == num_samples)
            if global_step % args.checkpoint_every == 0 or done:
                position = (epoch + 1, 0) if consumed == num_samples else (epoch, consumed)
                save_training_state(
                    args.checkpoint_dir, global_step, ctx, model_name, model, optimizer, scaler,
                    epoch=position[0], samples_consumed=position[1],
                )  # fmt: skip
                log(f"step {global_step}: checkpoint (epoch {position[0]}, {position[1]} of {num_samples} samples)")
            if args.crash_at_step == global_step and attempt() == 0:
                dist.barrier()  # rank 0 has recorded this step: the next attempt's count is exact
                if ctx.rank == args.crash_rank:
                    crash(global_step)
            time.sleep(args.step_delay_s)
            if done:
                break

    correct, total = evaluate(model, held_out_loader(splits.test, ctx), ctx)
    log(
        f"done: step {global_step}, world_size={ctx.world_size}, attempt {attempt()} | "
        f"{start['recomputed_steps']} steps recomputed in all | held-out accuracy {correct / total:.2%} ({correct}/{total})"
    )
    if args.save and ctx.is_main:
        atomic_save(cpu_state_dict(model), args.save)
    if recorder:
        recorder.close()
    return {
        "world_size": ctx.world_size, "backend": ctx.backend, "steps": global_step, "attempt": attempt(),
        "resumed_from_step": start["global_step"], "recomputed_steps": start["recomputed_steps"],
        "eval_accuracy": correct / total,
    }  # fmt: skip


def open_recorder(directory, ctx):
    """A line-buffered file per rank and attempt, so that a crash keeps every line written before it."""
    if not directory:
        return None
    Path(directory).mkdir(parents=True, exist_ok=True)
    return open(Path(directory) / f"samples_attempt{attempt()}_rank{ctx.rank}.jsonl", "a", buffering=1)


def record(recorder, step, epoch, ids) -> None:
    if recorder:
        recorder.write(json.dumps({"step": step, "epoch": epoch, "ids": ids}) + "\n")


def main(args) -> int:
    started = time.perf_counter()
    try:
        check_restarts_are_safe()
        ctx = setup_distributed(args.backend, timeout_s=args.timeout_s)
        metrics = train(ctx, args)  # returns plain numbers: the DDP model is out of reach now
        metrics["wall_s"] = time.perf_counter() - started
        if args.metrics_json and ctx.is_main:
            atomic_write_json(metrics, args.metrics_json)
        return 0
    except CourseError as error:
        if attempt() == 0:  # a restarted attempt would only repeat the same line
            log_error(str(error))
        return 1
    finally:
        teardown_distributed()  # gc.collect(), then destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(parse_args()))
