"""How long the course takes: reading, running and the exercises, per notebook, for the core path and the route.

    python -m ddp_course.authoring.budget            # the table, then one line per budget: ok or OVER; exit 1 if any is over
    python -m ddp_course.authoring.budget --readme   # the README's two rows (core path, whole route), to paste

The route is the README's syllabus table (tests/test_route.py checks that every notebook agrees with
it). Every `## ` section heading of a route notebook ends with a tag, `[core]` or `[deep dive]`
(the README's "Core path" explains the convention): a learner with a week reads the core sections and
comes back for the rest. The words before a notebook's first `## ` heading (its title, the Before
line, the introduction) are core; a `### ` subsection belongs to its section. A heading's tag is
counted with its words (a reader sees it): `[core]` is one word, `[deep dive]` two.

Time is counted the way a careful first-time reader spends it (the rates a learner measured on
himself while working through the core path):

- reading: 120 words a minute of prose with formulas beside it, 0.75 min to run each code cell and
  glance at it, 1 min per 25 lines of code in view and 1 min per 30 lines of stored text output;
- exercises: the time each exercise and hands-on step states in its notebook, written
  `(about N min)` or `(about N h)` in its heading or instruction (every `Exercise`, `Check your
  understanding` and `Self-check` heading must state one), plus 1 min for each **Predict** prompt (stop, think, guess);
- set-up: one hour, once (install, the quick start, starting JupyterLab).

Words are counted in markdown cells only, as runs of letters and digits joined by hyphens or
apostrophes (`all-reduce` and `don't` are one word each; `2.14` is two): code, outputs and LaTeX
commands' backslashes do not count, but the words inside a formula's text do.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field

from ddp_course.launch import REPO_ROOT

WORD = re.compile(r"\w+(?:[-'’]\w+)*")
SECTION_HEADING = re.compile(r"^## (?!#)(.*)$", flags=re.MULTILINE)
TAGS = {"[core]": "core", "[deep dive]": "deep dive"}

# Rates (minutes), from the learner review of 2026-11-28, section 2.1.
WORDS_PER_MINUTE = 120
MINUTES_PER_CODE_CELL = 0.75
CODE_LINES_PER_MINUTE = 25
OUTPUT_LINES_PER_MINUTE = 30
MINUTES_PER_PREDICTION = 1.0
SETUP_HOURS = 1.0

STATED_TIME = re.compile(r"\(about (\d+(?:\.\d+)?) (min|h)\b[^)]*\)")  # "(about 2 h)", "(about 90 min, ...)"
PREDICTION = re.compile(r"\*\*?Predict")
# Headings of work a learner does, which must say how long it takes.
EXERCISE_HEADING = re.compile(r"^#{2,4} .*(Exercise \d|Check your understanding|Self-check|conversion exercise)", flags=re.MULTILINE)

# Budgets. Words and cells: issue 31. Time: issue 38 (a week of evenings, exercises included).
ROUTE_WORDS = 35_000
CORE_WORDS = 20_000
NOTEBOOK_WORDS = 3_500
NOTEBOOK_CELLS = 70
CORE_HOURS = 12.0
CORE_READING_HOURS = 5.5
CORE_EXERCISE_HOURS = 5.0
# Issue 38's limits on what one core cell may put in front of a reader.
CORE_CODE_CELL_LINES = 40
CORE_OUTPUT_LINES = 60


@dataclass
class Tally:
    """What one part (core or deep dive) of a notebook asks of a reader."""

    words: int = 0
    code_cells: int = 0
    code_lines: int = 0
    output_lines: int = 0
    predictions: int = 0
    stated_minutes: float = 0.0  # the exercises' and hands-on steps' own estimates

    def __add__(self, other: Tally) -> Tally:
        return Tally(*(getattr(self, name) + getattr(other, name) for name in self.__dataclass_fields__))

    @property
    def reading_minutes(self) -> float:
        return (
            self.words / WORDS_PER_MINUTE
            + self.code_cells * MINUTES_PER_CODE_CELL
            + self.code_lines / CODE_LINES_PER_MINUTE
            + self.output_lines / OUTPUT_LINES_PER_MINUTE
        )

    @property
    def exercise_minutes(self) -> float:
        return self.stated_minutes + self.predictions * MINUTES_PER_PREDICTION


@dataclass
class NotebookCount:
    step: str
    path: str
    core: Tally
    deep: Tally
    cells: int
    untagged: list[str] = field(default_factory=list)  # `## ` headings without a tag
    unstated: list[str] = field(default_factory=list)  # exercise headings that state no time
    walls: list[str] = field(default_factory=list)  # core cells over CORE_CODE_CELL_LINES / CORE_OUTPUT_LINES

    @property
    def words(self) -> int:
        return self.core.words + self.deep.words

    @property
    def core_words(self) -> int:
        return self.core.words

    @property
    def deep_words(self) -> int:
        return self.deep.words

    @property
    def code_cells(self) -> int:
        return self.core.code_cells + self.deep.code_cells

    @property
    def core_code_cells(self) -> int:
        return self.core.code_cells


def route(readme: str | None = None) -> list[tuple[str, str]]:
    """[(step name, notebook path)] in the order of the README's syllabus table."""
    readme = readme if readme is not None else (REPO_ROOT / "README.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ((?:lecture|lab) \d+\w?) \|(.*)$", readme, flags=re.MULTILINE)
    return [(name, re.search(r"\(((?:lectures|labs)/[^)]+\.ipynb)\)", rest).group(1)) for _, name, rest in rows]


def section_tag(heading: str) -> str | None:
    """'core', 'deep dive' or None for a `## ` heading's text."""
    for tag, name in TAGS.items():
        if heading.rstrip().endswith(tag):
            return name
    return None


def stated_minutes(text: str) -> float:
    """The minutes stated in `(about N min)` / `(about N h)` marks of a piece of markdown."""
    return sum(float(number) * (60 if unit == "h" else 1) for number, unit in STATED_TIME.findall(text))


def output_lines(cell: dict) -> int:
    """Lines of text a code cell's stored outputs show (a figure counts as its text line only)."""
    lines = 0
    for output in cell.get("outputs", []):
        text = output.get("text") or output.get("data", {}).get("text/plain") or output.get("traceback") or ""
        lines += len("".join(text).splitlines())
    return lines


def count_notebook(step: str, path: str) -> NotebookCount:
    cells = json.loads((REPO_ROOT / path).read_text())["cells"]
    count = NotebookCount(step, path, Tally(), Tally(), len(cells))
    current = "core"  # the introduction before the first section

    def part() -> Tally:
        return count.core if current == "core" else count.deep

    for index, cell in enumerate(cells):
        source = "".join(cell["source"])
        if cell["cell_type"] == "code":
            code, shown = len(source.splitlines()), output_lines(cell)
            part().code_cells += 1
            part().code_lines += code
            part().output_lines += shown
            if current == "core" and (code > CORE_CODE_CELL_LINES or shown > CORE_OUTPUT_LINES):
                count.walls.append(f"cell {index}: {code} lines of code, {shown} lines of output")
            continue
        if cell["cell_type"] != "markdown":
            continue
        count.unstated += _unstated_headings(source)
        # A cell may hold a section's last paragraph and the next heading: split it at each heading.
        pieces = SECTION_HEADING.split(source)  # [text, heading, text, heading, text, ...]
        for position, piece in enumerate(pieces):
            if position % 2 == 1:  # a heading: its words, tag included, belong to the section it opens
                tag = section_tag(piece)
                if tag is None:
                    count.untagged.append(piece.strip())
                current = tag or "core"
            part().words += len(WORD.findall(piece))
            part().predictions += len(PREDICTION.findall(piece))
            part().stated_minutes += stated_minutes(piece)
    return count


def _unstated_headings(markdown: str) -> list[str]:
    """Exercise headings in a markdown cell whose line states no time."""
    return [line.lstrip("#").strip() for line in markdown.splitlines() if EXERCISE_HEADING.match(line) and not STATED_TIME.search(line)]


def total(counts: list[NotebookCount], part: str) -> Tally:
    """The sum of one part ('core' or 'deep') over notebooks."""
    return sum((getattr(count, part) for count in counts), Tally())


def hours(counts: list[NotebookCount]) -> dict[str, dict[str, float]]:
    """{'core path' | 'whole route': {'reading': h, 'exercises': h, 'set-up': h, 'total': h}}."""
    core, deep = total(counts, "core"), total(counts, "deep")
    result = {}
    for name, tally in (("core path", core), ("whole route", core + deep)):
        reading, exercises = tally.reading_minutes / 60, tally.exercise_minutes / 60
        result[name] = {"reading": reading, "exercises": exercises, "set-up": SETUP_HOURS, "total": reading + exercises + SETUP_HOURS}
    return result


def readme_rows(counts: list[NotebookCount]) -> list[str]:
    """The README's table rows for the core path and the whole route (tests/test_budget.py compares them)."""
    rows = []
    for name, part in hours(counts).items():
        words = sum(c.core_words if name == "core path" else c.words for c in counts)
        code = sum(c.core_code_cells if name == "core path" else c.code_cells for c in counts)
        rows.append(f"| {name} | {words:,} | {code} | {part['reading']:.1f} h | {part['exercises']:.1f} h | {part['total']:.1f} h |")
    return rows


def budget_lines(counts: list[NotebookCount]) -> list[tuple[bool, str]]:
    """(within budget, what) for every budget the tests enforce: words, cells, tags, stated times, and no core
    cell over CORE_CODE_CELL_LINES lines of code or CORE_OUTPUT_LINES lines of output."""
    words = sum(count.words for count in counts)
    core = sum(count.core_words for count in counts)
    lines = [(words <= ROUTE_WORDS, f"whole route: {words:,} words (budget {ROUTE_WORDS:,})"),
             (core <= CORE_WORDS, f"core path: {core:,} words (budget {CORE_WORDS:,})")]  # fmt: skip
    for count in counts:
        lines.append((count.words <= NOTEBOOK_WORDS, f"{count.path}: {count.words:,} words (budget {NOTEBOOK_WORDS:,})"))
        lines.append((count.cells <= NOTEBOOK_CELLS, f"{count.path}: {count.cells} cells (budget {NOTEBOOK_CELLS})"))
        if count.untagged:
            lines.append((False, f"{count.path}: sections without [core] or [deep dive]: {count.untagged}"))
        if count.unstated:
            lines.append((False, f"{count.path}: exercises that state no time '(about N min)': {count.unstated}"))
        lines += [(False, f"{count.path}: core {wall}") for wall in count.walls]  # issue 38: no core cell prints a wall
    return lines


def target_lines(counts: list[NotebookCount]) -> list[tuple[bool, str]]:
    """(met, what) for issue 38's time targets: reported by the command, not yet enforced by a test."""
    core = hours(counts)["core path"]
    lines = [
        (core["total"] <= CORE_HOURS, f"core path with exercises: {core['total']:.1f} h (target {CORE_HOURS:g} h)"),
        (core["reading"] <= CORE_READING_HOURS, f"core reading and running: {core['reading']:.1f} h (target {CORE_READING_HOURS:g} h)"),
        (core["exercises"] <= CORE_EXERCISE_HOURS, f"core exercises: {core['exercises']:.1f} h (target {CORE_EXERCISE_HOURS:g} h)"),
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    counts = [count_notebook(step, path) for step, path in route()]
    if "--readme" in (argv or []):
        print("\n".join(readme_rows(counts)))
        return 0
    header = f"{'step':<11} {'notebook':<44} {'words':>6} {'core':>6} {'cells':>5} {'code':>4} {'read h':>6} {'ex. h':>5} {'core read':>9} {'core ex.':>8}"
    print(header)
    for count in counts:
        both = count.core + count.deep
        print(
            f"{count.step:<11} {count.path:<44} {count.words:>6,} {count.core_words:>6,} {count.cells:>5} {count.code_cells:>4} "
            f"{both.reading_minutes / 60:>6.1f} {both.exercise_minutes / 60:>5.1f} "
            f"{count.core.reading_minutes / 60:>9.1f} {count.core.exercise_minutes / 60:>8.1f}"
        )
    for name, part in hours(counts).items():
        print(
            f"{name}: reading and running {part['reading']:.1f} h + exercises {part['exercises']:.1f} h + set-up {part['set-up']:g} h = {part['total']:.1f} h"
        )
    failed = False
    for ok, line in budget_lines(counts):
        if not ok or line.startswith(("whole", "core")):
            print(("ok   " if ok else "OVER ") + line)
        failed |= not ok
    for ok, line in target_lines(counts):
        print(("ok   " if ok else "over target: ") + line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
