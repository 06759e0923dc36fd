"""Checkpoints that survive crashes and load safely.

- Atomic: write a temporary file in the same directory, flush it to disk, then os.replace() it
  over the final name. A crash mid-write leaves the previous checkpoint untouched, never half a file.
  The directory is flushed after the rename too, so the new name also survives a power loss.
- Rank 0 writes, then every rank waits at a barrier, so no rank races ahead and reads a file that
  is not there yet.
- Only tensors, numbers, strings, lists, tuples and dicts go in, so torch.load(weights_only=True)
  (the default since torch 2.6) can load it without executing arbitrary pickled code.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_course.cli import CourseError
from ddp_course.seeding import get_rng_state

CHECKPOINT_PATTERN = re.compile(r"checkpoint_step(\d+)\.pt")


def checkpoint_path(directory: str | Path, global_step: int) -> Path:
    return Path(directory) / f"checkpoint_step{global_step:08d}.pt"


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoints in directory, oldest first (by the optimizer step in their name)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if CHECKPOINT_PATTERN.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(CHECKPOINT_PATTERN.fullmatch(p.name).group(1)))


def latest_checkpoint(directory: str | Path) -> Path | None:
    checkpoints = list_checkpoints(directory)
    return checkpoints[-1] if checkpoints else None


def atomic_save(obj, path: str | Path) -> None:
    """torch.save(obj, path), all or nothing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    try:
        with open(temporary, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())  # on disk before the rename makes it visible
        os.replace(temporary, path)
        fsync_directory(path.parent)  # the rename itself is a change to the directory
    finally:
        temporary.unlink(missing_ok=True)  # only left over when saving failed


def fsync_directory(directory: str | Path) -> None:
    """Flush a directory's entries to disk, so a rename in it survives a power loss (POSIX).

    os.replace() is atomic for processes, but the new directory entry may still sit in the page
    cache; a power cut then brings back the old name. Windows cannot open a directory for fsync,
    and some filesystems refuse it: there we skip it (crash safety for processes is unchanged).
    """
    try:
        descriptor = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:  # e.g. EINVAL on filesystems without directory fsync
        pass
    finally:
        os.close(descriptor)


def atomic_write_json(obj, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(temporary, path)


def gather_rng_states() -> list[dict]:
    """Every rank's generator states, in rank order. A collective: every rank must call it."""
    if not (dist.is_available() and dist.is_initialized()):
        return [get_rng_state()]
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, get_rng_state())
    return states


def save_checkpoint(state: dict, directory: str | Path, global_step: int, is_main: bool, keep_last: int = 3) -> Path:
    """Rank 0 writes state atomically and keeps the newest keep_last files; then all ranks sync."""
    path = checkpoint_path(directory, global_step)
    if is_main:
        atomic_save(state, path)
        for old in list_checkpoints(directory)[:-keep_last]:
            old.unlink()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return path


def load_checkpoint(path: str | Path, required_keys: tuple[str, ...] = ()) -> dict:
    """Load a checkpoint with weights_only=True; anything unusable is a CourseError with one line."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # truncated file, not a torch file, unsafe pickle: all unusable
        raise CourseError(f"cannot load checkpoint {path}: corrupt or not a checkpoint ({type(error).__name__})") from None
    missing = [key for key in required_keys if not (isinstance(state, dict) and key in state)]
    if missing:
        raise CourseError(f"{path} is not a training checkpoint of this lab (missing {', '.join(missing)})")
    return state
