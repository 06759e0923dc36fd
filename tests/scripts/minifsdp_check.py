"""Checks of the from-scratch FSDP (solutions/minifsdp.py) on real ranks: one PASS/FAIL line per case.

    torchrun --standalone --nproc_per_node=2 tests/scripts/minifsdp_check.py
    torchrun --standalone --nproc_per_node=4 tests/scripts/minifsdp_check.py --timeout-s 30

Every rank trains the sharded model on its part of each global batch AND a one-process reference on the
whole batch, then compares; a case passes when it passes on every rank. Rank 0 prints one line per case,
"PASS name: details" or "FAIL name: details", then "done: P passed, F failed"; the exit status is 1 if any
case failed. tests/test_minifsdp.py asserts on these lines. Every collective waits at most --timeout-s s.

Cases: SGD and AdamW against one process (float32, CharTransformer with its tied embedding); replicated
gradients identical on every rank; the tied weight still tied, gathered once in backward and
reduce-scattered once per step; no full weight left after forward and after the step, and with lab 8's
block units never more than the root's and one block's full weights at once; float16 compute
against a one-process float16 reference; two wrong variants (negative controls); optimizer state per
rank; the exercise labs/minifsdp.py, part by part.
"""

from __future__ import annotations

import argparse
import sys
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from ddp_course.compare import max_relative_difference
from ddp_course.distributed import setup_distributed, teardown_distributed
from ddp_course.authoring.exercises import exercise_header, make_exercise
from ddp_course.launch import REPO_ROOT, import_script
from ddp_course.models import CharTransformer
from ddp_course.sharding import at_module_boundaries, storage_bytes

SOLUTION = REPO_ROOT / "solutions" / "minifsdp.py"
EXERCISE = REPO_ROOT / "labs" / "minifsdp.py"
minifsdp = import_script(SOLUTION, "minifsdp")

STEPS = 3
BATCH, TIME, VOCAB = 8, 8, 13  # 8 sequences of 8 tokens; 13 rows of the embedding: padded on 2 and 4 ranks
TIED_USES = 2
# Float32 bound. A weight's gradient element is a sum over the BATCH * TIME positions (twice that for the
# tied embedding, used at input and output). FSDP sums each rank's part, then the ranks' sums: another
# order than one process. A float32 sum of n terms in another order differs by at most about n * eps
# relative to the sum of the terms' magnitudes (Higham, Accuracy and Stability of Numerical Algorithms,
# 2nd ed., section 4.2), and each of the STEPS updates can add that again. AdamW's elementwise update
# is the same function of the same gradient on the slice as on the full tensor.
EPS = torch.finfo(torch.float32).eps
TOLERANCE = STEPS * TIED_USES * BATCH * TIME * EPS  # 4.6e-5
# float16 compute. Each rank's float16 gradient is rounded (2^-11 relative) before the float32 average,
# so one process computing the whole batch in float16 rounds differently: measured 1.0e-3 apart on 2
# ranks, as far as from a float32 run (0.9e-3) - such a comparison could not tell float16 from float32.
# The reference therefore computes in float16 on world_size micro-batches (the ranks' rows) and averages
# their gradients in float32, as gradient accumulation does. Then only the float32 summation order of
# world_size terms differs (measured: 0 on 2 ranks), while a run in float32 stays about 1e-3 away.
HALF_TOLERANCE = 1e-4
SGD = (torch.optim.SGD, {"lr": 0.1})
# AdamW's eps is raised from 1e-8 to 1e-6 for a reason of the model, not of FSDP: the attention's key bias
# gets a gradient that is zero in exact arithmetic (softmax ignores a shift shared by all keys), so what
# is computed is rounding noise (about 1e-12 here), and Adam's g / (sqrt(v) + eps) turns noise into
# steps of lr with a random sign unless eps is far above it. Measured with eps=1e-8: 5e-4 on that bias
# only. Nearly all real gradient elements here are far above 1e-6, so Adam stays adaptive.
ADAMW = (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "eps": 1e-6})


# --- models and data -----------------------------------------------------------------------------------


def char_transformer() -> nn.Module:
    """Lab 6's transformer, tiny: tied embedding (13, 16), LayerNorms and biases (replicated)."""
    return CharTransformer(VOCAB, context=TIME, d_model=16, n_layers=1, n_heads=2)


class HalfNet(nn.Module):
    """A tied-embedding model that runs with float16 matrices and float32 LayerNorms: no biased linear."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.norm = nn.LayerNorm(16)  # accepts float16 input with float32 parameters on CPU
        self.up = nn.Linear(16, 40, bias=False)
        self.down = nn.Linear(40, 16, bias=False)
        self.head = nn.Linear(16, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + self.down(F.gelu(self.up(self.norm(x))))
        return self.head(x).float()  # (B, T, VOCAB) logits, float32 for the loss


def build(model_fn, seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return model_fn()


def batch(step):
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(VOCAB, (BATCH, TIME + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]  # inputs and next-token targets, (B, T) each


def loss_of(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def mine(ctx, tensor):
    return tensor.chunk(ctx.world_size)[ctx.rank]


# --- training runs -------------------------------------------------------------------------------------


def reference_weights(model_fn, optimizer, steps=STEPS, compute_dtype=None, micro_batches=1) -> dict:
    """One process on the whole batch; matrices cast to compute_dtype for forward and backward, if given.

    The float32 master weights get the gradient of the cast copy (autograd casts it back), as FSDP's
    slices do. micro_batches > 1: the batch goes through in that many parts whose float32 gradients are
    averaged (gradient accumulation), the float16 reference's way to round as N ranks do (see HALF_TOLERANCE).
    """
    model = build(model_fn)
    optimizer_cls, kwargs = optimizer
    opt = optimizer_cls(model.parameters(), **kwargs)
    masters = list(model.parameters())
    for step in range(steps):
        inputs, targets = batch(step)
        opt.zero_grad()
        for part_inputs, part_targets in zip(inputs.chunk(micro_batches), targets.chunk(micro_batches)):
            params = dict(model.named_parameters())
            if compute_dtype is not None:
                params = {name: p.to(compute_dtype) if p.dim() >= 2 else p for name, p in params.items()}
            loss = loss_of(functional_call(model, params, (part_inputs,)), part_targets)  # tied weights stay tied
            for master, grad in zip(masters, torch.autograd.grad(loss, masters)):
                master.grad = grad if master.grad is None else master.grad + grad
        for master in masters:
            master.grad /= micro_batches
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def fsdp_run(ctx, model_fn, optimizer, wrap=None, steps=STEPS, compute_dtype=None, on_step=None):
    """Train FSDP(model) on this rank's rows of each batch; returns (wrapper, optimizer)."""
    wrap = wrap or minifsdp.FSDP
    model = wrap(build(model_fn), compute_dtype=compute_dtype)
    optimizer_cls, kwargs = optimizer
    opt = optimizer_cls(model.parameters(), **kwargs)
    for step in range(steps):
        inputs, targets = batch(step)
        opt.zero_grad()
        loss_of(model(mine(ctx, inputs)), mine(ctx, targets)).backward()
        model.finish_gradient_synchronization()
        if on_step is not None:
            on_step(model)
        opt.step()
    return model, opt


def train_and_compare(ctx, model_fn, optimizer, wrap=None, compute_dtype=None) -> tuple[float, str]:
    """max relative difference to the one-process reference (inf, and the error, if training raised)."""
    reference = reference_weights(model_fn, optimizer, compute_dtype=compute_dtype)
    try:
        model, _ = fsdp_run(ctx, model_fn, optimizer, wrap=wrap, compute_dtype=compute_dtype)
    except RuntimeError as error:  # the same error on every rank: the same graph fails at the same place
        return float("inf"), f"training raised {str(error).splitlines()[0][:90]!r}"
    return max_relative_difference(model.gather_full_params(), reference), ""


# --- wrong variants (negative controls) -----------------------------------------------------------------


class SumNotAverageGroup(minifsdp.ShardGroup):
    """WRONG on purpose: reduce-scatters the sum of the ranks' gradients, not their average."""

    def reduce_scatter(self):
        trainable = [handle for handle in self.params if handle.full.requires_grad]
        flat = torch.cat([h.full.grad.to(torch.float32).view(self.world_size, -1) for h in trainable], dim=1)
        mine = torch.empty(flat.shape[1])
        minifsdp.reduce_scatter_single(mine, flat.reshape(-1))
        for handle, part in zip(trainable, mine.split([h.shard.numel() for h in trainable])):
            handle.shard.grad = part.view_as(handle.shard)
            handle.full.grad = None
        self.release()
        self.gradients_pending = set(trainable)


class SumNotAverageFSDP(minifsdp.FSDP):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for group in self.groups:
            group.__class__ = SumNotAverageGroup  # the hooks call group.reduce_scatter(): now the wrong one


class NoRegatherFSDP(minifsdp.FSDP):
    """WRONG on purpose: frees the weights after forward and never gathers them again for backward."""

    def _before_backward(self, unit):
        pass


# --- cases: each returns (passed, details) on this rank ----------------------------------------------------


def sgd_matches_single(ctx):
    difference, error = train_and_compare(ctx, char_transformer, SGD)
    return difference <= TOLERANCE, f"max_rel_diff {difference:.2e} <= {TOLERANCE:.1e} {error}"


def per_block(model, **kwargs):
    """FSDP with each transformer block one unit (lab 8's configuration, as fully_shard(block) does)."""
    return minifsdp.FSDP(model, units=list(model.blocks), **kwargs)


def adamw_matches_single(ctx):
    """With units: one message per block and one for the rest (SGD above: one per weight matrix)."""
    difference, error = train_and_compare(ctx, char_transformer, ADAMW, wrap=per_block)
    return difference <= TOLERANCE, f"max_rel_diff {difference:.2e} <= {TOLERANCE:.1e} {error}"


def gradients_local_float32_and_replicated_equal(ctx):
    """After finish: every trainable parameter of .module has a float32 .grad of its own (local) shape, and
    the replicated parameters' gradients are bit-for-bit the same on every rank."""
    captured = {}
    fsdp_run(ctx, char_transformer, SGD, steps=1, on_step=lambda model: captured.update(model=model))
    model = captured["model"]
    params = [p for p in model.module.parameters() if p.requires_grad]
    shapes_ok = all(p.grad is not None and p.grad.dtype == torch.float32 and p.grad.shape == p.shape for p in params)
    replicated = torch.cat([p.grad.flatten() for p in model.replicated])
    everyone = [torch.empty_like(replicated) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, replicated)
    equal = all(torch.equal(everyone[0], other) for other in everyone)
    sliced = sum(p in model.sharded for p in params)
    return shapes_ok and equal, (
        f"{len(params)} trainable ({sliced} slices, {len(model.replicated)} replicated), local float32 grads: "
        f"{shapes_ok}; replicated grads equal on all ranks: {equal}"
    )


def tied_weight_gathered_once(ctx):
    """The tied embedding is one slice, still shared by both modules; per step one gather in backward and one
    reduce-scatter, however many modules use it (units=None: each module is its own unit, so forward
    gathers it once per using module; with both users in one unit, once)."""
    found = []
    for units in (None, "root"):
        model = minifsdp.FSDP(build(char_transformer), units=None if units is None else [])
        handle = model.sharded[model.module.token_embedding.weight]
        group = next(g for g in model.groups if handle in g.params)
        counts = {"gather": 0, "reduce_scatter": 0}
        original_gather, original_scatter = group.gather, group.reduce_scatter

        def counting_gather():
            counts["gather"] += not group.gathered  # gathers that really communicate
            original_gather()

        def counting_scatter():
            counts["reduce_scatter"] += 1
            original_scatter()

        group.gather, group.reduce_scatter = counting_gather, counting_scatter
        inputs, targets = batch(0)
        logits = model(mine(ctx, inputs))
        forward_gathers = counts["gather"]
        loss_of(logits, mine(ctx, targets)).backward()
        model.finish_gradient_synchronization()
        still_tied = model.module.head.weight is model.module.token_embedding.weight
        found.append((still_tied, forward_gathers, counts["gather"] - forward_gathers, counts["reduce_scatter"]))
    expected = [(True, TIED_USES, 1, 1), (True, 1, 1, 1)]
    return found == expected, "; ".join(
        f"units={units}: still tied {tied}, gathers in forward {fwd}, in backward {bwd}, reduce-scatters {rs}"
        for units, (tied, fwd, bwd, rs) in zip(("None", "[] (one root unit)"), found)
    )


def full_weights_only_around_use(ctx):
    """Inside a module's forward its weight is full-size, and it is the only full weight in memory; after
    forward, and after backward (before finish_gradient_synchronization()), no full weight is left."""
    model = minifsdp.FSDP(build(char_transformer))
    gathered = lambda: sum(handle.gathered for handle in model.sharded.values())  # noqa: E731 (units=None)
    shapes, held = {}, []
    # Pre-hooks registered after FSDP's run after its gather: they see what the module's forward sees.
    for name, module in model.module.named_modules():
        module.register_forward_pre_hook(lambda module, inputs, name=name: held.append(gathered()))
    mlp_in = model.module.blocks[0].mlp[0]
    mlp_in.register_forward_pre_hook(lambda module, inputs: shapes.update(forward=tuple(module.weight.shape)))
    inputs, targets = batch(0)
    logits = model(mine(ctx, inputs))
    after_forward = gathered()
    loss_of(logits, mine(ctx, targets)).backward()
    after_backward = gathered()  # freed by the reduce-scatter hooks, not by finish_gradient_synchronization()
    model.finish_gradient_synchronization()
    shapes["outside"] = tuple(mlp_in.weight.shape)
    ok = shapes == {"forward": (64, 16), "outside": (64 // ctx.world_size, 16)} and max(held) == 1 and after_forward == after_backward == 0
    return ok, (
        f"mlp weight in forward {shapes['forward']}, outside {shapes['outside']}; full weights held: at most "
        f"{max(held)} during forward, {after_forward} after forward, {after_backward} after backward"
    )


def two_blocks() -> nn.Module:
    return CharTransformer(VOCAB, context=TIME, d_model=16, n_layers=2, n_heads=2)


def block_units_gather_only_around_use(ctx):
    """Lab 8's configuration, units=list(model.blocks), on two blocks: at every module boundary of forward and
    backward (ddp_course.sharding.at_module_boundaries) the full weights held are at most the root unit's (it
    holds the tied embedding, gathered from the head's backward to the embedding's) plus one block's; none
    after forward or after backward; and both blocks were gathered at some point (the bound is reached)."""
    bare = build(two_blocks)
    model = minifsdp.FSDP(bare, units=list(bare.blocks))
    group_bytes = {id(group): sum(h.full_bytes for h in group.params) for group in model.groups}
    root = next(g for g in model.groups if model.sharded[bare.token_embedding.weight] in g.params)
    bound = group_bytes[id(root)] + max(b for key, b in group_bytes.items() if key != id(root))
    held = []

    def sample(label):
        held.append((label, storage_bytes(handle.full for handle in model.sharded.values())))

    inputs, targets = batch(0)
    with at_module_boundaries(bare, sample):
        logits = model(mine(ctx, inputs))
        after_forward = storage_bytes(handle.full for handle in model.sharded.values())
        loss_of(logits, mine(ctx, targets)).backward()
    after_backward = storage_bytes(handle.full for handle in model.sharded.values())
    model.finish_gradient_synchronization()
    peak = max(size for _, size in held)
    in_backward = max(size for label, size in held if label.startswith("backward"))
    ok = peak == bound and in_backward == bound and after_forward == after_backward == 0
    return ok, (
        f"full weights held at most {peak} B (in backward {in_backward} B); root unit + largest block = {bound} B "
        f"(all units: {sum(group_bytes.values())} B); after forward {after_forward} B, after backward {after_backward} B"
    )


def float16_matches_float16_reference(ctx):
    """compute_dtype=float16 against one process computing in float16 with float32 master weights."""
    reference16 = reference_weights(HalfNet, SGD, compute_dtype=torch.float16, micro_batches=ctx.world_size)
    reference32 = reference_weights(HalfNet, SGD)
    global_batch16 = reference_weights(HalfNet, SGD, compute_dtype=torch.float16)  # shown, not asserted
    seen = {}
    model = minifsdp.FSDP(build(HalfNet), compute_dtype=torch.float16)
    model.module.up.register_forward_pre_hook(lambda module, inputs: seen.update(dtype=module.weight.dtype))
    optimizer = torch.optim.SGD(model.parameters(), **SGD[1])
    for step in range(STEPS):
        inputs, targets = batch(step)
        optimizer.zero_grad()
        loss_of(model(mine(ctx, inputs)), mine(ctx, targets)).backward()
        model.finish_gradient_synchronization()
        optimizer.step()
    master = {p.dtype for p in model.parameters()} | {p.grad.dtype for p in model.parameters()}
    full = model.gather_full_params()
    difference = max_relative_difference(full, reference16)
    versus32 = max_relative_difference(full, reference32)
    in_effect = versus32 > HALF_TOLERANCE  # float16 really was used: the same bound rejects the float32 run
    ok = difference <= HALF_TOLERANCE and in_effect and seen["dtype"] == torch.float16 and master == {torch.float32}
    return ok, (
        f"max_rel_diff {difference:.2e} <= {HALF_TOLERANCE:.0e}; to the float32 reference {versus32:.2e} "
        f"> {HALF_TOLERANCE:.0e}; to float16 on the whole batch at once "
        f"{max_relative_difference(full, global_batch16):.2e}; "
        f"weights in forward {seen['dtype']}, slices and grads {sorted(str(d) for d in master)}"
    )


def negative_sum_not_average(ctx):
    """With SGD: AdamW would hide a constant factor in the gradient (its update is scale-invariant)."""
    difference, error = train_and_compare(ctx, char_transformer, SGD, wrap=SumNotAverageFSDP)
    limit = 100 * TOLERANCE
    return difference > limit, f"the comparison fails: max_rel_diff {difference:.2e} > {limit:.1e} {error}"


def negative_no_regather(ctx):
    difference, error = train_and_compare(ctx, char_transformer, SGD, wrap=NoRegatherFSDP)
    limit = 100 * TOLERANCE
    return difference > limit, f"the comparison fails: max_rel_diff {difference:.2e} > {limit:.1e} {error}"


def optimizer_state_is_the_slices(ctx):
    """AdamW keeps two float32 moments per element it steps (and a step count per tensor): here the slices."""
    model, optimizer = fsdp_run(ctx, char_transformer, ADAMW, steps=1)
    reference = build(char_transformer)
    full_elements = sum(p.numel() for p in reference.parameters() if p.dim() >= 2)
    replicated_elements = sum(p.numel() for p in reference.parameters() if p.dim() < 2)
    slice_elements = sum(p.numel() for p in model.sharded)
    state = optimizer.state.values()
    moment_bytes = sum(s[k].numel() * s[k].element_size() for s in state for k in ("exp_avg", "exp_avg_sq"))
    expected = 2 * 4 * (slice_elements + replicated_elements)
    padded_share = rows_share(model, ctx.world_size)
    ok = moment_bytes == expected and slice_elements <= padded_share
    unsharded = 2 * 4 * (full_elements + replicated_elements)
    return ok, (
        f"moments {moment_bytes} B = 2 x 4 B x ({slice_elements} slice + {replicated_elements} replicated elements); "
        f"unsharded {unsharded} B, ratio {moment_bytes / unsharded:.3f} (1/{ctx.world_size} = {1 / ctx.world_size:.3f} "
        "plus padding and replicated)"
    )


def rows_share(model, world_size) -> int:
    """Elements per rank if every matrix is split into world_size slices of ceil(rows / world_size) rows."""
    return sum(minifsdp.rows_per_rank(h.shape[0], world_size) * h.shard[0].numel() for h in model.sharded.values())


# --- the exercise, part by part ----------------------------------------------------------------------------


def module_from_text(text: str, name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(text, f"<{name}>", "exec"), module.__dict__)
    return module


def exercise_outcome(ctx, module) -> str:
    """'ok', or the message of the first TODO one training step reaches."""
    try:
        fsdp_run(ctx, char_transformer, SGD, wrap=module.FSDP, steps=1)[0].gather_full_params()
    except NotImplementedError as stop:
        return str(stop)
    return "ok"


def exercise_refuses_part_by_part(ctx):
    """The committed exercise stops at part 1; with parts 1..k-1 solved it stops at part k; fully solved, ok."""
    solution = SOLUTION.read_text()
    header = exercise_header("solutions/minifsdp.py", "labs/minifsdp.py")
    outcomes = [exercise_outcome(ctx, import_script(EXERCISE, "minifsdp_exercise"))]
    for first_todo in (2, 3):
        text = make_exercise(solution, header, parts=range(first_todo, 4))
        outcomes.append(exercise_outcome(ctx, module_from_text(text, f"minifsdp_from_part_{first_todo}")))
    expected = ["TODO(lab 8, part 1): ", "TODO(lab 8, part 2): ", "TODO(lab 8, part 3): "]
    ok = all(outcome.startswith(prefix) for outcome, prefix in zip(outcomes, expected))
    return ok, " | ".join(outcome[:60] for outcome in outcomes)


CASES = [
    sgd_matches_single,
    adamw_matches_single,
    gradients_local_float32_and_replicated_equal,
    tied_weight_gathered_once,
    full_weights_only_around_use,
    block_units_gather_only_around_use,
    float16_matches_float16_reference,
    negative_sum_not_average,
    negative_no_regather,
    optimizer_state_is_the_slices,
    exercise_refuses_part_by_part,
]


def run_cases(ctx) -> int:
    """Run every case on every rank; rank 0 prints one line per case. Returns the number of failures."""
    failures = 0
    for case in CASES:
        passed, details = case(ctx)
        everyone = [None] * ctx.world_size
        dist.all_gather_object(everyone, (passed, details))
        all_passed = all(rank_passed for rank_passed, _ in everyone)
        failures += not all_passed
        if ctx.is_main:
            worst = next((d for p, d in everyone if not p), details)  # a failing rank's details, else rank 0's
            print(f"{'PASS' if all_passed else 'FAIL'} {case.__name__} (world_size {ctx.world_size}): {worst}")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout-s", type=float, default=30.0, help="the longest any collective may wait")
    args = parser.parse_args()
    if args.timeout_s <= 0:
        parser.error(f"--timeout-s must be positive, not {args.timeout_s}")
    ctx = setup_distributed("gloo", timeout_s=args.timeout_s)
    try:
        # Every wrapper is built and dropped inside run_cases(): when it returns none is reachable, and
        # teardown_distributed() collects them (gc) before destroying the group (CONTRIBUTING.md, "gloo teardown").
        failures = run_and_report(ctx)
    finally:
        teardown_distributed()
    return 1 if failures else 0


def run_and_report(ctx) -> int:
    """run_cases(), then rank 0's closing line "done: P passed, F failed". Returns the failures."""
    failures = run_cases(ctx)
    if ctx.is_main:
        print(f"done: {len(CASES) - failures} passed, {failures} failed")
    return failures


if __name__ == "__main__":
    sys.exit(main())
