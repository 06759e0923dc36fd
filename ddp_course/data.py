"""Datasets: real data that works offline by default, CIFAR-10 for GPU machines.

- "digits": the 1,797 8x8 handwritten digits that scikit-learn ships inside its package (UCI
  optical recognition of handwritten digits, test part). No download, ever. A fixed split keeps
  20% of the images aside as the held-out set, the same for every run, seed and world size.
- "cifar10": 50,000 + 10,000 32x32 colour images through torchvision. Needs --data-dir holding
  the data, or a machine that can download it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, TensorDataset

from ddp_course.cli import CourseError

DATASETS = ("digits", "cifar10")
DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0  # fixed: the held-out set must not change with --seed
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)  # per-channel statistics of the CIFAR-10 training set
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


@dataclass
class DatasetSplits:
    name: str
    train: Dataset
    test: Dataset
    num_classes: int


def load_dataset(name: str, data_dir: str | Path = "data", local_rank: int = 0) -> DatasetSplits:
    """The train and held-out splits of a dataset named in DATASETS."""
    if name == "digits":
        return load_digits()
    if name == "cifar10":
        return load_cifar10(Path(data_dir), local_rank)
    raise CourseError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


def load_digits() -> DatasetSplits:
    """Digits as tensors: images (N, 1, 8, 8) standardized with train statistics, labels (N,)."""
    from sklearn.datasets import load_digits as sklearn_digits  # imported here: sklearn is slow to import

    pixels, labels = sklearn_digits(return_X_y=True)  # pixels (1797, 64), values 0..16
    images = torch.tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8)
    labels = torch.tensor(labels, dtype=torch.long)

    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(DIGITS_SPLIT_SEED))
    n_test = round(len(images) * DIGITS_TEST_FRACTION)
    test_idx, train_idx = order[:n_test], order[n_test:]

    # Standardize with the training split's statistics only, so nothing leaks from the test set.
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = (images - mean) / std
    return DatasetSplits(
        name="digits",
        train=TensorDataset(images[train_idx], labels[train_idx]),
        test=TensorDataset(images[test_idx], labels[test_idx]),
        num_classes=10,
    )


def load_cifar10(root: Path, local_rank: int = 0) -> DatasetSplits:
    """CIFAR-10 from root; downloads it once per node when it is missing and the machine is online."""
    try:
        return _cifar10_from_disk(root)
    except RuntimeError:  # torchvision: "Dataset not found or corrupted"
        pass
    download_error = None
    if local_rank == 0:  # one download per node; the other local ranks wait at the barrier
        download_error = _try_download_cifar10(root)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    try:
        return _cifar10_from_disk(root)
    except RuntimeError:
        reason = f" ({download_error})" if download_error else ""
        raise CourseError(
            f"CIFAR-10 is not in {root} and could not be downloaded{reason}. On a machine with "
            f"internet run: python -c \"import torchvision; torchvision.datasets.CIFAR10('{root}', "
            f"download=True)\", then copy {root}/cifar-10-batches-py into --data-dir here"
        ) from None


def _cifar10_from_disk(root: Path) -> DatasetSplits:
    from torchvision import datasets, transforms

    normalize = transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)
    augment = transforms.Compose(
        [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize]
    )
    plain = transforms.Compose([transforms.ToTensor(), normalize])
    return DatasetSplits(
        name="cifar10",
        train=datasets.CIFAR10(str(root), train=True, transform=augment, download=False),
        test=datasets.CIFAR10(str(root), train=False, transform=plain, download=False),
        num_classes=10,
    )


def _try_download_cifar10(root: Path) -> str | None:
    """Download into root; on failure return why, in a few words, for the caller's error line."""
    from torchvision import datasets

    try:
        datasets.CIFAR10(str(root), train=True, download=True)
    except Exception as error:  # offline, DNS failure, disk full: all end in the same advice
        return f"{type(error).__name__}: {error}"
    return None
