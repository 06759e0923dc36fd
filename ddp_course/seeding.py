"""Seeds and random-number-generator states.

Every rank seeds with the same value so that every replica builds identical initial weights
(DDP also broadcasts rank 0's weights at wrap time, but equal seeds make single-process reference
runs comparable). Data order comes from DistributedSampler's own seed, not from these generators,
and each DataLoader gets a generator of its own (dataloader_seed says why).
"""

from __future__ import annotations

import random

import torch


def seed_everything(seed: int) -> None:
    """Seed Python's and torch's generators (torch.manual_seed also seeds every CUDA device)."""
    random.seed(seed)
    torch.manual_seed(seed)


def get_rng_state() -> dict:
    """This process's generator states, as plain tuples and tensors (loads with weights_only=True)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's generator
    return state


def set_rng_state(state: dict) -> None:
    """Restore what get_rng_state() returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def dataloader_seed(seed: int, rank: int, epoch: int) -> int:
    """The seed of one rank's DataLoader generator for one epoch: it depends on (seed, rank, epoch) only.

    Why a DataLoader needs a generator of its own: every iter(loader) draws a base seed for its
    worker processes (torch/utils/data/dataloader.py, _BaseDataLoaderIter.__init__), from
    loader.generator, or from the default generator when the loader has none - even with
    num_workers=0. A resumed job creates its iterator at another point of the default stream than
    the uninterrupted job did (mid-epoch, right after restoring the generator states), so every
    dropout mask after the resume would be one draw out of step. Reseeded from this value at the
    start of each epoch, the loader's own generator keeps iter() off the default stream, and the
    workers still get a base seed that differs per rank and per epoch (CIFAR-10's crops and flips).
    random.Random seeds from a string through SHA-512: the same value on every machine and Python.
    """
    return random.Random(f"dataloader seed={seed} rank={rank} epoch={epoch}").getrandbits(63)
