"""What a rank holds and what it sends under DDP, ZeRO-1/2 and FSDP (lecture 7, labs 8 and 9).

    storage_bytes(tensors)              bytes of the distinct storages behind some tensors (a DTensor: its shard)
    model_state_bytes(params, opt)      this rank's parameters, gradients and optimizer state, in bytes
    count_collectives(*modules)         a context manager recording every torch.distributed collective's payload
    at_module_boundaries(model, sample) a context manager calling sample(label) at every module's entry and exit
                                        in forward and before its backward: where an FSDP's memory changes
    StepWatch(sources)                  bytes per category (each storage once) sampled at those points of a step
    cuda_peak(device)                   torch.cuda's peak allocation during a block, less what was allocated before
    bytes_written()                     what this process really wrote (sockets included) during a block: Linux
    allocations(device)                 the allocator's own peak during a block (CPU: the profiler's memory events
                                        over every thread; CUDA: max_memory_allocated), and its bytes at samples
    SavedActivations()                  the tensors autograd saves for backward while it is active, still alive
    SampledAlongside(allocator, sources) a StepWatch that also notes the allocator's bytes at each sample
    cuda_snapshot(directory, name, ...) GPU: every CUDA allocation of a block, a snapshot file per rank
    predicted_peak(impl, sizes, A, N)   one rank's peak during an AdamW step under each implementation (lab 9)
    predicted_bytes_per_step(...)       the bytes one rank sends per step under each stage (lecture 2's ring costs)
    predicted_state_bytes(...)          the model state one rank keeps under each stage, with Adam in float32

Bytes are counted from storages, not from shapes: two views of one buffer (DDP's gradient_as_bucket_view,
tied embeddings) count once, a freed tensor (storage resized to 0, as FSDP does with full weights between
uses) counts 0, and a DTensor (fully_shard's parameters) counts the local shard this rank really stores.

Ring costs (lecture 2), for a payload of S bytes on N ranks, bytes each rank sends:
    all-reduce                       2 (N - 1) / N x S   (a reduce-scatter, then an all-gather)
    all-gather, reduce-scatter       (N - 1) / N x S     (S: the gathered output, the scattered input)
    broadcast                        (N - 1) / N x S     (pipelined: on average over the ranks)
CollectiveCounter's ring_model_bytes_* apply them to the payloads it recorded: what a ring would send (NCCL's
ring algorithms do), a count and a model, not a measurement. gloo does not run every collective as a ring:
its reduce-scatter is an all-reduce of the whole input, of which each rank keeps its part
(ProcessGroupGloo::reduce_scatter_tensor_coalesced; its profiler span is "gloo:all_reduce"), so on gloo a
reduce-scatter sends 2 (N - 1) / N x S, twice the model. bytes_written() measures what really left.
"""

from __future__ import annotations

import functools
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from ddp_course.cli import CourseError

# torch.distributed's name -> the kind of collective, where its full payload S is among the arguments
# (position, keyword: all-reduce's and broadcast's tensor, all-gather's output, reduce-scatter's input),
# and the position of its `group` argument (it may also come as a keyword).
COLLECTIVES = {
    "all_reduce": ("all_reduce", 0, "tensor", 2),
    "broadcast": ("broadcast", 0, "tensor", 2),
    "all_gather": ("all_gather", 0, "tensor_list", 2),  # the output is a list of N tensors
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor", 2),
    # torch 2.14.1 names them all_gather_single / reduce_scatter_single; the old names still work and warn
    # (torch/distributed/distributed_c10d.py: all_gather_into_tensor is @deprecated, line 5176 of 2.14.1).
    "all_gather_single": ("all_gather", 0, "output_tensor", 2),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input", 3),
    "reduce_scatter_single": ("reduce_scatter", 1, "input", 3),
}
RING_FACTOR = {  # wire bytes per rank = factor(N) x S
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
}
STAGES = ("ddp", "zero1", "zero2", "fsdp")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores: a DTensor's local shard, any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (None entries skipped): each storage counted once, whole."""
    seen: dict[tuple, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        storage = _local(tensor).untyped_storage()
        if storage.nbytes() > 0:  # a freed storage (resize_(0)) holds nothing
            seen[(storage.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor in the optimizer's state (Adam's moments and step counts). A ZeRO-1 ShardedOptimizer
    (solutions/minddp.py) keeps its state in .local_optimizer: that shard is what this rank holds."""
    optimizer = getattr(optimizer, "local_optimizer", None) or optimizer
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


def model_state_bytes(parameters, optimizer) -> dict[str, int]:
    """This rank's bytes of model state: {"parameters", "gradients", "optimizer_state", "total"}.

    parameters: what the rank keeps between steps (model.parameters(): DDP's full replicas, minifsdp's
    slices and replicated 1-D parameters, fully_shard's DTensors). Call it after backward and before
    zero_grad(), while the gradients exist. Full weights an FSDP gathers only around their use are
    transient: between steps their storage is freed, so they count 0. DDP's bucket buffers count only
    when the gradients are views into them (gradient_as_bucket_view=True); otherwise DDP holds another
    gradient-sized copy that this count does not see.
    """
    parameters = list(parameters)
    gradients = [p.grad for p in parameters]
    state = optimizer_state_tensors(optimizer) if optimizer is not None else []
    return {
        "parameters": storage_bytes(parameters),
        "gradients": storage_bytes(gradients),
        "optimizer_state": storage_bytes(state),
        "total": storage_bytes(parameters + gradients + state),  # a storage shared by two kinds counts once
    }


def _payload_bytes(value) -> int:
    tensors = value if isinstance(value, (list, tuple)) else [value]
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


@dataclass
class CollectiveCounter:
    """Collectives recorded by count_collectives(): calls is a list of (kind, S bytes), in call order, and
    groups the ranks of each call's process group (a tuple of global ranks, in the same order)."""

    calls: list[tuple[str, int]] = field(default_factory=list)
    groups: list[tuple[int, ...]] = field(default_factory=list)

    def bytes_by_kind(self) -> dict[str, int]:
        """{kind: total payload S in bytes} over the recorded calls."""
        totals: dict[str, int] = {}
        for kind, size in self.calls:
            totals[kind] = totals.get(kind, 0) + size
        return totals

    def ring_model_bytes_per_rank(self, world_size: int) -> float:
        """Bytes each rank would send for the recorded calls by the ring costs (module docstring): a model
        applied to the payloads, which gloo's reduce-scatter exceeds."""
        return sum(RING_FACTOR[kind](world_size) * size for kind, size in self.calls)

    def ring_model_bytes_by_group(self) -> dict[tuple[int, ...], float]:
        """{ranks of a process group: bytes each of its ranks would send by the ring costs}, each call by its own group's size: on a
        2-D mesh, what travels inside a group of ranks (a node) and what travels between groups."""
        found: dict[tuple[int, ...], float] = {}
        for (kind, size), ranks in zip(self.calls, self.groups):
            found[ranks] = found.get(ranks, 0.0) + RING_FACTOR[kind](len(ranks)) * size
        return found


def _counting(kind: str, position: int, keyword: str, group_position: int, real, counter: CollectiveCounter):
    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        payload = args[position] if len(args) > position else kwargs[keyword]
        group = args[group_position] if len(args) > group_position else kwargs.get("group")
        counter.calls.append((kind, _payload_bytes(payload)))
        counter.groups.append(tuple(dist.get_process_group_ranks(group or dist.group.WORLD)))
        return real(*args, **kwargs)

    return wrapper


@contextmanager
def count_collectives(*modules):
    """Record every collective called through torch.distributed while the block runs; yields a CollectiveCounter.

        with count_collectives(minifsdp) as counter:   # minifsdp: a module that saved its own aliases
            training_step(...)
        counter.bytes_by_kind(), counter.ring_model_bytes_per_rank(world_size)

    It replaces the functions of COLLECTIVES in torch.distributed, and in each module given any global that
    is one of them (solutions/minifsdp.py binds `all_gather_single = dist.all_gather_single` at import:
    replacing torch.distributed's attribute alone would miss its calls), and puts them back on exit.
    Not replaced: torch.distributed.distributed_c10d's own globals, so all_gather_into_tensor, which calls
    c10d's all_gather_single, counts once.

    What it sees in torch 2.14.1:
    - fully_shard (FSDP2) calls dist.all_gather_single(...) and dist.reduce_scatter_single(output=...,
      input=...) through the torch.distributed module (read in the 2.14.1 wheel:
      torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, DefaultAllGather.__call__ line 119 and
      DefaultReduceScatter.__call__ line 184; releases before 2.14 call all_gather_into_tensor /
      reduce_scatter_tensor, which COLLECTIVES counts too): seen.
    - torch's DistributedDataParallel all-reduces its buckets inside its C++ Reducer: NOT seen. To count
      DDP, register a Python comm hook that does the same all-reduce through dist.all_reduce:
      ddp.register_comm_hook(None, torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook)
      (one all-reduce per bucket, the bucket's flat gradient as payload). DDP's start-up broadcast of the
      weights is C++ too, and is not part of a step.
    """
    counter = CollectiveCounter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    wrappers = {name: _counting(*COLLECTIVES[name], real, counter) for name, real in originals.items()}
    replaced = []  # (namespace, attribute, original) to restore
    for namespace in (dist, *modules):
        for attribute, value in list(vars(namespace).items()):
            for name, real in originals.items():
                if value is real:
                    replaced.append((namespace, attribute, value))
                    setattr(namespace, attribute, wrappers[name])
                    break
    try:
        yield counter
    finally:
        for namespace, attribute, value in reversed(replaced):
            setattr(namespace, attribute, value)


def predicted_bytes_per_step(stage: str, sharded_bytes: float, replicated_bytes: float, world_size: int) -> float:
    """Bytes one rank sends per training step (ring costs), without gradient accumulation.

    sharded_bytes: the FULL size of the parameters a stage shards (their gradients are the same size in
    float32); replicated_bytes: parameters every rank keeps whole (minifsdp's 1-D gains and biases).
    DDP shards nothing: pass every parameter in either argument.
      ddp    all-reduce every gradient:                     2 (N-1)/N x (sharded + replicated)
      zero1  as lab 6's ShardedOptimizer: DDP's all-reduce, then each updated parameter broadcast from
             its owner:                                     + (N-1)/N x (sharded + replicated)
      zero2  reduce-scatter the gradients, all-gather the updated parameters: DDP's bytes in two halves
      fsdp   (ZeRO-3) all-gather before forward, again before backward, reduce-scatter after:
             3 (N-1)/N x sharded = 1.5 x DDP's bytes for the sharded part; replicated gradients all-reduced
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {', '.join(STAGES)}, not {stage!r}")
    n = world_size
    one_way = (n - 1) / n  # an all-gather, reduce-scatter or broadcast of the payload
    everything = sharded_bytes + replicated_bytes
    if stage == "ddp" or stage == "zero2":
        return 2 * one_way * everything
    if stage == "zero1":
        return 3 * one_way * everything
    return 3 * one_way * sharded_bytes + 2 * one_way * replicated_bytes


def predicted_state_bytes(stage: str, sharded_bytes: float, replicated_bytes: float, world_size: int) -> float:
    """Bytes of model state one rank keeps with Adam, everything float32 (ZeRO paper's 16 bytes per parameter
    without mixed precision): parameters 4, gradients 4, Adam's two moments 8 bytes per element.

    sharded_bytes, replicated_bytes: float32 parameter bytes, as for predicted_bytes_per_step. Ignored
    here: padding rows and Adam's step counters (a few bytes per tensor).
      ddp    4 x everything                       (nothing sharded)
      zero1  (2 + 2/N) x everything               (Adam's state sharded)
      zero2  (1 + 3/N) x everything               (gradients too)
      fsdp   4/N x sharded + 4 x replicated       (parameters too)
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {', '.join(STAGES)}, not {stage!r}")
    n, everything = world_size, sharded_bytes + replicated_bytes
    per_element = {"ddp": 4, "zero1": 2 + 2 / n, "zero2": 1 + 3 / n}
    if stage in per_element:
        return per_element[stage] * everything
    return 4 / n * sharded_bytes + 4 * replicated_bytes


@contextmanager
def at_module_boundaries(model: torch.nn.Module, sample: Callable[[str], None], modules=None):
    """Call sample(label) wherever an FSDP gathers or frees weights: at the entry of every module's forward
    ("forward > name"), at its exit ("forward < name"), and in backward when the gradient of its output is
    ready, just before its own backward runs ("backward > name").

    modules: the (name, module) pairs to watch (default: model.named_modules()). The hooks are registered
    after any the model already has, so an FSDP's own hooks run first: a pre-hook here sees the weights its
    pre-hook gathered, an exit hook sees what its forward hook freed, and the gradient hook sees what its
    backward pre-hook gathered again. Removed on exit. Reads only sizes: nothing is allocated or copied.
    """
    handles = []

    def watch_output(name):
        def hook(module, inputs, output):
            sample(f"forward < {name}")
            for tensor in output if isinstance(output, (tuple, list)) else [output]:
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(lambda grad: sample(f"backward > {name}"))

        return hook

    for name, module in modules if modules is not None else model.named_modules():
        name = name or "model"
        handles.append(module.register_forward_pre_hook(lambda module, inputs, name=name: sample(f"forward > {name}")))
        handles.append(module.register_forward_hook(watch_output(name)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _new_storage_bytes(tensors, seen: set) -> int:
    """Bytes of the storages behind `tensors` not yet in `seen` (then added to it); freed storages count 0."""
    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        storage = _local(tensor).untyped_storage()
        key = (storage.device, storage.data_ptr())
        if storage.nbytes() > 0 and key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


class StepWatch:
    """What one rank holds during a training step, by category, sampled where it can change.

        watch = StepWatch({"weights": lambda: optimizer_params, "gathered": lambda: full_weights_now})
        with watch.during(model, wrapper):   # every module boundary (at_module_boundaries) and "after forward"
            training_step()
        watch.peak(), watch.peak("gathered"), watch.at("after forward")

    sources: {category: a function returning the tensors of that category now}. A storage is counted once,
    in the first category (in the dict's order) that lists it, so a view or a tied weight never counts
    twice. Sizes only: sampling allocates and copies nothing.
    """

    def __init__(self, sources: dict):
        self.sources = sources
        self.samples: list[tuple[str, dict[str, int]]] = []  # (label, {category: bytes}), in step order

    def sample(self, label: str) -> None:
        seen: set = set()
        self.samples.append((label, {category: _new_storage_bytes(source(), seen) for category, source in self.sources.items()}))

    @contextmanager
    def during(self, model: torch.nn.Module, wrapper: torch.nn.Module | None = None, modules=None):
        """Sample at every module boundary of `model` while the block runs, and once more when the outermost
        module (`wrapper`, e.g. the FSDP or DDP around `model`) has finished its forward: "after forward"."""
        with at_module_boundaries(model, self.sample, modules):  # first, so that "after forward" comes last
            outer = (wrapper or model).register_forward_hook(lambda module, inputs, output: self.sample("after forward"))
            try:
                yield self
            finally:
                outer.remove()

    def total(self, sample: dict[str, int], categories=None) -> int:
        return sum(size for category, size in sample.items() if categories is None or category in categories)

    def peak(self, *categories: str) -> int:
        """The largest total over the samples of these categories (all if none given)."""
        return max(self.total(sizes, categories or None) for _, sizes in self.samples)

    def at(self, label: str) -> dict[str, int]:
        """The last sample with this label."""
        return next(sizes for found, sizes in reversed(self.samples) if found == label)


@contextmanager
def cuda_peak(device: torch.device):
    """Yields a dict whose "bytes" is, after the block, torch.cuda.max_memory_allocated during it less what
    was allocated when it began (what other models hold stays out); None on a CPU device.
    GPU track: written with care, NOT YET RUN on a GPU."""
    found = {"bytes": None}
    if device.type != "cuda":
        yield found
        return
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    yield found
    torch.cuda.synchronize(device)  # kernels still running may allocate: wait before reading the peak
    found["bytes"] = torch.cuda.max_memory_allocated(device) - before


def _written_so_far() -> int | None:
    """wchar of /proc/self/io: the bytes every thread of this process has passed to write-like system calls
    (files, pipes and sockets - gloo's sends); None where there is no such file (not Linux)."""
    try:
        with open("/proc/self/io") as io:
            return next(int(line.split()[1]) for line in io if line.startswith("wchar:"))
    except (OSError, StopIteration, ValueError):
        return None


@contextmanager
def bytes_written():
    """Yields a dict whose "bytes" is, after the block, what this process wrote during it (None off Linux).
    Around collectives and nothing else (no printing, no files), that is what this rank sent: payloads
    plus the transport's small headers. Measured, unlike CollectiveCounter's ring model."""
    found = {"bytes": None}
    before = _written_so_far()
    yield found
    after = _written_so_far()
    if before is not None and after is not None:
        found["bytes"] = after - before


# --- the allocator's own figures: what a step really holds, beside what the counts name ----------------


class SavedActivations:
    """A context manager: every tensor autograd saves for backward while it is active is remembered (weakly);
    alive() lists those not yet freed. Autograd frees them as backward consumes them."""

    def __init__(self):
        self.saved: list[weakref.ref] = []

    def pack(self, tensor):
        self.saved.append(weakref.ref(tensor))
        return tensor  # saved as it is: this only watches

    def alive(self) -> list[torch.Tensor]:
        return [tensor for tensor in (ref() for ref in self.saved) if tensor is not None]

    def __enter__(self):
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self.hooks.__exit__(*exc)


class Allocations:
    """What allocations() yields. Inside its block, `with found.measured():` marks the part to weigh (at most
    once; the whole block if never), and found.sample() notes the bytes allocated at that moment. After the
    block, found.peak is the most bytes the device's allocator had handed out at once during the marked
    part, and found.at_samples the bytes at each sample(), both net of when the block began: allocated
    then less allocated at its start. So what the block built before the marked part (a model, its
    optimizer's state) counts, what existed before does not - and a free of memory that existed before
    lowers the figure (lab 9's checkpoint part's zero_grad frees the previous step's gradients: both its
    peaks are net of them, which leaves the comparison between its two settings fair).
    CPU: torch.profiler's memory events, each carrying the allocator's running total (every thread's, gloo's
    workers included: see track_every_thread). CUDA (written with care, NOT RUN on a GPU): torch.cuda's
    max_memory_allocated and memory_allocated, less memory_allocated when the block began."""

    MARK, SAMPLE = "ddp_course: the measured part", "ddp_course: sample"

    def __init__(self, device: torch.device):
        self.device, self.peak, self.marked = device, None, False
        self.before = 0  # CUDA: memory_allocated when the block began
        self.at_samples: list[int] = []  # the bytes allocated at each sample() (filled after the block on CPU)

    @contextmanager
    def measured(self):
        self.marked = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)  # the peak restarts from what is allocated now
            yield
            torch.cuda.synchronize(self.device)  # kernels still running may allocate: wait before reading
            self.cuda_peak = torch.cuda.max_memory_allocated(self.device)
            return
        from torch.profiler import record_function

        with record_function(self.MARK):
            yield

    def sample(self) -> None:
        if self.device.type == "cuda":
            self.at_samples.append(torch.cuda.memory_allocated(self.device) - self.before)
            return
        from torch.profiler import record_function

        with record_function(self.SAMPLE):  # an empty span: its start time places the sample among the events
            pass


class SampledAlongside(StepWatch):
    """A StepWatch that also has an Allocations note the allocator's bytes at each of its samples: the counted
    bytes (what the code names) and the measured ones (all the allocator handed out) at the same moments."""

    def __init__(self, allocator: Allocations, sources: dict):
        super().__init__(sources)
        self.allocator = allocator

    def sample(self, label: str) -> None:
        self.allocator.sample()
        super().sample(label)


@contextmanager
def cuda_snapshot(directory: str | None, name: str, device: torch.device, rank: int):
    """GPU track (NOT YET RUN on a GPU): with a directory, record every CUDA allocation of the block and write
    a snapshot per rank, DIRECTORY/<name>_rank<r>.pickle, to open at https://pytorch.org/memory_viz.
    Without one, or on a CPU device, it does nothing."""
    if not (directory and device.type == "cuda"):
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        yield
    finally:
        Path(directory).mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(Path(directory) / f"{name}_rank{rank}.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)


def predicted_peak(impl: str, sizes: dict, activations: int, world_size: int) -> int:
    """The peak of one rank's memory during an AdamW step (float32; the lab 9 sheet derives it). The peak
    comes where the activations are largest - at the turn from forward to backward - so it is the state
    kept then, plus the activations A, plus what the implementation holds at that moment:
        ddp     W weights + W gradients (DDP's buckets persist) + 2W Adam               + A
        zero1   W + W + 2W/N                                                            + A
        zero2   W + 2W/N + a bucket of full gradients (the largest: an upper bound)    + A
        fsdp, fully_shard   W/N + 2W/N + the root unit's and one block's full weights  + A
        fully_shard_keep    W/N + 2W/N + every full weight (kept since forward)         + A
    sizes: {"weights": W, "root", "block", "bucket"} in bytes. Left out: padding rows, Adam's step
    counters, a unit's gradients while its activations are freed."""
    w, n = sizes["weights"], world_size
    held = {"ddp": w + w + 2 * w, "zero1": w + w + 2 * w / n, "zero2": w + 2 * w / n + sizes["bucket"],
            "fsdp": w / n + 2 * w / n + sizes["root"] + sizes["block"],
            "fully_shard": w / n + 2 * w / n + sizes["root"] + sizes["block"], "fully_shard_keep": w / n + 2 * w / n + w}  # fmt: skip
    return int(held[impl] + activations)


def track_every_thread() -> None:
    """Make the CPU allocator keep its running total over every thread. Its profiler events carry that total
    (total_allocated), but it counts an allocation or a free only on a thread that is profiling, unless the
    c10 flag caffe2_report_cpu_memory_usage is set (c10/core/CPUAllocator.cpp, ProfiledCPUMemoryReporter).
    Without it, a buffer that gloo's worker thread frees stays counted, and one it allocates is not seen.
    Set once and left on (a lock and a table entry per allocation: slower, not different), so that every
    block's frees are matched. torch has no Python setter for it: the flag is a global of libc10."""
    import ctypes

    libraries = [path for name in ("libc10.so", "libc10.dylib") if (path := Path(torch.__file__).parent / "lib" / name).exists()]
    try:
        ctypes.c_bool.in_dll(ctypes.CDLL(str(libraries[0])), "FLAGS_caffe2_report_cpu_memory_usage").value = True
    except (IndexError, OSError, ValueError) as error:  # no such library or flag: the figures would miss other threads
        raise CourseError(f"cannot make the CPU allocator count every thread ({error}); leave out the memory, meta and checkpoint parts (--parts)") from None


@contextmanager
def allocations(device: torch.device):
    """Yields an Allocations; its figures are set when the block ends (see Allocations)."""
    found = Allocations(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        found.before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield found
        torch.cuda.synchronize(device)
        found.peak = (found.cuda_peak if found.marked else torch.cuda.max_memory_allocated(device)) - found.before
        return
    from torch.profiler import ProfilerActivity, profile

    track_every_thread()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        anchor = torch.empty(1)  # its event's running total, less its size, is what was allocated before the block
        yield found
    results = prof.profiler.kineto_results
    spans = {name: sorted(e.start_ns() for e in results.events() if e.name() == name) for name in (Allocations.MARK, Allocations.SAMPLE)}
    marked = [e for e in results.events() if e.name() == Allocations.MARK]
    window = (marked[0].start_ns(), marked[0].end_ns()) if marked else (0, float("inf"))
    fields = [(event.start_time_ns, event.extra_fields) for event in allocation_events(results)]
    totals = sorted((when, field.ptr, field.total_allocated) for when, field in fields)
    before = next(total for _, ptr, total in totals if ptr == anchor.data_ptr()) - anchor.untyped_storage().nbytes()
    samples, running, peak = spans[Allocations.SAMPLE], 0, 0
    for when, _, total in totals:
        while samples and samples[0] < when:  # a sample sees the total of the last event before it
            found.at_samples.append(running)
            samples.pop(0)
        running = total - before
        if window[0] <= when <= window[1]:
            peak = max(peak, running)
    found.at_samples += [running] * len(samples)
    found.peak = peak


def allocation_events(results):
    """Every allocation and free event of a profile (torch.profiler's event tree, depth first)."""
    pending = list(results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending += event.children
        if event.tag == torch._C._profiler._EventType.Allocation:
            yield event
