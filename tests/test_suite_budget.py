"""benchmarks/suite_budget.py: the suite's seconds in runs of the main job timed alongside (README, "Tests")."""

import pytest

from ddp_course.launch import REPO_ROOT, import_script

budget = import_script(REPO_ROOT / "benchmarks" / "suite_budget.py")


def test_the_ratio_divides_by_the_median_main_job():
    assert budget.report(900, [9.0, 10.0, 30.0]) == ("suite 900 s = 90 runs of the main job (median 10.0 s of 9.0, 10.0, 30.0): within the budget of 90 runs")


def test_a_suite_over_90_runs_is_reported_over():
    assert "= 151 runs" in budget.report(1192, [7.9]) and "OVER the budget of 90 runs" in budget.report(1192, [7.9])


def test_the_log_collects_timings_from_before_and_after_the_suite(tmp_path, capsys):
    log = tmp_path / "main_job.txt"
    log.write_text("8.000\n9.000\n")
    with log.open("a") as more:
        more.write("10.000\n")
    assert budget.main(["report", "--suite-seconds", "810", "--log", str(log)]) == 0
    assert "= 90 runs of the main job (median 9.0 s of 8.0, 9.0, 10.0)" in capsys.readouterr().out


@pytest.mark.parametrize("suite_seconds", ["100", "0"])
def test_no_timings_or_no_suite_time_is_one_line_and_exit_2(tmp_path, capsys, suite_seconds):
    log = tmp_path / "main_job.txt"
    if suite_seconds == "0":
        log.write_text("9.0\n")
    assert budget.main(["report", "--suite-seconds", suite_seconds, "--log", str(log)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
