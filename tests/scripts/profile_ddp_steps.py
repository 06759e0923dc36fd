"""Test helper: profile 2 steps of a 6-layer MLP under DDP with ddp_course.profiling, one way of three.

    torchrun --standalone --nproc_per_node=2 tests/scripts/profile_ddp_steps.py OUT_DIR --sync ddp

--sync ddp:      torch DDP, one 4 MiB bucket per layer (all-reduces overlap the rest of backward)
--sync blocking: torch DDP with a communication hook that waits for each all-reduce (no overlap)
--sync after:    no DDP; every gradient all-reduced after backward() returned (what naive DDP does)
"""

import argparse
import gc

import torch
import torch.distributed as dist
from torch import nn

from ddp_course import profiling
from ddp_course.distributed import setup_distributed, teardown_distributed


def blocking_allreduce_hook(state, bucket):
    """A WRONG hook: waits for its all-reduce before backward may continue."""
    buffer = bucket.buffer()
    dist.all_reduce(buffer)  # synchronous
    buffer.div_(dist.get_world_size())
    future = torch.futures.Future()
    future.set_result(buffer)
    return future


def profile(out_dir: str, sync: str, rank: int) -> None:
    torch.manual_seed(0)
    # Six 1024x1024 layers (4 MiB of fp32 weights each): with bucket_cap_mb=4 one bucket per layer. A
    # batch of 2 keeps each layer's backward shorter than its all-reduce, also on a fast CPU.
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)])
    if sync == "after":
        trained = model
    else:
        trained = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=4)
        if sync == "blocking":
            trained.register_comm_hook(None, blocking_allreduce_hook)
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.01)
    inputs = torch.randn(2, 1024)

    def step(_):
        with profiling.phase("forward"):
            loss = trained(inputs).square().mean()
        with profiling.phase("backward"):
            loss.backward()
        if sync == "after":
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad)
        with profiling.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()

    profiling.profile_steps(step, steps=2, out_dir=out_dir, rank=rank)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--sync", choices=("ddp", "blocking", "after"), default="ddp")
    args = parser.parse_args()
    ctx = setup_distributed("gloo", timeout_s=60)
    try:
        profile(args.out_dir, args.sync, ctx.rank)
    finally:
        gc.collect()
        teardown_distributed()


if __name__ == "__main__":
    main()
