"""Compare two sets of weights: the check behind every "DDP equals one process" claim."""

from __future__ import annotations

import torch


def max_relative_difference(weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """max over tensors of ||w - ref|| / ||ref|| (Frobenius norms); 0.0 means identical.

    Relative, because float32 rounding scales with the size of the values (about 1e-7 per operation);
    per tensor, because a small layer's error would vanish in one norm over the whole model.
    """
    if weights.keys() != reference.keys():
        raise ValueError(f"different parameter names: {sorted(weights.keys() ^ reference.keys())}")
    worst = 0.0
    for name, ref in reference.items():
        diff = (weights[name].double() - ref.double()).norm()
        worst = max(worst, float(diff / ref.double().norm().clamp_min(1e-30)))
    return worst
