"""DDP on one screen: the digits CNN trained with DistributedDataParallel, every distributed line in view.

    torchrun --standalone --nproc_per_node=2 labs/ddp_minimal.py             # CPU: 2 processes, gloo
    torchrun --standalone --nproc_per_node=NUM_GPUS labs/ddp_minimal.py      # GPUs: one process each, NCCL
"""
import argparse
import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from ddp_course.data import load_digits
from ddp_course.models import DigitsCNN


def train(args, rank, world_size, device):
    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    digits = load_digits()
    model = DDP(DigitsCNN().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = DistributedSampler(digits.train, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(digits.train, batch_size=args.batch_size, sampler=sampler)  # batch_size is per rank
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        for images, labels in loader:
            loss = F.cross_entropy(model(images.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()  # DDP all-reduces and averages the gradients here
            optimizer.step()
        # Each rank scores every world_size-th held-out image; one all-reduce sums the counts of the job.
        held_out = Subset(digits.test, range(rank, len(digits.test), world_size))
        counts = torch.zeros(2, device=device)  # [correct, seen] on this rank
        with torch.no_grad():
            for images, labels in DataLoader(held_out, batch_size=256):
                counts[0] += (model(images.to(device)).argmax(dim=1) == labels.to(device)).sum()
                counts[1] += len(labels)
        dist.all_reduce(counts)  # the sums over every rank: the whole held-out set, each image once
        if rank == 0:
            correct, seen = counts.tolist()
            print(f"epoch {epoch + 1}/{args.epochs} | held-out accuracy {correct / seen:.2%} ({correct:.0f}/{seen:.0f})")
    if rank == 0 and args.save:
        torch.save(model.module.state_dict(), args.save)  # the bare model's keys, without "module."
    dist.barrier()  # nobody leaves before the file is written


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", help="where rank 0 saves the trained weights")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("ddp_minimal.py: error: launch it with torchrun: torchrun --standalone --nproc_per_node=2 labs/ddp_minimal.py")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # set by torchrun
    local_rank = int(os.environ["LOCAL_RANK"])  # this process's index on its machine
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)  # from LOCAL_RANK, never from RANK
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=5))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(minutes=5))  # a stuck collective fails, not hangs
    train(args, rank, world_size, device)
    gc.collect()  # the DDP model died with train(); gloo can abort at exit if it is still alive
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
