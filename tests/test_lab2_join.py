"""labs/lab2_join.py: DDP on uneven inputs hangs until the timeout without Join, and finishes with it.

The three launches start together in one module fixture, `jobs`: the hang demo spends most of its
time waiting for its own 3 s timeout, and the 2 cores run the Join jobs meanwhile. The file took
22-25 s with the launches one after another, 19-22 s so (2026-11-25, 2 cores).
"""

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from ddp_course.launch import REPO_ROOT, import_script, run_torchrun

LAB2_JOIN = REPO_ROOT / "labs" / "lab2_join.py"
TRAIN_DIGITS = 1438


# (ranks, steps each rank runs) of the jobs with --join; the 2-rank job is the hang demo's, fixed.
JOIN_RUNS = [(2, [15, 30]), (3, [8, 15, 23])]


def load_module():
    return import_script(LAB2_JOIN)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """{key: (Future of RunResult, path of its --json report)}: the hang demo ("no join") and the JOIN_RUNS.

    A test waits for its own job's result, so a failed job fails only its test. No relaunch.
    """
    with ThreadPoolExecutor(max_workers=len(JOIN_RUNS) + 1, thread_name_prefix="lab2_join") as pool:  # all at once
        futures = {}

        def submit(key, flags, nproc):
            report = tmp_path_factory.mktemp("-".join(map(str, key))) / "r.json"
            future = pool.submit(run_torchrun, LAB2_JOIN, [*flags, "--json", report], nproc=nproc)
            futures[key] = (future, report)

        for nproc, _ in JOIN_RUNS:
            submit(("join", nproc), ["--join", "--timeout-s", "30"], nproc)
        submit(("no join",), ["--timeout-s", "3"], 2)
        yield futures  # leaving the block waits for every job, also when a test failed


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_uneven_slices_cover_the_data_once_and_grow_with_the_rank(world_size):
    slices = [load_module().uneven_slice(TRAIN_DIGITS, rank, world_size) for rank in range(world_size)]
    assert [i for part in slices for i in part] == list(range(TRAIN_DIGITS))
    assert all(len(a) < len(b) for a, b in zip(slices, slices[1:]))


@pytest.mark.timeout(30)
def test_the_hang_demo_runs_on_gloo_unless_nccl_is_asked_for():
    """The 'stopped ...' report needs gloo's synchronous errors, so gloo is the default (review finding 3)."""
    lab2_join = load_module()
    assert lab2_join.parse_args([]).backend == "gloo"
    assert lab2_join.parse_args(["--backend", "nccl"]).backend == "nccl"  # still possible, with a note
    for fact in ("CPU runs ahead", "watchdog", "TORCH_NCCL_BLOCKING_WAIT=1", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        assert fact in lab2_join.NCCL_NOTE


@pytest.mark.timeout(120)
def test_without_join_every_rank_says_where_it_stopped(jobs):
    future, report = jobs[("no join",)]
    result = future.result()
    assert not result.timed_out and result.returncode != 0, result.describe()
    stopped = dict(re.findall(r"^\[rank (\d)\] stopped (.*)$", result.stdout, flags=re.MULTILINE))
    assert stopped.keys() == {"0", "1"}, result.describe()
    # The job ended by its own 3 s timeout, not a hang: a fact in the output rather than a wall-clock
    # bound that a loaded machine can break. One rank reports the timeout; the other may report it
    # too or see its peer close the connection.
    assert any("Timed out waiting 3000ms" in reason for reason in stopped.values()), result.describe()
    # Rank 0 has 15 batches and waits at the barrier; rank 1 waits in the all-reduce of its step 16.
    assert stopped["0"].startswith("at the end-of-epoch barrier (of 15 batches)"), result.describe()
    assert stopped["1"].startswith("in the gradient all-reduce of step 16 (of 30 batches)"), result.describe()
    assert "[rank0]: Traceback" not in result.stderr and "[rank1]: Traceback" not in result.stderr, result.describe()
    assert not report.exists()
    assert "backend=nccl" not in result.stdout  # the NCCL note is printed on NCCL only


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("nproc", "expected_steps"), JOIN_RUNS)
def test_join_lets_uneven_ranks_finish_with_identical_weights(jobs, read_json, nproc, expected_steps):
    future, report_file = jobs[("join", nproc)]
    result = future.result()
    assert result.ok, result.describe()
    report = read_json(report_file)
    assert report["join"] is True and report["world_size"] == nproc
    assert report["steps_per_rank"] == expected_steps
    assert report["same_weights_on_every_rank"] is True
    assert report["eval_accuracy"] > 0.6  # it trained: a fresh DigitsCNN scores about 10%
