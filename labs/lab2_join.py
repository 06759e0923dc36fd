"""Lab 2, part 2: DDP on uneven inputs - the hang, and the fix with Join.

DistributedSampler pads the data so that every rank runs the same number of steps. Data split any
other way is usually uneven: ranks that read their own files, or a filter applied after sharding.
Here rank r trains on a slice of the training digits proportional to r + 1 (with 2 ranks, a third
and two thirds), so the ranks run different numbers of steps. DDP all-reduces the gradients in
every backward(): when the rank with fewer batches stops, the others wait in their next all-reduce
for a peer that never comes.

    the hang (fails after --timeout-s):  torchrun --standalone --nproc_per_node=2 labs/lab2_join.py
    the fix:                             torchrun --standalone --nproc_per_node=2 labs/lab2_join.py --join
    3 ranks, 3 different lengths:        torchrun --standalone --nproc_per_node=3 labs/lab2_join.py --join
    on GPUs with NCCL (see below):       torchrun --standalone --nproc_per_node=2 labs/lab2_join.py --backend nccl

It runs on gloo (CPU processes) by default, also on a GPU machine, because the demo relies on
gloo's synchronous errors: a gloo collective blocks the Python thread, so each rank stops at the
line it waits in, and when --timeout-s expires the wait raises a RuntimeError that the script
catches to say where. NCCL works differently (see the lab 2 sheet, section 7): its collectives are
queued on the GPU and return at once, so the CPU runs ahead - rank 1 would likely run all of its
steps and reach the barrier - and on NCCL a barrier is itself a one-element all-reduce, which can
pair with the other rank's gradient all-reduce. A timeout is then found by ProcessGroupNCCL's
watchdog thread, which tears the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING) instead of raising
in Python, so the "stopped ..." lines are never printed. `--backend nccl` runs the demo on GPUs
anyway and prints what to expect instead (not run by the course's tests: no GPU there).

With --join the training loop runs inside `Join([ddp_model])`. A rank that runs out of batches
joins early and, until every rank has joined, answers its peers' all-reduces with zero gradients;
when the last rank finishes, DDP copies its weights to every rank (torch's DistributedDataParallel
.join_hook documents both). What you should see with 2 ranks: without --join, each rank says in one
line where it stopped - rank 0, with fewer batches, at the end-of-epoch barrier, rank 1 in the
all-reduce of its step 16 - and why (a timeout after --timeout-s seconds, or a connection its peer
closed on giving up), and the job exits with status 1; with --join, the steps each rank ran (15
and 30), identical weights on every rank, and the held-out accuracy of the trained model.

Only training waits for at most --timeout-s. Starting the ranks and loading the data can take longer
on a busy machine, and a rank that starts late is not the hang this lab shows: the process group
forms with a generous timeout (START_TIMEOUT_S), and DDP and the collectives after it run on
training_group(--timeout-s), made once every rank has started (ddp_course/distributed.py).
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset

from ddp_course.checkpoint import atomic_write_json
from ddp_course.cli import CourseArgumentParser, CourseError, positive_float, positive_int
from ddp_course.data import load_digits
from ddp_course.distributed import BACKENDS, START_TIMEOUT_S, log, log_error, setup_distributed, teardown_distributed, training_group
from ddp_course.faults import first_line
from ddp_course.models import DigitsCNN
from ddp_course.seeding import seed_everything


def parse_args(argv=None):
    parser = CourseArgumentParser(prog="lab2_join.py", description="DDP on uneven inputs, with and without Join.")
    parser.add_argument("--join", action="store_true", help="run the training loop inside Join([ddp_model])")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="per rank")
    parser.add_argument("--lr", type=positive_float, default=0.05)
    parser.add_argument("--backend", choices=BACKENDS, default="gloo", help="gloo (see the docstring for nccl)")
    parser.add_argument("--timeout-s", type=positive_float, default=10.0, help="how long a rank waits for a peer in training")
    parser.add_argument("--json", help="rank 0 writes the steps per rank, the weight check and the accuracy here")
    return parser.parse_args(argv)


def uneven_slice(n: int, rank: int, world_size: int) -> range:
    """Rank r's contiguous slice of n samples, sized in proportion to r + 1 (deliberately uneven)."""
    total_weight = world_size * (world_size + 1) // 2
    start = n * (rank * (rank + 1) // 2) // total_weight
    end = n * ((rank + 1) * (rank + 2) // 2) // total_weight
    return range(start, end)


NCCL_NOTE = (
    "note: backend=nccl. This demo's 'stopped ...' lines rely on gloo's synchronous errors. On NCCL "
    "collectives are queued on the GPU and the CPU runs ahead (rank 1 may reach the end-of-epoch barrier, "
    "which NCCL runs as a one-element all-reduce that can pair with rank 0's gradient all-reduce); after "
    "--timeout-s the NCCL watchdog aborts the processes (SIGABRT, TORCH_NCCL_ASYNC_ERROR_HANDLING) with no "
    "Python error. TORCH_NCCL_BLOCKING_WAIT=1 makes the wait raise in Python instead; "
    "TORCH_FR_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 (the flight recorder) records which collective each rank was in."
)


def same_weights_everywhere(model, ctx, group) -> bool:
    """True when every rank holds exactly rank 0's parameters."""
    mine = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, mine, group=group)
    return all(torch.equal(theirs, everyone[0]) for theirs in everyone)


def train(ctx, args) -> dict | None:
    digits = load_digits()
    shard = uneven_slice(len(digits.train), ctx.rank, ctx.world_size)
    generator = torch.Generator().manual_seed(ctx.rank)  # each rank shuffles its own slice
    loader = DataLoader(Subset(digits.train, shard), batch_size=args.batch_size, shuffle=True, generator=generator)
    seed_everything(0)  # identical initial weights on every rank
    model = DigitsCNN().to(ctx.device)
    group = training_group(args.timeout_s)  # from here on a rank gives up after --timeout-s
    ddp_model = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None, process_group=group)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=args.lr, momentum=0.9)
    log(f"{len(shard)} samples, {len(loader)} batches of up to {args.batch_size}", every_rank=True)

    steps = 0
    try:
        # enable=False makes Join a no-op: the same loop, with and without the fix.
        with Join([ddp_model], enable=args.join):
            for images, labels in loader:
                loss = F.cross_entropy(ddp_model(images.to(ctx.device)), labels.to(ctx.device))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # all-reduces the gradients: every rank must take part
                optimizer.step()
                steps += 1
        dist.barrier(group=group)  # the end of the epoch, where a rank that ran out of batches waits
    except RuntimeError as error:  # a collective timed out, or a peer that gave up closed its connection
        where = "at the end-of-epoch barrier" if steps == len(loader) else f"in the gradient all-reduce of step {steps + 1}"
        log(f"stopped {where} (of {len(loader)} batches): {first_line(str(error))}", every_rank=True)
        return None
    steps_per_rank = torch.zeros(ctx.world_size, dtype=torch.long, device=ctx.device)
    steps_per_rank[ctx.rank] = steps
    dist.all_reduce(steps_per_rank, group=group)  # each rank fills its own slot: the sum gathers them
    return {
        "world_size": ctx.world_size, "join": args.join, "steps_per_rank": steps_per_rank.tolist(),
        "same_weights_on_every_rank": same_weights_everywhere(model, ctx, group),
        "eval_accuracy": held_out_accuracy(model, digits.test, ctx.device),
    }  # fmt: skip


@torch.no_grad()
def held_out_accuracy(model, test_set, device) -> float:
    """Accuracy on all 359 held-out digits (every rank holds the same weights and gets the same answer)."""
    images, labels = test_set.tensors
    return float((model.eval()(images.to(device)).argmax(dim=1) == labels.to(device)).float().mean())


def main(args) -> int:
    try:
        ctx = setup_distributed(args.backend, timeout_s=START_TIMEOUT_S)  # joining may be slow: training_group is short
        if ctx.backend == "nccl" and not args.join:
            log(NCCL_NOTE)
        result = train(ctx, args)  # plain numbers or None: the DDP model is out of reach now
        if result is None:
            return 1
        log(
            f"steps per rank: {result['steps_per_rank']}; identical weights on every rank: "
            f"{result['same_weights_on_every_rank']}; held-out accuracy {result['eval_accuracy']:.2%}"
        )
        if args.json and ctx.is_main:
            atomic_write_json(result, args.json)
        return 0
    except CourseError as error:  # e.g. the process group could not be formed: one line, not a traceback
        log_error(str(error))
        return 1
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_args()))
