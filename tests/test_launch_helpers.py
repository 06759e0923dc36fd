"""The lab sheets' one-line helpers in ddp_course.launch: background jobs, and reading what a job printed.

In this process, no torchrun: the job helpers get a recording stand-in for run_torchrun (or a
one-line `python -c` command), the parsers the text torch and the labs print.
"""

import sys
import threading
import time

import pytest

from ddp_course.launch import (
    copy_with_line_after, detail_mismatches, lines_by_rank, rank_errors, scratch_folder, start_command_in_background,
    start_jobs,
)  # fmt: skip


class Recorder:
    """A stand-in for run_torchrun: records when each job starts and ends, and how many run at once."""

    def __init__(self, seconds=0.05, slow=()):
        self.events, self.running, self.most_at_once = [], 0, 0
        self.seconds, self.slow, self.lock = seconds, set(slow), threading.Lock()

    def __call__(self, name, **options):
        with self.lock:
            self.events.append(("start", name))
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        time.sleep(self.seconds * (10 if name in self.slow else 1))
        with self.lock:
            self.events.append(("end", name))
            self.running -= 1
        return f"{name} done"


@pytest.mark.timeout(30)
def test_jobs_run_at_most_at_once_at_a_time_in_the_order_given():
    launch = Recorder()
    futures = start_jobs({name: {"name": name} for name in "abcde"}, at_once=2, launch=launch)
    assert {name: future.result(timeout=10) for name, future in futures.items()} == {n: f"{n} done" for n in "abcde"}
    assert launch.most_at_once == 2
    assert [name for kind, name in launch.events if kind == "start"] == list("abcde")


@pytest.mark.timeout(30)
def test_a_job_after_another_starts_only_once_that_one_ended():
    launch = Recorder(seconds=0.05, slow={"slow"})
    jobs = {"slow": {"name": "slow"}, "other": {"name": "other"}, "needs slow": {"name": "needs slow", "after": "slow"}}
    futures = start_jobs(jobs, at_once=2, launch=launch)
    futures["needs slow"].result(timeout=10)
    events = launch.events
    assert events.index(("end", "slow")) < events.index(("start", "needs slow"))
    # without "after" it would have taken the thread "other" freed, before "slow" ended
    assert events.index(("end", "other")) < events.index(("end", "slow"))


def test_after_must_name_an_earlier_job():
    with pytest.raises(ValueError, match="'first' runs after 'second', which is not an earlier job"):
        start_jobs({"first": {"name": "first", "after": "second"}, "second": {"name": "second"}}, launch=Recorder())


@pytest.mark.timeout(60)
def test_a_command_in_the_background_returns_its_run_result():
    future = start_command_in_background([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], timeout_s=50)
    result = future.result(timeout=55)
    assert (result.returncode, result.stdout.strip(), result.timed_out) == (3, "out", False)


def test_scratch_folders_are_new_and_empty():
    first, second = scratch_folder("sheet_"), scratch_folder("sheet_")
    assert first != second and first.is_dir() and not any(first.iterdir()) and first.name.startswith("sheet_")


def test_lines_by_rank_groups_and_sorts_ranks():
    text = "config: ...\n[rank 1] b1\n[rank 0] a1\n[rank 10] k\n[rank 1] b2\nnot [rank 3] this\n"
    assert lines_by_rank(text) == {0: ["a1"], 1: ["b1", "b2"], 10: ["k"]}


def test_rank_errors_are_distinct_sorted_and_without_glooss_source_prefix():
    stderr = (
        "[rank1]: Traceback (most recent call last):\n"
        "[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer\n"
        "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms\n"
        "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
    )
    assert rank_errors(stderr) == ["RuntimeError: Connection closed by peer", "RuntimeError: Timed out waiting 3000ms"]


def test_detail_mismatches_reads_each_ranks_own_collective():
    # The shape of TORCH_DISTRIBUTED_DEBUG=DETAIL's reports (torch 2.14), one line per rank.
    report = (
        "[rank 1] Detected mismatch between collectives on ranks. Rank 1 is running collective: "
        "CollectiveFingerPrint(SequenceNumber=2, OpType=BARRIER), but Rank 0 is running collective: "
        "CollectiveFingerPrint(SequenceNumber=2, OpType=ALLREDUCE, TensorShape=[1]).\n"
        "[rank 0] Detected mismatch between collectives on ranks. Rank 0 is running collective: "
        "CollectiveFingerPrint(SequenceNumber=2OpType=ALLREDUCE, TensorShape=[2]), but Rank 1 is running collective: "
        "CollectiveFingerPrint(SequenceNumber=2, OpType=GATHER).\n"
    )
    assert detail_mismatches(report) == {0: (2, "ALLREDUCE"), 1: (2, "BARRIER")}
    assert detail_mismatches("no mismatch here") == {}


def test_copy_with_line_after_inserts_once_and_refuses_a_missing_or_repeated_anchor(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("a = 1\n    x = load()\nprint(a)\n")
    copy = copy_with_line_after(script, "    x = load()\n", "    log(x)", scratch_folder("probe_"))
    assert copy.name == "job.py" and copy.read_text() == "a = 1\n    x = load()\n    log(x)\nprint(a)\n"
    assert script.read_text() == "a = 1\n    x = load()\nprint(a)\n"  # the original is untouched
    with pytest.raises(ValueError, match="occurs 0 times"):
        copy_with_line_after(script, "y = 2", "z", tmp_path)
    script.write_text("x\nx\n")
    with pytest.raises(ValueError, match="occurs 2 times"):
        copy_with_line_after(script, "x", "z", tmp_path)
