"""Datasets: real data that works offline by default, CIFAR-10 for GPU machines.

- "digits": the 1,797 8x8 handwritten digits that scikit-learn ships inside its package (UCI
  optical recognition of handwritten digits, test part). No download, ever. A fixed split keeps
  20% of the images aside as the held-out set, the same for every run, seed and world size.
- "cifar10": 50,000 + 10,000 32x32 colour images through torchvision. Needs --data-dir holding
  the data, or a machine that can download it (global rank 0 then downloads it once for the job).
- the standard library's source text (lab 6): Python code that every Python installation ships,
  read as characters for a character-level language model. See load_stdlib_text().
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, TensorDataset

from ddp_course.cli import CourseError

DATASETS = ("digits", "cifar10")
DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0  # fixed: the held-out set must not change with --seed
DOWNLOAD_TIMEOUT_S = 3600.0  # how long the other ranks wait for rank 0 to download CIFAR-10 (170 MB)
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)  # per-channel statistics of the CIFAR-10 training set
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


@dataclass
class DatasetSplits:
    name: str
    train: Dataset
    test: Dataset
    num_classes: int


def load_dataset(name: str, data_dir: str | Path = "data", download_timeout_s: float | None = None) -> DatasetSplits:
    """The train and held-out splits of a dataset named in DATASETS.

    Under torchrun every rank must call it (CIFAR-10's preparation is collective, see load_cifar10).
    """
    if name == "digits":
        return load_digits()
    if name == "cifar10":
        return load_cifar10(Path(data_dir), download_timeout_s=download_timeout_s)
    raise CourseError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")


def digits_arrays():
    """scikit-learn's digits as numpy arrays: pixels (1797, 64) float64 with values 0..16, labels (1797,).

    The same arrays as sklearn.datasets.load_digits(return_X_y=True), read from the CSV file that
    scikit-learn ships and parsed as it parses it, but without importing scikit-learn: that import
    costs each process about 1.5 CPU-seconds, more than a short lab run spends on the data, and the
    tests start hundreds of ranks (tests/test_helpers.py checks both ways give equal arrays). A
    scikit-learn that keeps the file elsewhere is asked the usual way.
    """
    import gzip
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")  # finds the package without running its __init__
    folders = spec.submodule_search_locations if spec else None  # None: not installed (the import below says so)
    csv = Path(next(iter(folders or []), "")) / "datasets" / "data" / "digits.csv.gz"
    if not csv.is_file():
        from sklearn.datasets import load_digits as sklearn_digits

        return sklearn_digits(return_X_y=True)
    with gzip.open(csv, "rt", encoding="utf-8") as rows:
        table = np.loadtxt(rows, delimiter=",")  # 65 columns: 64 pixels, then the label
    return table[:, :-1], table[:, -1].astype(int, copy=False)


def load_digits() -> DatasetSplits:
    """Digits as tensors: images (N, 1, 8, 8) standardized with train statistics, labels (N,)."""
    pixels, labels = digits_arrays()  # pixels (1797, 64), values 0..16
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


def load_cifar10(root: Path, download_timeout_s: float | None = None) -> DatasetSplits:
    """CIFAR-10 from root; when any rank lacks it, global rank 0 downloads it, once for the whole job.

    Every rank runs the same collectives, whatever it finds on disk, so none is left waiting in a
    collective that the others skipped:
    1. every rank looks on disk, and all ranks share what they found: if every rank has the data,
       all return it;
    2. otherwise global rank 0 alone downloads (one download per job: several nodes downloading
       into the same shared directory at once would race and can corrupt the files), and then
       broadcasts how it went. That broadcast is the barrier every rank waits at, unconditionally;
    3. every rank looks again and all share the verdict: all return the data, or all raise the same
       CourseError.

    --data-dir is expected on storage that every node sees (NFS, Lustre...). On node-local disks,
    rank 0's download lands on node 0 only: the other nodes still miss the data at step 3, and every
    rank fails with one line saying so (copy the data to every node first) - no hang.

    The download may take minutes, longer than the process-group timeout (--timeout-s) that bounds
    the training collectives, and on NCCL a collective that times out aborts the process instead of
    raising. So these collectives run on a separate gloo group whose timeout, download_timeout_s
    (DOWNLOAD_TIMEOUT_S by default), covers a download; gloo works on CPU tensors, so they stay on
    the CPU whatever the job's backend. (Multi-node clusters where gloo picks the wrong network
    interface need GLOO_SOCKET_IFNAME, as for any gloo job.)
    """
    group = _preparation_group(DOWNLOAD_TIMEOUT_S if download_timeout_s is None else download_timeout_s)
    splits = _cifar10_or_none(root)
    if all(_gather_flags(splits is not None, group)):
        return splits
    download_error = _try_download_cifar10(root) if _global_rank() == 0 else None
    download_error = _broadcast_from_rank_0(download_error, group)  # every rank waits here for rank 0
    splits = _cifar10_or_none(root)
    found = _gather_flags(splits is not None, group)
    if all(found):
        return splits
    raise CourseError(_cifar10_missing_message(root, found, download_error))


def _cifar10_missing_message(root: Path, found: list[bool], download_error: str | None) -> str:
    """The one line every rank raises; built from facts every rank shares, so it is the same everywhere."""
    advice = (
        f"On a machine with internet run: python -c \"import torchvision; torchvision.datasets.CIFAR10('{root}', "
        f'download=True)", then copy {root}/cifar-10-batches-py into --data-dir on every node'
    )
    if any(found):
        missing = [rank for rank, has_it in enumerate(found) if not has_it]
        return (
            f"CIFAR-10 was downloaded to {root} by rank 0, but ranks {missing} do not see it: --data-dir "
            f"seems to be node-local. Put it on storage every node shares, or copy the data to every node. {advice}"
        )
    reason = f" ({download_error})" if download_error else ""
    return f"CIFAR-10 is not in {root} and could not be downloaded{reason}. {advice}"


def _preparation_group(timeout_s: float):
    """A gloo group over all ranks with its own timeout, or None outside a process group.

    It is left to teardown_distributed() (destroy_process_group destroys every group) rather than
    destroyed here: a rank that destroyed it at once could close a connection a slower peer still reads.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _gather_flags(flag: bool, group) -> list[bool]:
    """Every rank's flag, in rank order (a CPU tensor: the group is gloo)."""
    if group is None:
        return [flag]
    flags = [torch.zeros(1, dtype=torch.uint8) for _ in range(dist.get_world_size(group))]
    dist.all_gather(flags, torch.tensor([int(flag)], dtype=torch.uint8), group=group)
    return [bool(f.item()) for f in flags]


def _broadcast_from_rank_0(value, group):
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _cifar10_or_none(root: Path) -> DatasetSplits | None:
    try:
        return _cifar10_from_disk(root)
    except RuntimeError:  # torchvision: "Dataset not found or corrupted"
        return None


def _cifar10_from_disk(root: Path) -> DatasetSplits:
    from torchvision import datasets, transforms

    normalize = transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)
    augment = transforms.Compose([transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize])
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


# ---- character-level text: the standard library's own source files ------------------------------

# A fixed vocabulary, the same on every machine: id 0 stands for any character outside it (a
# non-ASCII letter in a docstring, a tab), then the newline and the 95 printable ASCII characters.
UNKNOWN_ID = 0
TEXT_CHARACTERS = "\n" + "".join(chr(code) for code in range(32, 127))
TEXT_VOCAB_SIZE = 1 + len(TEXT_CHARACTERS)  # 97
_CHARACTER_IDS = {character: index + 1 for index, character in enumerate(TEXT_CHARACTERS)}
STDLIB_MAX_CHARS = 1_000_000  # about 20 modules' worth: plenty for a few hundred steps, read in milliseconds


def encode_text(text: str) -> torch.Tensor:
    """Characters -> token ids (int64, shape (len(text),)); characters outside the vocabulary -> UNKNOWN_ID."""
    return torch.tensor([_CHARACTER_IDS.get(character, UNKNOWN_ID) for character in text], dtype=torch.long)


def decode_text(ids) -> str:
    """Token ids -> characters; UNKNOWN_ID reads as U+FFFD (the replacement character)."""
    return "".join(TEXT_CHARACTERS[i - 1] if i != UNKNOWN_ID else "\ufffd" for i in map(int, ids))


def stdlib_source_files(stdlib_dir: str | Path | None = None) -> list[Path]:
    """The public top-level modules of the standard library, sorted by name: a fixed order on any machine.

    Names starting with "_" are left out: they include _sysconfigdata_*.py, which describes how this
    particular Python was built (paths, compiler flags) rather than being shared source code.
    Which files exist still depends on the Python version, so nothing the course compares may depend
    on the text itself.
    """
    folder = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    files = sorted(path for path in folder.glob("*.py") if path.name[0].isalpha())
    if not files:
        raise CourseError(f"no Python source files in {folder}: is this a full Python installation?")
    return files


def load_stdlib_text(max_chars: int = STDLIB_MAX_CHARS, stdlib_dir: str | Path | None = None) -> str:
    """The first max_chars characters of the concatenated standard-library sources (stdlib_source_files order)."""
    parts, length = [], 0
    for path in stdlib_source_files(stdlib_dir):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text[: max_chars - length])
        length += len(parts[-1])
        if length >= max_chars:
            break
    return "".join(parts)


def text_splits(tokens: torch.Tensor, held_out_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held_out): the held-out part is the END of the text, so no window straddles both."""
    n_held_out = int(len(tokens) * held_out_fraction)
    return tokens[: len(tokens) - n_held_out], tokens[len(tokens) - n_held_out :]


def sample_windows(tokens: torch.Tensor, batch_size: int, context: int, generator: torch.Generator):
    """batch_size random windows of the text: inputs (B, T) and targets (B, T), the inputs shifted by one.

    The generator decides everything, so every rank seeded alike draws the same global batch and
    can take its own rows of it (and a single process can redo the whole batch as a reference).
    """
    if len(tokens) <= context:
        raise CourseError(f"the text has {len(tokens)} tokens, too few for windows of {context} + 1")
    starts = torch.randint(0, len(tokens) - context, (batch_size,), generator=generator)
    windows = torch.stack([tokens[start : start + context + 1] for start in starts.tolist()])  # (B, T + 1)
    return windows[:, :-1], windows[:, 1:]
