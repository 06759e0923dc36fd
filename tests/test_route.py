"""One route through the course: the README's syllabus table, and every notebook's first and last lines agree with it.

Each notebook on the route opens with "**Before:** <the previous step> ...; route step i of n" and its last
markdown line is "**Next:** <the next step> ..." (the last step's Next is the course's wrap-up), so a
learner who follows the lines follows the table.
"""

import json
import re

import pytest

from ddp_course.launch import REPO_ROOT

README = (REPO_ROOT / "README.md").read_text()


def route() -> list[tuple[str, str]]:
    """[(step name, notebook path)] in the order of the README's syllabus table."""
    rows = re.findall(r"^\| (\d+) \| ((?:lecture|lab) \d+\w?) \|(.*)$", README, flags=re.MULTILINE)
    assert [int(number) for number, _, _ in rows] == list(range(1, len(rows) + 1)), "the table's steps are numbered 1..n"
    return [(name, re.search(r"\(((?:lectures|labs)/[^)]+\.ipynb)\)", rest).group(1)) for _, name, rest in rows]


ROUTE = route()


def markdown_lines(path: str) -> tuple[list[str], list[str]]:
    """The first and the last markdown cell's lines."""
    cells = json.loads((REPO_ROOT / path).read_text())["cells"]
    markdown = ["".join(cell["source"]) for cell in cells if cell["cell_type"] == "markdown"]
    return markdown[0].splitlines(), markdown[-1].strip().splitlines()


def names(text: str, step: str) -> bool:
    return re.search(rf"\b{step}\b", text) is not None


def test_the_route_line_lists_the_table_in_order():
    line = re.search(r"\*\*The route:\*\* (.*?)\. Follow", README, flags=re.DOTALL).group(1)
    assert [step.strip() for step in " ".join(line.split()).split("->")] == [name for name, _ in ROUTE]


@pytest.mark.parametrize("index", range(len(ROUTE)), ids=[name for name, _ in ROUTE])
def test_before_and_next_follow_the_table(index):
    name, path = ROUTE[index]
    first, last = markdown_lines(path)
    before = next((line for line in first if line.startswith("**Before:**")), None)
    assert before is not None, f"{path}: its first markdown cell has no **Before:** line"
    assert f"route step {index + 1} of {len(ROUTE)}" in before, before
    if index > 0:
        assert names(before, ROUTE[index - 1][0]), f"{path}: Before should name {ROUTE[index - 1][0]}: {before}"
    assert last[-1].startswith("**Next:**") or any(line.startswith("**Next:**") for line in last), f"{path}: no **Next:** line at its end"
    next_line = " ".join(last[[i for i, line in enumerate(last) if line.startswith("**Next:**")][-1] :])
    if index + 1 < len(ROUTE):
        assert names(next_line, ROUTE[index + 1][0]), f"{path}: Next should name {ROUTE[index + 1][0]}: {next_line}"
    else:
        assert "wrap-up" in next_line


def test_every_notebook_of_lectures_and_labs_is_on_the_route_or_optional():
    on_route = {path for _, path in ROUTE}
    notebooks = {str(path.relative_to(REPO_ROOT)) for folder in ("lectures", "labs") for path in (REPO_ROOT / folder).glob("*.ipynb")}
    assert notebooks - on_route == {"lectures/optional_beyond_data_parallelism.ipynb"}


def test_every_syllabus_row_has_the_tables_four_cells():
    """A row with one cell too many (`||`) loses its last cell on GitHub: the "After it you can" text vanished
    from six rows once (issue 29). Pipes inside backticks are code, not cell borders."""
    header = "| Step | Notebook | What it covers | After it you can |"
    assert header in README
    rows = re.findall(r"^\| \d+ \| (?:lecture|lab) \d+\w? \|.*$", README, flags=re.MULTILINE)
    for row in rows:
        outside_code = re.sub(r"`[^`]*`", "", row)
        assert outside_code.count("|") == 5 and "||" not in outside_code, row[:120]
