"""Lab 8's checks: DDP, ZeRO-1, ZeRO-2, a learner's FSDP and torch's fully_shard, checked, weighed, counted and timed.

The learner types `torchrun --standalone --nproc_per_node=2 labs/lab8_fsdp.py --part K` (or `--impl ...`):
that script (its flags, the launch lines, which from-scratch code to load) is the front end, and the judging
lives here, as the other checkers' does. The implementations themselves are built and stepped by
ddp_course/sharded_training.py, which lab 9 shares; the from-scratch code (lab 6's ShardedOptimizer,
labs/minizero2.py, the learner's minifsdp.py) comes in from the script as `modules`, because the package
never imports a script.

    run(args, ctx, modules)              every implementation checked against one process, its state weighed,
                                         its bytes per step counted against the formula, timed; the verdicts
    check_parts(args, ctx, minifsdp)     --part K: the from-scratch FSDP's parts 1 to K, one line per check
    predicted(impl, model, world_size)   the formula's bytes per step (the lab sheet prints it too)
    gathered_bound(model, args, n)       the most full weights the from-scratch FSDP may hold at once
    failures(record)                     what an implementation got wrong, one concept per line
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from ddp_course.char_lm_job import CONTEXT, EPS_PER_STEP, global_batch, job_max, median_ratio, my_rows, new_model, seconds_per_step
from ddp_course.checking.verdict import Verdict
from ddp_course.data import encode_text, load_stdlib_text, text_splits
from ddp_course.distributed import log
from ddp_course.reporting import format_table
from ddp_course.sharded_training import (  # the harness labs 8 and 9 share: each implementation built, stepped, checked alike
    ADAMW_LR,
    BYTES_TOLERANCE,
    IMPLS,  # noqa: F401 (the lab sheet reads it here, beside predicted)
    Trained,
    check,
    gathered_now,
    kept,
    make_optimizer,
)
from ddp_course.sharding import StepWatch, count_collectives, cuda_peak, model_state_bytes, predicted_bytes_per_step, storage_bytes

# The bytes-per-step formula each follows: fully_shard_keep all-gathers once and reduce-scatters, as ZeRO-2.
STAGE = {"ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "fsdp": "fsdp", "fully_shard": "fsdp", "fully_shard_keep": "zero2"}
MIB = 2**20


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


def run(args, ctx, modules: dict) -> tuple[list[dict], bool]:
    """Check, weigh, count and time every implementation of args.impls; print the table and the verdicts.
    modules: the from-scratch code they need ({"minddp", "minizero2", "minifsdp"} -> module, as the lab loads
    them). Returns the records and whether every implementation PASSed and the control differed."""
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


def part_line(verdict: Verdict) -> str:
    """One --part line, "part N  PASS|FAIL  name: detail" (ddp_course/grade.py reads them)."""
    return f"part {verdict.number}  {verdict.status}  {verdict.check}: {verdict.evidence}"


def check_parts(args, ctx, minifsdp) -> bool:
    """--part K: the from-scratch FSDP's parts 1 to K (minifsdp: the learner's module, as the lab loads it), on
    this lab's model and units, one line per check."""
    verdicts = []

    def verdict(part: int, name: str, ok: bool, detail: str) -> None:
        ok = bool(job_max(0.0 if ok else 1.0, ctx) == 0)  # a check passes when it passes on every rank
        verdicts.append(Verdict(name, "PASS" if ok else "FAIL", detail, number=part))
        log(part_line(verdicts[-1]))

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
        records, ok = run(argparse.Namespace(**{**vars(args), "impls": ["fsdp"], "repeats": 0}), ctx, {"minifsdp": minifsdp})
        verdict(3, "the lab's whole check of --impl fsdp", ok, "weights equal one process's, bytes and gathering as the lines above say")
    return all(v.passed for v in verdicts)
