"""Lecture 4's model and instruments, shared by its demo script, its exercise checks and its bucket figure.

lectures/scripts/ddp_internals_demos.py runs the demos in a 2-rank job; ddp_course/lecture04_checks.py
runs exercises 1 and 2 against real DDP in one process and ddp_course/diagrams/ddp_backward.py draws
what the third iteration did. All three build the same OutOfOrderNet and read DDP with the same
instruments, so they live here rather than in the script (the package never imports a script).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


class OutOfOrderNet(nn.Module):
    """Four layers registered in another order than forward uses them: `head` first, used last."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(256, 10)  # 10 KiB of weights
        self.embed = nn.Linear(64, 512)  # 128 KiB
        self.hidden = nn.Linear(512, 512)  # 1 MiB
        self.proj = nn.Linear(512, 256)  # 512 KiB

    def forward(self, x):  # (B, 64) -> (B, 10)
        return self.head(F.relu(self.proj(F.relu(self.hidden(F.relu(self.embed(x)))))))


def batch(rank: int, size=(8, 64), step: int = 0) -> torch.Tensor:
    """A different batch on every rank (as DistributedSampler gives), the same on every run."""
    return torch.randn(size, generator=torch.Generator().manual_seed(1000 * rank + step))


def train_steps(model, steps: int, rank: int, size=(8, 64), **forward_kwargs) -> None:
    """Forward and backward `steps` times on this rank's batches (no optimizer: the demos read gradients)."""
    for step in range(steps):
        model(batch(rank, size, step), **forward_kwargs).square().mean().backward()


def bucket_names(ddp: DDP) -> list[list[str]]:
    """Parameter names of each gradient bucket, in the order DDP all-reduces the buckets.

    Read from the reducer's private _get_zeros_like_grad_buckets() (torch 2.14; no public API).
    """
    names = {p: name for name, p in ddp.module.named_parameters()}
    return [[names[p] for p in bucket.parameters()] for bucket in ddp.reducer._get_zeros_like_grad_buckets()]


def logging_hooks(ddp: DDP, log: list):
    """Record, in program order, when each gradient is ready and when DDP launches each bucket."""
    for name, parameter in ddp.module.named_parameters():
        parameter.register_post_accumulate_grad_hook(lambda p, name=name: log.append(["ready", name]))

    def launch_logger(state, bucket):
        log.append(["launch", bucket.index()])
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, launch_logger)


def grads_with_hook(rank: int, hook) -> list[torch.Tensor]:
    """Each parameter's gradient after one DDP step with this communication hook (None: DDP's built-in all-reduce)."""
    torch.manual_seed(0)
    ddp = DDP(OutOfOrderNet(), bucket_cap_mb=0.1)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    train_steps(ddp, 1, rank)
    return [p.grad.clone() for p in ddp.module.parameters()]
