"""Test helper: each rank reports what torchrun told it and takes part in one all_reduce."""

import argparse
import os

import torch
import torch.distributed as dist

from ddp_course.distributed import log, setup_distributed, teardown_distributed

parser = argparse.ArgumentParser()
parser.add_argument("--tag", default="")
args = parser.parse_args()

ctx = setup_distributed("gloo", timeout_s=30)
try:
    total = torch.tensor([float(ctx.rank)])
    dist.all_reduce(total)  # 0 + 1 with two ranks
    threads = os.environ.get("OMP_NUM_THREADS")
    log(f"world_size {ctx.world_size} local_rank {ctx.local_rank} sum {total.item():g} tag {args.tag} threads {threads}", every_rank=True)
finally:
    teardown_distributed()
