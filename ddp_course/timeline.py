"""A per-rank timeline of a DDP training script: where each optimizer step's time went, rank by rank.

    torchrun --standalone --nproc_per_node=2 -m ddp_course.timeline labs/lab10_slow_ddp.py [ARGS...]
    torchrun --standalone --nproc_per_node=2 -m ddp_course.timeline --out runs/tl SCRIPT [ARGS...]

It runs SCRIPT unchanged, as torchrun would (as `__main__`, with ARGS), and watches it from outside:
nothing in the script needs to know. Each rank writes OUT/timeline-r{rank}.json; then rank 0 prints a
table of the job's steps and the shares of their time. What it records per optimizer step and rank:

- wall and CPU time of the whole step (from one optimizer step to the next). CPU time is what the
  process computed; the rest of the wall time it waited, or another program had the core;
- data wait: time inside the DataLoader's `next()` (the batch was not ready);
- communication: time the rank spent blocked at the end of backward() while DDP's all-reduces
  finished, split into *waiting for others* (the last rank's gradients were not ready yet: the
  step's last bucket became ready on that rank later than on this one) and the rest (the
  all-reduce itself);
- compute: the remainder (forward, backward, optimizer, and anything else the script does);
- all-reduce calls and bytes, and which of DDP's buckets they carried (a counting communication
  hook: DDP's own all-reduce, called through torch's `allreduce_hook`); the threads the rank runs;
  whether the wrapper searches for unused parameters, and how many it found;
- the smallest batch a BatchNorm layer normalised in training mode: the samples its statistics
  came from, on this rank alone.

Shares computed from CPU time do not depend on how busy the machine is (other programs slow the wall
clock, not the work); the wall-clock split is what a profiler shows. Lab 10's checker
(ddp_course/checking/lab10.py) reads these records; `draw(ax, records)` draws a few steps as a figure.
Limits: one DDP model per script; a script that registers a communication hook of its own gets it
wrapped by the counting one; BatchNorm is seen through its modules, not in a bare F.batch_norm call;
on GPUs (written, not run on a GPU) the CPU times say little, since the GPU computes asynchronously.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import runpy
import sys
import time
import traceback
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data.dataloader import _BaseDataLoaderIter

CATEGORIES = ("data wait", "compute", "communication", "waiting for others")
COLOURS = {"data wait": "tab:orange", "compute": "tab:blue", "communication": "tab:green", "waiting for others": "tab:red"}
WARMUP_STEPS = 2  # DDP rebuilds its buckets in the second iteration: the first two steps are not typical
WAIT_FOR_FILES_S = 60.0


class Recorder:
    """What one rank did, step by step; install() points the patched functions at the current one."""

    def __init__(self):
        self.steps: list[dict] = []
        self.ddp = None  # a weak reference: the recorder must not keep the wrapper (and its group) alive
        self.hooked = False
        self._open_step()

    def _open_step(self) -> None:
        self.current = {"start": time.time(), "cpu_start": time.process_time(), "data_wall_s": 0.0, "data_cpu_s": 0.0,
                        "blocked_s": 0.0, "ready_at": None, "allreduce_calls": 0, "allreduce_bytes": 0, "buckets": [],
                        "samples": 0, "batch_norm_min_batch": None}  # fmt: skip

    def batch_loaded(self, wall_s: float, cpu_s: float, batch) -> None:
        self.current["data_wall_s"] += wall_s
        self.current["data_cpu_s"] += cpu_s
        first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
        if isinstance(first, torch.Tensor) and first.dim() > 0 and torch.is_grad_enabled():
            self.current["samples"] += first.shape[0]

    def batch_normalised(self, samples: int) -> None:
        smallest = self.current["batch_norm_min_batch"]
        self.current["batch_norm_min_batch"] = samples if smallest is None else min(smallest, samples)

    def bucket_ready(self, index: int, nbytes: int) -> None:
        self.current["allreduce_calls"] += 1
        self.current["allreduce_bytes"] += nbytes
        self.current["buckets"].append(index)
        self.current["ready_at"] = time.time()  # the last bucket's time is when this rank's gradients were all ready

    def backward_blocked(self, seconds: float) -> None:
        self.current["blocked_s"] += seconds

    def optimizer_stepped(self) -> None:
        step = self.current
        step.update(end=time.time(), cpu_s=time.process_time() - step.pop("cpu_start"), threads=torch.get_num_threads())
        step["wall_s"] = step["end"] - step["start"]
        ddp = self.ddp() if self.ddp else None
        if ddp is not None:
            step["find_unused_parameters"] = bool(ddp.find_unused_parameters)
            if ddp.find_unused_parameters:
                step["unused_parameter_bytes"] = int(ddp._get_ddp_logging_data().get("unused_parameter_size", 0))
        self.steps.append(step)
        self._open_step()


class CurrentRecorder:
    """The patched functions call this; --runs gives it a fresh Recorder per run."""

    recorder: Recorder | None = None


CURRENT = CurrentRecorder()


def counting(hook):
    """A communication hook that records each bucket it is given, then runs `hook`."""

    @functools.wraps(hook)
    def counted(state, bucket):
        if CURRENT.recorder is not None:
            buffer = bucket.buffer()
            CURRENT.recorder.bucket_ready(bucket.index(), buffer.numel() * buffer.element_size())
        return hook(state, bucket)

    return counted


def install() -> None:
    """Patch DataLoader iteration, DDP and backward() once per process; every patch reports to CURRENT."""
    original_next = _BaseDataLoaderIter.__next__

    def timed_next(iterator):
        wall, cpu = time.perf_counter(), time.process_time()
        batch = original_next(iterator)
        if CURRENT.recorder is not None:
            CURRENT.recorder.batch_loaded(time.perf_counter() - wall, time.process_time() - cpu, batch)
        return batch

    _BaseDataLoaderIter.__next__ = timed_next

    original_init, original_forward = DistributedDataParallel.__init__, DistributedDataParallel.forward
    original_register = DistributedDataParallel.register_comm_hook

    @functools.wraps(original_init)
    def ddp_init(model, *args, **kwargs):
        original_init(model, *args, **kwargs)
        if CURRENT.recorder is not None:
            CURRENT.recorder.ddp = weakref.ref(model)

    @functools.wraps(original_register)
    def register_comm_hook(model, state, hook):  # the script's own hook, counted
        model._timeline_hooked = True
        return original_register(model, state, counting(hook))

    @functools.wraps(original_forward)
    def ddp_forward(model, *args, **kwargs):
        # A hook can be registered once, before the first forward: the counted default goes in then,
        # unless the script registered its own. allreduce_hook is DDP's own all-reduce, in Python.
        if not getattr(model, "_timeline_hooked", False):
            model._timeline_hooked = True
            original_register(model, None, counting(default_hooks.allreduce_hook))
        return original_forward(model, *args, **kwargs)

    DistributedDataParallel.__init__, DistributedDataParallel.forward = ddp_init, ddp_forward
    DistributedDataParallel.register_comm_hook = register_comm_hook

    original_backward = torch.Tensor.backward

    @functools.wraps(original_backward)
    def backward(tensor, *args, **kwargs):
        # Blocked time: wall time minus this thread's CPU time. On CPU tensors autograd computes on the
        # calling thread, so what is left is waiting, mostly for DDP's all-reduces at the end.
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return original_backward(tensor, *args, **kwargs)
        finally:
            if CURRENT.recorder is not None:
                CURRENT.recorder.backward_blocked(max(0.0, (time.perf_counter() - wall) - (time.thread_time() - cpu)))

    torch.Tensor.backward = backward

    def batch_norm_input(module, inputs):
        # In training mode a BatchNorm layer (SyncBatchNorm included) takes its statistics from this
        # batch; in eval mode from its running averages, so only training-mode calls count.
        if CURRENT.recorder is not None and module.training and isinstance(module, _BatchNorm) and inputs and inputs[0].dim() > 0:
            CURRENT.recorder.batch_normalised(inputs[0].shape[0])

    register_module_forward_pre_hook(batch_norm_input)
    register_optimizer_step_post_hook(lambda optimizer, args, kwargs: CURRENT.recorder and CURRENT.recorder.optimizer_stepped())
    original_init_group = dist.init_process_group

    @functools.wraps(original_init_group)
    def init_process_group(*args, **kwargs):
        if CURRENT.recorder is not None and kwargs.get("timeout") is not None:
            CURRENT.recorder.group_timeout_s = kwargs["timeout"].total_seconds()  # the default group's
        return original_init_group(*args, **kwargs)

    dist.init_process_group = init_process_group


# --- running a script under the recorder ---------------------------------------------------------------------
def record_file(out_dir: str | Path, rank: int) -> Path:
    return Path(out_dir) / f"timeline-r{rank}.json"


def run_script(script: str | Path, args: list[str], out_dir: str | Path, rank: int, capture: bool = False) -> int:
    """Run script as `__main__` with args under a fresh Recorder; write its record; return its exit status.

    capture: the script's stdout and stderr go to OUT_DIR/stdout-r{rank}.txt and stderr-r{rank}.txt
    (--runs, where several scripts share one launch).
    """
    out_dir, script = Path(out_dir), Path(script).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    CURRENT.recorder = recorder = Recorder()
    recorder.group_timeout_s = None
    saved_argv, saved_path, threads = list(sys.argv), list(sys.path), torch.get_num_threads()
    sys.argv, sys.path[0] = [str(script), *map(str, args)], str(script.parent)  # as if python had started SCRIPT
    status, error, started = 1, None, time.monotonic()
    with contextlib.ExitStack() as stack:
        if capture:
            stack.enter_context(contextlib.redirect_stdout(stack.enter_context(open(out_dir / f"stdout-r{rank}.txt", "w"))))
            stack.enter_context(contextlib.redirect_stderr(stack.enter_context(open(out_dir / f"stderr-r{rank}.txt", "w"))))
        try:
            runpy.run_path(str(script), run_name="__main__")
            status = 0
        except SystemExit as done:
            status = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
        except BaseException as failure:  # the script's own crash is part of what we observe
            error = f"{type(failure).__name__}: {str(failure).splitlines()[0][:300] if str(failure) else ''}"
            traceback.print_exc()
    CURRENT.recorder = None
    gc.collect()  # DDP's reference cycles would keep the run's group alive (ddp_course/distributed.py)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.argv, sys.path[:] = saved_argv, saved_path
    torch.set_num_threads(threads)  # the next run starts with the threads torchrun gave this rank
    record = {"rank": rank, "status": status, "error": error, "wall_s": time.monotonic() - started,
              "group_timeout_s": recorder.group_timeout_s, "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
              "cores": usable_cores(), "steps": recorder.steps}  # fmt: skip
    path = record_file(out_dir, rank)
    path.with_suffix(".tmp").write_text(json.dumps(record))
    path.with_suffix(".tmp").replace(path)
    return status


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run_all(runs_file: str | Path, rank: int) -> int:
    """--runs: [{"script", "args", "out_dir"}, ...] one after another in this process; stop at the first failure.

    After a failed run a peer may still be blocked in a collective: nothing after it can be trusted.
    """
    from ddp_course.checking.rows import give_each_group_its_own_store_keys

    give_each_group_its_own_store_keys("timeline")  # each run forms the job's group anew
    for run in json.loads(Path(runs_file).read_text()):
        status = run_script(run["script"], run["args"], run["out_dir"], rank, capture=True)
        if status != 0:
            return status
    return 0


def read_run(out_dir: str | Path, world_size: int, wait_s: float = 0.0) -> dict[int, dict]:
    """{rank: record} of one run; waits up to wait_s for every rank's file."""
    deadline = time.monotonic() + wait_s
    while True:
        found = {rank: json.loads(path.read_text()) for rank in range(world_size) if (path := record_file(out_dir, rank)).exists()}
        if len(found) == world_size or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


# --- what the records say ------------------------------------------------------------------------------------
def split_step(records: dict[int, dict], index: int) -> dict[int, dict[str, float]]:
    """Step `index` of every rank, its wall time split into CATEGORIES (seconds)."""
    steps = {rank: record["steps"][index] for rank, record in records.items()}
    ready = [step["ready_at"] for step in steps.values() if step["ready_at"] is not None]
    last_ready = max(ready) if ready else None
    split = {}
    for rank, step in steps.items():
        blocked = min(step["blocked_s"], step["wall_s"])
        wait = min(blocked, max(0.0, last_ready - step["ready_at"])) if last_ready and step["ready_at"] else 0.0
        data = min(step["data_wall_s"], step["wall_s"] - blocked)
        split[rank] = {"data wait": data, "compute": max(0.0, step["wall_s"] - blocked - data),
                       "communication": blocked - wait, "waiting for others": wait}  # fmt: skip
    return split


def median(values):
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


def summarize(records: dict[int, dict]) -> dict:
    """The run's figures, from its typical steps (all but the first WARMUP_STEPS), per rank and for the job."""
    count = min(len(record["steps"]) for record in records.values()) if records else 0
    typical = range(min(WARMUP_STEPS, max(0, count - 1)), count)
    per_rank = {}
    for rank, record in sorted(records.items()):
        steps = [record["steps"][i] for i in typical]
        splits = [split_step(records, i)[rank] for i in typical]
        wall, cpu = sum(s["wall_s"] for s in steps), sum(s["cpu_s"] for s in steps)
        rounds = [len(s["buckets"]) / max(1, len(set(s["buckets"]))) for s in steps]
        per_rank[rank] = {
            "steps": len(steps), "threads": max((s["threads"] for s in record["steps"]), default=None),
            "median_step_s": median(s["wall_s"] for s in steps), "median_step_cpu_s": median(s["cpu_s"] for s in steps),
            "median_step_work_s": median(s["cpu_s"] - s["data_cpu_s"] for s in steps),
            "data_cpu_share": sum(s["data_cpu_s"] for s in steps) / cpu if cpu else None,
            "shares": {c: sum(x[c] for x in splits) / wall if wall else None for c in CATEGORIES},
            "allreduce_calls_per_step": median(s["allreduce_calls"] for s in steps),
            "allreduce_mb_per_step": median(s["allreduce_bytes"] for s in steps) / 1e6 if steps else None,
            "buckets_per_round": median(len(set(s["buckets"])) for s in steps),
            "rounds_per_step": median(rounds),
            "samples_per_step": median(s["samples"] for s in steps),
            "find_unused_parameters": any(s.get("find_unused_parameters") for s in steps),
            "unused_parameter_bytes": max((s.get("unused_parameter_bytes", 0) for s in steps), default=0),
            # Every step counts here, warm-up included: one step of tiny batches is already too many.
            "batch_norm_min_batch": min((s["batch_norm_min_batch"] for s in record["steps"] if s.get("batch_norm_min_batch")), default=None),
        }  # fmt: skip
    job = {}
    if per_rank:
        # Work per step besides producing the batch: what one rank doing more than the others shows in.
        cpu_per_step = [r["median_step_work_s"] for r in per_rank.values() if r["median_step_work_s"]]
        fastest = min(per_rank, key=lambda r: per_rank[r]["median_step_work_s"] or 0)
        step_s = max(r["median_step_s"] or 0 for r in per_rank.values())
        samples = sum(r["samples_per_step"] or 0 for r in per_rank.values())
        job = {"ranks": len(per_rank), "steps": count, "median_step_s": step_s,
               "samples_per_s": samples / step_s if step_s else None,
               "cpu_imbalance": max(cpu_per_step) / min(cpu_per_step) if cpu_per_step and min(cpu_per_step) > 0 else None,
               "fastest_rank": fastest, "idle_share_of_fastest": per_rank[fastest]["shares"]["waiting for others"]}  # fmt: skip
    return {"job": job, "ranks": per_rank}


def format_summary(summary: dict) -> str:
    """A table: one line per rank, then the job's line."""
    lines = [f"{'rank':>4} {'threads':>7} {'step ms':>8} {'cpu ms':>7} {'data%cpu':>8} " + " ".join(f"{c[:12]:>12}" for c in CATEGORIES)
             + f" {'allreduces':>10} {'MB/step':>8} {'buckets':>7}"]  # fmt: skip
    for rank, r in summary["ranks"].items():
        shares = " ".join(f"{(r['shares'][c] or 0):>12.0%}" for c in CATEGORIES)
        lines.append(f"{rank:>4} {r['threads']:>7} {1e3 * (r['median_step_s'] or 0):>8.1f} {1e3 * (r['median_step_cpu_s'] or 0):>7.1f} "
                     f"{(r['data_cpu_share'] or 0):>8.0%} {shares} {r['allreduce_calls_per_step']:>10} "
                     f"{r['allreduce_mb_per_step']:>8.2f} {r['buckets_per_round']:>7}")  # fmt: skip
    job = summary["job"]
    if job:
        lines.append(f"job: {job['steps']} steps, {job['samples_per_s']:.0f} samples/s (median step), CPU per step: busiest rank / "
                     f"least busy {job['cpu_imbalance']:.2f}, rank {job['fastest_rank']} waited for others "
                     f"{job['idle_share_of_fastest']:.0%} of its time")  # fmt: skip
    return "\n".join(lines)


def draw(ax, records: dict[int, dict], steps=range(2, 6), title: str | None = None) -> None:
    """A few steps of every rank as horizontal bars, one colour per category, on a shared clock (ms)."""
    first = min(records[rank]["steps"][steps[0]]["start"] for rank in records)
    for rank in sorted(records):
        for index in steps:
            if index >= len(records[rank]["steps"]):
                break
            at = (records[rank]["steps"][index]["start"] - first) * 1e3
            for category, seconds in split_step(records, index)[rank].items():
                ax.barh(rank, seconds * 1e3, left=at, color=COLOURS[category], edgecolor="white", linewidth=0.3,
                        label=category if rank == min(records) and index == steps[0] else None)  # fmt: skip
                at += seconds * 1e3
    ax.set_yticks(sorted(records), [f"rank {rank}" for rank in sorted(records)])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(CATEGORIES), fontsize="small")
    if title:
        ax.set_title(title)


def main(argv: list[str]) -> int:
    from ddp_course.cli import CourseArgumentParser

    parser = CourseArgumentParser(prog="python -m ddp_course.timeline", description="Run a DDP script and record its per-rank timeline.")
    parser.add_argument("--out", default="runs/timeline", help="folder for timeline-r{rank}.json (default runs/timeline)")
    parser.add_argument("--runs", help="a JSON list of runs to make one after another (what lab 10's checker uses)")
    parser.add_argument("script", nargs="?", help="the training script")
    parser.add_argument("args", nargs="...", help="its arguments")
    options = parser.parse_args(argv)
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    install()
    if options.runs:
        status = run_all(options.runs, rank)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)  # after a failed run a peer may be blocked in a collective; torchrun must see the status
    if not options.script or not Path(options.script).is_file():
        parser.error(f"no script {options.script!r}: give the training script to run, e.g. labs/lab10_slow_ddp.py")
    status = run_script(options.script, options.args, options.out, rank)
    if rank == 0 and status == 0:
        records = read_run(options.out, world_size, wait_s=WAIT_FOR_FILES_S)
        if len(records) == world_size and all(record["steps"] for record in records.values()):
            print(format_summary(summarize(records)), flush=True)
        else:
            print(f"timeline: not every rank recorded an optimizer step (records in {options.out})", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
