"""Lab 4: the smallest program with the most common DDP hang, for TORCH_DISTRIBUTED_DEBUG=DETAIL.

Rank 0 has one batch more than rank 1 (an uneven split of the data). DDP all-reduces the gradients
in every backward(), so rank 0 enters a third all-reduce while rank 1 has already moved on to the
end-of-epoch barrier. Neither collective can complete.

    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc_per_node=2 labs/lab4_minimal_hang.py

With DETAIL, every rank compares each collective with its peers before running it, so both ranks
stop at once and name the collective they were in. Without it, both wait for the 30 s timeout and
report only that a receive timed out.

Cutting a failing job down to a program this small is a debugging step of its own: here it is also
how to use DETAIL on gloo, because a DDP model cannot be built on a gloo group in DETAIL mode (see
the lab sheet, section 2).
"""

import torch
import torch.distributed as dist

from ddp_course.distributed import log, setup_distributed, teardown_distributed

TIMEOUT_S = 30.0  # without DETAIL, how long the ranks wait before they give up


def describe_default_group() -> str:
    # _get_backend is private API, used only to show what DETAIL does: it wraps the gloo backend
    # in a checker (_ProcessGroupWrapper) that compares every collective across the ranks.
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return type(backend).__name__


def run_uneven_steps(rank: int) -> None:
    steps = 3 if rank == 0 else 2  # rank 0 was given one batch more than rank 1
    for _ in range(steps):
        gradient = torch.ones(4)
        dist.all_reduce(gradient)  # what DDP runs in every backward()
    dist.barrier()  # every rank: the end of the epoch


def main() -> int:
    ctx = setup_distributed("gloo", timeout_s=TIMEOUT_S)
    try:
        log(f"the default group's gloo backend is a {describe_default_group()}")
        run_uneven_steps(ctx.rank)
        log("finished: the ranks ran the same collectives")  # never printed: the ranks disagree
        return 0
    except RuntimeError as error:
        # Both ranks raise; print the first line of each rank's report and leave cleanly.
        log(str(error).splitlines()[0], every_rank=True)
        return 1
    finally:
        teardown_distributed()


if __name__ == "__main__":
    raise SystemExit(main())
