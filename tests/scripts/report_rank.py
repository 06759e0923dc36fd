"""Test helper: each rank reports what torchrun told it and takes part in one all_reduce.

It also reports which backend `--backend auto` would pick on a machine whose GPUs are exactly those
CUDA_VISIBLE_DEVICES lists (as the CUDA runtime counts them), so a test on a CPU-only machine can
simulate visible GPUs and check that the launcher hides them.
"""

import argparse
import os

import torch
import torch.distributed as dist

from ddp_course.distributed import choose_backend, log, setup_distributed, teardown_distributed

parser = argparse.ArgumentParser()
parser.add_argument("--tag", default="")
args = parser.parse_args()


def simulated_gpu_count() -> int:
    """GPUs the CUDA runtime would see: the entries of CUDA_VISIBLE_DEVICES ("" -> none; unset -> none here)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return len([d for d in visible.split(",") if d.strip()]) if visible else 0


torch.cuda.device_count = simulated_gpu_count
torch.cuda.is_available = lambda: simulated_gpu_count() > 0
# Decided before the group exists, with the node's process count, as setup_distributed("auto") does.
auto_backend = choose_backend("auto", int(os.environ["LOCAL_WORLD_SIZE"]))

ctx = setup_distributed("gloo", timeout_s=30)
try:
    total = torch.tensor([float(ctx.rank)])
    dist.all_reduce(total)  # 0 + 1 with two ranks
    threads = os.environ.get("OMP_NUM_THREADS")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
    log(
        f"world_size {ctx.world_size} local_rank {ctx.local_rank} sum {total.item():g} tag {args.tag} threads {threads} "
        f"cuda_visible_devices {visible!r} auto_backend {auto_backend}",
        every_rank=True,
    )
finally:
    teardown_distributed()
