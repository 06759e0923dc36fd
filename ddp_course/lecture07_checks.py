"""Lecture 7's exercise checks: each takes the learner's function and prints what it found, then a verdict.

    check_exercise_1(per_rank_bytes)        per-rank model-state bytes under DDP and ZeRO stages 1-3
    check_exercise_2(fsdp_wire_bytes)       the bytes one rank sends in one fully_shard step
    check_exercise_3(shard_gradient)        the backward of an all-gather (why a hand-written one is wrong)

The verdict is the last line printed: "exercise N: correct", "exercise N: not yet - WHY" or, for the
untouched stub (it raises NotImplementedError), "exercise N: not solved yet - fill in NAME above".
tests/test_lecture07.py runs every check on the solutions and on plausible wrong answers.
"""

from __future__ import annotations

import math

import torch

from ddp_course.self_check import Question

# Measured by lectures/scripts/sharding_demos.py (fully_shard, 4 linear layers, 39,312 float32 parameters =
# 157,248 bytes, every layer fully_shard-ed): (world size, reshard_after_forward, bytes per gathered element)
# -> bytes each rank sent in one step. tests/test_lecture07.py checks the job still measures these.
MEASURED_FSDP_WIRE_BYTES = {
    (2, True, 4): 235_872,
    (4, True, 4): 353_808,
    (4, True, 2): 235_872,  # MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    (4, False, 4): 235_872,
}
DEMO_PARAMETER_BYTES = 157_248


def _not_solved(number: int, name: str) -> None:
    print(f"exercise {number}: not solved yet - fill in {name} above")


def _verdict(number: int, problems: list[str]) -> None:
    print(f"exercise {number}: correct" if not problems else f"exercise {number}: not yet - {problems[0]}")


# --- exercise 1 -----------------------------------------------------------------------------------

BYTES = {"parameters": 4, "gradients": 4, "optimizer_state": 8}  # per parameter: float32, and Adam's two moments


def reference_per_rank_bytes(parameter_count: int, world_size: int, stage: str) -> dict[str, int]:
    """float32 parameters and gradients, Adam's two float32 moments; a sharded term is split into
    world_size equal pieces of ceil(parameter_count / world_size) elements (padded)."""
    sharded = {"ddp": (), "zero1": ("optimizer_state",), "zero2": ("optimizer_state", "gradients"),
               "zero3": ("optimizer_state", "gradients", "parameters")}[stage]  # fmt: skip
    per_rank = math.ceil(parameter_count / world_size)
    return {term: size * (per_rank if term in sharded else parameter_count) for term, size in BYTES.items()}


def check_exercise_1(per_rank_bytes) -> None:
    cases = [(39_312, 2), (39_312, 4), (7_000_000_000, 8), (1_000, 3), (12, 1)]
    problems = []
    try:
        for count, world in cases:
            for stage in ("ddp", "zero1", "zero2", "zero3"):
                expected = reference_per_rank_bytes(count, world, stage)
                got = per_rank_bytes(count, world, stage)
                if not isinstance(got, dict) or set(got) != set(expected):
                    problems.append(f"per_rank_bytes must return a dict with keys {sorted(expected)}")
                    break
                unpadded = {term: value * count / math.ceil(count / world) / world if value < BYTES[term] * count else value
                            for term, value in expected.items()}  # fmt: skip
                for term, value in expected.items():
                    # padding or not: anything from the exact split to the padded one is right
                    if not unpadded[term] - 1e-6 <= got[term] <= value + 1e-6:
                        problems.append(f"{stage}, {count:,} parameters on {world} ranks: {term} = {got[term]:,}, expected {value:,}")
        count, world = 39_312, 4
        print(
            "per rank, 39,312 parameters on 4 ranks (bytes):",
            ", ".join(f"{stage} {sum(per_rank_bytes(count, world, stage).values()):,.0f}" for stage in ("ddp", "zero1", "zero2", "zero3")),
        )
    except NotImplementedError:
        return _not_solved(1, "per_rank_bytes")
    _verdict(1, problems)


# --- exercise 2 -----------------------------------------------------------------------------------


def reference_fsdp_wire_bytes(parameter_bytes: float, world_size: int, reshard_after_forward: bool = True,
                              param_dtype_bytes: int = 4) -> float:  # fmt: skip
    """All-gather (in the compute dtype) before forward, again before backward if resharded, and a
    float32 reduce-scatter of the gradients: each costs (N - 1) / N of its full payload per rank."""
    one_way = (world_size - 1) / world_size
    gathered = parameter_bytes * param_dtype_bytes / 4
    return one_way * (gathered * (2 if reshard_after_forward else 1) + parameter_bytes)


def check_exercise_2(fsdp_wire_bytes) -> None:
    problems = []
    try:
        for (world, reshard, dtype_bytes), measured in MEASURED_FSDP_WIRE_BYTES.items():
            got = fsdp_wire_bytes(DEMO_PARAMETER_BYTES, world, reshard, dtype_bytes)
            print(f"  N={world}, reshard_after_forward={reshard}, {dtype_bytes}-byte compute dtype: yours {got:,.0f}, measured {measured:,}")
            if not math.isclose(got, measured, rel_tol=1e-9):
                problems.append(f"N={world}, reshard_after_forward={reshard}, {dtype_bytes}-byte dtype: {got:,.0f} != {measured:,}")
        for args in ((1e9, 8, True, 2), (1e9, 64, False, 4), (1e6, 1, True, 4)):
            if not math.isclose(fsdp_wire_bytes(*args), reference_fsdp_wire_bytes(*args), rel_tol=1e-9, abs_tol=1e-9):
                problems.append(f"fsdp_wire_bytes{args} = {fsdp_wire_bytes(*args):,.0f}, expected {reference_fsdp_wire_bytes(*args):,.0f}")
    except NotImplementedError:
        return _not_solved(2, "fsdp_wire_bytes")
    _verdict(2, problems)


# --- exercise 3 -----------------------------------------------------------------------------------


def simulated_shard_gradients(shard_gradient, world_size: int = 4, rows: int = 8, features: int = 3, seed: int = 0):
    """N ranks simulated in one process: each gathers the full weight from the N shards, computes its own
    loss on its own batch, and autograd gives it d(its loss)/d(full weight). shard_gradient(that list, r)
    is rank r's shard gradient. Returns (the N shard gradients, one process's gradient of the mean loss)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, features, generator=generator, dtype=torch.float64)
    batches = [torch.randn(5, features, generator=generator, dtype=torch.float64) for _ in range(world_size)]

    def loss(full, inputs):
        return torch.tanh(inputs @ full.T).pow(2).mean()

    full_gradients = []
    for inputs in batches:  # rank r: the gathered weight is a fresh leaf; its gradient holds only r's loss
        gathered = weight.clone().requires_grad_(True)
        loss(gathered, inputs).backward()
        full_gradients.append(gathered.grad)
    shards = [shard_gradient([g.clone() for g in full_gradients], r) for r in range(world_size)]
    one_process = weight.clone().requires_grad_(True)
    torch.stack([loss(one_process, inputs) for inputs in batches]).mean().backward()  # the global batch
    return shards, one_process.grad


def check_exercise_3(shard_gradient) -> None:
    problems = []
    try:
        for world in (2, 4):
            shards, expected = simulated_shard_gradients(shard_gradient, world_size=world)
            wanted = expected.chunk(world)
            for rank, (got, want) in enumerate(zip(shards, wanted)):
                if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                    problems.append(f"N={world}: rank {rank}'s shard gradient must have shape {tuple(want.shape)}")
                    break
                if not torch.allclose(got, want, rtol=1e-12, atol=1e-12):
                    problems.append(f"N={world}: rank {rank}'s shard gradient differs from one process's by "
                                    f"{(got - want).abs().max().item():.2e}")  # fmt: skip
                    break
        if problems:
            return _verdict(3, problems)
        shards, expected = simulated_shard_gradients(shard_gradient, world_size=4)
        difference = (torch.cat(shards) - expected).abs().max().item()
        print(f"4 simulated ranks: shard gradients equal one process's gradient (float64, within 1e-12): {difference <= 1e-12}")
    except NotImplementedError:
        return _not_solved(3, "shard_gradient")
    _verdict(3, problems)


# --- the self-check (ddp_course/self_check.py), asked at the end of the Summary --------------------------
# Sections 1 and 7: 7 B float32 parameters with Adam on 8 ranks, 40 GB per rank left for the model state.
# DDP holds 16P = 112 GB, ZeRO-1 8P + 8P/8 = 63 GB, ZeRO-2 4P + 12P/8 = 38.5 GB: the first that fits, and
# it sends DDP's bytes where ZeRO-3 (14 GB) sends 1.5 times them. tests/test_lecture07.py recomputes it.
SELF_CHECK = Question(
    name="self-check",
    expected=2,
    why="ZeRO-2 holds 4P + 12P/N = 38.5 GB, ZeRO-1 63 GB; ZeRO-3 fits too but sends 1.5 times DDP's bytes",
    hint="reread section 1 (what each rank holds) for each stage's bytes at N = 8, then section 7 (which one to "
    "choose): of the stages that fit, which sends the fewest bytes?",
    relative_tolerance=0.0,
)


def draw_held_bytes(memory: dict, stages: dict[str, str], parameters: int) -> None:
    """Section 1's bars: the kB each rank holds after a step (parameters, gradients, optimizer state), per stage
    and rank, on 2 and 4 ranks. memory is the job report's {"STAGE/N": [per-rank {"held": {...}}]}."""
    import matplotlib.pyplot as plt  # only when drawing

    colours = {"parameters": "tab:blue", "gradients": "tab:orange", "optimizer_state": "tab:green"}
    _, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
    for axis, n in zip(axes, (2, 4)):
        position, ticks, labels = 0, [], []
        for stage, label in stages.items():
            for r, rank in enumerate(memory[f"{stage}/{n}"]):
                bottom = 0
                for term, colour in colours.items():
                    kb = rank["held"][term] / 1e3
                    axis.bar(position, kb, bottom=bottom, color=colour, label=term if position == 0 else None)
                    bottom += kb
                ticks.append(position)
                labels.append(f"r{r}")
                position += 1
            axis.text(position - n / 2 - 0.5, 16 * parameters / 1e3 * 1.03, label.split(" ")[0], ha="center", fontsize=9)
            position += 1
        axis.set_xticks(ticks, labels, fontsize=7)
        axis.set_title(f"N = {n} ranks")
    axes[0].set_ylabel("kB held per rank")
    axes[0].legend(loc="upper right", fontsize=8)
    plt.suptitle("What each rank holds after a step (measured): DDP, ZeRO-1, ZeRO-2, ZeRO-3")
    plt.tight_layout()
