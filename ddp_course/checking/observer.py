"""Run a training script under torchrun and record what each rank does: the eyes of lab 4's and lab 3's checkers.

    python -m torch.distributed.run --standalone --nproc_per_node=2 ddp_course/checking/observer.py OUT_DIR SCRIPT [ARGS...]
    python -m torch.distributed.run ... ddp_course/checking/observer.py --runs RUNS.json    # several runs, one after another

Lab 4's checker and lab 3's conversion checker (ddp_course/checking/lab4.py and conversion.py) launch this for you. Every rank installs a few
patches, then runs SCRIPT as `__main__` (with runpy, as torchrun would have run it) and writes to
OUT_DIR what it saw:

- events-r<rank>.jsonl: every batch the script read from the digits train and held-out sets (the
  sample indices, and which pass over the data), every optimizer step, every collective called from
  Python and what became of it, every torch.save and torch.load (to a path or an open file), every
  os.replace/os.rename of a file torch.save wrote (an atomic write: recorded as a save of the
  target), the BatchNorm buffers the DDP model holds when each held-out pass ends (the ones it
  scored with: a forward through the DDP wrapper may have broadcast rank 0's at the pass's start),
  each destroy_process_group() and whether the DDP model was still alive then, and whether the
  script ended with its process group open. One JSON object per line, flushed at once: a job that
  is killed still leaves its evidence.
- step-r<rank>-<k>.pt: for the first GRADIENT_STEPS optimizer steps (LAB4_OBSERVE_STEPS=N records N;
  lab 3's checker records them all), the parameters and gradients the optimizer saw (flattened),
  the optimizer's class, settings and the norm of its state, this rank's last batch, and every micro-batch since the last
  step: its samples and the tensors the DataLoader delivered (after any augmentation), whether DDP
  synchronised its backward (no_sync or not), and the gradients just before and after its
  backward(); plus every clip_grad_norm_ call of the step (the norm it returned, the gradients it
  was given and left) and how many DDP forwards did and did not synchronise. So a checker can
  recompute each gradient and replay the steps in one process.
- a "save" event for every torch.save() the script makes (the file it wrote), so a checker can
  tell which ranks wrote a checkpoint; with LAB4_OBSERVE_SNAPSHOTS=1, a copy of what each save wrote,
  in saved/ (lab 3's checker resumes a second run from the first run's checkpoint of epoch 1).

Batches are recorded where the DataLoader hands them to the script, in the script's own process,
also when worker processes (num_workers > 0) load them: the sampler's indices are taken as the
loader asks for them, in order, and matched with the batches it delivers, in the same order. A
worker started by spawn (macOS's and Windows' default) receives the recording dataset as the
dataset it wraps: nothing of the observer has to be pickled or imported there.

Some patched attributes are torch internals (PATCHED lists each with the parameters relied on):
install() refuses to run, naming the difference, when a torch release removed or changed one.

The script's load_digits() returns recording datasets. With LAB4_OBSERVE_DIGITS=FILE (the checker
passes one) their tensors come from FILE, the checker's own copy of the same digits: the ranks then
skip scikit-learn's import and its CSV, about a CPU-second each, a fifth of a rank's start-up.

Collectives are matched across ranks before they run (unless LAB4_OBSERVE_RESCUE=0). Each rank announces a call (where in the
script it was made, and how often it was made there before) and waits until every rank announced the
same call. If a peer goes on training instead, waits in a different collective at the same point,
finishes, or stalls for STALL_S seconds, the call is recorded as unmatched and skipped on every rank
that made it. Unobserved, such a job waits until the process-group timeout and dies; observed, it
goes on, so the checks that come after it can still be decided. DDP's own gradient all-reduce runs
in C++ and is not affected. With LAB4_OBSERVE_RESCUE=0 every collective runs as it would unobserved
and is only recorded (entered, failed), and state-r<rank>.json tells where each rank was waiting.

The observer keeps numbers and copied tensors only, never the model, optimizer or DDP wrapper: a DDP
model still alive at destroy_process_group() makes gloo abort at exit (ddp_course/distributed.py).
It also imports torch.distributed.nn.functional before SCRIPT runs, so that a verdict about a clean
exit does not depend on a torch quirk that is no mistake of the script: that module declares its
functions with `group=group.WORLD` defaults, evaluated when it is first imported. DDP's first
construction imports it lazily, after init_process_group, and then ten default arguments keep the
default group (and gloo's worker threads) alive past destroy_process_group(), which can abort the
process at exit ("terminate called without an active exception") in a script that did everything
right (ddp_course/distributed.py explains it where the course's own scripts make the same import).
Imported first, the defaults are None, which every collective reads as the default group. So the
abort that remains observable is the script's own: a DDP model still alive at destroy. It holds the
DDP model it records gradients of through a weak reference, for the same reason.

With --runs RUNS.json the ranks run several scripts one after another in the same processes, each
exactly as above with its own OUT_DIR, arguments, environment (LAB4_OBSERVE_* settings) and process
group (under a store prefix of its own), the script's output in OUT_DIR/stdout-r<rank>.txt and
stderr-r<rank>.txt, and its exit status in status-r<rank>.json. A run may first copy files ("copy":
[[source, target], ...], done by rank 0 while the others wait), which is how a resumed run starts
from an earlier run's checkpoint; a run whose source is missing is skipped ("skipped" in its status
file). Most of an observed job is Python and torch start-up: lab 3's checker runs its two runs, and
the tests run dozens, in one launch. A run that fails ends the launch (a peer may be blocked in a
collective that the observer cannot rescue): the later runs leave no status file.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import gc
import importlib
import inspect
import json
import os
import re
import runpy
import shutil
import sys
import threading
import time
import traceback
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401 - before the script's init_process_group (see the docstring)
import torch.nn.utils.clip_grad
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset, get_worker_info
from torch.utils.data.dataloader import _BaseDataLoaderIter

import ddp_course.data
import ddp_course.distributed
from ddp_course.checking import collectives
from ddp_course.checking.rows import give_each_group_its_own_store_keys

GRADIENT_STEPS = 3  # optimizer steps whose parameters and gradients are saved for the checker (LAB4_OBSERVE_STEPS)
STALL_S = 5.0  # a peer silent this long (and not in this call) is taken to have skipped it
POLL_S = 0.005
_TORCH_DIR = str(Path(torch.__file__).parent)
_torch_save = torch.save  # the observer's own files; install() makes torch.save record the script's saves
_torch_load = torch.load
_os_replace = os.replace  # the observer's own atomic writes; install() makes os.replace record the script's renames
_destroy_process_group = dist.destroy_process_group  # the observer's own; install() makes the script's recorded
COPY_WAIT_S = 60.0  # how long a rank waits for rank 0 to copy a run's files (--runs)
# What install() replaces, with the leading parameters its replacements pass on or read. Some are torch's
# private internals: a torch release that renames one or reorders its parameters would silently blind a
# check, so install() refuses to run when check_torch_internals() finds a difference (and the tests fail).
PATCHED = {
    "torch.utils.data.DataLoader.__iter__": ["self"],
    "torch.utils.data.dataloader._BaseDataLoaderIter._reset": ["self", "loader", "first_iter"],
    "torch.utils.data.dataloader._BaseDataLoaderIter._next_index": ["self"],
    "torch.utils.data.dataloader._BaseDataLoaderIter.__next__": ["self"],
    "torch.Tensor.backward": ["self", "gradient", "retain_graph", "create_graph", "inputs"],
    "torch.nn.parallel.DistributedDataParallel.__init__": ["self", "module"],
    "torch.nn.parallel.DistributedDataParallel.forward": ["self", "inputs", "kwargs"],
    "torch.nn.parallel.DistributedDataParallel.no_sync": ["self"],
    "torch.nn.utils.clip_grad.clip_grad_norm_": ["parameters", "max_norm"],
    "torch.optim.optimizer.register_optimizer_step_pre_hook": ["hook"],
    "torch.save": ["obj", "f"],
    "torch.load": ["f", "map_location"],
    "torch.distributed.destroy_process_group": ["group"],
}


def _resolve(dotted: str):
    """The object a dotted name such as torch.utils.data.DataLoader.__iter__ names (the longest importable module, then attributes)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            found = getattr(found, name)
        return found
    raise ImportError(dotted)


def check_torch_internals(patched: dict | None = None) -> list[str]:
    """What differs from PATCHED in this torch: a missing attribute, or leading parameters renamed or reordered."""
    problems = []
    for dotted, expected in (PATCHED if patched is None else patched).items():
        try:
            target = _resolve(dotted)
        except (ImportError, AttributeError):
            problems.append(f"{dotted} is gone")
            continue
        try:
            names = list(inspect.signature(target).parameters)
        except (TypeError, ValueError):  # a builtin without a signature: nothing to compare
            continue
        if names[: len(expected)] != expected:
            problems.append(f"{dotted} takes ({', '.join(names)}), the observer expects ({', '.join(expected)}, ...)")
    return problems


class Recorder:
    """This rank's log, and its side of the collective-matching handshake (files in out_dir)."""

    def __init__(self, out_dir: Path, rank: int, world_size: int):
        self.out_dir, self.rank, self.world_size = out_dir, rank, world_size
        self.events = open(out_dir / f"events-r{rank}.jsonl", "a")
        self.progress = 0  # training batches read + optimizer steps: equal on all ranks at any collective
        self.activity = 0  # anything at all, for telling a slow rank from a stalled one
        self.steps = 0
        self.passes = {"train": -1, "held_out": -1}  # -1: no pass over that dataset started yet
        self.last_train_batch: list[int] = []
        self.calls_at_site: dict[str, int] = {}
        self.waiting = None  # the call being matched with the peers
        self.inside = None  # the collective running now
        self.rescue = os.environ.get("LAB4_OBSERVE_RESCUE", "1") != "0"
        self.recorded_steps = int(os.environ.get("LAB4_OBSERVE_STEPS", GRADIENT_STEPS))
        self.snapshots = os.environ.get("LAB4_OBSERVE_SNAPSHOTS", "0") == "1"
        self.saves = 0
        self.written: set[str] = set()  # files torch.save wrote in this run, resolved: a rename of one is a save too
        self.model = None  # a weak reference to the latest DDP model: never keep it alive (see the docstring)
        self.micro_batches: list[dict] = []  # since the last optimizer step, while steps are being recorded
        self.clips: list[dict] = []
        self.forwards = {"synced": 0, "unsynced": 0}  # DDP forwards (training, with gradients) since the last step
        self.backwards = 0
        self.lock = threading.Lock()
        self.write_state()

    @property
    def recording(self) -> bool:
        """Is the coming optimizer step one whose details are saved?"""
        return self.steps < self.recorded_steps

    def model_parameters(self) -> list | None:
        model = self.model() if self.model is not None else None
        return None if model is None else list(model.module.parameters())

    def emit(self, **event) -> None:
        with self.lock:
            self.events.write(json.dumps(event) + "\n")
            self.events.flush()

    def write_state(self, finished: bool = False) -> None:
        state = {
            "progress": self.progress, "activity": self.activity, "waiting": self.waiting, "inside": self.inside,
            "finished": finished,
        }  # fmt: skip
        _write_json_atomically(self.out_dir / f"state-r{self.rank}.json", state)

    def peer_state(self, peer: int) -> dict | None:
        try:
            return json.loads((self.out_dir / f"state-r{peer}.json").read_text())
        except (OSError, ValueError):
            return None  # not started yet

    # --- data, steps ---------------------------------------------------------------------------
    def new_pass(self, role: str) -> None:
        self.passes[role] += 1

    def batch(self, role: str, indices: list[int], via_loader: bool, tensors=None) -> None:
        if role == "train" and via_loader:
            self.progress += 1
            self.last_train_batch = indices
            if self.recording:
                kept = [t.detach().cpu().clone() for t in tensors or [] if isinstance(t, torch.Tensor)]
                self.micro_batches.append({"indices": indices, "tensors": kept, "synced": None, "grad_before": None, "grad_after": None})
        self.activity += 1
        self.write_state()
        self.emit(kind="batch", role=role, epoch=self.passes[role], indices=indices, progress=self.progress)

    def forward(self, synced: bool) -> None:
        """A DDP forward in training mode with gradients on: its backward all-reduces unless no_sync() is on."""
        self.forwards["synced" if synced else "unsynced"] += 1
        if self.recording and self.micro_batches:
            self.micro_batches[-1]["synced"] = synced

    def flat_grads(self, params=None):
        params = self.model_parameters() if params is None else params
        return None if params is None else torch.cat([_flat_grad(p) for p in params])

    def backward(self, when: str) -> None:
        """Around each backward() while steps are recorded: the gradients before and after it."""
        if when == "after":
            self.backwards += 1
        if self.recording and self.micro_batches:
            self.micro_batches[-1][f"grad_{when}"] = self.flat_grads()

    def clipped(self, params, norm, max_norm, before) -> None:
        if self.recording:
            self.clips.append({
                "norm": float(norm), "max_norm": float(max_norm), "after_backwards": self.backwards,
                "before": before, "after": self.flat_grads(params),
            })  # fmt: skip

    def before_step(self, optimizer) -> None:
        self.steps += 1
        self.progress += 1
        self.activity += 1
        self.write_state()
        self.emit(kind="step", step=self.steps, epoch=self.passes["train"], progress=self.progress)
        if self.steps <= self.recorded_steps:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            with torch.no_grad():
                record = {
                    "step": self.steps,
                    "shapes": [list(p.shape) for p in params],
                    "params": torch.cat([p.detach().reshape(-1).float().cpu() for p in params]),
                    "grads": torch.cat([_flat_grad(p) for p in params]),
                    "missing_grads": [i for i, p in enumerate(params) if p.grad is None],
                    "batch": self.last_train_batch,
                    "optimizer": _optimizer_settings(optimizer),
                    "optimizer_state_norm": _optimizer_state_norm(optimizer),  # before this step updates it
                    "micro_batches": self.micro_batches,
                    "clips": self.clips,
                    "forwards": dict(self.forwards),
                }  # fmt: skip
            _torch_save(record, self.out_dir / f"step-r{self.rank}-{self.steps}.pt")
        self.micro_batches, self.clips, self.forwards, self.backwards = [], [], {"synced": 0, "unsynced": 0}, 0

    def saved(self, target, renamed_from: str | None = None) -> None:
        """A torch.save to a path or an open file (its name); or a rename of a file torch.save wrote
        (renamed_from): an atomic write saves a temporary file, then os.replace()s it onto its name."""
        path = _path_of(target)
        if path is not None:
            self.written.add(path)
        self.emit(kind="save", path=path, progress=self.progress, epoch=self.passes["train"], step=self.steps,
                  **({"renamed_from": renamed_from} if renamed_from else {}))  # fmt: skip

    def renamed(self, source, target) -> None:
        """os.replace/os.rename(source, target) has just happened: record it as a save if torch.save wrote source."""
        source_path = _path_of(source) if self.written else None
        if source_path in self.written:
            self.written.discard(source_path)
            self.saved(target, renamed_from=source_path)  # its snapshot was taken when torch.save wrote it

    def snapshot(self, obj, target) -> None:
        """A copy of what the script just saved to a file (a path or an open file), as saved/<k>-r<rank>.pt
        (k counts this rank's saves). Serialised here, not copied from the file: on a script whose ranks
        all write the same file, another rank may be rewriting it."""
        if not self.snapshots or _path_of(target) is None:
            return
        self.saves += 1
        folder = self.out_dir / "saved"
        folder.mkdir(exist_ok=True)
        _torch_save(obj, folder / f"{self.saves}-r{self.rank}.pt")

    def loaded(self, target, map_location) -> None:
        self.emit(kind="load", path=_path_of(target), map_location=None if map_location is None else repr(map_location), step=self.steps)

    def held_out_pass_ended(self) -> None:
        """The BatchNorm buffers (running statistics) this rank's DDP model held when a held-out pass ended:
        the ones it scored with. Read at the end, not the start: a forward through the DDP wrapper, the
        first after a synchronised one, broadcasts rank 0's buffers first (in eval mode too)."""
        model = self.model() if self.model is not None else None
        if model is None:
            return
        buffers = {name: b.detach().reshape(-1).double().cpu().tolist() for name, b in model.module.named_buffers()}
        self.emit(kind="buffers", epoch=self.passes["held_out"], train_epoch=self.passes["train"], step=self.steps, buffers=buffers)

    def destroyed(self, group) -> None:
        """destroy_process_group() is about to run: was this rank's DDP model still alive (gloo's abort at exit)?"""
        alive = self.model is not None and self.model() is not None
        self.emit(kind="destroy", default_group=group is None or group is dist.group.WORLD, ddp_model_alive=alive)

    # --- collectives ---------------------------------------------------------------------------
    def announce(self, op: str, what: str, site: str) -> dict:
        """Publish this call and decide with the peers whether it runs; returns the decision."""
        occurrence = self.calls_at_site.get(site, 0)
        self.calls_at_site[site] = occurrence + 1
        key = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{site}-{occurrence}")
        call = {"key": key, "op": op, "what": what, "progress": self.progress, "step": self.steps, "epoch": self.passes["train"]}
        if not self.rescue:
            return {**call, "decision": "run"}
        _write_json_atomically(self.out_dir / f"call-{key}-r{self.rank}.json", call)
        self.waiting, self.activity = call, self.activity + 1
        self.write_state()
        decision = self.decide(call)
        self.waiting, self.activity = None, self.activity + 1
        self.write_state()
        self.emit(kind="collective", rank=self.rank, **call, **decision)
        return {**call, **decision}

    def run_collective(self, call: dict, function, args, kwargs):
        self.inside = call
        self.write_state()
        try:
            return function(*args, **kwargs)
        except Exception as error:  # a gloo timeout, a closed connection, a detected mismatch
            message = re.sub(r"^\[[^\]]*\]\s*", "", str(error).splitlines()[0])[:300]  # drop gloo's source path
            self.emit(kind="collective_error", rank=self.rank, **call, error=message)
            raise
        finally:
            self.inside = None
            self.write_state()

    def decide(self, call: dict) -> dict:
        key, peers = call["key"], [p for p in range(self.world_size) if p != self.rank]
        seen = {peer: (None, time.monotonic()) for peer in peers}  # peer -> (activity, when it last changed)
        while True:
            decided = _read_json(self.out_dir / f"decision-{key}.json")
            if decided is not None:
                return decided
            entered = {peer: _read_json(self.out_dir / f"call-{key}-r{peer}.json") for peer in peers}
            if all(entered.values()):
                different = [peer for peer, theirs in entered.items() if theirs["what"] != call["what"]]
                if different:
                    peer = different[0]
                    verdict = {"decision": "skip", "peer": peer, "peer_did": "different_arguments", "peer_what": entered[peer]["what"]}
                else:
                    verdict = {"decision": "run"}
                self.publish_decision(key, verdict)
                continue
            for peer in (p for p in peers if entered[p] is None):
                state = self.peer_state(peer)
                if state is None:
                    continue
                if state["activity"] != seen[peer][0]:
                    seen[peer] = (state["activity"], time.monotonic())
                waiting = state["waiting"]
                if state["finished"]:
                    verdict = {"peer_did": "finished"}
                elif state["progress"] > call["progress"]:
                    verdict = {"peer_did": "went_on", "peer_progress": state["progress"]}
                elif waiting and waiting["key"] != key and waiting["progress"] == call["progress"] and not self.decided(waiting["key"]):
                    verdict = {"peer_did": "other_call", "peer_what": waiting["what"]}
                elif time.monotonic() - seen[peer][1] > STALL_S:
                    verdict = {"peer_did": "stalled", "stall_s": STALL_S}
                else:
                    continue
                self.publish_decision(key, {"decision": "skip", "peer": peer, **verdict})
                break
            time.sleep(POLL_S)

    def decided(self, key: str) -> bool:
        """Has the call `key` been decided? A peer still waiting in a decided call is only behind: it has
        not yet read the decision (with 3 ranks, rank 0 can finish a broadcast it sends, and announce its
        next call, before a receiving peer has even read that the broadcast runs)."""
        return (self.out_dir / f"decision-{key}.json").exists()

    def publish_decision(self, key: str, verdict: dict) -> None:
        """The first rank to decide wins; every rank then reads the same decision."""
        final = self.out_dir / f"decision-{key}.json"
        temporary = self.out_dir / f".decision-{key}-r{self.rank}.tmp"
        temporary.write_text(json.dumps({**verdict, "decided_by": self.rank}))
        try:
            os.link(temporary, final)  # atomic and exclusive: fails if another rank decided first
        except FileExistsError:
            pass
        temporary.unlink()


def _path_of(target) -> str | None:
    """The resolved path torch.save/torch.load/os.replace was given: a path, or an open file's name; None for a buffer."""
    path = os.fspath(target) if isinstance(target, (str, os.PathLike)) else getattr(target, "name", None)
    return str(Path(path).resolve()) if isinstance(path, str) else None


def _optimizer_state_norm(optimizer) -> float:
    """The norm of everything the optimizer keeps per parameter (AdamW's moments and step counts): equal on
    two ranks only when both hold the same optimizer state."""
    total = 0.0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                total += float(value.detach().double().pow(2).sum())
            elif isinstance(value, (int, float)):
                total += float(value) ** 2
    return total**0.5


def _flat_grad(param: torch.Tensor) -> torch.Tensor:
    if param.grad is None:
        return torch.zeros(param.numel())
    return param.grad.detach().reshape(-1).float().cpu()


def _optimizer_settings(optimizer) -> dict:
    """The optimizer's class and each group's settings (lr, momentum...) as plain values: enough to rebuild it."""
    plain = (bool, int, float, str, type(None))
    groups = []
    for group in optimizer.param_groups:
        settings = {}
        for key, value in group.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()  # a tensor learning rate
            if isinstance(value, plain) or (isinstance(value, tuple) and all(isinstance(v, plain) for v in value)):
                settings[key] = value
        groups.append({"settings": settings, "size": len(group["params"])})
    return {"class": type(optimizer).__name__, "groups": groups}


def _write_json_atomically(path: Path, obj) -> None:
    temporary = path.with_name("." + path.name + ".tmp")
    temporary.write_text(json.dumps(obj))
    _os_replace(temporary, path)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _load_saved_digits(path: str) -> ddp_course.data.DatasetSplits:
    """The digits splits from the tensors the checker saved (see ddp_course/checking/lab4.py, save_digits)."""
    saved = torch.load(path, weights_only=True)
    return ddp_course.data.DatasetSplits(
        name="digits", train=TensorDataset(*saved["train"]), test=TensorDataset(*saved["test"]), num_classes=saved["num_classes"]
    )


class RecordingDataset(Dataset):
    """A dataset that tells the recorder which samples were read, then returns them unchanged."""

    def __init__(self, base: Dataset, role: str, recorder: Recorder):
        self.base, self.role, self.recorder = base, role, recorder

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index):
        # A DataLoader's reads are recorded where it delivers the batch (install); here only the
        # script's own reads, in its own process.
        if get_worker_info() is None and not _LOADING.active:
            self.recorder.batch(self.role, [int(index)], via_loader=False)
        return self.base[index]

    def __getitems__(self, indices):  # what a DataLoader calls for a whole batch
        return [self.base[i] for i in indices]

    def __reduce__(self):
        # Sent to a DataLoader worker that is spawned (macOS's and Windows' default start method), it
        # travels as the dataset it wraps (a copy of it, made by copy.copy, which the worker can import):
        # the Recorder (an open file, a lock) stays here, and the worker needs no import of this file,
        # which runs as __main__. The batches are recorded in this process anyway.
        return copy.copy, (self.base,)


class _Loading(threading.local):
    active = False  # inside a DataLoader's fetch in this process (num_workers=0)


_LOADING = _Loading()


def _role_of(dataset) -> tuple[str | None, list]:
    """('train' or 'held_out', the Subsets on the way) for a recording dataset, also inside Subset and
    wrappers that keep it as .dataset (an augmentation); (None, []) for any other dataset."""
    subsets = []
    for _ in range(8):
        if isinstance(dataset, RecordingDataset):
            return dataset.role, subsets
        if isinstance(dataset, Subset):
            subsets.append(dataset.indices)
        dataset = getattr(dataset, "dataset", None)
    return None, []


def _underlying(indices, subsets) -> list[int]:
    """Indices into a loader's dataset -> indices into the digits split (a wrapper keeps them as they are)."""
    indices = [int(i) for i in (indices if isinstance(indices, (list, tuple)) else [indices])]
    for subset_indices in subsets:
        indices = [int(subset_indices[i]) for i in indices]
    return indices


def _caller_frame():
    """The first frame outside torch and this file: where the script (or a course helper) made the call."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    return frame


def _call_site() -> str:
    """file:line where the script made the call."""
    frame = _caller_frame()
    return "unknown" if frame is None else f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"


def _made_by_the_group_setup() -> bool:
    """A call of ddp_course.distributed itself: training_group's barrier, where every rank waits for the
    slowest to start. It is not the script's collective, and a slow start is no mismatch."""
    frame = _caller_frame()
    return frame is not None and frame.f_code.co_filename == ddp_course.distributed.__file__


def _describe(op: str, args, kwargs) -> str:
    tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if tensor is None:
        return op
    return f"{op} of a {tensor.numel()}-element {str(tensor.dtype).removeprefix('torch.')} tensor"


class _SkippedWork:
    """Stands in for the handle of a skipped async_op=True collective."""

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self):
        return True


def install(recorder: Recorder) -> None:
    if problems := check_torch_internals():
        raise RuntimeError(f"ddp_course/checking/observer.py cannot observe with torch {torch.__version__}: {'; '.join(problems)}")
    original_load_digits = ddp_course.data.load_digits
    saved_digits = os.environ.get("LAB4_OBSERVE_DIGITS")

    @functools.wraps(original_load_digits)
    def load_digits():
        splits = _load_saved_digits(saved_digits) if saved_digits else original_load_digits()
        splits.train = RecordingDataset(splits.train, "train", recorder)
        splits.test = RecordingDataset(splits.test, "held_out", recorder)
        return splits

    ddp_course.data.load_digits = load_digits  # load_dataset("digits") calls it too

    # --- the data: which samples each batch the script receives holds, and the tensors themselves ---
    original_iter, original_reset = DataLoader.__iter__, _BaseDataLoaderIter._reset
    original_next_index, original_next = _BaseDataLoaderIter._next_index, _BaseDataLoaderIter.__next__

    def iterate(loader):
        role, subsets = _role_of(loader.dataset)
        if role is not None:
            recorder.new_pass(role)
        iterator = original_iter(loader)
        iterator._observed = (role, subsets)
        return iterator

    def reset(iterator, *args, **kwargs):  # a new pass (also of persistent workers): no index is pending
        iterator._observed_indices = collections.deque()
        return original_reset(iterator, *args, **kwargs)

    def next_index(iterator):  # the sampler's next batch of indices, as the loader asks for it (maybe ahead)
        index = original_next_index(iterator)
        iterator.__dict__.setdefault("_observed_indices", collections.deque()).append(index)
        return index

    def next_batch(iterator):
        role, subsets = getattr(iterator, "_observed", (None, []))
        _LOADING.active = True
        try:
            batch = original_next(iterator)
        except StopIteration:
            if role == "held_out":
                recorder.held_out_pass_ended()
            raise
        finally:
            _LOADING.active = False
        pending = iterator.__dict__.get("_observed_indices")
        if role is not None and pending:
            tensors = batch if isinstance(batch, (list, tuple)) else [batch]
            recorder.batch(role, _underlying(pending.popleft(), subsets), via_loader=True, tensors=tensors)
        return batch

    DataLoader.__iter__ = iterate
    _BaseDataLoaderIter._reset, _BaseDataLoaderIter._next_index, _BaseDataLoaderIter.__next__ = reset, next_index, next_batch
    register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: recorder.before_step(optimizer))

    # --- DDP: the model whose gradients are recorded, and which forwards synchronise their backward ---
    original_ddp_init, original_ddp_forward = DistributedDataParallel.__init__, DistributedDataParallel.forward

    @functools.wraps(original_ddp_init)
    def ddp_init(model, *args, **kwargs):
        original_ddp_init(model, *args, **kwargs)
        recorder.model = weakref.ref(model)

    @functools.wraps(original_ddp_forward)
    def ddp_forward(model, *args, **kwargs):
        if model.training and torch.is_grad_enabled():
            recorder.forward(synced=bool(model.require_backward_grad_sync))  # False inside no_sync()
        return original_ddp_forward(model, *args, **kwargs)

    DistributedDataParallel.__init__, DistributedDataParallel.forward = ddp_init, ddp_forward

    original_backward = torch.Tensor.backward

    @functools.wraps(original_backward)
    def backward(tensor, *args, **kwargs):
        recorder.backward("before")
        result = original_backward(tensor, *args, **kwargs)
        recorder.backward("after")  # DDP's all-reduce has finished when backward() returns
        return result

    torch.Tensor.backward = backward

    original_clip = torch.nn.utils.clip_grad.clip_grad_norm_

    @functools.wraps(original_clip)
    def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)  # a generator is read once
        before = recorder.flat_grads(parameters) if recorder.recording else None
        norm = original_clip(parameters, max_norm, *args, **kwargs)
        recorder.clipped(parameters, norm, max_norm, before)
        return norm

    torch.nn.utils.clip_grad_norm_ = torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_

    inside = threading.local()  # all_gather_object calls all_gather: record the outer call only

    def observed(op, function):
        @functools.wraps(function)
        def call(*args, **kwargs):
            group = kwargs.get("group")
            # Every rank makes the calls of a group of all ranks (the default group, or the labs' training_group):
            # they are matched across ranks. A group of some ranks is not.
            if (
                getattr(inside, "active", False)
                or not dist.is_initialized()
                or dist.get_world_size() == 1
                or (group is not None and dist.get_world_size(group) != dist.get_world_size())
                or _made_by_the_group_setup()
            ):
                return function(*args, **kwargs)
            call = recorder.announce(op, _describe(op, args, kwargs), _call_site())
            if call["decision"] == "skip":
                return _SkippedWork() if kwargs.get("async_op") else None
            inside.active = True
            try:
                return recorder.run_collective(call, function, args, kwargs)
            finally:
                inside.active = False

        return call

    # Every rank of the group makes these together, so each call is matched across ranks; point-to-point
    # calls are not (two ranks make them) and run as they are.
    collectives.install(collectives.GROUP_COLLECTIVES, observed)

    @functools.wraps(_torch_save)
    def save(obj, f, *args, **kwargs):
        recorder.saved(f)
        result = _torch_save(obj, f, *args, **kwargs)
        recorder.snapshot(obj, f)
        return result

    @functools.wraps(_torch_load)
    def load(f, *args, **kwargs):
        recorder.loaded(f, kwargs.get("map_location", args[0] if args else None))
        return _torch_load(f, *args, **kwargs)

    torch.save, torch.load = save, load

    # An atomic write (ddp_course.checkpoint.atomic_save, lecture 6): torch.save to a temporary file, then a rename.
    for name in ("replace", "rename"):
        original_rename = getattr(os, name)

        def rename(source, target, *args, _original=original_rename, **kwargs):
            result = _original(source, target, *args, **kwargs)
            recorder.renamed(source, target)
            return result

        setattr(os, name, functools.wraps(original_rename)(rename))

    original_destroy = dist.destroy_process_group

    @functools.wraps(original_destroy)
    def destroy_process_group(group=None):
        recorder.destroyed(group)
        return original_destroy(group)

    dist.destroy_process_group = destroy_process_group


class CurrentRecorder:
    """What the patches report to with --runs: the Recorder of the run that runs now."""

    def __init__(self):
        self.current = None

    def __getattr__(self, name):
        return getattr(self.current, name)

    def __setattr__(self, name, value):
        if name == "current":
            object.__setattr__(self, name, value)
        else:
            setattr(self.current, name, value)


def copy_before_run(run: dict, out_dir: Path, rank: int) -> str | None:
    """Rank 0 copies the run's files while the others wait for it; returns why the run cannot start, or None."""
    done, missing = out_dir / ".copied", [source for source, _ in run.get("copy", []) if not Path(source).is_file()]
    if rank == 0:
        if not missing:
            for source, target in run.get("copy", []):
                shutil.copyfile(source, target)
        _write_json_atomically(done, {"missing": missing})
    deadline = time.monotonic() + COPY_WAIT_S
    while (decided := _read_json(done)) is None:
        if time.monotonic() > deadline:
            return f"rank 0 did not copy the run's files within {COPY_WAIT_S:g} s"
        time.sleep(POLL_S)
    return f"no file to start from: {', '.join(decided['missing'])}" if decided["missing"] else None


def run_one(proxy: CurrentRecorder, run: dict, rank: int, world_size: int) -> int:
    """One run of --runs: main()'s single run, with the script's output in files; returns its exit status."""
    out_dir, script = Path(run["out_dir"]), Path(run["script"]).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    started, status = time.monotonic(), 1
    skipped = copy_before_run(run, out_dir, rank)
    if skipped:
        (out_dir / f"status-r{rank}.json").write_text(json.dumps({"status": None, "skipped": skipped, "wall_s": 0.0}))
        return 0
    saved_argv, saved_path, saved_env = list(sys.argv), list(sys.path), dict(os.environ)
    os.environ.update(run.get("env", {}))  # before the Recorder, which reads the LAB4_OBSERVE_* settings
    proxy.current = recorder = Recorder(out_dir, rank, world_size)
    sys.argv = [str(script), *run["args"]]
    sys.path[0] = str(script.parent)  # as if python had been started on SCRIPT itself
    with open(out_dir / f"stdout-r{rank}.txt", "w") as out, open(out_dir / f"stderr-r{rank}.txt", "w") as err:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(script), run_name="__main__")
                status = 0
            except SystemExit as done:
                status = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
                if isinstance(done.code, str):
                    print(done.code, file=sys.stderr)  # sys.exit("message"), as Python itself would print it
            except BaseException:
                traceback.print_exc()
            finally:
                # group_open: the script left without destroy_process_group() (the observer destroys it below)
                recorder.emit(kind="exit", status=status, group_open=dist.is_initialized())
                recorder.write_state(finished=True)
                recorder.events.close()
    gc.collect()  # DDP's reference cycles would keep the run's group alive (ddp_course/distributed.py)
    if dist.is_initialized():  # the script left its group open (its exit event says so)
        _destroy_process_group()
    # What survived is the process's lasting state (torch, its compiled-in modules, torch._dynamo that
    # DDP imported): move it out of the collector's sight, so that every later gc.collect() (the next
    # script's, and the line above) scans only what the next run creates: 0.27 s less per call here.
    gc.freeze()
    sys.argv, sys.path[:] = saved_argv, saved_path
    os.environ.clear()
    os.environ.update(saved_env)
    (out_dir / f"status-r{rank}.json").write_text(json.dumps({"status": status, "wall_s": time.monotonic() - started}))
    return status


def run_all(runs_file: str) -> int:
    """--runs: every run of the file in order, in these processes; stops at the first that fails."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    proxy = CurrentRecorder()
    install(proxy)
    give_each_group_its_own_store_keys("run")  # each run forms the job's group anew
    for run in json.loads(Path(runs_file).read_text()):
        status = run_one(proxy, run, rank, world_size)
        if status != 0:
            return status
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--runs":
        status = run_all(argv[1])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # after a failing run a peer may be blocked in a collective; torchrun must see the status
    if len(argv) < 2:
        print("usage: observer.py OUT_DIR SCRIPT [ARGS...] | --runs RUNS.json (run under torchrun)", file=sys.stderr)
        return 2
    out_dir, script = Path(argv[0]), Path(argv[1]).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    recorder = Recorder(out_dir, rank, world_size)
    install(recorder)
    sys.argv = [str(script), *argv[2:]]
    sys.path[0] = str(script.parent)  # as if python had been started on SCRIPT itself
    status = 1
    try:
        runpy.run_path(str(script), run_name="__main__")
        status = 0
    except SystemExit as done:
        status = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        raise
    finally:
        recorder.emit(kind="exit", status=status, group_open=dist.is_initialized())
        recorder.write_state(finished=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
