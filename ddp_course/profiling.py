"""Profile a few DDP training steps, read the trace back, and see whether communication overlapped backward.

In a torchrun script (every rank calls it; each writes its own trace):

    from ddp_course import profiling

    def train_step(step):
        with profiling.phase("forward"):
            loss = loss_fn(ddp_model(inputs), targets)
        with profiling.phase("backward"):
            loss.backward()
        with profiling.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()

    profiling.profile_steps(train_step, steps=3, out_dir="traces", rank=ctx.rank, device=ctx.device)

Then, in any process: `timelines = profiling.read_traces("traces")`, `profiling.overlap_summary(timelines)`
and `profiling.draw_timeline(ax, timelines)`.

Open a trace by eye: go to https://ui.perfetto.dev and drag `trace_rank0.json` into the page (or open
chrome://tracing in Chrome and load it). Each thread is a row: the main thread shows the phases and the
autograd ops of backward, the gloo worker threads (`pt_gloo_runloop`) show the all-reduces; on a GPU
the CUDA streams show the compute and NCCL kernels. Use W/S to zoom and A/D to pan.

What torch 2.14 records for a collective (read from real gloo traces on this machine; the NCCL names
from ProcessGroupNCCL's profiling titles and NCCL's kernel names, not yet seen in a trace here):

| backend | host side: the call that enqueues it          | the work itself                                     |
|---------|-----------------------------------------------|-----------------------------------------------------|
| gloo    | `c10d::allreduce_` (cpu_op, calling thread)   | `gloo:all_reduce` (user_annotation, on a `pt_gloo_runloop` thread; it lasts until every rank has joined) |
| nccl    | `c10d::allreduce_`, inside it `nccl:all_reduce` and `record_param_comms` | kernels `ncclDevKernel_AllReduce_Sum_f32_RING_LL(...)` (older NCCL: `ncclKernel_AllReduce_...`) on the NCCL stream |

`record_param_comms` is not recorded for gloo in torch 2.14. Other collectives follow the same pattern
(`c10d::broadcast_` / `gloo:broadcast`, ...). Timestamps in the trace are microseconds.

What overlap means. Overlap is concurrency: an all-reduce running WHILE backward still computes
gradients. Only start and end times show it. A ratio built from summed op durations (total
communication time against total backward time, a heuristic found in some guides) cannot: the same
sums come out whether the two ran side by side or one after the other. overlap_summary() therefore
compares intervals. How much communication a step really leaves exposed is measured best by timing:
the step time with and without synchronisation (`no_sync`), as lab 5 does.

On a GPU (written, not run on a GPU yet): kernels are attributed to the step and phase of the host
call that launched them (the trace's `correlation` ids; runtime-API and driver-API launches alike),
gradient computation is every non-NCCL kernel launched during backward, and communication is the
NCCL kernels.
"""

from __future__ import annotations

import json
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

PHASES = ("forward", "backward", "optimizer")
_PHASE_PREFIX = "phase:"
_STEP_PREFIX = "step "
_LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")  # trace categories of host-side kernel launches
# The autograd engine runs one of these per node of the backward graph (CPU tensors: on the thread that
# called backward()). AccumulateGrad only adds a finished gradient into .grad - and runs the hooks DDP
# uses to launch bucket all-reduces - so it is not gradient computation.
_AUTOGRAD_NODE = "autograd::engine::evaluate_function: "
_ACCUMULATE_GRAD = "torch::autograd::AccumulateGrad"
# A hand-written communication hook that blocks still sits inside AccumulateGrad: its waiting time is
# never counted as computation.
_NCCL_KERNEL = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")
# gloo's worker threads close their record of a collective in a callback that can run after the waiting
# rank has already moved on; a short pause before the profiler stops lets the last ones close.
_SETTLE_S = 0.05


def trace_file(out_dir: str | Path, rank: int) -> Path:
    """Where rank's chrome trace goes: OUT_DIR/trace_rank{rank}.json."""
    return Path(out_dir) / f"trace_rank{rank}.json"


@contextmanager
def phase(name: str):
    """Mark a phase of a training step (forward, backward, optimizer) in the trace."""
    if name not in PHASES:
        raise ValueError(f"unknown phase {name!r}; choose one of {', '.join(PHASES)}")
    from torch.profiler import record_function

    with record_function(_PHASE_PREFIX + name):
        yield


def profile_steps(
    step_fn: Callable[[int], object],
    steps: int,
    out_dir: str | Path,
    rank: int = 0,
    warmup_steps: int = 2,
    device=None,
) -> Path:
    """Run step_fn(0..warmup_steps-1) untraced, then step_fn(i) for `steps` steps under torch.profiler.

    Each traced step is recorded as "step i" (i counts from 0 after the warm-up). Two warm-up steps by
    default: DDP rebuilds its buckets at the second forward pass, so later steps are the steady state.
    Traces CPU activity, plus CUDA kernels when device is a CUDA device. Writes trace_file(out_dir, rank)
    and returns its path.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    if steps < 1 or warmup_steps < 0:
        raise ValueError(f"need steps >= 1 and warmup_steps >= 0, got {steps} and {warmup_steps}")
    on_gpu = device is not None and torch.device(device).type == "cuda"
    for step in range(warmup_steps):
        step_fn(step)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as profiler:
        for step in range(steps):
            with record_function(f"{_STEP_PREFIX}{step}"):
                step_fn(warmup_steps + step)
                if on_gpu:
                    torch.cuda.synchronize(device)  # this step's kernels finish inside its span
        time.sleep(_SETTLE_S)
    path = trace_file(out_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(path))
    return path


# ---- reading a trace ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """One event of the trace: name, start and end in microseconds, and where it ran."""

    name: str
    start_us: float
    end_us: float
    lane: str  # "thread 1234" or "stream 7"

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


@dataclass
class StepTimeline:
    """What one rank did in one traced step."""

    rank: int
    step: int
    span: Span
    phases: dict[str, Span] = field(default_factory=dict)  # forward / backward / optimizer, those marked
    launches: list[Span] = field(default_factory=list)  # host calls that enqueue a collective
    communication: list[Span] = field(default_factory=list)  # the collectives' work (gloo thread / NCCL kernel)
    gradient_compute: list[Span] = field(default_factory=list)  # backward ops (CPU) or kernels (GPU)

    @property
    def gradient_compute_end_us(self) -> float | None:
        """When the last gradient computation of the step finished (None without any)."""
        return max((s.end_us for s in self.gradient_compute), default=None)


def collective_of(name: str) -> str | None:
    """The collective an event belongs to ("all_reduce", "broadcast", ...) or None for other events.

    c10d::allreduce_ / gloo:all_reduce / nccl:all_reduce / ncclDevKernel_AllReduce_... -> "all_reduce".
    """
    if name.startswith(("gloo:", "nccl:")):
        return name.split(":", 1)[1]
    if name.startswith("c10d::"):
        op = name[len("c10d::") :].rstrip("_")
        op = op.removesuffix("_coalesced")
        return {"allreduce": "all_reduce", "allgather": "all_gather", "reduce_scatter": "reduce_scatter"}.get(op, op)
    match = _NCCL_KERNEL.match(name)
    if match:
        return re.sub(r"(?<!^)(?=[A-Z])", "_", match.group(1)).lower()  # AllReduce -> all_reduce
    return None


def _is_work(event: dict) -> bool:
    """The collective's own execution, as opposed to the host call that enqueued it."""
    name = event["name"]
    return name.startswith("gloo:") or (event.get("cat") == "kernel" and name.startswith("nccl"))


def _is_launch(event: dict) -> bool:
    return event["name"].startswith("c10d::") and event.get("cat") == "cpu_op"


def _span(event: dict) -> Span:
    lane = f"stream {event['args']['stream']}" if "stream" in event.get("args", {}) else f"thread {event.get('tid')}"
    return Span(event["name"], float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0)), lane)


def _inside(span: Span, outer: Span) -> bool:
    return outer.start_us <= span.start_us <= outer.end_us


def read_trace(path: str | Path, rank: int | None = None, collective: str | None = "all_reduce") -> list[StepTimeline]:
    """One StepTimeline per traced step of a chrome trace written by profile_steps().

    collective filters the communication events ("all_reduce" by default; None keeps every collective).
    rank defaults to the number in the file name (trace_rank{rank}.json).
    """
    path = Path(path)
    if rank is None:
        found = re.search(r"rank(\d+)", path.stem)
        rank = int(found.group(1)) if found else 0
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    step_spans = sorted((_span(e) for e in events if e["name"].startswith(_STEP_PREFIX) and e.get("cat") == "user_annotation"),
                        key=lambda s: s.start_us)  # fmt: skip
    # GPU kernels run later than the host call that launched them: place each by its launch, made
    # through the runtime API (cudaLaunchKernel) or the driver API (cuLaunchKernel/cuLaunchKernelEx,
    # which recent NCCL and cuBLASLt use). Without its launch, a backward kernel that runs after
    # backward() returned on the host would fall outside the backward phase.
    launch_time = {e["args"]["correlation"]: float(e["ts"]) for e in events
                   if e.get("cat") in _LAUNCH_CATEGORIES and "correlation" in e.get("args", {})}  # fmt: skip

    def host_time(event: dict) -> float:
        correlation = event.get("args", {}).get("correlation")
        return launch_time.get(correlation, float(event["ts"])) if event.get("cat") == "kernel" else float(event["ts"])

    timelines = []
    for span in step_spans:
        timeline = StepTimeline(rank, int(span.name[len(_STEP_PREFIX) :]), span)
        in_step = [e for e in events if span.start_us <= host_time(e) < span.end_us]
        for e in in_step:
            if e["name"].startswith(_PHASE_PREFIX) and e.get("cat") != "gpu_user_annotation":
                timeline.phases[e["name"][len(_PHASE_PREFIX) :]] = _span(e)
        wanted = (lambda e: collective_of(e["name"]) == collective) if collective else (lambda e: collective_of(e["name"]))
        timeline.launches = sorted((_span(e) for e in in_step if _is_launch(e) and wanted(e)), key=lambda s: s.start_us)
        timeline.communication = sorted((_span(e) for e in in_step if _is_work(e) and wanted(e)), key=lambda s: s.start_us)
        backward = timeline.phases.get("backward", span)
        compute = []
        for e in in_step:
            on_cpu = e["name"].startswith(_AUTOGRAD_NODE) and not e["name"].endswith(_ACCUMULATE_GRAD)
            on_gpu = e.get("cat") == "kernel" and not e["name"].startswith("nccl")
            if (on_cpu or on_gpu) and backward.start_us <= host_time(e) <= backward.end_us:
                compute.append(_span(e))
        timeline.gradient_compute = sorted(compute, key=lambda s: s.start_us)
        timelines.append(timeline)
    return timelines


def read_traces(out_dir: str | Path, collective: str | None = "all_reduce") -> dict[int, list[StepTimeline]]:
    """{rank: its StepTimelines} for every trace_rank*.json in out_dir."""
    paths = sorted(Path(out_dir).glob("trace_rank*.json"))
    if not paths:
        raise FileNotFoundError(f"no trace_rank*.json in {out_dir}")
    traces = {}
    for path in paths:
        rank = int(re.search(r"rank(\d+)", path.stem).group(1))
        traces[rank] = read_trace(path, rank, collective)
    return dict(sorted(traces.items()))


# ---- overlap -------------------------------------------------------------------------------------


def operator_table(trace_path: str | Path) -> dict[str, tuple[int, float]]:
    """{operator name: (calls, self time in us)} from one chrome trace, like the profiler's `key_averages()`.

    An operator's self time is its duration minus its children's, where children are the operators
    that start and end inside it on the same thread (the trace stores no parent links).
    """
    events = [e for e in json.loads(Path(trace_path).read_text())["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    table: dict[str, tuple[int, float]] = {}
    for thread in {e["tid"] for e in events}:
        enclosing: list[tuple[float, str]] = []  # (end time, name) of the operators that contain the current one
        for e in sorted((e for e in events if e["tid"] == thread), key=lambda e: (e["ts"], -e["dur"])):
            while enclosing and enclosing[-1][0] <= e["ts"]:
                enclosing.pop()
            calls, self_us = table.get(e["name"], (0, 0.0))
            table[e["name"]] = (calls + 1, self_us + e["dur"])
            if enclosing:  # the parent did not do this child's work itself
                parent_calls, parent_self = table[enclosing[-1][1]]
                table[enclosing[-1][1]] = (parent_calls, parent_self - e["dur"])
            enclosing.append((e["ts"] + e["dur"], e["name"]))
    return table


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    return [(max(s1, s2), min(e1, e2)) for s1, e1 in a for s2, e2 in b if max(s1, s2) < min(e1, e2)]


# overlap_summary()'s yes/no threshold: well above the microseconds by which two threads' profiler
# timestamps can disagree, well below what the rank that arrives last overlaps (0.24 or more seen).
SOME_OVERLAP = 0.05


def overlapped_compute_fraction(timeline: StepTimeline) -> float | None:
    """Of the gradient computation done after the first all-reduce started, the fraction that ran while
    some all-reduce was in flight (0..1); None when no computation followed the first all-reduce."""
    if not timeline.communication:
        return None
    first_start = timeline.communication[0].start_us
    after = _intersection(_merged([(s.start_us, s.end_us) for s in timeline.gradient_compute]), [(first_start, float("inf"))])
    if _length(after) == 0:
        return None
    in_flight = _merged([(s.start_us, s.end_us) for s in timeline.communication])
    return _length(_intersection(after, in_flight)) / _length(after)


def overlap_summary(traces: dict[int, list[StepTimeline]]) -> list[dict]:
    """Per rank and step, counts and booleans that do not depend on timing noise (for a compared cell).

    - all_reduces: collectives that ran in the step (work events);
    - launched_before_compute_end: how many were launched (host call) before the last gradient
      computation finished. On the CPU that is program order on the calling thread, so deterministic;
      on a GPU the host runs ahead of the kernels and this counts every launch of backward;
    - started_before_backward_end: how many started to run before backward ended (on the CPU when
      backward() returned: DDP's backward waits for its all-reduces, so all of them; an all-reduce
      issued after backward(): none. On a GPU, when the last gradient kernel finished);
    - overlapped: True when some gradient computation (at least SOME_OVERLAP of it) after the first
      all-reduce started ran while an all-reduce was in flight. A blocking all-reduce makes that
      impossible (the thread that computes is the one waiting): 0 exactly. How much an asynchronous one
      overlaps depends on timing - the rank that arrives last finds its peer waiting, so its all-reduces
      finish fast (fractions of 0.24-1.0 seen in 17 2-rank CPU runs) - so only the yes/no is compared.
    """
    rows = []
    for rank, timelines in traces.items():
        for t in timelines:
            compute_end = t.gradient_compute_end_us
            # On a GPU backward() returns before its kernels finish: backward ends with the later of the two.
            backward_end = max(t.phases["backward"].end_us if "backward" in t.phases else t.span.end_us, compute_end or 0.0)
            fraction = overlapped_compute_fraction(t)
            rows.append({
                "rank": rank,
                "step": t.step,
                "all_reduces": len(t.communication),
                "launched_before_compute_end": sum(compute_end is not None and s.start_us < compute_end for s in t.launches),
                "started_before_backward_end": sum(s.start_us < backward_end for s in t.communication),
                "overlapped": fraction is not None and fraction >= SOME_OVERLAP,
            })  # fmt: skip
    return rows


def format_summary(rows: list[dict]) -> str:
    """overlap_summary() as text lines, one per rank and step."""
    return "\n".join(
        f"rank {r['rank']} step {r['step']}: {r['all_reduces']} all-reduces, "
        f"{r['launched_before_compute_end']} launched while gradients were still being computed, "
        f"{r['started_before_backward_end']} started before backward() returned; overlapped: {r['overlapped']}"
        for r in rows
    )


# ---- drawing -------------------------------------------------------------------------------------

PHASE_COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "optimizer": "tab:green"}
COMPUTE_COLOUR, COMM_COLOUR = "tab:brown", "tab:red"


def draw_timeline(ax, traces: dict[int, list[StepTimeline]], steps=None, title: str | None = None) -> None:
    """Draw, per rank, three rows: phases, gradient computation, all-reduces, in ms from the first step.

    steps: which traced steps to draw (default: all). All ranks of a one-machine job share one clock;
    across machines the clocks are only as close as the machines' time sync.
    """
    from matplotlib.patches import Patch

    chosen = {rank: [t for t in timelines if steps is None or t.step in steps] for rank, timelines in traces.items()}
    origin = min(t.span.start_us for timelines in chosen.values() for t in timelines)
    labels, y = [], 0

    def bars(spans, colour, height=0.8):
        ax.broken_barh([((s.start_us - origin) / 1e3, max(s.duration_us / 1e3, 0.01)) for s in spans],
                       (y - height / 2, height), facecolors=colour, edgecolors="none")  # fmt: skip

    for rank in sorted(chosen, reverse=True):  # rank 0 on top
        timelines = chosen[rank]
        bars([s for t in timelines for s in t.communication], COMM_COLOUR, 0.6)
        for launch in (s for t in timelines for s in t.launches):
            ax.plot([(launch.start_us - origin) / 1e3] * 2, [y - 0.4, y + 0.4], color="black", lw=0.8)
        labels.append(f"rank {rank} all-reduce")
        y += 1
        bars([s for t in timelines for s in t.gradient_compute], COMPUTE_COLOUR, 0.6)
        labels.append(f"rank {rank} grad compute")
        y += 1
        for name, colour in PHASE_COLOURS.items():
            bars([t.phases[name] for t in timelines if name in t.phases], colour)
        labels.append(f"rank {rank} phases")
        y += 1.5
    ax.set_yticks([row + 3.5 * k for k in range(len(chosen)) for row in range(3)])
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("time since the first step started (ms)")
    handles = [Patch(color=c, label=n) for n, c in PHASE_COLOURS.items()]
    handles += [Patch(color=COMPUTE_COLOUR, label="gradient computation"), Patch(color=COMM_COLOUR, label="all-reduce running"),
                Patch(facecolor="white", edgecolor="black", label="| all-reduce launched")]  # fmt: skip
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if title:
        ax.set_title(title, fontsize=9)
