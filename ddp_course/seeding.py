"""Seeds and random-number-generator states.

Every rank seeds with the same value so that every replica builds identical initial weights
(DDP also broadcasts rank 0's weights at wrap time, but equal seeds make single-process reference
runs comparable). Data order comes from DistributedSampler's own seed, not from these generators.
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
