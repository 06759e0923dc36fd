"""DDP on one screen: labs/train_single.py turned into a DistributedDataParallel job, every DDP line in view.

    torchrun --standalone --nproc_per_node=2 labs/ddp_minimal.py           # CPU: 2 processes, gloo
    torchrun --standalone --nproc_per_node=NUM_GPUS labs/ddp_minimal.py    # GPUs: one process each, NCCL"""

import argparse
import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401 - before init, or its group= defaults keep the group alive at exit
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from ddp_course.cli import positive_float, positive_int
from ddp_course.data import load_digits
from ddp_course.models import DigitsCNN


def main():
    parser = argparse.ArgumentParser(description="Train DigitsCNN on the digits data with DDP.")
    parser.add_argument("--epochs", type=positive_int, default=5)
    parser.add_argument("--batch-size", type=positive_int, default=64, help="per process")
    parser.add_argument("--lr", type=positive_float, default=0.05, help="SGD learning rate (momentum 0.9)")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and shuffling order")
    parser.add_argument("--save", help="write the trained model's state_dict to this file")
    args = parser.parse_args()
    if args.save and not os.path.isdir(os.path.dirname(os.path.abspath(args.save))):
        parser.error(f"--save: the folder of {args.save} does not exist")
    if "LOCAL_RANK" not in os.environ:
        parser.error("launch it with torchrun: torchrun --standalone --nproc_per_node=2 labs/ddp_minimal.py")
    local_rank = int(os.environ["LOCAL_RANK"])  # torchrun's environment: this process's index on its machine
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)  # from LOCAL_RANK, never from RANK (RANK counts all machines)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=5))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(minutes=5))  # a stuck collective fails, never hangs
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    digits = load_digits()  # 1,438 training and 359 held-out 8x8 images, as tensors
    model = DDP(DigitsCNN().to(device), device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    train_sampler = DistributedSampler(digits.train, shuffle=True, seed=args.seed)  # this rank's share
    train_loader = DataLoader(digits.train, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(Subset(digits.test, range(rank, len(digits.test), world_size)), batch_size=256)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)  # a new shuffle every epoch, the same one on every rank
        model.train()
        for images, labels in train_loader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)  # mean over this rank's batch
            loss.backward()  # DDP all-reduces the gradients here: every rank gets the average
            optimizer.step()
        model.eval()
        correct, total = 0, 0
        with torch.no_grad():
            for images, labels in test_loader:
                correct += int((model(images.to(device)).argmax(dim=1) == labels.to(device)).sum())
                total += len(labels)
        counts = torch.tensor([correct, total], device=device)
        dist.all_reduce(counts)  # the job's totals: every held-out image counted once, on every rank
        correct, total = counts.tolist()
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: held-out accuracy {correct / total:.4f} ({correct}/{total})")
    if args.save and rank == 0:
        torch.save(model.module.state_dict(), args.save)  # the bare model's keys, without "module."
    dist.barrier()  # nobody leaves before the file is written
    del model  # gloo can abort at exit while a DDP model is alive: drop it, collect it, then leave
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
