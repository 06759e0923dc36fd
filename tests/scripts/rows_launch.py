"""Several runs in one torchrun launch of tests/scripts/record_collectives.py --rows, and what a test reads of each.

Most of a short launch is start-up - torchrun's agent and every rank importing torch, about 10
CPU-seconds for 2 ranks - so tests that need several runs of the same world size make each run a row
of one launch (the recorder's docstring says how rows run). A test describes each run (`Run`: its
ranks, script, flags, expected exit status), `launch_rows` starts the launch, and `RowRun` reads one
run back: its ranks' own stdout and stderr files, its summary lines, its exit status on every rank.
tests/scripts/lab2_launches.py (lab 2's runs) and tests/test_lab6_ddp_from_scratch.py use it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ddp_course.launch import REPO_ROOT, RunResult, run_torchrun

RECORDER = REPO_ROOT / "tests" / "scripts" / "record_collectives.py"
ROW_SUMMARY = r"\[collectives rank (\d) row {name}\] status (-?\d+) calls (\d+) violations (\d+) ops (\S*)"


@dataclass(frozen=True)
class Run:
    nproc: int
    script: Path
    flags: list[str]
    expected_status: int  # on every rank
    alone: bool = False  # a launch of its own instead of a row
    late_start: dict | None = None  # {"rank": r, "seconds": s}: rank r starts the row s seconds late


def row_name(key: tuple) -> str:
    """("bug", "same-rank") -> "bug-same-rank": a name for summary lines and file names."""
    return "-".join(str(part).strip("-").replace(" ", "-") for part in key)


@dataclass
class RowRun:
    """One run, as a row of a shared launch or in a launch of its own: its output, its folder."""

    key: tuple
    run: Run
    folder: Path  # a row's out_dir (stdout-r<rank>.txt, stderr-r<rank>.txt) and the run's reports
    launch: RunResult

    @property
    def nproc(self) -> int:
        return self.run.nproc

    @property
    def expected_status(self) -> int:
        return self.run.expected_status

    def summaries(self) -> dict[int, tuple[int, int, int, str]]:
        """A row's {rank: (exit status, collective calls, device violations, ops)}, from the launch's stdout."""
        pattern = re.compile(ROW_SUMMARY.format(name=re.escape(row_name(self.key))))
        return {int(m[1]): (int(m[2]), int(m[3]), int(m[4]), m[5]) for m in pattern.finditer(self.launch.stdout)}

    def stdout(self, rank: int = 0) -> str:
        """What one rank of a row printed (a launch of its own: use job_stdout)."""
        path = self.folder / f"stdout-r{rank}.txt"
        return path.read_text() if path.exists() else ""

    def stderr(self, rank: int = 0) -> str:
        path = self.folder / f"stderr-r{rank}.txt"
        return path.read_text() if path.exists() else ""

    def job_stdout(self) -> str:
        """Everything the run printed on stdout, every rank's: what a learner's terminal would show."""
        return self.launch.stdout if self.run.alone else "".join(self.stdout(rank) for rank in range(self.nproc))

    def job_stderr(self) -> str:
        return self.launch.stderr if self.run.alone else "".join(self.stderr(rank) for rank in range(self.nproc))

    def a_rank_printed_a_traceback(self) -> bool:
        """A row's files hold only its ranks' own output. A launch of its own also holds torchrun's report
        of a failed job, with the agent's traceback; torch prefixes a rank's lines there with [rankN]:."""
        if self.run.alone:
            return re.search(r"^\[rank\d+\]: Traceback", self.launch.stderr, flags=re.MULTILINE) is not None
        return "Traceback" in self.job_stderr()

    def describe(self) -> str:
        """For a failing assertion: the row's own output on every rank, then the whole launch."""
        parts = [f"run {row_name(self.key)} (expected exit status {self.expected_status})"]
        if not self.run.alone:
            for rank in range(self.nproc):
                parts.append(f"--- rank {rank} stdout\n{self.stdout(rank)}--- rank {rank} stderr\n{self.stderr(rank)}")
        return "\n".join([*parts, "=== the launch", self.launch.describe()])

    def ended_as_expected(self) -> bool:
        """A row: every rank ran it to its end, with the expected exit status and no device violation.
        A launch of its own: it ended by itself, failed if its status should be non-zero (torchrun
        reports a failed job with status 1, whatever the worker's).

        Checks of the launch as a whole follow from it: the recorder ends a launch at the first row
        that does not end as expected, so a later row's summaries would be missing."""
        if self.run.alone:
            return not self.launch.timed_out and (self.launch.returncode == 0) == (self.expected_status == 0)
        summaries = self.summaries()
        return sorted(summaries) == list(range(self.nproc)) and all(
            status == self.expected_status and violations == 0 for status, _, violations, _ in summaries.values()
        )

    def made_collective_calls(self, ranks=None) -> bool:
        """These ranks (all by default) of a row called torch.distributed collectives, so the recorder checked some."""
        summaries = self.summaries()
        return all(rank in summaries and summaries[rank][1] > 0 for rank in (ranks or range(self.nproc)))

    def failed_by_itself(self) -> bool:
        """For a row that may end its launch on purpose (the last of its launch: a hang's deadline ends the
        process, gloo aborts): it failed, and was not killed by the launch's time limit. Every rank reported a
        non-zero status, or the launch ended by itself with a non-zero status before the row's lines."""
        if self.launch.timed_out:
            return False
        summaries = self.summaries()
        if sorted(summaries) == list(range(self.nproc)):
            return all(status != 0 for status, _, _, _ in summaries.values())
        return self.launch.returncode not in (0, None)


def row_entry(key: tuple, run: Run, folder: Path, args: list[str]) -> dict:
    """The row of `run`, as record_collectives.py --rows reads it: its output files go to folder."""
    entry = {"name": row_name(key), "script": str(run.script), "args": [str(arg) for arg in args],
             "expect_status": run.expected_status, "out_dir": str(folder)}  # fmt: skip
    return {**entry, "late_start": run.late_start} if run.late_start else entry


def launch_rows(rows: list[dict], rows_folder: Path, nproc: int, timeout_s: float, env=None, torchrun_args=()) -> RunResult:
    """One launch that runs rows (row_entry's) in order; rows_folder holds the rows file and the rows' markers.
    env and torchrun_args as run_torchrun's (lab 7's rows: its restart-safe environment and --max-restarts)."""
    rows_file = rows_folder / "rows.json"
    rows_file.write_text(json.dumps(rows, indent=1))
    return run_torchrun(RECORDER, ["--rows", rows_file], nproc=nproc, timeout_s=timeout_s, env=env, torchrun_args=torchrun_args)
