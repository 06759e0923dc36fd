"""labs/lab2_join.py: DDP on uneven inputs hangs until the timeout without Join, and finishes with it.

The three runs under torchrun (--join on 2 and 3 ranks, the hang demo without Join) are rows of the 2
rows launches that this file shares with tests/test_lab2_sampler.py (tests/scripts/lab2_launches.py):
each row has its own argv, process group, output files and expected exit status, and its
collectives' devices are checked on the way. The hang demo is the last row of the 2-rank launch.
3 launches of their own took 19-22 s (side by side, 2026-11-25, 2 cores), most of it start-up.

In that row rank 1 starts LATE_START_S after rank 0, to show that a slow start is not taken for the
hang: two tests read the one run. The hang with both ranks starting together is the lab 2 sheet's own
run (labs/lab2_sampler.ipynb, section 6), which nbval compares: its exit status and each rank's line.
"""

import json
import math
import re

import pytest

from ddp_course.launch import REPO_ROOT, import_script

LAB2_JOIN = REPO_ROOT / "labs" / "lab2_join.py"
TRAIN_DIGITS = 1438
# The plan of the runs both lab-2 test files share (the launches themselves: conftest's lab2_launches).
lab2_plan = import_script(REPO_ROOT / "tests" / "scripts" / "lab2_launches.py", "lab2_launches")


# (ranks, steps each rank runs) of the runs with --join; the 2-rank run is the hang demo's, fixed.
JOIN_RUNS = [(2, [15, 30]), (3, [8, 15, 23])]
assert [nproc for nproc, _ in JOIN_RUNS] == lab2_plan.JOIN_RANKS

# The hang demo's rank 1 starts this long after rank 0: twice the demo's 3 s timeout.
LATE_START_S = lab2_plan.LATE_START_S


def load_module():
    return import_script(LAB2_JOIN)


@pytest.fixture(scope="module")
def lab2_row(lab2_launches):
    """lab2_row(key) -> the RowRun of one run: ("no join",) is the hang demo, ("join", ranks) the others.

    The first call starts the shared launches; a test waits for its own row's launch, and a failed
    row fails its test (and the rows after it in its launch theirs). No relaunch."""
    return lab2_launches.row


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
    for fact in ("CPU runs ahead", "watchdog", "TORCH_NCCL_BLOCKING_WAIT=1", "TORCH_FR_BUFFER_SIZE"):
        assert fact in lab2_join.NCCL_NOTE


@pytest.mark.timeout(300)  # the launched tests may wait for their whole launch
def test_without_join_every_rank_says_where_it_stopped(lab2_row):
    run = lab2_row(("no join",))
    report = run.folder / "r.json"
    assert run.expected_status == 1 and run.ended_as_expected(), run.describe()  # exit status 1 on every rank
    assert run.made_collective_calls(ranks=[0]), run.describe()  # its barrier; rank 1 waits in DDP's C++ all-reduce, unseen
    stdout = run.stdout(0) + run.stdout(1)  # each rank's lines are in its own file
    assert_each_rank_stopped_where_the_demo_hangs(stdout, run.describe())
    assert not run.a_rank_printed_a_traceback(), run.describe()
    assert not report.exists()
    assert "backend=nccl" not in stdout  # the NCCL note is printed on NCCL only


def assert_each_rank_stopped_where_the_demo_hangs(stdout: str, describe: str) -> None:
    """Both ranks of the hang demo (2 ranks, --timeout-s 3) said where they stopped, and why."""
    stopped = dict(re.findall(r"^\[rank (\d)\] stopped (.*)$", stdout, flags=re.MULTILINE))
    assert stopped.keys() == {"0", "1"}, describe
    # The job ended by its own 3 s timeout, not a hang: a fact in the output rather than a wall-clock
    # bound that a loaded machine can break. One rank reports the timeout; the other may report it
    # too or see its peer close the connection.
    assert any("Timed out waiting 3000ms" in reason for reason in stopped.values()), describe
    # Rank 0 has 15 batches and waits at the barrier; rank 1 waits in the all-reduce of its step 16.
    assert stopped["0"].startswith("at the end-of-epoch barrier (of 15 batches)"), describe
    assert stopped["1"].startswith("in the gradient all-reduce of step 16 (of 30 batches)"), describe


@pytest.mark.timeout(300)
def test_a_rank_that_starts_late_still_stops_at_the_hang(lab2_row):
    """Rank 1 starts the hang demo's row 6 s after rank 0, longer than the 3 s timeout: each rank still
    stops where the demo hangs. When the 3 s bounded every wait, joining the group included, rank 0
    failed at start-up instead ("could not join the gloo process group: DistStoreError: wait timeout
    after 3000ms"), with no "stopped" line: the lab 2 sheet once stored that. Now only training_group
    has the 3 s. The run is the one test_without_join_every_rank_says_where_it_stopped reads."""
    run = lab2_row(("no join",))
    late = f"late start: rank 1 sleeps {LATE_START_S} s before row {lab2_plan.row_name(run.key)}"
    assert late in run.launch.stderr, run.describe()  # the late start happened
    assert run.expected_status == 1 and run.ended_as_expected(), run.describe()  # status 1, not our limit's kill
    assert_each_rank_stopped_where_the_demo_hangs(run.stdout(0) + run.stdout(1), run.describe())
    assert "could not join" not in run.job_stderr(), run.describe()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("nproc", "expected_steps"), JOIN_RUNS)
def test_join_lets_uneven_ranks_finish_with_identical_weights(lab2_row, read_json, nproc, expected_steps):
    run = lab2_row(("join", nproc))
    assert run.ended_as_expected() and run.made_collective_calls(), run.describe()  # status 0, devices checked
    report = read_json(run.folder / "r.json")
    assert report["join"] is True and report["world_size"] == nproc
    assert report["steps_per_rank"] == expected_steps
    assert report["same_weights_on_every_rank"] is True
    assert report["eval_accuracy"] > 0.6  # it trained: a fresh DigitsCNN scores about 10%


# --- the lab 2 sheet's self-check (labs/lab2_sampler.ipynb, about section 6's Join run) -----------


@pytest.mark.timeout(30)
def test_self_check_counts_the_steps_whose_all_reduce_the_joined_rank_shadows():
    from ddp_course.lab_self_checks import LAB2_SELF_CHECK
    from ddp_course.self_check import verdict

    lab2_join = load_module()
    batch_size = lab2_join.parse_args([]).batch_size
    # Independently: each rank's batches from the script's split; with Join every rank takes part in the
    # gradient all-reduce of every step the longest rank runs (its own, then zeros).
    batches = [math.ceil(len(lab2_join.uneven_slice(TRAIN_DIGITS, rank, 2)) / batch_size) for rank in range(2)]
    assert batches == [15, 30]
    assert max(batches) == LAB2_SELF_CHECK.expected
    # The sheet's own stored run of section 6 printed the same steps, and the hang demo's rank 1 waited at step 16.
    sheet = REPO_ROOT / "labs" / "lab2_sampler.ipynb"
    outputs = ["".join(output.get("text", "")) for cell in json.loads(sheet.read_text())["cells"] for output in cell.get("outputs", [])]
    [steps] = [re.search(r"steps per rank: \[(\d+), (\d+)\]", text).groups() for text in outputs if "steps per rank:" in text]
    assert [int(step) for step in steps] == batches
    assert any(f"[rank 1] stopped in the gradient all-reduce of step {batches[0] + 1}" in text for text in outputs)
    assert verdict(LAB2_SELF_CHECK, 30).startswith("self-check: correct")
    # The classic mistakes: only rank 0's own batches, and both ranks' steps added up.
    for wrong in (batches[0], sum(batches)):
        assert verdict(LAB2_SELF_CHECK, wrong) == f"self-check: not yet - {LAB2_SELF_CHECK.hint}"
