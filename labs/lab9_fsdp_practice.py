"""Lab 9: sharding in practice - memory over a whole step, a model no rank builds whole, activation
checkpointing, clipping across shards, HSDP, and a training state resumed on another number of ranks.

Lab 8 weighed what each rank keeps between steps and wrote FSDP from scratch. This lab measures what
practitioners meet next, on lab 8's workload (lab 6's character transformer, the same batches):

  memory     for ddp, zero1, zero2, fsdp (ours), fully_shard and fully_shard_keep (lab 8's --impl): the
             bytes one rank holds at every phase of an AdamW step - each module's entry and exit in
             forward, each module's backward, the gradient sync, the optimizer step - by category:
             parameters, gathered full weights, gradients, optimizer state, activations (the tensors
             autograd saved for backward), counted from their storages; and the allocator's own peak,
             measured; each against the sheet's formula with its own stated tolerance (the count checks
             the accounting, the allocator's figure memory: one more full-size buffer FAILs it)
  meta       a model no rank builds whole: built on the meta device (no memory), fully_shard-ed, then
             only each rank's shards materialised (to_empty) and filled from a sharded checkpoint
             (torch.distributed.checkpoint) that a normally built model saved; the CPU allocator's peak
             on every rank stays far below the full model's bytes; the loaded weights equal the saved ones
  checkpoint activation checkpointing per block under fully_shard: the allocator's peak during a step with
             and without, the all-gathers per step (the same: recomputation runs inside the unit's
             backward, while its weights are gathered anyway), and equal weights after the step
  clip       gradient clipping across shards: clip_grad_norm_ on each rank's slices (naive) gives each
             rank another norm and the replicated parameters drift apart; the fix (one all-reduce of the
             squared norms) and torch's clip_grad_norm_ on fully_shard's DTensors equal one process
  hsdp       (4 ranks) fully_shard on a 2 x 2 mesh: shard within pairs, replicate across them; equal to
             one process; the payloads at ring costs per mesh dimension against the formula, and what
             gloo really wrote (more: its reduce-scatter is an all-reduce)
  resume     (4 ranks) model and optimizer state saved with DCP by 2 ranks (a subgroup) after some steps,
             loaded by all 4, training continued: equal to the uninterrupted run, and a resume without the
             optimizer's state is not

From the repository root (gloo, CPU):
    torchrun --standalone --nproc_per_node=2 labs/lab9_fsdp_practice.py --json runs/lab9_2.json
    torchrun --standalone --nproc_per_node=4 labs/lab9_fsdp_practice.py --json runs/lab9_4.json
    one part:  ... --parts memory,clip
    N GPUs (NCCL; written with care, NOT YET RUN on a GPU): torchrun --standalone --nproc_per_node=N
               labs/lab9_fsdp_practice.py --parts memory --snapshot-dir runs/snapshots   (torch.cuda's peak per
               implementation, and a memory snapshot each, for https://pytorch.org/memory_viz)

What you should see: one PASS line per check and exit status 0; at 2 ranks the 4-rank parts are skipped
with a line saying so. Any world size of 2 or more runs: the global batch of the meta, clip, hsdp and resume
parts is 8 windows or the next multiple of the world size (windows_per_step). solutions/lab9_reference/
holds the records of both runs, and the lab 9 sheet reads
them.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import minizero2  # labs/minizero2.py, beside this script: ZeRO-2 from scratch, complete code to read
from ddp_course import char_lm_job  # the job labs 6, 8 and 9 share: model, batch, verdicts, timing
from ddp_course import sharded_training as impls  # lab 8's implementations, built, checked and weighed alike
from ddp_course.checkpoint import atomic_write_json
from ddp_course.cli import CourseArgumentParser, CourseError, positive_float
from ddp_course.data import encode_text, load_stdlib_text, sample_windows, text_splits
from ddp_course.distributed import BACKENDS, log, log_error, setup_distributed, teardown_distributed
from ddp_course.sharding import SavedActivations, allocations, bytes_written, count_collectives, storage_bytes

PARTS = ("memory", "meta", "checkpoint", "clip", "hsdp", "resume")
FOUR_RANK_PARTS = ("hsdp", "resume")
MEMORY_IMPLS = impls.IMPLS  # ddp, zero1, zero2, fsdp (ours), fully_shard, fully_shard_keep
MIB = 2**20
REPO_ROOT = Path(__file__).resolve().parent.parent
# Windows per step in the meta, clip, hsdp and resume parts: 8, or the next multiple of the world size, so
# that every rank gets the same number of whole windows (4 each on 2 ranks, 2 on 4, 3 on 3, 1 on 9 or more)
# and the average of the ranks' means is the global batch's mean, at any world size.
SMALLEST_GLOBAL_BATCH = 8
CLIP_STEPS, MAX_NORM = 3, 0.5  # the gradient's norm is about 4.8 at the first step: clipping acts at every step
HSDP_STEPS = 2
RESUME_AT, RESUME_STEPS = 2, 4


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


# --- memory over a whole step: counted, measured and predicted (ddp_course.sharded_training) ---------------


def from_scratch() -> dict:
    """The finished from-scratch code the implementations need: lab 6's ShardedOptimizer (ZeRO-1), ZeRO-2, our FSDP."""
    return {
        "minddp": char_lm_job.load_learner_module("solutions", "minddp", root=REPO_ROOT),
        "minizero2": minizero2,
        "minifsdp": char_lm_job.load_learner_module("solutions", "minifsdp", root=REPO_ROOT),
    }


def memory(args, ctx, tokens) -> dict:
    """Every implementation's step, counted and measured, against the formula; ZeRO-2 against one process."""
    modules = from_scratch()
    sizes = impls.model_sizes(char_lm_job.new_model(args, ctx), minizero2)
    timelines = {impl: impls.memory_timeline(impl, ctx, modules, tokens, args.seed, args.snapshot_dir) for impl in MEMORY_IMPLS}
    labels = timelines["ddp"]["labels"]  # the same phases for every implementation: the same model's modules
    if any(timeline.pop("labels") != labels for timeline in timelines.values()):
        raise CourseError("the implementations' steps went through different phases")
    facts = {"categories": impls.CATEGORIES, "labels": labels, "sizes": sizes, "counted_tolerance": impls.COUNTED_TOLERANCE,
             "measured_tolerance": impls.MEASURED_TOLERANCE, "impls": {}}  # fmt: skip
    for impl, timeline in timelines.items():
        facts["impls"][impl] = impls.judge_peaks(impl, timeline, labels, sizes, ctx.world_size)
    # ZeRO-2 from scratch trains as one process does at this world size too (lab 8's check: SGD steps)
    checked = impls.check(impls.job_args(args.seed, impls=["zero2"]), ctx, tokens, modules)["zero2"]
    facts["zero2_check"] = {key: checked[key] for key in ("max_abs_diff_vs_single_process", "tolerance")} | {"passed": checked["verdict"] == "PASS"}
    facts["passed"] = all(impl["passed"] for impl in facts["impls"].values()) and facts["zero2_check"]["passed"]
    return facts


# --- a model no rank builds whole ------------------------------------------------------------------------


def world_mesh(ctx, group=None):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

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


def full_weights_equal(first, second) -> bool:
    """Two fully_shard models' weights, compared parameter by parameter (one full tensor at a time)."""
    return all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(first.parameters(), second.parameters()))


def meta(args, ctx, tokens) -> dict:
    """Save a normally built (and trained) sharded model with DCP; build it again on the meta device, shard it,
    materialise only the shards, load them; weigh the allocator's peak of both builds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    mesh = world_mesh(ctx)
    with allocations(ctx.device) as whole_then_sharded:  # the usual way: every rank builds the whole model first
        saved = sharded_model(args, ctx, mesh)
    inputs, targets = local_batch(args, ctx, tokens, step=0)
    F.cross_entropy(saved(inputs).flatten(0, 1), targets.flatten()).backward()
    torch.optim.SGD(saved.parameters(), lr=char_lm_job.CHECK_LR).step()  # so that the saved weights are not the initial ones
    directory = shared_directory(args, ctx, "meta")
    dcp.save(get_model_state_dict(saved), checkpoint_id=directory)
    with allocations(ctx.device) as never_whole:
        loaded = sharded_model(args, ctx, mesh, device="meta")  # shapes only: no memory
        loaded.to_empty(device=ctx.device)  # this rank's shards, uninitialised
        state = get_model_state_dict(loaded)  # DTensors over the shards
        dcp.load(state, checkpoint_id=directory)  # each rank reads only the pieces of its shards
        set_model_state_dict(loaded, state)
    whole = storage_bytes(char_lm_job.new_model(args, ctx).parameters())
    peaks = {"whole_then_sharded": int(char_lm_job.job_max(whole_then_sharded.peak, ctx)), "meta": int(char_lm_job.job_max(never_whole.peak, ctx))}
    equal = full_weights_equal(saved, loaded)
    remove_if_temporary(args, ctx, directory)
    passed = peaks["meta"] < whole <= peaks["whole_then_sharded"] and equal
    log(
        f"meta     the whole model: {whole / MIB:.2f} MiB; the fullest rank's allocator peak building it whole, then sharding: "
        f"{peaks['whole_then_sharded'] / MIB:.2f} MiB; on the meta device, then shards loaded: {peaks['meta'] / MIB:.2f} MiB; "
        f"loaded weights equal the saved ones: {equal}   {'PASS' if passed else 'FAIL'}"
    )
    return {"whole_model_bytes": whole, "peak_bytes": peaks, "loaded_equals_saved": equal, "passed": passed}


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


# --- activation checkpointing --------------------------------------------------------------------------


class Checkpointed(nn.Module):
    """A block whose forward keeps no activations: backward runs it again (torch.utils.checkpoint). Wrapped
    BEFORE fully_shard, so the FSDP unit is this module: the recomputation calls the inner block, inside the
    unit's backward, when fully_shard has gathered the unit's weights already - no extra all-gather."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def activation_checkpointing(args, ctx, tokens) -> dict:
    """The same fully_shard step with and without checkpointing each block: the allocator's peak, the
    tensors saved for backward after forward, the all-gathers; the weights after the step are the same."""
    mesh, facts, weights = world_mesh(ctx), {}, {}
    inputs, targets = (
        char_lm_job.my_rows(t, ctx) for t in char_lm_job.global_batch(tokens, torch.Generator().manual_seed(args.seed), impls.job_args(args.seed), ctx)
    )
    for setting, wrap_block in (("plain", None), ("checkpointed", Checkpointed)):
        model = sharded_model(args, ctx, mesh, wrap_block=wrap_block)
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
        facts[setting] = {"allocator_peak_bytes": int(char_lm_job.job_max(allocated.peak, ctx)),
                          "saved_after_forward_bytes": int(char_lm_job.job_max(after_forward[-1], ctx)),
                          "all_gathers": sum(kind == "all_gather" for kind, _ in counter.calls),
                          "ring_model_bytes": counter.ring_model_bytes_per_rank(ctx.world_size)}  # fmt: skip
        weights[setting] = model
    equal = full_weights_equal(weights["plain"], weights["checkpointed"])
    plain, ac = facts["plain"], facts["checkpointed"]
    passed = ac["allocator_peak_bytes"] < plain["allocator_peak_bytes"] and ac["all_gathers"] == plain["all_gathers"] and equal
    log(
        f"checkpoint  allocator peak {plain['allocator_peak_bytes'] / MIB:.2f} -> {ac['allocator_peak_bytes'] / MIB:.2f} MiB, saved for backward "
        f"{plain['saved_after_forward_bytes'] / MIB:.2f} -> {ac['saved_after_forward_bytes'] / MIB:.2f} MiB, all-gathers per step "
        f"{plain['all_gathers']} -> {ac['all_gathers']}, weights after the step equal: {equal}   {'PASS' if passed else 'FAIL'}"
    )
    return {**facts, "weights_equal": equal, "passed": passed}


# --- gradient clipping across shards ---------------------------------------------------------------------


def clip_sharded_(model, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ for the from-scratch FSDP (solutions/minifsdp.py): the norm of the WHOLE gradient.
    Its square is the sum over ranks of each rank's slices' squares (one all-reduce) plus the replicated
    parameters' squares, counted once (every rank holds the same). Every rank then scales by the same factor."""
    slices = [p.grad for p in model.sharded if p.grad is not None]
    replicated = [p.grad for p in model.replicated if p.grad is not None]
    squares = torch.stack([g.pow(2).sum() for g in slices]).sum() if slices else torch.zeros((), device=replicated[0].device)
    dist.all_reduce(squares)
    total = (squares + sum(g.pow(2).sum() for g in replicated)).sqrt()
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch.nn.utils.clip_grad_norm_'s rule
    for gradient in slices + replicated:
        gradient.mul_(factor)
    return total


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


def clipped_training(args, ctx, tokens, how: str) -> tuple[torch.Tensor, list[float], torch.Tensor | None]:
    """CLIP_STEPS SGD steps on this rank's rows, clipped to MAX_NORM: the full weights flattened, the norm
    this rank computed at each step, and (our FSDP) this rank's copy of the replicated parameters.
    how: "naive" (our FSDP, clip_grad_norm_ over this rank's slices and replicated parameters), "fixed"
    (our FSDP, clip_sharded_), "fully_shard" (torch's clip_grad_norm_ on fully_shard's DTensors)."""
    if how == "fully_shard":
        model = wrapped = sharded_model(args, ctx, world_mesh(ctx))
    else:
        model = char_lm_job.new_model(args, ctx)
        wrapped = char_lm_job.load_learner_module("solutions", "minifsdp", root=REPO_ROOT).FSDP(model, units=list(model.blocks))
    optimizer, norms = torch.optim.SGD(wrapped.parameters(), lr=char_lm_job.CHECK_LR), []
    for step in range(CLIP_STEPS):
        inputs, targets = local_batch(args, ctx, tokens, step)
        optimizer.zero_grad()
        F.cross_entropy(wrapped(inputs).flatten(0, 1), targets.flatten()).backward()
        if how != "fully_shard":
            wrapped.finish_gradient_synchronization()
        norm = clip_sharded_(wrapped, MAX_NORM) if how == "fixed" else torch.nn.utils.clip_grad_norm_(wrapped.parameters(), MAX_NORM)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        optimizer.step()
    if how == "fully_shard":
        return torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()]), norms, None
    named = wrapped.gather_full_params()
    replicas = torch.cat([p.detach().flatten() for p in wrapped.replicated])  # this rank's own copy
    return torch.cat([named[n].flatten() for n, _ in model.named_parameters()]), norms, replicas


def clipping(args, ctx, tokens) -> dict:
    reference, reference_norms = one_process(args, ctx, tokens, CLIP_STEPS, MAX_NORM)
    tolerance = char_lm_job.EPS_PER_STEP * CLIP_STEPS * torch.finfo(torch.float32).eps * float(reference.abs().max())
    facts, passed = {"max_norm": MAX_NORM, "reference_norms": reference_norms, "tolerance": tolerance}, True
    for how in ("naive", "fixed", "fully_shard"):
        weights, norms, replicas = clipped_training(args, ctx, tokens, how)
        difference = char_lm_job.job_max(float((weights - reference).abs().max()), ctx)
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, (norms, None if replicas is None else replicas.tolist()))
        norms_agree = all(other[0] == everyone[0][0] for other in everyone)
        replicas_agree = replicas is None or all(other[1] == everyone[0][1] for other in everyone)
        expected = how != "naive"  # the naive clip must differ: per-rank norms, drifting replicas, other weights
        agrees = [difference <= tolerance, norms_agree, replicas_agree]
        ok = all(agrees) if expected else not any(agrees)
        passed = passed and ok
        facts[how] = {"max_abs_diff_vs_one_process": difference, "first_step_norms_by_rank": [other[0][0] for other in everyone],
                      "norms_agree": norms_agree, "replicated_parameters_agree": replicas_agree, "passed": ok}  # fmt: skip
        log(
            f"clip     {how:<11} first step's norm on each rank {', '.join(f'{other[0][0]:.4f}' for other in everyone)} "
            f"(one process {reference_norms[0]:.4f}); replicated parameters equal on every rank: {replicas_agree}; "
            f"max|w - one process| {difference:.1e} ({'must differ' if not expected else f'<= {tolerance:.1e}'})   {'PASS' if ok else 'FAIL'}"
        )
    facts["passed"] = passed
    return facts


# --- HSDP on a 2 x 2 mesh --------------------------------------------------------------------------------


def hsdp(args, ctx, tokens) -> dict:
    """fully_shard on a 2-D mesh: shard over the 2 ranks of each row ("shard"), replicate across the rows
    ("replicate") - a node of 2 GPUs, 2 nodes. Trained against one process; bytes per mesh dimension."""
    from torch.distributed.device_mesh import init_device_mesh

    rows = ctx.world_size // 2
    mesh = init_device_mesh(ctx.device.type, (rows, 2), mesh_dim_names=("replicate", "shard"))
    model = sharded_model(args, ctx, mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=char_lm_job.CHECK_LR)
    for step in range(HSDP_STEPS):
        inputs, targets = local_batch(args, ctx, tokens, step)
        optimizer.zero_grad()
        with count_collectives() as counter, bytes_written() as written:  # the last step's are kept
            F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
        optimizer.step()
    reference, _ = one_process(args, ctx, tokens, HSDP_STEPS)
    weights = torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()])
    tolerance = char_lm_job.EPS_PER_STEP * HSDP_STEPS * torch.finfo(torch.float32).eps * float(reference.abs().max())
    difference = char_lm_job.job_max(float((weights - reference).abs().max()), ctx)
    shard_group = tuple(dist.get_process_group_ranks(mesh.get_group("shard")))
    replicate_group = tuple(dist.get_process_group_ranks(mesh.get_group("replicate")))
    by_group = counter.ring_model_bytes_by_group()
    s, g, r = storage_bytes(char_lm_job.new_model(args, ctx).parameters()), 2, rows
    # The payloads the step's collectives carried, each priced by the ring costs (sharding.py): the model.
    modelled = {"shard": by_group.get(shard_group, 0.0), "replicate": by_group.get(replicate_group, 0.0)}
    # Within a row: all-gather before forward and before backward, reduce-scatter after (ZeRO-3 over g = 2
    # ranks): 3 (g-1)/g S. Across rows: an all-reduce of this rank's 1/g of the gradient: 2 (r-1)/r S/g.
    formula = {"shard": 3 * (g - 1) / g * s, "replicate": 2 * (r - 1) / r * s / g}
    ratios = {dim: modelled[dim] / formula[dim] for dim in formula}
    passed = difference <= tolerance and all(abs(ratio - 1) <= impls.BYTES_TOLERANCE for ratio in ratios.values())
    # what really left, where collectives write to sockets (gloo); NCCL's transports do not pass through write()
    sent = int(char_lm_job.job_max(written["bytes"], ctx)) if ctx.backend == "gloo" and written["bytes"] is not None else None
    log(
        f"hsdp     {r} x 2 mesh: max|w - one process| {difference:.1e} <= {tolerance:.1e}; per rank per step, payloads at ring "
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
        "tolerance": tolerance,
        "parameter_bytes": s,
        "ring_model_bytes_by_dimension": modelled,
        "formula_by_dimension": formula,
        "ratio_by_dimension": ratios,
        "written_bytes_per_step": sent,
        "calls_by_dimension": calls,
        "passed": passed,
    }


# --- a full training state, saved on 2 ranks, resumed on 4 ----------------------------------------------


def sgd_with_momentum(model):
    return torch.optim.SGD(model.parameters(), lr=char_lm_job.CHECK_LR, momentum=0.9)  # momentum: state worth saving


def train_steps(args, ctx, tokens, model, optimizer, steps, group=None) -> None:
    for step in steps:
        inputs, targets = local_batch(args, ctx, tokens, step, group)
        optimizer.zero_grad()
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
        optimizer.step()


def resume(args, ctx, tokens) -> dict:
    """Ranks 0-1 train RESUME_STEPS steps uninterrupted (the reference) and, separately, RESUME_AT steps,
    then save model and optimizer with DCP; all ranks load both into a fresh fully_shard model and its
    optimizer and train the remaining steps on the same global batches; and once more without loading the
    optimizer's state (the control: momentum lost)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict

    pair = dist.new_group([0, 1])  # every rank creates every group, in the same order
    directory, reference = shared_directory(args, ctx, "resume"), None
    if ctx.rank < 2:
        model = sharded_model(args, ctx, world_mesh(ctx, pair))
        optimizer = sgd_with_momentum(model)
        train_steps(args, ctx, tokens, model, optimizer, range(RESUME_STEPS), pair)
        reference = torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()])
        model = sharded_model(args, ctx, world_mesh(ctx, pair))
        optimizer = sgd_with_momentum(model)
        train_steps(args, ctx, tokens, model, optimizer, range(RESUME_AT), pair)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory, process_group=pair)
        del model, optimizer, model_state, optimizer_state
    dist.barrier()  # the files exist before any rank reads them
    facts = {}
    for setting in ("model and optimizer", "model only"):
        model = sharded_model(args, ctx, world_mesh(ctx), seed_offset=1)  # other weights until loaded
        optimizer = sgd_with_momentum(model)
        # get_state_dict creates the optimizer's state (a step with zero gradients) so that DCP can load into it
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state} | ({"optimizer": optimizer_state} if setting == "model and optimizer" else {})
        dcp.load(state, checkpoint_id=directory)  # in place: each rank reads the pieces of its shards
        if setting == "model and optimizer":
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        else:  # the control: the weights alone, a fresh optimizer - the momentum of the first steps is lost
            set_model_state_dict(model, state["model"])
            optimizer = sgd_with_momentum(model)
        train_steps(args, ctx, tokens, model, optimizer, range(RESUME_AT, RESUME_STEPS))
        facts[setting] = torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()])
    remove_if_temporary(args, ctx, directory)
    if reference is None:  # ranks 2.. did not train the reference: rank 0 sends it
        reference = torch.empty_like(facts["model only"])
    dist.broadcast(reference, src=0)
    tolerance = char_lm_job.EPS_PER_STEP * RESUME_STEPS * torch.finfo(torch.float32).eps * float(reference.abs().max())
    # weights and reference both on ctx.device (a CPU tensor minus a CUDA one raises)
    differences = {setting: char_lm_job.job_max(float((weights - reference).abs().max()), ctx) for setting, weights in facts.items()}
    passed = differences["model and optimizer"] <= tolerance < differences["model only"]
    log(
        f"resume   saved by 2 ranks after {RESUME_AT} of {RESUME_STEPS} steps, resumed by {ctx.world_size}: max|w - uninterrupted| "
        f"{differences['model and optimizer']:.1e} <= {tolerance:.1e}; without the optimizer's state {differences['model only']:.1e} "
        f"(must differ)   {'PASS' if passed else 'FAIL'}"
    )
    return {"saved_on": 2, "resumed_on": ctx.world_size, "steps": RESUME_STEPS, "saved_after": RESUME_AT, "tolerance": tolerance,
            "max_abs_diff_vs_uninterrupted": differences, "passed": passed}  # fmt: skip


# --- the job ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    parser = CourseArgumentParser(prog="lab9_fsdp_practice.py", description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from: {', '.join(PARTS)} (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="model initialization and batches")
    parser.add_argument("--json", help="write every part's facts here (rank 0)")
    parser.add_argument("--checkpoint-dir", help="a folder for the meta and resume parts' checkpoints (default: a temporary one)")
    parser.add_argument("--snapshot-dir", help="GPU track: write a torch.cuda memory snapshot per implementation here")
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    parser.add_argument("--timeout-s", type=positive_float, default=120.0, help="process-group timeout, seconds")
    args = parser.parse_args(argv)
    args.parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown or not args.parts:
        parser.error(f"--parts: unknown {', '.join(unknown) or 'nothing given'}; choose from {', '.join(PARTS)}")
    if args.json and Path(args.json).is_dir():
        parser.error(f"--json {args.json} is a folder; give a file name")
    return args


RUNNERS = {"memory": memory, "meta": meta, "checkpoint": activation_checkpointing, "clip": clipping, "hsdp": hsdp, "resume": resume}


def run(args, ctx) -> dict:
    """Every part asked for, in order: {part: facts}; a part this world size cannot run says so."""
    if ctx.world_size < 2:
        raise CourseError(f"lab 9 needs 2 or more ranks (torchrun --standalone --nproc_per_node=2 or 4); this job has {ctx.world_size}")
    tokens, _ = text_splits(encode_text(load_stdlib_text()))
    log(f"config: parts={','.join(args.parts)} world_size={ctx.world_size} backend={ctx.backend} device={ctx.device.type}")
    report = {"world_size": ctx.world_size, "backend": ctx.backend, "device": ctx.device.type}
    for part in args.parts:
        if part in FOUR_RANK_PARTS and (ctx.world_size < 4 or ctx.world_size % 2):
            log(f"{part:<8} skipped: it needs an even number of ranks, 4 or more (this job has {ctx.world_size})")
            continue
        report[part] = RUNNERS[part](args, ctx, tokens)
    return report


def judge(args, ctx) -> int:
    """run() in the job's process group; rank 0 writes --json; the exit status (0: every part PASSed)."""
    try:
        report = run(args, ctx)
        if args.json and ctx.is_main:
            atomic_write_json(report, args.json)
        failed = [part for part in args.parts if part in report and not report[part]["passed"]]
        if failed:
            raise CourseError(f"FAILED: {', '.join(failed)} (the lines above say what)")
        return 0
    except CourseError as error:
        log_error(str(error))
        return 1


def main(args) -> int:
    try:
        ctx = setup_distributed(args.backend, timeout_s=args.timeout_s)
        return judge(args, ctx)
    except CourseError as error:
        log_error(str(error))
        return 1
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_args()))
