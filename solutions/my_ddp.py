"""Solution of lab 3's conversion exercise: labs/train_realistic.py turned into a DDP script.

Comments that start with "DDP:" mark what the conversion added or decided (`diff labs/train_realistic.py
solutions/my_ddp.py` shows every change). Launch it from the repository root with torchrun, one process
per GPU, or any number of CPU processes:

    laptop, 2 CPU processes (gloo):  torchrun --standalone --nproc_per_node=2 solutions/my_ddp.py
    N GPUs on one machine (NCCL):     torchrun --standalone --nproc_per_node=N solutions/my_ddp.py
    check it:                         python labs/lab3_convert_check.py solutions/my_ddp.py

What you should see on 2 CPU processes with the defaults: rank 0 alone prints the job's training loss
every 10 optimizer steps and the accuracy on all 359 held-out images after every epoch, above 97% at
the end (8 epochs; about 10 s of training on 2 quiet cores). The global batch is 128 per optimizer
step (32 per micro-batch x 2 micro-batches x 2 processes), as the one-process script's 64 x 2 would
be on 2 machines' worth of data: the checker shows that every step is one process's step on it.

The decisions, each behind a check of labs/lab3_convert_check.py (labs/convert_checklist.md lists them):
- BatchNorm keeps each rank's own statistics while training (each rank normalises its micro-batch, as
  the one-process script normalises each of its micro-batches). Before evaluating and saving, every
  rank takes rank 0's running statistics, so the model that is scored is the model that is saved.
  SyncBatchNorm would average the statistics over ranks at every forward; torch 2.14 runs it on GPUs
  only, and it changes what a step computes (it is then one process on the ranks' micro-batches
  together), so it is a choice, not a fix.
- The learning-rate schedule counts optimizer steps: an epoch is this rank's batches / accumulation, rounded up.
- Accumulation: the first micro-batches of a step run under no_sync(), so one all-reduce per step.
- Clipping: after the backward that all-reduces, once per optimizer step: the norm of the averaged
  gradient, the same on every rank.
"""

import gc
import math
import os
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401 - not DDP: a gloo exit workaround (labs/ddp_minimal.py says why)
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import clip_grad_norm_
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from ddp_course.cli import CourseArgumentParser, non_negative_int, positive_float, positive_int
from ddp_course.data import load_digits

TIMEOUT = timedelta(seconds=60)  # DDP: a rank stuck in a collective fails after a minute instead of 30


class DigitsNet(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a linear classifier, for 1x8x8 digits (9,978 parameters)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),  # (B, 16, 8, 8)
            nn.Conv2d(16, 32, kernel_size=3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),  # (B, 32, 8, 8)
            nn.MaxPool2d(2), nn.Flatten(),  # (B, 512)
        )  # fmt: skip
        self.classifier = nn.Linear(32 * 4 * 4, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))


class RandomShift(Dataset):
    """The images of `dataset`, each moved by up to one pixel in each direction, at random.

    The shift is drawn from torch's default generator in the process that loads the sample: a
    DataLoader worker, whose generator the loader seeds from its own `generator` at every epoch.
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        image, label = self.dataset[index]  # (1, 8, 8)
        top, left = torch.randint(0, 3, (2,)).tolist()  # where the 8x8 window sits in the padded 10x10
        return F.pad(image, (1, 1, 1, 1))[:, top : top + 8, left : left + 8], label


def lr_at(step: int, total_steps: int, warmup_steps: int, peak_lr: float) -> float:
    """The learning rate of optimizer step `step` (0, 1, ...): a linear warm-up to peak_lr, then a cosine to 0."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak_lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> torch.Tensor:
    """[correct, total] on the held-out images this rank scores."""
    model.eval()
    counts = torch.zeros(2, dtype=torch.long, device=device)
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)  # DDP: to this rank's device
        counts[0] += (model(images).argmax(dim=1) == labels).sum()
        counts[1] += len(labels)
    return counts


def parse_args():
    # DDP: CourseArgumentParser reports a bad flag once for the job, not once per process.
    parser = CourseArgumentParser(description="Train DigitsNet on the digits data with DDP (see the docstring).")
    parser.add_argument("--epochs", type=positive_int, default=8)
    parser.add_argument("--batch-size", type=positive_int, default=32, help="samples per micro-batch, per process")  # DDP
    parser.add_argument("--accumulation", type=positive_int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=positive_float, default=4e-3, help="AdamW's peak learning rate")
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--warmup-steps", type=positive_int, default=10, help="optimizer steps of linear warm-up")
    parser.add_argument("--clip-norm", type=positive_float, default=1.0, help="clip the gradient's global norm to this")
    parser.add_argument("--workers", type=non_negative_int, default=2, help="DataLoader worker processes, per process")
    parser.add_argument("--log-every", type=positive_int, default=10, help="print the training loss every N optimizer steps")
    parser.add_argument("--seed", type=int, default=0, help="initial weights, shuffling and augmentation")
    parser.add_argument("--save", help="checkpoint file, written after every epoch")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint at --save")
    args = parser.parse_args()
    if args.save and not os.path.isdir(os.path.dirname(os.path.abspath(args.save))):
        parser.error(f"--save: the folder of {args.save} does not exist")
    if args.resume and not (args.save and os.path.isfile(args.save)):
        parser.error("--resume needs an existing checkpoint at --save")
    if "RANK" not in os.environ:  # DDP: torchrun tells each process who it is through the environment
        parser.error("launch me with torchrun, e.g. torchrun --standalone --nproc_per_node=2 solutions/my_ddp.py")
    return args


def setup() -> tuple[int, int, torch.device]:
    """DDP: join the process group torchrun prepared; returns (rank, world_size, this process's device)."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))  # LOCAL_RANK on this machine, never RANK
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=TIMEOUT)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=TIMEOUT)
    return rank, world_size, device


def train(args, rank: int, world_size: int, device: torch.device) -> None:
    torch.manual_seed(args.seed)  # DDP: the same initial weights on every rank (DDP also broadcasts rank 0's)
    digits = load_digits()  # 1,438 training and 359 held-out 8x8 images, as tensors
    model = DigitsNet(digits.num_classes).to(device)  # DDP: on this rank's device
    start_epoch = 0
    if args.resume:
        # DDP: every rank loads the file rank 0 wrote (model, optimizer and schedule states alike),
        # onto its own device: without map_location, tensors saved from cuda:0 would all land on cuda:0.
        checkpoint = torch.load(args.save, map_location=device, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        start_epoch = checkpoint["epoch"]
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)  # DDP: averages gradients in backward()
    optimizer = torch.optim.AdamW(ddp_model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    # DDP: each rank reads its own 1/world_size of a permutation drawn from (seed, epoch).
    train_set = RandomShift(digits.train)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    generator = torch.Generator()  # DDP: now only seeds the workers' augmentation (the sampler shuffles)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers, generator=generator)
    # DDP: rank r scores held-out images r, r + world_size, ...: all 359 once each. (A DistributedSampler
    # would pad them to a multiple of world_size with repeats, and the repeats would count twice.)
    test_loader = DataLoader(Subset(digits.test, range(rank, len(digits.test), world_size)), batch_size=256)
    # DDP: an epoch is this rank's share: len(train_loader) micro-batches, not len(digits.train) / batch.
    steps_per_epoch = math.ceil(len(train_loader) / args.accumulation)
    total_steps = args.epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, total_steps, args.warmup_steps, args.lr) / args.lr)
    if args.resume:
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        if rank == 0:
            print(f"resumed from {args.save} after epoch {start_epoch}")

    step = start_epoch * steps_per_epoch
    running = torch.zeros(2, dtype=torch.float64, device=device)  # DDP: [sum of per-sample losses, samples] on this rank
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # DDP: a new permutation every epoch, the same on every rank
        generator.manual_seed((args.seed * 1000 + epoch) * 1000 + rank)  # DDP: this epoch's augmentation, its own on each rank
        ddp_model.train()
        for micro_step, (images, labels) in enumerate(train_loader):
            images, labels = images.to(device), labels.to(device)  # DDP: to this rank's device
            last_of_step = (micro_step + 1) % args.accumulation == 0 or micro_step + 1 == len(train_loader)
            # DDP: no_sync() keeps the first micro-batches' gradients local (they add up in .grad); the
            # backward of the step's last one all-reduces the sum: one all-reduce per optimizer step.
            with nullcontext() if last_of_step else ddp_model.no_sync():
                loss = F.cross_entropy(ddp_model(images), labels)  # the mean over this micro-batch
                (loss / args.accumulation).backward()
            running[0] += loss.detach().double() * len(labels)
            running[1] += len(labels)
            if not last_of_step:
                continue
            clip_grad_norm_(ddp_model.parameters(), args.clip_norm)  # DDP: the averaged gradient's norm, equal on every rank
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step % args.log_every == 0:
                dist.all_reduce(running)  # DDP: the job's loss: every rank's samples, summed, then divided
                if rank == 0:  # DDP: one line for the job, not one per process
                    print(f"step {step}: train loss {float(running[0] / running[1]):.4f}, lr {scheduler.get_last_lr()[0]:.2e}")
                running.zero_()
        # DDP: BatchNorm's running statistics are each rank's own: score and save rank 0's everywhere.
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
        # DDP: the bare model. Through ddp_model the first forward after a synchronised one would copy rank 0's
        # buffers too (in eval mode as well); the bare model never does, so the broadcast above is what makes them equal.
        counts = evaluate(model, test_loader, device)
        dist.all_reduce(counts)  # DDP: each rank scored its slice; the job's accuracy counts them all
        correct, total = int(counts[0]), int(counts[1])
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: held-out accuracy {correct / total:.4f} ({correct}/{total})")
        if args.save and rank == 0:
            # DDP: one writer (ranks writing the same file race), the bare model's keys (no "module.").
            checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "epoch": epoch + 1}
            torch.save(checkpoint, args.save)
        dist.barrier()  # DDP: nobody goes on, or exits, before rank 0 has written the file


def main() -> None:
    args = parse_args()
    rank, world_size, device = setup()
    try:
        train(args, rank, world_size, device)
    finally:
        # DDP: the model died with train()'s frame, but DDP keeps reference cycles that only the garbage
        # collector frees; a DDP model alive when the group is destroyed can make gloo abort at exit.
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
