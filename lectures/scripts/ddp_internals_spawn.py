"""The launcher torchrun replaced: torch.multiprocessing.spawn starts the ranks from Python.

    python lectures/scripts/ddp_internals_spawn.py --nprocs 2

What the learner should see: one line per rank, "[rank r of 2] all_reduce of the ranks' ids: 1".
The script must do itself what torchrun does for you: pick MASTER_ADDR and a free MASTER_PORT, give
every process its rank and the world size, and start them. mp.spawn pickles the function it starts
by module and name, so the function must live in an importable file like this one - a function
defined in a notebook cell cannot be found by the new processes. CPU (gloo) only.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port nobody listens on right now (the OS picks it; never hard-code one)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def worker(rank: int, world_size: int, port: int) -> None:
    """Runs in each spawned process; mp.spawn passes the process index first."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=30))  # fmt: skip
    try:
        ids = torch.tensor([float(rank)])
        dist.all_reduce(ids)
        # One write per line: the ranks share the terminal (print() writes the text and the newline apart).
        sys.stdout.write(f"[rank {rank} of {world_size}] all_reduce of the ranks' ids: {ids.item():g}\n")
        sys.stdout.flush()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, default=2, choices=range(1, 9), metavar="N", help="processes (1-8)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun would set this; each rank gets one thread
    mp.spawn(worker, args=(args.nprocs, free_port()), nprocs=args.nprocs, join=True)


if __name__ == "__main__":
    main()
