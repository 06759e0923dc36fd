"""ddp_course/self_check.py: one line of feedback for an unanswered, right or wrong self-check answer; and every
core notebook ends with a self-check in its Summary section, whose stored output is the unanswered line."""

import importlib
import json
import pkgutil
import re

import pytest

import ddp_course
from ddp_course.authoring.budget import route
from ddp_course.launch import REPO_ROOT
from ddp_course.self_check import Question, verdict

STEPS = Question("self-check", 15, why="1438 samples / (2 ranks x 48) = 14.98, rounded up", hint="reread section 2")
WORD = Question("self-check", "rank", why="the sampler needs the global rank", hint="reread section 3")


def test_no_answer_says_how_to_answer():
    assert verdict(STEPS, None) == "self-check: not answered yet - set `answer` above and run this cell again"


@pytest.mark.parametrize("answer", [15, 15.0, 15.2])
def test_a_number_within_the_tolerance_is_correct_with_its_reason(answer):
    assert verdict(STEPS, answer) == "self-check: correct - 1438 samples / (2 ranks x 48) = 14.98, rounded up"


@pytest.mark.parametrize("answer", [14, 30, -15])
def test_a_wrong_number_gets_the_hint(answer):
    assert verdict(STEPS, answer) == "self-check: not yet - reread section 2"


@pytest.mark.parametrize("answer", ["15", True, [15]])
def test_a_number_question_refuses_other_types_in_one_line(answer):
    assert verdict(STEPS, answer) == f"self-check: not yet - the answer is a number (got {answer!r})"


@pytest.mark.parametrize(("answer", "ok"), [("rank", True), (" RANK ", True), ("local_rank", False), (3, False)])
def test_a_word_matches_case_and_spaces_aside(answer, ok):
    assert verdict(WORD, answer).startswith("self-check: correct" if ok else "self-check: not yet - reread section 3")


# --- every core notebook ends with one (issue 38): its place, its call, its stored output ---------------
NUMBERED_CORE_SECTION = re.compile(r"^## \d+\..*\[core\]\s*$", re.MULTILINE)
SELF_CHECK_HEADING = re.compile(r"^### Self-check \(about \d+ min\)", re.MULTILINE)
QUESTION_IMPORT = re.compile(r"^from ddp_course\.(\w+) import (\w+)(?: as SELF_CHECK)?", re.MULTILINE)
NOT_ANSWERED = "self-check: not answered yet - set `answer` above and run this cell again"
# The modules that hold the questions, imported at collection: importing torch (which they do) starts a
# process (ldconfig) in torch's CUDA builds, which conftest refuses inside a unit test.
QUESTION_MODULES = {
    module.name: importlib.import_module(f"ddp_course.{module.name}")
    for module in pkgutil.iter_modules(ddp_course.__path__)
    if module.name.startswith("lecture") and module.name.endswith("_checks") or module.name == "lab_self_checks"
}


def core_notebooks() -> list[str]:
    """Route notebooks with at least one numbered core section (lab 10's core is its introduction only)."""
    notebooks = []
    for _, path in route():
        cells = json.loads((REPO_ROOT / path).read_text())["cells"]
        if any(NUMBERED_CORE_SECTION.search("".join(cell["source"])) for cell in cells if cell["cell_type"] == "markdown"):
            notebooks.append(path)
    return notebooks


def self_check_cells(path: str) -> tuple[str, dict]:
    """(the self-check's markdown, the code cell after it) of a notebook; fails when it has none."""
    cells = json.loads((REPO_ROOT / path).read_text())["cells"]
    section = None
    for index, cell in enumerate(cells[:-1]):
        source = "".join(cell["source"])
        headings = re.findall(r"^## .*$", source, re.MULTILINE)
        section = headings[-1] if headings else section
        if cell["cell_type"] == "markdown" and SELF_CHECK_HEADING.search(source):
            assert section and section.startswith("## Summary") and section.rstrip().endswith("[core]"), (path, section)
            return source, cells[index + 1]
    raise AssertionError(f"{path}: no '### Self-check (about N min)' cell")


def own_question(path: str) -> tuple[str, str]:
    """(module, name) of the Question a notebook must ask: a lecture's SELF_CHECK from its own checks module
    (lectures/05a_step_time.ipynb: lecture05a_checks), a lab sheet's LABN_SELF_CHECK from lab_self_checks."""
    name = path.split("/")[-1]
    if path.startswith("labs/"):
        lab = re.match(r"lab(\d+)_", name).group(1)
        return "lab_self_checks", f"LAB{lab}_SELF_CHECK"
    lecture = re.match(r"(\d+[a-z]?)_", name).group(1)
    return f"lecture{lecture}_checks", "SELF_CHECK"


@pytest.mark.parametrize("path", core_notebooks())
def test_every_core_notebook_ends_with_a_self_check(path):
    _, code = self_check_cells(path)
    source = "".join(code["source"])
    assert code["cell_type"] == "code" and "answer = None" in source and "self_check(SELF_CHECK, answer)" in source, source
    imported = QUESTION_IMPORT.search(source)
    assert imported and imported.groups() == own_question(path), source  # its own question, not a neighbour's
    question = getattr(QUESTION_MODULES[imported.group(1)], imported.group(2))
    assert isinstance(question, Question) and question.hint.startswith("reread section"), question
    stored = "".join("".join(output.get("text", "")) for output in code["outputs"])
    assert stored.strip() == NOT_ANSWERED, stored
