"""Lab 1: run every collective for real, check each result, then benchmark all-reduce.

Launch from the repository root:

    laptop, 2 CPU processes (gloo):  torchrun --standalone --nproc_per_node=2 labs/lab1_collectives.py
    ... with the benchmark:           torchrun --standalone --nproc_per_node=2 labs/lab1_collectives.py \
                                          --bench --json bench.json --plot bench.png
    N GPUs on one machine (NCCL):     torchrun --standalone --nproc_per_node=N labs/lab1_collectives.py --bench
    2 nodes x 8 GPUs (on each node):  torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
                                          --rdzv-endpoint=NODE0_HOST:29400 --rdzv-id=lab1 \
                                          labs/lab1_collectives.py --bench

What you should see: one PASS line per collective (SKIP with a reason where one cannot run) and
"10/10 collectives passed"; any FAIL ends the job with exit status 1. Rank r contributes the
float32 values 100(r+1) + [0, 1, ...], so every rank can work out what each collective must
return. With --bench, rank 0 then prints one row per message size: the time of one all-reduce
(the median over --iters timed calls of the slowest rank's time), algbw = bytes / time and
busbw = algbw x 2(N-1)/N, as NVIDIA's nccl-tests define them (doc/PERFORMANCE.md). Two gloo ranks
on a 2-core CPU reach roughly 0.5-2 GB/s busbw. Depending on the machine, busbw either keeps
rising to 64 MiB or peaks around 1-2 MiB, where gloo's buffers and socket copies still fit in the
CPU caches, and settles lower beyond (memory-bound): estimate large all-reduces from the largest sizes.

On GPUs (NCCL; not run by this course's tests, which have no GPU) each timed call is a Python
call, a c10d work object and a kernel launch, then a synchronize: rows below about 1 MiB measure
that host-side path more than NCCL. For NCCL's own figure run NVIDIA's nccl-tests:
`all_reduce_perf -b 4K -e 1G -f 2 -g <gpus>`.

Self-test of the checker: --corrupt-rank R adds 0.5 to the first value rank R contributes after
the expected results are fixed. Every collective that reads R's data must then FAIL (broadcast
from rank 0 and the barrier still PASS) and the job exits with status 1. The tests use it to prove
that a PASS means something.
"""

import argparse
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ddp_course.checkpoint import atomic_write_json
from ddp_course.cli import CourseArgumentParser, CourseError, non_negative_int, positive_float, positive_int
from ddp_course.distributed import BACKENDS, log, log_error, setup_distributed, teardown_distributed

BARRIER_DELAY_S = 0.2  # the last rank reaches the barrier this late on purpose
# torch 2.14 renamed reduce_scatter_tensor to reduce_scatter_single (the old name warns); older torch has only the old.
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def byte_size(text: str) -> int:
    """'4096', '64K', '64M', '1G' -> bytes (binary units), a whole number of float32 values."""
    match = re.fullmatch(r"(\d+)([KMG]?)", text.strip().upper())
    value = int(match.group(1)) * 1024 ** " KMG".index(match.group(2) or " ") if match else 0
    if value < 4 or value % 4:
        raise argparse.ArgumentTypeError(f"must be a multiple of 4 bytes such as 4096, 64K or 1G, got {text!r}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    parser = CourseArgumentParser(prog="lab1_collectives.py", description="Check every collective; benchmark all-reduce.")
    parser.add_argument("--chunk", type=positive_int, default=2, help="values per reduce-scatter chunk (2)")
    parser.add_argument("--checks-json", help="write every rank's input and output of every collective here")
    parser.add_argument("--bench", action="store_true", help="after the checks, time all-reduce over message sizes")
    parser.add_argument("--min-bytes", type=byte_size, default=4096, help="smallest message (4K)")
    parser.add_argument("--max-bytes", type=byte_size, help="largest message (64M on the CPU, 1G on GPUs)")
    parser.add_argument("--factor", type=positive_int, default=2, help="size ratio between rows, 2 or more (2)")
    parser.add_argument("--warmup", type=non_negative_int, default=3, help="untimed all-reduces per size (3)")
    parser.add_argument("--iters", type=positive_int, default=20, help="timed all-reduces per size; the median is kept (20)")
    parser.add_argument("--json", help="with --bench: write one record per message size here")
    parser.add_argument("--plot", help="with --bench: save bandwidth against size here (PNG, PDF, ...)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="auto: nccl with a GPU per rank, else gloo")
    parser.add_argument("--timeout-s", type=positive_float, default=120.0, help="process-group timeout, seconds")
    parser.add_argument("--corrupt-rank", type=non_negative_int, help="self-test of the checker (see the docstring)")
    args = parser.parse_args(argv)
    if args.factor < 2:
        parser.error(f"argument --factor: must be 2 or more, got {args.factor}")
    if args.max_bytes is not None and args.max_bytes < args.min_bytes:
        parser.error(f"--max-bytes ({args.max_bytes}) is smaller than --min-bytes ({args.min_bytes})")
    if (args.json or args.plot) and not args.bench:
        parser.error("--json and --plot record the benchmark: add --bench")
    return args


def rank_values(rank: int, length: int, device) -> torch.Tensor:
    """Rank r's contribution: 100(r+1) + [0, 1, ...]. Whole numbers, so float32 sums are exact."""
    return 100.0 * (rank + 1) + torch.arange(length, dtype=torch.float32, device=device)


def close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    # A tolerance only for the means (a division rounds); the self-test's +0.5 is far above it.
    return actual.shape == expected.shape and torch.allclose(actual, expected, rtol=1e-6, atol=0.0)


class Skipped(Exception):
    """A check that cannot run in this job; the message says why."""


# Each check runs one collective on this rank's tensor `mine` and returns (what this rank ended up
# with, whether that is right); everyone[r] is what rank r should have contributed. Its docstring
# is what PASS means.
def check_broadcast(ctx, mine, everyone):
    """every rank holds rank 0's tensor"""
    tensor = mine.clone()
    dist.broadcast(tensor, src=0)
    return tensor, close(tensor, everyone[0])


def check_reduce(ctx, mine, everyone):
    """rank 0 holds the sum of all tensors"""
    tensor = mine.clone()
    dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)
    if ctx.rank != 0:
        return None, True  # only the destination's result is defined; others may hold partial sums
    return tensor, close(tensor, sum(everyone))


def check_all_reduce_sum(ctx, mine, everyone):
    """every rank holds the sum"""
    tensor = mine.clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor, close(tensor, sum(everyone))


def check_all_reduce_max(ctx, mine, everyone):
    """every rank holds the element-wise maximum"""
    tensor = mine.clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor, close(tensor, torch.stack(everyone).amax(dim=0))


def check_all_reduce_mean(ctx, mine, everyone):
    """every rank holds the mean (sum, then divide by world_size)"""
    # The portable mean, and what DDP does to gradients. Integer tensors: convert to float first,
    # or the division truncates.
    tensor = mine.clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    tensor /= ctx.world_size
    return tensor, close(tensor, sum(everyone) / ctx.world_size)


def check_all_reduce_avg_op(ctx, mine, everyone):
    """every rank holds the mean (ReduceOp.AVG)"""
    # One call instead of two: NCCL 2.10+ natively; gloo since torch 2.8 (pytorch/pytorch#149781,
    # internally sum then divide). Older gloo raises "Cannot use ReduceOp.AVG with Gloo" on every rank.
    tensor = mine.clone()
    try:
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
    except (RuntimeError, ValueError) as error:
        if "AVG" not in str(error):
            raise
        raise Skipped(f"{str(error).splitlines()[0]}: use sum, then divide") from None
    return tensor, close(tensor, sum(everyone) / ctx.world_size)


def check_all_gather(ctx, mine, everyone):
    """every rank holds all tensors, in rank order"""
    pieces = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(pieces, mine)  # pieces[r] = rank r's tensor
    return torch.cat(pieces), close(torch.cat(pieces), torch.cat(everyone))


def check_reduce_scatter(ctx, mine, everyone):
    """rank r holds chunk r of the sum"""
    # gloo emulates it (all-reduce, then keep one chunk: same result, twice the traffic); NCCL runs a real one.
    received = torch.empty(mine.numel() // ctx.world_size, dtype=mine.dtype, device=mine.device)
    reduce_scatter_flat(received, mine, op=dist.ReduceOp.SUM)  # mine = world_size chunks
    return received, close(received, sum(everyone).chunk(ctx.world_size)[ctx.rank])


def check_barrier(ctx, mine, everyone):
    """the early ranks waited for the late one, and it did not wait"""
    late_rank = ctx.world_size - 1
    if ctx.rank == late_rank:
        time.sleep(BARRIER_DELAY_S)  # arrive late: all the others must wait for this rank
    # Each rank times its own wait on its own monotonic clock: no comparison of clocks across
    # nodes, which are only as close as their NTP (often milliseconds apart, sometimes worse).
    arrived = time.perf_counter()
    dist.barrier()
    waited_s = time.perf_counter() - arrived
    waits = [torch.zeros(1, dtype=torch.float64, device=ctx.device) for _ in range(ctx.world_size)]
    dist.all_gather(waits, torch.tensor([waited_s], dtype=torch.float64, device=ctx.device))
    return torch.tensor([waited_s]), barrier_held([float(w) for w in waits], late_rank)


def barrier_held(waits_s: list[float], late_rank: int, delay_s: float = BARRIER_DELAY_S) -> bool:
    """True when every early rank waited about delay_s at the barrier and the late rank did not.

    Half the delay separates the two: a barrier that let ranks through early would show waits
    near 0 on every rank; scheduling noise on a busy machine is milliseconds, far below 0.1 s.
    """
    early = [wait for rank, wait in enumerate(waits_s) if rank != late_rank]
    return all(wait >= delay_s / 2 for wait in early) and waits_s[late_rank] < delay_s / 2


def check_send_recv_ring(ctx, mine, everyone):
    """rank r holds the tensor of rank r-1"""
    if ctx.world_size == 1:
        raise Skipped("a ring needs 2 or more ranks (a rank cannot send to itself)")
    right, left = (ctx.rank + 1) % ctx.world_size, (ctx.rank - 1) % ctx.world_size
    received = torch.empty_like(mine)
    # Post the send and the receive together: if every rank first did a blocking send, each would
    # wait for a receiver that is itself stuck sending (a deadlock).
    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, right), dist.P2POp(dist.irecv, received, left)])
    for request in requests:
        request.wait()
    return received, close(received, everyone[left])


CHECKS = [
    check_broadcast, check_reduce, check_all_reduce_sum, check_all_reduce_max, check_all_reduce_mean,
    check_all_reduce_avg_op, check_all_gather, check_reduce_scatter, check_barrier, check_send_recv_ring,
]  # fmt: skip


def run_checks(ctx, args) -> bool:
    """Every check on every rank; the verdicts gathered and printed by rank 0. True if none failed."""
    length = args.chunk * ctx.world_size  # reduce-scatter needs a multiple of world_size
    everyone = [rank_values(rank, length, ctx.device) for rank in range(ctx.world_size)]
    mine = everyone[ctx.rank].clone()
    if args.corrupt_rank == ctx.rank:
        mine[0] += 0.5  # the self-test: this rank's data is no longer what the others expect
    log(f"lab1 collectives: world_size={ctx.world_size} backend={ctx.backend} device={ctx.device.type}; "
        f"rank r contributes {length} float32 values 100(r+1) + [0..{length - 1}]")  # fmt: skip
    results = {}  # collective: (status, this rank's output as a list, or why it was skipped)
    for check in CHECKS:
        name = check.__name__.removeprefix("check_")
        try:
            output, correct = check(ctx, mine, everyone)
            results[name] = ("PASS" if correct else "FAIL", None if output is None else output.tolist())
        except Skipped as reason:
            results[name] = ("SKIP", str(reason))
    reports = [None] * ctx.world_size
    dist.all_gather_object(reports, (mine.tolist(), results))  # reports[r] = rank r's, on every rank

    job_status = {}  # the job's verdict per collective: FAIL if any rank got a wrong result
    for check in CHECKS:
        name = check.__name__.removeprefix("check_")
        wrong = [str(rank) for rank, (_, result) in enumerate(reports) if result[name][0] == "FAIL"]
        job_status[name] = "FAIL" if wrong else results[name][0]
        detail = {"FAIL": f"wrong on rank(s) {', '.join(wrong)}", "SKIP": results[name][1]}
        log(f"{job_status[name]}  {name:<19} {detail.get(job_status[name], check.__doc__)}")
    failed = list(job_status.values()).count("FAIL")
    log(f"{list(job_status.values()).count('PASS')}/{len(CHECKS)} collectives passed" + (f", {failed} FAILED" * bool(failed)))
    if args.checks_json and ctx.is_main:
        outputs = {name: [result[name][1] for _, result in reports] for name in job_status}
        atomic_write_json({
            "world_size": ctx.world_size, "backend": ctx.backend, "inputs": [values for values, _ in reports],
            "collectives": {name: {"status": job_status[name], "outputs": outputs[name]} for name in job_status},
        }, args.checks_json)  # fmt: skip
    return failed == 0


def synchronize(ctx) -> None:
    # NCCL only queues work on a CUDA stream and returns: wait for the GPU before reading a clock.
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def bench_all_reduce(ctx, args) -> list[dict]:
    """Time an in-place float32 sum all-reduce per message size, the way nccl-tests does."""
    bus_factor = 2 * (ctx.world_size - 1) / ctx.world_size  # bytes each rank sends per byte reduced (ring)
    records = []
    for size in message_sizes(args, ctx.device.type):
        buffer = torch.zeros(size // 4, dtype=torch.float32, device=ctx.device)  # zeros stay zero: no overflow
        time_s = median_call_time(ctx, buffer, args)
        algbw = size / time_s / 1e9  # GB/s of data reduced, as the caller sees it
        records.append({
            "bytes": size, "time_s": time_s, "algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor,
            "world_size": ctx.world_size, "backend": ctx.backend,
        })  # fmt: skip
    return records


def message_sizes(args, device_type: str) -> list[int]:
    """--min-bytes, times --factor, ... up to --max-bytes (default 64 MiB on the CPU, 1 GiB on GPUs)."""
    largest = args.max_bytes or (2**30 if device_type == "cuda" else 64 * 2**20)
    sizes = [args.min_bytes]
    while sizes[-1] * args.factor <= largest:
        sizes.append(sizes[-1] * args.factor)
    return sizes


def median_call_time(ctx, buffer, args) -> float:
    """Seconds per all-reduce of buffer: the median over --iters calls of the slowest rank's time.

    The median, not the mean: on a shared machine one call in twenty can be stalled by the
    scheduler for milliseconds, and a mean would charge that to the collective.
    """
    for _ in range(args.warmup):  # the first calls set up connections and buffers
        dist.all_reduce(buffer)
    synchronize(ctx)
    dist.barrier()  # start every rank's clock together
    seconds = []
    for _ in range(args.iters):
        start = time.perf_counter()
        dist.all_reduce(buffer)
        synchronize(ctx)  # on a GPU: includes one synchronize per call (microseconds; see the docstring)
        seconds.append(time.perf_counter() - start)
    slowest = torch.tensor(seconds, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # call i ends when its slowest rank is done
    return statistics.median(slowest.tolist())


def report_bench(records, args) -> None:
    log(f"all-reduce benchmark: {records[0]['world_size']} ranks, {records[0]['backend']}, float32 sum in place, "
        f"{args.warmup} warm-up + {args.iters} timed calls per size, median of the slowest rank's times")  # fmt: skip
    log(f"{'bytes':>13} {'time (us)':>11} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
    for r in records:
        log(f"{r['bytes']:>13,} {r['time_s'] * 1e6:>11.1f} {r['algbw_gbps']:>13.3f} {r['busbw_gbps']:>13.3f}")
    if records[0]["backend"] == "nccl":  # each row is timed from Python
        log(
            "note: rows below about 1 MiB time the host-side path (Python, c10d, kernel launch, synchronize) "
            "more than NCCL itself; for NCCL's own figure run nccl-tests: all_reduce_perf -b 4K -e 1G -f 2 -g <gpus>"
        )
    if args.json:
        atomic_write_json(records, args.json)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")  # draw into a file: no display needed
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for key, style in (("busbw_gbps", "o-"), ("algbw_gbps", "s--")):
            ax.plot([r["bytes"] for r in records], [r[key] for r in records], style, label=key.split("_")[0])
        ax.set(xscale="log", xlabel="message size (bytes)", ylabel="GB/s", title=f"all-reduce, "
               f"{records[0]['world_size']} ranks, {records[0]['backend']}")  # fmt: skip
        ax.legend()
        fig.savefig(args.plot, bbox_inches="tight")
        plt.close(fig)


def main(args) -> int:
    try:
        ctx = setup_distributed(args.backend, timeout_s=args.timeout_s)
        if args.corrupt_rank is not None and args.corrupt_rank >= ctx.world_size:
            raise CourseError(f"--corrupt-rank {args.corrupt_rank}: there is no such rank (0..{ctx.world_size - 1})")
        if not run_checks(ctx, args):
            return 1  # on every rank: every rank saw the gathered verdicts
        if args.bench:
            records = bench_all_reduce(ctx, args)
            if ctx.is_main:
                report_bench(records, args)
        return 0
    except CourseError as error:
        log_error(str(error))
        return 1
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_args()))
