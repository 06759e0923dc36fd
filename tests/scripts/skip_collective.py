"""Test helper: rank 1 never joins rank 0's all_reduce; the process-group timeout must end the wait."""

import argparse
import sys
import time

import torch
import torch.distributed as dist

from ddp_course.distributed import setup_distributed, teardown_distributed

parser = argparse.ArgumentParser()
parser.add_argument("--timeout-s", type=float, required=True)
args = parser.parse_args()

ctx = setup_distributed("gloo", timeout_s=args.timeout_s)
status = 0
try:
    if ctx.rank == 0:
        try:
            dist.all_reduce(torch.ones(1))
        except RuntimeError as error:  # gloo raises when the timeout expires
            print(f"rank 0 timed out in all_reduce: {str(error).splitlines()[0]}", flush=True)
            status = 1
    else:
        time.sleep(args.timeout_s + 20)  # busy elsewhere, long past rank 0's timeout
finally:
    teardown_distributed()
sys.exit(status)
