"""Train a digits classifier in one process, the way real training scripts do: the conversion exercise's start.

    python labs/train_realistic.py                          # 8 epochs, about 98% held-out, seconds on a CPU
    python labs/train_realistic.py --epochs 4 --save run.pt
    python labs/train_realistic.py --epochs 8 --save run.pt --resume    # continue run.pt to 8 epochs

It has what real scripts have and lecture 1's DDP diff does not answer: a model with BatchNorm, AdamW
with a learning rate that warms up and then follows a cosine per optimizer step, gradient clipping by
global norm, gradient accumulation over --accumulation micro-batches, a DataLoader with worker
processes and a seeded random augmentation, the training loss printed every --log-every optimizer
steps, the held-out accuracy after every epoch, a checkpoint written every epoch, and --resume.

The exercise (lab 3's sheet, section 7): copy it (cp labs/train_realistic.py labs/my_ddp.py), turn
the copy into a DDP script that torchrun runs on any number of processes, and check it with
`python labs/lab3_convert_check.py`. Keep its flags and the form of its printed lines; --batch-size
becomes the batch of each process. Each feature above asks a decision; the checklist
labs/convert_checklist.md lists them, where the course teaches each, and which check catches it.
"""

import argparse
import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import clip_grad_norm_
from torch.utils.data import DataLoader, Dataset

from ddp_course.cli import non_negative_int, positive_float, positive_int
from ddp_course.data import load_digits


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
def evaluate(model: nn.Module, loader: DataLoader) -> tuple[int, int]:
    """(correct, total) on the held-out images."""
    model.eval()
    correct = total = 0
    for images, labels in loader:
        correct += int((model(images).argmax(dim=1) == labels).sum())
        total += len(labels)
    return correct, total


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train DigitsNet on the digits data in one process (see the docstring).")
    parser.add_argument("--epochs", type=positive_int, default=8)
    parser.add_argument("--batch-size", type=positive_int, default=32, help="samples per micro-batch")
    parser.add_argument("--accumulation", type=positive_int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=positive_float, default=4e-3, help="AdamW's peak learning rate")
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--warmup-steps", type=positive_int, default=10, help="optimizer steps of linear warm-up")
    parser.add_argument("--clip-norm", type=positive_float, default=1.0, help="clip the gradient's global norm to this")
    parser.add_argument("--workers", type=non_negative_int, default=2, help="DataLoader worker processes")
    parser.add_argument("--log-every", type=positive_int, default=10, help="print the training loss every N optimizer steps")
    parser.add_argument("--seed", type=int, default=0, help="initial weights, shuffling and augmentation")
    parser.add_argument("--save", help="checkpoint file, written after every epoch")
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint at --save")
    args = parser.parse_args()
    if args.save and not os.path.isdir(os.path.dirname(os.path.abspath(args.save))):
        parser.error(f"--save: the folder of {args.save} does not exist")
    if args.resume and not (args.save and os.path.isfile(args.save)):
        parser.error("--resume needs an existing checkpoint at --save")
    return args


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    digits = load_digits()  # 1,438 training and 359 held-out 8x8 images, as tensors
    model = DigitsNet(digits.num_classes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    steps_per_epoch = math.ceil(len(digits.train) / (args.batch_size * args.accumulation))
    total_steps = args.epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, total_steps, args.warmup_steps, args.lr) / args.lr)
    generator = torch.Generator()  # shuffles, and seeds the workers' augmentation
    train_loader = DataLoader(RandomShift(digits.train), batch_size=args.batch_size, shuffle=True, num_workers=args.workers, generator=generator)
    test_loader = DataLoader(digits.test, batch_size=256)
    start_epoch = 0
    if args.resume:
        checkpoint = torch.load(args.save, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        start_epoch = checkpoint["epoch"]
        print(f"resumed from {args.save} after epoch {start_epoch}")

    step = start_epoch * steps_per_epoch
    running_loss, running_samples = 0.0, 0
    for epoch in range(start_epoch, args.epochs):
        generator.manual_seed(args.seed * 1000 + epoch)  # this epoch's order and augmentation, also after a resume
        model.train()
        for micro_step, (images, labels) in enumerate(train_loader):
            loss = F.cross_entropy(model(images), labels)  # the mean over this micro-batch
            (loss / args.accumulation).backward()  # gradients add up in .grad over the micro-batches
            running_loss, running_samples = running_loss + loss.item() * len(labels), running_samples + len(labels)
            if (micro_step + 1) % args.accumulation != 0 and micro_step + 1 != len(train_loader):
                continue
            clip_grad_norm_(model.parameters(), args.clip_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step % args.log_every == 0:
                print(f"step {step}: train loss {running_loss / running_samples:.4f}, lr {scheduler.get_last_lr()[0]:.2e}")
                running_loss, running_samples = 0.0, 0
        correct, total = evaluate(model, test_loader)
        print(f"epoch {epoch + 1}/{args.epochs}: held-out accuracy {correct / total:.4f} ({correct}/{total})")
        if args.save:
            checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "epoch": epoch + 1}
            torch.save(checkpoint, args.save)


if __name__ == "__main__":
    main()
