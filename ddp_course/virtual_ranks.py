"""Lecture 1's plumbing for DDP on virtual ranks in one process: which samples each rank reads, its batches,
the optimizer, one process's step, a model's gradients, and the driver that trains replicas beside one process.

The two functions that *are* data parallelism (`average_gradients`, the simulated all-reduce, and
`data_parallel_step`) stay in the notebook, where a reader sees them; what is here only prepares
their inputs and reads their results.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from ddp_course.compare import max_relative_difference
from ddp_course.models import DigitsCNN
from ddp_course.seeding import seed_everything


def rank_indices(dataset, world_size: int, seed: int = 0, epoch: int = 0) -> list[torch.Tensor]:
    """Index tensor per rank for one epoch, dealt by DistributedSampler exactly as in a DDP job."""
    per_rank = []
    for rank in range(world_size):
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        per_rank.append(torch.tensor(list(sampler)))
    return per_rank


def rank_batches(dataset: TensorDataset, indices_per_rank: list[torch.Tensor], step: int, batch_size: int):
    """[(images, labels) of rank r at this step] for every rank r."""
    images, labels = dataset.tensors
    batches = []
    for indices in indices_per_rank:
        chosen = indices[step * batch_size : (step + 1) * batch_size]
        batches.append((images[chosen], labels[chosen]))
    return batches


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # lab 3's optimizer


def single_process_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def gradients_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def train_both_ways(data_parallel_step, dataset: TensorDataset, steps: int, world_size: int, per_rank_batch: int, indices_per_rank):
    """Train virtual DDP replicas (with the notebook's `data_parallel_step`) and one process on the global
    batch from the same seed-0 DigitsCNN; return (replicas, single, gaps). A control trains on rank 0's shard
    only; gaps holds, per step, each run's max relative difference from the single process."""
    seed_everything(0)
    single = DigitsCNN()
    control = copy.deepcopy(single)  # trains on rank 0's shard only
    replicas = [copy.deepcopy(single) for _ in range(world_size)]
    optimizers = [make_optimizer(r) for r in replicas]
    single_optimizer, control_optimizer = make_optimizer(single), make_optimizer(control)
    gaps = {f"DDP replicas vs one process, batch {world_size * per_rank_batch}": [], f"control: one process, batch {per_rank_batch}": []}
    for step in range(steps):
        batches = rank_batches(dataset, indices_per_rank, step, per_rank_batch)
        data_parallel_step(replicas, optimizers, batches)
        single_process_step(single, single_optimizer, torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
        single_process_step(control, control_optimizer, *batches[0])
        ddp_gap, control_gap = gaps
        gaps[ddp_gap].append(max_relative_difference(replicas[0].state_dict(), single.state_dict()))
        gaps[control_gap].append(max_relative_difference(control.state_dict(), single.state_dict()))
    return replicas, single, gaps
