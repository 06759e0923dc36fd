"""What lecture 04 prints from its 2-rank job holds: the demo script's facts, checked outside nbval.

One torchrun launch of lectures/scripts/ddp_internals_demos.py (about 15-25 s on 2 CPU cores), then one
test per section of the lecture. The launch runs under the collectives recorder, which checks every
collective's devices (tests/test_device_discipline.py leaves the script's gpu_smoke row to it). Also: the
demo script starts gloo even where a GPU is visible (review finding 1), the mp.spawn launcher works from
a script, and mp.spawn of a function defined in a program without a module file (a notebook, `python -c`)
fails.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from ddp_course import profiling
from ddp_course.launch import REPO_ROOT, child_environment, import_script, run_command, run_torchrun

SCRIPTS = REPO_ROOT / "lectures" / "scripts"
RECORDER = import_script(REPO_ROOT / "tests" / "scripts" / "record_collectives.py", "record_collectives")
SMOKE = import_script(REPO_ROOT / "benchmarks" / "gpu_smoke.py", "gpu_smoke")
SMOKE_ROW = next(row for row in SMOKE.LAB_RUNS if row.name == "lecture4_demos")


@pytest.fixture(scope="module")
def spawn_launch():
    """The spawn demo, started before the job below so that the two start up side by side; a Future."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawn")
    future = pool.submit(run_command, [sys.executable, str(SCRIPTS / "ddp_internals_spawn.py"), "--nprocs", "2"], timeout_s=90)
    pool.shutdown(wait=False)
    return future


@pytest.fixture(scope="module")
def recorded_job(tmp_path_factory, spawn_launch):
    """(RunResult, out folder) of one run of the demo script with gpu_smoke's command (its lecture4_demos
    row), under the collectives recorder: tests/test_device_discipline.py leaves the row to this run."""
    out = tmp_path_factory.mktemp("lecture04")
    args = SMOKE_ROW.command_args(out, "gloo")  # --json out/report.json --trace-dir out/traces
    result = run_torchrun(RECORDER.__file__, [SCRIPTS / "ddp_internals_demos.py", *args], nproc=2, timeout_s=240)
    assert result.ok, result.describe()
    return result, out


@pytest.fixture(scope="module")
def job(recorded_job):
    """(report, trace folder) of the run."""
    _, out = recorded_job
    return json.loads((out / "report.json").read_text()), out / "traces"


@pytest.mark.timeout(300)
def test_every_collective_gets_tensors_on_one_device_and_the_smoke_row_passes(recorded_job):
    """The device rule of tests/test_device_discipline.py (its docstring), and gpu_smoke's key figure of the row."""
    result, out = recorded_job
    assert RECORDER.device_rule_failures(result.stdout, nproc=2) == [], result.describe()
    outcome = SMOKE.judge(SMOKE_ROW, result, out)
    assert outcome.passed, outcome


@pytest.mark.timeout(300)
def test_torchrun_environment_and_subgroups(job):
    report, _ = job
    for rank, facts in enumerate(report["environment"]):
        assert (facts["RANK"], facts["LOCAL_RANK"], facts["WORLD_SIZE"], facts["LOCAL_WORLD_SIZE"]) == (str(rank), str(rank), "2", "2")
        assert facts["MASTER_PORT"].isdigit() and facts["TORCHELASTIC_RESTART_COUNT"] == "0" and facts["backend"] == "gloo"
    assert [f["rank_in_each_solo_group"] for f in report["subgroups"]] == [[0, -1], [-1, 0]]
    assert [f["sum_in_my_group"] for f in report["subgroups"]] == [1.0, 2.0]
    assert [f["sum_in_everyone"] for f in report["subgroups"]] == [3.0, 3.0]


@pytest.mark.timeout(300)
def test_construction_broadcasts_rank_0s_parameters_and_buffers(job):
    report, _ = job
    for facts in report["broadcast_at_construction"]:
        assert facts["equal_before"] == {"weight": False, "running_mean": False}
        assert facts["equal_after"] == {"weight": True, "running_mean": True} and facts["equals_rank0_original"]
        assert facts["running_mean_after"] == [0.0] * 4  # rank 0's value


@pytest.mark.timeout(300)
def test_buckets_one_first_then_rebuilt_in_ready_order(job):
    report, _ = job
    buckets = report["buckets"][0]
    assert report["buckets"][0] == report["buckets"][1]
    names = list(buckets["parameter_bytes"])
    for cap in ("None", "0.5", "1", "25"):
        assert buckets[cap]["before"] == buckets[cap]["after_step_1"] == [names] and buckets[cap]["rebuilt"]
    assert buckets["None"]["after_step_2"][0][:2] == ["head.bias", "head.weight"]  # ready first
    assert len(buckets["25"]["after_step_2"]) == 1 and len(buckets["0.5"]["after_step_2"]) == 3
    unused = buckets["None, find_unused_parameters"]
    assert not unused["rebuilt"] and unused["before"] == unused["after_step_2"] and len(unused["before"]) == 2


@pytest.mark.timeout(300)
def test_launches_follow_bucket_order(job):
    report, _ = job
    assert report["launch_order"][0] == report["launch_order"][1]
    for facts in report["launch_order"][0].values():
        launches = [event[1] for event in facts["log"] if event[0] == "launch"]
        assert launches == list(range(len(facts["buckets"])))
    # The figure of section 2.2 (assets/ddp_backward.json, current by tests/test_diagrams.py) shows this job's order.
    figure = json.loads((REPO_ROOT / "assets" / "ddp_backward.json").read_text())["description"]
    assert figure["buckets"] == report["launch_order"][0]["default"]["buckets"]
    assert figure["events"] == report["launch_order"][0]["default"]["log"]
    log = report["launch_order"][0]["find_unused_parameters"]["log"]
    assert report["launch_order"][0]["find_unused_parameters"]["buckets"][-1] == ["head.weight"]
    # head.weight is ready second, but its bucket (the last) is launched last, right after bucket 3
    assert log.index(["ready", "head.weight"]) == 1 and log[-2:] == [["launch", 3], ["launch", 4]]


@pytest.mark.timeout(300)
def test_gradient_views_unused_parameters_and_static_graph(job):
    report, _ = job
    for facts in report["gradient_as_bucket_view"]:
        assert facts["False"]["grads_inside_buckets"] == 0 and facts["True"]["grads_inside_buckets"] == facts["True"]["parameters"] == 8
    for rank, facts in enumerate(report["unused_everywhere"]):
        assert facts["False"]["steps_completed"] == 1
        assert facts["False"]["error"].startswith("Expected to have finished reduction in the prior iteration")
        assert f"did not receive grad for rank {rank}: 2 3" in facts["False"]["error"]
        assert facts["True"] == {"steps_completed": 3, "error": None, "extra_grad_is_none": True}
    for facts in report["unused_on_some_ranks"]:
        assert facts["grad_equal_on_every_rank"] and facts["grad_is_average_of_local"] and facts["grad_nonzero"]
    outcomes = [f["outcome"] for f in report["unused_on_one_rank_without_flag"]]
    assert outcomes[0] == "timed out" and outcomes[1].startswith("Expected to have finished reduction")
    for facts in report["static_graph"]:
        assert facts == {"steps_completed": 3, "body_grad_equal": True, "extra_grad_is_none": True}


@pytest.mark.timeout(300)
def test_buffers_batchnorm_and_changes_after_wrapping(job):
    report, _ = job
    for rank, facts in enumerate(report["batchnorm"]):
        synced, unsynced = facts["forward_sync_buffers=True"], facts["forward_sync_buffers=False"]
        assert synced == {"equal_after_step_1": False, "step_2_forward_saw_rank0_values": True, "equal_after_step_2": False}
        assert unsynced["step_2_forward_saw_rank0_values"] == (rank == 0)
        assert facts["broadcast_buffers_warns"][0].startswith("FutureWarning: `broadcast_buffers` is deprecated")
    for facts in report["sync_batchnorm"]:
        assert "GPU" in facts["sync_batchnorm_on_cpu_error"] and facts["global_stats_match_one_process"]
    for facts in report["change_after_wrapping"]:
        assert facts["replaced"].startswith("Expected to have finished reduction")
        assert facts["added"] == {"body_equal_on_every_rank": True, "added_equal_on_every_rank": False}


@pytest.mark.timeout(300)
def test_hooks_and_overlap(job):
    report, traces = job
    for facts in report["tensor_hook"]:
        assert not facts["hook_grad_equal_on_every_rank"] and facts["final_grad_equal_on_every_rank"]
        assert facts["final_is_mean_of_hook_grads"]
    hooks = report["comm_hooks"][0]
    assert hooks["mean"]["matches_builtin"] and hooks["blocking"]["matches_builtin"]
    assert not hooks["sum"]["matches_builtin"] and hooks["sum"]["min_ratio"] == hooks["sum"]["max_ratio"] == 2.0
    for name, overlapped in (("builtin", True), ("blocking", False)):
        timelines = profiling.read_traces(traces / name)
        rows = profiling.overlap_summary(timelines)
        assert [(r["rank"], r["step"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        for row in rows:
            # Six 4 MiB layers, one bucket each; the last bucket (first layer) is ready only once every
            # gradient is computed; DDP's backward() waits for all of them.
            assert (row["all_reduces"], row["launched_before_compute_end"], row["started_before_backward_end"]) == (6, 5, 6)
            assert row["overlapped"] is overlapped, (name, row)
        for per_rank in timelines.values():
            assert all(set(t.phases) == set(profiling.PHASES) for t in per_rank)
            assert all(t.gradient_compute_end_us <= t.phases["backward"].end_us for t in per_rank)


@pytest.mark.timeout(120)
def test_the_spawn_launcher_runs_two_ranks(spawn_launch):
    result = spawn_launch.result()
    assert result.ok, result.describe()
    assert sorted(result.stdout.splitlines()) == [f"[rank {r} of 2] all_reduce of the ranks' ids: 1" for r in (0, 1)]


@pytest.mark.timeout(120)
def test_spawning_a_function_without_a_module_file_fails():
    program = "import torch.multiprocessing as mp\ndef square(i):\n    return i * i\nmp.spawn(square, nprocs=1)\n"
    finished = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=90,
                              env=child_environment(os.environ, 1, None, False))  # fmt: skip
    assert finished.returncode != 0
    assert "Can't get attribute 'square'" in finished.stderr
    assert "ProcessExitedException: process 0 terminated with exit code 1" in finished.stderr


class GroupStarted(Exception):
    """Stops main() right after it asked for its process group (the demos need a real job)."""


def test_the_demo_script_starts_gloo_even_where_a_gpu_is_visible(monkeypatch, tmp_path):
    """Review finding 1: with NCCL, the demos' first CPU collective fails on a GPU machine."""
    demos = import_script(SCRIPTS / "ddp_internals_demos.py")
    requested = []

    def record_group(backend=None, **kwargs):
        requested.append(backend)
        raise GroupStarted()

    monkeypatch.setattr(demos.torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    monkeypatch.setattr(demos.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(demos.torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(demos.dist, "init_process_group", record_group)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(sys, "argv", ["ddp_internals_demos.py", "--json", str(tmp_path / "report.json")])
    with pytest.raises(GroupStarted):
        demos.main()
    assert requested == ["gloo"]
    assert "gloo" in demos.__doc__ and "GPU machine" in demos.__doc__


def test_an_older_torch_gets_one_line_before_any_process_group(monkeypatch, tmp_path):
    """Seen on a GPU machine with torch 2.11: DDP had no forward_sync_buffers, and every rank printed a traceback."""
    demos = import_script(SCRIPTS / "ddp_internals_demos.py")

    class TorchElevenDDP:  # the constructor's arguments as torch 2.11 has them, without forward_sync_buffers
        def __init__(self, module, device_ids=None, broadcast_buffers=True, process_group=None):
            pass

    monkeypatch.setattr(demos, "DDP", TorchElevenDDP)
    monkeypatch.setattr(demos.dist, "init_process_group", lambda **kwargs: pytest.fail("the group started anyway"))
    monkeypatch.setattr(sys, "argv", ["ddp_internals_demos.py", "--json", str(tmp_path / "report.json")])
    with pytest.raises(SystemExit) as stopped:
        demos.main()
    message = str(stopped.value.code)
    assert "\n" not in message and "no forward_sync_buffers argument" in message and "requirements.txt" in message


LECTURE = REPO_ROOT / "lectures" / "04_ddp_internals.ipynb"


@pytest.mark.timeout(30)
def test_each_fact_is_printed_beside_the_demo_it_comes_from():
    """Code behind every fact, one demo beside each fact (issue 38: no 191-line dump of every demo at once):
    the first cell reading report["X"] (demo_X's facts) prints demo_X's source itself, or the code cell
    just before it does."""
    import re

    import nbformat

    cells = nbformat.read(LECTURE, as_version=4).cells
    demos = set(re.findall(r"^def (demo_\w+)", (SCRIPTS / "ddp_internals_demos.py").read_text(), re.MULTILINE))
    previous_shown, first_read = set(), {}
    for cell in cells:
        if cell.cell_type != "code" or "def show_demos" in cell.source:
            continue
        shown = {name for call in re.findall(r"show_demos\(([^)]*)\)", cell.source) for name in re.findall(r'"(\w+)"', call)}
        for key in re.findall(r'report\["(\w+)"\]', cell.source):
            if key not in first_read:
                first_read[key] = cell.source
                assert f"demo_{key}" in demos, key
                assert f"demo_{key}" in shown | previous_shown, f"report[{key!r}] is read away from its demo's source"
        if "profiling.read_traces" in cell.source:
            assert "demo_overlap_traces" in shown | previous_shown
        previous_shown = shown
    assert not any("source_of(" in cell.source for cell in cells)
    assert len(first_read) >= 14


def test_the_overlap_table_has_one_row_per_run_and_shows_disagreement():
    from ddp_course.lecture04_checks import overlap_table

    row = {"all_reduces": 6, "launched_before_compute_end": 5, "started_before_backward_end": 6, "overlapped": True}
    table = overlap_table({"builtin": [row, dict(row)], "blocking": [{**row, "overlapped": False}, row]}).splitlines()
    assert len(table) == 4 and table[2].split("|")[-1].strip() == "True"
    assert table[3].split("|")[-1].strip() == "[False, True]"  # ranks or steps that differ are not hidden
