"""Train DigitsCNN on the digits data in one process: lecture 1's starting point for DDP.

    python labs/train_single.py                         # 5 epochs; held-out accuracy near 98%
    python labs/train_single.py --epochs 2 --save model.pt

Lecture 1 prints its DDP version, labs/ddp_minimal.py, as a diff of this file: every line DDP adds.
"""

import argparse
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ddp_course.cli import positive_float, positive_int
from ddp_course.data import load_digits
from ddp_course.models import DigitsCNN


def train(args):
    torch.manual_seed(args.seed)
    digits = load_digits()  # 1,438 training and 359 held-out 8x8 images, as tensors
    model = DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    train_loader = DataLoader(digits.train, batch_size=args.batch_size, shuffle=True)
    test_loader = DataLoader(digits.test, batch_size=256)
    for epoch in range(args.epochs):
        model.train()
        loss_sum, seen = 0.0, 0
        for images, labels in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)  # mean over the batch
            loss.backward()
            optimizer.step()
            loss_sum, seen = loss_sum + loss.item() * len(labels), seen + len(labels)
        model.eval()
        with torch.no_grad():
            hits = [model(images).argmax(dim=1) == labels for images, labels in test_loader]
        correct, total = sum(int(h.sum()) for h in hits), sum(len(h) for h in hits)
        print(f"epoch {epoch + 1}/{args.epochs}: train loss {loss_sum / seen:.4f}, held-out accuracy {correct / total:.4f} ({correct}/{total})")
    if args.save:
        torch.save(model.state_dict(), args.save)


def main():
    parser = argparse.ArgumentParser(description="Train DigitsCNN on the digits data in one process.")
    parser.add_argument("--epochs", type=positive_int, default=5)
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--lr", type=positive_float, default=0.05, help="SGD learning rate (momentum 0.9)")
    parser.add_argument("--seed", type=int, default=0, help="initial weights and shuffling order")
    parser.add_argument("--save", help="write the trained model's state_dict to this file")
    args = parser.parse_args()
    if args.save and not os.path.isdir(os.path.dirname(os.path.abspath(args.save))):
        parser.error(f"--save: the folder of {args.save} does not exist")
    train(args)


if __name__ == "__main__":
    main()
