"""Grade every exercise a learner writes, by behaviour: one command, one table, one JSON file.

    python -m ddp_course.grade                          # your files; the table, and runs/grade.json
    python -m ddp_course.grade --solutions              # the course's solutions: every runnable point
    python -m ddp_course.grade --only lab3 --only lecture1 --json my_grade.json

What it grades, and from which file (yours; with --solutions, the course's):

  lectureN, optional  the "# Exercise N: ..." cells of lectures/NN_*.ipynb (solutions/NN_*_solutions.ipynb):
                      each cell runs after its solutions notebook's set-up cells, then the notebook's
                      own check (ddp_course/lectureNN_checks.py), whose verdict is the row
  lab3                labs/my_ddp.py (solutions/my_ddp.py): the conversion checker's 13 checks, parts A and B
                      (python labs/lab3_convert_check.py; ddp_course/checking/conversion.py)
  lab4                my_lab4.py at the repository root (solutions/lab4_broken_ddp.py): lab 4's 7 checks
                      (python labs/lab4_check.py; ddp_course/checking/lab4.py). Check 4 (epoch-shuffle) counts only once check 1 (data-split)
                      passes: without a DistributedSampler the DataLoader's own shuffle hides bug 4, so the
                      broken script passes it
  lab10               my_lab10.py at the repository root (solutions/lab10_slow_ddp.py): lab 10's 10 checks
                      (labs/lab10_check.py). Throughput (check 7) is BLOCKED while a check about one
                      cause fails, accuracy (check 8) while batch-norm (check 10) fails; the time-out
                      check adds an 8 s save
  lab6                labs/minddp.py (solutions/minddp.py): each part's wrapper against one process and
                      torch's DDP (labs/lab6_ddp_from_scratch.py --module labs --repeats 0 --zero)
  lab8                labs/minifsdp.py (solutions/minifsdp.py): labs/lab8_fsdp.py --part K through its
                      command line, K the last part with no TODO left: each "part N  PASS|FAIL  name: ..."
                      line it prints is a row (part 3's is the lab's whole check of --impl fsdp)

A file you have not created yet (labs/my_ddp.py, my_lab4.py) fails every check of its exercise at once,
and so does every part of labs/minddp.py or labs/minifsdp.py that still raises its TODO: nothing is
launched for them, so the untouched starting files are graded in seconds and score 0.

Each row: exercise, check, PASS / FAIL / BLOCKED, points and the reason. Every row that runs is worth
one point. BLOCKED rows are worth none and do not count: a criterion that needs GPUs on a machine
without them, or a check another one makes meaningless. The exit status is 0 only when every row
that ran passed and every exercise graded had a row that ran (an exercise whose rows are all BLOCKED
was not judged, so it did not pass), 1 otherwise, 2 for a bad command line. The whole grading takes a few minutes on a
2-core CPU (it launches the labs' jobs one after another).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddp_course.checking.verdict import Verdict
from ddp_course.cli import CourseArgumentParser

REPO_ROOT = Path(__file__).resolve().parent.parent
LECTURE_TIMEOUT_S = 300  # all lecture exercises, in one worker process
CELL_TIMEOUT_S = 60  # one cell of a lecture exercise (an infinite loop in an answer ends here)
LAB_TIMEOUT_S = 240  # one lab's job
TODO = re.compile(r'NotImplementedError\(\s*"TODO\(lab (\d+), part (\d+)\)')
EXERCISE_VERDICT = re.compile(r"^exercise (\d+): (.*)$", re.MULTILINE)
NO_GPU = "needs GPUs (CUDA sees {gpus} here): run it on a GPU machine"


@dataclass(frozen=True)
class Row(Verdict):
    """One line of the table: the checkers' own Verdict of one check, the exercise it belongs to, and
    the point it earns (BLOCKED earns nothing and costs nothing). Build one with Row.of(...)."""

    exercise: str = ""

    @classmethod
    def of(cls, exercise: str, check: str, status: str, reason: str = "") -> Row:
        return cls(check, status, reason, exercise=exercise)

    @property
    def reason(self) -> str:
        return self.evidence

    @property
    def points(self) -> int:
        return int(self.status == "PASS")

    @property
    def max_points(self) -> int:
        return 0 if self.status == "BLOCKED" else 1

    def as_json(self) -> dict:
        return {"exercise": self.exercise, "check": self.check, "status": self.status, "reason": self.reason}


@dataclass
class Sources:
    """Where each exercise's file is: the learner's (default) or the course's solutions (solutions=True)."""

    root: Path = REPO_ROOT
    solutions: bool = False
    extra: dict = field(default_factory=dict)  # tests: {"lab3": path, "lab4": path} to look elsewhere

    def lab3(self) -> Path:
        return self.extra.get("lab3") or self.root / ("solutions/my_ddp.py" if self.solutions else "labs/my_ddp.py")

    def lab4(self) -> Path:
        return self.extra.get("lab4") or self.root / ("solutions/lab4_broken_ddp.py" if self.solutions else "my_lab4.py")

    def lab10(self) -> Path:
        return self.extra.get("lab10") or self.root / ("solutions/lab10_slow_ddp.py" if self.solutions else "my_lab10.py")

    def module(self) -> str:
        """--module of labs 6 and 8."""
        return "solutions" if self.solutions else "labs"

    def lectures(self) -> list[tuple[str, Path, Path]]:
        """[(exercise name, the notebook graded, its solutions notebook)] for every lecture with exercises."""
        found = []
        for solved in sorted((self.root / "solutions").glob("*_solutions.ipynb")):
            lecture = self.root / "lectures" / solved.name.replace("_solutions", "")
            number = solved.name.split("_")[0]
            name = f"lecture{number.lstrip('0')}" if number[0].isdigit() else "optional"
            found.append((name, solved if self.solutions else lecture, solved))
        return found


# --- lectures: the exercise cells, in a worker process -----------------------------------------------------
def lecture_rows(sources: Sources, timeout_s: float = LECTURE_TIMEOUT_S) -> list[Row]:
    """Every lecture exercise's row, from one worker process (python -m ddp_course.grade --lecture-worker)."""
    return graded_lectures(sources.lectures(), sources.root, timeout_s)


def graded_lectures(lectures: list[tuple[str, Path, Path]], root: Path = REPO_ROOT, timeout_s: float = LECTURE_TIMEOUT_S) -> list[Row]:
    """The rows of [(name, graded notebook, solutions notebook)], graded in one worker process."""
    plan = [[name, str(graded), str(solved)] for name, graded, solved in lectures]
    command = [sys.executable, "-m", "ddp_course.grade", "--lecture-worker", json.dumps(plan)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, cwd=root, env=env)
        output, problem = done.stdout, None if done.returncode == 0 else f"the grading process failed: {last_line(done.stderr)}"
    except subprocess.TimeoutExpired as expired:
        output, problem = expired.stdout or "", f"the lecture exercises did not finish within {timeout_s:g} s"
    if isinstance(output, bytes):
        output = output.decode()
    rows = [Row.of(**json.loads(line[len("ROW ") :])) for line in output.splitlines() if line.startswith("ROW ")]
    graded = {row.exercise for row in rows}
    for name, _, solved in lectures:  # a lecture the worker never reached
        if name not in graded:
            rows += [Row.of(name, check, "FAIL", problem or "not graded") for check in exercise_titles(solved)]
    return rows


def exercise_titles(notebook: Path) -> list[str]:
    from ddp_course.authoring.notebooks import cells_titled

    return [f"exercise {title.split(':')[0].split()[-1]}" for title in cells_titled(notebook, "# Exercise ")]


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no error message"


class CellTimeout(Exception):
    pass


def grade_lecture(name: str, graded: Path, solved: Path) -> list[Row]:
    """Run the solutions notebook's code cells with each exercise cell taken from `graded`; a row per check cell.

    The solutions notebook has the set-up cells an exercise needs; the graded notebook gives the
    learner's "# Exercise N: ..." cells, matched by their first line. A check cell's verdict is its
    "exercise N: ..." line: "correct" passes, anything else ("not solved yet", "not yet ...") fails.
    """
    import nbformat

    from ddp_course.authoring.notebooks import cells_titled

    mine = {title: source for title, (source, _) in cells_titled(graded, "# Exercise ").items()}
    namespace, rows, setup_problem = {"__name__": f"graded_{name}"}, [], None
    for cell in nbformat.read(solved, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        source = cell.source
        title = source.splitlines()[0] if source else ""
        check = re.match(r"# Check exercise (\d+)", title)
        if title.startswith("# Exercise "):
            if title not in mine:
                namespace["__missing__"] = f"no cell starting with {title!r} in {graded.name}"
                continue
            source = mine[title]
        if check:
            number = check.group(1)
            if setup_problem:
                rows.append(Row.of(name, f"exercise {number}", "FAIL", setup_problem))
                continue
            printed, error = run_cell(source, namespace)
            verdict = next((text for found, text in EXERCISE_VERDICT.findall(printed) if found == number), None)
            if error or verdict is None:  # no "exercise N: ..." line: the check's last line says why (lecture 2: "not done yet")
                said = printed.strip().splitlines()[-1] if printed.strip() else "the check printed nothing"
                rows.append(Row.of(name, f"exercise {number}", "FAIL", namespace.pop("__missing__", None) or error or said))
            else:
                rows.append(Row.of(name, f"exercise {number}", "PASS" if verdict.startswith("correct") else "FAIL", verdict))
            namespace.pop("__missing__", None)
            continue
        _, error = run_cell(source, namespace)
        if error and not title.startswith("# Exercise "):
            setup_problem = f"a set-up cell of {solved.name} failed: {error}"
        elif error:
            namespace["__missing__"] = f"your exercise cell raised {error}"
    return rows


def run_cell(source: str, namespace: dict) -> tuple[str, str | None]:
    """(what the cell printed, None or its exception as one line); a cell still running after CELL_TIMEOUT_S stops."""
    from ddp_course.authoring.notebooks import run_source

    def expired(signum, frame):
        raise CellTimeout(f"still running after {CELL_TIMEOUT_S} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(CELL_TIMEOUT_S)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return run_source(source, namespace), None
    except BaseException as error:  # a learner's cell may raise anything: it becomes the row's reason
        if isinstance(error, KeyboardInterrupt):
            raise
        return "", f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def lecture_worker(plan_json: str) -> int:
    """The worker: grade each (name, graded notebook, solutions notebook) and print one "ROW {json}" line per row."""
    import matplotlib

    matplotlib.use("Agg")  # the set-up cells may draw; nobody looks
    for name, graded, solved in json.loads(plan_json):
        for row in grade_lecture(name, Path(graded), Path(solved)):
            print("ROW " + json.dumps(row.as_json()), flush=True)
    return 0


# --- labs 3 and 4: the behavioural checkers ----------------------------------------------------------------
def checker_rows(exercise: str, verdicts, names: dict[int, tuple]) -> list[Row]:
    return [Row.of(exercise, f"{v.number} {names[v.number][0]}", v.status, v.evidence) for v in verdicts]


def lab3_rows(sources: Sources, check=None) -> list[Row]:
    """The conversion checker on labs/my_ddp.py; check(script, out_dir) -> (observations, verdicts) (tests pass their own)."""
    from ddp_course.checking import conversion as checker

    script = sources.lab3()
    gpu = gpu_row("lab3", "the script on GPUs (NCCL, cuda:LOCAL_RANK)", script)
    if not script.is_file():
        reason = f"no {display(script, sources)} yet: cp labs/train_realistic.py labs/my_ddp.py, then turn it into a DDP script"
        return [Row.of("lab3", f"{number} {name}", "FAIL", reason) for number, (name, _) in checker.CHECKS.items()] + [gpu]
    with tempfile.TemporaryDirectory(prefix="grade_lab3_") as out_dir:
        _, verdicts = (check or checker.check)(script.resolve(), Path(out_dir))
    return checker_rows("lab3", verdicts, checker.CHECKS) + [gpu]


# A check that means something only once another passes: {exercise: {check: (the check it needs, why)}}.
DEPENDS_ON = {
    "lab4": {4: (1, "without a DistributedSampler the DataLoader's own shuffle makes every epoch new: epoch-shuffle counts once data-split passes")},
}


def lab4_rows(sources: Sources, check=None) -> list[Row]:
    from ddp_course.checking import lab4 as checker

    script = sources.lab4()
    if not script.is_file():
        reason = f"no {display(script, sources)} yet: cp labs/lab4_broken_ddp.py my_lab4.py, then fix it (lab 4 sheet, section 6)"
        return [Row.of("lab4", f"{number} {name}", "FAIL", reason) for number, (name, _) in checker.CHECKS.items()]
    with tempfile.TemporaryDirectory(prefix="grade_lab4_") as out_dir:
        _, verdicts = (check or checker.check)(script.resolve(), Path(out_dir))
    return with_dependencies("lab4", verdicts, checker.CHECKS)


def with_dependencies(exercise: str, verdicts, names) -> list[Row]:
    by_number = {v.number: v for v in verdicts}
    rows = []
    for verdict in verdicts:
        needed = DEPENDS_ON.get(exercise, {}).get(verdict.number)
        if needed and verdict.status == "PASS" and by_number[needed[0]].status != "PASS":
            rows.append(Row.of(exercise, f"{verdict.number} {names[verdict.number][0]}", "BLOCKED", needed[1]))
        else:
            rows.append(Row.of(exercise, f"{verdict.number} {names[verdict.number][0]}", verdict.status, verdict.evidence))
    return rows


def lab10_rows(sources: Sources, check=None) -> list[Row]:
    """Lab 10's checker (ddp_course/checking/lab10.py) on my_lab10.py; check(script, folder) -> (launch, verdicts)."""
    from ddp_course.checking import lab10

    script = sources.lab10()
    if not script.is_file():
        reason = f"no {display(script, sources)} yet: cp labs/lab10_slow_ddp.py my_lab10.py, then measure and fix it (lab 10 sheet)"
        return [Row.of("lab10", f"{number} {name}", "FAIL", reason) for number, (name, _) in lab10.CHECKS.items()]
    with tempfile.TemporaryDirectory(prefix="grade_lab10_") as folder:
        _, verdicts = (check or lab10.check)(script.resolve(), Path(folder))
    return [Row.of("lab10", f"{v.number} {v.check}", v.status, v.evidence) for v in verdicts]


# --- labs 6 and 8: the labs' own checks, through their command lines ----------------------------------------
def todo_parts(path: Path, lab: int) -> set[int]:
    """The parts whose TODO still raises in an exercise file (ddp_course.authoring.exercises writes them)."""
    if not path.is_file():
        return set()
    return {int(part) for number, part in TODO.findall(path.read_text()) if int(number) == lab}


LAB6_PARTS = {  # part: (what the row checks, the implementation the lab checks for it, the parts it needs)
    1: ("part 1: NaiveDDP = one process = torch DDP", "naive", {1}),
    2: ("part 2: OverlapDDP = one process = torch DDP", "overlap", {1, 2}),
    3: ("part 3: BucketedDDP = one process = torch DDP", "bucketed", {1, 3}),
    4: ("part 4: ShardedOptimizer (ZeRO-1) = AdamW", "zero", {4}),
}


def lab6_rows(sources: Sources, run=None) -> list[Row]:
    """labs/lab6_ddp_from_scratch.py's check for every part whose TODOs are done; run(args) -> (RunResult, records or None)."""
    exercise_file = sources.root / sources.module() / "minddp.py"
    left = todo_parts(exercise_file, 6)
    rows, impls = {}, []
    for part, (check, impl, needs) in LAB6_PARTS.items():
        if needs & left:
            rows[part] = Row.of("lab6", check, "FAIL", f"not done: TODO(lab 6, part {min(needs & left)}) still raises in {display(exercise_file, sources)}")
        else:
            impls.append(impl)
    if impls:
        args = ["--module", sources.module(), "--repeats", "0", *(f"--impl={impl}" for impl in impls if impl != "zero")]
        if "zero" in impls:
            args += ["--zero"] + ([] if len(impls) > 1 else ["--impl=torch"])
        result, records = (run or run_lab)(sources.root / "labs" / "lab6_ddp_from_scratch.py", args)
        passed = {record["impl"]: record["check_passed"] for record in records or []}
        zero = re.search(r"^\s*zero-1 .*\b(PASS|FAIL)\s*$", result.stdout, re.MULTILINE)
        for part, (check, impl, _) in LAB6_PARTS.items():
            if impl not in impls:
                continue
            ok = (bool(zero) and zero.group(1) == "PASS") if impl == "zero" else passed.get(impl, False)
            rows[part] = Row.of("lab6", check, "PASS" if ok else "FAIL", lab_line(result, "zero-1" if impl == "zero" else impl, ok))
    return [rows[part] for part in sorted(rows)] + [gpu_row("lab6", "the wrappers on GPUs (NCCL)", exercise_file)]


# Lab 8's per-part checks (labs/lab8_fsdp.py --part K prints one "part N  PASS|FAIL  name: detail" line
# for each check of parts 1 to K), as the grader lists them when a part cannot be run.
LAB8_CHECKS = {
    1: ["shard_rows", "gather_full_params"],
    2: ["forward", "full weights only around their use"],
    3: ["the lab's whole check of --impl fsdp"],
}
PART_LINE = re.compile(r"^part (\d+)\s+(PASS|FAIL)\s+(.+?): (.*)$", re.MULTILINE)


def lab8_rows(sources: Sources, run=None) -> list[Row]:
    """labs/lab8_fsdp.py --part K, K the last part of labs/minifsdp.py that has no TODO left (and none before it)."""
    exercise_file = sources.root / sources.module() / "minifsdp.py"
    left = todo_parts(exercise_file, 8)
    done = 0
    while done + 1 in LAB8_CHECKS and done + 1 not in left:
        done += 1
    rows = []
    if done:
        result = (run or run_command_of_lab)(sources.root / "labs" / "lab8_fsdp.py", ["--part", str(done), "--module", sources.module()])
        for part, status, name, detail in PART_LINE.findall(result.stdout):
            rows.append(Row.of("lab8", f"part {part}: {name}", status, detail))
        ran = {int(part) for part, *_ in PART_LINE.findall(result.stdout)}
        for part in range(1, done + 1):
            if part not in ran:  # the job ended before this part's lines
                rows += [Row.of("lab8", f"part {part}: {name}", "FAIL", lab_failure(result, "part")) for name in LAB8_CHECKS[part]]
    for part in range(done + 1, max(LAB8_CHECKS) + 1):
        why = (f"not done: TODO(lab 8, part {part}) still raises in {display(exercise_file, sources)}" if part in left
               else f"needs part {done + 1} first (labs/lab8_fsdp.py --part {part} runs parts 1 to {part})")  # fmt: skip
        rows += [Row.of("lab8", f"part {part}: {name}", "FAIL", why) for name in LAB8_CHECKS[part]]
    rows.sort(key=lambda row: int(row.check.split()[1].rstrip(":")))
    return rows + [gpu_row("lab8", "peak memory per rank on GPUs", exercise_file)]


def run_command_of_lab(script: Path, args: list[str]):
    """torchrun --standalone --nproc_per_node=2 script args: its RunResult (labs that print their verdicts)."""
    from ddp_course.launch import run_torchrun

    return run_torchrun(script, args, nproc=2, timeout_s=LAB_TIMEOUT_S)


def run_lab(script: Path, args: list[str]):
    """torchrun --standalone --nproc_per_node=2 script args --json FILE; (RunResult, its records or None)."""
    from ddp_course.launch import run_torchrun

    with tempfile.TemporaryDirectory(prefix="grade_lab_") as folder:
        report = Path(folder) / "records.json"
        result = run_torchrun(script, [*args, "--json", report], nproc=2, timeout_s=LAB_TIMEOUT_S)
        records = json.loads(report.read_text()) if report.exists() else None
    return result, records


def lab_line(result, impl: str, passed: bool) -> str:
    """The lab's own line about impl's check ("naive  max|w - one process| 1.2e-07 ... PASS"), squeezed to one space."""
    verdict = "PASS" if passed else "FAIL"
    lines = [" ".join(line.split()) for line in result.stdout.splitlines() if line.strip().startswith(impl + " ") and verdict in line]
    return lines[0][:200] if lines else (f"the lab's check of {impl} passed" if passed else lab_failure(result, impl))


def lab_failure(result, impl: str) -> str:
    """Why a lab's check of impl did not pass, in one line: the lab's own error line, or its FAIL line."""
    if result.timed_out:
        return f"the lab's job did not finish within {LAB_TIMEOUT_S} s"
    errors = [line for line in result.stderr.splitlines() if ": error: " in line]
    fails = [" ".join(line.split()) for line in result.stdout.splitlines() if line.strip().startswith(impl) and "FAIL" in line]
    return (fails or errors or [f"the lab's job ended with exit status {result.returncode}"])[0][:200]


def gpu_row(exercise: str, check: str, path: Path) -> Row:
    """A criterion only GPUs can show: BLOCKED on a machine without them (the course's GPU paths are not run by it)."""
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        return Row.of(exercise, check, "BLOCKED", NO_GPU.format(gpus=gpus))
    return Row.of(exercise, check, "BLOCKED", f"{gpus} GPU(s) here: the grader does not launch GPU jobs; run the lab's GPU commands (README) on {path.name}")


def display(path: Path, sources: Sources) -> str:
    try:
        return str(path.relative_to(sources.root))
    except ValueError:
        return str(path)


# --- the table, the JSON file and the exit status ----------------------------------------------------------
EXERCISES = ("lectures", "lab3", "lab4", "lab6", "lab8", "lab10")


def grade(sources: Sources, only=None, graders=None) -> list[Row]:
    """Every row, in the order of EXERCISES; only: names from EXERCISES or lectureN; graders: tests replace some."""
    graders = {"lectures": lecture_rows, "lab3": lab3_rows, "lab4": lab4_rows, "lab6": lab6_rows, "lab8": lab8_rows, "lab10": lab10_rows, **(graders or {})}
    rows = []
    for name in EXERCISES:
        wanted = not only or name in only or (name == "lectures" and any(o.startswith("lecture") or o == "optional" for o in only))
        if not wanted:
            continue
        found = graders[name](sources)
        if name == "lectures" and only and "lectures" not in only:
            found = [row for row in found if row.exercise in only]
        rows += found
    return rows


def table(rows: list[Row]) -> str:
    """The rows as a fixed-width table, then the totals."""
    header = f"{'exercise':<10} {'check':<48} {'status':<7} {'points':>6}  reason"
    lines = [header, "-" * len(header)]
    for row in rows:
        points = f"{row.points}/{row.max_points}" if row.max_points else "-"
        lines.append(f"{row.exercise:<10} {row.check[:48]:<48} {row.status:<7} {points:>6}  {row.reason}")
    lines.append(totals(rows))
    return "\n".join(lines)


def totals(rows: list[Row]) -> str:
    earned, possible = sum(r.points for r in rows), sum(r.max_points for r in rows)
    failed, blocked = sum(r.status == "FAIL" for r in rows), sum(r.status == "BLOCKED" for r in rows)
    line = f"total: {earned}/{possible} points; {failed} failed, {blocked} blocked (not counted)"
    if unjudged(rows):
        line += f"; not passed: {', '.join(unjudged(rows))}, where no check could be decided (every row BLOCKED)"
    return line


def report(rows: list[Row], sources: Sources, seconds: float) -> dict:
    return {
        "graded": "solutions" if sources.solutions else "your files",
        "rows": [{**row.as_json(), "points": row.points, "max_points": row.max_points} for row in rows],
        "points": sum(r.points for r in rows), "max_points": sum(r.max_points for r in rows),
        "passed": exit_status(rows) == 0, "seconds": round(seconds, 1),
    }  # fmt: skip


def unjudged(rows: list[Row]) -> list[str]:
    """The exercises none of whose rows ran (every row BLOCKED): nothing was judged, so nothing passed."""
    return sorted({row.exercise for row in rows} - {row.exercise for row in rows if row.status != "BLOCKED"})


def exit_status(rows: list[Row]) -> int:
    """0 only when every row that ran passed (BLOCKED rows did not run) and every exercise had a row that ran."""
    return 0 if all(row.status in ("PASS", "BLOCKED") for row in rows) and not unjudged(rows) else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--lecture-worker"]:
        return lecture_worker(argv[1])
    choices = (*EXERCISES, *(name for name, _, _ in Sources().lectures()))
    parser = CourseArgumentParser(prog="python -m ddp_course.grade", description=__doc__.split("\n\n")[0])
    parser.add_argument("--solutions", action="store_true", help="grade the course's solutions instead of your files")
    parser.add_argument("--only", action="append", choices=choices, metavar="EXERCISE", help=f"grade only these: {', '.join(choices)}")
    parser.add_argument("--json", default=str(REPO_ROOT / "runs" / "grade.json"), help="write the table here as JSON (default runs/grade.json)")
    args = parser.parse_args(argv)
    json_path = Path(args.json)
    if json_path.is_dir() or not json_path.parent.exists() and json_path.parent != REPO_ROOT / "runs":
        parser.error(f"--json {args.json}: give a file in an existing folder")
    sources = Sources(solutions=args.solutions)
    started = time.perf_counter()
    print(f"grading {'the solutions' if args.solutions else 'your files'} (labs run on 2 CPU processes; a few minutes)", flush=True)
    rows = grade(sources, only=args.only)
    print(table(rows))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report(rows, sources, time.perf_counter() - started), indent=1) + "\n")
    print(f"written: {json_path}")
    return exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())
