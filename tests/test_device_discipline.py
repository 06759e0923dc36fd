"""Device discipline for NCCL (issue 11 item 3): every collective in the labs and lecture scripts gets
all its tensors on one device, the rank's. Each torchrun row of benchmarks/gpu_smoke.py runs once, at
its small size, on 2 gloo ranks under tests/scripts/record_collectives.py, which checks every
torch.distributed call (lab 5's sweep driver is left out: it launches its own jobs, which the lab5
row covers). Lab 6 also runs on 1 rank, as gpu_smoke runs it on a 1-GPU machine.

Most of a launch is Python and torch start-up, so rows that need the same torchrun options and
environment run one after another in ONE launch (the recorder's --rows mode, issue 22): 4 launches
instead of 16. Each row still gets its own summary line, its own key-figure check and its own test;
a failing row fails its test by name and the rows after it report that they were not reached. Lab 7
runs apart (its restart-safe environment), and so does lab 7's crash-and-restart row (torchrun
restarts the whole launch).

On gloo every tensor is on the CPU, so a lab passes here unless it mixes devices within one call
(e.g. a meta or CUDA tensor next to CPU ones); on a GPU machine the same wrapper with --backend nccl
would catch a CPU tensor in an NCCL call (review finding 1). The recorder itself is tested below on
a mixed-device call, in a launch and in isolation, since a CPU-only lab run cannot show it failing.
"""

import json
import re
from dataclasses import replace

import pytest
import torch

from ddp_course.launch import REPO_ROOT, import_script, run_torchrun

RECORDER_PATH = REPO_ROOT / "tests" / "scripts" / "record_collectives.py"
BAD_ROW_PATH = REPO_ROOT / "tests" / "scripts" / "recorder_bad_row.py"
ROW_SUMMARY = r"\[collectives rank (\d) row {name}\] status (-?\d+) calls (\d+) violations (\d+) ops (\S*)"
GROUP_TIMEOUT_S = 330  # the 13 shared rows take about 60 s on a quiet 2-core machine


def load_module(name, path):
    return import_script(path, name)


recorder = load_module("record_collectives", RECORDER_PATH)
smoke = load_module("gpu_smoke", REPO_ROOT / "benchmarks" / "gpu_smoke.py")  # the same small commands
CPU_LABS = [lab for lab in smoke.LAB_RUNS if not lab.gpu_only and not lab.plain_python]
LABS = {lab.name: lab for lab in smoke.LAB_RUNS}


def launch_key(lab, nproc):
    """Rows with the same key can share a launch: same ranks, torchrun options and environment."""
    return (nproc, lab.torchrun_args, lab.env)


def run_rows(rows, out_dirs, nproc, timeout_s, env=(), torchrun_args=()):
    """One torchrun launch of the recorder over rows [(name, script, args)]; returns its RunResult."""
    spec = [{"name": name, "script": str(script), "args": [str(arg) for arg in args]} for name, script, args in rows]
    rows_file = out_dirs / "rows.json"
    rows_file.write_text(json.dumps(spec, indent=1))
    return run_torchrun(RECORDER_PATH, ["--rows", rows_file], nproc=nproc, timeout_s=timeout_s, env=dict(env), torchrun_args=list(torchrun_args))


def row_summaries(result, name):
    """{rank: (status, calls, violations, ops)} of one row; a restarted launch prints one per attempt, the last wins."""
    pattern = re.compile(ROW_SUMMARY.format(name=re.escape(name)))
    return {int(m[1]): (int(m[2]), int(m[3]), int(m[4]), m[5]) for m in pattern.finditer(result.stdout)}


class SharedLaunches:
    """Runs each group of rows once, on first demand, and keeps the launch's result for the rows' tests."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory
        self.launches = {}  # launch key -> (RunResult, {row name: out dir})

    def result_of(self, lab, nproc):
        key = launch_key(lab, nproc)
        if key not in self.launches:
            group = [row for row in CPU_LABS if launch_key(row, nproc) == key] if nproc == 2 else [lab]
            outs = {row.name: self.tmp_path_factory.mktemp(row.name) for row in group}
            rows = [(row.name, REPO_ROOT / row.script, row.command_args(outs[row.name], "gloo")) for row in group]
            launch_dir = self.tmp_path_factory.mktemp("launch")
            self.launches[key] = (run_rows(rows, launch_dir, nproc, GROUP_TIMEOUT_S, lab.env, lab.torchrun_args), outs)
        return self.launches[key]


@pytest.fixture(scope="module")
def shared_launches(tmp_path_factory):
    return SharedLaunches(tmp_path_factory)


def check_row(lab, launches, nproc):
    """The row's summaries on every rank: ran, exit status 0, collectives seen, none mixing devices."""
    result, outs = launches.result_of(lab, nproc)
    summaries = row_summaries(result, lab.name)
    assert sorted(summaries) == list(range(nproc)), f"row {lab.name} did not finish on every rank (an earlier row failed?)\n{result.describe()}"
    for rank, (status, calls, violations, ops) in summaries.items():
        assert status == 0, f"row {lab.name} exited with status {status} on rank {rank}\n{result.describe()}"
        assert calls > 0, f"row {lab.name}, rank {rank} made no collective call through torch.distributed: {ops}"
        assert violations == 0, "\n".join(line for line in result.stdout.splitlines() if f"row {lab.name}] VIOLATION" in line)
    # The row passed on every rank: judge its key figure (from its own out dir) as gpu_smoke would.
    row_result = replace(result, returncode=0, timed_out=False)
    outcome = smoke.judge(lab, row_result, outs[lab.name])
    assert outcome.passed, outcome


@pytest.mark.timeout(360)
@pytest.mark.parametrize("lab", CPU_LABS, ids=[lab.name for lab in CPU_LABS])
def test_every_collective_of_the_lab_gets_tensors_on_one_device(shared_launches, lab):
    # The run also gives the smoke table's key figure, so its parser matches the lab's real output.
    check_row(lab, shared_launches, nproc=2)


@pytest.mark.timeout(360)
def test_lab6_passes_on_one_rank_as_on_a_1_gpu_machine(shared_launches):
    """Review finding 2: gpu_smoke runs lab 6 with one rank per GPU, so a 1-GPU machine runs it on 1 rank.

    Before lab 6 skipped its no-sync control on one rank (commit 4eb5255), the control could not
    differ from the reference there and the check failed."""
    check_row(LABS["lab6"], shared_launches, nproc=1)


@pytest.mark.timeout(180)
def test_a_shared_launch_reports_a_violation_and_a_failing_row_by_name(tmp_path):
    """The recorder's --rows mode: a mixed-device call is counted against its own row, a failing row
    ends the launch with its status and is named, and the rows after it never report."""
    rows = [("mixed", BAD_ROW_PATH, ["--mixed-device"]), ("fails", BAD_ROW_PATH, ["--exit-status", "3"]), ("after", BAD_ROW_PATH, ["--mixed-device"])]
    result = run_rows(rows, tmp_path, nproc=2, timeout_s=150)
    assert not result.ok, result.describe()
    mixed = row_summaries(result, "mixed")
    assert sorted(mixed) == [0, 1] and all(status == 0 and violations == 1 for status, _, violations, _ in mixed.values()), result.describe()
    assert "[collectives rank 0 row mixed] VIOLATION all_reduce: tensors on meta, but this rank's backend works on cpu" in result.stdout
    assert {status for status, *_ in row_summaries(result, "fails").values()} == {3}, result.describe()
    assert row_summaries(result, "after") == {}, result.describe()


def test_recorder_flags_a_mixed_device_output_list():
    """Lab 5's old bug in miniature: an input on one device, the output list on another."""
    mine = torch.zeros(3, device="meta")
    outputs = [torch.zeros(3), torch.zeros(3)]
    problems = recorder.device_problems("all_gather", (outputs, mine), {}, expected=None)
    assert problems == ["all_gather: tensor 2 on meta, the first tensor on cpu"]


def test_recorder_flags_tensors_off_the_backends_device():
    on_cpu = torch.zeros(2)
    assert recorder.device_problems("all_reduce", (on_cpu,), {}, expected=torch.device("meta")) == [
        "all_reduce: tensors on cpu, but this rank's backend works on meta"
    ]
    assert recorder.device_problems("all_reduce", (on_cpu,), {"op": None}, expected=torch.device("cpu")) == []
    assert recorder.device_problems("barrier", (), {}, expected=torch.device("cpu")) == []  # no tensor, nothing to check


def test_recorder_finds_tensors_in_nested_lists_and_keywords():
    nested = [[torch.zeros(1)], [torch.zeros(1, device="meta")]]  # all_to_all-style lists
    assert len(recorder.tensors_in(nested)) == 2
    problems = recorder.device_problems("scatter", (torch.zeros(1),), {"scatter_list": nested}, expected=None)
    assert problems == ["scatter: tensor 2 on meta, the first tensor on cpu"]
