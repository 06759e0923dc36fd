"""ddp_course.grade: one command grades every exercise; its table, JSON file and exit status, and its adapters.

What other tests already run is not run again here. The labs' checkers judge real jobs in
tests/test_checkers.py, which also feeds its rows (lab 3's and lab 4's solutions and mistakes) to
the grader's lab 3 and lab 4 adapters; labs 6 and 8 run their solutions in their own tests. Here:
- the table, the JSON report, the points and the exit status, from rows made up for the purpose;
- the adapters of labs 6 and 8 on the lab's output and records as the labs write them (a stand-in
  for the launch), and which parts they launch at all (none while a part's TODO still raises);
- for real: every lecture exercise graded from the solutions notebooks (all pass) and lectures 1
  and 2's untouched stubs (all fail), in ONE worker process; and the whole grader on the untouched
  starting files, where nothing is launched (every lab file is missing or still raises its TODOs)
  and the result is 0 points and exit status 1.
"""

import json

import pytest

from ddp_course import grade
from ddp_course.launch import REPO_ROOT, RunResult

Row = grade.Row


def fake_rows():
    return [
        Row.of("lecture1", "exercise 1", "PASS", "correct"),
        Row.of("lab3", "1 data-split", "PASS", "disjoint"),
        Row.of("lab3", "the script on GPUs (NCCL, cuda:LOCAL_RANK)", "BLOCKED", "needs GPUs"),
    ]


def test_points_count_what_ran_and_the_exit_status_needs_every_row_that_ran_to_pass(tmp_path):
    rows = fake_rows()
    assert [(r.points, r.max_points) for r in rows] == [(1, 1), (1, 1), (0, 0)]
    assert grade.exit_status(rows) == 0  # a BLOCKED row did not run: it does not fail the grade
    assert grade.exit_status([*rows, Row.of("lab4", "5 collectives", "FAIL", "unmatched")]) == 1
    text = grade.table(rows)
    lines = text.splitlines()
    assert lines[0].split() == ["exercise", "check", "status", "points", "reason"]
    assert lines[2].split()[:5] == ["lecture1", "exercise", "1", "PASS", "1/1"]
    assert "BLOCKED      -  needs GPUs" in lines[4]
    assert lines[-1] == "total: 2/2 points; 0 failed, 1 blocked (not counted)"
    report = grade.report(rows, grade.Sources(solutions=True), 1.23)
    assert report["points"] == 2 and report["max_points"] == 2 and report["passed"] is True and report["graded"] == "solutions"
    assert report["rows"][2] == {"exercise": "lab3", "check": "the script on GPUs (NCCL, cuda:LOCAL_RANK)", "status": "BLOCKED",
                                 "reason": "needs GPUs", "points": 0, "max_points": 0}  # fmt: skip


def test_an_exercise_whose_rows_are_all_blocked_was_not_judged_and_did_not_pass():
    """A lab 3 script that no check could decide (e.g. 13 BLOCKED) earns no 'passed' and exit status 1 (review 2026-11-28, finding 9)."""
    rows = [Row.of("lecture1", "exercise 1", "PASS", "correct"),
            *(Row.of("lab3", f"{n} check", "BLOCKED", "undecided") for n in range(1, 14)),
            Row.of("lab3", "the script on GPUs (NCCL, cuda:LOCAL_RANK)", "BLOCKED", "needs GPUs")]  # fmt: skip
    assert grade.unjudged(rows) == ["lab3"]
    assert grade.exit_status(rows) == 1
    assert grade.report(rows, grade.Sources(), 1.0)["passed"] is False
    assert grade.totals(rows) == "total: 1/1 points; 0 failed, 14 blocked (not counted); not passed: lab3, where no check could be decided (every row BLOCKED)"


def test_main_prints_the_table_writes_the_same_rows_as_json_and_exits_with_their_status(tmp_path, monkeypatch, capsys):
    failing = [*fake_rows(), Row.of("lab4", "5 collectives", "FAIL", "unmatched")]
    monkeypatch.setattr(grade, "grade", lambda sources, only=None: failing)
    path = tmp_path / "grade.json"
    assert grade.main(["--json", str(path)]) == 1
    printed = capsys.readouterr().out
    assert grade.table(failing) in printed and f"written: {path}" in printed
    written = json.loads(path.read_text())
    assert [(r["exercise"], r["check"], r["status"]) for r in written["rows"]] == [(r.exercise, r.check, r.status) for r in failing]
    assert written["points"] == 2 and written["max_points"] == 3 and written["passed"] is False


@pytest.mark.parametrize(("args", "expected"), [
    (["--only", "lab5"], "argument --only: invalid choice: 'lab5'"),
    (["--json", "no/such/folder/grade.json"], "--json no/such/folder/grade.json: give a file in an existing folder"),
])  # fmt: skip
def test_bad_command_lines_fail_with_one_line(args, expected, capsys):
    with pytest.raises(SystemExit) as stopped:
        grade.main(args)
    assert stopped.value.code == 2
    assert expected in capsys.readouterr().err.strip().splitlines()[-1]


def test_only_picks_exercises_and_single_lectures():
    calls = []

    def grader(name, rows):
        def run(sources):
            calls.append(name)
            return rows

        return run

    graders = {name: grader(name, [Row.of(name, "c", "PASS")]) for name in grade.EXERCISES}
    graders["lectures"] = grader("lectures", [Row.of("lecture1", "exercise 1", "PASS"), Row.of("lecture2", "exercise 1", "PASS")])
    rows = grade.grade(grade.Sources(), only=["lab4", "lecture1"], graders=graders)
    assert calls == ["lectures", "lab4"] and [r.exercise for r in rows] == ["lecture1", "lab4"]


def test_lab4_epoch_shuffle_counts_only_once_data_split_passes():
    """The broken exercise passes epoch-shuffle (its DataLoader shuffles): no point for a bug it hides."""

    class Verdict:
        def __init__(self, number, status, evidence="x"):
            self.number, self.status, self.evidence = number, status, evidence

    names = {n: (f"check{n}", "") for n in range(1, 8)}
    rows = grade.with_dependencies("lab4", [Verdict(1, "FAIL"), *(Verdict(n, "PASS") for n in range(2, 8))], names)
    assert rows[3].status == "BLOCKED" and "epoch-shuffle counts once data-split passes" in rows[3].reason
    assert [r.status for r in rows[:3] + rows[4:]] == ["FAIL", "PASS", "PASS", "PASS", "PASS", "PASS"]
    rows = grade.with_dependencies("lab4", [Verdict(n, "PASS") for n in range(1, 8)], names)
    assert all(r.status == "PASS" for r in rows)


def exercise_copy(tmp_path, lab_file: str, keep_todo_of: set[int], lab: int):
    """tmp_path/labs/<lab_file>: the solution, with the parts in keep_todo_of turned back into their TODOs."""
    from ddp_course.authoring.exercises import make_exercise

    (tmp_path / "labs").mkdir(exist_ok=True)
    target = tmp_path / "labs" / lab_file
    target.write_text(make_exercise((REPO_ROOT / "solutions" / lab_file).read_text(), parts=keep_todo_of))
    assert grade.todo_parts(target, lab) == keep_todo_of
    return grade.Sources(root=tmp_path)


LAB6_STDOUT = """\
  naive     max|w - one process| 1.2e-07   max|w - torch DDP| 0.0e+00   PASS
  overlap   max|w - one process| 3.1e-01   max|w - torch DDP| 3.1e-01   FAIL
  zero-1    max|w - AdamW| 0.0e+00   AdamW state on the fullest rank 0.50 of AdamW's   PASS
"""


def test_lab6_launches_only_the_parts_without_todos_and_reads_their_verdicts(tmp_path):
    sources = exercise_copy(tmp_path, "minddp.py", {3}, 6)
    launched = []

    def run(script, args):
        launched.append(args)
        records = [{"impl": "naive", "check_passed": True}, {"impl": "overlap", "check_passed": False}]
        return RunResult(["torchrun"], 1, LAB6_STDOUT, "lab6_ddp_from_scratch.py: error: the check FAILED", 9.0, False), records

    rows = grade.lab6_rows(sources, run=run)
    assert launched == [["--module", "labs", "--repeats", "0", "--impl=naive", "--impl=overlap", "--zero"]]
    assert [(r.check.split(":")[0], r.status) for r in rows] == [
        ("part 1", "PASS"),
        ("part 2", "FAIL"),
        ("part 3", "FAIL"),
        ("part 4", "PASS"),
        ("the wrappers on GPUs (NCCL)", "BLOCKED"),
    ]
    assert rows[0].reason == "naive max|w - one process| 1.2e-07 max|w - torch DDP| 0.0e+00 PASS"
    assert rows[1].reason.startswith("overlap max|w - one process| 3.1e-01")
    assert rows[3].reason.startswith("zero-1 max|w - AdamW| 0.0e+00")
    assert rows[2].reason == "not done: TODO(lab 6, part 3) still raises in labs/minddp.py"


def test_lab6_launches_nothing_while_every_part_raises(tmp_path):
    sources = exercise_copy(tmp_path, "minddp.py", {1, 2, 3, 4}, 6)
    rows = grade.lab6_rows(sources, run=lambda *args: pytest.fail("launched"))
    assert [r.status for r in rows] == ["FAIL"] * 4 + ["BLOCKED"]


LAB8_STDOUT = """\
part 1  PASS  shard_rows: 13 rows over 4 ranks: slices of 4 rows, in rank order, the 3 rows past the end zero
part 1  PASS  gather_full_params: every weight whole again, equal to the model's before sharding
part 2  PASS  forward: logits equal the unsharded model's: max difference 0.0e+00 <= 2.3e-05
part 2  FAIL  full weights only around their use: after forward 1,024 B gathered, modules show their slices again: True
"""


def test_lab8_runs_the_parts_done_and_reads_each_parts_lines(tmp_path):
    """--part K for the last part without a TODO; a part after a part with a TODO is not run (it needs it)."""
    sources = exercise_copy(tmp_path, "minifsdp.py", {3}, 8)
    launched = []

    def run(script, args):
        launched.append(args)
        return RunResult(["torchrun"], 1, LAB8_STDOUT, "lab8_fsdp.py: error: --part 2 FAILED: see the FAIL lines above\n", 5.0, False)

    rows = grade.lab8_rows(sources, run=run)
    assert launched == [["--part", "2", "--module", "labs"]]
    assert [(r.check, r.status) for r in rows] == [
        ("part 1: shard_rows", "PASS"), ("part 1: gather_full_params", "PASS"), ("part 2: forward", "PASS"),
        ("part 2: full weights only around their use", "FAIL"), ("part 3: the lab's whole check of --impl fsdp", "FAIL"),
        ("peak memory per rank on GPUs", "BLOCKED")]  # fmt: skip
    assert rows[3].reason.startswith("after forward 1,024 B gathered")
    assert rows[4].reason == "not done: TODO(lab 8, part 3) still raises in labs/minifsdp.py"
    sources = exercise_copy(tmp_path / "b", "minifsdp.py", {1}, 8) if (tmp_path / "b").mkdir() is None else None
    rows = grade.lab8_rows(sources, run=lambda *args: pytest.fail("launched with part 1 unfinished"))
    assert [r.status for r in rows] == ["FAIL"] * 5 + ["BLOCKED"]
    assert rows[2].reason == "needs part 1 first (labs/lab8_fsdp.py --part 2 runs parts 1 to 2)"


@pytest.mark.timeout(240)
def test_lecture_exercises_solutions_pass_and_untouched_stubs_fail_in_one_worker():
    """The grader's own path (each exercise cell swapped into its solutions notebook, then the check), for
    real, on lectures 1 and 2: their solutions score every point, their untouched stubs (the two ways the
    checks word "not done") score none. The path re-executes a whole solutions notebook, which nbval
    re-executes anyway: the other lectures' solutions are checked there, and that each lecture's stub
    says "not solved yet" with that lecture's exercises (tests/test_lecture0N_exercises.py)."""
    graded = ("lecture1", "lecture2")
    untouched = [(f"{name}-untouched", mine, solved) for name, mine, solved in grade.Sources().lectures() if name in graded]
    solved = [lecture for lecture in grade.Sources(solutions=True).lectures() if lecture[0] in graded]
    rows = grade.graded_lectures([*solved, *untouched])
    starters = [r for r in rows if r.exercise.endswith("-untouched")]
    solutions = [r for r in rows if not r.exercise.endswith("-untouched")]
    assert len(solutions) == len(starters) == 4  # lecture 1: 1 exercise, lecture 2: 3
    assert all(r.status == "PASS" and r.reason.startswith("correct") for r in solutions), solutions
    # Lecture 2's checks word it their own way ("not done yet: complete the cell above ...").
    assert all(r.status == "FAIL" and r.reason.startswith(("not solved yet", "not done yet")) for r in starters), starters


def test_a_learners_cell_that_raises_or_hangs_fails_its_row_only(tmp_path, monkeypatch):
    """A broken answer is a FAIL with its reason, not a crash of the grader; a loop stops at the cell limit."""
    import nbformat

    solved = REPO_ROOT / "solutions" / "01_data_parallelism_solutions.ipynb"
    reasons = []
    for answer in (
        "# Exercise 1: a token-level loss\ndef accumulate_step(*args):\n    return 1 / 0\n",  # the title changed too
        None,
    ):  # the title kept, the body a loop
        if answer is None:
            # Only now: the set-up cell's first, cold imports (torch, matplotlib) can take over 2 s on a loaded machine.
            monkeypatch.setattr(grade, "CELL_TIMEOUT_S", 2)
        lecture = nbformat.read(REPO_ROOT / "lectures" / "01_data_parallelism.ipynb", as_version=4)
        for cell in lecture.cells:
            if cell.cell_type == "code" and cell.source.startswith("# Exercise 1:"):
                cell.source = answer or cell.source.split("\n")[0] + "\nwhile True:\n    pass\n"
        nbformat.write(lecture, tmp_path / "01_data_parallelism.ipynb")
        rows = grade.grade_lecture("lecture1", tmp_path / "01_data_parallelism.ipynb", solved)
        assert [(r.check, r.status) for r in rows] == [("exercise 1", "FAIL")]
        reasons.append(rows[0].reason)
    # the grader prints the title with repr(), which quotes it with " because it holds an apostrophe
    assert reasons[0].startswith('no cell starting with "# Exercise 1: the last step of an epoch'), reasons[0]
    assert reasons[1] == "your exercise cell raised CellTimeout: still running after 2 s", reasons[1]


@pytest.mark.timeout(240)
def test_the_untouched_starting_files_score_zero_without_a_launch(tmp_path, monkeypatch):
    """`python -m ddp_course.grade` on a fresh clone: no labs/my_ddp.py, no my_lab4.py, every TODO of labs 6 and 8."""
    sources = grade.Sources(extra={"lab3": tmp_path / "labs" / "my_ddp.py", "lab4": tmp_path / "my_lab4.py", "lab10": tmp_path / "my_lab10.py"})
    graders = {"lectures": lambda s: []}  # graded for real in the test above, from the same notebooks
    monkeypatch.setattr(grade, "run_lab", lambda *args: pytest.fail("a lab was launched"))
    rows = grade.grade(sources, graders=graders)
    ran = [r for r in rows if r.status != "BLOCKED"]
    assert {r.exercise for r in rows} == {"lab3", "lab4", "lab6", "lab8", "lab10"}
    assert len(ran) == 13 + 7 + 4 + 5 + 10 and all(r.status == "FAIL" for r in ran), rows
    assert sum(r.points for r in rows) == 0 and grade.exit_status(rows) == 1
    assert all(r.reason.startswith("needs GPUs") for r in rows if r.status == "BLOCKED")


def test_lab10_rows_are_the_checkers_verdicts_and_a_missing_file_fails_every_check(tmp_path):
    from ddp_course.checking import lab10
    from ddp_course.checking.verdict import Verdict

    missing = grade.lab10_rows(grade.Sources(extra={"lab10": tmp_path / "my_lab10.py"}))
    assert [r.check for r in missing] == [f"{n} {name}" for n, (name, _) in lab10.CHECKS.items()]
    assert all(r.status == "FAIL" and "cp labs/lab10_slow_ddp.py my_lab10.py" in r.reason for r in missing)
    script = tmp_path / "my_lab10.py"
    script.write_text("")
    verdicts = [Verdict("threads", "PASS", "1 thread", number=1), Verdict("throughput", "BLOCKED", "decided later", number=7)]
    rows = grade.lab10_rows(grade.Sources(extra={"lab10": script}), check=lambda path, folder: (None, verdicts))
    assert [(r.check, r.status, r.reason) for r in rows] == [("1 threads", "PASS", "1 thread"), ("7 throughput", "BLOCKED", "decided later")]
    assert [r.max_points for r in rows] == [1, 0]
