"""Checks of the from-scratch DDP of lab 6 on real ranks; one launch runs many, rank 0 writes them as JSON.

    torchrun --standalone --nproc_per_node=2 tests/scripts/minddp_check.py --suite wrappers --json /tmp/w.json
    torchrun --standalone --nproc_per_node=4 tests/scripts/minddp_check.py --suite zero --json /tmp/z.json

--suite wrappers (2 ranks): NaiveDDP, OverlapDDP and BucketedDDP against one process on the full batch
and against torch's DDP (a model with a frozen layer, tied weights and a buffer; several bucket sizes),
no_sync accumulation, parameters unused on one rank or on all, a graph whose gradient order depends on
the rank, two deliberately wrong variants (negative controls), and the exercise, part by part.
--suite zero (4 ranks, subgroups of 1, 2 and 4): ShardedOptimizer against the unsharded optimizer and
torch's ZeroRedundancyOptimizer, optimizer-state bytes per rank, and BucketedDDP + ShardedOptimizer
against one process.

Every rank computes its own checks (and its own single-process reference); rank 0 gathers them and
writes {"suite", "world_size", "tolerance", "records": [{"check", "rank", ...}, ...]}. tests/test_minddp.py
asserts on the records. Every collective waits at most --timeout-s seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from ddp_course.compare import max_relative_difference
from ddp_course.distributed import setup_distributed, teardown_distributed
from ddp_course.authoring.exercises import exercise_header, make_exercise
from ddp_course.checking.lab6 import GatedNet, TwoBranchNet, small_batch
from ddp_course.launch import REPO_ROOT, import_script

SOLUTION = REPO_ROOT / "solutions" / "minddp.py"
EXERCISE = REPO_ROOT / "labs" / "minddp.py"
minddp = import_script(SOLUTION, "minddp")
# The lab's own check runs these two small models on the learner's module too: one copy, in lab 6's checks.
# GatedNet: `extra` used by rank 0 only, `never` by no rank. TwoBranchNet: a rank-dependent gradient order.
RANK_DEPENDENT_GRAPHS = (GatedNet,)  # the function itself depends on the rank (TwoBranchNet's does not)

STEPS = 5
BATCH = 16  # rows of the global batch; each of 2 ranks gets 8
LR = 0.1
# A weight gradient here is a sum of at most 32 products (16 rows x 2 uses of the tied weight). Summed
# in another order (shards, then the all-reduce) a float32 sum of n terms differs by at most about
# n * eps relative to the sum of the terms' magnitudes (Higham, Accuracy and Stability of Numerical
# Algorithms, 2nd ed., section 4.2), and each of the STEPS updates can add that again.
EPS = torch.finfo(torch.float32).eps
TOLERANCE = STEPS * 2 * BATCH * EPS  # 1.9e-5


# --- models -------------------------------------------------------------------------------------------


class TiedNet(nn.Module):
    """A frozen layer, input and output weights tied, a buffer: what a DDP wrapper must get right."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 16, bias=False)  # weight (16, 6): also the output projection
        self.hidden = nn.Linear(16, 16)
        self.frozen = nn.Linear(16, 16).requires_grad_(False)
        self.mix = nn.Linear(16, 16)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x, rank=0):  # x (B, 6) -> (B, 6)
        h = torch.tanh(self.embed(x))
        h = torch.tanh(self.hidden(h)) + self.scale * self.frozen(h)
        return torch.tanh(self.mix(h)) @ self.embed.weight


class ZeroNet(nn.Sequential):
    """Eight equal layers: shards of 1/1, 1/2 and 1/4 of the parameters balance exactly."""

    def __init__(self):
        super().__init__(*[nn.Linear(16, 16) for _ in range(8)])


# --- training runs ------------------------------------------------------------------------------------


def batch(step, rows=BATCH):
    return small_batch(step, rows)


def build(model_cls, seed=0):
    torch.manual_seed(seed)
    return model_cls()


def weights(model) -> dict:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def reference_weights(model_cls, world_size, steps=STEPS, rows=BATCH) -> dict:
    """One process, the whole batch: for a rank-dependent model, each shard through its rank's graph."""
    model = build(model_cls)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = batch(step, rows)
        optimizer.zero_grad()
        if model_cls in RANK_DEPENDENT_GRAPHS:
            shards = zip(x.chunk(world_size), y.chunk(world_size))
            loss = sum(F.mse_loss(model(xs, rank), ys) for rank, (xs, ys) in enumerate(shards)) / world_size
        else:
            loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    return weights(model)


def distributed_weights(ctx, model_cls, wrap, steps=STEPS, micro_batches=1, set_to_none=True, rows=BATCH) -> dict:
    """Train a wrapped replica on this rank's shard; micro_batches > 1 accumulates under no_sync()."""
    model = wrap(build(model_cls))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        x, y = batch(step, rows)
        x, y = x.chunk(ctx.world_size)[ctx.rank], y.chunk(ctx.world_size)[ctx.rank]
        optimizer.zero_grad(set_to_none=set_to_none)
        micro = list(zip(x.chunk(micro_batches), y.chunk(micro_batches)))
        with model.no_sync():
            for xs, ys in micro[:-1]:
                (F.mse_loss(model(xs, ctx.rank), ys) / micro_batches).backward()
        xs, ys = micro[-1]
        (F.mse_loss(model(xs, ctx.rank), ys) / micro_batches).backward()
        if not isinstance(model, DistributedDataParallel):
            model.finish_gradient_synchronization()
        optimizer.step()
    return weights(model.module)


def torch_ddp(find_unused_parameters=False):
    return lambda module: DistributedDataParallel(module, find_unused_parameters=find_unused_parameters)


class SumNotAverageBucketedDDP(minddp.BucketedDDP):
    """WRONG on purpose (seed error E2): sums the gradients without dividing by world_size."""

    def _launch_bucket(self, bucket):
        bucket.work = dist.all_reduce(bucket.buffer, async_op=True)


class UnbroadcastShardedOptimizer(minddp.ShardedOptimizer):
    """WRONG on purpose: steps its shard but never sends the updated parameters to the other ranks."""

    def _broadcast_from_owners(self):
        pass


class ReadyOrderBucketedDDP(minddp.BucketedDDP):
    """WRONG on purpose (seed error E1): launches each bucket as soon as it is full, in the order buckets fill."""

    def _launch_ready_buckets(self):
        for bucket in self.buckets:
            if bucket.waiting_for == 0 and bucket.work is None:
                self._launch_bucket(bucket)


def compare(check, ctx, weights_, reference, **extra) -> dict:
    difference = max_relative_difference(weights_, reference)
    return {"check": check, "rank": ctx.rank, "max_rel_diff": difference, **extra}


def per_parameter_cap_mb() -> float:
    return 1e-9  # below any parameter's size: one parameter per bucket


def several_buckets_cap_mb() -> float:
    return 1.1 * 1024 / minddp.MIB  # 1.1 KiB: a 16x16 weight (1 KiB) and its bias share a bucket


def bucket_count(model_cls, cap_mb) -> int:
    trainable = [p for p in build(model_cls).parameters() if p.requires_grad]
    return len(minddp.assign_buckets(trainable, cap_mb))


def wrapper_checks(ctx) -> list[dict]:
    records = []
    reference = reference_weights(TiedNet, ctx.world_size)
    torch_weights = distributed_weights(ctx, TiedNet, torch_ddp())
    records.append(compare("torch_ddp_vs_single", ctx, torch_weights, reference))
    caps = {"one": None, "default": 25.0, "several": several_buckets_cap_mb(), "per_param": per_parameter_cap_mb()}
    trainable = sum(p.requires_grad for p in build(TiedNet).parameters())
    runs = {"naive": minddp.NaiveDDP, "overlap": minddp.OverlapDDP}
    for name, cap in caps.items():
        runs[f"bucketed_{name}"] = lambda module, cap=cap: minddp.BucketedDDP(module, bucket_cap_mb=cap)
    for name, wrap in runs.items():
        mine = distributed_weights(ctx, TiedNet, wrap)
        buckets = bucket_count(TiedNet, caps[name.removeprefix("bucketed_")]) if name.startswith("bucketed") else None
        extra = {"wrapper": name, "buckets": buckets, "trainable_parameters": trainable}
        records.append(compare("matches_single", ctx, mine, reference, **extra))
        records.append(compare("matches_torch_ddp", ctx, mine, torch_weights, **extra))
        exact = all(torch.equal(mine[key], torch_weights[key]) for key in mine)
        records[-1]["bitwise_equal"] = exact
    # .grad left as views into the buckets, zeroed in place by zero_grad(set_to_none=False).
    kept = distributed_weights(ctx, TiedNet, runs["bucketed_several"], set_to_none=False)
    records.append(compare("matches_single", ctx, kept, reference, wrapper="bucketed_several_set_to_none_false"))
    records += no_sync_checks(ctx, runs)
    records += unused_parameter_checks(ctx)
    records += order_checks(ctx)
    records += negative_controls(ctx, reference)
    records.append(broadcast_check(ctx))
    records.append(wrap_twice_check(ctx))
    records += [second_backward_check(ctx, name, runs[name]) for name in ("overlap", "bucketed_several")]
    records += exercise_checks(ctx)
    return records


def no_sync_checks(ctx, runs) -> list[dict]:
    """3 micro-batches of 4 rows per rank, the first 2 under no_sync(): equals one process on all 24 rows."""
    rows = 3 * 4 * ctx.world_size
    reference = reference_weights(TiedNet, ctx.world_size, rows=rows)
    records = []
    for name in ("naive", "overlap", "bucketed_several", "bucketed_one"):
        mine = distributed_weights(ctx, TiedNet, runs[name], micro_batches=3, rows=rows)
        records.append(compare("no_sync_matches_single", ctx, mine, reference, wrapper=name))
    return records


def unused_parameter_checks(ctx) -> list[dict]:
    """GatedNet: `extra` used on rank 0 only, `never` on no rank. Must finish and average correctly."""
    reference = reference_weights(GatedNet, ctx.world_size)
    records = [compare("unused_torch_ddp", ctx, distributed_weights(ctx, GatedNet, torch_ddp(True)), reference)]
    wrappers = {
        "naive": minddp.NaiveDDP,
        "overlap": minddp.OverlapDDP,
        "bucketed_one": lambda module: minddp.BucketedDDP(module, bucket_cap_mb=None),
        "bucketed_per_param": lambda module: minddp.BucketedDDP(module, bucket_cap_mb=per_parameter_cap_mb()),
    }
    for name, wrap in wrappers.items():
        mine = distributed_weights(ctx, GatedNet, wrap)
        records.append(compare("unused_matches_single", ctx, mine, reference, wrapper=name))
        records[-1].update(never_grad(ctx, wrap))
    return records


def never_grad(ctx, wrap) -> dict:
    """What .grad of the parameter no rank used holds after one synchronised step."""
    model = wrap(build(GatedNet))
    x, y = batch(0)
    F.mse_loss(model(x.chunk(ctx.world_size)[ctx.rank], ctx.rank), y.chunk(ctx.world_size)[ctx.rank]).backward()
    model.finish_gradient_synchronization()
    grad = model.module.never.weight.grad
    return {"never_grad_is_none": grad is None, "never_grad_abs_max": None if grad is None else float(grad.abs().max())}


def order_checks(ctx) -> list[dict]:
    """TwoBranchNet readies a's and b's gradients in a rank-dependent order; strict bucket order copes."""
    model = build(TwoBranchNet)
    order = []
    for name in ("a", "b"):
        getattr(model, name).weight.register_post_accumulate_grad_hook(lambda _, name=name: order.append(name))
    x, y = batch(0)
    F.mse_loss(model(x, ctx.rank), y).backward()
    reference = reference_weights(TwoBranchNet, ctx.world_size)
    records = [{"check": "ready_order", "rank": ctx.rank, "order": order}]
    for name, wrap in {"overlap": minddp.OverlapDDP, "bucketed_per_param": _per_param(minddp.BucketedDDP)}.items():
        mine = distributed_weights(ctx, TwoBranchNet, wrap)
        records.append(compare("rank_dependent_order_matches_single", ctx, mine, reference, wrapper=name))
    return records


def _per_param(wrapper_cls):
    return lambda module: wrapper_cls(module, bucket_cap_mb=per_parameter_cap_mb())


def negative_controls(ctx, tied_reference) -> list[dict]:
    """The same comparisons applied to wrong variants must report a difference far above TOLERANCE."""
    summed = distributed_weights(ctx, TiedNet, _per_param(SumNotAverageBucketedDDP))
    records = [compare("negative_sum_not_average", ctx, summed, tied_reference)]
    reference = reference_weights(TwoBranchNet, ctx.world_size)
    ready_order = distributed_weights(ctx, TwoBranchNet, _per_param(ReadyOrderBucketedDDP))
    records.append(compare("negative_ready_order", ctx, ready_order, reference))
    return records


def broadcast_check(ctx) -> dict:
    """Replicas built with different seeds on each rank hold rank 0's weights once wrapped."""
    model = build(TiedNet, seed=100 + ctx.rank)
    before = torch.cat([t.flatten() for t in weights(model).values()])
    minddp.NaiveDDP(model)
    after = torch.cat([t.flatten() for t in weights(model).values()])
    everyone = [torch.empty_like(after) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, after)
    seeds_differ = [torch.empty_like(before) for _ in range(ctx.world_size)]
    dist.all_gather(seeds_differ, before)
    return {
        "check": "broadcast_at_construction",
        "rank": ctx.rank,
        "differed_before": not all(torch.equal(seeds_differ[0], t) for t in seeds_differ),
        "equal_after": all(torch.equal(everyone[0], t) for t in everyone),
    }


def wrap_twice_check(ctx) -> dict:
    """A module already wrapped (its parameters carry hooks) is refused by a second wrapper."""
    model = build(TiedNet)
    minddp.BucketedDDP(model)
    try:
        minddp.OverlapDDP(model)
    except RuntimeError as error:
        return {"check": "wrap_twice_refused", "rank": ctx.rank, "message": str(error)}
    return {"check": "wrap_twice_refused", "rank": ctx.rank, "message": None}


def second_backward_check(ctx, name, wrap) -> dict:
    """Two synchronised backward passes without finish_gradient_synchronization() in between: an error, not
    a gradient all-reduced twice. finish_gradient_synchronization() then completes what was launched."""
    model = wrap(build(TiedNet))
    x, y = batch(0)
    message = None
    for _ in range(2):
        try:
            F.mse_loss(model(x.chunk(ctx.world_size)[ctx.rank]), y.chunk(ctx.world_size)[ctx.rank]).backward()
        except RuntimeError as error:
            message = str(error)
    model.finish_gradient_synchronization()
    return {"check": "second_backward_raises", "rank": ctx.rank, "wrapper": name, "message": message}


# --- the exercise, part by part ---------------------------------------------------------------------


def module_from_text(text: str, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    sys.modules[name] = module  # dataclasses look the module up there
    exec(compile(text, f"<{name}>", "exec"), module.__dict__)
    return module


def outcome(action) -> str:
    """'ok', or the NotImplementedError's message (the TODO the run reached first)."""
    try:
        action()
    except NotImplementedError as stop:
        return str(stop)
    return "ok"


def exercise_outcomes(module, ctx) -> dict:
    def one_step(wrap):
        def run():
            model = wrap(build(TiedNet))
            x, y = batch(0)
            F.mse_loss(model(x.chunk(ctx.world_size)[ctx.rank]), y.chunk(ctx.world_size)[ctx.rank]).backward()
            model.finish_gradient_synchronization()

        return run

    def sharded_step():
        model = build(TiedNet)
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        module.ShardedOptimizer(model.parameters(), torch.optim.SGD, lr=LR).step()

    return {
        "naive": outcome(one_step(module.NaiveDDP)),
        "overlap": outcome(one_step(module.OverlapDDP)),
        "bucketed": outcome(one_step(lambda m: module.BucketedDDP(m, bucket_cap_mb=several_buckets_cap_mb()))),
        "sharded": outcome(sharded_step),
    }


def exercise_checks(ctx) -> list[dict]:
    """The committed exercise as a learner gets it, then the exercise with parts 1..k-1 solved, k = 2..4."""
    committed = exercise_outcomes(import_script(EXERCISE, "minddp_exercise"), ctx)
    records = [{"check": "exercise", "rank": ctx.rank, "stage": "labs/minddp.py", **committed}]
    solution = SOLUTION.read_text()
    header = exercise_header("solutions/minddp.py", "labs/minddp.py")
    for first_todo in (2, 3, 4):
        text = make_exercise(solution, header, parts=range(first_todo, 5))
        module = module_from_text(text, f"minddp_from_part_{first_todo}")
        records.append({"check": "exercise", "rank": ctx.rank, "stage": first_todo, **exercise_outcomes(module, ctx)})
    return records


# --- ZeRO-1 ----------------------------------------------------------------------------------------


def zero_checks(ctx) -> list[dict]:
    """ShardedOptimizer in subgroups of 1, 2 and 4 ranks (every rank creates every group, as new_group requires)."""
    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), ctx.world_size: None}
    optimizers = {
        "adam": (torch.optim.Adam, {"lr": 0.01}),
        "sgd_momentum": (torch.optim.SGD, {"lr": LR, "momentum": 0.9}),
    }
    records = []
    for size, group in groups.items():
        if ctx.rank >= size:
            continue
        for name, (optimizer_cls, kwargs) in optimizers.items():
            records.append({"world_size": size, "optimizer": name, **sharded_run(ctx, group, optimizer_cls, kwargs)})
    records.append(zero_with_ddp(ctx))
    records.append(groups_and_scheduler_check(ctx))
    records.append(unbroadcast_control(ctx))
    return records


def groups_and_scheduler_check(ctx) -> dict:
    """Two parameter groups with their own learning rates, changed by a scheduler: as the unsharded optimizer."""
    sharded, unsharded = build(ZeroNet), build(ZeroNet)

    def groups(model):
        parameters = list(model.parameters())  # 8 layers x (weight, bias): the first 4 layers, then the rest
        return [{"params": parameters[:8], "lr": 0.05}, {"params": parameters[8:]}]

    optimizers = [
        minddp.ShardedOptimizer(groups(sharded), torch.optim.SGD, lr=LR, momentum=0.9),
        torch.optim.SGD(groups(unsharded), lr=LR, momentum=0.9),
    ]
    schedulers = [torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5) for optimizer in optimizers]
    for step in range(STEPS):
        for model, optimizer, scheduler in zip((sharded, unsharded), optimizers, schedulers):
            full_batch_gradients(model, step)
            optimizer.step()
            scheduler.step()
    return compare(
        "zero_groups_and_scheduler", ctx, weights(sharded), weights(unsharded),
        lrs=[group["lr"] for group in optimizers[0].param_groups],
        local_lrs=[group["lr"] for group in optimizers[0].local_optimizer.param_groups],
    )  # fmt: skip


def unbroadcast_control(ctx) -> dict:
    """Negative control: the same comparison catches a ShardedOptimizer that forgets the broadcast."""
    sharded, unsharded = build(ZeroNet), build(ZeroNet)
    optimizers = [
        UnbroadcastShardedOptimizer(sharded.parameters(), torch.optim.SGD, lr=LR),
        torch.optim.SGD(unsharded.parameters(), lr=LR),
    ]
    for step in range(STEPS):
        for model, optimizer in zip((sharded, unsharded), optimizers):
            full_batch_gradients(model, step)
            optimizer.step()
    return compare("negative_zero_without_broadcast", ctx, weights(sharded), weights(unsharded))


def full_batch_gradients(model, step):
    model.zero_grad()
    generator = torch.Generator().manual_seed(2000 + step)
    x, y = torch.randn(BATCH, 16, generator=generator), torch.randn(BATCH, 16, generator=generator)
    F.mse_loss(model(x), y).backward()


def sharded_run(ctx, group, optimizer_cls, kwargs) -> dict:
    """The same full-batch gradients on every rank of the group: sharded, unsharded and torch's ZeRO step them."""
    replicas = {kind: build(ZeroNet) for kind in ("sharded", "unsharded", "torch_zero")}
    optimizers = {
        "sharded": minddp.ShardedOptimizer(replicas["sharded"].parameters(), optimizer_cls, process_group=group, **kwargs),
        "unsharded": optimizer_cls(replicas["unsharded"].parameters(), **kwargs),
        "torch_zero": ZeroRedundancyOptimizer(replicas["torch_zero"].parameters(), optimizer_class=optimizer_cls, process_group=group, **kwargs),
    }
    for step in range(STEPS):
        for kind, model in replicas.items():
            full_batch_gradients(model, step)
            optimizers[kind].step()
    unsharded = weights(replicas["unsharded"])
    sharded = weights(replicas["sharded"])
    return {
        "check": "zero",
        "rank": ctx.rank,
        "sharded_vs_unsharded": max_relative_difference(sharded, unsharded),
        "sharded_vs_torch_zero": max_relative_difference(sharded, weights(replicas["torch_zero"])),
        "bitwise_equal_unsharded": all(torch.equal(sharded[key], unsharded[key]) for key in sharded),
        "state_bytes_sharded": minddp.optimizer_state_bytes(optimizers["sharded"]),
        "state_bytes_unsharded": minddp.optimizer_state_bytes(optimizers["unsharded"]),
        "state_bytes_torch_zero": minddp.optimizer_state_bytes(optimizers["torch_zero"].optim),
    }


def zero_with_ddp(ctx) -> dict:
    """BucketedDDP + ShardedOptimizer(Adam) on the whole job against one process with Adam on the full batch."""
    reference = build(TiedNet)
    optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    model = minddp.BucketedDDP(build(TiedNet), bucket_cap_mb=several_buckets_cap_mb())
    sharded = minddp.ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        F.mse_loss(reference(x), y).backward()
        optimizer.step()
        sharded.zero_grad()
        F.mse_loss(model(x.chunk(ctx.world_size)[ctx.rank]), y.chunk(ctx.world_size)[ctx.rank]).backward()
        model.finish_gradient_synchronization()
        sharded.step()
    return compare("zero_with_bucketed_ddp", ctx, weights(model.module), weights(reference))


# --- main ------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=("wrappers", "zero"), required=True)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    args = parser.parse_args()
    ctx = setup_distributed("gloo", timeout_s=args.timeout_s)
    try:
        run_suite(ctx, args.suite, args.json)
    finally:
        teardown_distributed()
    return 0


def run_suite(ctx, suite: str, json_path: Path) -> None:
    """Every rank runs the suite's checks; rank 0 gathers all ranks' records and writes them to json_path."""
    records = wrapper_checks(ctx) if suite == "wrappers" else zero_checks(ctx)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, records)
    if ctx.is_main:
        result = {"suite": suite, "world_size": ctx.world_size, "tolerance": TOLERANCE}
        result["records"] = [record for rank_records in everyone for record in rank_records]
        json_path.write_text(json.dumps(result, indent=1))
        print(f"{suite}: {len(result['records'])} records written to {json_path}")


if __name__ == "__main__":
    sys.exit(main())
