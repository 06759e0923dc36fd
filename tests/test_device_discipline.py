"""Device discipline for NCCL (issue 11 item 3): every collective in the labs and lecture scripts gets
all its tensors on one device, the rank's. Each torchrun row of benchmarks/gpu_smoke.py runs once, at
its small size, on 2 gloo ranks under tests/scripts/record_collectives.py, which checks every
torch.distributed call (lab 5's sweep driver is left out: it launches its own jobs, which the lab5
row covers). Lab 6 also runs on 1 rank, as gpu_smoke runs it on a 1-GPU machine.

Most of a launch is Python and torch start-up, so rows that need the same ranks run one after another
in ONE launch (the recorder's --rows mode, issue 22): 2 launches instead of 16, every 2-rank row in
one and lab 6's 1-rank row in the other. Two rows are checked where another test file already
launches the same command (CHECKED_ELSEWHERE: lecture 4's demos, lectures 5a-5b's job): that file runs its
launch under the recorder and judges the row there. Each row still gets its own summary line, its own key-figure
check and its own test; a failing row fails its test by name and the rows after it report that they
were not reached. The 2-rank launch runs in the restart-safe environment lab 7 asks for (it only
gives each torchrun attempt a fresh store; the other rows do not notice it) and with lab 7's
--max-restarts=1: its crash-and-restart row comes after every other lab's row, torchrun restarts the
whole launch once, and the recorder skips every row that passed before the crash. The recorder's own
test rows close that launch; the restart is spent by then, so the failing one ends it. The two
launches run side by side, both started by the first test; each test waits for its own.

On gloo every tensor is on the CPU, so a lab passes here unless it mixes devices within one call
(e.g. a meta or CUDA tensor next to CPU ones); on a GPU machine the same wrapper with --backend nccl
would catch a CPU tensor in an NCCL call (review finding 1). The recorder itself is tested below on
a mixed-device call, in a launch and in isolation, since a CPU-only lab run cannot show it failing.
"""

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from ddp_course.checking import rows as row_runner
from ddp_course.launch import REPO_ROOT, import_script, run_torchrun

RECORDER_PATH = REPO_ROOT / "tests" / "scripts" / "record_collectives.py"
BAD_ROW_PATH = REPO_ROOT / "tests" / "scripts" / "recorder_bad_row.py"
ROW_SUMMARY = r"\[collectives rank (\d) row {name}\] status (-?\d+) calls (\d+) violations (\d+) ops (\S*)"
GROUP_TIMEOUT_S = 330  # the 2-rank launch: 13 rows and lab 7's restart
# The recorder's own test (test_a_shared_launch_reports_...), at the end of the main launch: a row with a
# mixed-device call, a row that fails, and a row that must never run. The launch ends with status 3.
SELF_TEST_ROWS = [("mixed", BAD_ROW_PATH, ["--mixed-device"]), ("fails", BAD_ROW_PATH, ["--exit-status", "3"]), ("after", BAD_ROW_PATH, ["--mixed-device"])]


def load_module(name, path):
    return import_script(path, name)


recorder = load_module("record_collectives", RECORDER_PATH)
smoke = load_module("gpu_smoke", REPO_ROOT / "benchmarks" / "gpu_smoke.py")  # the same small commands
# Rows another test file already launches with the same command: it runs that launch under the recorder and
# checks the device rule and the row's key figure there (one run instead of two).
CHECKED_ELSEWHERE = {"lecture4_demos": "test_lecture04_demos.py", "lecture5_perf_job": "test_lecture05_perf_job.py"}
CPU_LABS = [lab for lab in smoke.LAB_RUNS if not lab.gpu_only and not lab.plain_python and lab.name not in CHECKED_ELSEWHERE]
LABS = {lab.name: lab for lab in smoke.LAB_RUNS}


MAIN_LAUNCH = 2  # a launch is known by its number of ranks: every 2-rank row, then lab 6 on 1 rank


def launch_plan(nproc):
    """(the rows of one launch in order [(LabRun or None, name, script, args)], its environment, its torchrun options).

    The rows' environments add up: only lab 7 asks for one, and the other rows run in it unchanged.
    torchrun's options may differ only by --max-restarts: the launch restarts, and the recorder skips
    the rows that passed before."""
    group = list(CPU_LABS) if nproc == MAIN_LAUNCH else [LABS["lab6"]]
    group.sort(key=lambda row: bool(row.torchrun_args))  # rows that crash on purpose last: the others pass first
    options = {row.torchrun_args for row in group if row.torchrun_args}
    assert len(options) <= 1, f"rows of one launch need the same torchrun options: {options}"
    env = dict(pair for row in group for pair in row.env)
    assert len(env) == len({pair for row in group for pair in row.env}), f"rows of one launch set a variable differently: {env}"
    rows = [(row, row.name, REPO_ROOT / row.script, None) for row in group]
    if nproc == MAIN_LAUNCH:  # after the crash row: its restart is spent, so the failing self-test row ends the launch
        rows += [(None, *row) for row in SELF_TEST_ROWS]
    return rows, env, next(iter(options), ())


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
    """Starts both launches of this file on first demand, side by side, and keeps each result for its rows' tests."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory
        self.launches = {}  # ranks -> future of (RunResult, {row name: out dir})
        self.pool = ThreadPoolExecutor(max_workers=2)  # both launches at once

    def result_of(self, nproc):
        if not self.launches:
            for each in (MAIN_LAUNCH, 1):  # the longest first
                self.launches[each] = self.start(each)
        return self.launches[nproc].result()

    def start(self, nproc):
        """Write the launch's rows file and its rows' out dirs (here, not in a worker thread), then start it."""
        rows, env, torchrun_args = launch_plan(nproc)
        outs = {name: self.tmp_path_factory.mktemp(name) for _, name, _, _ in rows}
        commands = [(name, script, lab.command_args(outs[name], "gloo") if lab else args) for lab, name, script, args in rows]
        launch_dir = self.tmp_path_factory.mktemp("launch")
        future = self.pool.submit(run_rows, commands, launch_dir, nproc, GROUP_TIMEOUT_S, env, torchrun_args)
        return _WithOuts(future, outs)

    def close(self):
        self.pool.shutdown(wait=True)


class _WithOuts:
    """A started launch: result() waits for it and returns (RunResult, {row name: out dir})."""

    def __init__(self, future, outs):
        self.future, self.outs = future, outs

    def result(self):
        return self.future.result(), self.outs


@pytest.fixture(scope="module")
def shared_launches(tmp_path_factory):
    launches = SharedLaunches(tmp_path_factory)
    yield launches
    launches.close()


def check_row(lab, launches, nproc):
    """The row's summaries on every rank: ran, exit status 0, collectives seen, none mixing devices."""
    result, outs = launches.result_of(nproc)
    summaries = row_summaries(result, lab.name)
    assert sorted(summaries) == list(range(nproc)), f"row {lab.name} did not finish on every rank (an earlier row failed?)\n{result.describe()}"
    if not lab.torchrun_args:  # a restart must not hide a failure: a row that does not crash on purpose passes every time it runs
        statuses = re.findall(ROW_SUMMARY.format(name=re.escape(lab.name)), result.stdout)
        assert all(int(status) == 0 for _, status, *_ in statuses), f"row {lab.name} failed in an attempt\n{result.describe()}"
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


@pytest.mark.timeout(360)
def test_a_shared_launch_reports_a_violation_and_a_failing_row_by_name(shared_launches):
    """The recorder's --rows mode: a mixed-device call is counted against its own row, a failing row
    ends the launch with its status and is named, and the rows after it never report."""
    result, _ = shared_launches.result_of(MAIN_LAUNCH)
    assert not result.ok, result.describe()  # torchrun reports a failed worker with its own status (1)
    mixed = row_summaries(result, "mixed")
    assert sorted(mixed) == [0, 1] and all(status == 0 and violations == 1 for status, _, violations, _ in mixed.values()), result.describe()
    assert "[collectives rank 0 row mixed] VIOLATION all_reduce: tensors on meta, but this rank's backend works on cpu" in result.stdout
    assert {status for status, *_ in row_summaries(result, "fails").values()} == {3}, result.describe()
    assert row_summaries(result, "after") == {}, result.describe()


@pytest.mark.parametrize("name", sorted(CHECKED_ELSEWHERE))
def test_a_row_left_to_another_file_is_checked_there(name):
    """The file runs the row's script under the recorder and judges the row (its device rule test)."""
    source = (REPO_ROOT / "tests" / CHECKED_ELSEWHERE[name]).read_text()
    assert LABS[name].script in {str(path.relative_to(REPO_ROOT)) for path in REPO_ROOT.glob("lectures/scripts/*.py")}
    assert "RECORDER.__file__, [" in source and "RECORDER.device_rule_failures(result.stdout" in source
    assert f'row.name == "{name}"' in source and "SMOKE.judge(" in source


def test_device_rule_failures_reads_a_run_s_summary_lines():
    good = "[collectives rank 0] calls 3 violations 0 ops all_reduce=3\n[collectives rank 1] calls 3 violations 0 ops all_reduce=3\n"
    assert recorder.device_rule_failures(good, nproc=2) == []
    bad = "[collectives rank 0] VIOLATION all_reduce: tensors on meta\n[collectives rank 0] calls 0 violations 1 ops \n"
    assert recorder.device_rule_failures(bad, nproc=2) == [
        "rank 1 printed no summary line",
        "rank 0 made no collective call",
        "[collectives rank 0] VIOLATION all_reduce: tensors on meta",
    ]


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


def test_a_row_forgets_only_the_courses_own_modules_never_a_library_in_a_venv_inside_the_clone(tmp_path):
    """Issue 29: with the README's `.venv` inside the clone, numpy, scipy and scikit-learn live under the
    repository root too; forgetting them after a row made the next row's import of numpy fail
    ("cannot load module more than once per process"). Only the course's folders are its own."""
    root = str(REPO_ROOT)
    assert row_runner.is_course_file(str(REPO_ROOT / "labs" / "lab3_ddp.py"), root)
    assert row_runner.is_course_file(str(REPO_ROOT / "solutions" / "minddp.py"), root)
    assert not row_runner.is_course_file(str(REPO_ROOT / ".venv" / "lib" / "python3.11" / "site-packages" / "numpy" / "__init__.py"), root)
    assert not row_runner.is_course_file(str(REPO_ROOT / "labs" / "env" / "lib" / "site-packages" / "numpy" / "__init__.py"), root)
    assert not row_runner.is_course_file(str(REPO_ROOT / "ddp_course" / "launch.py"), root)  # shared helpers stay loaded
    assert not row_runner.is_course_file(torch.__file__, root)
    import numpy  # wherever this interpreter's environment lives, its packages are never the course's

    assert "numpy" not in row_runner.own_modules(root) and numpy.__file__
