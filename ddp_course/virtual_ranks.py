"""Lecture 1's plumbing for DDP on virtual ranks in one process: which samples each rank reads, its batches,
the optimizer, one process's step and a model's gradients.

The two functions that *are* data parallelism (`average_gradients`, the simulated all-reduce, and
`data_parallel_step`) stay in the notebook, where a reader sees them; what is here only prepares
their inputs and reads their results.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset


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
