"""ddp_course.launch.SheetJobs and verdict_lines: the lab sheets' one-line job orchestration (issue 31).

In-process: run_torchrun is replaced by a fake that records its calls and sleeps, so these tests
launch nothing (the sheets' own nbval runs launch the real jobs through the same code).
"""

import json
import tempfile
import threading
import time
from pathlib import Path

import pytest

from ddp_course import launch
from ddp_course.launch import RunResult, SheetJobs, verdict_lines


class FakeTorchrun:
    """Stands in for run_torchrun: records (script, args, nproc, timeout_s, use_gpus) and how many ran at once."""

    def __init__(self, seconds=0.05):
        self.calls, self.running, self.most_at_once, self.seconds = [], 0, 0, seconds
        self.lock = threading.Lock()

    def __call__(self, script, args=(), nproc=2, timeout_s=120, use_gpus=False, **_):
        with self.lock:
            self.calls.append((str(script), list(args), nproc, timeout_s, use_gpus))
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        time.sleep(self.seconds)
        with self.lock:
            self.running -= 1
        return RunResult([str(script), *args], 0, f"ran {script}", "", self.seconds, False)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the sheets' folders land in pytest's, removed after
    fake = FakeTorchrun()
    monkeypatch.setattr(launch, "run_torchrun", fake)
    return fake


@pytest.mark.timeout(30)
def test_jobs_get_a_fresh_folder_string_arguments_and_the_sheets_settings(fake):
    jobs = SheetJobs("test_sheet_", nproc=2, use_gpus=False, timeout_s=99)
    assert jobs.out.parent == Path(tempfile.gettempdir())
    assert jobs.out.is_dir() and jobs.out.name.startswith("test_sheet_") and not any(jobs.out.iterdir())
    result = jobs.start("labs/lab2_sampler.py", "--eval-size", 31, "--json", jobs.out / "three.json", nproc=3).result()
    assert result.ok and result.stdout == "ran labs/lab2_sampler.py"
    assert fake.calls == [("labs/lab2_sampler.py", ["--eval-size", "31", "--json", str(jobs.out / "three.json")], 3, 99, False)]
    jobs.run("labs/lab2_join.py")  # nproc defaults to the sheet's
    assert fake.calls[-1][2] == 2
    assert SheetJobs("test_sheet_").out != jobs.out  # every sheet run writes into a folder of its own


@pytest.mark.timeout(30)
def test_no_more_than_at_once_jobs_run_together_and_all_finish(fake):
    jobs = SheetJobs("test_sheet_", at_once=2)
    futures = [jobs.start("labs/lab2_sampler.py", "--seed", seed) for seed in range(5)]
    assert all(future.result().ok for future in futures)
    assert len(fake.calls) == 5 and fake.most_at_once == 2


@pytest.mark.timeout(30)
def test_read_json_reads_what_a_job_wrote_into_the_folder(fake):
    jobs = SheetJobs("test_sheet_")
    (jobs.out / "report.json").write_text(json.dumps({"checks": {"split": True}}))
    assert jobs.read_json("report.json") == {"checks": {"split": True}}


def test_verdict_lines_keep_the_verdicts_in_order_and_leave_out_what_is_asked():
    stdout = "config: world_size=2\nPASS  broadcast  ok\nnoise\nFAIL  reduce  wrong on rank(s) 0\nSKIP  all_reduce_avg_op  old torch\n"
    assert verdict_lines(stdout) == ["PASS  broadcast  ok", "FAIL  reduce  wrong on rank(s) 0", "SKIP  all_reduce_avg_op  old torch"]
    assert verdict_lines(stdout, leave_out=("avg_op",)) == ["PASS  broadcast  ok", "FAIL  reduce  wrong on rank(s) 0"]
    assert verdict_lines("all 7 checks passed\n") == []


@pytest.mark.timeout(60)
def test_a_command_that_is_not_torchrun_joins_the_same_queue_with_the_same_timeout(monkeypatch, tmp_path):
    """Lab 5's sweep driver launches torchrun itself: the sheet starts it as a plain command, one at a time."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    commands = []

    def fake_run_command(command, timeout_s=120, use_gpus=False, **_):
        commands.append((command, timeout_s, use_gpus))
        return RunResult(command, 0, "swept", "", 0.0, False)

    monkeypatch.setattr(launch, "run_command", fake_run_command)
    jobs = SheetJobs("sheet_", timeout_s=600, at_once=1)
    result = jobs.start_command("python", Path("labs/lab5_scaling.py"), "--sweep", 1).result(timeout=10)
    assert result.stdout == "swept"
    assert commands == [(["python", "labs/lab5_scaling.py", "--sweep", "1"], 600, False)]


@pytest.mark.timeout(30)
def test_a_job_after_another_starts_only_once_that_one_ended_and_takes_its_own_options(monkeypatch, tmp_path):
    """Lab 7's one-rank resume reads the two-rank job's checkpoint: `after=` holds it back, though a thread is free."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    events, lock = [], threading.Lock()

    def fake_run_torchrun(script, args=(), nproc=2, timeout_s=120, use_gpus=False, **options):
        with lock:
            events.append(("start", script, nproc, options))
        time.sleep(0.2 if script == "first.py" else 0.01)
        with lock:
            events.append(("end", script, nproc, options))
        return RunResult([script], 0, "", "", 0.0, False)

    monkeypatch.setattr(launch, "run_torchrun", fake_run_torchrun)
    jobs = SheetJobs("sheet_", at_once=2)
    first = jobs.start("first.py")
    resumed = jobs.start("resume.py", nproc=1, after=first, env={"X": "1"}, torchrun_args=["--max-restarts=1"])
    resumed.result(timeout=10)
    order = [(kind, script) for kind, script, _, _ in events]
    assert order.index(("end", "first.py")) < order.index(("start", "resume.py"))  # a free thread, yet it waited
    _, _, nproc, options = next(event for event in events if event[:2] == ("start", "resume.py"))
    assert nproc == 1 and options == {"env": {"X": "1"}, "torchrun_args": ["--max-restarts=1"]}
