"""Lab 6's checks and timing: a learner's from-scratch DDP against one process and torch's DDP, then timed.

The learner types `torchrun --standalone --nproc_per_node=2 labs/lab6_ddp_from_scratch.py`: that script
(its flags, the launch lines, the training demo) is the front end, and the judging lives here, as the other
checkers' does. The wrappers come from the learner's labs/minddp.py (or solutions/minddp.py, or a file of
their own), which the script loads and passes in as `minddp`: the package never imports a script.

    check_everything(args, ctx, tokens, minddp)  every wrapper after SGD steps against one process and torch
                 DDP (a verdict each), the small models that catch what the transformer cannot, ZeRO-1
    time_and_profile(args, ctx, tokens, minddp)  step times, repeats interleaved; --profile's traces
    job_records(...), report_times(...)          one record per implementation; the step-time table
    wrap(impl, model, minddp, cap_mb, ctx), training_step(...)  what the check, the timing and training share
    GatedNet, TwoBranchNet, small_batch         the small models (tests/scripts/minddp_check.py uses them too)
"""

from __future__ import annotations

import functools
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.char_lm_job import CHECK_LR, EPS_PER_STEP, deadline, global_batch, job_max, median_ratio, my_rows, new_model, seconds_per_step
from ddp_course.distributed import log
from ddp_course.profiling import phase, profile_steps
from ddp_course.reporting import format_table

WRAPPER_CLASS = {"naive": "NaiveDDP", "overlap": "OverlapDDP", "bucketed": "BucketedDDP"}
ZERO_LR = 1e-3  # AdamW for the --zero check: an optimizer with state worth sharding (two moments per weight)
PROFILED_STEPS = 3
SMALL_ROWS_PER_RANK = 4  # the small models' batch: 4 rows of 6 features per rank
ONE_BUCKET_PER_PARAMETER_MB = 1e-9  # below any tensor's size: BucketedDDP launches every gradient on its own


def wrap(impl: str, model, minddp, cap_mb, ctx):
    """model wrapped by impl; the controls "single process" and "no sync" train it bare."""
    if impl == "torch":
        # The same cap for both. An explicit cap also switches off DDP's small 1 MiB first bucket, so
        # both bucket alike; "none" becomes a cap above the model's size: one bucket. "default" is
        # torch's bucket_cap_mb=None: after the first step's rebuild, a 1 MiB first bucket, then 25 MiB.
        one_bucket_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1
        device_ids = [ctx.local_rank] if ctx.device.type == "cuda" else None
        if cap_mb == "default":
            return DDP(model, device_ids=device_ids)
        return DDP(model, device_ids=device_ids, bucket_cap_mb=one_bucket_mb if cap_mb is None else cap_mb)
    if impl == "bucketed":  # BucketedDDP has no small-first-bucket rule: "default" is its plain 25 MiB
        return minddp.BucketedDDP(model) if cap_mb == "default" else minddp.BucketedDDP(model, bucket_cap_mb=cap_mb)
    return getattr(minddp, WRAPPER_CLASS[impl])(model) if impl in WRAPPER_CLASS else model


def training_step(model, optimizer, inputs, targets) -> torch.Tensor:
    with phase("forward"):  # phases name the spans of a --profile trace
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())  # mean over the shard's characters
    with phase("backward"):
        loss.backward()
    if hasattr(model, "finish_gradient_synchronization"):  # the contract of minddp; torch DDP's backward waits itself
        model.finish_gradient_synchronization()
    with phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad()
    return loss.detach()


def weights_after_sgd(args, ctx, tokens, minddp, impl: str, make_optimizer=None) -> torch.Tensor:
    """All parameters, flattened, after --check-steps SGD steps. impl "single process": the whole batch,
    no wrapper; "no sync": this rank's shard, no wrapper; otherwise this rank's shard, wrapped.
    make_optimizer(parameters) replaces plain SGD (the --zero check)."""
    model = new_model(args, ctx)
    trained = wrap(impl, model, minddp, args.bucket_cap_mb, ctx)
    optimizer = (make_optimizer or functools.partial(torch.optim.SGD, lr=CHECK_LR))(model.parameters())
    generator = torch.Generator().manual_seed(args.seed)
    for _ in range(args.check_steps):
        inputs, targets = global_batch(tokens, generator, args, ctx)
        if impl != "single process":
            inputs, targets = my_rows(inputs, ctx), my_rows(targets, ctx)
        training_step(trained, optimizer, inputs, targets)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def check(args, ctx, tokens, minddp) -> dict:
    """Per implementation: max |w - w_single| and max |w - w_torch| (worst rank), the small models'
    differences, and the verdict, printed as soon as known (a learner whose later part raises a TODO
    still sees the earlier parts pass)."""
    single = weights_after_sgd(args, ctx, tokens, minddp, "single process")
    with_torch = weights_after_sgd(args, ctx, tokens, minddp, "torch")
    tolerance = EPS_PER_STEP * args.check_steps * torch.finfo(torch.float32).eps * float(single.abs().max())
    log(
        f"check: {args.check_steps} SGD steps, {ctx.world_size} shards of {args.batch_size} windows vs one process on all "
        f"{args.batch_size * ctx.world_size}; tolerance {tolerance:.2g} ({EPS_PER_STEP} x steps x float32 eps x max|w|)"
    )
    if ctx.world_size == 1:  # the only shard is the whole batch: no communication is needed to match one process
        log("  no sync   skipped: with one process it trains on the whole batch, exactly as the reference does")
    results = {}
    for impl in ([] if ctx.world_size == 1 else ["no sync"]) + args.impls:
        with deadline(args.case_timeout_s, f"{impl:<9} the transformer"):
            weights = with_torch if impl == "torch" else weights_after_sgd(args, ctx, tokens, minddp, impl)
        diffs = {"max_abs_diff_vs_single_process": job_max(float((weights - single).abs().max()), ctx),
                 "max_abs_diff_vs_torch_ddp": job_max(float((weights - with_torch).abs().max()), ctx)}  # fmt: skip
        results[impl] = {**diffs, "verdict": verdict(impl, diffs, tolerance), "tolerance": tolerance}
        log(
            f"  {impl:<9} max|w - one process| {diffs['max_abs_diff_vs_single_process']:.1e}   "
            f"max|w - torch DDP| {diffs['max_abs_diff_vs_torch_ddp']:.1e}   {results[impl]['verdict']}"
        )
        if impl in WRAPPER_CLASS:
            results[impl].update(check_small_models(args, ctx, minddp, impl))
    return results


# --- the small models: what the transformer cannot catch ------------------------------------------------
# Every rank of the transformer readies its gradients in the same order and uses every parameter, so a
# wrapper that launches in ready order, or waits for a gradient that never comes, passes it. These two
# models break both assumptions (tests/scripts/minddp_check.py, the course's own tests, uses them too).


class GatedNet(nn.Module):
    """`extra` is used by rank 0 only, `never` by no rank: a rank-dependent graph with unused parameters."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 16)
        self.extra = nn.Linear(16, 16)
        self.never = nn.Linear(16, 16)
        self.head = nn.Linear(16, 6)

    def forward(self, x, rank=0):  # x (B, 6) -> (B, 6)
        h = torch.tanh(self.trunk(x))
        if rank == 0:
            h = h + torch.tanh(self.extra(h))
        return self.head(h)


class TwoBranchNet(nn.Module):
    """Two equal-size branches computed in a rank-dependent order, so backward readies them in a rank-dependent
    order: even ranks get b's gradient first, odd ranks a's. The function computed is the same on every rank."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6, bias=False)
        self.b = nn.Linear(6, 6, bias=False)
        self.head = nn.Linear(6, 6)

    def forward(self, x, rank=0):  # x (B, 6) -> (B, 6)
        if rank % 2 == 0:
            ya = self.a(x)
            yb = self.b(x)
        else:
            yb = self.b(x)
            ya = self.a(x)
        return self.head(torch.tanh(ya) * torch.tanh(yb))


SMALL_MODELS = {"rank-dependent order": TwoBranchNet, "unused on a rank": GatedNet}


def small_batch(step: int, rows: int, device="cpu"):
    """Inputs and targets (rows, 6), the same on every rank for a given step."""
    generator = torch.Generator().manual_seed(1000 + step)
    inputs, targets = torch.randn(rows, 6, generator=generator), torch.randn(rows, 6, generator=generator)
    return inputs.to(device), targets.to(device)


def small_model_weights(args, ctx, model_cls, wrap=None) -> torch.Tensor:
    """All parameters, flattened, after --check-steps SGD steps. wrap None: one process, every rank's shard
    through that rank's graph (the loss is the mean of the shards' losses); otherwise this rank's shard, wrapped."""
    torch.manual_seed(args.seed)
    model = model_cls().to(ctx.device)
    trained = model if wrap is None else wrap(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=CHECK_LR)
    for step in range(args.check_steps):
        inputs, targets = small_batch(step, SMALL_ROWS_PER_RANK * ctx.world_size, ctx.device)
        if wrap is None:
            shards = zip(inputs.chunk(ctx.world_size), targets.chunk(ctx.world_size))
            loss = sum(F.mse_loss(model(x, rank), y) for rank, (x, y) in enumerate(shards)) / ctx.world_size
        else:
            loss = F.mse_loss(trained(my_rows(inputs, ctx), ctx.rank), my_rows(targets, ctx))
        loss.backward()
        if wrap is not None:
            trained.finish_gradient_synchronization()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def check_small_models(args, ctx, minddp, impl: str) -> dict:
    """impl on each small model against one process: max |w - w_single| (worst rank), a line per model as
    soon as known. BucketedDDP gets one bucket per parameter, so that the order of the launches matters."""
    if impl == "bucketed":
        wrap = functools.partial(minddp.BucketedDDP, bucket_cap_mb=ONE_BUCKET_PER_PARAMETER_MB)
    else:
        wrap = getattr(minddp, WRAPPER_CLASS[impl])
    diffs, passed = {}, True
    for name, model_cls in SMALL_MODELS.items():
        single = small_model_weights(args, ctx, model_cls)
        with deadline(args.case_timeout_s, f"{impl:<9} {name}"):
            mine = small_model_weights(args, ctx, model_cls, wrap)
        tolerance = EPS_PER_STEP * args.check_steps * torch.finfo(torch.float32).eps * float(single.abs().max())
        diffs[name] = job_max(float((mine - single).abs().max()), ctx)
        passed = passed and diffs[name] <= tolerance
        log(f"  {impl:<9} {name:<21} max|w - one process| {diffs[name]:.1e}   {'PASS' if diffs[name] <= tolerance else 'FAIL'}")
    return {"small_models_max_abs_diff": diffs, "small_models_passed": passed}


def check_zero(args, ctx, tokens, minddp) -> bool:
    """Part 4: torch DDP stepping your ShardedOptimizer(AdamW) must end with the weights of torch DDP
    stepping AdamW itself, while the fullest rank keeps at most 1/world_size of AdamW's state plus one
    tensor's share (a tensor has one owner: the split is only as even as the tensor sizes allow)."""
    optimizers = {}

    def keep(name, make):  # remember the optimizer weights_after_sgd builds, to measure its state
        return lambda parameters: optimizers.setdefault(name, make(parameters))

    adamw = functools.partial(torch.optim.AdamW, lr=ZERO_LR)
    plain = weights_after_sgd(args, ctx, tokens, minddp, "torch", keep("adamw", adamw))
    with deadline(args.case_timeout_s, "zero-1    ShardedOptimizer"):
        sharded = weights_after_sgd(args, ctx, tokens, minddp, "torch", keep("sharded", lambda ps: minddp.ShardedOptimizer(ps, torch.optim.AdamW, lr=ZERO_LR)))
    tolerance = EPS_PER_STEP * args.check_steps * torch.finfo(torch.float32).eps * float(plain.abs().max())
    difference = job_max(float((sharded - plain).abs().max()), ctx)
    state_share = job_max(minddp.optimizer_state_bytes(optimizers["sharded"]), ctx) / minddp.optimizer_state_bytes(optimizers["adamw"])
    sizes = [p.numel() for p in optimizers["adamw"].param_groups[0]["params"]]
    allowed = 1 / ctx.world_size + max(sizes) / sum(sizes)
    passed = difference <= tolerance and state_share <= allowed
    log(
        f"  zero-1    max|w - AdamW| {difference:.1e}   AdamW state on the fullest rank {state_share:.2f} of AdamW's "
        f"(at most 1/world_size + largest tensor / all = {1 / ctx.world_size:.2f} + {max(sizes) / sum(sizes):.2f})   "
        f"{'PASS' if passed else 'FAIL'}"
    )
    return passed


def time_and_profile(args, ctx, tokens, minddp) -> dict:
    """Step times of every implementation and of "no sync" (the same step without any communication),
    one per repeat; with --zero also torch DDP stepping AdamW and stepping your ShardedOptimizer(AdamW).
    The order rotates each repeat, so drift in the machine's load and any first-in-the-round effect hit
    every implementation alike."""
    inputs, targets = (my_rows(t, ctx) for t in global_batch(tokens, torch.Generator().manual_seed(args.seed), args, ctx))
    optimizers = {impl: functools.partial(torch.optim.SGD, lr=1e-4) for impl in args.impls + ["no sync"]}
    if args.zero:  # part 4's price: the same torch DDP step, the optimizer sharded or not
        optimizers["torch+adamw"] = functools.partial(torch.optim.AdamW, lr=ZERO_LR)
        optimizers["torch+zero-1"] = lambda ps: minddp.ShardedOptimizer(ps, torch.optim.AdamW, lr=ZERO_LR)
    steps = {}
    for impl, make_optimizer in optimizers.items():
        model = new_model(args, ctx)
        wrapped = wrap("torch" if impl.startswith("torch+") else impl, model, minddp, args.bucket_cap_mb, ctx)
        optimizer = make_optimizer(model.parameters())
        steps[impl] = lambda w=wrapped, o=optimizer: training_step(w, o, inputs, targets)
        for _ in range(args.warmup_steps):
            steps[impl]()
    order = list(steps)
    times = {impl: [] for impl in order}
    for repeat in range(args.repeats):
        shift = repeat % len(order)
        for impl in order[shift:] + order[:shift]:
            times[impl].append(seconds_per_step(steps[impl], args.steps, ctx))
    if args.profile:
        write_traces({impl: steps[impl] for impl in args.impls}, args.profile, ctx)
    return times


def write_traces(steps: dict, directory: str, ctx) -> None:
    for impl, step in steps.items():
        profile_steps(lambda _: step(), PROFILED_STEPS, Path(directory) / impl, rank=ctx.rank, warmup_steps=0, device=ctx.device)
    log(f"traces: {directory}/<impl>/trace_rank<r>.json (open at https://ui.perfetto.dev or chrome://tracing)")


def verdict(impl: str, diffs: dict, tolerance: float) -> str:
    close = diffs["max_abs_diff_vs_single_process"] <= tolerance and diffs["max_abs_diff_vs_torch_ddp"] <= tolerance
    if impl == "no sync":  # the control: replicas that never communicate must drift apart
        return "differs (control)" if not close else "CONTROL DID NOT DIFFER"
    return "PASS" if close else "FAIL"


def check_everything(args, ctx, tokens, minddp) -> tuple[dict, dict, bool]:
    """check(), then with --zero check_zero(): {impl: its numbers}, {impl: its verdict}, and whether the
    whole check passed (every wrapper on the transformer and on both small models, the control differing)."""
    checked = check(args, ctx, tokens, minddp)
    verdicts = {impl: result.pop("verdict") for impl, result in checked.items()}
    small_passed = all(checked[impl].get("small_models_passed", True) for impl in args.impls)
    control_differs = ctx.world_size == 1 or verdicts["no sync"] == "differs (control)"  # skipped on one rank
    passed = all(verdicts[impl] == "PASS" for impl in args.impls) and small_passed and control_differs
    if args.zero:
        passed = check_zero(args, ctx, tokens, minddp) and passed
    return checked, verdicts, passed


def job_records(args, ctx, checked: dict, verdicts: dict, times: dict) -> list[dict]:
    """One record per implementation (--json writes them): the check's numbers and the step times."""
    median = {impl: statistics.median(t) for impl, t in times.items() if t}
    return [{
        "impl": impl, "module": "torch" if impl == "torch" else args.file or args.module, "bucket_cap_mb": args.bucket_cap_mb,
        "world_size": ctx.world_size, "backend": ctx.backend, "device": ctx.device.type, "batch_size_per_rank": args.batch_size,
        "check_steps": args.check_steps, **checked[impl],
        "check_passed": verdicts[impl] == "PASS" and checked[impl].get("small_models_passed", True),
        "step_time_s": median.get(impl), "step_times_s": times.get(impl, []),
        "step_time_no_sync_s": median.get("no sync"),
        "vs_torch_ddp": median_ratio(times, impl, "torch"),
        # the share of a step that communication added and backward did not hide (lab 5's comm_fraction)
        "exposed_comm_fraction": 1 - median_ratio(times, "no sync", impl) if impl in median else None,
        "step_time_torch_adamw_s": median.get("torch+adamw"), "step_time_torch_zero1_s": median.get("torch+zero-1"),
        "zero1_vs_adamw": median_ratio(times, "torch+zero-1", "torch+adamw"),
    } for impl in args.impls]  # fmt: skip


def report_times(args, records: list[dict], times: dict) -> None:
    """The step-time table, and with --zero ZeRO-1's price; nothing when nothing was timed."""
    median = {impl: statistics.median(t) for impl, t in times.items() if t}
    if median:
        log(
            f"step time: median of {args.repeats} repeats of {args.steps} steps, slowest rank; "
            f"the same step without communication ('no sync'): {1000 * median['no sync']:.1f} ms"
        )
        table = [{**r, "step_time_ms": 1000 * r["step_time_s"]} for r in records]
        log(format_table(table, ["impl", "bucket_cap_mb", "step_time_ms", "vs_torch_ddp", "exposed_comm_fraction"]))
    if "torch+zero-1" in median:  # ShardedOptimizer keeps DDP's all-reduce and adds one broadcast per parameter tensor
        log(
            f"zero-1: torch DDP + ShardedOptimizer(AdamW) {1000 * median['torch+zero-1']:.1f} ms per step, torch DDP + AdamW "
            f"{1000 * median['torch+adamw']:.1f} ms ({median_ratio(times, 'torch+zero-1', 'torch+adamw'):.2f}x, median of "
            f"same-repeat ratios): the broadcasts come on top of the gradient all-reduce"
        )
