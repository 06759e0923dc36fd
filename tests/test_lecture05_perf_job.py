"""Lectures 5a and 5b's 2-rank job (lectures/scripts/perf_ddp_job.py) and the reference-run reader.

One launch with every part at tiny sizes (module fixture, a few tens of seconds on 2 CPU ranks); each
test checks one claim the lecture prints from it: the bytes each communication hook sends, mixed
precision leaving them unchanged, no_sync accumulation sending one k-th with the same gradients, ZeRO-1
splitting Adam's state without changing the weights, one trace per rank whose all-reduces match DDP's
buckets, lab 5's measurement for each bucket cap, and GradScaler skipping an overflow on every rank (on
one rank only under no_sync). The launch runs under the collectives recorder, which checks every
collective's devices (tests/test_device_discipline.py leaves the job's gpu_smoke row to it). Bad flags
give one line and a non-zero exit, parsed in this process: the script's parser is
ddp_course.cli.CourseArgumentParser, whose path through torchrun (rank 0 speaks, the others stay quiet)
tests/test_lab3_ddp.py launches for real and tests/test_helpers.py checks, so a launch of its own here
would only repeat it (issue 22). The step timer synchronizes CUDA before reading the clock.
"""

import json

import pytest
import torch

from ddp_course.launch import REPO_ROOT, import_script, run_torchrun

JOB = REPO_ROOT / "lectures" / "scripts" / "perf_ddp_job.py"
RECORDER = import_script(REPO_ROOT / "tests" / "scripts" / "record_collectives.py", "record_collectives")
SMOKE = import_script(REPO_ROOT / "benchmarks" / "gpu_smoke.py", "gpu_smoke")
TINY = ["--hook-steps", "11", "--profile-steps", "2", "--bucket-caps", "default,25", "--timing-steps", "1",
        "--timing-repeats", "1", "--accumulation-steps", "3"]  # fmt: skip


@pytest.fixture(scope="module")
def recorded_job(tmp_path_factory):
    """(RunResult, out folder) of the job, under the collectives recorder: tests/test_device_discipline.py
    leaves gpu_smoke's lecture5_perf_job row (these flags with --accumulation-steps 2) to this run."""
    out_dir = tmp_path_factory.mktemp("perf_job")
    result = run_torchrun(RECORDER.__file__, [JOB, "--out-dir", out_dir, *TINY], nproc=2, timeout_s=420)
    assert result.ok, result.describe()
    return result, out_dir


@pytest.fixture(scope="module")
def job(recorded_job):
    _, out_dir = recorded_job
    return out_dir, json.loads((out_dir / "perf.json").read_text())


@pytest.mark.timeout(480)
def test_every_collective_gets_tensors_on_one_device_and_the_smoke_row_passes(recorded_job):
    """The device rule of tests/test_device_discipline.py (its docstring), and gpu_smoke's key figure of the row."""
    result, out_dir = recorded_job
    assert RECORDER.device_rule_failures(result.stdout, nproc=2) == [], result.describe()
    row = next(row for row in SMOKE.LAB_RUNS if row.name == "lecture5_perf_job")
    assert [arg for arg in row.args if arg != "{out}"] == ["--out-dir", *TINY[:-1], "2"]  # the same command, 2 micro-batches
    outcome = SMOKE.judge(row, result, out_dir)
    assert outcome.passed, outcome


@pytest.mark.timeout(480)
def test_hooks_send_what_the_lecture_says(job):
    _, perf = job
    hooks = perf["hooks"]
    plain = hooks["allreduce"]
    assert plain["bytes_per_step"] == plain["gradient_bytes"] > 0  # one fp32 bucket, all of it
    for name in ("fp16", "bf16"):
        assert hooks[name]["bytes_per_step"] * 2 == plain["bytes_per_step"], name
    assert 0 < hooks["powerSGD"]["bytes_per_step"] < plain["bytes_per_step"] / 20
    assert hooks["powerSGD"]["all_reduce_calls_per_step"] == 3  # uncompressed tensors, then P, then Q
    assert hooks["batched_powerSGD"] == {"failed": "AssertionError"}
    for name in ("allreduce", "bf16_autocast", "fp16", "bf16", "powerSGD"):
        losses = hooks[name]["losses"]
        assert len(losses) == 11 and losses[-1] < losses[0], name


@pytest.mark.timeout(480)
def test_autocast_leaves_the_all_reduced_bytes_and_gradients_in_fp32(job):
    _, perf = job
    autocast, plain = perf["hooks"]["bf16_autocast"], perf["hooks"]["allreduce"]
    assert autocast["bytes_per_step"] == plain["bytes_per_step"]
    assert autocast["gradient_dtypes"] == ["torch.float32"] and autocast["loss_dtype"] == "torch.float32"


@pytest.mark.timeout(480)
def test_no_sync_accumulation_sends_one_kth_with_the_same_gradients(job):
    _, perf = job
    accumulation = perf["accumulation"]
    k, buckets = accumulation["micro_batches"], accumulation["buckets"]
    assert k == 3 and buckets >= 2
    assert accumulation["no_sync"] == {"all_reduce_calls": buckets, "bytes": accumulation["every_micro_batch"]["bytes"] // k}
    assert accumulation["every_micro_batch"]["all_reduce_calls"] == k * buckets
    assert accumulation["max_relative_gradient_difference"] < 1e-5


@pytest.mark.timeout(480)
def test_zero1_splits_adam_state_and_keeps_the_weights(job):
    _, perf = job
    zero = perf["zero"]
    adam, sharded = zero["state_bytes_per_rank"]["adam"], zero["state_bytes_per_rank"]["zero1"]
    moments = 8 * zero["parameters"]
    assert all(moments <= b <= moments + 1024 for b in adam)  # two fp32 moments, plus small step counters
    assert moments <= sum(sharded) <= moments + 1024 and max(sharded) < max(adam)
    assert zero["max_abs_weight_difference"] < 1e-6


@pytest.mark.timeout(480)
def test_profile_writes_one_trace_per_rank_with_one_all_reduce_per_bucket(job):
    from ddp_course import profiling

    out_dir, perf = job
    traces = profiling.read_traces(out_dir / "traces")
    assert sorted(traces) == [0, 1]
    buckets = len(perf["profile"]["bucket_sizes_mib"])
    for row in profiling.overlap_summary(traces):
        assert row["all_reduces"] == buckets and row["started_before_backward_end"] == buckets


@pytest.mark.timeout(480)
def test_buckets_part_is_lab5s_measurement_per_cap(job):
    _, perf = job
    records = perf["buckets"]
    assert [r["bucket_cap_mb"] for r in records] == ["default", 25.0]
    assert records[0]["bucket_sizes_mib"] != records[1]["bucket_sizes_mib"]  # the 1 MiB first bucket is the difference
    assert all(r["world_size"] == 2 and r["step_time_s"] > 0 for r in records)


@pytest.mark.timeout(480)
def test_gradscaler_skips_an_overflow_on_every_rank_only_through_the_all_reduce(job):
    _, perf = job
    scaled = perf["gradscaler"]
    half = scaled["init_scale"] / 2
    ddp, no_sync = scaled["ddp"], scaled["no_sync"]
    for steps in ddp + no_sync:  # step 1 is finite everywhere and steps
        assert steps[0]["stepped"] and steps[0]["gradients_finite"] and steps[0]["scale"] == scaled["init_scale"]
    # With DDP: rank 0's own loss is finite, yet the all-reduce gives it rank 1's inf: both skip, both halve.
    assert ddp[0][1]["loss_finite"] and not ddp[1][1]["loss_finite"]
    assert [(s[1]["gradients_finite"], s[1]["stepped"], s[1]["scale"]) for s in ddp] == [(False, False, half)] * 2
    assert ddp[0][1]["weights"] == ddp[1][1]["weights"] == ddp[0][0]["weights"]  # unchanged by step 2, equal on both
    # Without the all-reduce only rank 1 sees the overflow: the replicas part ways.
    assert [(s[1]["stepped"], s[1]["scale"]) for s in no_sync] == [(True, scaled["init_scale"]), (False, half)]
    assert no_sync[0][1]["weights"] != no_sync[1][1]["weights"]


@pytest.mark.timeout(60)
def test_the_step_clock_synchronizes_cuda_first(monkeypatch):
    from types import SimpleNamespace

    job_module = import_script(JOB)
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    job_module.clock(SimpleNamespace(device=torch.device("cpu")))
    assert calls == []  # nothing to wait for on the CPU
    job_module.clock(SimpleNamespace(device=torch.device("cuda", 1)))
    assert calls == [torch.device("cuda", 1)]


@pytest.mark.timeout(480)
def test_reference_script_reads_the_traces(job):
    out_dir, _ = job
    reference = import_script(REPO_ROOT / "benchmarks" / "lecture5_reference.py")
    rows = reference.profiled_steps(out_dir / "traces")
    assert len(rows) == 4  # 2 ranks x 2 profiled steps
    for row in rows:
        assert set(row["phase_ms"]) == {"forward", "backward", "optimizer"}
        assert 0 <= row["backward_after_last_gradient_ms"] <= row["phase_ms"]["backward"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "args, message",
    [
        (["--out-dir", "x", "--parts", "profile,nonsense"], "--parts: unknown nonsense"),
        (["--out-dir", "x", "--hooks", "zip"], "--hooks: unknown zip"),
        (["--out-dir", "x", "--hook-steps", "5"], "--hook-steps must exceed 10"),
        (["--parts", "hooks"], "the following arguments are required: --out-dir"),
        (["--out-dir", "x", "--bucket-caps", "0"], "--bucket-caps"),
    ],
)
def test_bad_flags_give_one_line(refused_flag_line, args, message):
    job_module = import_script(JOB)
    assert message in refused_flag_line(job_module, args)


@pytest.mark.timeout(60)
def test_all_reduce_counter_counts_and_restores():
    import torch.distributed as dist

    job_module = import_script(JOB)
    original = dist.all_reduce
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with job_module.AllReduceCounter() as counter:
            dist.all_reduce(torch.ones(10))  # not counting yet
            with counter.counting():
                dist.all_reduce(torch.ones(10))
                dist.all_reduce(torch.ones(3, dtype=torch.float16))
        assert (counter.calls, counter.bytes) == (2, 10 * 4 + 3 * 2)
        assert dist.all_reduce is original
    finally:
        dist.destroy_process_group()
