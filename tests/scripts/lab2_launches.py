"""The torchrun runs of lab 2's tests (tests/test_lab2_sampler.py, tests/test_lab2_join.py): 11 runs, 3 launches.

Most of a launch is start-up - torchrun's agent and every rank importing torch, about 10 CPU-seconds
for 2 ranks - and the lab-2 jobs' own work is small. So the runs that need the same number of ranks
share one launch of tests/scripts/record_collectives.py --rows (issue 22): each run is a row, run as
__main__ with its own argv and its own process group, its stdout and stderr in files of its own (one
per rank), its exit status checked against the one it must have (the planted bugs and a bad flag
exit non-zero on purpose), and every collective's devices checked on the way (its summary line).

Order matters in a launch: a row that does not end as expected ends the launch (the later rows do not
run, and their tests say so), so the hang demo - its collectives time out on purpose - goes last.

One run keeps a launch of its own: the bad flag --epochs 1. Its proof is torchrun's own behaviour:
argparse fails on every rank, rank 0 prints the one line and exits, and torchrun stops the job; the
other ranks wait QUIET_RANK_GRACE_S (15 s, ddp_course/cli.py) so that torchrun cannot kill rank 0
before it has printed. In a rows launch nobody is stopped, and the quiet ranks would sit out the 15 s.

The first test that needs a run starts all 3 launches, 2 at a time (the 2-rank rows launch, the
longest, beside the other two), and each test waits for its own run. Both test files use the same
launches, through the session fixture `lab2_launches` in tests/conftest.py.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from ddp_course.launch import REPO_ROOT, RunResult, run_torchrun

RECORDER = REPO_ROOT / "tests" / "scripts" / "record_collectives.py"
LAB2 = REPO_ROOT / "labs" / "lab2_sampler.py"
LAB2_JOIN = REPO_ROOT / "labs" / "lab2_join.py"
# The longest launch, 8 rows on 2 ranks, takes about 20 s on a busy 2-core machine.
LAUNCH_TIMEOUT_S = 240
ROW_SUMMARY = r"\[collectives rank (\d) row {name}\] status (-?\d+) calls (\d+) violations (\d+) ops (\S*)"

# The runs the tests need, by the key a test asks for. "{out}" in a flag is the run's own folder (its
# --json report, its saved model).
SAMPLER_GOOD_RUNS = [(2, 359), (3, 31)]  # (world size, held-out digits scored)
SAMPLER_BUGS = ["same-rank", "wrong-world-size", "no-set-epoch", "padded-eval"]
SAMPLER_BAD_FLAGS = [["--eval-size", "400"], ["--epochs", "1"]]
JOIN_RANKS = [2, 3]


@dataclass(frozen=True)
class Run:
    nproc: int
    script: Path
    flags: list[str]
    expected_status: int  # on every rank
    alone: bool = False  # a launch of its own instead of a row


def planned_runs() -> dict[tuple, Run]:
    """Every run, in launch order: a rows launch runs the rows of its world size from top to bottom."""
    runs = {}
    for nproc, eval_size in SAMPLER_GOOD_RUNS:
        flags = ["--dataset-size", "11", "--eval-size", str(eval_size), "--json", "{out}/lab2.json", "--save-model", "{out}/model.pt"]
        runs[("good", nproc)] = Run(nproc, LAB2, flags, 0)
    for bug in SAMPLER_BUGS:
        runs[("bug", bug)] = Run(2, LAB2, ["--bug", bug, "--json", "{out}/lab2.json"], 1)
    runs[("flags", "--eval-size", "400")] = Run(2, LAB2, ["--eval-size", "400"], 1)  # a CourseError after the set-up
    runs[("flags", "--epochs", "1")] = Run(2, LAB2, ["--epochs", "1"], 2, alone=True)  # argparse (docstring)
    for nproc in JOIN_RANKS:
        runs[("join", nproc)] = Run(nproc, LAB2_JOIN, ["--join", "--timeout-s", "30", "--json", "{out}/r.json"], 0)
    runs[("no join",)] = Run(2, LAB2_JOIN, ["--timeout-s", "3", "--json", "{out}/r.json"], 1)  # last: see the docstring
    return runs


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


class Lab2Launches:
    """Writes the rows files and starts every launch; row(key) waits for the key's launch."""

    def __init__(self, tmp_path_factory):
        self.runs = planned_runs()
        self.folders = {key: tmp_path_factory.mktemp(row_name(key)) for key in self.runs}
        rows_by_ranks = {}  # ranks -> the rows of that launch, as record_collectives.py reads them
        for key, run in self.runs.items():
            if not run.alone:
                rows_by_ranks.setdefault(run.nproc, []).append(
                    {"name": row_name(key), "script": str(run.script), "args": self.args(key), "expect_status": run.expected_status,
                     "out_dir": str(self.folders[key])}  # fmt: skip
                )
        # The 2-rank rows launch (the longest) on one side, the 3-rank one and then the runs alone on the other.
        pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lab2_launch")
        self.launches = {}  # ranks of a rows launch, or the key of a run alone -> Future of its RunResult
        for nproc, rows in sorted(rows_by_ranks.items()):
            rows_file = tmp_path_factory.mktemp(f"rows{nproc}") / "rows.json"
            rows_file.write_text(json.dumps(rows, indent=1))
            self.launches[nproc] = pool.submit(run_torchrun, RECORDER, ["--rows", rows_file], nproc=nproc, timeout_s=LAUNCH_TIMEOUT_S)
        for key, run in self.runs.items():
            if run.alone:
                self.launches[key] = pool.submit(run_torchrun, run.script, self.args(key), nproc=run.nproc, timeout_s=LAUNCH_TIMEOUT_S)
        pool.shutdown(wait=False)  # its threads end with the launches

    def args(self, key: tuple) -> list[str]:
        return [flag.replace("{out}", str(self.folders[key])) for flag in self.runs[key].flags]

    def row(self, key: tuple) -> RowRun:
        run = self.runs[key]
        launch = self.launches[key if run.alone else run.nproc].result()
        return RowRun(key, run, self.folders[key], launch)

    def wait_for_all(self) -> None:
        wait(self.launches.values())
