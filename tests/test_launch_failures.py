"""A job launched from a notebook that fails explains itself: show_failures prints its stderr's last lines.

Every sheet and lecture prints a job's exit status and then calls show_failures(job): a job that ends as
expected adds nothing to the cell's output (so stored outputs stay the same), one that does not shows why.
"""

from ddp_course.launch import RunResult, show_failures


def job(returncode, stderr="", timed_out=False):
    return RunResult(["torchrun", "lab.py"], returncode, "epoch 1/1 ...\n", stderr, 1.0, timed_out)


def test_a_job_that_ends_as_expected_prints_nothing(capsys):
    show_failures(job(0, "a warning\n"))
    show_failures(job(1, "lab.py: error: planted\n"), expected=1)
    assert capsys.readouterr().out == ""


def test_a_failed_job_prints_the_last_lines_of_its_stderr(capsys):
    stderr = "".join(f"line {n}\n" for n in range(30)) + "terminate called without an active exception\n"
    show_failures(job(0), job(1, stderr), lines=3)
    assert capsys.readouterr().out.splitlines() == [
        "--- exit status 1 (expected 0); the last lines of its stderr:",
        "line 28",
        "line 29",
        "terminate called without an active exception",
    ]


def test_a_timeout_and_an_unexpected_success_are_failures_too(capsys):
    show_failures(job(None, timed_out=True), job(0), expected=1)
    assert capsys.readouterr().out.splitlines() == [
        "--- timed out (expected 1); the last lines of its stderr:",
        "(nothing on stderr)",
        "--- exit status 0 (expected 1); the last lines of its stderr:",
        "(nothing on stderr)",
    ]
