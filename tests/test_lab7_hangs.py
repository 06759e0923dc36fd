"""labs/lab7_hangs.py: every planted hang ends in time with the tool's diagnosis; Join finishes correctly.

Seven launches (the five scenarios, and two without their tool) run in threads, LAUNCHES_AT_ONCE
at a time, in one module fixture: a launch is mostly start-up (CPU) and a wait for its own
--timeout-s (idle), so while one waits another starts. The broken ones use a 2 s timeout; "in
time" is checked on the time rank 0 spent in the collective that failed (at most 2 x --timeout-s),
which does not depend on how long a loaded machine takes to start the processes.
"""

import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from ddp_course.launch import REPO_ROOT, import_script, run_torchrun

LAB7_HANGS = REPO_ROOT / "labs" / "lab7_hangs.py"
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


# Launches running at once. Each is mostly CPU-bound start-up (torch imports in the agent and both
# ranks) on 2 cores, so more at once only adds switching: the module took about 30 s with 2, 3 or 4
# at once and 34 s with all 7, for 45, 50, 53 and 59 CPU-seconds (one run each, alone, load 3-3.6).
LAUNCHES_AT_ONCE = 2


def load_module():
    return import_script(LAB7_HANGS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, read_json):
    """{name: (RunResult, rank 0's JSON or None)} for every launch in RUNS, LAUNCHES_AT_ONCE at a time."""
    folder = tmp_path_factory.mktemp("lab7_hangs")

    def launch(name):
        # Join must not fail because a busy machine stalls a rank: it gets a long timeout.
        timeout = 60 if name == "uneven-join" else TIMEOUT_S
        report = folder / f"{name.replace(' ', '_').replace(',', '')}.json"
        result = run_torchrun(LAB7_HANGS, [*RUNS[name], "--timeout-s", timeout, "--json", report], nproc=2, timeout_s=240)
        return result, read_json(report) if report.exists() else None

    with ThreadPoolExecutor(max_workers=LAUNCHES_AT_ONCE) as pool:
        futures = {name: pool.submit(launch, name) for name in RUNS}
        return {name: future.result() for name, future in futures.items()}


def rank_lines(result) -> dict[str, list[str]]:
    """{"0": [rank 0's lines], "1": [...]} from the "[rank r] ..." lines of stdout."""
    lines = {}
    for rank, text in re.findall(r"^\[rank (\d)\] (.*)$", result.stdout, flags=re.MULTILINE):
        lines.setdefault(rank, []).append(text)
    return lines


def assert_failed_in_time(result, report):
    """Non-zero exit by the script's own diagnosis (not the launcher's kill), within 2 x the timeout."""
    assert not result.timed_out and result.returncode != 0, result.describe()
    assert "[rank0]: Traceback" not in result.stderr and "[rank1]: Traceback" not in result.stderr, result.describe()
    assert report is not None and report["status"] == 1, result.describe()
    assert report["seconds_waited"] <= 2 * TIMEOUT_S, report


@pytest.mark.timeout(300)
def test_rank0_only_collective_is_named_by_detail_on_both_ranks(runs):
    result, report = runs["rank0-only"]
    assert_failed_in_time(result, report)
    lines = rank_lines(result)
    assert lines["0"] == ["stopped in the all-reduce only rank 0 calls: mismatch: Detected mismatch between collectives "
                          "(this rank ran ALLREDUCE [4]; they differ in op type, tensor shapes, tensor dtypes, tensor devices)"]
    assert lines["1"] == ["stopped in the end-of-step barrier: mismatch: Detected mismatch between collectives "
                          "(this rank ran BARRIER; they differ in op type)"]
    assert "tool=DETAIL" in result.stdout
    assert report["seconds_waited"] < TIMEOUT_S  # DETAIL stops at once: it does not wait for the timeout


@pytest.mark.timeout(300)
def test_shape_mismatch_is_named_with_detail_and_silently_wrong_without(runs):
    result, report = runs["shape-mismatch"]
    assert_failed_in_time(result, report)
    lines = rank_lines(result)
    assert lines["0"] == ["stopped in the all-reduce: mismatch: Detected mismatch between collectives "
                          "(this rank ran ALLREDUCE [4]; they differ in tensor shapes)"]
    assert lines["1"] == ["stopped in the all-reduce: mismatch: Detected mismatch between collectives "
                          "(this rank ran ALLREDUCE [3]; they differ in tensor shapes)"]

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
    assert "batches per rank: [2, 3] - uneven: DDP needs Join" in result.stdout
    lines = rank_lines(result)
    assert lines["0"][0].startswith("stopped in the end-of-epoch barrier, after its 2 steps: "), result.describe()
    assert lines["1"][0].startswith("stopped in the gradient all-reduce of step 3 (of 3): "), result.describe()
    # The first rank to give up reports the timeout; the other may see its connection close instead.
    kinds = {line.split(": ")[1] for line in (lines["0"][0], lines["1"][0])}
    assert "timeout" in kinds and kinds <= {"timeout", "peer gone"}, result.describe()


@pytest.mark.timeout(300)
def test_join_finishes_with_identical_weights_that_follow_the_join_rule(runs):
    result, report = runs["uneven-join"]
    assert result.ok, result.describe()
    assert report["status"] == 0 and report["seconds_waited"] is None
    assert ("finished: steps per rank [2, 3]; identical weights on every rank: True; "
            "equal to the Join rule computed in one process: True") in result.stdout


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
    assert err == ["lab7_hangs.py: error: every scenario needs at least 2 ranks: "
                   "torchrun --standalone --nproc_per_node=2 labs/lab7_hangs.py ..."]
    # The NCCL path is written but not run here (no GPU): asking for it says so in one line.
    monkeypatch.setattr(lab.torch.cuda, "device_count", lambda: 0)
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert lab.main(lab.parse_args(["--scenario", "uneven", "--backend", "nccl"])) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lab7_hangs.py: error: --backend nccl needs CUDA GPUs"), err
