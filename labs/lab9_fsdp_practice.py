"""Lab 9: sharding in practice - memory over a whole step, a model no rank builds whole, activation
checkpointing, clipping across shards, HSDP, and a training state resumed on another number of ranks.

Lab 8 weighed what each rank keeps between steps and wrote FSDP from scratch. This lab measures what
practitioners meet next, on lab 8's workload (lab 6's character transformer, the same batches):

  memory     lab 8's six implementations (its --impl) over an AdamW step: the bytes one rank holds at every
             phase, by category (parameters, gathered full weights, gradients, optimizer state, activations),
             counted from their storages, and the allocator's peak, measured; each against the sheet's formula
             with its own stated tolerance (ddp_course/sharded_training.py does the accounting)
  meta       a model no rank builds whole: built on the meta device (no memory), fully_shard-ed, only each rank's
             shards materialised (to_empty) and filled from a sharded checkpoint (torch.distributed.checkpoint)
             a normally built model saved; the allocator's peak on every rank stays far below the whole model's
             bytes; the loaded weights equal the saved ones
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
holds the records of both runs, and the lab 9 sheet reads them. What the parts share, and each part's
verdict line, are ddp_course/fsdp_practice.py: this script keeps the six demos.
"""

import functools
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import minizero2  # labs/minizero2.py, beside this script: ZeRO-2 from scratch, complete code to read
from ddp_course import char_lm_job  # the job labs 6, 8 and 9 share: model, batch, verdicts, timing
from ddp_course import fsdp_practice as practice  # what the parts share, and each part's verdict
from ddp_course import sharded_training as impls  # lab 8's implementations, built, checked and weighed alike
from ddp_course.cli import CourseArgumentParser, CourseError, positive_float
from ddp_course.distributed import BACKENDS, log, log_error, setup_distributed, teardown_distributed
from ddp_course.fsdp_practice import MIB, full_weights, full_weights_equal, local_batch, one_process, remove_if_temporary, shared_directory
from ddp_course.fsdp_practice import sharded_model, world_mesh  # meta() shows them by these names (the sheet prints its source)
from ddp_course.sharding import allocations, bytes_written, count_collectives, storage_bytes

PARTS = ("memory", "meta", "checkpoint", "clip", "hsdp", "resume")
FOUR_RANK_PARTS = ("hsdp", "resume")
MEMORY_IMPLS = impls.IMPLS  # ddp, zero1, zero2, fsdp (ours), fully_shard, fully_shard_keep
REPO_ROOT = Path(__file__).resolve().parent.parent
CLIP_STEPS, MAX_NORM = 3, 0.5  # the gradient's norm is about 4.8 at the first step: clipping acts at every step
HSDP_STEPS = 2
RESUME_AT, RESUME_STEPS = 2, 4


# --- memory over a whole step: counted, measured and predicted (ddp_course.sharded_training) ---------------


def memory(args, ctx, tokens) -> dict:
    """Every implementation's step, counted and measured, against the formula; ZeRO-2 against one process."""
    # the finished from-scratch code the implementations need: lab 6's ShardedOptimizer (ZeRO-1), ZeRO-2, our FSDP
    solution = functools.partial(char_lm_job.load_learner_module, "solutions", root=REPO_ROOT)
    modules = {"minddp": solution("minddp"), "minizero2": minizero2, "minifsdp": solution("minifsdp")}
    sizes = impls.model_sizes(char_lm_job.new_model(args, ctx), minizero2)
    timelines = {impl: impls.memory_timeline(impl, ctx, modules, tokens, args.seed, args.snapshot_dir) for impl in MEMORY_IMPLS}
    # ZeRO-2 from scratch trains as one process does at this world size too (lab 8's check: SGD steps)
    checked = impls.check(impls.job_args(args.seed, impls=["zero2"]), ctx, tokens, modules)["zero2"]
    return practice.judge_memory(timelines, sizes, checked, ctx.world_size)


# --- a model no rank builds whole ------------------------------------------------------------------------


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
    inputs, targets = practice.lab8_batch(args, ctx, tokens)
    for setting, wrap_block in (("plain", None), ("checkpointed", Checkpointed)):
        weights[setting] = sharded_model(args, ctx, mesh, wrap_block=wrap_block)
        facts[setting] = practice.weigh_sgd_step(weights[setting], inputs, targets, ctx)
    return practice.judge_checkpointing(facts, full_weights_equal(weights["plain"], weights["checkpointed"]))


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
        return full_weights(model), norms, None
    named = wrapped.gather_full_params()
    replicas = torch.cat([p.detach().flatten() for p in wrapped.replicated])  # this rank's own copy
    return torch.cat([named[n].flatten() for n, _ in model.named_parameters()]), norms, replicas


def clipping(args, ctx, tokens) -> dict:
    """Each way of clipping trained, then judged against one process clipping the whole batch's gradient."""
    reference, reference_norms = one_process(args, ctx, tokens, CLIP_STEPS, MAX_NORM)
    runs = {how: clipped_training(args, ctx, tokens, how) for how in ("naive", "fixed", "fully_shard")}
    return practice.judge_clipping(ctx, reference, reference_norms, MAX_NORM, CLIP_STEPS, runs)


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
    parameter_bytes = storage_bytes(char_lm_job.new_model(args, ctx).parameters())
    return practice.judge_hsdp(ctx, mesh, full_weights(model), reference, HSDP_STEPS, counter, written, parameter_bytes)


# --- a full training state, saved on 2 ranks, resumed on 4 ----------------------------------------------


def sgd_with_momentum(model):
    return torch.optim.SGD(model.parameters(), lr=char_lm_job.CHECK_LR, momentum=0.9)  # momentum: state worth saving


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
        practice.train_steps(args, ctx, tokens, model, optimizer, range(RESUME_STEPS), pair)
        reference = full_weights(model)
        model = sharded_model(args, ctx, world_mesh(ctx, pair))
        optimizer = sgd_with_momentum(model)
        practice.train_steps(args, ctx, tokens, model, optimizer, range(RESUME_AT), pair)
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
        practice.train_steps(args, ctx, tokens, model, optimizer, range(RESUME_AT, RESUME_STEPS))
        facts[setting] = full_weights(model)
    remove_if_temporary(args, ctx, directory)
    return practice.judge_resume(ctx, facts, reference, RESUME_AT, RESUME_STEPS)  # rank 0 sends ranks 2.. the reference


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


def judge(args, ctx) -> int:
    """Every part asked for, in order, in the job's process group; rank 0 writes --json; the exit status
    (0: every part PASSed). A part this world size cannot run says so."""
    return practice.judge_parts(args, ctx, RUNNERS, FOUR_RANK_PARTS)


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
