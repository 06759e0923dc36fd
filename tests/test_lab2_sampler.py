"""labs/lab2_sampler.py launched as a learner launches it (torchrun, gloo ranks on the CPU), and its checks.

Of the 8 runs under torchrun (2 good runs, 4 planted bugs, 2 bad flags), 7 are rows of the 2 launches
that this file shares with tests/test_lab2_join.py, and the bad flag --epochs 1 has a launch of its
own (tests/scripts/lab2_launches.py says how and why): each row has its own argv, process group,
output files and expected exit status, and its collectives' devices are checked on the way. 8
launches of their own took 32 to 37 s (3 at a time) on 2 cores, most of it torchrun's and torch's
start-up, 8 times over.
"""

import json
import math
import re

import pytest
import torch
from torch.utils.data import DistributedSampler

from ddp_course.data import load_digits
from ddp_course.launch import REPO_ROOT, import_script
from ddp_course.models import DigitsCNN

LAB2 = REPO_ROOT / "labs" / "lab2_sampler.py"
CHECKS = ["split", "disjoint", "coverage", "drop_last", "set_epoch", "same seed", "exact metric"]
# The plan of the runs both lab-2 test files share (the launches themselves: conftest's lab2_launches).
lab2_plan = import_script(REPO_ROOT / "tests" / "scripts" / "lab2_launches.py", "lab2_launches")


# The runs that pass: (world size, held-out digits scored). The planted bugs: (bug, checks it must fail).
GOOD_RUNS = lab2_plan.SAMPLER_GOOD_RUNS  # [(2, 359), (3, 31)]
ALL_BUT_SAME_SEED = {"split", "disjoint", "coverage", "drop_last", "set_epoch", "exact metric"}
BUG_RUNS = [
    ("same-rank", ALL_BUT_SAME_SEED),
    ("wrong-world-size", ALL_BUT_SAME_SEED),
    ("no-set-epoch", {"set_epoch"}),
    ("padded-eval", {"exact metric"}),
]
# Bad flags under torchrun: (flags, the one error line's text).
BAD_FLAG_RUNS = [
    (["--epochs", "1"], r"--epochs must be 2 or more"),  # argparse, on every rank
    (["--eval-size", "400"], r"--eval-size must be at most 359"),  # after the set-up, on every rank
]
assert [bug for bug, _ in BUG_RUNS] == lab2_plan.SAMPLER_BUGS
assert sorted(flags for flags, _ in BAD_FLAG_RUNS) == sorted(lab2_plan.SAMPLER_BAD_FLAGS)


@pytest.fixture(scope="module")
def lab2_row(lab2_launches):
    """lab2_row(key) -> the RowRun of one run (keys as in lab2_plan.planned_runs), waiting for its launch.

    The first call starts the shared launches. A failed row fails its test, and the rows after it in
    its launch (never run) fail theirs. No relaunch, here or by pytest."""
    return lab2_launches.row


def load_lab2_module():
    """The lab script as a module, to test its check functions in this process (no torchrun)."""
    return import_script(LAB2)


def torch_shards(n, world_size, seed, epoch, drop_last=False):
    """What torch's own DistributedSampler gives each rank, built here with explicit num_replicas and rank."""
    shards = []
    for rank in range(world_size):
        sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
    return shards


def single_process_correct(weights_path, eval_size):
    """Per-sample correctness of the saved model on the first eval_size held-out digits, in one process."""
    model = DigitsCNN()
    model.load_state_dict(torch.load(weights_path, weights_only=True))
    images, labels = load_digits().test[:eval_size]
    with torch.no_grad():
        return (model.eval()(images).argmax(dim=1) == labels).tolist()


def status_lines(stdout):
    return re.findall(r"^(PASS|FAIL) (.+?):", stdout, flags=re.MULTILINE)


def no_traceback(run):
    """No rank printed a Python traceback (a user mistake or a planted bug ends in the lab's own lines only)."""
    return not run.a_rank_printed_a_traceback() and 'lab2_sampler.py", line' not in run.job_stderr()


@pytest.mark.timeout(300)  # this and the launched tests below may wait for their whole launch
@pytest.mark.parametrize(("nproc", "eval_size"), GOOD_RUNS)
def test_all_checks_pass_and_the_exact_metric_equals_one_process(lab2_row, nproc, eval_size):
    run = lab2_row(("good", nproc))
    report_file, weights = run.folder / "lab2.json", run.folder / "model.pt"
    assert run.ended_as_expected() and run.made_collective_calls(), run.describe()  # status 0, devices checked
    assert status_lines(run.stdout()) == [("PASS", name) for name in CHECKS], run.describe()
    assert "all 7 checks passed" in run.stdout()
    assert not any(status_lines(run.stdout(rank)) for rank in range(1, nproc))  # rank 0 speaks for the job

    report = json.loads(report_file.read_text())
    assert (report["world_size"], report["backend"], report["dataset_size"], report["epochs"]) == (nproc, "gloo", 11, 3)
    assert report["checks"] == {name: True for name in CHECKS}
    # The gathered shards are exactly what torch's sampler hands each rank (11 samples, seed 0).
    assert report["shards"] == [torch_shards(11, nproc, 0, epoch) for epoch in range(3)]
    assert report["drop_last_shards"] == [torch_shards(11, nproc, 0, epoch, drop_last=True) for epoch in range(3)]
    assert all(len(shard) == math.ceil(11 / nproc) for epoch in report["shards"] for shard in epoch)
    assert all(len(shard) == 11 // nproc for epoch in report["drop_last_shards"] for shard in epoch)

    # Evaluation: the sampler pads n held-out digits to a multiple of the world size with the
    # first ones (shuffle=False), so those are scored twice; the exact count scores each once.
    ev = report["eval"]
    duplicates = nproc * math.ceil(eval_size / nproc) - eval_size  # 1 for (2, 359), 2 for (3, 31)
    correct = single_process_correct(weights, eval_size)
    assert (ev["exact_correct"], ev["exact_total"]) == (sum(correct), eval_size)
    assert (ev["single_process_correct"], ev["single_process_total"]) == (sum(correct), eval_size)
    assert ev["duplicates"] == duplicates and ev["padding_samples"] == list(range(duplicates))
    assert (ev["padded_correct"], ev["padded_total"]) == (sum(correct) + sum(correct[:duplicates]), eval_size + duplicates)
    assert ev["skew"] == pytest.approx(ev["padded_accuracy"] - ev["exact_accuracy"])
    assert abs(ev["skew"]) <= ev["max_skew"] + 1e-12
    # The briefly trained model makes mistakes (otherwise duplicates could never change the accuracy) ...
    assert 0.3 < ev["exact_accuracy"] < 0.95
    # ... and the per-rank counts are disjoint slices that add up to the whole held-out subset.
    assert sorted(r["rank"] for r in ev["per_rank"]) == list(range(nproc))
    assert sum(r["exact"][1] for r in ev["per_rank"]) == eval_size


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("bug", "failing"), BUG_RUNS)
def test_each_planted_bug_fails_its_checks(lab2_row, bug, failing):
    """Negative controls: the checks can fail, and each bug fails exactly the checks it should."""
    run = lab2_row(("bug", bug))
    report_file = run.folder / "lab2.json"
    assert run.expected_status == 1 and run.ended_as_expected(), run.describe()  # exit status 1 on every rank
    assert {name for status, name in status_lines(run.stdout()) if status == "FAIL"} == failing, run.describe()
    assert f"{len(failing)} of 7 checks FAILED" in run.stdout()
    assert {name for name, passed in json.loads(report_file.read_text())["checks"].items() if not passed} == failing
    assert no_traceback(run), run.describe()


@pytest.mark.timeout(60)
def test_checks_accept_torch_shards_and_reject_broken_ones():
    """In-process: the lab's checks pass on torch's real shards for many sizes, and catch a broken shard."""
    lab2 = load_lab2_module()
    args = lab2.parse_args(["--seed", "3"])
    for n in (1, 2, 5, 11, 12, 31):
        for world_size in (1, 2, 3, 4, 7):
            padded = [torch_shards(n, world_size, 3, epoch) for epoch in range(3)]
            dropped = [torch_shards(n, world_size, 3, epoch, drop_last=True) for epoch in range(3)]
            checks = lab2.check_shards(padded, dropped, padded, n, args)
            assert all(passed for _, passed, _ in checks), (n, world_size, checks)
            # The rebuilt global order is the seeded permutation padded with its own head.
            assert lab2.interleave(padded[0]) == lab2.pad_to_multiple(lab2.seeded_permutation(n, 3, 0), world_size)

    padded = [torch_shards(11, 2, 3, epoch) for epoch in range(3)]
    dropped = [torch_shards(11, 2, 3, epoch, drop_last=True) for epoch in range(3)]
    broken = [[shards[0], shards[0]] for shards in padded]  # rank 1 reads rank 0's shard
    verdict = {name: passed for name, passed, _ in lab2.check_shards(broken, dropped, broken, 11, args)}
    assert not verdict["disjoint"] and not verdict["coverage"] and not verdict["split"]
    stale = [padded[0]] * 3  # every epoch repeats epoch 0's order: set_epoch was never called
    verdict = {name: passed for name, passed, _ in lab2.check_shards(stale, dropped, stale, 11, args)}
    assert not verdict["set_epoch"] and verdict["disjoint"] and verdict["coverage"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--dataset-size", "0"], r"--dataset-size: must be a positive integer"),
        (["--epochs", "1"], r"--epochs must be 2 or more"),
        (["--bug", "typo"], r"argument --bug: invalid choice: 'typo'"),
        (["--timeout-s", "-1"], r"--timeout-s: must be a positive number"),
    ],
)
def test_bad_flags_fail_with_one_line(args, expected, refused_flag_line):
    """The launch below proves that under torchrun the line is printed once for the job."""
    assert re.search(expected, refused_flag_line(load_lab2_module(), args))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("args", "expected"), BAD_FLAG_RUNS)
def test_bad_flags_under_torchrun_print_one_line_for_the_job(lab2_row, args, expected):
    run = lab2_row(("flags", *args))
    assert run.expected_status != 0 and run.ended_as_expected(), run.describe()  # a non-zero status (every rank's, in a row)
    errors = [line for line in run.job_stderr().splitlines() if line.startswith("lab2_sampler.py: error:")]
    assert len(errors) == 1 and re.search(expected, errors[0]), run.describe()
    assert no_traceback(run), run.describe()
