"""Lectures 5a and 5b's measurements in real DDP processes: a profiled step, compression hooks, bucket sizes,
gradient accumulation with no_sync, ZeRO-1's optimizer memory, and GradScaler skipping an overflowing
step on every rank. One job, several parts.

    2 CPU processes (gloo), what the lecture runs:
        torchrun --standalone --nproc_per_node=2 lectures/scripts/perf_ddp_job.py --out-dir runs/lecture5
    some parts only, longer:
        torchrun --standalone --nproc_per_node=2 lectures/scripts/perf_ddp_job.py --out-dir runs/l5 \
            --parts hooks --hook-steps 300
    8 GPUs (NCCL) - written with care (device from LOCAL_RANK, every tensor on the rank's GPU), run on
    one GPU (1 rank, benchmarks/gpu_smoke.py), never on several:
        torchrun --standalone --nproc_per_node=8 lectures/scripts/perf_ddp_job.py --out-dir runs/gpu

What you should see: rank 0 prints one line per part and writes OUT_DIR/perf.json (every number
below, per part) and OUT_DIR/traces/trace_rank{0,1}.json (open them in https://ui.perfetto.dev).
- profile: three comm_bound steps (lab 5's 13 M-parameter MLP) under torch.profiler, then lab 5's
  own DDP / no_sync timing of the same configuration (lab5_scaling.measure) for comparison;
- hooks: the digits CNN trained with each communication hook; bytes all-reduced per step (the fp16
  and bf16 hooks send half of allreduce_hook's, PowerSGD far less), losses and test accuracy;
  batched_powerSGD_hook fails in torch 2.14.1 (a shape assertion in its orthogonalisation), and
  the record says how;
- buckets: lab 5's measurement for each --bucket-caps value (DDP's default, then MiB sizes);
- accumulation: all-reduce calls and bytes per optimizer step with and without no_sync;
- zero: optimizer-state bytes per rank for Adam and for ZeroRedundancyOptimizer(Adam);
- gradscaler: fp16 autocast with torch.amp.GradScaler, an inf in rank 1's input at step 2: per rank,
  whether its loss and its (all-reduced) gradients were finite, whether it stepped, and its scale;
  then the same overflow under no_sync, where only rank 1 sees it.
"""

import contextlib
import functools
import gc
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from ddp_course import profiling
from ddp_course.checkpoint import atomic_write_json
from ddp_course.cli import CourseArgumentParser, CourseError, name_list, positive_float, positive_int
from ddp_course.data import load_digits
from ddp_course.distributed import BACKENDS, log, log_error, setup_distributed, teardown_distributed
from ddp_course.launch import REPO_ROOT, import_script
from ddp_course.models import DigitsCNN, WideMLP, build_model

lab5 = import_script(REPO_ROOT / "labs" / "lab5_scaling.py")  # lab 5's configs and its timing method

PARTS = ("profile", "hooks", "buckets", "accumulation", "zero", "gradscaler")
# allreduce_hook does what DDP does without a hook, but through torch.distributed.all_reduce in Python,
# where AllReduceCounter sees it (DDP's built-in path calls C++ directly). "bf16_autocast" trains under
# bf16 autocast with the plain all-reduce: what mixed precision does to the bytes sent.
HOOKS = {
    "allreduce": default_hooks.allreduce_hook,
    "bf16_autocast": default_hooks.allreduce_hook,
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
    "powerSGD": powerSGD_hook.powerSGD_hook,
    "batched_powerSGD": powerSGD_hook.batched_powerSGD_hook,
}
POWERSGD_START = 10  # plain all-reduce for the first steps: early gradients are the most sensitive
BATCH_PER_RANK = 32
ACCUMULATION_BUCKET_MB = 0.25
ZERO_WIDTH = 1024
SCALER_INIT = 2.0**10  # small enough that the finite step cannot overflow fp16 by itself


class AllReduceCounter:
    """Counts the calls and payload bytes of torch.distributed.all_reduce while active.

    Communication hooks call torch.distributed.all_reduce (PowerSGD also from the callbacks that run
    when an earlier all-reduce completes, on another thread), so the counter wraps that function.
    Bytes are the tensor each rank contributes; a ring moves 2(N-1)/N times that per rank (lecture 2).
    """

    def __init__(self):
        self.calls, self.bytes, self.active = 0, 0, False
        self._lock, self._original = threading.Lock(), dist.all_reduce

    def __enter__(self):
        def counting_all_reduce(tensor, *args, **kwargs):
            if self.active:
                with self._lock:
                    self.calls += 1
                    self.bytes += tensor.numel() * tensor.element_size()
            return self._original(tensor, *args, **kwargs)

        dist.all_reduce = counting_all_reduce
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._original

    @contextlib.contextmanager
    def counting(self):
        self.calls, self.bytes, self.active = 0, 0, True
        try:
            yield
        finally:
            self.active = False


def device_ids(ctx):
    return [ctx.local_rank] if ctx.device.type == "cuda" else None


def clock(ctx) -> float:
    """perf_counter() once this rank's GPU work is done: CUDA kernels run asynchronously, so without
    the synchronize a host timer measures how long the step took to enqueue, not to run."""
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    return time.perf_counter()


def profile_part(ctx, args) -> dict:
    """Profile comm_bound steps as lab 5 runs them (one trace per rank); --parts buckets times them lab 5's way."""
    config = lab5.CONFIGS["comm_bound"]
    torch.manual_seed(0)
    model = build_model(config.model).to(ctx.device)
    ddp_model = DDP(model, device_ids=device_ids(ctx), gradient_as_bucket_view=True)  # as lab 5 builds it
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=1e-3)
    inputs = torch.randn(config.batch_size, *config.input_shape, device=ctx.device)
    labels = torch.randint(0, 10, (config.batch_size,), device=ctx.device)

    def train_step(_):
        with profiling.phase("forward"):
            loss = F.cross_entropy(ddp_model(inputs), labels)
        with profiling.phase("backward"):
            loss.backward()  # DDP all-reduces its buckets while this runs, and waits for them at the end
        with profiling.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)

    profiling.profile_steps(train_step, steps=args.profile_steps, out_dir=Path(args.out_dir) / "traces",
                            rank=ctx.rank, device=ctx.device)  # fmt: skip
    return {"config": "comm_bound", "steps": args.profile_steps, "bucket_sizes_mib": lab5.bucket_sizes_mib(ddp_model)}


@functools.cache
def digits():
    return load_digits()  # the same splits for every hook, loaded once


def digits_batches(ctx, split, seed=0):
    """Endless (images, labels) batches of this rank's shard, a new shuffle every epoch."""
    sampler = DistributedSampler(split, num_replicas=ctx.world_size, rank=ctx.rank, seed=seed, drop_last=True)
    loader = DataLoader(split, batch_size=BATCH_PER_RANK, sampler=sampler, drop_last=True)
    for epoch in range(10**6):
        sampler.set_epoch(epoch)
        for images, labels in loader:
            yield images.to(ctx.device), labels.to(ctx.device)


def train_with_hook(ctx, name, args, counter) -> dict:
    """Train the digits CNN for --hook-steps steps with one communication hook; what it sent and learned."""
    torch.manual_seed(0)
    model = DigitsCNN().to(ctx.device)
    ddp_model = DDP(model, device_ids=device_ids(ctx))
    state = None
    if "powerSGD" in name:
        # Rank-r approximation of every gradient matrix, with error feedback (the residual is added to
        # the next step's gradient) and warm start (last step's Q starts the next power iteration).
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                            start_powerSGD_iter=POWERSGD_START, use_error_feedback=True,
                                            warm_start=True, random_seed=0)  # fmt: skip
    ddp_model.register_comm_hook(state, HOOKS[name])
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9)
    splits = digits()
    batches = digits_batches(ctx, splits.train)
    losses, seconds = [], []
    for step in range(args.hook_steps):
        images, labels = next(batches)
        started = clock(ctx)
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=name == "bf16_autocast"):
            loss = F.cross_entropy(ddp_model(images), labels)
        with counter.counting() if step == args.hook_steps - 1 else contextlib.nullcontext():
            loss.backward()  # the last step is counted: PowerSGD compresses by then
        gradient_dtypes = sorted({str(p.grad.dtype) for p in model.parameters()})  # what DDP averaged
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(clock(ctx) - started)
        losses.append(loss.detach())
    job_losses = torch.stack(losses)
    dist.all_reduce(job_losses)  # one collective for the whole curve: the job-wide mean loss per step
    test_images, test_labels = (tensor.to(ctx.device) for tensor in splits.test.tensors)
    with torch.no_grad():  # every rank holds the same weights: evaluate the whole test split
        accuracy = (model(test_images).argmax(1) == test_labels).float().mean().item()
    return {
        "losses": (job_losses / ctx.world_size).cpu().tolist(), "all_reduce_calls_per_step": counter.calls,
        "bytes_per_step": counter.bytes, "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "seconds_per_step": statistics.median(seconds[POWERSGD_START:]), "test_accuracy": accuracy,
        "gradient_dtypes": gradient_dtypes, "loss_dtype": str(loss.dtype),
    }  # fmt: skip


def hooks_part(ctx, args) -> dict:
    results = {}
    with AllReduceCounter() as counter:
        for name in args.hooks:
            try:
                results[name] = train_with_hook(ctx, name, args, counter)
            except Exception as error:  # a hook that fails (batched_powerSGD in torch 2.14.1): record how, go on
                first_line = (str(error).strip().splitlines() or [""])[0]
                results[name] = {"failed": f"{type(error).__name__}: {first_line}".rstrip(": ")}
                gc.collect()  # the half-finished DDP model goes before the next collective
                dist.barrier()  # every rank has failed the same way: meet again before the next hook
    return results


def buckets_part(ctx, args) -> list[dict]:
    """Lab 5's DDP / no_sync timing (lab5_scaling.measure) for each bucket cap."""
    records = []
    for cap in args.bucket_caps:
        flags = ["--config", args.bucket_config, "--bucket-cap-mb", cap, "--steps", args.timing_steps, "--repeats", args.timing_repeats]
        flags += ["--batch-size", args.bucket_batch] if args.bucket_batch else []
        records.append(lab5.measure(ctx, lab5.parse_args([str(flag) for flag in flags])))
    return records


def accumulation_part(ctx, args) -> dict:
    """All-reduces per optimizer step when k micro-batches are accumulated, with and without no_sync.

    The digits CNN with 0.25 MiB buckets (several buckets from a small model), after two warm-up
    steps: DDP's first iteration sends all gradients in one bucket, then rebuilds its buckets.
    """
    result = {"micro_batches": args.accumulation_steps, "bucket_cap_mb": ACCUMULATION_BUCKET_MB}
    gradients = {}
    generator = torch.Generator().manual_seed(1 + ctx.rank)  # each rank its own micro-batches

    def micro_batch_backward(model, scale=1.0):
        images, labels = torch.randn(BATCH_PER_RANK, 1, 8, 8, generator=generator), torch.randint(0, 10, (BATCH_PER_RANK,), generator=generator)
        (F.cross_entropy(model(images.to(ctx.device)), labels.to(ctx.device)) * scale).backward()

    with AllReduceCounter() as counter:
        for use_no_sync in (False, True):
            torch.manual_seed(0)
            ddp_model = DDP(DigitsCNN().to(ctx.device), device_ids=device_ids(ctx), bucket_cap_mb=ACCUMULATION_BUCKET_MB)
            ddp_model.register_comm_hook(None, default_hooks.allreduce_hook)
            for _ in range(2):
                micro_batch_backward(ddp_model)
            ddp_model.zero_grad()
            generator.manual_seed(1 + ctx.rank)  # both modes see the same micro-batches
            with counter.counting():
                for micro_batch in range(args.accumulation_steps):
                    last = micro_batch == args.accumulation_steps - 1
                    with ddp_model.no_sync() if use_no_sync and not last else contextlib.nullcontext():
                        micro_batch_backward(ddp_model, scale=1 / args.accumulation_steps)
            key = "no_sync" if use_no_sync else "every_micro_batch"
            result[key] = {"all_reduce_calls": counter.calls, "bytes": counter.bytes}
            result["buckets"] = len(lab5.bucket_sizes_mib(ddp_model) or [])
            gradients[key] = torch.cat([p.grad.flatten() for p in ddp_model.parameters()])
            del ddp_model
    # Averaging each micro-batch's gradient and summing = summing and averaging once: same gradients.
    difference = (gradients["no_sync"] - gradients["every_micro_batch"]).abs().max()
    result["max_relative_gradient_difference"] = (difference / gradients["no_sync"].abs().max()).item()
    return result


def zero_part(ctx, args) -> dict:
    """Adam's state per rank, unsharded and sharded (ZeRO stage 1), after the same 3 steps.

    Model: lab 5's wide MLP at width 1024 (3.4 M parameters), a quarter of comm_bound's, to stay quick.
    """
    weights, state_bytes = {}, {}
    for sharded in (False, True):
        torch.manual_seed(0)
        ddp_model = DDP(WideMLP(width=ZERO_WIDTH).to(ctx.device), device_ids=device_ids(ctx))
        if sharded:
            optimizer = ZeroRedundancyOptimizer(ddp_model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
            local_state = optimizer.optim.state  # this rank's shard of the parameters only
        else:
            optimizer = torch.optim.Adam(ddp_model.parameters(), lr=1e-3)
            local_state = optimizer.state
        generator = torch.Generator().manual_seed(1 + ctx.rank)
        for _ in range(3):
            inputs = torch.randn(4, 256, generator=generator).to(ctx.device)
            labels = torch.randint(0, 10, (4,), generator=generator).to(ctx.device)
            F.cross_entropy(ddp_model(inputs), labels).backward()
            optimizer.step()  # ZeRO: each rank steps its shard, then broadcasts the updated parameters
            optimizer.zero_grad()
        mine = sum(t.numel() * t.element_size() for s in local_state.values() for t in s.values() if torch.is_tensor(t))
        every_rank = [None] * ctx.world_size
        dist.all_gather_object(every_rank, mine)
        state_bytes["zero1" if sharded else "adam"] = every_rank
        weights[sharded] = torch.cat([p.detach().flatten() for p in ddp_model.parameters()])
        del ddp_model, optimizer, local_state
    return {"parameters": weights[False].numel(), "parameter_shapes": [list(p.shape) for p in WideMLP(width=ZERO_WIDTH).parameters()],
            "state_bytes_per_rank": state_bytes, "max_abs_weight_difference": (weights[True] - weights[False]).abs().max().item()}  # fmt: skip


def scaler_steps(ctx, sync: bool) -> list[dict]:
    """Two fp16 steps under GradScaler; at step 2 rank 1's input holds an inf (and, unless sync, step 2
    skips the all-reduce). What this rank saw at each step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(ctx.device)
    ddp_model = DDP(model, device_ids=device_ids(ctx))
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(ctx.device.type, init_scale=SCALER_INIT)
    generator = torch.Generator().manual_seed(1 + ctx.rank)
    records = []
    for step in (1, 2):
        inputs = torch.randn(8, 4, generator=generator)
        if step == 2 and ctx.rank == 1:
            inputs[0, 0] = float("inf")  # one overflowing sample, on one rank only
        before = model.weight.detach().clone()
        # no_sync must cover the forward too: DDP decides there whether this backward all-reduces.
        with ddp_model.no_sync() if step == 2 and not sync else contextlib.nullcontext():
            with torch.autocast(ctx.device.type, dtype=torch.float16):
                loss = ddp_model(inputs.to(ctx.device)).float().square().mean()
            scaler.scale(loss).backward()  # DDP all-reduces the *scaled* gradients (unless no_sync)
        gradients_finite = all(torch.isfinite(p.grad).all().item() for p in model.parameters())
        scaler.step(optimizer)  # unscale_, then skip the step if any gradient is inf or NaN
        scaler.update()  # halve the scale after a skipped step
        optimizer.zero_grad()
        records.append({"step": step, "loss_finite": bool(torch.isfinite(loss).item()), "gradients_finite": gradients_finite,
                        "stepped": not torch.equal(before, model.weight.detach()), "scale": scaler.get_scale(),
                        "weights": model.weight.detach().cpu().flatten().tolist()})  # fmt: skip
    return records


def gradscaler_part(ctx, args) -> dict:
    """GradScaler in a real DDP job: an inf on one rank reaches every rank's gradients through the
    all-reduce, so every rank's unscale_ finds it and every rank skips the same step. Under no_sync
    (nothing all-reduced) only the overflowing rank skips, and the replicas part ways."""
    result = {"init_scale": SCALER_INIT}
    for mode, sync in (("ddp", True), ("no_sync", False)):
        every_rank = [None] * ctx.world_size
        dist.all_gather_object(every_rank, scaler_steps(ctx, sync))
        result[mode] = every_rank  # [rank][step] records; main() collects the DDP models after the part
    return result


def parse_args(argv=None):
    parser = CourseArgumentParser(prog="perf_ddp_job.py", description="Lectures 5a and 5b's DDP measurements.")
    parser.add_argument("--out-dir", required=True, help="perf.json and traces/ go here")
    parser.add_argument("--parts", type=name_list, default=list(PARTS), help=f"any of {','.join(PARTS)}")
    parser.add_argument("--hooks", type=name_list, default=list(HOOKS), help=f"any of {','.join(HOOKS)}")
    parser.add_argument("--hook-steps", type=positive_int, default=12, help="training steps per hook (the last one is counted)")
    parser.add_argument("--powersgd-rank", type=positive_int, default=1, help="PowerSGD's matrix_approximation_rank")
    parser.add_argument("--profile-steps", type=positive_int, default=3, help="steps traced by the profiler")
    parser.add_argument("--bucket-caps", type=lab5.bucket_cap_list, default=lab5.bucket_cap_list("default,1,25,100"))
    parser.add_argument("--bucket-config", choices=lab5.CONFIGS, default="comm_bound", help="lab 5 config for --parts buckets")
    parser.add_argument("--bucket-batch", type=positive_int, help="per-rank batch for --parts buckets (default: the config's)")
    parser.add_argument("--timing-steps", type=positive_int, default=3, help="lab 5's --steps for the timed parts")
    parser.add_argument("--timing-repeats", type=positive_int, default=1, help="lab 5's --repeats for the timed parts")
    parser.add_argument("--accumulation-steps", type=positive_int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    parser.add_argument("--timeout-s", type=positive_float, default=120.0)
    args = parser.parse_args(argv)
    for option, chosen, known in (("--parts", args.parts, PARTS), ("--hooks", args.hooks, HOOKS)):
        if set(chosen) - set(known):
            parser.error(f"{option}: unknown {', '.join(sorted(set(chosen) - set(known)))}; choose from {', '.join(known)}")
    if args.hook_steps <= POWERSGD_START:
        parser.error(f"--hook-steps must exceed {POWERSGD_START}: PowerSGD compresses only from step {POWERSGD_START}")
    return args


def main(args) -> int:
    run_part = {"profile": profile_part, "hooks": hooks_part, "buckets": buckets_part,
                "accumulation": accumulation_part, "zero": zero_part, "gradscaler": gradscaler_part}  # fmt: skip
    try:
        ctx = setup_distributed(args.backend, timeout_s=args.timeout_s)
        log(f"perf_ddp_job: world_size={ctx.world_size} backend={ctx.backend} device={ctx.device.type} parts={','.join(args.parts)}")
        results = {"world_size": ctx.world_size, "backend": ctx.backend, "torch": torch.__version__}
        for part in args.parts:
            started = time.perf_counter()
            results[part] = run_part[part](ctx, args)  # plain numbers: the part's DDP models are out of reach
            gc.collect()
            log(f"part {part} done in {time.perf_counter() - started:.1f} s")
        if ctx.is_main:
            atomic_write_json(results, Path(args.out_dir) / "perf.json")
        return 0
    except CourseError as error:
        log_error(str(error))
        return 1
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_args()))
