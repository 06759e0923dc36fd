"""The parts of a DDP training job that lab 3 and lab 7 share: job-wide evaluation and the
training state a restart needs.

A training state holds everything that decides what the next step computes: the model's weights
(keys without "module."), the optimizer's state (SGD's momentum buffers), the GradScaler's, the
position in the data (each lab names its own position keys) and the generator state of EVERY rank
(ranks seeded with seed + rank draw differently: giving rank 0's state to all would correlate
their dropout masks and augmentations). checkpoint.save_checkpoint writes it on rank 0 atomically
and then holds every rank at a barrier; checkpoint.load_checkpoint reads it with weights_only=True.

Which checkpoint to resume from is decided by rank 0 alone and sent to every rank (rank0_decides):
on a shared filesystem the nodes can list different "newest" files. After loading, the ranks
compare their global_step and stop with one line if they differ.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset

from ddp_course.checkpoint import gather_rng_states, load_checkpoint, save_checkpoint
from ddp_course.cli import CourseError
from ddp_course.distributed import log
from ddp_course.seeding import set_rng_state

STATE_KEYS = ("model_name", "model", "optimizer", "scaler", "global_step", "rng_states")


def save_training_state(directory, global_step, ctx, model_name, model, optimizer, scaler, **position) -> Path:
    """Checkpoint after global_step optimizer steps; `position` says where training continues.

    A collective (the RNG states are gathered from every rank): every rank must call it.
    """
    state = {
        "model_name": model_name, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(), "global_step": global_step, "rng_states": gather_rng_states(), **position,
    }  # fmt: skip
    return save_checkpoint(state, directory, global_step, ctx.is_main)


def rank0_decides(choose, ctx):
    """Run choose() on rank 0 only and give its result to every rank (a collective: all must call it).

    For decisions read from a shared filesystem: which checkpoint is the newest, how far the job
    got. NFS clients cache directory listings and file attributes for some seconds (attribute
    caching), and a restart comes seconds after rank 0's os.replace(), so another node may still
    list an older newest checkpoint. Ranks that load different checkpoints start with the same
    weights (DDP broadcasts rank 0's) but different momentum, step counts and data positions: the
    replicas drift apart without an error, and the job hangs when their step counts run out at
    different times. So one rank reads, and every rank loads what it chose.
    """
    decision = [choose() if ctx.is_main else None]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(decision, src=0, device=ctx.device)  # pickled; NCCL sends it from the GPU
    return decision[0]


def check_ranks_agree(name: str, value, path) -> None:
    """All-gather value from every rank; a CourseError with one line unless all ranks hold the same."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    if len(set(values)) > 1:
        raise CourseError(
            f"the ranks resumed from different states of {path}: {name} {values} in rank order "
            "(does every node see the same files in the checkpoint directory?)"
        )


def restore_training_state(path, model_name, model, optimizer, scaler, ctx, position_keys=()) -> dict:
    """Load the state at path into model, optimizer, scaler and this rank's generators; return it.

    Every rank must pass the same path (rank0_decides) and call it: the ranks then check that they
    loaded the same global_step. Anything unusable (corrupt file, another model, weights of another
    shape) is a CourseError with one line. Generators are restored only when the checkpoint has a
    state for every rank of this job; a job of another size starts from its seeds and says so.
    """
    state = load_checkpoint(path, STATE_KEYS + tuple(position_keys))
    # The same name can hold different files on different nodes (a stale cached copy): compare.
    check_ranks_agree("global_step", state["global_step"], path)
    if state["model_name"] != model_name:
        raise CourseError(f"{path} holds a {state['model_name']} model, but this run trains {model_name}")
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
    except (RuntimeError, ValueError, KeyError) as error:
        raise CourseError(f"{path} does not fit this model or optimizer ({type(error).__name__})") from None
    if len(state["rng_states"]) == ctx.world_size:
        set_rng_state(state["rng_states"][ctx.rank])
    else:
        log(f"note: {path} was written by {len(state['rng_states'])} ranks, this job has {ctx.world_size}")
    return state


def cpu_state_dict(model) -> dict:
    """The bare model's weights (keys without "module.") on the CPU: the file loads on any machine."""
    return {name: tensor.cpu() for name, tensor in model.state_dict().items()}


@torch.no_grad()
def copy_rank0_buffers(model) -> None:
    """Give every rank rank 0's buffers (BatchNorm running mean and variance) before evaluating.

    DDP does not average buffers: it copies rank 0's to every rank at the start of each training
    forward, then every rank updates its running statistics with its own micro-batch. So after the
    last step the ranks hold slightly different statistics, and a job-wide accuracy would mix
    several models. With rank 0's everywhere it is the accuracy of the model that --save and the
    checkpoints keep. The digits CNN has no buffers (a no-op there); resnet18 has BatchNorm layers.
    """
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)  # in place; buffers live on ctx.device, as NCCL requires


@torch.no_grad()
def evaluate(model, loader, ctx) -> tuple[int, int]:
    """(correct, total) over the WHOLE held-out set: each rank scores a disjoint slice, then we sum."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=ctx.device)  # [correct, seen]
    for images, labels in loader:
        images, labels = images.to(ctx.device), labels.to(ctx.device)
        counts[0] += (model(images).argmax(dim=1) == labels).sum()
        counts[1] += labels.numel()
    dist.all_reduce(counts)  # sum over ranks; no sample is padded in or counted twice
    model.train()
    return int(counts[0]), int(counts[1])


def held_out_loader(dataset, ctx, num_workers: int = 0, batch_size: int = 256) -> DataLoader:
    """This rank's slice of the held-out set for evaluate(): samples rank, rank + world_size, ...

    Uneven slices, and no sampler padding: DistributedSampler would repeat samples to even out the
    shards and count them twice in the job's accuracy (lecture 3, section 5). Its own generator:
    evaluating must not draw from the default stream that dropout uses (seeding.dataloader_seed).
    """
    eval_slice = Subset(dataset, range(ctx.rank, len(dataset), ctx.world_size))
    generator = torch.Generator().manual_seed(ctx.rank)  # only seeds workers, which draw nothing here
    return DataLoader(eval_slice, batch_size=batch_size, num_workers=num_workers, generator=generator)
