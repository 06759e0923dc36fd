"""Generate an exercise file from its solution, so that the two can never drift apart.

In the solution, each piece the learner writes is a marked region:

        # BEGIN SOLUTION
        # TODO(lab 6, part 2): the hint, which may continue
        #   on indented comment lines
        ...solution code...
        # END SOLUTION

make_exercise() replaces every region by `raise NotImplementedError("TODO(lab 6, part 2): the hint ...")`
at the region's indentation and puts `header` (comment lines) at the top; everything else is copied
unchanged, so classes, signatures and docstrings stay the same. `parts` keeps the solution code of the
parts not listed: an exercise half done, as a learner who has finished parts 1 and 2 has it.

    python -m ddp_course.authoring.exercises solutions/minddp.py labs/minddp.py          # (re)write the exercise
    python -m ddp_course.authoring.exercises solutions/minddp.py labs/minddp.py --check  # exit 1 if it is stale

Notebooks use the same markers. In a solutions notebook (`solutions/NAME_solutions.ipynb`) an exercise
is a code cell that starts with `# Exercise N: title`, its marked regions need no TODO line, and its
check is the cell that starts with `# Check exercise N`. The lecture (`lectures/NAME.ipynb`) holds the
same two cells, the exercise with every region replaced by one stub:

        # YOUR CODE HERE (solution: solutions/NAME_solutions.ipynb)
        raise NotImplementedError("exercise N")

    python -m ddp_course.authoring.exercises --notebooks          # rewrite every lecture's exercise and check cells
    python -m ddp_course.authoring.exercises --notebooks --check  # exit 1, naming the cells, if any is stale

Only the cells' sources are written: re-execute the lecture afterwards (python -m ddp_course.authoring.notebooks)
so that its stored outputs are the new cells'.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from ddp_course.cli import CourseArgumentParser

BEGIN = re.compile(r"^(?P<indent> *)# BEGIN SOLUTION$")
END = "# END SOLUTION"
TODO = re.compile(r"^TODO\((?P<label>[^)]*\bpart (?P<part>\d+))\): \S")
LINE_WIDTH = 110  # of the generated string literals, indentation included


@dataclass(frozen=True)
class Region:
    """One marked region: its hint and where it sits in the solution (0-based line numbers)."""

    message: str  # "TODO(lab 6, part 2): ..." - the text the exercise raises
    part: int
    begin: int  # the BEGIN SOLUTION line
    end: int  # the END SOLUTION line
    indent: str


def find_regions(lines: list[str]) -> list[Region]:
    """Every marked region of a solution, in file order; ValueError (with a line number) if a marker is malformed."""
    regions, number = [], 0
    while number < len(lines):
        match = BEGIN.match(lines[number])
        if match is None:
            if lines[number].strip() == END:
                raise ValueError(f"line {number + 1}: END SOLUTION without BEGIN SOLUTION")
            number += 1
            continue
        indent = match["indent"]
        hint_lines, cursor = [], number + 1
        while cursor < len(lines) and lines[cursor].startswith(indent + "# ") and lines[cursor].strip() != END:
            text = lines[cursor][len(indent) + 2 :]
            if hint_lines and not text.startswith("  "):
                break  # an ordinary comment of the solution code, not part of the hint
            hint_lines.append(text.strip())
            cursor += 1
        message = " ".join(hint_lines)
        todo = TODO.match(message)
        if todo is None:
            raise ValueError(f"line {number + 1}: BEGIN SOLUTION must be followed by '# TODO(... part N): hint'")
        while cursor < len(lines) and lines[cursor] != indent + END:
            if BEGIN.match(lines[cursor]):
                raise ValueError(f"line {cursor + 1}: BEGIN SOLUTION inside the region opened at line {number + 1}")
            cursor += 1
        if cursor == len(lines):
            raise ValueError(f"line {number + 1}: BEGIN SOLUTION without an END SOLUTION at the same indentation")
        regions.append(Region(message, int(todo["part"]), number, cursor, indent))
        number = cursor + 1
    return regions


def raise_statement(message: str, indent: str) -> list[str]:
    """`raise NotImplementedError("...")` as lines of at most LINE_WIDTH characters (implicit concatenation)."""
    one_line = f"{indent}raise NotImplementedError({_literal(message)})"
    if len(one_line) <= LINE_WIDTH:
        return [one_line]
    inner = indent + "    "
    pieces, current = [], ""
    for word in message.split(" "):
        candidate = f"{current} {word}" if current else word
        if current and len(inner) + len(_literal(candidate + " ")) > LINE_WIDTH:
            pieces.append(current + " ")
            current = word
        else:
            current = candidate
    pieces.append(current)
    return [f"{indent}raise NotImplementedError(", *(inner + _literal(piece) for piece in pieces), f"{indent})"]


def _literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def make_exercise(solution: str, header: str = "", parts=None) -> str:
    """The exercise text: every region (of the given parts; None: all) replaced by its raise, header on top."""
    lines = solution.split("\n")
    output, copied_up_to = [], 0
    for region in find_regions(lines):
        if parts is not None and region.part not in parts:
            continue
        output.extend(lines[copied_up_to : region.begin])
        output.extend(raise_statement(region.message, region.indent))
        copied_up_to = region.end + 1
    output.extend(lines[copied_up_to:])
    header_lines = [f"# {line}".rstrip() for line in header.splitlines()]
    return "\n".join(header_lines + output)


def exercise_header(solution_path: str, exercise_path: str) -> str:
    """The comment a generated exercise starts with: what to do, and where it comes from."""
    return (
        'Exercise: replace each `raise NotImplementedError("TODO(...)")` below with working code, part by part.\n'
        f"Generated from {solution_path} by `python -m ddp_course.authoring.exercises {solution_path} {exercise_path}`:\n"
        "course maintainers edit the solution and regenerate this file; a test checks that the two agree."
    )


def repository_root(path: Path) -> Path | None:
    """The repository that holds path: the nearest folder above it with a .git (a clone) or a pyproject.toml.

    Found from the file itself, not from where ddp_course is installed: an instructor with two clones
    and one virtual environment runs the generator of clone A on the files of clone B.
    """
    for folder in path.resolve().parents:
        if (folder / ".git").exists() or (folder / "pyproject.toml").is_file():
            return folder
    return None


def _shown(path: Path) -> str:
    """The path as the header names it: relative to its repository's root, so it is the same from any cwd and any clone."""
    root = repository_root(path)
    if root is None:
        return path.as_posix()
    return path.resolve().relative_to(root).as_posix()


# --- notebooks ---------------------------------------------------------------------------------
NOTEBOOK_REGION = re.compile(rf"^( *)# BEGIN SOLUTION\n.*?^ *{END}$", re.MULTILINE | re.DOTALL)
EXERCISE_TITLE = re.compile(r"# Exercise (\d+):")
CHECK_TITLE = re.compile(r"# Check exercise (\d+)\b")


def notebook_exercise(solution_source: str, number: int, solutions_path: str) -> str:
    """The exercise cell a learner sees: each marked region of the solution cell becomes the stub that
    names where the solution is and raises, at the region's indentation."""

    def stub(match: re.Match) -> str:
        indent = match.group(1)
        return f'{indent}# YOUR CODE HERE (solution: {solutions_path})\n{indent}raise NotImplementedError("exercise {number}")'

    return NOTEBOOK_REGION.sub(stub, solution_source)


def notebook_pairs(root: Path) -> list[tuple[Path, Path]]:
    """(lecture, its solutions notebook) for every solutions/NAME_solutions.ipynb."""
    pairs = []
    for solutions in sorted((root / "solutions").glob("*_solutions.ipynb")):
        pairs.append((root / "lectures" / solutions.name.replace("_solutions.ipynb", ".ipynb"), solutions))
    return pairs


def _code_cells(notebook: dict) -> list[dict]:
    return [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def expected_lecture_cells(solutions: dict, solutions_path: str) -> dict[str, str]:
    """{first line: the source the lecture's cell must have} for every exercise and check cell."""
    expected = {}
    for cell in _code_cells(solutions):
        source = _source(cell)
        title = source.split("\n", 1)[0]
        if exercise := EXERCISE_TITLE.match(title):
            if not NOTEBOOK_REGION.search(source):
                raise ValueError(f"{title!r} marks no region between '# BEGIN SOLUTION' and '{END}'")
            expected[title] = notebook_exercise(source, int(exercise.group(1)), solutions_path)
        elif CHECK_TITLE.match(title):
            expected[title] = source
    return expected


def stale_cells(lecture: dict, solutions: dict, solutions_path: str) -> list[str]:
    """The titles of the lecture's exercise and check cells that differ from what the solutions generate
    (missing cells included): empty when the two notebooks agree."""
    expected = expected_lecture_cells(solutions, solutions_path)
    found = {_source(cell).split("\n", 1)[0]: _source(cell) for cell in _code_cells(lecture)}
    return [title for title, source in expected.items() if found.get(title) != source]


def write_lecture_cells(lecture: dict, solutions: dict, solutions_path: str) -> list[str]:
    """Give the lecture's exercise and check cells the generated sources; returns the titles rewritten.
    A cell the lecture lacks is an error (where it goes is an author's decision, not the generator's)."""
    expected = expected_lecture_cells(solutions, solutions_path)
    rewritten = []
    for cell in _code_cells(lecture):
        title = _source(cell).split("\n", 1)[0]
        if title in expected and _source(cell) != expected[title]:
            cell["source"] = expected[title].splitlines(keepends=True)
            rewritten.append(title)
    missing = set(expected) - {_source(cell).split("\n", 1)[0] for cell in _code_cells(lecture)}
    if missing:
        raise ValueError(f"the lecture has no cell titled {sorted(missing)[0]!r}: add it where it belongs, then rerun")
    return rewritten


def sync_notebooks(root: Path, check: bool) -> int:
    """Check (or rewrite) every lecture's exercise and check cells; the exit status."""
    status = 0
    for lecture_path, solutions_path in notebook_pairs(root):
        lecture, solutions = json.loads(lecture_path.read_text()), json.loads(solutions_path.read_text())
        shown = solutions_path.relative_to(root).as_posix()
        if check:
            stale = stale_cells(lecture, solutions, shown)
            for title in stale:
                print(f"{lecture_path.relative_to(root)}: cell {title!r} is not what {shown} generates", file=sys.stderr)
            status |= bool(stale)
            continue
        rewritten = write_lecture_cells(lecture, solutions, shown)
        if rewritten:
            lecture_path.write_text(json.dumps(lecture, indent=1, ensure_ascii=False, sort_keys=True) + "\n")
            print(f"wrote {len(rewritten)} cells of {lecture_path.relative_to(root)}: re-execute it (python -m ddp_course.authoring.notebooks)")
    return status


def main(argv=None) -> int:
    parser = CourseArgumentParser(prog="python -m ddp_course.authoring.exercises", description=__doc__.split("\n\n")[0])
    parser.add_argument("solution", type=Path, nargs="?", help="solution file with BEGIN/END SOLUTION regions")
    parser.add_argument("exercise", type=Path, nargs="?", help="exercise file to write")
    parser.add_argument("--notebooks", action="store_true", help="every lecture's exercise cells from its solutions notebook")
    parser.add_argument("--check", action="store_true", help="only check that the exercise is up to date")
    args = parser.parse_args(argv)
    if args.notebooks:
        if args.solution or args.exercise:
            parser.error("--notebooks takes no files: it reads every solutions/*_solutions.ipynb")
        try:
            # the clone the command runs in (a path inside the folder, so that the folder itself is searched)
            return sync_notebooks(repository_root(Path.cwd() / "pyproject.toml") or Path.cwd(), args.check)
        except ValueError as problem:
            parser.error(str(problem))
    if args.solution is None or args.exercise is None:
        parser.error("give a solution file and an exercise file, or --notebooks")
    if not args.solution.is_file():
        parser.error(f"no such solution file: {args.solution}")
    try:
        header = exercise_header(_shown(args.solution), _shown(args.exercise))
        expected = make_exercise(args.solution.read_text(), header)
    except ValueError as problem:
        parser.error(f"{args.solution}: {problem}")
    if args.check:
        if not args.exercise.is_file() or args.exercise.read_text() != expected:
            message = f"{args.exercise} is not what {args.solution} generates; run without --check to rewrite it"
            print(message, file=sys.stderr)
            return 1
        return 0
    args.exercise.write_text(expected)
    print(f"wrote {args.exercise} ({expected.count('NotImplementedError(')} TODOs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
