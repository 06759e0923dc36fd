"""Lab 3's conversion checklist: the learner's copy (labs/convert_checklist.md) lists each decision, its part of
the exercise, where the course teaches it and which check catches it, but not what is right (issue 38, section
2); the answers live in solutions/convert_checklist_answers.md, row for row; and every check a row names is
the conversion checker's check of that number and name.

The exercise's two parts (issue 38, section 2): part A at route step 2 (lab 3 section 7), part B after
lecture 6. Every "taught in" of a part-A row and every hint of a part-A check names only core sections of
the notebooks at or before route step 2 (lecture 1, lab 3); part B's name only core sections of notebooks
up to lecture 6. A learner at a part's place in the route can read every section it points to."""

import json
import re

import pytest

from ddp_course.authoring.budget import route, section_tag
from ddp_course.checking.conversion import CHECKS, PART_A_CHECKS, PART_B_CHECKS, WAITS_FOR
from ddp_course.launch import REPO_ROOT
from test_cross_references import SECTION_REFERENCE, numbers_in

CHECKLIST = (REPO_ROOT / "labs" / "convert_checklist.md").read_text()
ANSWERS = (REPO_ROOT / "solutions" / "convert_checklist_answers.md").read_text()


def table(markdown: str) -> tuple[list[str], list[list[str]]]:
    """(the header's cells, each row's cells) of the one table in a markdown file."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    header, rule, *rows = lines
    assert set(rule) <= set("|-: "), rule
    return cells(header), [cells(row) for row in rows]


def cells(line: str) -> list[str]:
    """A table row's cells (no cell of these tables holds " | ")."""
    return [cell.strip() for cell in line.strip("|").split(" | ")]


def test_the_learners_checklist_has_no_answer_column_and_its_answers_are_in_solutions():
    header, rows = table(CHECKLIST)
    assert header == ["#", "part", "decision", "taught in", "caught by"]
    assert [int(row[0]) for row in rows] == list(range(1, 20))
    answer_header, answers = table(ANSWERS)
    assert answer_header == ["#", "decision", "what is right"]
    # The same decisions in the same order: the checklist's name of each, before its question.
    assert [[row[0], row[2].split(":")[0]] for row in rows] == [answer[:2] for answer in answers]
    assert all(len(answer[2].split()) >= 4 for answer in answers), "every decision has a written answer"
    assert "solutions/convert_checklist_answers.md" in CHECKLIST  # the learner is told where, and when


def test_every_check_the_checklist_names_is_the_checkers_check_of_that_number():
    _, rows = table(CHECKLIST)
    named = {}
    for row in rows:
        for number, name in re.findall(r"check (\d+) \(([\w-]+)", row[4]):
            named[int(number)] = name
    assert named == {number: name for number, (name, _) in CHECKS.items()}, "each of the 13 checks, under its own name"


# --- the two parts: where each points ------------------------------------------------------------------
ROUTE = [name for name, _ in route()]
LAST_STEP = {"A": ROUTE.index("lab 3"), "B": ROUTE.index("lecture 6")}  # the last notebook a part may point to


def section_tags(path) -> dict[str, str]:
    """{section number: 'core' or 'deep dive'} of a notebook: a `## ` heading's own tag ("## 2.3 ... [deep
    dive]" too); a `### N.M` heading inherits the tag of the `## ` heading above it."""
    tags, current = {}, None
    for cell in json.loads((REPO_ROOT / path).read_text())["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        for line in "".join(cell["source"]).splitlines():
            heading = re.match(r"^(#{2,3}) (\d+(?:\.\d+)*)\.?\s", line)
            if line.startswith("## "):
                current = section_tag(line[3:])
            if heading:
                tags[heading.group(2)] = current
    return tags


TAGS = {name: section_tags(path) for name, path in route()}


def homes_out_of_reach(text: str, part: str) -> list[str]:
    """The references in text ("lecture 4 §2.7", "lab 3 section 2") a learner at the end of `part`'s place in the
    route could not read in the core: a later notebook, or a deep dive (each bare "§N" after a "lecture N")."""
    out = []
    for match in SECTION_REFERENCE.finditer(text):
        kind = (match.group("kind") or "lecture").lower()
        name = f"{kind} {match.group('id').lower()}"
        for number in numbers_in(match.group("numbers")):
            if name not in ROUTE or ROUTE.index(name) > LAST_STEP[part]:
                out.append(f"{name} §{number}: after part {part}'s place in the route")
            elif TAGS[name].get(number) != "core":
                out.append(f"{name} §{number}: {TAGS[name].get(number) or 'no such section'}, not core")
    return out


def test_the_section_tags_are_read():
    """A check that the reader above can fail: lecture 4's 2.3 is a deep dive inside a core section 2."""
    assert TAGS["lecture 4"]["2.7"] == "core" and TAGS["lecture 4"]["2.3"] == "deep dive" and TAGS["lab 3"]["4"] == "deep dive"
    assert homes_out_of_reach("lecture 3 §1; lab 3 section 4", "A") == ["lecture 3 §1: after part A's place in the route", "lab 3 §4: deep dive, not core"]
    assert homes_out_of_reach("lecture 1 §4; lab 3 §2", "A") == []


def test_every_row_has_a_part_and_each_parts_checks_are_caught_by_its_rows():
    _, rows = table(CHECKLIST)
    assert {row[1] for row in rows} == {"A", "B"}
    caught = {part: {int(n) for row in rows if row[1] == part for n in re.findall(r"checks? (\d+)|and (\d+)", row[4]) for n in n if n} for part in "AB"}
    assert caught["A"] <= set(PART_A_CHECKS), caught  # a part-A decision is judged in part A
    assert set(PART_B_CHECKS) <= caught["B"], caught  # every part-B check has its decision in part B


@pytest.mark.parametrize("part", ["A", "B"])
def test_each_parts_taught_in_names_only_core_sections_at_or_before_its_place(part):
    _, rows = table(CHECKLIST)
    out = {row[0]: homes_out_of_reach(row[3], part) for row in rows if row[1] == part}
    assert not any(out.values()), out
    assert all(SECTION_REFERENCE.search(row[3]) for row in rows if row[1] == part), "every row names a section"


@pytest.mark.parametrize("part", ["A", "B"])
def test_each_parts_hints_name_only_core_sections_at_or_before_its_place(part):
    """The checker's hint on a FAIL (and, for a part-B check under --part A, its WAITS line) points to a core
    home the learner has reached: at route step 2 for part A's checks, by the end of lecture 6 for part B's."""
    numbers = PART_A_CHECKS if part == "A" else PART_B_CHECKS
    texts = {number: CHECKS[number][1] + (" " + WAITS_FOR[number] if part == "B" else "") for number in numbers}
    out = {number: homes_out_of_reach(text, part) for number, text in texts.items()}
    assert not any(out.values()), out
    assert all(SECTION_REFERENCE.search(text) for text in texts.values()), "every hint names a section"
