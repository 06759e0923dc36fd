"""Lecture 7's sharded-data-parallel demos: what each rank holds and sends under DDP, ZeRO-1/2/3 and fully_shard.

    torchrun --standalone --nproc_per_node=4 lectures/scripts/sharding_demos.py --json report.json --checkpoint-dir ckpt

One 4-rank job (each torch process start costs seconds, so one job does everything). The 2-rank
numbers come from a subgroup of ranks 0 and 1, on which ranks 2 and 3 simply wait at the next barrier.
Any N >= 2 works (a GPU machine runs one rank per GPU): "4" below is then N.

  memory        for N = 2 and N = 4 ranks and each of DDP, ZeRO-1, ZeRO-2 (both written here, minimally,
                on one flat vector) and ZeRO-3 (torch's fully_shard), train 2 Adam steps and count the
                bytes each rank holds afterwards (ddp_course.sharding.model_state_bytes: parameters,
                gradients, optimizer state, from the tensors' storages), and the bytes its collectives
                moved during the second step (ddp_course.sharding.count_collectives).
  equal         the same model trained with DDP and with fully_shard (SGD, 3 steps, 4 ranks): the
                largest weight difference, and what bounds it.
  trace         one fully_shard step on 4 ranks under torch.profiler, with reshard_after_forward True
                and False and with forward prefetch: the FSDP phases rank 0 recorded, in order; whether each
                gloo collective ran inside the span that issued it, and the step's share of time in them.
  precision     MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32): the bytes per step.
  checkpoint    a fully_shard model saved with torch.distributed.checkpoint on 2 ranks, loaded on 4
                ranks (fully_shard again) and on 1 (a plain model): equal weights?

Rank 0 writes the facts (bytes, counts, booleans, event names; no timings except `wall_s`, the trace's
microseconds and the shares of step time) to --json.
Written for NCCL too: the device comes from LOCAL_RANK when --backend nccl (not run on a GPU yet).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401 - before init: see ddp_course/distributed.py
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn import functional as F

from ddp_course.cli import CourseArgumentParser
from ddp_course.sharding import bytes_written, count_collectives, model_state_bytes

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

WIDTH, INPUTS, OUTPUTS, BATCH = 128, 32, 16, 8  # every dimension 0 divides by 4: shards are even


def make_model(seed: int = 0) -> nn.Sequential:
    """Four linear layers, 39,312 parameters; the same weights on every rank (same seed)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(INPUTS, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
        nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, OUTPUTS),
    )  # fmt: skip


def local_batch(step: int, rank: int, device: torch.device):
    """This rank's part of step `step`'s global batch (the same data whatever the wrapper)."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    inputs = torch.randn(BATCH, INPUTS, generator=generator)
    targets = torch.randint(0, OUTPUTS, (BATCH,), generator=generator)
    return inputs.to(device), targets.to(device)


def linear_layers(model: nn.Module) -> list[nn.Module]:
    return [module for module in model if isinstance(module, nn.Linear)]


# --- ZeRO-1 and ZeRO-2, minimally -----------------------------------------------------------------


class FlatZero:
    """ZeRO-1 or ZeRO-2 by hand: full parameters on every rank; Adam updates 1/N of one flat vector.

    All parameters live in one flat float32 vector (padded to a multiple of N); each rank owns the
    slice [rank * per, (rank + 1) * per). Gradients live in a second flat vector (the parameters'
    .grad are views into it, as DDP's gradient_as_bucket_view). After backward:
      stage 1: all-reduce the whole gradient vector, keep it (every rank holds all of it);
      stage 2: reduce-scatter it: each rank receives the average of its own slice only, and the full
               vector is freed until the next backward (torch's and DeepSpeed's ZeRO-2 do this bucket
               by bucket during backward, so the full vector never exists at once; we keep it simple).
    Then Adam steps the slice (its state is 1/N) and an all-gather rebuilds the full parameters.
    """

    def __init__(self, model: nn.Module, group, stage: int, lr: float = 1e-3):
        self.params, self.group, self.stage = list(model.parameters()), group, stage
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        total = sum(p.numel() for p in self.params)
        self.per = -(-total // self.world)
        device = self.params[0].device
        self.flat_params = torch.zeros(self.per * self.world, device=device)
        self._point_into(self.flat_params, "data")
        self.shard = nn.Parameter(self.flat_params[self.rank * self.per : (self.rank + 1) * self.per])  # a view
        self.optimizer = torch.optim.Adam([self.shard], lr=lr)
        self.flat_grads = None

    def _point_into(self, flat: torch.Tensor, attribute: str) -> None:
        """Copy each parameter's data (or make its .grad) into its place in `flat`, as a view."""
        offset = 0
        for p in self.params:
            view = flat[offset : offset + p.numel()].view_as(p)
            if attribute == "data":
                view.copy_(p.data)
                p.data = view
            else:
                p.grad = view
            offset += p.numel()

    def zero_grad(self) -> None:
        """Before backward: a zeroed flat gradient vector, the parameters' .grad views into it."""
        self.flat_grads = torch.zeros_like(self.flat_params)
        self._point_into(self.flat_grads, "grad")

    def step(self) -> None:
        mine = slice(self.rank * self.per, (self.rank + 1) * self.per)
        if self.stage == 1:
            dist.all_reduce(self.flat_grads, group=self.group)
            self.flat_grads /= self.world
            self.shard.grad = self.flat_grads[mine]  # a view: no new storage
        else:
            shard_grad = torch.empty(self.per, device=self.flat_params.device)
            reduce_scatter_single(shard_grad, self.flat_grads, group=self.group)
            self.shard.grad = shard_grad / self.world
            for p in self.params:
                p.grad = None
            self.flat_grads = None  # ZeRO-2 keeps only its slice of the gradients
        self.optimizer.step()
        updated = self.shard.detach().clone()  # all-gather's input must not alias its output
        all_gather_single(self.flat_params, updated, group=self.group)


# --- the four wrappers, built the same way ------------------------------------------------------


def build(stage: str, group, device: torch.device, **fsdp_options):
    """(model, step function, parameters to count, optimizer to count) for one way of training."""
    model = make_model().to(device)
    if stage == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model, process_group=group, gradient_as_bucket_view=True)
        # The same all-reduce per bucket as DDP's C++ reducer, but through dist.all_reduce: counted.
        wrapped.register_comm_hook(group, default_hooks.allreduce_hook)
        optimizer = torch.optim.Adam(wrapped.parameters(), lr=1e-3)

        def step(inputs, targets):
            optimizer.zero_grad(set_to_none=False)
            F.cross_entropy(wrapped(inputs), targets).backward()
            optimizer.step()

        return wrapped, step, list(model.parameters()), optimizer
    if stage in ("zero1", "zero2"):
        zero = FlatZero(model, group, stage=int(stage[-1]))

        def step(inputs, targets):
            zero.zero_grad()
            F.cross_entropy(model(inputs), targets).backward()
            zero.step()

        return model, step, [*model.parameters(), zero.shard], zero.optimizer
    optimizer_name = fsdp_options.pop("optimizer", "adam")
    model = fully_shard_model(model, group, device, **fsdp_options)
    optimizer = (torch.optim.Adam(model.parameters(), lr=1e-3) if optimizer_name == "adam"
                 else torch.optim.SGD(model.parameters(), lr=0.05))  # fmt: skip

    def step(inputs, targets):
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()
        optimizer.step()

    return model, step, list(model.parameters()), optimizer  # DTensors: model_state_bytes counts their shards


def fully_shard_model(model: nn.Module, group, device: torch.device, **options) -> nn.Module:
    """fully_shard each linear layer (one all-gather per layer), then the root, on a 1-D mesh of `group`."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, device.type)
    for layer in linear_layers(model):
        fully_shard(layer, mesh=mesh, **options)
    return fully_shard(model, mesh=mesh, **options)


# --- the demos ---------------------------------------------------------------------------------


def memory_and_bytes(stage: str, group, device: torch.device, **fsdp_options) -> dict:
    """Two Adam steps; what this rank holds afterwards, and what the second step's collectives moved."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    model, step, parameters, optimizer = build(stage, group, device, **fsdp_options)
    step(*local_batch(0, rank, device))
    inputs, targets = local_batch(1, rank, device)
    with count_collectives(sys.modules[__name__]) as counter, bytes_written() as written:  # this module's aliases too
        step(inputs, targets)  # nothing else written meanwhile: what this process wrote is what it sent
    held = model_state_bytes(parameters, optimizer)
    facts = {
        "held": held,
        "calls": dict(sorted(counter.bytes_by_kind().items())),
        "wire": counter.ring_model_bytes_per_rank(world),
        "written": written["bytes"] if dist.get_backend(group) == "gloo" else None,
    }  # NCCL does not write() its bytes
    weights = torch.cat([full(p).detach().cpu().flatten() for p in model.parameters()])  # to compare with DDP's
    del model, step, parameters, optimizer
    return facts, weights


def trained_weights(stage: str, group, device, steps: int = 3) -> tuple[dict, float, float]:
    """{name: full float32 weight} after `steps` SGD steps, and the largest |local gradient| and |weight| seen (DDP)."""
    rank = dist.get_rank(group)
    model = make_model().to(device)
    if stage == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model, process_group=group)
    else:
        wrapped = fully_shard_model(model, group, device)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    largest_gradient = largest_weight = 0.0
    for step in range(steps):
        optimizer.zero_grad()
        inputs, targets = local_batch(step, rank, device)
        if stage == "ddp":  # the local gradient, before averaging: what the bound is made of
            local = torch.autograd.grad(F.cross_entropy(model(inputs), targets), list(model.parameters()))
            largest_gradient = max(largest_gradient, max(g.abs().max().item() for g in local))
            largest_weight = max(largest_weight, max(p.abs().max().item() for p in model.parameters()))
        F.cross_entropy(wrapped(inputs), targets).backward()
        optimizer.step()
    weights = {name: full(p).detach().cpu().clone() for name, p in model.named_parameters()}
    del wrapped, optimizer, model
    return weights, max(largest_gradient, 0.0), max(largest_weight, *(w.abs().max().item() for w in weights.values()))


def full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def phases_in_trace(group, device, reshard_after_forward: bool = True, forward_prefetch: bool = False) -> dict:
    """What rank 0's profiler saw in one training step: {"phases": the FSDP phases, [name, start, end] in
    microseconds from the step's first phase, in start order ("FSDP::phase (layer)", the layer as
    nn.Sequential numbers it); "gloo_collectives": how many gloo collectives ran; "inside_issuing_span": how
    many ran entirely inside the FSDP all-gather or reduce-scatter span that issued them (the main thread
    waited for them); "all_gather_share", "reduce_scatter_share": the step's time inside those spans}."""
    from torch.profiler import ProfilerActivity, profile, record_function

    model = fully_shard_model(make_model().to(device), group, device, reshard_after_forward=reshard_after_forward)
    if forward_prefetch:  # ask each layer to start the next layer's all-gather when its own forward starts
        layers = linear_layers(model)
        for layer, following in zip(layers, layers[1:]):
            layer.set_modules_to_forward_prefetch([following])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    rank = dist.get_rank(group)

    def step(model, optimizer, i):
        optimizer.zero_grad()
        F.cross_entropy(model(local_batch(i, rank, device)[0]), local_batch(i, rank, device)[1]).backward()
        optimizer.step()

    step(model, optimizer, 0)  # warm-up: fully_shard initialises lazily in the first step
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("training step"):
            step(model, optimizer, 1)
    recorded = [(e.start_ns(), e.end_ns(), e.name()) for e in prof.profiler.kineto_results.events()]
    del model, optimizer
    events = sorted(event for event in recorded if event[2].startswith("FSDP::"))
    first = events[0][0]
    # gloo runs a collective on its own worker thread ("gloo:all_gather", "gloo:all_reduce": gloo's
    # reduce-scatter); each one starts inside the FSDP span whose call issued it.
    spans = {
        kind: [(s, e) for s, e, name in events if name.startswith(prefix)]
        for kind, prefix in (("all_gather", "FSDP::all_gather ("), ("reduce_scatter", "FSDP::post_backward_reduce"))
    }
    gloo = [(s, e) for s, e, name in recorded if name.startswith("gloo:")]
    inside = sum(any(s <= gs and ge <= e for s, e in spans["all_gather"] + spans["reduce_scatter"]) for gs, ge in gloo)
    step_start, step_end = next((s, e) for s, e, name in recorded if name == "training step")
    share = {kind: sum(e - s for s, e in found) / (step_end - step_start) for kind, found in spans.items()}
    return {"phases": [[name, (start - first) / 1e3, (end - first) / 1e3] for start, end, name in events],
            "gloo_collectives": len(gloo), "inside_issuing_span": inside,
            "all_gather_share": share["all_gather"], "reduce_scatter_share": share["reduce_scatter"]}  # fmt: skip


def checkpoint_demo(world, pair, rank: int, device, directory: Path) -> dict:
    """Save a fully_shard model (after 2 steps) on ranks 0-1; load it on all 4 ranks and on rank 0 alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    facts = {}
    saved = None
    if rank < 2:
        model, step, _, _ = build("fsdp", pair, device)
        for i in range(2):
            step(*local_batch(i, rank, device))
        state = get_model_state_dict(model)  # {name: DTensor}: each rank's shard, and where it belongs
        facts["saved_local_shapes"] = {name: list(t.to_local().shape) for name, t in state.items()}
        dcp.save(state, checkpoint_id=directory, process_group=pair)
        saved = {name: full(t).cpu() for name, t in state.items()}
        del model, step, state
    dist.barrier(world)  # the files exist before anyone reads them
    four = fully_shard_model(make_model(seed=1).to(device), world, device)  # different weights until loaded
    state = get_model_state_dict(four)
    dcp.load(state, checkpoint_id=directory, process_group=world)  # in place, into this rank's shards
    set_model_state_dict(four, state)
    on_four = {name: full(t).cpu() for name, t in get_model_state_dict(four).items()}
    facts["four_local_shapes"] = {name: list(t.to_local().shape) for name, t in state.items()}
    del four, state
    if rank == 0:
        plain = make_model(seed=2)
        plain_state = plain.state_dict()
        dcp.load(plain_state, checkpoint_id=directory, no_dist=True)
        plain.load_state_dict(plain_state)
        facts["files"] = sorted(path.name for path in directory.iterdir())
        facts["equal_on_4"] = all(torch.equal(saved[name], on_four[name]) for name in saved)
        facts["equal_on_1"] = all(torch.equal(saved[name], plain_state[name]) for name in saved)
    return facts


def run(args) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.backend == "nccl" else torch.device("cpu")
    world = dist.group.WORLD
    pair = dist.new_group([0, 1])  # every rank creates every group, in the same order
    report = {"world_size": world_size, "parameters": sum(p.numel() for p in make_model().parameters())}

    # memory and bytes: N = 2 (ranks 0-1) and N = 4
    report["memory"] = {}
    for n, group in ((2, pair), (world_size, world)):
        for stage in ("ddp", "zero1", "zero2", "fsdp"):
            facts = None
            if rank < n:
                facts, weights = memory_and_bytes(stage, group, device)
                if stage == "ddp":
                    ddp_weights = weights
                # Adam's first steps are about lr * sign(gradient): a stage that forgot an all-gather or
                # averaged the wrong shard is off by ~lr; float32 reduction order moves a weight far less
                facts["max_difference_from_ddp"] = (weights - ddp_weights).abs().max().item()
            gathered = [None] * world_size
            dist.all_gather_object(gathered, facts, group=world)
            report["memory"][f"{stage}/{n}"] = gathered[:n]
    # mixed precision and reshard_after_forward=False, on 4 ranks: bytes only
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for label, options in ((f"fsdp_bf16/{world_size}", {"mp_policy": bf16}), (f"fsdp_keep/{world_size}", {"reshard_after_forward": False})):
        facts, _ = memory_and_bytes("fsdp", world, device, **options)
        gathered = [None] * world_size
        dist.all_gather_object(gathered, facts, group=world)
        report["memory"][label] = gathered

    # DDP and fully_shard end equal?
    ddp_weights, largest_gradient, largest_weight = trained_weights("ddp", world, device)
    fsdp_weights, _, _ = trained_weights("fsdp", world, device)
    gradients = [None] * world_size
    dist.all_gather_object(gradients, largest_gradient, group=world)
    report["equal"] = {
        "max_abs_difference": max((ddp_weights[k] - fsdp_weights[k]).abs().max().item() for k in ddp_weights),
        "largest_local_gradient": max(gradients),
        "largest_weight": largest_weight,
        "bitwise_equal": all(torch.equal(ddp_weights[k], fsdp_weights[k]) for k in ddp_weights),
        "steps": 3, "lr": 0.05,
    }  # fmt: skip

    traced = {
        "reshard": phases_in_trace(world, device),
        "keep": phases_in_trace(world, device, reshard_after_forward=False),
        "forward_prefetch": phases_in_trace(world, device, forward_prefetch=True),
    }
    report["trace"] = {setting: facts.pop("phases") for setting, facts in traced.items()}
    report["trace_blocking"] = traced["reshard"]  # the default setting's collectives: waited for, or not?
    report["checkpoint"] = checkpoint_demo(world, pair, rank, device, Path(args.checkpoint_dir))
    return report


def main() -> None:
    parser = CourseArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where rank 0 writes the facts")
    parser.add_argument("--checkpoint-dir", required=True, help="an empty folder for the DCP checkpoint")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="bound on every collective")
    args = parser.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:  # every rank sees the same; rank 0 says it, before any group exists
        if os.environ.get("RANK", "0") == "0":
            print(
                "sharding_demos.py: error: run it under torchrun on 2 or more ranks (the lecture uses --nproc_per_node=4); the 2-rank numbers use ranks 0-1",
                file=sys.stderr,
                flush=True,
            )
        return 2
    started = time.perf_counter()
    if args.backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.timeout_s))
    try:
        report = run(args)
        report["wall_s"] = round(time.perf_counter() - started, 1)
        if dist.get_rank() == 0:
            Path(args.json).write_text(json.dumps(report, indent=1))
            print(f"sharding_demos: done in {report['wall_s']} s", flush=True)
    finally:
        gc.collect()  # wrappers out of reach before the group goes (CONTRIBUTING.md, "gloo teardown")
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
