"""What lab 9's six demos share, and how each demo's claim is judged.

labs/lab9_fsdp_practice.py shows, part by part, what practitioners meet after writing FSDP: memory over a
whole step, a model no rank builds whole, activation checkpointing, clipping across shards, HSDP and a
training state resumed on other ranks. The script keeps each technique (the meta-device build, the
checkpointed block, the fixed clip, the 2-D mesh, the DCP save and load); the plumbing they share and the
verdicts - one PASS or FAIL line per claim, and the facts the --json report holds - live here. The memory
part's accounting is ddp_course/sharded_training.py and ddp_course/sharding.py.

    windows_per_step(n), global_batch(...), local_batch(...)   the parts' batches: equal shares at any world size;
                                              lab8_batch(...) the rows of lab 8's first batch
    world_mesh(ctx), sharded_model(...), full_weights(model), full_weights_equal(a, b)
                                              fully_shard on lab 6's transformer, and its weights read back whole
    shared_directory(...), remove_if_temporary(...)   a checkpoint folder every rank agrees on, and its removal
    one_process(args, ctx, tokens, steps)     the reference the parts compare with: SGD on the whole batch
    train_steps(args, ctx, tokens, model, optimizer, steps)   SGD on this rank's share of those batches
    weigh_sgd_step(model, inputs, targets, ctx)   one step's allocator peak, saved activations, all-gathers
    judge_memory, judge_checkpointing, judge_clipping, judge_hsdp, judge_resume   each part's verdict
    judge_parts(args, ctx, runners, four_rank_parts)   the job: every part asked for, the --json report, the exit status
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ddp_course import char_lm_job  # the job labs 6, 8 and 9 share: model, batch, verdicts, timing
from ddp_course import sharded_training as impls  # lab 8's implementations, built, checked and weighed alike
from ddp_course.checkpoint import atomic_write_json
from ddp_course.cli import CourseError
from ddp_course.data import encode_text, load_stdlib_text, sample_windows, text_splits
from ddp_course.distributed import log, log_error
from ddp_course.sharding import SavedActivations, allocations, count_collectives, storage_bytes

MIB = 2**20
# Windows per step in the meta, clip, hsdp and resume parts: 8, or the next multiple of the world size, so
# that every rank gets the same number of whole windows (4 each on 2 ranks, 2 on 4, 3 on 3, 1 on 9 or more)
# and the average of the ranks' means is the global batch's mean, at any world size.
SMALLEST_GLOBAL_BATCH = 8


# --- the parts' batches ----------------------------------------------------------------------------------


def windows_per_step(world_size: int) -> int:
    """The global batch of the meta, clip, hsdp and resume parts: the smallest multiple of world_size that
    is at least SMALLEST_GLOBAL_BATCH (so any subgroup whose size divides world_size splits it evenly too)."""
    return world_size * -(-SMALLEST_GLOBAL_BATCH // world_size)


def global_batch(args, ctx, tokens, step: int):
    """Step `step`'s global batch, the same on every rank (its size depends on the job's world size only)."""
    windows = sample_windows(tokens, windows_per_step(ctx.world_size), char_lm_job.CONTEXT, torch.Generator().manual_seed(args.seed + step))
    return tuple(t.to(ctx.device) for t in windows)


def local_batch(args, ctx, tokens, step: int, group=None):
    """This rank's equal share of step `step`'s global batch, among the ranks of the job or of `group` (whose
    size divides the job's: the resume part's pair on an even world size)."""
    ranks = dist.get_world_size(group) if group is not None else ctx.world_size
    rank = dist.get_rank(group) if group is not None else ctx.rank
    windows = global_batch(args, ctx, tokens, step)
    per_rank = len(windows[0]) // ranks
    if per_rank * ranks != len(windows[0]):  # a programming error, not the user's: the parts pick their groups
        raise CourseError(f"a global batch of {len(windows[0])} windows does not split evenly over {ranks} ranks")
    return tuple(t[rank * per_rank : (rank + 1) * per_rank] for t in windows)


def lab8_batch(args, ctx, tokens):
    """This rank's rows of lab 8's first global batch (its defaults: 4 windows per rank), as lab 8 weighs a step."""
    batch = char_lm_job.global_batch(tokens, torch.Generator().manual_seed(args.seed), impls.job_args(args.seed), ctx)
    return tuple(char_lm_job.my_rows(t, ctx) for t in batch)


# --- fully_shard on lab 6's transformer ------------------------------------------------------------------


def world_mesh(ctx, group=None):
    """A 1-D DeviceMesh of the job's ranks, or of `group`'s."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # imports torch._dynamo: seconds, so only here

    return init_device_mesh(ctx.device.type, (ctx.world_size,)) if group is None else DeviceMesh.from_group(group, ctx.device.type)


def sharded_model(args, ctx, mesh, device=None, wrap_block=None, seed_offset: int = 0):
    """Lab 6's transformer under fully_shard (a unit per block, the root last), built on `device` (default:
    the job's device; "meta": nothing allocated); the weights of lab 6's new_model (seed_offset: others).
    wrap_block(block) may wrap each block first."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(args.seed + seed_offset)
    with torch.device(device or ctx.device):
        model = char_lm_job.CharTransformer(char_lm_job.TEXT_VOCAB_SIZE, **char_lm_job.MODEL_SHAPE)
    for index, block in enumerate(model.blocks):
        model.blocks[index] = wrap_block(block) if wrap_block else block
        fully_shard(model.blocks[index], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def full_weights(model) -> torch.Tensor:
    """A fully_shard model's every parameter, whole (each DTensor all-gathered), flattened."""
    return torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()])


def full_weights_equal(first, second) -> bool:
    """Two fully_shard models' weights, compared parameter by parameter (one full tensor at a time)."""
    return all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(first.parameters(), second.parameters()))


# --- a checkpoint folder every rank agrees on --------------------------------------------------------------


def shared_directory(args, ctx, name: str) -> str:
    """A folder every rank agrees on: --checkpoint-dir/name, or a temporary one (rank 0 makes it and says
    where: one host, one file system; several nodes need --checkpoint-dir on a shared file system)."""
    import tempfile

    if args.checkpoint_dir:
        path = [str(Path(args.checkpoint_dir) / name)]
    else:  # rank 0 alone creates it, so that remove_if_temporary leaves nothing behind
        path = [tempfile.mkdtemp(prefix=f"lab9_{name}_") if ctx.is_main else None]
    dist.broadcast_object_list(path, src=0, device=ctx.device)
    return path[0]


def remove_if_temporary(args, ctx, directory: str) -> None:
    """After every rank is done with it, rank 0 removes a temporary checkpoint folder (not --checkpoint-dir's)."""
    import shutil

    dist.barrier()
    if ctx.is_main and not args.checkpoint_dir:
        shutil.rmtree(directory, ignore_errors=True)


# --- the reference ----------------------------------------------------------------------------------------


def one_process(args, ctx, tokens, steps: int, max_norm: float | None = None) -> tuple[torch.Tensor, list[float]]:
    """The reference: one process, SGD on each step's whole global batch (clipped to max_norm if given);
    every parameter flattened, and the gradient norm of each step."""
    model = char_lm_job.new_model(args, ctx)
    optimizer, norms = torch.optim.SGD(model.parameters(), lr=char_lm_job.CHECK_LR), []
    for step in range(steps):
        inputs, targets = global_batch(args, ctx, tokens, step)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]), norms


def train_steps(args, ctx, tokens, model, optimizer, steps, group=None) -> None:
    """SGD steps `steps` (their numbers pick the batches) on this rank's share, among the ranks of `group`."""
    for step in steps:
        inputs, targets = local_batch(args, ctx, tokens, step, group)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
        optimizer.step()


def tolerance(reference: torch.Tensor, steps: int) -> float:
    """Lab 6's bound for two correct runs of `steps` steps: EPS_PER_STEP x steps x float32 eps x max|w|."""
    return char_lm_job.EPS_PER_STEP * steps * torch.finfo(torch.float32).eps * float(reference.abs().max())


def weigh_sgd_step(model, inputs, targets, ctx) -> dict:
    """One SGD step of a fully_shard model, after a warm-up step (fully_shard's lazy initialisation): the
    fullest rank's allocator peak, the bytes autograd saved for backward by the end of forward, the
    all-gathers, and the bytes the step's collectives carried at ring costs."""
    optimizer = torch.optim.SGD(model.parameters(), lr=char_lm_job.CHECK_LR)

    def step():
        optimizer.zero_grad()
        with saved:
            loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        after_forward.append(storage_bytes(saved.alive()))
        loss.backward()
        optimizer.step()

    saved, after_forward = SavedActivations(), []
    step()  # warm-up: fully_shard's lazy initialisation
    with count_collectives() as counter, allocations(ctx.device) as allocated:
        step()
    return {"allocator_peak_bytes": int(char_lm_job.job_max(allocated.peak, ctx)),
            "saved_after_forward_bytes": int(char_lm_job.job_max(after_forward[-1], ctx)),
            "all_gathers": sum(kind == "all_gather" for kind, _ in counter.calls),
            "ring_model_bytes": counter.ring_model_bytes_per_rank(ctx.world_size)}  # fmt: skip


# --- each part's verdict ----------------------------------------------------------------------------------


def judge_memory(timelines: dict, sizes: dict, zero2_checked: dict, world_size: int) -> dict:
    """Every implementation's timeline against the peak formula (ddp_course.sharded_training), and ZeRO-2's
    check against one process: the memory part's facts, "passed" among them."""
    labels = timelines["ddp"]["labels"]  # the same phases for every implementation: the same model's modules
    if any(timeline.pop("labels") != labels for timeline in timelines.values()):
        raise CourseError("the implementations' steps went through different phases")
    facts = {"categories": impls.CATEGORIES, "labels": labels, "sizes": sizes, "counted_tolerance": impls.COUNTED_TOLERANCE,
             "measured_tolerance": impls.MEASURED_TOLERANCE, "impls": {}}  # fmt: skip
    for impl, timeline in timelines.items():
        facts["impls"][impl] = impls.judge_peaks(impl, timeline, labels, sizes, world_size)
    facts["zero2_check"] = {key: zero2_checked[key] for key in ("max_abs_diff_vs_single_process", "tolerance")} | {"passed": zero2_checked["verdict"] == "PASS"}
    facts["passed"] = all(impl["passed"] for impl in facts["impls"].values()) and facts["zero2_check"]["passed"]
    return facts


def judge_checkpointing(facts: dict, equal: bool) -> dict:
    """Checkpointing must lower the allocator's peak, keep the all-gathers per step, and change no weight."""
    plain, ac = facts["plain"], facts["checkpointed"]
    passed = ac["allocator_peak_bytes"] < plain["allocator_peak_bytes"] and ac["all_gathers"] == plain["all_gathers"] and equal
    log(
        f"checkpoint  allocator peak {plain['allocator_peak_bytes'] / MIB:.2f} -> {ac['allocator_peak_bytes'] / MIB:.2f} MiB, saved for backward "
        f"{plain['saved_after_forward_bytes'] / MIB:.2f} -> {ac['saved_after_forward_bytes'] / MIB:.2f} MiB, all-gathers per step "
        f"{plain['all_gathers']} -> {ac['all_gathers']}, weights after the step equal: {equal}   {'PASS' if passed else 'FAIL'}"
    )
    return {**facts, "weights_equal": equal, "passed": passed}


def judge_clipping(ctx, reference: torch.Tensor, reference_norms: list[float], max_norm: float, steps: int, runs: dict) -> dict:
    """runs: {how: (full weights, this rank's norm per step, this rank's replicated parameters or None)}. The
    naive clip must differ from one process in every way (per-rank norms, drifting replicas, other weights);
    the others must agree with it in every way. One line per way of clipping."""
    bound = tolerance(reference, steps)
    facts, passed = {"max_norm": max_norm, "reference_norms": reference_norms, "tolerance": bound}, True
    for how, (weights, norms, replicas) in runs.items():
        difference = char_lm_job.job_max(float((weights - reference).abs().max()), ctx)
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, (norms, None if replicas is None else replicas.tolist()))
        norms_agree = all(other[0] == everyone[0][0] for other in everyone)
        replicas_agree = replicas is None or all(other[1] == everyone[0][1] for other in everyone)
        expected = how != "naive"  # the naive clip must differ: per-rank norms, drifting replicas, other weights
        agrees = [difference <= bound, norms_agree, replicas_agree]
        ok = all(agrees) if expected else not any(agrees)
        passed = passed and ok
        facts[how] = {"max_abs_diff_vs_one_process": difference, "first_step_norms_by_rank": [other[0][0] for other in everyone],
                      "norms_agree": norms_agree, "replicated_parameters_agree": replicas_agree, "passed": ok}  # fmt: skip
        log(
            f"clip     {how:<11} first step's norm on each rank {', '.join(f'{other[0][0]:.4f}' for other in everyone)} "
            f"(one process {reference_norms[0]:.4f}); replicated parameters equal on every rank: {replicas_agree}; "
            f"max|w - one process| {difference:.1e} ({'must differ' if not expected else f'<= {bound:.1e}'})   {'PASS' if ok else 'FAIL'}"
        )
    facts["passed"] = passed
    return facts


def judge_hsdp(ctx, mesh, weights: torch.Tensor, reference: torch.Tensor, steps: int, counter, written: dict, parameter_bytes: int) -> dict:
    """HSDP on a (rows x 2) mesh against one process, and the last step's payloads at ring costs per mesh
    dimension against the formula; what gloo really wrote, where it can be read."""
    bound = tolerance(reference, steps)
    difference = char_lm_job.job_max(float((weights - reference).abs().max()), ctx)
    shard_group = tuple(dist.get_process_group_ranks(mesh.get_group("shard")))
    replicate_group = tuple(dist.get_process_group_ranks(mesh.get_group("replicate")))
    by_group = counter.ring_model_bytes_by_group()
    s, g, r = parameter_bytes, 2, ctx.world_size // 2
    # The payloads the step's collectives carried, each priced by the ring costs (sharding.py): the model.
    modelled = {"shard": by_group.get(shard_group, 0.0), "replicate": by_group.get(replicate_group, 0.0)}
    # Within a row: all-gather before forward and before backward, reduce-scatter after (ZeRO-3 over g = 2
    # ranks): 3 (g-1)/g S. Across rows: an all-reduce of this rank's 1/g of the gradient: 2 (r-1)/r S/g.
    formula = {"shard": 3 * (g - 1) / g * s, "replicate": 2 * (r - 1) / r * s / g}
    ratios = {dim: modelled[dim] / formula[dim] for dim in formula}
    passed = difference <= bound and all(abs(ratio - 1) <= impls.BYTES_TOLERANCE for ratio in ratios.values())
    # what really left, where collectives write to sockets (gloo); NCCL's transports do not pass through write()
    sent = int(char_lm_job.job_max(written["bytes"], ctx)) if ctx.backend == "gloo" and written["bytes"] is not None else None
    log(
        f"hsdp     {r} x 2 mesh: max|w - one process| {difference:.1e} <= {bound:.1e}; per rank per step, payloads at ring "
        f"costs: within its pair (shard) {modelled['shard'] / MIB:.3f} MiB = {ratios['shard']:.3f}x 3(g-1)/g S, across pairs "
        f"(replicate) {modelled['replicate'] / MIB:.3f} MiB = {ratios['replicate']:.3f}x 2(r-1)/r S/g   {'PASS' if passed else 'FAIL'}"
    )
    if sent is not None:
        ratio = sent / sum(modelled.values())
        log(f"hsdp     written by the fullest rank ({ctx.backend}): {sent / MIB:.3f} MiB, {ratio:.2f}x the ring model's total")
    calls = {
        dim: sorted({kind for (kind, _), ranks in zip(counter.calls, counter.groups) if ranks == group})
        for dim, group in (("shard", shard_group), ("replicate", replicate_group))
    }
    return {
        "mesh": [r, 2],
        "max_abs_diff_vs_one_process": difference,
        "tolerance": bound,
        "parameter_bytes": s,
        "ring_model_bytes_by_dimension": modelled,
        "formula_by_dimension": formula,
        "ratio_by_dimension": ratios,
        "written_bytes_per_step": sent,
        "calls_by_dimension": calls,
        "passed": passed,
    }


def judge_resume(ctx, resumed: dict, reference: torch.Tensor | None, saved_after: int, steps: int) -> dict:
    """resumed: {"model and optimizer": weights, "model only": weights}. The first must equal the uninterrupted
    run's (reference: trained by ranks 0-1, None on the others, to whom rank 0 sends it), the second
    (momentum lost) must not."""
    if reference is None:  # ranks 2.. did not train the reference: rank 0 sends it
        reference = torch.empty_like(resumed["model only"])
    dist.broadcast(reference, src=0)
    bound = tolerance(reference, steps)
    # weights and reference both on ctx.device (a CPU tensor minus a CUDA one raises)
    differences = {setting: char_lm_job.job_max(float((weights - reference).abs().max()), ctx) for setting, weights in resumed.items()}
    passed = differences["model and optimizer"] <= bound < differences["model only"]
    log(
        f"resume   saved by 2 ranks after {saved_after} of {steps} steps, resumed by {ctx.world_size}: max|w - uninterrupted| "
        f"{differences['model and optimizer']:.1e} <= {bound:.1e}; without the optimizer's state {differences['model only']:.1e} "
        f"(must differ)   {'PASS' if passed else 'FAIL'}"
    )
    return {"saved_on": 2, "resumed_on": ctx.world_size, "steps": steps, "saved_after": saved_after, "tolerance": bound,
            "max_abs_diff_vs_uninterrupted": differences, "passed": passed}  # fmt: skip


# --- the job ----------------------------------------------------------------------------------------------


def run_parts(args, ctx, runners: dict, four_rank_parts) -> dict:
    """Every part of args.parts, in order, by its runner(args, ctx, tokens): {part: facts}; a part this world
    size cannot run says so."""
    if ctx.world_size < 2:
        raise CourseError(f"lab 9 needs 2 or more ranks (torchrun --standalone --nproc_per_node=2 or 4); this job has {ctx.world_size}")
    tokens, _ = text_splits(encode_text(load_stdlib_text()))
    log(f"config: parts={','.join(args.parts)} world_size={ctx.world_size} backend={ctx.backend} device={ctx.device.type}")
    report = {"world_size": ctx.world_size, "backend": ctx.backend, "device": ctx.device.type}
    for part in args.parts:
        if part in four_rank_parts and (ctx.world_size < 4 or ctx.world_size % 2):
            log(f"{part:<8} skipped: it needs an even number of ranks, 4 or more (this job has {ctx.world_size})")
            continue
        report[part] = runners[part](args, ctx, tokens)
    return report


def judge_parts(args, ctx, runners: dict, four_rank_parts) -> int:
    """run_parts() in the job's process group; rank 0 writes --json; the exit status (0: every part PASSed)."""
    try:
        report = run_parts(args, ctx, runners, four_rank_parts)
        if args.json and ctx.is_main:
            atomic_write_json(report, args.json)
        failed = [part for part in args.parts if part in report and not report[part]["passed"]]
        if failed:
            raise CourseError(f"FAILED: {', '.join(failed)} (the lines above say what)")
        return 0
    except CourseError as error:
        log_error(str(error))
        return 1
