"""Solution of the lab 3 conversion exercise: labs/train_single.py turned into a DDP script.

Comments that start with "DDP:" mark what the conversion added (`diff labs/train_single.py
solutions/my_ddp.py` shows every change). Launch it from the repository root with torchrun, one
process per GPU, or any number of CPU processes:

    laptop, 2 CPU processes (gloo):  torchrun --standalone --nproc_per_node=2 solutions/my_ddp.py
    N GPUs on one machine (NCCL):     torchrun --standalone --nproc_per_node=N solutions/my_ddp.py
    check it:                         python labs/lab3_convert_check.py solutions/my_ddp.py

What you should see on 2 CPU processes with the defaults: rank 0 alone prints one line per epoch,
with the job's train loss and its accuracy on all 359 held-out images, ending near 97% after 5
epochs. The global batch is 128 (64 per process x 2): the checker shows that the job trains exactly
as one process would on those 128 samples.
"""

import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401 - before init, or its group= defaults keep the group alive at exit
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from ddp_course.cli import CourseArgumentParser, positive_float, positive_int
from ddp_course.data import load_digits
from ddp_course.models import DigitsCNN

TIMEOUT = timedelta(seconds=60)  # DDP: a rank stuck in a collective fails after a minute instead of 30


def parse_args():
    # DDP: argparse that reports a bad flag once for the job, not once per process.
    parser = CourseArgumentParser(description="Train DigitsCNN on the digits data with DDP (see the docstring).")
    parser.add_argument("--epochs", type=positive_int, default=5)
    parser.add_argument("--batch-size", type=positive_int, default=64, help="per process; the global batch is this x world size")  # DDP
    parser.add_argument("--lr", type=positive_float, default=0.05, help="SGD learning rate (momentum 0.9)")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and shuffling order")
    parser.add_argument("--save", help="write the trained model's state_dict to this file")
    args = parser.parse_args()
    if args.save and not os.path.isdir(os.path.dirname(os.path.abspath(args.save))):
        parser.error(f"--save: the folder of {args.save} does not exist")
    if "RANK" not in os.environ:  # DDP: torchrun tells each process who it is through the environment
        parser.error("launch me with torchrun, e.g. torchrun --standalone --nproc_per_node=2 solutions/my_ddp.py")
    return args


def setup() -> tuple[int, int, torch.device]:
    """DDP: join the process group torchrun prepared; returns (rank, world_size, this process's device)."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        # LOCAL_RANK numbers the processes of this machine, RANK those of the whole job: on the
        # second node of a 2 x 8 GPU job RANK is 8..15 but the GPUs are cuda:0..7.
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=TIMEOUT)  # device_id binds the group to this GPU
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=TIMEOUT)
    return rank, world_size, device


@torch.no_grad()
def count_correct(model, loader, device) -> torch.Tensor:
    """[correct, seen] on the held-out images this process scores."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=device)
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        counts[0] += (model(images).argmax(dim=1) == labels).sum()
        counts[1] += len(labels)
    return counts


def train(args, rank: int, world_size: int, device: torch.device) -> None:
    torch.manual_seed(args.seed)  # DDP: every rank builds the same initial weights (DDP also broadcasts rank 0's)
    digits = load_digits()
    model = DigitsCNN().to(device)  # DDP: on this rank's device
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)  # DDP: averages gradients in backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # DDP: each rank reads its own 1/world_size of a permutation drawn from (seed, epoch).
    sampler = DistributedSampler(digits.train, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(digits.train, batch_size=args.batch_size, sampler=sampler)
    # DDP: rank r scores held-out images r, r + world_size, ...: all 359 once each. (A DistributedSampler
    # would pad them to a multiple of world_size with repeats, and the repeats would count twice.)
    test_loader = DataLoader(Subset(digits.test, range(rank, len(digits.test), world_size)), batch_size=256)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new permutation every epoch, the same on every rank
        ddp_model.train()
        loss_sum = torch.zeros(2, device=device)  # DDP: [sum of per-sample losses, samples] on this rank
        for images, labels in train_loader:
            images, labels = images.to(device), labels.to(device)  # DDP: to this rank's device
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp_model(images), labels)  # mean over this rank's batch
            loss.backward()  # DDP all-reduces here: every rank now holds the gradient averaged over ranks
            optimizer.step()
            loss_sum += torch.stack([loss.detach() * len(labels), torch.tensor(float(len(labels)), device=device)])

        counts = count_correct(ddp_model, test_loader, device)
        dist.all_reduce(loss_sum)  # DDP: the job's loss, summed over every rank's samples
        dist.all_reduce(counts)  # DDP: each rank scored its slice; the job's accuracy counts them all
        correct, total = int(counts[0]), int(counts[1])
        if rank == 0:  # DDP: one line for the job, not one per process
            print(f"epoch {epoch + 1}/{args.epochs}: train loss {float(loss_sum[0] / loss_sum[1]):.4f}, held-out accuracy {correct / total:.4f} ({correct}/{total})")

    if rank == 0 and args.save:
        # DDP: one writer (ranks writing the same file race), and the bare model's weights: keys
        # without the wrapper's "module." prefix, so a plain DigitsCNN loads them.
        torch.save(ddp_model.module.state_dict(), args.save)
    dist.barrier()  # DDP: nobody exits, or reads the file, before rank 0 has written it


def main() -> None:
    args = parse_args()
    rank, world_size, device = setup()
    try:
        train(args, rank, world_size, device)
    finally:
        # DDP: the model died with train()'s frame, but DDP keeps reference cycles that only the
        # garbage collector frees; a DDP model still alive when the group is destroyed can make
        # gloo abort the process at exit (see ddp_course/distributed.py, teardown_distributed).
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
