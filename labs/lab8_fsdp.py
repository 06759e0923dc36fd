"""Lab 8: sharded data parallelism - DDP, ZeRO-1, ZeRO-2 and FSDP (yours and torch's), checked, weighed and timed.

labs/minifsdp.py is the exercise (solutions/minifsdp.py the finished version): FSDP written from scratch,
every rank keeping 1/N of each weight matrix. This script runs lab 6's character transformer under
  ddp          torch's DistributedDataParallel: everything replicated, gradients all-reduced
  zero1        torch DDP + lab 6's ShardedOptimizer (solutions/minddp.py): Adam's state sharded,
               each updated parameter broadcast from the rank that owns it
  zero2        ZeRO-2 without DDP (labs/minizero2.py, complete: read it): full weights, gradients
               reduce-scattered bucket by bucket during backward, 1/N of the gradients and of Adam's state
               kept, the updated slices all-gathered
  fsdp         your FSDP from scratch (--module labs, the default) or ours (--module solutions)
  fully_shard  torch's FSDP2 (torch.distributed.fsdp.fully_shard) on a DeviceMesh of the job's ranks
  fully_shard_keep  the same with reshard_after_forward=False: each block's weights kept from its forward
               to its backward (SHARD_GRAD_OP): ZeRO-2's bytes per step, 1/N of the weights between steps
and for each one
  1. CHECKS: after --check-steps SGD steps on disjoint shards, the full weights must equal those of ONE
     process training on the whole global batch, within 64 x steps x float32 eps x max|w| (lab 6's bound:
     another summation order changes a sum by about eps relative per operation; the margin is about 100x
     the differences seen and far below the unsynchronised control, which must differ);
  2. WEIGHS the model state each rank keeps between steps with AdamW (parameters, gradients, optimizer
     state: bytes of the tensors' storages, ddp_course.sharding), on the fullest rank, and the weights it
     holds at the fullest moment of a step (its own plus any gathered full weights, sampled at every
     module's entry and exit and before every module's backward); on GPUs also torch.cuda's peak;
  3. COUNTS the bytes one step communicates (every collective recorded with its payload, turned into
     bytes each rank sends by lecture 2's ring costs) against the formula (lecture 7), and the messages;
  4. JUDGES: an implementation PASSes when its weights equal one process's (1.) and its bytes per step
     are within 5 % of the formula (3.); the from-scratch FSDP must also hold full weights only around
     their use: none left after forward, and never more than the unit that holds the tied embedding (the
     root's) plus the largest other unit at once. A FAIL line says which concept failed; exit status 1;
  5. TIMES an AdamW step: warm-up, repeats interleaved across implementations, the slowest rank's time,
     the median over repeats.

From the repository root:
    your FSDP, part by part:     torchrun --standalone --nproc_per_node=2 labs/lab8_fsdp.py --part 1   (then 2, then 3)
    your FSDP, 2 CPU processes:  torchrun --standalone --nproc_per_node=2 labs/lab8_fsdp.py --impl fsdp
    everything, ours:            torchrun --standalone --nproc_per_node=2 labs/lab8_fsdp.py --module solutions --impl all
    memory at 4 ranks:           torchrun --standalone --nproc_per_node=4 labs/lab8_fsdp.py --module solutions --repeats 1
    records:                     ... --json runs/lab8.json
    N GPUs (NCCL; written with care, NOT YET RUN on a GPU):
                                 torchrun --standalone --nproc_per_node=N labs/lab8_fsdp.py --module solutions

Sharding needs 2 or more ranks: on one process (plain python, or a machine with one GPU) the lab refuses
with one line and exit status 1 - one rank would shard nothing and send nothing.

What you should see: with labs/minifsdp.py untouched and --impl fsdp, one line naming the first TODO
and exit status 1. With --module solutions on 2 CPU ranks every implementation PASSes, FSDP keeps about
half of DDP's bytes per rank between steps (a quarter at 4 ranks) and at most the root's and one block's
full weights more during a step, communicates 1.5x DDP's bytes, and every byte count (a ring-cost count of the collectives each rank
called: a count, not a measurement of the wire) is within a few per cent of the formula (solutions/lab8_reference/).
"""

import argparse
import functools
import statistics
import sys
from pathlib import Path

import torch

import minizero2  # labs/minizero2.py, beside this script: ZeRO-2 from scratch, complete code to read
from ddp_course.char_lm_job import (  # the job labs 6, 8 and 9 share: model, batch, verdicts, timing
    CONTEXT,
    EPS_PER_STEP,
    global_batch,
    job_max,
    load_learner_module,
    median_ratio,
    my_rows,
    new_model,
    seconds_per_step,
)
from ddp_course.checkpoint import atomic_write_json
from ddp_course.cli import CourseArgumentParser, CourseError, non_negative_int, positive_float, positive_int
from ddp_course.data import encode_text, load_stdlib_text, text_splits
from ddp_course.distributed import BACKENDS, log, log_error, setup_distributed, teardown_distributed
from ddp_course.reporting import format_table
from ddp_course.sharded_training import (  # the harness labs 8 and 9 share: each implementation built, stepped, checked alike
    ADAMW_LR,
    BATCH_SIZE,
    BYTES_TOLERANCE,
    CASE_TIMEOUT_S,
    CHECK_STEPS,
    IMPLS,
    Trained,
    check,
    gathered_now,
    kept,
    make_optimizer,
)
from ddp_course.sharding import StepWatch, count_collectives, cuda_peak, model_state_bytes, predicted_bytes_per_step, storage_bytes

REPO_ROOT = Path(__file__).resolve().parent.parent
# The bytes-per-step formula each follows: fully_shard_keep all-gathers once and reduce-scatters, as ZeRO-2.
STAGE = {"ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "fsdp": "fsdp", "fully_shard": "fsdp", "fully_shard_keep": "zero2"}
MIB = 2**20


def parse_args(argv=None):
    parser = CourseArgumentParser(prog="lab8_fsdp.py", description="Check, weigh and time DDP, ZeRO-1 and FSDP.")
    parser.add_argument("--impl", action="append", choices=IMPLS + ("all",), help="implementation(s); repeat the flag, or 'all' (default)")
    parser.add_argument(
        "--module", choices=("labs", "solutions"), default="labs", help="the FSDP of --impl fsdp: labs (your labs/minifsdp.py) or solutions (the finished one)"
    )
    parser.add_argument(
        "--part", type=int, choices=(1, 2, 3), help="check --module's minifsdp.py, parts 1 to PART only (3: the whole check of --impl fsdp), and stop"
    )
    parser.add_argument(
        "--fsdp-units",
        choices=("blocks", "matrices"),
        default="blocks",
        help="what --impl fsdp sends in one message: each block's weights (as fully_shard) or each matrix",
    )
    parser.add_argument("--batch-size", type=positive_int, default=BATCH_SIZE, help=f"windows of {CONTEXT} characters per rank")
    parser.add_argument("--check-steps", type=positive_int, default=CHECK_STEPS, help="SGD steps of the correctness check")
    parser.add_argument("--warmup-steps", type=positive_int, default=2, help="untimed AdamW steps first")
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps per repeat")
    parser.add_argument("--repeats", type=non_negative_int, default=5, help="timing rounds, interleaved across impls (0: no timing)")
    parser.add_argument("--seed", type=int, default=0, help="model initialization and batches")
    parser.add_argument("--json", help="write one record per implementation here")
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    parser.add_argument("--timeout-s", type=positive_float, default=120.0, help="process-group timeout, seconds")
    parser.add_argument(
        "--case-timeout-s", type=positive_float, default=CASE_TIMEOUT_S, help="a check still running after this many seconds is a hang: FAIL, and the job ends"
    )
    args = parser.parse_args(argv)
    chosen = args.impl or ["all"]
    args.impls = list(IMPLS) if "all" in chosen else [impl for impl in IMPLS if impl in chosen]
    if args.json and Path(args.json).is_dir():
        parser.error(f"--json {args.json} is a folder; give a file name")
    return args


def load_minifsdp(module: str):
    """labs/minifsdp.py (the exercise) or solutions/minifsdp.py (the finished version)."""
    return load_learner_module(module, "minifsdp", root=REPO_ROOT)


def measure(args, ctx, tokens, modules) -> tuple[dict, dict]:
    """AdamW: per implementation the fullest rank's model state between steps, the weights it holds at the
    fullest moment of a step, and one step's communication; then the step times, {impl: [seconds per step,
    one per repeat]}, the order rotating each repeat."""
    inputs, targets = (my_rows(t, ctx) for t in global_batch(tokens, torch.Generator().manual_seed(args.seed), args, ctx))
    adamw = functools.partial(make_optimizer, optimizer_cls=torch.optim.AdamW, lr=ADAMW_LR)
    trained, measured = {}, {}
    for impl in args.impls:
        with cuda_peak(ctx.device) as cuda:
            trained[impl] = Trained(impl, args, ctx, modules, adamw(impl, modules))
            for _ in range(args.warmup_steps):  # first steps build state (Adam's moments, DDP's buckets, lazy init)
                trained[impl].step(inputs, targets)
            watch = weights_watch(trained[impl])
            with count_collectives(*modules.values()) as counter, watch.during(trained[impl].model, trained[impl].wrapped):
                trained[impl].step(inputs, targets)
        state = model_state_bytes(kept(trained[impl]), trained[impl].optimizer)
        peaks = {"weights_peak_bytes": watch.peak(), "gathered_peak_bytes": watch.peak("gathered"),
                 "gathered_after_forward_bytes": watch.at("after forward")["gathered"]}  # fmt: skip
        measured[impl] = {
            "model_state_bytes": {kind: int(job_max(value, ctx)) for kind, value in state.items()},
            **{key: int(job_max(value, ctx)) for key, value in peaks.items()},
            # GPU track (NOT YET RUN on a GPU): the allocator's peak over building, warm-up and the measured step
            "cuda_peak_allocated_bytes": None if cuda["bytes"] is None else int(job_max(cuda["bytes"], ctx)),
            "collective_bytes_by_kind": counter.bytes_by_kind(),
            "messages_per_step": len(counter.calls),  # each pays the fixed latency alpha, whatever its size
            "ring_model_bytes_per_step": counter.ring_model_bytes_per_rank(ctx.world_size),
            "bytes_per_step_predicted": predicted(impl, new_model(args, ctx), ctx.world_size),
        }
    times = {impl: [] for impl in args.impls}
    for repeat in range(args.repeats):
        shift = repeat % len(args.impls)
        for impl in args.impls[shift:] + args.impls[:shift]:
            times[impl].append(seconds_per_step(lambda t=trained[impl]: t.step(inputs, targets), args.steps, ctx))
    return measured, times


def weights_watch(trained: Trained) -> StepWatch:
    """The weights a rank keeps between steps, and those gathered around their use."""
    own = kept(trained)
    return StepWatch({"weights": lambda: own, "gathered": lambda: gathered_now(trained)})


def gathered_bound(bare_model, args, world_size: int) -> int:
    """The most full weights our FSDP may hold at once (float32, rows padded to a multiple of world_size):
    the unit holding the tied embedding, gathered from the head's backward until the embedding's
    gradient is complete, plus the largest other unit (one at a time: gathered, used, freed)."""

    def full_bytes(params):
        return sum(minifsdp_rows(p.shape[0], world_size) * p[0].numel() * 4 for p in params if p.dim() >= 2)

    if args.fsdp_units == "blocks":
        in_blocks = {id(p) for p in bare_model.blocks.parameters()}
        units = [[p for p in bare_model.parameters() if id(p) not in in_blocks]] + [list(b.parameters()) for b in bare_model.blocks]
    else:
        units = [list(m.parameters(recurse=False)) for m in bare_model.modules() if any(p.dim() >= 2 for p in m.parameters(recurse=False))]
    tied = next(u for u in units if any(p is bare_model.token_embedding.weight for p in u))
    return full_bytes(tied) + max(full_bytes(u) for u in units if u is not tied)


def minifsdp_rows(rows: int, world_size: int) -> int:
    return -(-rows // world_size) * world_size  # dimension 0 padded to a multiple of world_size


def predicted(impl: str, bare_model, world_size: int) -> float:
    """The formula's bytes per step for impl. Our FSDP shards the parameters of 2+ dimensions and
    all-reduces the 1-D ones; fully_shard shards every parameter; DDP and ZeRO-1 replicate all."""
    parameters = list(bare_model.parameters())  # model.parameters() lists the tied embedding once
    matrices = storage_bytes(p for p in parameters if p.dim() >= 2)
    vectors = storage_bytes(p for p in parameters if p.dim() < 2)
    if impl == "fsdp":
        return predicted_bytes_per_step("fsdp", matrices, vectors, world_size)
    return predicted_bytes_per_step(STAGE[impl], matrices + vectors, 0, world_size)


def modules_for(impls, module: str = "solutions") -> dict:
    """The from-scratch code the implementations need: lab 6's ShardedOptimizer, ZeRO-2, an FSDP."""
    modules = {"minddp": load_learner_module("solutions", "minddp", root=REPO_ROOT)} if "zero1" in impls else {}
    if "zero2" in impls:
        modules["minizero2"] = minizero2
    if "fsdp" in impls:
        modules["minifsdp"] = load_minifsdp(module)
    return modules


def run(args, ctx) -> tuple[list[dict], bool]:
    modules = modules_for(args.impls, args.module)
    tokens, _ = text_splits(encode_text(load_stdlib_text()))
    log(
        f"config: impls={','.join(args.impls)} module={args.module} world_size={ctx.world_size} backend={ctx.backend} "
        f"device={ctx.device.type} batch={args.batch_size}x{CONTEXT} characters/rank"
    )
    checked = check(args, ctx, tokens, modules)
    control_differs = checked["no sync"]["verdict"] == "differs (control)"
    measured, times = measure(args, ctx, tokens, modules)
    median = {impl: statistics.median(t) for impl, t in times.items() if t}
    ddp_total = measured.get("ddp", {}).get("model_state_bytes", {}).get("total")
    bound = gathered_bound(new_model(args, ctx), args, ctx.world_size)
    records = [{
        "impl": impl, "module": args.module if impl == "fsdp" else ("solutions" if impl == "zero1" else "torch"),
        "fsdp_units": args.fsdp_units if impl == "fsdp" else None,
        "world_size": ctx.world_size, "backend": ctx.backend, "device": ctx.device.type,
        "batch_size_per_rank": args.batch_size, "check_steps": args.check_steps,
        **{k: v for k, v in checked[impl].items() if k != "verdict"}, "check_passed": checked[impl]["verdict"] == "PASS",
        **measured[impl], "gathered_bound_bytes": bound if impl == "fsdp" else None,
        "bytes_vs_formula": ratio(measured[impl]["ring_model_bytes_per_step"], measured[impl]["bytes_per_step_predicted"]),
        "state_vs_ddp": measured[impl]["model_state_bytes"]["total"] / ddp_total if ddp_total else None,
        "step_time_s": median.get(impl), "step_times_s": times.get(impl, []),
        "vs_fully_shard": median_ratio(times, impl, "fully_shard"),
    } for impl in args.impls]  # fmt: skip
    for record in records:
        record["failures"] = failures(record)
        record["passed"] = not record["failures"]
    report(records, args)
    return records, control_differs and all(record["passed"] for record in records)


def failures(record: dict) -> list[str]:
    """What an implementation got wrong, one concept per line (empty: PASS)."""
    found = []
    if not record["check_passed"]:
        found.append(
            f"weights differ from one process's by {record['max_abs_diff_vs_single_process']:.1e} > {record['tolerance']:.1e}: "
            "the gradients are not the average over ranks of the whole model's"
        )
    if abs(record["bytes_vs_formula"] - 1) > BYTES_TOLERANCE:
        found.append(
            f"sends {record['bytes_vs_formula']:.3f}x the formula's bytes per step (allowed 1 +- {BYTES_TOLERANCE}): "
            "a collective is missing, repeated or too large (lecture 7, section 2)"
        )
    if record["impl"] == "fsdp" and record["gathered_after_forward_bytes"] > 0:
        found.append(
            f"{record['gathered_after_forward_bytes'] / MIB:.2f} MiB of full weights still gathered after forward: "
            "each unit must free its full weights when its forward ends (part 2)"
        )
    if record["impl"] == "fsdp" and record["gathered_peak_bytes"] > record["gathered_bound_bytes"]:
        found.append(
            f"{record['gathered_peak_bytes'] / MIB:.2f} MiB of full weights gathered at once, more than the root's "
            f"and one other unit's {record['gathered_bound_bytes'] / MIB:.2f} MiB: full weights must exist only around their use"
        )
    return found


def ratio(counted: float, predicted: float) -> float | None:
    """counted / predicted; None where the formula predicts 0 bytes."""
    return counted / predicted if predicted else None


def report(records: list[dict], args) -> None:
    short = {"parameters": "params_MiB", "gradients": "grads_MiB", "optimizer_state": "adam_MiB", "total": "total_MiB"}
    rows = [{"impl": r["impl"], **{short[k]: v / MIB for k, v in r["model_state_bytes"].items()},
             "vs_ddp": r["state_vs_ddp"], "weights_peak_MiB": r["weights_peak_bytes"] / MIB,
             "ring_model_MiB": r["ring_model_bytes_per_step"] / MIB, "formula_MiB": r["bytes_per_step_predicted"] / MIB,
             "ratio": r["bytes_vs_formula"], "messages": r["messages_per_step"]} for r in records]  # fmt: skip
    log("model state on the fullest rank between steps (AdamW), the weights it holds at the step's fullest moment,")
    log("bytes each rank sends per step (ring costs) and collectives per step:")
    log(format_table(rows, list(rows[0])))
    for r in records:
        log(f"verdict {r['impl']:<16} {'PASS' if r['passed'] else 'FAIL'}" + "".join(f"\n  FAIL: {line}" for line in r["failures"]))
    if args.repeats:
        log(f"step time (AdamW): median of {args.repeats} repeats of {args.steps} steps, slowest rank")
        table = [{"impl": r["impl"], "step_time_ms": 1000 * r["step_time_s"], "vs_fully_shard": r["vs_fully_shard"]} for r in records]
        log(format_table(table, ["impl", "step_time_ms", "vs_fully_shard"]))


def check_parts(args, ctx) -> bool:
    """--part K: the from-scratch FSDP's parts 1 to K, on this lab's model and units, one line per check."""
    minifsdp, passed = load_minifsdp(args.module), []

    def verdict(part: int, name: str, ok: bool, detail: str) -> None:
        ok = bool(job_max(0.0 if ok else 1.0, ctx) == 0)  # a check passes when it passes on every rank
        passed.append(ok)
        log(f"part {part}  {'PASS' if ok else 'FAIL'}  {name}: {detail}")

    full = torch.arange(13 * 2, dtype=torch.float32).view(13, 2)
    slices = [minifsdp.shard_rows(full, rank, 4) for rank in range(4)]
    verdict(1, "shard_rows", all(s.shape == (4, 2) and s.dtype == torch.float32 for s in slices)
            and torch.equal(torch.cat(slices)[:13], full) and not torch.cat(slices)[13:].any(),
            "13 rows over 4 ranks: slices of 4 rows, in rank order, the 3 rows past the end zero")  # fmt: skip
    model = new_model(args, ctx)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    wrapped = minifsdp.FSDP(model, units=list(model.blocks))
    after = wrapped.gather_full_params()
    verdict(
        1,
        "gather_full_params",
        after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before),
        "every weight whole again, equal to the model's before sharding",
    )
    if args.part >= 2:  # forward only (no graph: nothing of part 3 runs), against the unsharded model
        tokens, _ = text_splits(encode_text(load_stdlib_text()))
        inputs = my_rows(global_batch(tokens, torch.Generator().manual_seed(args.seed), args, ctx)[0], ctx)
        watch = StepWatch({"gathered": lambda: [handle.full for handle in wrapped.sharded.values()]})  # noqa: F821 (called before the del below)
        with torch.no_grad(), watch.during(model, wrapped):
            logits, expected = wrapped(inputs), new_model(args, ctx)(inputs)
        tolerance = EPS_PER_STEP * torch.finfo(torch.float32).eps * float(expected.abs().max())
        difference = float((logits - expected).abs().max())
        verdict(2, "forward", difference <= tolerance, f"logits equal the unsharded model's: max difference {difference:.1e} <= {tolerance:.1e}")
        bound, slices_shown = (
            gathered_bound(new_model(args, ctx), args, ctx.world_size),
            all(getattr(m, name) is p for m in model.modules() for name, p in m.named_parameters(recurse=False)),
        )
        verdict(2, "full weights only around their use", watch.at("after forward")["gathered"] == 0 and watch.peak() <= bound and slices_shown,
                f"after forward {watch.at('after forward')['gathered']:,} B gathered, modules show their slices again: {slices_shown}; "
                f"at most {watch.peak():,} B at once (root unit + one block: {bound:,} B)")  # fmt: skip
    del wrapped, model
    if args.part >= 3:
        records, ok = run(argparse.Namespace(**{**vars(args), "impls": ["fsdp"], "repeats": 0}), ctx)
        verdict(3, "the lab's whole check of --impl fsdp", ok, "weights equal one process's, bytes and gathering as the lines above say")
    return all(passed)


def judge(args, ctx) -> int:
    """Run everything in the job's process group; print the verdicts; return the exit status (0: every PASS)."""
    try:
        if ctx.world_size < 2:
            raise CourseError(
                f"lab 8 needs 2 or more ranks (one rank shards nothing and sends nothing): torchrun "
                f"--standalone --nproc_per_node=2 labs/lab8_fsdp.py, or 2+ GPUs; this job has {ctx.world_size}"
            )
        if args.part:
            if not check_parts(args, ctx):
                raise CourseError(f"--part {args.part} FAILED: see the FAIL lines above")
            return 0
        records, passed = run(args, ctx)  # plain numbers: every wrapper is out of reach now
        if args.json and ctx.is_main:
            atomic_write_json(records, args.json)
        if not passed:
            raise CourseError("the check FAILED: see the FAIL lines above")
        return 0
    except NotImplementedError as error:  # the exercise's TODOs: every rank reaches the same one
        log_error(f"{args.module}/minifsdp.py is not finished: {error}")
        return 1
    except CourseError as error:
        log_error(str(error))
        return 1


def main(args) -> int:
    try:
        ctx = setup_distributed(args.backend, timeout_s=args.timeout_s)
        return judge(args, ctx)
    except CourseError as error:  # e.g. --backend nccl without a GPU
        log_error(str(error))
        return 1
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_args()))
