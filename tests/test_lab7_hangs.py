"""labs/lab7_hangs.py: every planted hang ends in time with the tool's diagnosis; Join finishes correctly.

Seven runs (the five scenarios, and two without their tool) are rows of four launches (LAUNCHES,
tests/scripts/rows_launch.py): most of a launch is start-up (torchrun's agent and two ranks
importing torch), which the rows of a launch pay once. A run whose collectives time out on purpose
ends its launch (the group it leaves behind is broken), so each launch holds one, last; the runs
that end at once (DETAIL's mismatches, Join) go before it. The launches run in threads,
LAUNCHES_AT_ONCE at a time: a launch is mostly start-up (CPU) and a wait for its own --timeout-s
(idle), so while one waits another starts. The broken runs use a 2 s timeout; "in time" is
checked on the time rank 0 spent in the collective that failed (at most 2 x --timeout-s), which
does not depend on how long a loaded machine takes to start the processes.
"""

import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from ddp_course.launch import REPO_ROOT, import_script

LAB7_HANGS = REPO_ROOT / "labs" / "lab7_hangs.py"
rows_launch = import_script(REPO_ROOT / "tests" / "scripts" / "rows_launch.py", "rows_launch")
# Measured with the seven launches at once (load average 5): after the scenario's group exists, the two ranks
# reach each matching collective within 0.02 s of each other (DDP's constructor included, which first spends
# about 5 s importing torch._dynamo on every rank); 2 s is 100x that, and the hangs still wait for it.
TIMEOUT_S = 2
TIMEOUT_MS = f"{1000 * TIMEOUT_S} ms"
RUNS = {
    "rank0-only": ["--scenario", "rank0-only"],
    "shape-mismatch": ["--scenario", "shape-mismatch"],
    "shape-mismatch, no tools": ["--scenario", "shape-mismatch", "--no-tools"],
    "missing-rank": ["--scenario", "missing-rank"],
    "missing-rank, no tools": ["--scenario", "missing-rank", "--no-tools"],
    "uneven": ["--scenario", "uneven"],
    "uneven-join": ["--scenario", "uneven-join"],
}
# The rows of each launch, in order; the last of each times out on purpose. Both uneven runs share a
# launch: each rank imports torch._dynamo (DDP's constructor needs it, seconds of CPU) once for both.
LAUNCHES = [
    ["rank0-only", "shape-mismatch", "missing-rank"],
    ["uneven-join", "uneven"],
    ["shape-mismatch, no tools"],
    ["missing-rank, no tools"],
]


# Launches running at once. Each is mostly CPU-bound start-up (torch imports in the agent and both
# ranks) on 2 cores, so more at once only adds switching: with one launch per run, the module took
# about 30 s with 2, 3 or 4 at once and 34 s with all 7, for 45, 50, 53 and 59 CPU-seconds (one run
# each, alone, load 3-3.6).
LAUNCHES_AT_ONCE = 2


def load_module():
    return import_script(LAB7_HANGS)


def expected_status(name) -> int:
    return 0 if name == "uneven-join" else 1


def file_name(name) -> str:
    """ "missing-rank, no tools" -> "missing-rank-no-tools": the run's output folder and report name."""
    return rows_launch.row_name((name,)).replace(",", "")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, read_json):
    """{name: (RowRun, rank 0's JSON or None)} for every run in RUNS, as rows of LAUNCHES."""
    folder = tmp_path_factory.mktemp("lab7_hangs")

    def row(name, launch=None):
        run = rows_launch.Run(2, LAB7_HANGS, [], expected_status(name))
        return rows_launch.RowRun((name,), run, folder / file_name(name), launch)

    def report(name):
        return folder / f"{file_name(name)}.json"

    def launch(names):
        entries = []
        for name in names:
            # Join must not fail because a busy machine stalls a rank: it gets a long timeout.
            timeout = 60 if name == "uneven-join" else TIMEOUT_S
            each, flags = row(name), [*RUNS[name], "--timeout-s", timeout, "--json", report(name)]
            entries.append(rows_launch.row_entry(each.key, each.run, each.folder, flags))
        rows_folder = folder / f"rows{LAUNCHES.index(names)}"
        rows_folder.mkdir()
        return rows_launch.launch_rows(entries, rows_folder, 2, timeout_s=240)

    with ThreadPoolExecutor(max_workers=LAUNCHES_AT_ONCE) as pool:
        futures = [(names, pool.submit(launch, names)) for names in LAUNCHES]
        results = {name: row(name, future.result()) for names, future in futures for name in names}
    return {name: (result, read_json(report(name)) if report(name).exists() else None) for name, result in results.items()}


def last_of_its_launch(name) -> bool:
    return any(names[-1] == name for names in LAUNCHES)


def rank_lines(result) -> dict[str, list[str]]:
    """{"0": [rank 0's lines], "1": [...]} from the "[rank r] ..." lines of the run's stdout."""
    lines = {}
    for rank, text in re.findall(r"^\[rank (\d)\] (.*)$", result.job_stdout(), flags=re.MULTILINE):
        lines.setdefault(rank, []).append(text)
    return lines


def assert_failed_in_time(result, report):
    """Non-zero exit by the script's own diagnosis (not the launcher's kill), within 2 x the timeout.

    A run that ends its launch failed by itself (RowRun.failed_by_itself); one before the last of its
    launch ended with status 1 on every rank, or the launch would have stopped there."""
    name = result.key[0]
    ended = result.failed_by_itself() if last_of_its_launch(name) else result.ended_as_expected()
    assert ended, result.describe()
    assert not result.a_rank_printed_a_traceback(), result.describe()
    assert "[rank0]: Traceback" not in result.launch.stderr and "[rank1]: Traceback" not in result.launch.stderr, result.describe()
    assert report is not None and report["status"] == 1, result.describe()
    assert report["seconds_waited"] <= 2 * TIMEOUT_S, report


@pytest.mark.timeout(300)
def test_rank0_only_collective_is_named_by_detail_on_both_ranks(runs):
    result, report = runs["rank0-only"]
    assert_failed_in_time(result, report)
    lines = rank_lines(result)
    assert lines["0"] == [
        "stopped in the all-reduce only rank 0 calls: mismatch: Detected mismatch between collectives "
        "(this rank ran ALLREDUCE [4]; they differ in op type, tensor shapes, tensor dtypes, tensor devices)"
    ]
    assert lines["1"] == ["stopped in the end-of-step barrier: mismatch: Detected mismatch between collectives (this rank ran BARRIER; they differ in op type)"]
    assert "tool=DETAIL" in result.job_stdout()
    assert report["seconds_waited"] < TIMEOUT_S  # DETAIL stops at once: it does not wait for the timeout


@pytest.mark.timeout(300)
def test_shape_mismatch_is_named_with_detail_and_silently_wrong_without(runs):
    result, report = runs["shape-mismatch"]
    assert_failed_in_time(result, report)
    lines = rank_lines(result)
    assert lines["0"] == [
        "stopped in the all-reduce: mismatch: Detected mismatch between collectives (this rank ran ALLREDUCE [4]; they differ in tensor shapes)"
    ]
    assert lines["1"] == [
        "stopped in the all-reduce: mismatch: Detected mismatch between collectives (this rank ran ALLREDUCE [3]; they differ in tensor shapes)"
    ]

    # Without DETAIL, gloo hands rank 1 a wrong sum and raises nothing; rank 0 waits until its timeout.
    result, report = runs["shape-mismatch, no tools"]
    assert_failed_in_time(result, report)
    lines = rank_lines(result)
    assert lines["1"][0].startswith("wrong result with no error: the all-reduce returned ["), result.describe()
    assert lines["1"][0].endswith("every element should be 3.0")
    assert lines["0"] == [f"stopped in the all-reduce: timeout: no peer answered within {TIMEOUT_MS} (the process group's timeout)"]
    assert report["seconds_waited"] >= 0.9 * TIMEOUT_S  # it really waited for the timeout


@pytest.mark.timeout(300)
def test_missing_rank_is_named_by_monitored_barrier_only(runs):
    result, report = runs["missing-rank"]
    assert_failed_in_time(result, report)
    lines = rank_lines(result)
    assert lines["1"][0] == "busy for 1.5 x --timeout-s before the barrier (a stuck data loader, say)"
    assert lines["0"] == [f"stopped in monitored_barrier: missing rank: rank(s) 1 did not reach monitored_barrier within {TIMEOUT_MS}"]

    result, report = runs["missing-rank, no tools"]  # a plain barrier: the same wait, but no name
    assert_failed_in_time(result, report)
    assert rank_lines(result)["0"] == [f"stopped in the barrier: timeout: no peer answered within {TIMEOUT_MS} (the process group's timeout)"]


@pytest.mark.timeout(300)
def test_uneven_inputs_without_join_stop_at_the_timeout_saying_where(runs):
    result, report = runs["uneven"]
    assert_failed_in_time(result, report)
    assert "batches per rank: [2, 3] - uneven: DDP needs Join" in result.job_stdout()
    lines = rank_lines(result)
    assert lines["0"][0].startswith("stopped in the end-of-epoch barrier, after its 2 steps: "), result.describe()
    assert lines["1"][0].startswith("stopped in the gradient all-reduce of step 3 (of 3): "), result.describe()
    # The first rank to give up reports the timeout; the other may see its connection close instead.
    kinds = {line.split(": ")[1] for line in (lines["0"][0], lines["1"][0])}
    assert "timeout" in kinds and kinds <= {"timeout", "peer gone"}, result.describe()


@pytest.mark.timeout(300)
def test_join_finishes_with_identical_weights_that_follow_the_join_rule(runs):
    result, report = runs["uneven-join"]
    assert result.ended_as_expected() and not result.a_rank_printed_a_traceback(), result.describe()
    assert report["status"] == 0 and report["seconds_waited"] is None
    assert (
        "finished: steps per rank [2, 3]; identical weights on every rank: True; equal to the Join rule computed in one process: True"
    ) in result.job_stdout()


@pytest.mark.timeout(60)
def test_the_join_rule_check_can_fail():
    """The reference differs from a rule a learner might assume (average over the ranks still
    training) by far more than the check's 1e-5 tolerance, so the check is not vacuous."""
    import torch

    from ddp_course.compare import max_relative_difference

    lab = load_module()
    reference = lab.join_rule_reference(2)
    lab.seed_everything(0)
    model = torch.nn.Linear(lab.FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=lab.LR)
    per_rank = [lab.batches_for(r) for r in range(2)]
    for step in range(3):
        active = [batches[step] for batches in per_rank if step < len(batches)]
        model.zero_grad()
        sum(torch.nn.functional.mse_loss(model(x), y) for x, y in active).div(len(active)).backward()
        optimizer.step()
    assert max_relative_difference(dict(model.state_dict()), reference) > 1e-3


@pytest.mark.timeout(60)
def test_help_lists_the_scenarios(capsys):
    with pytest.raises(SystemExit) as stopped:
        load_module().parse_args(["--help"])
    assert stopped.value.code == 0
    assert "--scenario {rank0-only,shape-mismatch,missing-rank,uneven,uneven-join}" in capsys.readouterr().out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([], "the following arguments are required: --scenario"),
        (["--scenario", "deadlock"], "argument --scenario: invalid choice: 'deadlock'"),
        (["--scenario", "uneven", "--timeout-s", "0"], "argument --timeout-s: must be a positive number, got 0"),
        (["--scenario", "uneven", "--backend", "mpi"], "argument --backend: invalid choice: 'mpi'"),
    ],
)
def test_bad_flags_end_in_one_line(refused_flag_line, args, expected):
    assert expected in refused_flag_line(load_module(), args)


@pytest.mark.timeout(60)
def test_one_process_and_nccl_without_gpus_are_refused_in_one_line(monkeypatch, capsys):
    lab = load_module()
    monkeypatch.setattr(sys, "argv", ["labs/lab7_hangs.py"])  # log_error names the script from argv[0]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert lab.main(lab.parse_args(["--scenario", "uneven"])) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["lab7_hangs.py: error: every scenario needs at least 2 ranks: torchrun --standalone --nproc_per_node=2 labs/lab7_hangs.py ..."]
    # The NCCL path is written but not run here (no GPU): asking for it says so in one line.
    monkeypatch.setattr(lab.torch.cuda, "device_count", lambda: 0)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert lab.main(lab.parse_args(["--scenario", "uneven", "--backend", "nccl"])) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lab7_hangs.py: error: --backend nccl needs CUDA GPUs"), err
