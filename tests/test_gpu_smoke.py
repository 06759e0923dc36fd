"""benchmarks/gpu_smoke.py: its verdicts, lines and summary on recorded sample outputs, and its no-GPU exit."""

import json
import sys

import pytest

from ddp_course.launch import REPO_ROOT, RunResult, import_script, run_command

SMOKE_PATH = REPO_ROOT / "benchmarks" / "gpu_smoke.py"


def load_gpu_smoke():
    return import_script(SMOKE_PATH)


smoke = load_gpu_smoke()
LABS = {lab.name: lab for lab in smoke.LAB_RUNS}

# Samples written from the labs' real --json files (CPU runs, 2 ranks), trimmed to the fields read.
SAMPLES = {
    "lecture7_sharding": ("report.json", {
        "world_size": 2, "checkpoint": {"equal_on_4": True, "equal_on_1": True},
        "memory": {"ddp/2": [{"held": {"total": 1000}, "wire": 100}], "fsdp/2": [{"held": {"total": 500}, "wire": 150}]},
    }, "2 ranks: fully_shard holds 0.50x DDP's bytes, sends 1.50x; DCP 2 -> 2 ranks and -> 1 process equal"),
    "lab1": ("lab1.json", [
        {"algbw_gbps": 0.0105, "backend": "nccl", "busbw_gbps": 0.0105, "bytes": 4096, "time_s": 0.00039, "world_size": 2},
        {"algbw_gbps": 141.3, "backend": "nccl", "busbw_gbps": 141.3, "bytes": 4194304, "time_s": 2.97e-05, "world_size": 2},
        {"algbw_gbps": 0.154, "backend": "nccl", "busbw_gbps": 0.154, "bytes": 65536, "time_s": 0.00043, "world_size": 2},
    ], "busbw 141.30 GB/s at 4 MiB"),
    "lab2_sampler": ("lab2.json", {"backend": "nccl", "checks": {"coverage": True, "disjoint": True, "split": True}},
                     "3/3 sampler checks passed"),
    "lab2_join": ("join.json", {"eval_accuracy": 0.8050139546394348, "join": True, "same_weights_on_every_rank": True,
                                "steps_per_rank": [15, 30], "world_size": 2},
                  "steps per rank [15, 30], identical weights, accuracy 80.5%"),
    "lab3": ("lab3.json", {"backend": "nccl", "eval_accuracy": 0.9303621169916435, "steps": 12}, "held-out accuracy 93.0%"),
    "lab4_solution": ("lab4.json", {"backend": "nccl", "eval_accuracy": 0.09749303621169916}, "held-out accuracy 9.7%"),
    "lab5": ("lab5.json", {"backend": "nccl", "comm_fraction": 0.4784563600866918, "samples_per_s": 19.711300798215827},
             "20 samples/s, comm fraction 0.48"),
    "lab6": ("lab6.json", [{"impl": impl, "check_passed": True, "vs_torch_ddp": ratio}
                           for impl, ratio in (("naive", 3.378), ("overlap", 1.989), ("bucketed", 0.893), ("torch", 1.0))],
             "4/4 impls match one process; bucketed/torch step time 0.89"),
    "lab8": ("lab8.json", [{"impl": impl, "passed": True, "state_vs_ddp": ratio}
                           for impl, ratio in (("ddp", 1.0), ("fsdp", 0.5043), ("fully_shard", 0.5001))],
             "3/3 impls match one process; model state vs DDP: fsdp 0.50, fully_shard 0.50"),
    "lab9": ("lab9.json", {"world_size": 2, "device": "cuda", "memory": {"passed": True, "impls": {
        "ddp": {"counted_vs_predicted": 1.0, "measured_minus_predicted_in_w": 0.25},
        "fully_shard": {"counted_vs_predicted": 0.982, "measured_minus_predicted_in_w": 0.5}}}, "clip": {"passed": True}},
        "2 parts passed (memory, clip); counted peak / formula, torch.cuda peak - formula: ddp 1.00 / +0.25 W, fully_shard 0.98 / +0.50 W"),
    "lab10_solution": ("lab10.json", {"world_size": 2, "steps": 10, "eval_accuracy": 0.6211699164345403}, "held-out accuracy 62.1%"),
    "lab7": ("lab7.json", {"attempt": 0, "backend": "nccl", "eval_accuracy": 0.7827298050139275, "steps": 20}, "held-out accuracy 78.3%"),
    "lab7_hangs_join": ("hangs.json", {"scenario": "uneven-join", "status": 0, "line": (
        "finished: steps per rank [2, 3]; identical weights on every rank: True; "
        "equal to the Join rule computed in one process: True")},
        "finished: steps per rank [2, 3], identical weights equal to the Join rule"),
    "lab5_sweep": ("sweep.json", [
        {"config": "comm_bound", "world_size": 1, "samples_per_s": 26.1, "weak_scaling_efficiency": 1.0},
        {"config": "comm_bound", "world_size": 2, "samples_per_s": 21.4, "weak_scaling_efficiency": 0.41},
    ], "world sizes 1 and 2 measured, weak-scaling efficiency at 2: 0.41"),
    "lab7_restart": ("lab7.json", {"attempt": 1, "backend": "nccl", "eval_accuracy": 0.7827298050139275, "steps": 20,
                                   "resumed_from_step": 10, "recomputed_steps": 5},
                     "restarted once, resumed from step 10, 5 steps recomputed, held-out accuracy 78.3%"),
    "lecture4_demos": ("report.json", {"environment": [{"backend": "gloo", "RANK": "0"}, {"backend": "gloo", "RANK": "1"}],
                                       "subgroups": [{}, {}], "overlap_traces": [{"traced": True}, {"traced": True}]},
                       "3 demos on gloo, 2 ranks, traces written"),
    "lecture5_perf_job": ("perf.json", {"backend": "nccl", "world_size": 2, "profile": {}, "accumulation": {}, "zero": {},
                                        "gradscaler": {}, "buckets": [{"bucket_cap_mb": "default", "comm_fraction": 0.216}],
                                        "hooks": {"allreduce": {"bytes_per_step": 605224}, "fp16": {"bytes_per_step": 302612}}},
                          "6 parts on nccl, fp16 hook sends half the bytes, comm fraction 0.22"),
    "lecture6_faults": ("faults.json", {"per_rank": [
        {"replicas_identical": {"load_after_wrap_on_rank0": False, "load_before_wrap_everywhere": True},
         "unused_parameter": {"raised_at_iteration": 1}, "flight_recorder": {"kind": "timeout", "entries": 3}}] * 2},
        "2 ranks: load after wrap diverges, unused parameter raises at iteration 1, flight recorder dumped"),
}  # fmt: skip
# Files a key figure looks for beside the JSON (lecture 4's demos write a profiler trace per rank).
EXTRA_FILES = {"lecture4_demos": ["traces/builtin/trace_rank0.json", "traces/blocking/trace_rank0.json"], "lab9": ["snapshots/ddp_rank0.pickle"]}


def finished(returncode=0, stderr="", wall_s=12.5, timed_out=False):
    return RunResult(command=["torchrun"], returncode=returncode, stdout="", stderr=stderr, wall_s=wall_s, timed_out=timed_out)


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_a_lab_that_ran_passes_with_its_key_figure(tmp_path, name):
    file_name, content, figure = SAMPLES[name]
    (tmp_path / file_name).write_text(json.dumps(content))
    for extra in EXTRA_FILES.get(name, []):
        (tmp_path / extra).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / extra).write_text("{}")
    outcome = smoke.judge(LABS[name], finished(), tmp_path)
    assert outcome == smoke.Outcome.of(name, True, 12.5, figure)
    assert smoke.format_line(outcome) == f"PASS  {name:<18}   12.5 s  {figure}"


def test_every_lab_in_the_table_has_a_sample():
    cpu_labs = {lab.name for lab in smoke.LAB_RUNS if not lab.gpu_only}
    assert cpu_labs == set(SAMPLES)
    assert {lab.script for lab in smoke.LAB_RUNS} >= {
        "labs/lab1_collectives.py",
        "labs/lab2_sampler.py",
        "labs/lab2_join.py",
        "labs/lab3_ddp.py",
        "solutions/lab4_broken_ddp.py",
        "labs/lab5_scaling.py",
        "labs/lab6_ddp_from_scratch.py",
        "labs/lab7_fault_tolerance.py",
        "labs/lab7_hangs.py",
        "labs/lab8_fsdp.py",
        "lectures/scripts/ddp_internals_demos.py",
        "lectures/scripts/perf_ddp_job.py",
        "lectures/scripts/faults_demos.py",
        "lectures/scripts/sharding_demos.py",
    }


def test_lab1_on_one_gpu_reports_algbw_since_busbw_is_zero(tmp_path):
    """Seen on a one-GPU H200: busbw 0.00 GB/s, true (2(n-1)/n = 0) but no measurement; algbw is one."""
    records = [
        {"algbw_gbps": 0.13, "busbw_gbps": 0.0, "bytes": 4096, "world_size": 1},
        {"algbw_gbps": 52.41, "busbw_gbps": 0.0, "bytes": 4194304, "world_size": 1},
    ]
    (tmp_path / "lab1.json").write_text(json.dumps(records))
    outcome = smoke.judge(LABS["lab1"], finished(), tmp_path)
    assert outcome.passed and outcome.detail == "algbw 52.41 GB/s at 4 MiB (1 rank: no bus traffic, busbw 0)"


def test_the_pinned_torch_range_is_read_from_requirements():
    major_minor, spec = smoke.pinned_torch_range()
    assert spec.startswith(f">={major_minor}") and f"torch{spec}" in (REPO_ROOT / "requirements.txt").read_text().replace(" ", "")


def test_a_failed_check_fails_the_lab_even_with_exit_status_0(tmp_path):
    (tmp_path / "lab2.json").write_text(json.dumps({"checks": {"coverage": True, "disjoint": False}}))
    outcome = smoke.judge(LABS["lab2_sampler"], finished(), tmp_path)
    assert not outcome.passed and outcome.detail == "ran, but checks failed: disjoint"


def test_a_wrapper_that_fails_lab6s_check_fails_the_lab(tmp_path):
    records = [{"impl": "bucketed", "check_passed": False, "vs_torch_ddp": 0.9}, {"impl": "torch", "check_passed": True, "vs_torch_ddp": 1.0}]
    (tmp_path / "lab6.json").write_text(json.dumps(records))
    outcome = smoke.judge(LABS["lab6"], finished(), tmp_path)
    assert not outcome.passed and outcome.detail == "ran, but check failed for bucketed"


def test_an_fsdp_that_fails_lab8s_check_fails_the_lab(tmp_path):
    records = [
        {"impl": "ddp", "passed": True, "state_vs_ddp": 1.0},
        {"impl": "fsdp", "passed": False, "state_vs_ddp": 0.5},
        {"impl": "fully_shard", "passed": True, "state_vs_ddp": 0.5},
    ]  # fmt: skip  (passed: lab 8's whole verdict)
    (tmp_path / "lab8.json").write_text(json.dumps(records))
    outcome = smoke.judge(LABS["lab8"], finished(), tmp_path)
    assert not outcome.passed and outcome.detail == "ran, but check failed for fsdp"


def test_lab9_on_a_gpu_needs_its_memory_snapshots_and_quotes_counted_and_measured_peaks(tmp_path):
    """A CUDA run without snapshots fails; any run quotes each implementation's counted peak over the formula
    and its allocator-measured peak less the formula (torch.cuda's on a GPU)."""
    impls = {
        "ddp": {"counted_vs_predicted": 1.0, "measured_minus_predicted_in_w": 0.22},
        "zero2": {"counted_vs_predicted": 0.979, "measured_minus_predicted_in_w": 0.19},
    }
    report = {"world_size": 2, "device": "cuda", "memory": {"passed": True, "impls": impls}}
    (tmp_path / "lab9.json").write_text(json.dumps(report))
    outcome = smoke.judge(LABS["lab9"], finished(), tmp_path)
    assert not outcome.passed and outcome.detail == "ran, but no memory snapshot in snapshots/"
    (tmp_path / "lab9.json").write_text(json.dumps(report | {"device": "cpu"}))
    outcome = smoke.judge(LABS["lab9"], finished(), tmp_path)
    assert outcome.passed and outcome.detail == (
        "1 parts passed (memory); counted peak / formula, CPU allocator peak - formula: ddp 1.00 / +0.22 W, zero2 0.98 / +0.19 W"
    )


def test_lab8_runs_ddp_and_both_fsdps_on_every_gpu(tmp_path):
    args = LABS["lab8"].command_args(tmp_path, "nccl")
    assert [args[i + 1] for i, arg in enumerate(args) if arg == "--impl"] == ["ddp", "fsdp", "fully_shard"]
    assert LABS["lab8"].ranks(8) == 8 and args[-2:] == ["--backend", "nccl"] and "solutions" in args


def test_join_weights_that_differ_fail_the_hang_lab(tmp_path):
    line = "finished: steps per rank [2, 3]; identical weights on every rank: False; equal to the Join rule computed in one process: False"
    (tmp_path / "hangs.json").write_text(json.dumps({"status": 0, "line": line}))
    outcome = smoke.judge(LABS["lab7_hangs_join"], finished(), tmp_path)
    assert not outcome.passed and outcome.detail.startswith("ran, but the Join scenario did not end correctly")


def test_a_lab_needing_more_ranks_than_gpus_is_marked():
    # the Join scenario; the sweep's 2-rank job; 2-rank subgroups; lab 8 refuses one rank (sharding over one shards nothing)
    two_ranks = {"lab7_hangs_join", "lab5_sweep", "lecture7_sharding", "lab8", "lab9"}
    assert all(LABS[name].min_ranks == 2 for name in two_ranks)
    assert all(lab.min_ranks == 1 for lab in smoke.LAB_RUNS if lab.name not in two_ranks)  # lab 6 too (review finding 2)


def test_cpu_only_scripts_run_on_2_gloo_ranks_and_the_rest_on_every_gpu(tmp_path):
    """Lectures 4 and 6's scripts use CPU tensors: 2 ranks and no --backend flag, whatever the GPU count."""
    assert {lab.name for lab in smoke.LAB_RUNS if lab.gloo_by_design} == {"lecture4_demos", "lecture6_faults"}
    for name in ("lecture4_demos", "lecture6_faults"):
        assert LABS[name].ranks(1) == LABS[name].ranks(8) == 2
        assert "--backend" not in LABS[name].command_args(tmp_path, "nccl")
    assert LABS["lecture5_perf_job"].ranks(1) == 1 and LABS["lecture5_perf_job"].command_args(tmp_path, "nccl")[-2:] == ["--backend", "nccl"]
    assert LABS["lab7_restart"].torchrun_args == ("--max-restarts=1",)
    for name in ("lab7", "lab7_restart"):  # lab 7 refuses torchrun's shared agent store on every launch
        assert dict(LABS[name].env) == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def test_a_lecture4_report_from_an_nccl_group_fails(tmp_path):
    """Review finding 1's crash in the report's words: the demos must run on gloo."""
    (tmp_path / "report.json").write_text(json.dumps({"environment": [{"backend": "nccl"}], "overlap_traces": [{"traced": True}]}))
    outcome = smoke.judge(LABS["lecture4_demos"], finished(), tmp_path)
    assert not outcome.passed and outcome.detail == "ran, but the demos ran on ['nccl'], not gloo (they use CPU tensors)"


def test_a_restart_that_did_not_resume_fails(tmp_path):
    (tmp_path / "lab7.json").write_text(json.dumps({"attempt": 0, "resumed_from_step": 0, "recomputed_steps": 0, "eval_accuracy": 0.8}))
    outcome = smoke.judge(LABS["lab7_restart"], finished(), tmp_path)
    assert not outcome.passed and "expected attempt 1 resumed from step 10" in outcome.detail


def test_a_lecture5_job_with_a_missing_part_fails(tmp_path):
    (tmp_path / "perf.json").write_text(json.dumps({"backend": "nccl", "hooks": {}}))
    outcome = smoke.judge(LABS["lecture5_perf_job"], finished(), tmp_path)
    assert not outcome.passed and outcome.detail.startswith("ran, but perf.json lacks part(s) profile, buckets")


def test_lecture6_replicas_that_stay_equal_after_a_late_load_fail(tmp_path):
    facts = {"replicas_identical": {"load_after_wrap_on_rank0": True, "load_before_wrap_everywhere": True},
             "unused_parameter": {"raised_at_iteration": 1}, "flight_recorder": {"entries": 3}}  # fmt: skip
    (tmp_path / "faults.json").write_text(json.dumps({"per_rank": [facts, facts]}))
    outcome = smoke.judge(LABS["lecture6_faults"], finished(), tmp_path)
    assert not outcome.passed and outcome.detail.startswith("ran, but replicas after loading")


def test_a_crashed_lab_fails_with_its_last_error_line(tmp_path):
    stderr = (
        "[rank1]: Traceback (most recent call last):\n"
        '[rank1]:   File "labs/lab5_scaling.py", line 170, in gather_from_every_rank\n'
        "[rank1]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3690, invalid argument\n"
        "E1123 12:00:00.000000 123 api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 4242) of binary: python\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    )
    outcome = smoke.judge(LABS["lab5"], finished(returncode=1, stderr=stderr), tmp_path)
    assert not outcome.passed
    assert outcome.detail == "exit status 1: [rank1]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3690, invalid argument"


def test_a_script_that_stops_with_one_line_fails_with_that_line(tmp_path):
    """As on the H200 with torch 2.11: the script's own line, not torchrun's report after it (which names errors.html)."""
    stderr = (
        "ddp_internals_demos.py: DDP in torch 2.11.0+cu130 has no forward_sync_buffers argument (the BatchNorm demo needs it); "
        "install the torch that requirements.txt pins\n"
        "W1130 00:28:23.980000 807 torch/distributed/elastic/multiprocessing/api.py:1012] Sending process 813 closing signal SIGTERM\n"
        "E1130 00:28:23.988000 807 torch/distributed/elastic/multiprocessing/api.py:986] failed (exitcode: 1) local_rank: 0\n"
        "Traceback (most recent call last):\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html\n"
    )
    outcome = smoke.judge(LABS["lecture4_demos"], finished(returncode=1, stderr=stderr), tmp_path)
    assert outcome.detail.startswith("exit status 1: ddp_internals_demos.py: DDP in torch 2.11.0+cu130 has no forward_sync_buffers")


def test_a_lab_that_timed_out_fails(tmp_path):
    outcome = smoke.judge(LABS["lab2_join"], finished(returncode=None, wall_s=300.2, timed_out=True), tmp_path)
    assert outcome == smoke.Outcome.of("lab2_join", False, 300.2, "timed out after 300 s")
    assert smoke.format_line(outcome) == "FAIL  lab2_join           300.2 s  timed out after 300 s"


def test_a_lab_without_its_json_fails(tmp_path):
    outcome = smoke.judge(LABS["lab3"], finished(), tmp_path)
    assert not outcome.passed and outcome.detail == "ran, but no readable lab3.json (FileNotFoundError)"


def test_summary_counts_and_exit_status():
    ok, bad = smoke.Outcome.of("lab1", True, 1.0, "x"), smoke.Outcome.of("lab3", False, 2.0, "timed out after 300 s")
    assert smoke.summary([ok, ok]) == ("2 passed, 0 failed", 0)
    assert smoke.summary([ok, bad]) == ("1 passed, 1 failed", 1)
    assert smoke.summary([]) == ("0 passed, 0 failed", 1)  # nothing ran: not a success


@pytest.mark.timeout(120)
def test_without_a_gpu_it_says_so_in_one_line_and_exits_0():
    # run_command hides the GPUs, so this holds on a GPU machine too.
    result = run_command([sys.executable, str(SMOKE_PATH)], timeout_s=90)
    assert result.ok, result.describe()
    assert result.stdout.splitlines() == ["gpu_smoke: no CUDA GPU is visible on this machine; nothing to run (pytest covers the CPU/gloo path)"]
