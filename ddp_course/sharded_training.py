"""The implementations labs 8 and 9 compare, built, stepped, checked and weighed alike.

Lab 8 runs lab 6's character transformer (ddp_course.char_lm_job) under six implementations - DDP, ZeRO-1,
ZeRO-2, an FSDP written from scratch, fully_shard and fully_shard with reshard_after_forward=False - and
checks each against one process; lab 9 weighs the same six over a whole AdamW step. Both need the same
harness: wrap a fresh model, give it its optimizer, step it, name what it keeps and what it has gathered.
That harness lives here, so that lab 9 uses lab 8's without loading lab 8's script; lab 8's verdicts on
the learner's FSDP are ddp_course/checking/lab8.py, and lab 9's script keeps its six short demos.

The from-scratch code a learner reads or writes is not here: solutions/minddp.py (lab 6's ShardedOptimizer),
labs/minizero2.py (ZeRO-2) and labs/ or solutions/minifsdp.py (the FSDP). The package never imports a
script, so each lab loads those itself and passes them in as `modules`: {"minddp", "minizero2",
"minifsdp"} -> module, only the ones its implementations need.

    IMPLS, job_args(seed)               the implementations; a configuration at lab 8's defaults
    Trained(impl, args, ctx, modules, make_optimizer)   one implementation around a fresh model
    make_optimizer(impl, modules, cls)  the optimizer each implementation steps with
    check(args, ctx, tokens, modules)   SGD steps on shards against one process, a verdict each
    kept(trained), gathered_now(trained) the parameters kept between steps; the full weights gathered now
    memory_timeline(impl, ctx, ...)     one AdamW step weighed at every phase, counted and measured (lab 9)
    model_sizes(model, minizero2), judge_peaks(...)    the peak formula's terms; a peak against it (lab 9)
"""

from __future__ import annotations

import argparse
import functools
import gc

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.char_lm_job import CHECK_LR, EPS_PER_STEP, deadline, global_batch, job_max, my_rows, new_model
from ddp_course.distributed import log
from ddp_course.sharding import (
    SampledAlongside,
    SavedActivations,
    StepWatch,
    allocations,
    count_collectives,
    cuda_snapshot,
    optimizer_state_tensors,
    predicted_peak,
    storage_bytes,
)

IMPLS = ("ddp", "zero1", "zero2", "fsdp", "fully_shard", "fully_shard_keep")
FULLY_SHARD = ("fully_shard", "fully_shard_keep")
ADAMW_LR = 1e-3
# ZeRO-2's buckets: about one transformer block each (0.75 MiB), so that during backward at most two buckets
# hold full gradients - the one in flight and the one being filled, when gradients arrive in bucket order
# (labs/minizero2.py) - where DDP's 25 MiB would make this 3 MiB model one bucket: all of them at once.
ZERO2_BUCKET_MB = 1.0
BYTES_TOLERANCE = 0.05  # counted bytes per step vs the formula: padding and the replicated vectors stay far below
# Lab 8's defaults (its flags --batch-size, --check-steps, --case-timeout-s), which lab 9 uses as they are
BATCH_SIZE, CHECK_STEPS, CASE_TIMEOUT_S = 4, 3, 90.0
MIB = 2**20


def job_args(seed: int = 0, **changes) -> argparse.Namespace:
    """What Trained, check and memory_timeline read from a configuration, at lab 8's defaults: windows per
    rank, SGD steps of the check, our FSDP's units (a block each), a check's time limit, every implementation."""
    defaults = {"seed": seed, "batch_size": BATCH_SIZE, "check_steps": CHECK_STEPS, "fsdp_units": "blocks",
                "case_timeout_s": CASE_TIMEOUT_S, "impls": list(IMPLS)}  # fmt: skip
    return argparse.Namespace(**{**defaults, **changes})


class Trained:
    """One implementation around a fresh model: what steps, what the optimizer sees, the full weights."""

    def __init__(self, impl: str, args, ctx, modules: dict, make_optimizer):
        self.impl, self.model = impl, new_model(args, ctx)  # the same weights on every rank
        self.wrapped = wrap(impl, self.model, args, ctx, modules)
        self.optimizer = make_optimizer(self.wrapped)

    def step(self, inputs, targets) -> None:
        """One training step. Gradients are cleared at the start, so after it they can be weighed."""
        self.optimizer.zero_grad()
        F.cross_entropy(self.wrapped(inputs).flatten(0, 1), targets.flatten()).backward()
        if hasattr(self.wrapped, "finish_gradient_synchronization"):  # minifsdp's contract
            self.wrapped.finish_gradient_synchronization()
        self.optimizer.step()

    def full_weights(self) -> torch.Tensor:
        """Every parameter, whole, flattened in the bare model's named_parameters() order (a collective)."""
        if self.impl == "fsdp":
            named = self.wrapped.gather_full_params()
        else:  # fully_shard's parameters are DTensors: full_tensor() all-gathers the shards
            named = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in self.model.named_parameters()}
        return torch.cat([named[name].detach().flatten() for name, _ in self.model.named_parameters()])


def wrap(impl: str, model, args, ctx, modules: dict):
    if impl in ("ddp", "zero1"):
        device_ids = [ctx.local_rank] if ctx.device.type == "cuda" else None
        # gradient_as_bucket_view: the gradients live in DDP's buckets, so weighing them counts DDP's real
        # memory (otherwise DDP keeps a second, hidden copy). The comm hook does what DDP's C++ reducer does
        # (average each bucket with one all-reduce) through dist.all_reduce, where count_collectives sees it.
        ddp = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True)
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        return ddp
    if impl == "fsdp":
        # blocks: one unit per transformer block and the rest in the root's, the grouping fully_shard gets
        # below; matrices: every module that owns a matrix is its own unit (one message per weight matrix).
        units = list(model.blocks) if args.fsdp_units == "blocks" else None
        return modules["minifsdp"].FSDP(model, units=units)
    if impl == "zero2":
        return modules["minizero2"].ZeRO2(model, bucket_cap_mb=ZERO2_BUCKET_MB)  # labs/minizero2.py: no DDP wrapper
    if impl in FULLY_SHARD:
        from torch.distributed.device_mesh import init_device_mesh  # imports torch._dynamo: seconds, so only here
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))  # cpu + gloo, or cuda + NCCL
        # fully_shard: reshard_after_forward=True everywhere, the root too (its default keeps the root's
        # weights gathered until backward): every weight is gathered twice per step, as ZeRO-3 and our FSDP
        # do. fully_shard_keep: False everywhere (SHARD_GRAD_OP): gathered once, kept until backward.
        reshard = impl == "fully_shard"
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        return fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model  # the controls: "single process", "no sync"


def make_optimizer(impl: str, modules: dict, optimizer_cls, **kwargs):
    """A function of the wrapped model: optimizer_cls over its parameters; ZeRO-1 wraps it in lab 6's
    ShardedOptimizer; ZeRO-2 steps only this rank's slices, then all-gathers (minizero2.ShardedStep)."""
    if impl == "zero1":
        return lambda wrapped: modules["minddp"].ShardedOptimizer(wrapped.parameters(), optimizer_cls, **kwargs)
    if impl == "zero2":
        return lambda wrapped: modules["minizero2"].ShardedStep(wrapped, optimizer_cls, **kwargs)
    return lambda wrapped: optimizer_cls(wrapped.parameters(), **kwargs)


def check(args, ctx, tokens, modules) -> dict:
    """Per implementation, max |w - w_single| over the job after --check-steps SGD steps, and the verdict."""
    sgd = functools.partial(make_optimizer, optimizer_cls=torch.optim.SGD, lr=CHECK_LR)
    single = weights_after(args, ctx, tokens, Trained("single process", args, ctx, modules, sgd("single process", modules)))
    tolerance = EPS_PER_STEP * args.check_steps * torch.finfo(torch.float32).eps * float(single.abs().max())
    log(
        f"check: {args.check_steps} SGD steps, {ctx.world_size} shards of {args.batch_size} windows vs one process on all "
        f"{args.batch_size * ctx.world_size}; tolerance {tolerance:.2g} ({EPS_PER_STEP} x steps x float32 eps x max|w|)"
    )
    results = {}
    for impl in ["no sync"] + args.impls:
        with deadline(args.case_timeout_s, f"{impl:<16} the check"):
            trained = Trained(impl, args, ctx, modules, sgd(impl, modules))
            difference = job_max(float((weights_after(args, ctx, tokens, trained) - single).abs().max()), ctx)
        close = difference <= tolerance
        verdict = ("CONTROL DID NOT DIFFER" if close else "differs (control)") if impl == "no sync" else ("PASS" if close else "FAIL")
        results[impl] = {"max_abs_diff_vs_single_process": difference, "tolerance": tolerance, "verdict": verdict}
        log(f"  {impl:<16} max|w - one process| {difference:.1e}   {verdict}")
    return results


def weights_after(args, ctx, tokens, trained: Trained) -> torch.Tensor:
    generator = torch.Generator().manual_seed(args.seed)  # the same batches for every implementation
    for _ in range(args.check_steps):
        inputs, targets = global_batch(tokens, generator, args, ctx)
        if trained.impl != "single process":
            inputs, targets = my_rows(inputs, ctx), my_rows(targets, ctx)
        trained.step(inputs, targets)
    return trained.full_weights()


def gathered_now(trained: Trained) -> list[torch.Tensor]:
    """The full weights gathered right now: minifsdp's full tensors (0 bytes of storage while freed);
    fully_shard's unsharded parameters, which it registers on the modules in place of the DTensors.
    DDP and ZeRO-1 keep every weight whole: nothing is gathered."""
    if trained.impl == "fsdp":
        return [handle.full for handle in trained.wrapped.sharded.values()]
    if trained.impl in FULLY_SHARD:
        return [p for m in trained.model.modules() for p in m._parameters.values() if p is not None and not hasattr(p, "to_local")]
    return []


def kept(trained: Trained) -> list[torch.Tensor]:
    """The parameters a rank keeps between steps: the model's and the optimizer's (fully_shard's DTensor
    shards stay in the optimizer while the modules show the unsharded weights; ZeRO-2's slices are views
    of its full weights). Storages are counted once, so listing a tensor twice costs nothing."""
    return [*trained.wrapped.parameters(), *(p for group in trained.optimizer.param_groups for p in group["params"])]


# --- lab 9: one rank's memory over a whole AdamW step, counted and measured, against the peak formula ------

CATEGORIES = ("parameters", "gathered", "gradients", "optimizer_state", "activations")
# The peak formula against the COUNTED peak (the storages of the tensors the code names): within 5 %. That
# checks the accounting - that the formula adds up what the code keeps - not memory. It leaves out padding
# rows and Adam's step counters (under 0.1 % here) and puts the peak at the turn from forward to backward;
# the counted peak can come one module later, after the head's activations are freed (3 % of them here).
COUNTED_TOLERANCE = 0.05
# The formula against the MEASURED peak (the allocator's own figure), in units of W, the weights' bytes:
# measured - predicted within [-1/4 W, +3/4 W]. Above the formula the allocator also holds what no count
# names: autograd's temporaries in backward (the head's gradients: about 0.2 W here), and our FSDP's
# gather buffer beside the unit's full weights (about 0.6 W in all here). One more full-size buffer kept
# alive - a second copy of the gradients, a leaked W - puts an implementation above +3/4 W: a FAIL.
MEASURED_TOLERANCE = (-0.25, 0.75)


def gradients_now(trained: Trained, own) -> list[torch.Tensor]:
    """Every gradient that exists right now: the kept parameters' and the gathered weights' (.grad of
    minifsdp's full tensors, of fully_shard's unsharded parameters), and ZeRO-2's bucket buffers."""
    found = [p.grad for p in own] + [t.grad for t in gathered_now(trained)]
    return found + (trained.wrapped.gradient_buffers() if trained.impl == "zero2" else [])


def memory_timeline(impl: str, ctx, modules: dict, tokens, seed: int = 0, snapshot_dir: str | None = None) -> dict:
    """One AdamW step of impl after a warm-up step, weighed two ways, the fullest rank's bytes:
    counted   at every phase, the storages of the tensors the code names, by category (StepWatch);
    measured  the allocator's own peak during that step, counting all this implementation allocated since
              before it was built (Allocations) - what the counts cannot name (DDP's bucket copies,
              fully_shard's flat buffers, autograd's temporaries, a leaked copy) included.
    snapshot_dir (GPU): a CUDA memory snapshot of the step per rank (cuda_snapshot)."""
    gc.collect()  # the previous implementation's garbage goes now, not during this one's measurement
    with allocations(ctx.device) as allocator:
        args = job_args(seed)
        make = make_optimizer(impl, modules, torch.optim.AdamW, lr=ADAMW_LR)
        trained = Trained(impl, args, ctx, modules, make)
        batch = global_batch(tokens, torch.Generator().manual_seed(seed), args, ctx)
        inputs, targets = (my_rows(t, ctx) for t in batch)
        trained.step(inputs, targets)  # warm-up: Adam's state exists, DDP's buckets are built, fully_shard initialised
        own, saved = kept(trained), SavedActivations()
        watch = SampledAlongside(allocator, {"parameters": lambda: own, "gathered": lambda: gathered_now(trained),
                           "gradients": lambda: gradients_now(trained, own),
                           "optimizer_state": lambda: optimizer_state_tensors(trained.optimizer), "activations": saved.alive})  # fmt: skip
        with cuda_snapshot(snapshot_dir, impl, ctx.device, ctx.rank), allocator.measured(), count_collectives(*modules.values()) as counter:
            counted_step(impl, trained, watch, saved, inputs, targets)
    counted = torch.tensor([[sample[c] for c in CATEGORIES] for _, sample in watch.samples], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(counted, op=dist.ReduceOp.MAX)  # the same phases on every rank (the same graph): the fullest
    measured = torch.tensor(allocator.at_samples, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    return {
        "labels": [label for label, _ in watch.samples],
        "bytes": counted.long().tolist(),
        "measured_bytes": measured.long().tolist(),
        "measured_peak_bytes": int(job_max(allocator.peak, ctx)),
        "ring_model_bytes_per_step": counter.ring_model_bytes_per_rank(ctx.world_size),
        "messages_per_step": len(counter.calls),
    }


def counted_step(impl: str, trained: Trained, watch: StepWatch, saved: SavedActivations, inputs, targets) -> None:
    """The weighed step, with a sample of the counted bytes at every phase."""
    watch.sample("start")
    # DDP's gradients live in its reducer's buckets whatever zero_grad does (gradient_as_bucket_view):
    # set_to_none=False keeps the .grad views that show them.
    trained.optimizer.zero_grad(**({"set_to_none": False} if impl in ("ddp", "zero1") else {}))
    watch.sample("zero_grad")
    with watch.during(trained.model, trained.wrapped), saved:
        F.cross_entropy(trained.wrapped(inputs).flatten(0, 1), targets.flatten()).backward()
    watch.sample("after backward")
    if hasattr(trained.wrapped, "finish_gradient_synchronization"):
        trained.wrapped.finish_gradient_synchronization()
    watch.sample("after gradient sync")
    trained.optimizer.step()
    watch.sample("after optimizer step")


def model_sizes(model, minizero2) -> dict:
    """The bytes the peak formula is made of (float32): W, the weights; the root unit's and the largest
    block's full weights (what an FSDP gathers at once); the largest ZeRO-2 bucket (minizero2's split)."""
    weights = storage_bytes(model.parameters())
    in_blocks = {id(p) for p in model.blocks.parameters()}
    root = storage_bytes(p for p in model.parameters() if id(p) not in in_blocks)
    block = max(storage_bytes(b.parameters()) for b in model.blocks)
    buckets = minizero2.split(list(model.parameters())[::-1], ZERO2_BUCKET_MB * 2**20)
    return {"weights": weights, "root": root, "block": block, "bucket": max(storage_bytes(b) for b in buckets)}


def judge_peaks(impl: str, timeline: dict, labels: list[str], sizes: dict, world_size: int) -> dict:
    """The counted and the measured peak of one implementation against the formula, each with its tolerance."""
    totals = [sum(sample) for sample in timeline["bytes"]]
    counted = max(totals)
    # A: this implementation's own activations when forward ends (the same graph gives every one the same)
    activations = dict(zip(labels, timeline["bytes"]))["after forward"][CATEGORIES.index("activations")]
    predicted = predicted_peak(impl, sizes, activations, world_size)
    measured = timeline["measured_peak_bytes"]
    counted_ok = abs(counted / predicted - 1) <= COUNTED_TOLERANCE
    low, high = MEASURED_TOLERANCE
    measured_ok = low <= (measured - predicted) / sizes["weights"] <= high
    log(
        f"memory {impl:<16} predicted {predicted / MIB:6.2f} MiB; counted {counted / MIB:6.2f} MiB ({counted / predicted:.3f}x) "
        f"at {labels[totals.index(counted)]:<22} measured by the allocator {measured / MIB:6.2f} MiB "
        f"({(measured - predicted) / sizes['weights']:+.2f} W)   {'PASS' if counted_ok and measured_ok else 'FAIL'}"
    )
    return {
        **timeline,
        "activations_after_forward": activations,
        "predicted_peak_bytes": predicted,
        "counted_peak_bytes": counted,
        "counted_peak_at": labels[totals.index(counted)],
        "counted_vs_predicted": counted / predicted,
        "measured_minus_predicted_in_w": (measured - predicted) / sizes["weights"],
        "counted_passed": counted_ok,
        "measured_passed": measured_ok,
        "passed": counted_ok and measured_ok,
    }
