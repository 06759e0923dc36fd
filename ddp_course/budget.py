"""How long the course is to read: markdown words and cells per notebook, the core path and the whole route.

    python -m ddp_course.budget            # the table, then one line per budget: ok or OVER; exit 1 if any is over

The route is the README's syllabus table (tests/test_route.py checks that every notebook agrees with
it). Every `## ` section heading of a route notebook ends with a tag, `[core]` or `[deep dive]`
(the README's "Core path" explains the convention): a learner with a week reads the core sections and
comes back for the rest. The words before a notebook's first `## ` heading (its title, the Before
line, the introduction) are core; a `### ` subsection belongs to its section.

Words are counted in markdown cells only, as runs of letters and digits joined by hyphens or
apostrophes (`all-reduce` and `don't` are one word each; `2.14` is two): code, outputs and LaTeX
commands' backslashes do not count, but the words inside a formula's text do.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from ddp_course.launch import REPO_ROOT

WORD = re.compile(r"\w+(?:[-'’]\w+)*")
SECTION_HEADING = re.compile(r"^## (?!#)(.*)$", flags=re.MULTILINE)
TAGS = {"[core]": "core", "[deep dive]": "deep dive"}
WORDS_PER_MINUTE = 150  # technical reading with code beside it; running cells is on top (see reading_hours)
MINUTES_PER_CODE_CELL = 1.0  # read the cell, run it, look at its output

# Budgets (issue 31): a course that fits a week of evenings.
ROUTE_WORDS = 35_000
CORE_WORDS = 20_000
NOTEBOOK_WORDS = 3_500
NOTEBOOK_CELLS = 70


@dataclass
class NotebookCount:
    step: str
    path: str
    words: int
    core_words: int
    cells: int
    code_cells: int
    core_code_cells: int
    untagged: list[str]  # `## ` headings without a tag

    @property
    def deep_words(self) -> int:
        return self.words - self.core_words


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


def count_notebook(step: str, path: str) -> NotebookCount:
    cells = json.loads((REPO_ROOT / path).read_text())["cells"]
    words = core_words = code_cells = core_code_cells = 0
    untagged = []
    current = "core"  # the introduction before the first section
    for cell in cells:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code":
            code_cells += 1
            core_code_cells += current == "core"
            continue
        if cell["cell_type"] != "markdown":
            continue
        # A cell may hold a section's last paragraph and the next heading: split it at each heading.
        pieces = SECTION_HEADING.split(source)  # [text, heading, text, heading, text, ...]
        for index, piece in enumerate(pieces):
            if index % 2 == 1:  # a heading: its words belong to the section it opens (the tag not counted)
                tag = section_tag(piece)
                if tag is None:
                    untagged.append(piece.strip())
                current = tag or "core"
                piece = piece.rstrip().removesuffix("[core]").removesuffix("[deep dive]")
            counted = len(WORD.findall(piece))
            words += counted
            core_words += counted if current == "core" else 0
    return NotebookCount(step, path, words, core_words, len(cells), code_cells, core_code_cells, untagged)


def reading_hours(words: int, code_cells: int) -> float:
    return (words / WORDS_PER_MINUTE + code_cells * MINUTES_PER_CODE_CELL) / 60


def budget_lines(counts: list[NotebookCount]) -> list[tuple[bool, str]]:
    """(within budget, what) for every budget of issue 31."""
    total = sum(count.words for count in counts)
    core = sum(count.core_words for count in counts)
    lines = [(total <= ROUTE_WORDS, f"whole route: {total:,} words (budget {ROUTE_WORDS:,})"),
             (core <= CORE_WORDS, f"core path: {core:,} words (budget {CORE_WORDS:,})")]  # fmt: skip
    for count in counts:
        lines.append((count.words <= NOTEBOOK_WORDS, f"{count.path}: {count.words:,} words (budget {NOTEBOOK_WORDS:,})"))
        lines.append((count.cells <= NOTEBOOK_CELLS, f"{count.path}: {count.cells} cells (budget {NOTEBOOK_CELLS})"))
        if count.untagged:
            lines.append((False, f"{count.path}: sections without [core] or [deep dive]: {count.untagged}"))
    return lines


def main(argv: list[str] | None = None) -> int:
    counts = [count_notebook(step, path) for step, path in route()]
    print(f"{'step':<11} {'notebook':<48} {'words':>6} {'core':>6} {'deep':>6} {'cells':>5} {'code':>4}")
    for count in counts:
        print(f"{count.step:<11} {count.path:<48} {count.words:>6,} {count.core_words:>6,} {count.deep_words:>6,} {count.cells:>5} {count.code_cells:>4}")
    total = sum(count.words for count in counts)
    core = sum(count.core_words for count in counts)
    code = sum(count.code_cells for count in counts)
    core_code = sum(count.core_code_cells for count in counts)
    print(f"{'route':<11} {len(counts)} notebooks{'':<36} {total:>6,} {core:>6,} {total - core:>6,} {sum(c.cells for c in counts):>5} {code:>4}")
    print(f"reading time at {WORDS_PER_MINUTE} words/min and {MINUTES_PER_CODE_CELL:g} min per code cell: "
          f"core path about {reading_hours(core, core_code):.1f} h, whole route about {reading_hours(total, code):.1f} h")  # fmt: skip
    failed = False
    for ok, line in budget_lines(counts):
        if not ok or line.startswith(("whole", "core")):
            print(("ok   " if ok else "OVER ") + line)
        failed |= not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
