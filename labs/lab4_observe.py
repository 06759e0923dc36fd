"""Run a training script under torchrun and record what each rank does: the lab 4 checker's eyes.

    python -m torch.distributed.run --standalone --nproc_per_node=2 labs/lab4_observe.py OUT_DIR SCRIPT [ARGS...]

labs/lab4_check.py launches this for you. Every rank installs a few patches, then runs SCRIPT as
`__main__` (with runpy, as torchrun would have run it) and writes to OUT_DIR what it saw:

- events-r<rank>.jsonl: every batch the script read from the digits train and held-out sets (the
  sample indices, and which pass over the data), every optimizer step, every collective called from
  Python and what became of it. One JSON object per line, flushed at once: a job that is killed
  still leaves its evidence.
- step-r<rank>-<k>.pt: for the first GRADIENT_STEPS optimizer steps (LAB4_OBSERVE_STEPS=N records N;
  lab 3's checker records them all), the parameters and gradients the optimizer saw (flattened),
  the optimizer's class and settings, and this rank's batch, so the checker can recompute the
  gradient and replay the steps in one process.
- a "save" event for every torch.save() the script makes (the file it wrote), so a checker can
  tell which ranks wrote a checkpoint.

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
abort that remains observable is the script's own: a DDP model still alive at destroy.
"""

from __future__ import annotations

import functools
import json
import os
import re
import runpy
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401 - before the script's init_process_group (see the docstring)
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import DataLoader, Dataset, TensorDataset

import ddp_course.data

GRADIENT_STEPS = 3  # optimizer steps whose parameters and gradients are saved for the checker (LAB4_OBSERVE_STEPS)
STALL_S = 5.0  # a peer silent this long (and not in this call) is taken to have skipped it
POLL_S = 0.005
COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all", "all_to_all_single",
    "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object", "monitored_barrier", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list",
)  # fmt: skip
_TORCH_DIR = str(Path(torch.__file__).parent)
_torch_save = torch.save  # the observer's own files; install() makes torch.save record the script's saves


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
        self.lock = threading.Lock()
        self.write_state()

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

    def batch(self, role: str, indices: list[int], via_loader: bool) -> None:
        if role == "train" and via_loader:
            self.progress += 1
            self.last_train_batch = indices
        self.activity += 1
        self.write_state()
        self.emit(kind="batch", role=role, epoch=self.passes[role], indices=indices, progress=self.progress)

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
                }  # fmt: skip
            _torch_save(record, self.out_dir / f"step-r{self.rank}-{self.steps}.pt")

    def saved(self, target) -> None:
        path = os.fspath(target) if isinstance(target, (str, os.PathLike)) else getattr(target, "name", None)
        self.emit(kind="save", path=str(Path(path).resolve()) if isinstance(path, str) else None, progress=self.progress)

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
                elif waiting and waiting["key"] != key and waiting["progress"] == call["progress"]:
                    verdict = {"peer_did": "other_call", "peer_what": waiting["what"]}
                elif time.monotonic() - seen[peer][1] > STALL_S:
                    verdict = {"peer_did": "stalled", "stall_s": STALL_S}
                else:
                    continue
                self.publish_decision(key, {"decision": "skip", "peer": peer, **verdict})
                break
            time.sleep(POLL_S)

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
    os.replace(temporary, path)


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _load_saved_digits(path: str) -> ddp_course.data.DatasetSplits:
    """The digits splits from the tensors the checker saved (see lab4_check.save_digits)."""
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
        self.recorder.batch(self.role, [int(index)], via_loader=False)
        return self.base[index]

    def __getitems__(self, indices):  # what a DataLoader calls for a whole batch
        self.recorder.batch(self.role, [int(i) for i in indices], via_loader=True)
        return [self.base[i] for i in indices]


def _role_of(dataset) -> str | None:
    """'train' or 'held_out' for a recording dataset, also inside Subset and friends."""
    for _ in range(8):
        if isinstance(dataset, RecordingDataset):
            return dataset.role
        dataset = getattr(dataset, "dataset", None)
    return None


def _call_site() -> str:
    """file:line of the first frame outside torch and this file: where the script made the call."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_TORCH_DIR) and filename != __file__:
            return f"{Path(filename).name}:{frame.f_lineno}"
        frame = frame.f_back
    return "unknown"


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
    original_load_digits = ddp_course.data.load_digits
    saved_digits = os.environ.get("LAB4_OBSERVE_DIGITS")

    @functools.wraps(original_load_digits)
    def load_digits():
        splits = _load_saved_digits(saved_digits) if saved_digits else original_load_digits()
        splits.train = RecordingDataset(splits.train, "train", recorder)
        splits.test = RecordingDataset(splits.test, "held_out", recorder)
        return splits

    ddp_course.data.load_digits = load_digits  # load_dataset("digits") calls it too

    original_iter = DataLoader.__iter__

    def iterate(loader):
        role = _role_of(loader.dataset)
        if role is not None:
            recorder.new_pass(role)
        return original_iter(loader)

    DataLoader.__iter__ = iterate
    register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: recorder.before_step(optimizer))

    inside = threading.local()  # all_gather_object calls all_gather: record the outer call only

    def observed(op, function):
        @functools.wraps(function)
        def call(*args, **kwargs):
            group = kwargs.get("group")
            if getattr(inside, "active", False) or not dist.is_initialized() or dist.get_world_size() == 1 or (
                group is not None and group is not dist.group.WORLD
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

    for op in COLLECTIVES:
        setattr(dist, op, observed(op, getattr(dist, op)))

    @functools.wraps(_torch_save)
    def save(obj, f, *args, **kwargs):
        recorder.saved(f)
        return _torch_save(obj, f, *args, **kwargs)

    torch.save = save


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: lab4_observe.py OUT_DIR SCRIPT [ARGS...] (run under torchrun)", file=sys.stderr)
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
        recorder.emit(kind="exit", status=status)
        recorder.write_state(finished=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
