"""Resuming part-way into an epoch, on the same or on a different number of ranks.

DistributedSampler(shuffle=True) draws ONE permutation of the dataset per epoch, from the
generator seeded with seed + epoch, whatever the number of ranks; it pads that order to a multiple
of the world size W by repeating its first samples and gives rank r the positions r, r + W, ...
So when every rank reads b samples per step, the job as a whole reads the permutation front to
back, b x W positions per step: after k steps of the epoch its first k x b x W positions (capped at
the dataset's length n: positions beyond it were padding) have been trained on, whatever W was.

That count, "samples of this epoch's permutation consumed", is the only position in the epoch
that survives a change of world size. A count of batches does not: 10 batches of 32 are 640
samples on 2 ranks and 320 on 1. ResumableDistributedSampler starts an epoch at such a count and
deals the REST of the permutation to the new ranks the way DistributedSampler deals a whole epoch,
so that nothing is skipped and nothing is read twice (lecture 3's exercise 2 derives the same
rest, then leaves the shards uneven; here they are padded like DistributedSampler's, because
every DDP rank must make the same number of steps - see the class docstring).

Used by lab 7 (crash, restart, scale-down) and lecture 6 (why a batch count is the wrong position).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch.utils.data import Sampler


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The permutation DistributedSampler(shuffle=True, seed=seed) reads in `epoch`, for any world size."""
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=generator).tolist()


def samples_consumed(start: int, batches: int, batch_size: int, world_size: int, num_samples: int) -> int:
    """Positions of the epoch's permutation trained on after `batches` batches per rank from `start`.

    Each batch takes batch_size positions per rank, batch_size x world_size for the job; positions
    past num_samples are padding, so the count stops there (the epoch is complete).
    """
    return min(start + batches * batch_size * world_size, num_samples)


class ResumableDistributedSampler(Sampler[int]):
    """DistributedSampler(shuffle=True, drop_last=False) that can start part-way into an epoch.

    set_epoch(epoch, samples_consumed=c): this rank reads order[c:][rank::world_size], where order
    is epoch_order(n, seed, epoch), after padding order[c:] to a multiple of world_size with the
    epoch's first samples (as DistributedSampler pads a whole epoch). Hence:
    - c = 0 gives exactly DistributedSampler's indices (tests/test_lab7_fault_tolerance.py checks it);
    - on the SAME world size, starting at c = k x batch_size x world_size gives exactly what the
      uninterrupted sampler gives after its first k batches: a restart changes nothing;
    - on ANOTHER world size the new ranks share the unread rest between them: no sample of the
      epoch is skipped, none is read twice, except the at most world_size - 1 padding samples that
      make the shards equally long (none when world_size divides n - c). Equal shards keep every
      DDP rank at the same number of steps; the alternative, uneven shards, needs
      torch.distributed.algorithms.Join (lecture 3, section 5).
    """

    def __init__(self, num_samples: int, num_replicas: int, rank: int, seed: int = 0):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in 0..{num_replicas - 1}")
        self.num_samples, self.num_replicas, self.rank, self.seed = num_samples, num_replicas, rank, seed
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, samples_consumed: int = 0) -> None:
        """Read `epoch`'s permutation from position samples_consumed on (0: the whole epoch)."""
        if not 0 <= samples_consumed <= self.num_samples:
            raise ValueError(f"samples_consumed must be in 0..{self.num_samples}, got {samples_consumed}")
        self.epoch, self.start = epoch, samples_consumed

    def __len__(self) -> int:
        return math.ceil((self.num_samples - self.start) / self.num_replicas)

    def __iter__(self):
        order = epoch_order(self.num_samples, self.seed, self.epoch)
        rest = order[self.start :]
        padding = len(self) * self.num_replicas - len(rest)
        rest += itertools.islice(itertools.cycle(order), padding)  # the epoch's first samples again
        return iter(rest[self.rank :: self.num_replicas])


# What torchrun's environment needs for restarts that work (--max-restarts, --nnodes=MIN:MAX): by
# default torchrun lets the workers share its rendezvous store and keeps that one store for every
# attempt, so a restarted worker can read the address a dead worker of the last attempt published
# and fail ("connectFullMesh ... Connection refused") or wait. Measured with gloo on torch 2.14; the
# cause is backend-independent (NCCL's unique id goes through the same store). With this variable
# every attempt gets a fresh store. labs/lab7_fault_tolerance.py explains it and refuses any torchrun
# that shares its store without it; the tests, the lab sheet and labs/slurm/lab3.sbatch set it.
RESTART_SAFE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
