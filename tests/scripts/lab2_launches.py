"""The torchrun runs of lab 2's tests (tests/test_lab2_sampler.py, tests/test_lab2_join.py): 11 runs, 3 launches.

Most of a launch is start-up - torchrun's agent and every rank importing torch, about 10 CPU-seconds
for 2 ranks - and the lab-2 jobs' own work is small. So the runs that need the same number of ranks
share one launch of tests/scripts/record_collectives.py --rows (issue 22, tests/scripts/rows_launch.py): each run is a row, run as
__main__ with its own argv and its own process group, its stdout and stderr in files of its own (one
per rank), its exit status checked against the one it must have (the planted bugs and a bad flag
exit non-zero on purpose), and every collective's devices checked on the way (its summary line).

Order matters in a launch: a row that does not end as expected ends the launch (the later rows do not
run, and their tests say so), so the hang demo - its collectives time out on purpose - goes last.

The hang demo's rank 1 starts LATE_START_S after rank 0 (the recorder's "late_start"): the demo must
still stop at its hang, not at start-up, when a rank is slow to arrive. A launch of its own for that
cost about 23 s; the sheet's own run of the demo (labs/lab2_sampler.ipynb, section 6, compared by
nbval) is the case where both ranks start together.

One run keeps a launch of its own: the bad flag --epochs 1. Its proof is torchrun's own behaviour:
argparse fails on every rank, rank 0 prints the one line and exits, and torchrun stops the job; the
other ranks wait QUIET_RANK_GRACE_S (15 s, ddp_course/cli.py) so that torchrun cannot kill rank 0
before it has printed. In a rows launch nobody is stopped, and the quiet ranks would sit out the 15 s.

The first test that needs a run starts all 3 launches, 2 at a time (the 2-rank rows launch, the
longest, beside the other two), and each test waits for its own run. Both test files use the same
launches, through the session fixture `lab2_launches` in tests/conftest.py.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait

from ddp_course.launch import REPO_ROOT, run_torchrun
from rows_launch import Run, RowRun, launch_rows, row_entry, row_name  # beside this file (import_script puts it on sys.path)

LAB2 = REPO_ROOT / "labs" / "lab2_sampler.py"
LAB2_JOIN = REPO_ROOT / "labs" / "lab2_join.py"
# The longest launch, 8 rows on 2 ranks, takes about 20 s on a busy 2-core machine, and LATE_START_S more.
LAUNCH_TIMEOUT_S = 240

# The runs the tests need, by the key a test asks for. "{out}" in a flag is the run's own folder (its
# --json report, its saved model).
SAMPLER_GOOD_RUNS = [(2, 359), (3, 31)]  # (world size, held-out digits scored)
SAMPLER_BUGS = ["same-rank", "wrong-world-size", "no-set-epoch", "padded-eval"]
SAMPLER_BAD_FLAGS = [["--eval-size", "400"], ["--epochs", "1"]]
JOIN_RANKS = [2, 3]
# Rank 1 of the hang demo starts this long after rank 0: twice the demo's 3 s timeout.
LATE_START_S = 6


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
    runs[("no join",)] = Run(
        2,
        LAB2_JOIN,
        ["--timeout-s", "3", "--json", "{out}/r.json"],
        1,  # last: see the docstring
        late_start={"rank": 1, "seconds": LATE_START_S},
    )
    return runs


class Lab2Launches:
    """Writes the rows files and starts every launch; row(key) waits for the key's launch."""

    def __init__(self, tmp_path_factory):
        self.runs = planned_runs()
        self.folders = {key: tmp_path_factory.mktemp(row_name(key)) for key in self.runs}
        rows_by_ranks = {}  # ranks -> the rows of that launch, as record_collectives.py reads them
        for key, run in self.runs.items():
            if not run.alone:
                rows_by_ranks.setdefault(run.nproc, []).append(row_entry(key, run, self.folders[key], self.args(key)))
        # The 2-rank rows launch (the longest) on one side, the 3-rank one and then the runs alone on the other.
        pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lab2_launch")
        self.launches = {}  # ranks of a rows launch, or the key of a run alone -> Future of its RunResult
        for nproc, rows in sorted(rows_by_ranks.items()):
            self.launches[nproc] = pool.submit(launch_rows, rows, tmp_path_factory.mktemp(f"rows{nproc}"), nproc, LAUNCH_TIMEOUT_S)
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
