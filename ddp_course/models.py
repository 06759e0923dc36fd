"""Models used by the labs.

DigitsCNN deliberately has no batch-norm and, by default, no dropout: with them, N ranks at batch
B would not match one process at batch N x B (dropout draws different masks per rank, batch-norm
normalizes each rank's shard with its own statistics). Without them the equivalence is exact up to
float rounding, and the labs and tests prove it. DigitsCNN(dropout=P) adds dropout for the resume
tests of labs 3 and 7: a model that draws random numbers at every step can only resume bit for bit
if the checkpoint restores every rank's generator state and nothing else draws from it.
DigitsCNN(batch_norm=True) adds batch-norm for lab 10, whose accuracy fault is exactly that difference.
"""

from __future__ import annotations

import torch
from torch import nn

MODEL_FOR_DATASET = {"digits": "digits_cnn", "cifar10": "resnet18"}
MODEL_NAMES = ("digits_cnn", "resnet18", "wide_mlp", "conv_net")


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions and two linear layers for 1x8x8 digit images (151,306 parameters).

    batch_norm=True (lab 10) first standardises each of the 64 pixels with a BatchNorm layer: in
    training mode with the mean and variance of that pixel over the batch it is given. Only at the
    input: BatchNorm between the layers would also make the model forgive a learning rate left
    unscaled (measured: 98 % instead of 72 %), and lab 10 plants that fault too.
    """

    def __init__(self, num_classes: int = 10, dropout: float = 0.0, batch_norm: bool = False):
        super().__init__()
        # Identity has no parameters: without batch_norm the names and the checkpoints stay as they were.
        self.input_norm = nn.BatchNorm1d(8 * 8) if batch_norm else nn.Identity()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, kernel_size=3, padding=1),  # (B, 32, 8, 8)
            nn.ReLU(),
            nn.Conv2d(32, 64, kernel_size=3, padding=1),  # (B, 64, 8, 8)
            nn.ReLU(),
            nn.MaxPool2d(2),  # (B, 64, 4, 4)
        )
        # A separate module, so the parameter names (classifier.1.weight, ...) do not depend on it.
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.classifier = nn.Sequential(
            nn.Flatten(),  # (B, 1024)
            nn.Linear(64 * 4 * 4, 128),
            nn.ReLU(),
            nn.Linear(128, num_classes),  # (B, num_classes) logits
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        images = self.input_norm(images.flatten(1)).view_as(images)  # (B, 64): one statistic per pixel
        return self.classifier(self.dropout(self.features(images)))


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


def build_model(name: str, num_classes: int = 10, dropout: float = 0.0) -> nn.Module:
    """A fresh model by name; seed the generators first so every rank builds the same weights.

    dropout: the probability of DigitsCNN's optional dropout layer (the other models have no such option).
    """
    if dropout and name != "digits_cnn":
        raise ValueError(f"only digits_cnn has an optional dropout layer, not {name!r}")
    if name == "digits_cnn":
        return DigitsCNN(num_classes, dropout)
    if name == "resnet18":
        return resnet18_cifar(num_classes)
    if name == "wide_mlp":
        return WideMLP(num_classes=num_classes)
    if name == "conv_net":
        return ConvNet(num_classes)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")


def train_flops_per_sample(name: str, input_shape: tuple[int, ...]) -> float:
    """Forward + backward FLOPs of one sample through build_model(name), counted by torch itself.

    torch's counter counts 2 FLOPs per multiply-add over the batch; a batch of 2 (BatchNorm needs more
    than one sample) halved gives one sample's share. Lab 5 divides it by the gradient bytes: the FLOPs
    a model does per byte it all-reduces decide how well it scales.
    """
    from torch.utils.flop_counter import FlopCounterMode

    model = build_model(name)
    with FlopCounterMode(display=False) as counter:
        model(torch.randn(2, *input_shape)).sum().backward()
    return counter.get_total_flops() / 2


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions 0..t only (a language model's mask)."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not a multiple of n_heads={n_heads}")
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)  # queries, keys and values in one matmul
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, d_model = x.shape
        # (B, T, 3C) -> three (B, heads, T, C/heads) tensors
        q, k, v = (t.view(batch, time, self.n_heads, -1).transpose(1, 2) for t in self.qkv(x).split(d_model, dim=2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # no dropout: deterministic
        return self.proj(y.transpose(1, 2).reshape(batch, time, d_model))


class TransformerBlock(nn.Module):
    """Pre-norm block (as in GPT-2): x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attention = CausalSelfAttention(d_model, n_heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    """A small decoder-only transformer for character-level language modelling (lab 6's workload).

    Chosen for DDP rather than for quality: 12 parameter tensors per block of very different sizes
    (a LayerNorm bias of d_model floats up to the 4 x d_model^2 MLP weights), so gradient buckets
    have something to group, and the output layer shares its weight with the token embedding
    (weight tying, Press & Wolf 2017): one Parameter used twice in the forward pass, which
    model.parameters() lists once and whose gradient is the sum of both uses. No dropout and no
    batch-norm: N ranks at batch B then match one process at batch N x B up to float rounding.

    Input (B, T) token ids with T <= context; output (B, T, vocab_size) logits for the next token.
    """

    def __init__(self, vocab_size: int, context: int = 64, d_model: int = 128, n_layers: int = 4, n_heads: int = 4):
        super().__init__()
        self.context = context
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.position_embedding = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, n_heads) for _ in range(n_layers))
        self.final_norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.token_embedding.weight  # tied: the same Parameter object, one storage
        nn.init.normal_(self.token_embedding.weight, std=0.02)  # GPT-2's scale; N(0, 1) would make huge first logits
        nn.init.normal_(self.position_embedding.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        time = tokens.shape[1]
        if time > self.context:
            raise ValueError(f"sequence of {time} tokens is longer than the model's context of {self.context}")
        positions = torch.arange(time, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))  # (B, T, vocab_size)
