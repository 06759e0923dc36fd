"""Lab 7, part 2: five ways a DDP job hangs, each ended by a timeout with the tool that names the cause.

Launch from the repository root (2 CPU processes, gloo; a small timeout keeps each run short):

    torchrun --standalone --nproc_per_node=2 labs/lab7_hangs.py --scenario rank0-only --timeout-s 3
    torchrun --standalone --nproc_per_node=2 labs/lab7_hangs.py --scenario shape-mismatch --no-tools
    on GPUs (NCCL; written, not run on a GPU yet): add --backend nccl

Scenarios, the bug each plants, and the tool the script uses on it (--no-tools: the same bug without it):

  rank0-only      rank 0 all-reduces a metric only it logs (a collective inside `if rank == 0:`);
                  the others go on to the end-of-step barrier. Tool: TORCH_DISTRIBUTED_DEBUG=DETAIL
                  (the script turns it on): before every collective the ranks compare its
                  fingerprint, and all raise "Detected mismatch between collectives" at once.
                  Without it: every rank waits --timeout-s and learns only that a receive timed out.
  shape-mismatch  every rank all-reduces, rank 0 four numbers, the others three. Tool: DETAIL names
                  the shapes. Without it, on gloo, rank 1's all-reduce RETURNS a wrong sum with no
                  error (the script's own check of the sum says so) while rank 0 waits until the timeout.
  missing-rank    the last rank is busy for 1.5 x --timeout-s (a stuck data loader, say). Tool: rank 0
                  waits in dist.monitored_barrier, which names the ranks that did not arrive. Without
                  it: a plain barrier times out without saying who is missing.
  uneven          DDP on uneven inputs: rank r has r + 2 batches. The rank with fewer batches waits at
                  the end-of-epoch barrier while the other waits in the gradient all-reduce of its
                  extra step, until --timeout-s. Tool: the timeout, and the batch counts every rank
                  all-gathers before training (a check worth keeping in your own jobs).
  uneven-join     the same inside Join([model]): it finishes, with identical weights on every rank,
                  equal to the Join rule (joined ranks add zero gradients) computed in one process.

Every scenario first meets at a barrier with a long timeout (starting processes on a busy machine can
take many seconds: that is not the bug), then runs on a group whose collectives give up after
--timeout-s. What you should see: every broken scenario exits with a non-zero status within 2 x --timeout-s, and
each rank that failed prints one line `[rank r] stopped in WHERE: KIND: CAUSE` (ddp_course.faults
names the kinds). The first rank to give up reports the timeout; its peer may instead see the
connection close ("peer gone"): read the earliest error of a job, not the last.

On NCCL (--backend nccl) the same bugs fail differently (lecture 6, section 2): collectives are
queued on the GPU and return at once, and a timeout is found by the watchdog thread, which aborts
the process (SIGABRT, no Python exception) unless TORCH_NCCL_BLOCKING_WAIT=1; the "stopped" lines
may not be printed. DETAIL also works on NCCL; monitored_barrier needs gloo, so on NCCL it runs on
a gloo side group.
"""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.checkpoint import atomic_write_json
from ddp_course.cli import CourseArgumentParser, CourseError, positive_float
from ddp_course.compare import max_relative_difference
from ddp_course.distributed import BACKENDS, log, log_error, setup_distributed, teardown_distributed
from ddp_course.faults import diagnose
from ddp_course.seeding import seed_everything

SCENARIOS = ("rank0-only", "shape-mismatch", "missing-rank", "uneven", "uneven-join")
# The debugging aid each scenario uses unless --no-tools (the uneven ones rely on the timeout itself).
TOOLS = {"rank0-only": "DETAIL", "shape-mismatch": "DETAIL", "missing-rank": "monitored_barrier",
         "uneven": "timeout", "uneven-join": "Join"}  # fmt: skip
BATCH, FEATURES, LR = 4, 8, 0.1
# Starting the processes and joining the job can take many seconds on a busy machine: the default
# group waits this long, and only the scenario's own collectives use --timeout-s (scenario_group).
START_TIMEOUT_S = 120.0


def parse_args(argv=None):
    parser = CourseArgumentParser(prog="lab7_hangs.py", description="DDP hangs that end with a diagnosis (see the docstring).")
    parser.add_argument("--scenario", choices=SCENARIOS, required=True, help="which bug to plant")
    parser.add_argument("--timeout-s", type=positive_float, default=5.0, help="how long a rank waits for a peer")
    parser.add_argument("--no-tools", action="store_true", help="run the bug without its debugging tool")
    parser.add_argument("--backend", choices=BACKENDS, default="gloo", help="gloo (the messages above); nccl: see the docstring")
    parser.add_argument("--json", help="rank 0 writes its outcome here (its line, and how long its failed collective waited)")
    return parser.parse_args(argv)


class Stopped(Exception):
    """A rank's scenario ended in a diagnosed failure: `line` says where and why."""

    def __init__(self, line: str, waited_s: float):
        super().__init__(line)
        self.line, self.waited_s = line, waited_s  # waited_s: time spent in the collective that failed


def waiting(where: str, collective, rank: int):
    """Run one collective; turn its failure into Stopped('stopped in WHERE: KIND: CAUSE')."""
    entered = time.perf_counter()
    try:
        return collective()
    except RuntimeError as error:
        raise Stopped(f"stopped in {where}: {diagnose(error, rank)}", time.perf_counter() - entered) from None


def rank0_only(ctx, group, args) -> str:
    metric = torch.ones(4, device=ctx.device)
    if ctx.rank == 0:  # the bug: a collective behind a rank test
        waiting("the all-reduce only rank 0 calls", lambda: dist.all_reduce(metric, group=group), ctx.rank)
    waiting("the end-of-step barrier", lambda: dist.barrier(group), ctx.rank)
    return "no error"  # not reached: the ranks never agree


def shape_mismatch(ctx, group, args) -> str:
    size = 4 if ctx.rank == 0 else 3  # the bug: a tensor sized from something that differs per rank
    values = torch.full((size,), float(ctx.rank + 1), device=ctx.device)
    waiting("the all-reduce", lambda: dist.all_reduce(values, group=group), ctx.rank)
    expected = float(sum(range(1, ctx.world_size + 1)))  # every rank's value, summed
    if not torch.all(values == expected):
        # gloo returned without an error: only a check of the numbers notices (no exception, no hang).
        log(f"wrong result with no error: the all-reduce returned {values.tolist()}, every element should be {expected}", every_rank=True)
    waiting("the end-of-step barrier", lambda: dist.barrier(group), ctx.rank)
    return "no error"


def missing_rank(ctx, group, args) -> str:
    busy_rank = ctx.world_size - 1
    if ctx.rank == busy_rank:
        log("busy for 1.5 x --timeout-s before the barrier (a stuck data loader, say)", every_rank=True)
        time.sleep(1.5 * args.timeout_s)  # torchrun stops this rank as soon as rank 0 fails
    if args.no_tools:
        waiting("the barrier", lambda: dist.barrier(group), ctx.rank)
    else:
        # Rank 0 collects every other rank's arrival and names the missing ones. gloo only: an NCCL
        # job runs it on a gloo side group (made before the bug, as every rank must create it).
        waiting("monitored_barrier", lambda: dist.monitored_barrier(group, timeout=timedelta(seconds=args.timeout_s)), ctx.rank)
    return "no error"


def batches_for(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank r's r + 2 batches of a fixed linear-regression problem (the same on every run)."""
    generator = torch.Generator().manual_seed(1000 + rank)
    batches = []
    for _ in range(rank + 2):
        inputs = torch.randn(BATCH, FEATURES, generator=generator)
        batches.append((inputs, inputs.sum(dim=1, keepdim=True)))  # target: the sum of the features
    return batches


def join_rule_reference(world_size: int) -> dict[str, torch.Tensor]:
    """One process applying what Join promises: at each step, ranks that have run out of batches
    contribute zero gradients to an average still divided by world_size (torch's default,
    divide_by_initial_world_size=True), and every rank ends with the same weights."""
    seed_everything(0)
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    per_rank = [batches_for(r) for r in range(world_size)]
    for step in range(max(map(len, per_rank))):
        summed = [torch.zeros_like(p) for p in model.parameters()]
        for batches in per_rank:
            if step < len(batches):
                model.zero_grad()
                torch.nn.functional.mse_loss(model(batches[step][0]), batches[step][1]).backward()
                summed = [s + p.grad / world_size for s, p in zip(summed, model.parameters())]
        for p, g in zip(model.parameters(), summed):
            p.grad = g
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def uneven(ctx, group, args) -> str:
    batches = batches_for(ctx.rank)
    if not args.no_tools:
        counts = [None] * ctx.world_size
        # cheap, before training: names the imbalance
        waiting("the batch-count all-gather", lambda: dist.all_gather_object(counts, len(batches), group=group), ctx.rank)
        log(f"batches per rank: {counts}" + (" - uneven: DDP needs Join" if len(set(counts)) > 1 else ""))
    seed_everything(0)  # identical initial weights on every rank
    model = torch.nn.Linear(FEATURES, 1).to(ctx.device)
    ddp_model = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None, process_group=group)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=LR)
    steps = 0
    with Join([ddp_model], enable=args.scenario == "uneven-join"):
        for inputs, targets in batches:
            loss = torch.nn.functional.mse_loss(ddp_model(inputs.to(ctx.device)), targets.to(ctx.device))
            optimizer.zero_grad(set_to_none=True)
            waiting(f"the gradient all-reduce of step {steps + 1} (of {len(batches)})", loss.backward, ctx.rank)
            optimizer.step()
            steps += 1
    waiting(f"the end-of-epoch barrier, after its {steps} steps", lambda: dist.barrier(group), ctx.rank)
    return join_summary(model, steps, ctx)


def join_summary(model, steps: int, ctx) -> str:
    """Steps per rank, whether every rank holds the same weights, and whether they follow the Join rule."""
    steps_per_rank = [None] * ctx.world_size
    dist.all_gather_object(steps_per_rank, steps)
    weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, weights)
    identical = all(all(torch.equal(w[k], weights[k]) for k in weights) for w in everyone)
    # float32: a few roundings per step (eps = 1.2e-7) over at most world_size + 1 steps
    follows_rule = max_relative_difference(weights, join_rule_reference(ctx.world_size)) < 1e-5
    return (
        f"finished: steps per rank {steps_per_rank}; identical weights on every rank: {identical}; "
        f"equal to the Join rule computed in one process: {follows_rule}"
    )


def scenario_group(ctx, args):
    """Every rank, on a group whose collectives give up after --timeout-s (gloo for monitored_barrier)."""
    dist.barrier()  # everyone has started (default group: START_TIMEOUT_S), so a slow start is not the bug
    backend = "gloo" if args.scenario == "missing-rank" else ctx.backend
    return dist.new_group(backend=backend, timeout=timedelta(seconds=args.timeout_s))


RUNNERS = {"rank0-only": rank0_only, "shape-mismatch": shape_mismatch, "missing-rank": missing_rank,
           "uneven": uneven, "uneven-join": uneven}  # fmt: skip


def main(args) -> int:
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        log_error("every scenario needs at least 2 ranks: torchrun --standalone --nproc_per_node=2 labs/lab7_hangs.py ...")
        return 1
    if TOOLS[args.scenario] == "DETAIL" and not args.no_tools:
        dist.set_debug_level(dist.DebugLevel.DETAIL)  # = TORCH_DISTRIBUTED_DEBUG=DETAIL, before the group exists
    if args.scenario.startswith("uneven"):
        # DDP's constructor imports torch._dynamo: seconds of CPU on a busy machine, and not equally fast
        # on every rank. Imported now, before the start-up barrier's long timeout, that time cannot end a
        # healthy rank's wait in the constructor's first collective, which has the short --timeout-s.
        import torch._dynamo  # noqa: F401
    try:
        ctx = setup_distributed(args.backend, timeout_s=START_TIMEOUT_S)
        group = scenario_group(ctx, args)
        tool = "off" if args.no_tools else TOOLS[args.scenario]
        log(f"config: scenario={args.scenario} backend={ctx.backend} world_size={ctx.world_size} timeout_s={args.timeout_s:g} tool={tool}")
        try:
            outcome, status, waited_s = RUNNERS[args.scenario](ctx, group, args), 0, None
            log(outcome)
        except Stopped as stop:
            outcome, status, waited_s = stop.line, 1, stop.waited_s
            log(outcome, every_rank=True)
        if args.json and ctx.is_main:
            atomic_write_json({"scenario": args.scenario, "tool": tool, "status": status, "line": outcome, "seconds_waited": waited_s}, args.json)
        return status
    except CourseError as error:
        log_error(str(error))
        return 1
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_args()))
