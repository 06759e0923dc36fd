"""Lecture 4's demonstrations of what DistributedDataParallel does, run for real on gloo.

    torchrun --standalone --nproc_per_node=2 lectures/scripts/ddp_internals_demos.py --json report.json --trace-dir traces

Every demo runs in the one process group this script creates (a torchrun start costs seconds, so the
lecture launches it once), returns plain facts per rank, and rank 0 writes them all to --json:
{demo: [facts of rank 0, facts of rank 1, ...]}. The lecture reads that report; the tests check the
same facts. --trace-dir gets a torch.profiler trace per rank of a DDP step with its default
all-reduce and one with a blocking communication hook (open them in https://ui.perfetto.dev).

CPU only, by design: every demo builds CPU models and CPU tensors, so the job always starts on gloo,
on a GPU machine too (an NCCL group would refuse the first CPU collective). init_process_group_inline()
keeps the NCCL branch a GPU script takes (one answer to the lecture's exercise 3, whose rules section 1.2
states); main() calls it with backend="gloo" (DEMO_BACKEND).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course import profiling
from ddp_course.distributed import teardown_distributed
from ddp_course.lecture04_models import OutOfOrderNet, batch, bucket_names, grads_with_hook, logging_hooks, train_steps

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RESTART_COUNT")  # fmt: skip
MiB = 2**20
UNUSED_TIMEOUT_S = 2  # how long rank 0 waits for rank 1's missing all-reduce in the last demo
DEMO_BACKEND = "gloo"  # the demos' tensors are on the CPU, so never NCCL, even where a GPU is visible


def init_process_group_inline(timeout_s: float, backend: str) -> torch.device:
    """What ddp_course.setup_distributed() does for a torchrun job, written out.

    A GPU script passes backend="nccl" if torch.cuda.is_available() else "gloo"; this script's demos
    pass "gloo" always, since their tensors live on the CPU.
    """
    local_rank = int(os.environ["LOCAL_RANK"])  # this process's index on its node
    if backend == "nccl":
        device = torch.device("cuda", local_rank)  # LOCAL_RANK, never RANK: RANK is 8..15 on node 1 of 2x8
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", init_method="env://", timeout=timedelta(seconds=timeout_s), device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group(backend="gloo", init_method="env://", timeout=timedelta(seconds=timeout_s))
    # env:// reads MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE, which torchrun set.
    return device


# ---- models ------------------------------------------------------------------------------------


class WithUnused(nn.Module):
    """A model with a layer that forward skips: on every rank, or only where use_extra is True."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)

    def forward(self, x, use_extra=False):
        x = self.body(x)
        return self.extra(x) if use_extra else x


class Growing(nn.Module):
    """A model that can get an extra layer later (which is what must not happen after wrapping)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.adapter = None

    def forward(self, x):
        x = self.body(x)
        return self.adapter(x) if self.adapter is not None else x


def same_on_every_rank(tensor: torch.Tensor) -> bool:
    """True when every rank holds exactly this tensor (compared with rank 0's copy)."""
    reference = tensor.detach().clone()
    dist.broadcast(reference, src=0)
    equal = torch.tensor([float(torch.equal(reference, tensor.detach()))])
    dist.all_reduce(equal, op=dist.ReduceOp.MIN)
    return bool(equal.item())


# ---- 1. launch and process groups --------------------------------------------------------------


def demo_environment(rank: int, world_size: int) -> dict:
    facts = {name: os.environ.get(name) for name in TORCHRUN_VARIABLES}
    facts["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    facts["get_rank"], facts["get_world_size"], facts["backend"] = dist.get_rank(), dist.get_world_size(), dist.get_backend()
    return facts


def demo_subgroups(rank: int, world_size: int) -> dict:
    # Every rank creates every group, in the same order, members or not.
    solo = [dist.new_group([r]) for r in range(world_size)]
    everyone = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=20))
    mine = solo[rank]
    value = torch.tensor([float(rank + 1)])
    in_my_group = value.clone()
    dist.all_reduce(in_my_group, group=mine)  # a group of one: the value stays
    in_world = value.clone()
    dist.all_reduce(in_world, group=everyone)  # 1 + 2
    return {"rank_in_each_solo_group": [dist.get_rank(g) for g in solo], "rank_in_everyone": dist.get_rank(everyone),
            "sum_in_my_group": in_my_group.item(), "sum_in_everyone": in_world.item()}  # fmt: skip


# ---- 2. what the wrapper does ------------------------------------------------------------------


def demo_broadcast_at_construction(rank: int, world_size: int) -> dict:
    torch.manual_seed(rank)  # deliberately different weights on every rank
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].running_mean.fill_(float(rank))  # and different buffers
    before = {"weight": same_on_every_rank(model[0].weight), "running_mean": same_on_every_rank(model[1].running_mean)}
    rank0_weight = model[0].weight.detach().clone()
    dist.broadcast(rank0_weight, src=0)
    ddp = DDP(model)
    after = {"weight": same_on_every_rank(ddp.module[0].weight), "running_mean": same_on_every_rank(ddp.module[1].running_mean)}
    return {"equal_before": before, "equal_after": after,
            "equals_rank0_original": torch.equal(ddp.module[0].weight.detach(), rank0_weight),
            "running_mean_after": ddp.module[1].running_mean.tolist(), "reducer": type(ddp.reducer).__name__}  # fmt: skip


def demo_buckets(rank: int, world_size: int) -> dict:
    """Bucket assignment before the first iteration and after it, for several bucket_cap_mb."""
    facts = {"parameter_bytes": {n: p.numel() * p.element_size() for n, p in OutOfOrderNet().named_parameters()}}
    for label, kwargs in [("None", {}), ("0.5", {"bucket_cap_mb": 0.5}), ("1", {"bucket_cap_mb": 1}),
                          ("25", {"bucket_cap_mb": 25}), ("None, find_unused_parameters", {"find_unused_parameters": True})]:  # fmt: skip
        torch.manual_seed(0)
        ddp = DDP(OutOfOrderNet(), **kwargs)
        before = bucket_names(ddp)
        train_steps(ddp, 1, rank)
        after_1 = bucket_names(ddp)
        train_steps(ddp, 1, rank)  # the rebuild happens at the start of the second forward
        facts[label] = {"before": before, "after_step_1": after_1, "after_step_2": bucket_names(ddp),
                        "rebuilt": ddp._has_rebuilt_buckets}  # fmt: skip
    return facts


def demo_launch_order(rank: int, world_size: int) -> dict:
    """E1: buckets are all-reduced in bucket order; a bucket that is ready early waits for earlier ones."""
    facts = {}
    for label, kwargs in [("find_unused_parameters", {"find_unused_parameters": True}), ("default", {})]:
        torch.manual_seed(0)
        ddp = DDP(OutOfOrderNet(), bucket_cap_mb=0.005, **kwargs)  # 5 KiB: small buckets, head.weight alone
        log = []
        logging_hooks(ddp, log)
        train_steps(ddp, 2, rank)
        log.clear()
        train_steps(ddp, 1, rank)  # the third iteration: after any rebuild
        facts[label] = {"buckets": bucket_names(ddp), "log": log}
    return facts


def demo_gradient_as_bucket_view(rank: int, world_size: int) -> dict:
    facts = {}
    for as_view in (False, True):
        torch.manual_seed(0)
        ddp = DDP(OutOfOrderNet(), gradient_as_bucket_view=as_view)
        buffers = []

        def remember_buffer(state, bucket):
            buffers.append(bucket.buffer().untyped_storage().data_ptr())
            return default_hooks.allreduce_hook(state, bucket)

        ddp.register_comm_hook(None, remember_buffer)
        train_steps(ddp, 3, rank)
        grads_in_buckets = [p.grad.untyped_storage().data_ptr() in buffers for p in ddp.module.parameters()]
        facts[str(as_view)] = {"grads_inside_buckets": sum(grads_in_buckets), "parameters": len(grads_in_buckets)}
    facts["gradient_mib"] = sum(p.numel() * p.element_size() for p in OutOfOrderNet().parameters()) / MiB
    return facts


def first_sentence(error: Exception) -> str:
    return str(error).split(". ")[0].strip() + "."


def demo_unused_everywhere(rank: int, world_size: int) -> dict:
    facts = {}
    for find_unused in (False, True):
        torch.manual_seed(0)
        ddp = DDP(WithUnused(), find_unused_parameters=find_unused)
        completed = 0
        try:
            for step in range(3):
                ddp(batch(rank, (4, 8), step)).square().mean().backward()
                completed += 1
            facts[str(find_unused)] = {"steps_completed": completed, "error": None,
                                       "extra_grad_is_none": ddp.module.extra.weight.grad is None}  # fmt: skip
        except RuntimeError as error:
            facts[str(find_unused)] = {"steps_completed": completed, "error": str(error)}
    return facts


def demo_unused_on_some_ranks(rank: int, world_size: int) -> dict:
    """extra is used on rank 0 only; with find_unused_parameters=True DDP still averages its gradient."""
    torch.manual_seed(0)
    ddp = DDP(WithUnused(), find_unused_parameters=True)
    use_extra = rank == 0
    local = torch.autograd.grad(ddp.module(batch(rank, (4, 8)), use_extra).square().mean(),
                                ddp.module.extra.weight, allow_unused=True)[0]  # fmt: skip
    local = torch.zeros_like(ddp.module.extra.weight) if local is None else local
    ddp(batch(rank, (4, 8)), use_extra).square().mean().backward()
    expected = local.clone()
    dist.all_reduce(expected)
    expected /= world_size
    return {"used_here": use_extra, "grad_equal_on_every_rank": same_on_every_rank(ddp.module.extra.weight.grad),
            "grad_is_average_of_local": torch.allclose(ddp.module.extra.weight.grad, expected, rtol=1e-5, atol=1e-7),
            "grad_nonzero": bool(ddp.module.extra.weight.grad.abs().sum() > 0)}  # fmt: skip


def demo_static_graph(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    ddp = DDP(WithUnused(), static_graph=True)  # extra is unused in every iteration: a static graph
    train_steps(ddp, 3, rank, size=(4, 8))
    return {"steps_completed": 3, "body_grad_equal": same_on_every_rank(ddp.module.body.weight.grad),
            "extra_grad_is_none": ddp.module.extra.weight.grad is None}  # fmt: skip


def demo_batchnorm(rank: int, world_size: int) -> dict:
    """BatchNorm's running statistics: each rank updates its own; DDP copies rank 0's at every forward."""
    facts = {}
    for sync_buffers in (True, False):
        torch.manual_seed(0)
        ddp = DDP(nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4)), forward_sync_buffers=sync_buffers)
        bn = ddp.module[1]
        ddp(batch(rank, (16, 8), step=0)).square().mean().backward()
        rank0_after_step_1 = bn.running_mean.clone()
        dist.broadcast(rank0_after_step_1, src=0)
        equal_after_step_1 = same_on_every_rank(bn.running_mean)
        seen_by_bn = []
        bn.register_forward_pre_hook(lambda module, args: seen_by_bn.append(module.running_mean.clone()))
        ddp(batch(rank, (16, 8), step=1)).square().mean().backward()
        facts[f"forward_sync_buffers={sync_buffers}"] = {
            "equal_after_step_1": equal_after_step_1,
            "step_2_forward_saw_rank0_values": bool(torch.equal(seen_by_bn[0], rank0_after_step_1)),
            "equal_after_step_2": same_on_every_rank(bn.running_mean),
        }  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        DDP(nn.Linear(2, 2), broadcast_buffers=False)
    facts["broadcast_buffers_warns"] = [f"{w.category.__name__}: {str(w.message)[:44]}" for w in caught]
    return facts


def demo_sync_batchnorm(rank: int, world_size: int) -> dict:
    model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4)))
    try:
        DDP(model)(batch(rank, (16, 8)))
        error = None
    except ValueError as caught:
        error = str(caught)
    # What SyncBatchNorm computes: statistics over the GLOBAL batch, from all-reduced sums.
    x = batch(rank, (16, 4))
    sums = torch.stack([x.sum(0), (x * x).sum(0), torch.full((4,), float(len(x)))])
    dist.all_reduce(sums)
    mean = sums[0] / sums[2]
    var = sums[1] / sums[2] - mean**2
    mine = (x - mean) / torch.sqrt(var + 1e-5)
    everyone = torch.cat([batch(r, (16, 4)) for r in range(world_size)])
    reference = F.batch_norm(everyone, None, None, training=True)[rank * 16 : (rank + 1) * 16]  # one process
    return {"sync_batchnorm_on_cpu_error": error, "global_stats_match_one_process": torch.allclose(mine, reference, atol=1e-5)}


def demo_change_after_wrapping(rank: int, world_size: int) -> dict:
    facts = {}
    # Replacing a layer: DDP's reducer still holds the old head's parameters, which now get no gradient.
    torch.manual_seed(0)
    ddp = DDP(OutOfOrderNet())
    ddp.module.head = nn.Linear(256, 10)
    try:
        train_steps(ddp, 2, rank)
        facts["replaced"] = None
    except RuntimeError as error:
        facts["replaced"] = first_sentence(error)
    # Adding a layer: trains without an error, but nobody averages its gradient: the replicas drift apart.
    torch.manual_seed(0)
    model = Growing()
    ddp = DDP(model)
    torch.manual_seed(1)
    model.adapter = nn.Linear(8, 8)  # the same initial weights on every rank (same seed) ...
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # ... and the optimizer knows it
    for step in range(2):
        ddp(batch(rank, (4, 8), step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    facts["added"] = {"body_equal_on_every_rank": same_on_every_rank(model.body.weight),
                      "added_equal_on_every_rank": same_on_every_rank(model.adapter.weight)}  # fmt: skip
    return facts


# ---- 3. hooks ----------------------------------------------------------------------------------


def demo_tensor_hook(rank: int, world_size: int) -> dict:
    """A parameter's register_hook sees this rank's own gradient, before DDP averages it."""
    torch.manual_seed(0)
    ddp = DDP(OutOfOrderNet())
    seen = []
    ddp.module.head.weight.register_hook(lambda grad: seen.append(grad.clone()))
    train_steps(ddp, 1, rank)
    final = ddp.module.head.weight.grad
    mean_of_local = seen[0].clone()
    dist.all_reduce(mean_of_local)
    mean_of_local /= world_size
    return {"hook_grad_equal_on_every_rank": same_on_every_rank(seen[0]), "final_grad_equal_on_every_rank": same_on_every_rank(final),
            "final_is_mean_of_hook_grads": torch.allclose(final, mean_of_local, rtol=1e-5, atol=1e-8)}  # fmt: skip


def mean_allreduce_hook(process_group, bucket):
    """A correct communication hook: an asynchronous all-reduce of buffer / world size, returning its future."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer().div_(dist.get_world_size(group))  # divide first: the sum is then the mean
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda future: future.value()[0])  # a Future holding the bucket's tensor


def sum_allreduce_hook(process_group, bucket):
    """WRONG: all-reduces without dividing - every gradient world_size times too large."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda future: future.value()[0])


def blocking_allreduce_hook(process_group, bucket):
    """WRONG: waits for its all-reduce inside backward, so no other gradient is computed meanwhile."""
    buffer = bucket.buffer().div_(dist.get_world_size())
    dist.all_reduce(buffer)  # synchronous: returns when every rank has contributed
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


def demo_comm_hooks(rank: int, world_size: int) -> dict:
    builtin = grads_with_hook(rank, None)
    facts = {}
    for name, hook in [("mean", mean_allreduce_hook), ("sum", sum_allreduce_hook), ("blocking", blocking_allreduce_hook)]:
        grads = grads_with_hook(rank, hook)
        ratios = [float(g.norm() / b.norm()) for g, b in zip(grads, builtin)]
        facts[name] = {"matches_builtin": all(torch.allclose(g, b, rtol=1e-5, atol=1e-8) for g, b in zip(grads, builtin)),
                       "min_ratio": round(min(ratios), 3), "max_ratio": round(max(ratios), 3)}  # fmt: skip
    return facts


def demo_overlap_traces(rank: int, world_size: int, trace_dir: str) -> dict:
    """Profile two DDP steps with the built-in all-reduce and with the blocking hook (one trace folder each)."""
    for name, hook in [("builtin", None), ("blocking", blocking_allreduce_hook)]:
        torch.manual_seed(0)
        # Six 4 MiB layers and bucket_cap_mb=4: one bucket per layer after the rebuild. A batch of 2
        # keeps each layer's backward shorter than its all-reduce, on fast CPUs too, so that with real
        # overlap some all-reduce is always running while backward computes.
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)])
        ddp = DDP(model, bucket_cap_mb=4)
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        inputs = batch(rank, (2, 1024))

        def step(_):
            with profiling.phase("forward"):
                loss = ddp(inputs).square().mean()
            with profiling.phase("backward"):
                loss.backward()
            with profiling.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad()

        profiling.profile_steps(step, steps=2, out_dir=os.path.join(trace_dir, name), rank=rank)
    return {"traced": True}


def demo_unused_on_one_rank_without_flag(rank: int, world_size: int) -> dict:
    """The case find_unused_parameters exists for, without it: rank 1 errors, rank 0 waits until the timeout.

    Runs in a group of its own with a short timeout, last: that group is broken afterwards.
    """
    group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=UNUSED_TIMEOUT_S))
    torch.manual_seed(0)
    ddp = DDP(WithUnused(), process_group=group)
    outcome = "finished"
    try:
        for step in range(2):
            ddp(batch(rank, (4, 8), step), use_extra=(rank == 0)).square().mean().backward()
    except RuntimeError as error:
        text = str(error)
        outcome = "timed out" if "timed out" in text.lower() else first_sentence(error)
    return {"outcome": outcome}


DEMOS = [demo_environment, demo_subgroups, demo_broadcast_at_construction, demo_buckets, demo_launch_order,
         demo_gradient_as_bucket_view, demo_unused_everywhere, demo_unused_on_some_ranks, demo_static_graph,
         demo_batchnorm, demo_sync_batchnorm, demo_change_after_wrapping, demo_tensor_hook, demo_comm_hooks]  # fmt: skip


def run_demos(rank: int, world_size: int, trace_dir: str | None) -> dict:
    report = {}
    for demo in DEMOS:
        report[demo.__name__.removeprefix("demo_")] = demo(rank, world_size)
        gc.collect()  # no DDP wrapper of a finished demo outlives it (CONTRIBUTING.md, "gloo teardown")
    if trace_dir:
        report["overlap_traces"] = demo_overlap_traces(rank, world_size, trace_dir)
    report["unused_on_one_rank_without_flag"] = demo_unused_on_one_rank_without_flag(rank, world_size)
    gc.collect()
    return report


def require_forward_sync_buffers() -> None:
    """One clear line, not a traceback per rank, on a torch older than the course's (seen with 2.11)."""
    if "forward_sync_buffers" not in inspect.signature(DDP.__init__).parameters:
        sys.exit(
            f"ddp_internals_demos.py: DDP in torch {torch.__version__} has no forward_sync_buffers argument "
            "(the BatchNorm demo needs it); install the torch that requirements.txt pins"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True, help="where rank 0 writes every rank's facts")
    parser.add_argument("--trace-dir", help="write profiler traces of a DDP step here (two folders)")
    args = parser.parse_args()
    require_forward_sync_buffers()
    init_process_group_inline(timeout_s=60, backend=DEMO_BACKEND)
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        mine = run_demos(rank, world_size, args.trace_dir)
        everyone = [None] * world_size
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            report = {demo: [facts[demo] for facts in everyone] for demo in mine}
            with open(args.json, "w") as file:
                json.dump(report, file, indent=1)
    finally:
        teardown_distributed()


if __name__ == "__main__":
    main()
