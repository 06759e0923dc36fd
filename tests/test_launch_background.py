"""The sheets' one-line job starters (ddp_course.launch): a command in the background, torchrun jobs in turn."""

import sys
import threading
import time

import pytest

from ddp_course import launch


@pytest.mark.timeout(60)
def test_a_command_in_the_background_returns_at_once_and_its_result_later():
    started = time.perf_counter()
    future = launch.start_command_in_background([sys.executable, "-c", "import time; time.sleep(0.5); print('done')"], timeout_s=30)
    assert time.perf_counter() - started < 0.4 and not future.done()  # the caller goes on while it runs
    result = future.result(timeout=30)
    assert result.ok and result.stdout.strip() == "done"


@pytest.mark.timeout(60)
def test_a_command_past_its_timeout_is_killed_and_says_so():
    result = launch.start_command_in_background([sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=1).result(timeout=30)
    assert result.timed_out and result.returncode is None


@pytest.mark.timeout(60)
def test_jobs_in_turn_run_one_after_another_in_the_order_given(monkeypatch):
    """Never two at once: on 2 cores two 2-rank jobs would only fight over the cores."""
    running, log = [], []

    def fake_run_torchrun(script, args, nproc, timeout_s, **options):
        running.append(script)
        log.append((script, len(running), threading.current_thread().name, nproc, options))
        time.sleep(0.05)
        running.remove(script)
        return script

    monkeypatch.setattr(launch, "run_torchrun", fake_run_torchrun)
    futures = launch.start_jobs_in_turn([("first.py", []), ("second.py", ["--x"]), ("third.py", [])], nproc=3, use_gpus=False)
    assert [future.result(timeout=10) for future in futures] == ["first.py", "second.py", "third.py"]
    assert [entry[0] for entry in log] == ["first.py", "second.py", "third.py"]
    assert all(concurrent == 1 for _, concurrent, _, _, _ in log)  # one at a time
    assert {entry[3] for entry in log} == {3} and all(entry[4] == {"use_gpus": False} for entry in log)
