"""Lecture 7: DDP against FSDP - the bytes one rank holds over one AdamW step, counted from tensor storages.

The data are lab 9's memory part on 2 gloo ranks (solutions/lab9_reference/ranks2.json: lab 6's character
transformer, 4 windows of 64 characters per rank), which tests/test_lab9_fsdp_practice.py checks against a
fresh run: a changed measurement makes the reference stale there, and this figure stale here. Each sample
is one moment of the step (a module's entry or exit in forward, a module's backward, then the gradient
sync and the optimizer step), each band a category of tensors, counted from their storages; the dotted
line is the counted peak. (Lab 9 also measures the allocator's own peak; the figure shows the count.)
"""

from __future__ import annotations

import json
from pathlib import Path

NAME = "sharded_memory_timeline"
TITLE = "DDP vs FSDP (fully_shard): what one rank holds over one AdamW step, counted on 2 gloo ranks"
DATA = Path(__file__).resolve().parent.parent.parent / "solutions" / "lab9_reference" / "ranks2.json"
SHOWN = {"ddp": "DDP", "fully_shard": "FSDP (fully_shard, reshard after forward)"}
COLOURS = {"parameters": "tab:blue", "gathered": "tab:cyan", "gradients": "tab:orange", "optimizer_state": "tab:green",
           "activations": "tab:red"}  # fmt: skip
MIB = 2**20


def phase_of(label: str) -> str:
    if label in ("start", "zero_grad"):
        return "before"
    if label.startswith("forward") or label == "after forward":
        return "forward"
    if label.startswith("backward") or label == "after backward":
        return "backward"
    return "sync and step"


def describe() -> dict:
    """The bytes per category at every sampled moment, for DDP and fully_shard, in MiB (3 decimals), and
    where each phase of the step begins; each implementation's peak and the formula's."""
    memory = json.loads(DATA.read_text())["memory"]
    labels, categories = memory["labels"], memory["categories"]
    phases = [phase_of(label) for label in labels]
    starts = {phase: phases.index(phase) for phase in ("before", "forward", "backward", "sync and step")}
    series = {}
    for impl, title in SHOWN.items():
        facts = memory["impls"][impl]
        series[impl] = {"title": title, "peak_mib": round(facts["counted_peak_bytes"] / MIB, 3), "peak_at": facts["counted_peak_at"],
                        "predicted_peak_mib": round(facts["predicted_peak_bytes"] / MIB, 3),
                        "mib": {c: [round(sample[i] / MIB, 3) for sample in facts["bytes"]] for i, c in enumerate(categories)}}  # fmt: skip
    return {"source": "solutions/lab9_reference/ranks2.json (lab 9, memory part, 2 gloo ranks)", "samples": len(labels),
            "phase_starts": starts, "categories": categories, "series": series}  # fmt: skip


def draw(description: dict):
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(description["series"]), figsize=(12, 3.8), sharey=True)
    x = list(range(description["samples"]))
    for axis, series in zip(axes, description["series"].values()):
        axis.stackplot(x, *(series["mib"][c] for c in description["categories"]), labels=description["categories"],
                       colors=[COLOURS[c] for c in description["categories"]], alpha=0.85)  # fmt: skip
        for phase, start in description["phase_starts"].items():
            if phase != "before":  # the first two moments: the step's start and zero_grad
                axis.axvline(start, color="0.3", linewidth=0.6)
                axis.text(start + 1, 0.3, phase, fontsize=7, color="0.2", rotation=90, va="bottom")
        axis.axhline(series["peak_mib"], color="black", linestyle=":", linewidth=0.8)
        axis.set_title(f"{series['title']}\ncounted peak {series['peak_mib']:.2f} MiB (formula {series['predicted_peak_mib']:.2f})", fontsize=9)
        axis.set_xlabel("moments of the step (module boundaries)")
    axes[0].set_ylabel("MiB held by one rank")
    axes[0].legend(loc="upper left", fontsize=7)
    figure.tight_layout()
    return figure
