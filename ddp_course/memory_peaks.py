"""Lecture 5b's memory measurements on the CPU: a step's peak from the profiler, the activations autograd
saves, and the training runs they measure (lab 5's MLP, 16 layers of 256).

    peak_allocated_bytes(training_run("adam", use_ddp=True))   # bytes, a step's peak over 2 steps
    step_flops(segments=4) / step_flops(segments=0)             # what checkpointing recomputes
    seconds_per_step(segments=4) / seconds_per_step(segments=0)  # what that costs on this machine

The peak is the running sum of every allocation and free the profiler records (`profile_memory=True`),
so it needs no GPU: on one, `torch.cuda.max_memory_allocated()` gives the same quantity directly.
`training_run(use_ddp=True)` needs a process group (a one-rank group is enough: DDP's buckets do not
depend on the world size).
"""

from __future__ import annotations

import gc
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from ddp_course.models import WideMLP

MEMORY_BATCH = 1024
MEMORY_FEATURES = 256


def memory_model() -> WideMLP:
    torch.manual_seed(0)
    return WideMLP(in_features=MEMORY_FEATURES, width=256, depth=16)


def peak_allocated_bytes(run) -> int:
    """Peak of (bytes allocated - bytes freed) on the CPU while run() executes, from the profiler.

    run() runs once unmeasured first: what a process sets up on its first DDP step (gloo's and the reducer's
    one-time buffers), whose lifetime depends on thread timing, is not a training step's memory. Without it,
    the first DDP measurement in a process on a busy machine sometimes comes out 4P higher (45.3 MB instead
    of 41.1 for lecture 5b's Adam with DDP: 1 of 10 fresh processes beside 4 busy loops on 2 cores, 30 Nov
    2026; with the unmeasured run first, 0 of 10)."""
    run()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    changes = sorted((event.start_ns(), event.nbytes()) for event in prof.profiler.kineto_results.events() if event.name() == "[memory]")
    held = peak = 0
    for _, change in changes:
        held += change
        peak = max(peak, held)
    return peak


def activation_bytes(model: torch.nn.Module, inputs: torch.Tensor, autocast: bool = False) -> int:
    """Bytes of the tensors autograd saves for backward in one forward pass (parameters excluded)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()  # a storage counts once, however many views of it are saved
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(inputs)
    return sum(saved.values())


def training_run(optimizer_name="adam", use_ddp=False, batch=MEMORY_BATCH, segments=0, autocast=False, micro_batches=1):
    """A function that builds the model and trains it for 2 steps (everything it allocates is measured)."""

    def run():
        model = memory_model()
        trained = DDP(model) if use_ddp else model
        if optimizer_name == "adam":  # fused: the update happens in place, no full-size temporaries
            optimizer = torch.optim.Adam(trained.parameters(), lr=1e-3, fused=True)
        else:
            optimizer = torch.optim.SGD(trained.parameters(), lr=0.1, momentum=0.9)
        generator = torch.Generator().manual_seed(0)
        for _ in range(2):  # the second step holds the optimizer state the first one created
            for _ in range(micro_batches):
                inputs = torch.randn(batch, MEMORY_FEATURES, generator=generator)
                labels = torch.randint(0, 10, (batch,), generator=generator)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    logits = checkpointed_forward(model, inputs, segments) if segments else trained(inputs)
                    loss = F.cross_entropy(logits, labels) / micro_batches
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)  # gradients stay allocated between steps, as the formula assumes
        del trained, model, optimizer
        gc.collect()

    return run


def checkpointed_forward(model: WideMLP, inputs: torch.Tensor, segments: int) -> torch.Tensor:
    """Run the MLP as `segments` checkpointed pieces: only each piece's input is kept for backward."""
    layers = list(model.layers)
    size = math.ceil(len(layers) / segments)
    for start in range(0, len(layers), size):
        piece = torch.nn.Sequential(*layers[start : start + size])
        inputs = checkpoint(piece, inputs, use_reentrant=False)
    return inputs


def step_flops(segments: int = 0) -> int:
    """FLOPs of one forward + backward of the memory model at MEMORY_BATCH, as torch counts them
    (FlopCounterMode); segments > 0 checkpoints it, so backward recomputes the forward pass."""
    model, inputs = memory_model(), torch.randn(MEMORY_BATCH, MEMORY_FEATURES)
    with FlopCounterMode(display=False) as counter:
        logits = checkpointed_forward(model, inputs, segments) if segments else model(inputs)
        F.cross_entropy(logits, torch.zeros(MEMORY_BATCH, dtype=torch.long)).backward()
    return counter.get_total_flops()


def seconds_per_step(segments: int = 0, repeats: int = 5) -> float:
    """Median wall time of one forward + backward (segments as in step_flops): a live timing, so the
    lecture prints it in a cell nbval does not compare."""
    model, inputs = memory_model(), torch.randn(MEMORY_BATCH, MEMORY_FEATURES)
    labels = torch.zeros(MEMORY_BATCH, dtype=torch.long)
    times = []
    for _ in range(repeats):  # the median of a few: one slow step (another process, a page fault) does not count
        started = time.perf_counter()
        logits = checkpointed_forward(model, inputs, segments) if segments else model(inputs)
        F.cross_entropy(logits, labels).backward()
        times.append(time.perf_counter() - started)
    return statistics.median(times)
