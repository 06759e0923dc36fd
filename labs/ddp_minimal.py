"""DDP on one screen: labs/train_single.py turned into a DistributedDataParallel job, every DDP line in view.
Launch: torchrun --standalone --nproc_per_node=2 labs/ddp_minimal.py (CPU, gloo); --nproc_per_node=NUM_GPUS on GPUs (NCCL)."""

import argparse
import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from ddp_course.cli import positive_float, positive_int
from ddp_course.data import load_digits
from ddp_course.models import DigitsCNN

# ---- NOT PART OF DDP: on torch 2.14 a gloo (CPU) job can abort at exit ("terminate called without an active exception") if its group
# outlives destroy_process_group(): imported after init (as DDP does), this module's group= defaults hold it; imported first, None. Also gc.collect() in main.
import torch.distributed.nn.functional  # noqa: E402,F401


def train(args, rank, world_size, device):
    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    digits = load_digits()  # 1,438 training and 359 held-out 8x8 images, as tensors
    model = DDP(DigitsCNN().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    train_sampler = DistributedSampler(digits.train, shuffle=True, seed=args.seed)  # this rank's share
    train_loader = DataLoader(digits.train, batch_size=args.batch_size, sampler=train_sampler)
    test_loader = DataLoader(Subset(digits.test, range(rank, len(digits.test), world_size)), batch_size=256)
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)  # a new shuffle every epoch, the same one on every rank
        model.train()
        loss_sum, seen = 0.0, 0
        for images, labels in train_loader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)  # mean over this rank's batch
            loss.backward()  # DDP all-reduces the gradients here: every rank gets the average
            optimizer.step()
            loss_sum, seen = loss_sum + loss.item() * len(labels), seen + len(labels)
        model.module.eval()  # score the bare model: DDP's forward can broadcast buffers, a collective (lecture 4 §2.7)
        with torch.no_grad():
            hits = [model.module(images.to(device)).argmax(dim=1) == labels.to(device) for images, labels in test_loader]
        correct, total = sum(int(h.sum()) for h in hits), sum(len(h) for h in hits)
        sums = torch.tensor([loss_sum, seen, correct, total], dtype=torch.float64, device=device)
        dist.all_reduce(sums)  # the job's totals: every rank's samples and held-out images, each once
        loss_sum, seen, correct, total = sums.tolist()
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: train loss {loss_sum / seen:.4f}, held-out accuracy {correct / total:.4f} ({correct:.0f}/{total:.0f})")
    if args.save and rank == 0:
        torch.save(model.module.state_dict(), args.save)  # the bare model's keys, without "module."
    dist.barrier()  # nobody leaves before the file is written


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
    cuda, local_rank = torch.cuda.is_available(), int(os.environ["LOCAL_RANK"])  # LOCAL_RANK: the index on this machine
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")  # from LOCAL_RANK, never from RANK
    if cuda:
        torch.cuda.set_device(device)  # NCCL below on GPUs (device_id binds the group to this GPU), gloo on CPUs
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None, timeout=timedelta(minutes=5))
    train(args, dist.get_rank(), dist.get_world_size(), device)
    gc.collect()  # NOT PART OF DDP (the workaround at the top): frees the DDP model train() dropped, then the group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
