"""Test helper: CIFAR-10 preparation on 2 ranks with a fake disk and a fake download (review finding 4).

Each rank plays one node of a 2-node job with one process per node (so both are local rank 0, as
on a real 2-node job), and the three scenarios run one after another in the same job:
  one-has-it   rank 1's disk already holds the data, rank 0's does not; the download works
  offline      no rank has the data and the download fails
  node-local   no rank has the data; the download works but lands on rank 0's disk only
Every rank prints "[rank r] SCENARIO: ok" or "[rank r] SCENARIO: CourseError: ...", and every
download attempt appends "SCENARIO rank r" to WORKDIR/downloads.log.
"""

import argparse
import sys
from pathlib import Path

import torch.distributed as dist

from ddp_course import data
from ddp_course.cli import CourseError
from ddp_course.distributed import log, setup_distributed, teardown_distributed

parser = argparse.ArgumentParser()
parser.add_argument("--workdir", type=Path, required=True)
parser.add_argument("--timeout-s", type=float, default=15.0)
args = parser.parse_args()

# A setting of the scenario being run, read by the fakes below.
current = {"name": None, "download_works": True, "shared_disk": True}


def fake_from_disk(root: Path):
    """What this rank's disk holds: a file everyone sees (shared storage) or one only this rank sees."""
    rank = dist.get_rank()
    if (root / "shared").exists() or (root / f"local_rank{rank}").exists():
        return data.DatasetSplits(name="cifar10", train=[], test=[], num_classes=10)
    raise RuntimeError("Dataset not found or corrupted. You can use download=True to download it")


def fake_download(root: Path):
    rank = dist.get_rank()
    with open(args.workdir / "downloads.log", "a") as log_file:
        log_file.write(f"{current['name']} rank {rank}\n")
    if not current["download_works"]:
        return "URLError: <urlopen error [Errno -3] Temporary failure in name resolution>"
    (root / ("shared" if current["shared_disk"] else f"local_rank{rank}")).touch()
    return None


data._cifar10_from_disk = fake_from_disk
data._try_download_cifar10 = fake_download
data.DOWNLOAD_TIMEOUT_S = args.timeout_s  # the wait for a download, kept short for the test

SCENARIOS = {
    "one-has-it": {"download_works": True, "shared_disk": True, "preloaded_rank": 1},
    "offline": {"download_works": False, "shared_disk": True, "preloaded_rank": None},
    "node-local": {"download_works": True, "shared_disk": False, "preloaded_rank": None},
}

ctx = setup_distributed("gloo", timeout_s=args.timeout_s)
try:
    for name, settings in SCENARIOS.items():
        root = args.workdir / name
        if ctx.rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            if settings["preloaded_rank"] is not None:
                (root / f"local_rank{settings['preloaded_rank']}").touch()
        dist.barrier()  # the scenario's disk is ready before any rank looks
        current.update(name=name, download_works=settings["download_works"], shared_disk=settings["shared_disk"])
        try:
            # Each rank plays the only process of its own simulated node (local rank 0 everywhere).
            data.load_dataset("cifar10", root)
            outcome = "ok"
        except CourseError as error:
            outcome = f"CourseError: {error}"
        log(f"{name}: {outcome}", every_rank=True)
finally:
    teardown_distributed()
sys.exit(0)
