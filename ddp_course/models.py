"""Models used by the labs.

DigitsCNN deliberately has no dropout and no batch-norm: with them, N ranks at batch B would not
match one process at batch N x B (dropout draws different masks per rank, batch-norm normalizes
each rank's shard with its own statistics). Without them the equivalence is exact up to float
rounding, and the labs and tests prove it.
"""

from __future__ import annotations

import torch
from torch import nn

MODEL_FOR_DATASET = {"digits": "digits_cnn", "cifar10": "resnet18"}
MODEL_NAMES = ("digits_cnn", "resnet18", "wide_mlp", "conv_net")


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions and two linear layers for 1x8x8 digit images (about 0.14 M parameters)."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, kernel_size=3, padding=1),  # (B, 32, 8, 8)
            nn.ReLU(),
            nn.Conv2d(32, 64, kernel_size=3, padding=1),  # (B, 64, 8, 8)
            nn.ReLU(),
            nn.MaxPool2d(2),  # (B, 64, 4, 4)
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),  # (B, 1024)
            nn.Linear(64 * 4 * 4, 128),
            nn.ReLU(),
            nn.Linear(128, num_classes),  # (B, num_classes) logits
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))


class WideMLP(nn.Module):
    """Many parameters, little arithmetic per sample: gradient traffic dominates (lab 5's comm-bound case).

    With the defaults: 13.1 M parameters, so 52.5 MB of fp32 gradients to all-reduce every step,
    for only 26 MFLOP of forward pass per sample (about three times that with the backward pass).
    """

    def __init__(self, in_features: int = 256, width: int = 2048, depth: int = 4, num_classes: int = 10):
        super().__init__()
        layers = [nn.Linear(in_features, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, num_classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features)


class ConvNet(nn.Module):
    """Few parameters, much arithmetic per sample: compute dominates (lab 5's compute-bound case).

    Three 3x3 convolutions on 3x32x32 images: 0.09 M parameters (0.38 MB of gradients) for 77 MFLOP
    of forward pass per image: about 400 times the arithmetic per byte of gradient of WideMLP.
    """

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, kernel_size=3, padding=1), nn.ReLU(),  # (B, 32, 32, 32)
            nn.Conv2d(32, 64, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # (B, 64, 16, 16)
            nn.Conv2d(64, 128, kernel_size=3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),  # (B, 128, 1, 1)
        )  # fmt: skip
        self.classifier = nn.Linear(128, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).flatten(1))


def resnet18_cifar(num_classes: int = 10) -> nn.Module:
    """torchvision's resnet18, no pretrained weights, with the small-image stem used for CIFAR.

    The ImageNet stem (7x7 stride-2 convolution, then max-pooling) shrinks a 32x32 image to 8x8
    before the first block; the CIFAR variant of He et al. 2016 (section 4.2) keeps a 3x3 stride-1
    first convolution and no pooling.
    """
    from torchvision.models import resnet18  # imported here: torchvision is slow to import

    model = resnet18(weights=None, num_classes=num_classes)
    model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def build_model(name: str, num_classes: int = 10) -> nn.Module:
    """A fresh model by name; seed the generators first so every rank builds the same weights."""
    if name == "digits_cnn":
        return DigitsCNN(num_classes)
    if name == "resnet18":
        return resnet18_cifar(num_classes)
    if name == "wide_mlp":
        return WideMLP(num_classes=num_classes)
    if name == "conv_net":
        return ConvNet(num_classes)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
