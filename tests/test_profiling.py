"""ddp_course.profiling on hand-made traces with known answers, and on one process's real trace.

The hand-made traces are a few events each, in the chrome-trace format torch.profiler writes, with
every time chosen so that the right summary is known; a wrong summary fails on exact values. Real
2-rank gloo traces are read where a job already writes them, so no launch is made here for them:
tests/test_lecture04_demos.py (torch DDP overlaps, a blocking hook does not) and
tests/test_lab6_ddp_from_scratch.py (all-reduces issued after backward() start after it).
"""

import json

import matplotlib
import pytest

from ddp_course import profiling

matplotlib.use("Agg")

ACCUMULATE = "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad"
ADDMM = "autograd::engine::evaluate_function: AddmmBackward0"


def event(name, start, end, cat="cpu_op", tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": start, "dur": end - start, "pid": 1, "tid": tid, "args": args}


def cpu_step(step, t0, overlapping):
    """One step of two buckets: backward 100..800 us after t0; the second all-reduce is launched after the
    last gradient computation. overlapping=False: each all-reduce ends before the next computation starts."""
    second_addmm = (320, 500) if overlapping else (610, 790)
    first_gloo = (306, 600)
    launch_2 = second_addmm[1] + 5
    return [
        event(f"step {step}", t0, t0 + 1000, cat="user_annotation"),
        event("phase:forward", t0, t0 + 100, cat="user_annotation"),
        event("phase:backward", t0 + 100, t0 + 800 + (0 if overlapping else 150), cat="user_annotation"),
        event(ADDMM, t0 + 110, t0 + 300),
        event(ACCUMULATE, t0 + 300, t0 + (320 if overlapping else 605)),  # holds the launch (and a blocking wait)
        event("c10d::allreduce_", t0 + 305, t0 + 310),
        event("gloo:all_reduce", t0 + first_gloo[0], t0 + first_gloo[1], cat="user_annotation", tid=2),
        event(ADDMM, t0 + second_addmm[0], t0 + second_addmm[1]),
        event(ACCUMULATE, t0 + second_addmm[1], t0 + launch_2 + 10),
        event("c10d::allreduce_", t0 + launch_2, t0 + launch_2 + 5),
        event("gloo:all_reduce", t0 + launch_2 + 1, t0 + launch_2 + 100, cat="user_annotation", tid=3),
        event("c10d::broadcast_", t0 + 20, t0 + 25),  # another collective: filtered out
        event("gloo:broadcast", t0 + 21, t0 + 40, cat="user_annotation", tid=2),
        event("phase:optimizer", t0 + 960, t0 + 990, cat="user_annotation"),
    ]


def after_backward_step(step, t0):
    """All-reduces issued after backward() returned, as a naive DDP does."""
    return [
        event(f"step {step}", t0, t0 + 1000, cat="user_annotation"),
        event("phase:backward", t0 + 100, t0 + 400, cat="user_annotation"),
        event(ADDMM, t0 + 110, t0 + 300),
        event("c10d::allreduce_", t0 + 410, t0 + 415),
        event("gloo:all_reduce", t0 + 411, t0 + 600, cat="user_annotation", tid=2),
    ]


def gpu_step(t0):
    """A CUDA step: kernels run later than their launches; kernels are placed by their correlation id."""
    launch = lambda t, corr: event("cudaLaunchKernel", t0 + t, t0 + t + 3, cat="cuda_runtime", correlation=corr)  # noqa: E731
    kernel = lambda name, s, e, corr, stream: event(name, t0 + s, t0 + e, cat="kernel", tid=stream, correlation=corr, stream=stream)  # noqa: E731
    return [
        event("step 0", t0, t0 + 1000, cat="user_annotation"),
        event("step 0", t0 + 500, t0 + 900, cat="gpu_user_annotation"),  # the GPU's copy of the range: not a step
        event("phase:backward", t0 + 100, t0 + 400, cat="user_annotation"),
        launch(150, 1), kernel("volta_sgemm_128x64_nt", 500, 700, 1, 7),
        event("c10d::allreduce_", t0 + 195, t0 + 215),
        event("nccl:all_reduce", t0 + 198, t0 + 212, cat="user_annotation"),
        launch(200, 2), kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 710, 900, 2, 20),
        launch(250, 3), kernel("volta_sgemm_64x64_tn", 705, 850, 3, 7),
    ]  # fmt: skip


def write_trace(path, events):
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return path


@pytest.mark.parametrize(
    ("name", "collective"),
    [("c10d::allreduce_", "all_reduce"), ("gloo:all_reduce", "all_reduce"), ("nccl:all_reduce", "all_reduce"),
     ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", "all_reduce"), ("ncclKernel_AllGather_RING_LL_Sum_float(x)", "all_gather"),
     ("c10d::broadcast_", "broadcast"), ("c10d::allreduce_coalesced_", "all_reduce"), ("aten::mm", None),
     ("autograd::engine::evaluate_function: AddmmBackward0", None)],
)  # fmt: skip
def test_collective_names(name, collective):
    assert profiling.collective_of(name) == collective


def test_hand_made_cpu_trace_summary(tmp_path):
    write_trace(tmp_path / "trace_rank0.json", cpu_step(0, 0, overlapping=True) + cpu_step(1, 1000, overlapping=False))
    write_trace(tmp_path / "trace_rank1.json", after_backward_step(0, 5000))
    traces = profiling.read_traces(tmp_path)
    assert sorted(traces) == [0, 1]
    step0 = traces[0][0]
    assert [s.start_us for s in step0.launches] == [305, 505]
    assert [(s.start_us, s.end_us) for s in step0.communication] == [(306, 600), (506, 605)]
    assert step0.gradient_compute_end_us == 500  # AccumulateGrad is not gradient computation
    assert set(step0.phases) == {"forward", "backward", "optimizer"}
    assert profiling.overlapped_compute_fraction(step0) == 1.0
    assert profiling.overlapped_compute_fraction(traces[0][1]) == 0.0
    assert profiling.overlap_summary(traces) == [
        {"rank": 0, "step": 0, "all_reduces": 2, "launched_before_compute_end": 1, "started_before_backward_end": 2, "overlapped": True},
        {"rank": 0, "step": 1, "all_reduces": 2, "launched_before_compute_end": 1, "started_before_backward_end": 2, "overlapped": False},
        {"rank": 1, "step": 0, "all_reduces": 1, "launched_before_compute_end": 0, "started_before_backward_end": 0, "overlapped": False},
    ]  # fmt: skip
    # every collective when asked
    assert len(profiling.read_trace(tmp_path / "trace_rank0.json", collective=None)[0].communication) == 3


def test_hand_made_gpu_trace_places_kernels_by_their_launch(tmp_path):
    path = write_trace(tmp_path / "trace_rank3.json", gpu_step(0))
    (step,) = profiling.read_trace(path)
    assert step.rank == 3
    assert [s.lane for s in step.communication] == ["stream 20"]
    assert [s.name[:11] for s in step.gradient_compute] == ["volta_sgemm", "volta_sgemm"]
    assert [s.start_us for s in step.launches] == [195]
    # After the all-reduce started at 710, the gradient kernel 705..850 computes 140 us, all of it in flight.
    assert profiling.overlapped_compute_fraction(step) == 1.0
    assert profiling.overlap_summary({3: [step]}) == [
        {"rank": 3, "step": 0, "all_reduces": 1, "launched_before_compute_end": 1, "started_before_backward_end": 1, "overlapped": True}
    ]  # fmt: skip


def test_kernels_launched_through_the_driver_api_are_placed_by_their_launch(tmp_path):
    """Review finding 15: a kernel launched with cuLaunchKernelEx (cat "cuda_driver") belongs to backward
    by its launch at 250 us, although it runs at 705-850 us, after backward ended on the host at 400 us."""
    events = gpu_step(0)
    for e in events:
        if e.get("cat") == "cuda_runtime" and e["args"]["correlation"] == 3:
            e.update(name="cuLaunchKernelEx", cat="cuda_driver")
    (step,) = profiling.read_trace(write_trace(tmp_path / "trace_rank0.json", events))
    assert [(s.start_us, s.end_us) for s in step.gradient_compute] == [(500, 700), (705, 850)]
    assert profiling.overlapped_compute_fraction(step) == 1.0


def test_timeline_draws_every_rank(tmp_path):
    import matplotlib.pyplot as plt

    write_trace(tmp_path / "trace_rank0.json", cpu_step(0, 0, overlapping=True))
    write_trace(tmp_path / "trace_rank1.json", cpu_step(0, 10, overlapping=False))
    fig, ax = plt.subplots()
    profiling.draw_timeline(ax, profiling.read_traces(tmp_path), title="two ranks")
    labels = [label.get_text() for label in ax.get_yticklabels()]
    assert labels == ["rank 1 all-reduce", "rank 1 grad compute", "rank 1 phases",
                      "rank 0 all-reduce", "rank 0 grad compute", "rank 0 phases"]  # fmt: skip
    assert len(ax.collections) == 2 * (2 + 3)  # per rank: all-reduces, computation, three phases
    plt.close(fig)


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown phase"):
        with profiling.phase("backwards"):
            pass
    with pytest.raises(ValueError, match="steps >= 1"):
        profiling.profile_steps(lambda step: None, steps=0, out_dir=tmp_path)
    with pytest.raises(FileNotFoundError):
        profiling.read_traces(tmp_path)


def test_profile_steps_in_one_process_writes_a_readable_trace(tmp_path):
    import torch

    model = torch.nn.Linear(8, 8)
    calls = []

    def step(i):
        calls.append(i)
        with profiling.phase("backward"):
            model(torch.ones(2, 8)).sum().backward()

    path = profiling.profile_steps(step, steps=2, out_dir=tmp_path, rank=5, warmup_steps=1)
    assert path == tmp_path / "trace_rank5.json" and calls == [0, 1, 2]
    timelines = profiling.read_trace(path)
    assert [t.step for t in timelines] == [0, 1] and all(t.gradient_compute for t in timelines)
    assert all("backward" in t.phases and not t.communication for t in timelines)


def test_operator_table_subtracts_each_childs_time_from_its_parent_only(tmp_path):
    def op(name, ts, dur, tid=1):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}

    events = [op("parent", 0, 100), op("child", 10, 30), op("child", 50, 10), op("parent", 200, 5), op("other", 0, 7, tid=2),
              {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "ts": 0, "dur": 999, "tid": 3}]  # fmt: skip
    path = tmp_path / "trace_rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    # parent: 100 + 5 us, minus its two children's 40; an annotation is not an operator
    assert profiling.operator_table(path) == {"parent": (2, 65.0), "child": (2, 40.0), "other": (1, 7.0)}
