"""labs/lab2_sampler.py launched as a learner launches it (torchrun, gloo ranks on the CPU), and its checks.

Every launch of the file starts in one module fixture, `jobs`, 3 at a time (the pattern of
tests/test_lab4_checker.py): a job spends part of its time waiting (torchrun's agent, gloo's
rendezvous, one rank for the other), and meanwhile the 2 cores run the others. One after another,
the 8 launches took 48 s on a quiet machine; 3 at a time, 32 to 37 s.
"""

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.utils.data import DistributedSampler

from ddp_course.data import load_digits
from ddp_course.launch import REPO_ROOT, import_script, run_torchrun
from ddp_course.models import DigitsCNN

LAB2 = REPO_ROOT / "labs" / "lab2_sampler.py"
CHECKS = ["split", "disjoint", "coverage", "drop_last", "set_epoch", "same seed", "exact metric"]


# The runs that pass: (world size, held-out digits scored). The planted bugs: (bug, checks it must fail).
GOOD_RUNS = [(2, 359), (3, 31)]
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


def run_lab2(*args, nproc=2, timeout_s=120):
    return run_torchrun(LAB2, args, nproc=nproc, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every launch of this file, started at once and run 3 at a time: {key: (Future of RunResult, folder)}.

    A test waits for its own job's result, so a failed job fails only its test; the job's --json
    report and saved model are in its folder. The longest jobs (training, 3 ranks) go first. No
    relaunch of a failed job, here or by pytest.
    """
    # At most 3 jobs (7 processes) at a time: each keeps about 2x headroom under its 120 s limit.
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {}

        def submit(key, args, nproc=2):
            folder = tmp_path_factory.mktemp("-".join(map(str, key)))
            args = [str(folder / arg) if arg in ("lab2.json", "model.pt") else arg for arg in args]
            futures[key] = (pool.submit(run_lab2, *args, nproc=nproc), folder)

        for nproc, eval_size in GOOD_RUNS:
            args = ["--dataset-size", "11", "--eval-size", eval_size, "--json", "lab2.json", "--save-model", "model.pt"]
            submit(("good", nproc), args, nproc=nproc)
        for bug, _ in BUG_RUNS:
            submit(("bug", bug), ["--bug", bug, "--json", "lab2.json"])
        for flags, _ in BAD_FLAG_RUNS:
            submit(("flags", *flags), flags)
        yield futures  # leaving the block waits for every job, also when a test failed


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


@pytest.mark.timeout(300)  # this and the launched tests below may wait for the jobs queued before theirs
@pytest.mark.parametrize(("nproc", "eval_size"), GOOD_RUNS)
def test_all_checks_pass_and_the_exact_metric_equals_one_process(jobs, nproc, eval_size):
    future, folder = jobs[("good", nproc)]
    result = future.result()
    report_file, weights = folder / "lab2.json", folder / "model.pt"
    assert result.ok, result.describe()
    assert status_lines(result.stdout) == [("PASS", name) for name in CHECKS], result.describe()
    assert "all 7 checks passed" in result.stdout

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
def test_each_planted_bug_fails_its_checks(jobs, bug, failing):
    """Negative controls: the checks can fail, and each bug fails exactly the checks it should."""
    future, folder = jobs[("bug", bug)]
    result = future.result()
    report_file = folder / "lab2.json"
    assert not result.timed_out and result.returncode == 1, result.describe()
    assert {name for status, name in status_lines(result.stdout) if status == "FAIL"} == failing, result.describe()
    assert f"{len(failing)} of 7 checks FAILED" in result.stdout
    assert {name for name, passed in json.loads(report_file.read_text())["checks"].items() if not passed} == failing
    assert "[rank0]: Traceback" not in result.stderr and 'lab2_sampler.py", line' not in result.stderr, result.describe()


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
def test_bad_flags_under_torchrun_print_one_line_for_the_job(jobs, args, expected):
    result = jobs[("flags", *args)][0].result()
    assert not result.timed_out and result.returncode != 0, result.describe()
    errors = [line for line in result.stderr.splitlines() if line.startswith("lab2_sampler.py: error:")]
    assert len(errors) == 1 and re.search(expected, errors[0]), result.describe()
    assert "[rank0]: Traceback" not in result.stderr and 'lab2_sampler.py", line' not in result.stderr, result.describe()
