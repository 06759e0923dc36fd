"""CIFAR-10 preparation is collective (review finding 4): same collectives on every rank whatever each
finds on disk, one download per job, and one shared verdict - tested with a fake disk and download."""

import pytest

from ddp_course.launch import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests" / "scripts" / "cifar10_prepare.py"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """One 2-rank job runs all three scenarios (see the script's docstring)."""
    workdir = tmp_path_factory.mktemp("cifar10")
    # 15 s bounds every wait; the old code (a barrier only some ranks reach) ran into it.
    result = run_torchrun(SCRIPT, ["--workdir", workdir, "--timeout-s", "15"], nproc=2, timeout_s=90)
    assert result.ok, result.describe()
    outcomes = {}
    for line in result.stdout.splitlines():
        if line.startswith("[rank "):
            rank_part, rest = line.split("] ", 1)
            scenario, outcome = rest.split(": ", 1)
            outcomes[(scenario, int(rank_part.removeprefix("[rank ")))] = outcome
    downloads = (workdir / "downloads.log").read_text().splitlines()
    return outcomes, downloads, result


def test_a_rank_that_has_the_data_waits_for_the_one_that_does_not(prepared):
    outcomes, downloads, result = prepared
    assert outcomes[("one-has-it", 0)] == outcomes[("one-has-it", 1)] == "ok", result.describe()
    assert [line for line in downloads if line.startswith("one-has-it")] == ["one-has-it rank 0"]


def test_a_failed_download_is_tried_once_and_fails_every_rank_alike(prepared):
    outcomes, downloads, result = prepared
    first, second = outcomes[("offline", 0)], outcomes[("offline", 1)]
    assert first == second, result.describe()
    assert first.startswith("CourseError: CIFAR-10 is not in") and "Temporary failure in name resolution" in first
    assert [line for line in downloads if line.startswith("offline")] == ["offline rank 0"]


def test_node_local_data_dir_fails_every_rank_with_one_clear_line(prepared):
    outcomes, downloads, result = prepared
    first, second = outcomes[("node-local", 0)], outcomes[("node-local", 1)]
    assert first == second, result.describe()
    assert "ranks [1] do not see it" in first and "node-local" in first
    assert [line for line in downloads if line.startswith("node-local")] == ["node-local rank 0"]
