"""Lab 3's conversion checklist: the learner's copy (labs/convert_checklist.md) lists each decision, where the
course teaches it and which check catches it, but not what is right (issue 38, section 2); the answers live in
solutions/convert_checklist_answers.md, row for row; and every check a row names is the conversion checker's
check of that number and name."""

import re

from ddp_course.checking.conversion import CHECKS
from ddp_course.launch import REPO_ROOT

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
    assert header == ["#", "decision", "taught in", "caught by"]
    assert [int(row[0]) for row in rows] == list(range(1, 20))
    answer_header, answers = table(ANSWERS)
    assert answer_header == ["#", "decision", "what is right"]
    # The same decisions in the same order: the checklist's name of each, before its question.
    assert [[row[0], row[1].split(":")[0]] for row in rows] == [answer[:2] for answer in answers]
    assert all(len(answer[2].split()) >= 4 for answer in answers), "every decision has a written answer"
    assert "solutions/convert_checklist_answers.md" in CHECKLIST  # the learner is told where, and when


def test_every_check_the_checklist_names_is_the_checkers_check_of_that_number():
    _, rows = table(CHECKLIST)
    named = {}
    for row in rows:
        for number, name in re.findall(r"check (\d+) \(([\w-]+)", row[3]):
            named[int(number)] = name
    assert named == {number: name for number, (name, _) in CHECKS.items()}, "each of the 13 checks, under its own name"
