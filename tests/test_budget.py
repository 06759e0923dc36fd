"""The course's size and time: the word and cell budgets hold, every section is tagged core or deep dive,
every exercise states its time, and the README's core-path table says what ddp_course.authoring.budget counts."""

import json

from ddp_course.authoring import budget
from ddp_course.launch import REPO_ROOT

COUNTS = [budget.count_notebook(step, path) for step, path in budget.route()]


def test_every_budget_holds_and_every_section_is_tagged():
    broken = [line for ok, line in budget.budget_lines(COUNTS) if not ok]
    assert not broken, "\n".join(broken)


def test_the_readmes_core_path_table_is_the_counters():
    readme = (REPO_ROOT / "README.md").read_text()
    for row in budget.readme_rows(COUNTS):
        assert row in readme.splitlines(), f"README's row should read {row!r} (python -m ddp_course.authoring.budget --readme)"


def test_every_exercise_states_its_time_and_the_counter_adds_it(tmp_path, monkeypatch):
    cells = [
        {"cell_type": "markdown", "metadata": {}, "source": ["# Lab 0\n\n**Predict:** one minute.\n\n## 1. Run it [core]"]},
        {"cell_type": "code", "metadata": {}, "source": ["a = 1\nb = 2"], "outputs": [{"output_type": "stream", "name": "stdout", "text": ["x\n", "y\n"]}], "execution_count": 1},
        {"cell_type": "markdown", "metadata": {}, "source": ["### Exercise 1: decide (about 20 min)\n\n## 2. More [deep dive]\n\n### Exercise 2: no time"]},
        {"cell_type": "markdown", "metadata": {}, "source": ["## 3. Check your understanding (about 1 h) [deep dive]"]},
    ]  # fmt: skip
    (tmp_path / "nb.ipynb").write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    monkeypatch.setattr(budget, "REPO_ROOT", tmp_path)
    count = budget.count_notebook("lab 0", "nb.ipynb")
    assert count.unstated == ["Exercise 2: no time"]
    assert (False, "nb.ipynb: exercises that state no time '(about N min)': ['Exercise 2: no time']") in budget.budget_lines([count])
    assert (count.core.stated_minutes, count.core.predictions, count.deep.stated_minutes) == (20, 1, 60)
    assert count.core.exercise_minutes == 21
    assert (count.core.code_lines, count.core.output_lines) == (2, 2)
    # reading: 0.75 min for the cell, 2/25 for its code and 2/30 for its output, plus the words at 120 a minute
    words = count.core.words
    assert abs(count.core.reading_minutes - (words / 120 + 0.75 + 2 / 25 + 2 / 30)) < 1e-9


def test_a_core_cell_that_prints_a_wall_is_reported(tmp_path, monkeypatch):
    wall = {"output_type": "stream", "name": "stdout", "text": ["line\n"] * 61}
    cells = [
        {"cell_type": "markdown", "metadata": {}, "source": ["## 1. Core [core]"]},
        {"cell_type": "code", "metadata": {}, "source": ["print()"], "outputs": [wall], "execution_count": 1},
        {"cell_type": "code", "metadata": {}, "source": ["x = 1\n" * 41], "outputs": [], "execution_count": 2},
        {"cell_type": "markdown", "metadata": {}, "source": ["## 2. Deep [deep dive]"]},
        {"cell_type": "code", "metadata": {}, "source": ["print()"], "outputs": [wall], "execution_count": 3},
    ]  # fmt: skip
    (tmp_path / "nb.ipynb").write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    monkeypatch.setattr(budget, "REPO_ROOT", tmp_path)
    count = budget.count_notebook("lab 0", "nb.ipynb")
    assert count.walls == ["cell 1: 1 lines of code, 61 lines of output", "cell 2: 41 lines of code, 0 lines of output"]
    # and the enforced budget fails on them, by cell
    assert (False, "nb.ipynb: core cell 2: 41 lines of code, 0 lines of output") in budget.budget_lines([count])


def test_no_core_cell_of_the_route_prints_a_wall():
    """Issue 38: a core cell shows at most 40 lines of code and 60 lines of output; plumbing lives in
    ddp_course behind a one-line call, and a long listing is split beside the facts it explains."""
    walls = [f"{count.path}: {wall}" for count in COUNTS for wall in count.walls]
    assert not walls, "\n".join(walls)


def test_the_counter_splits_core_from_deep_dive_and_finds_untagged_sections(tmp_path, monkeypatch):
    cells = [
        {"cell_type": "markdown", "metadata": {}, "source": ["# Title\n\nIntro words count as core."]},  # 6 words
        {"cell_type": "code", "metadata": {}, "source": ["x = 1"], "outputs": [], "execution_count": 1},
        {"cell_type": "markdown", "metadata": {}, "source": ["## 1. Setup [core]\n\nTwo words.\n\n## 2. Proof [deep dive]\n\nThree more words."]},
        {"cell_type": "code", "metadata": {}, "source": ["y = 2"], "outputs": [], "execution_count": 2},
        {"cell_type": "markdown", "metadata": {}, "source": ["## Summary\n\nall-reduce don't"]},  # untagged: core, flagged
    ]  # fmt: skip
    (tmp_path / "nb.ipynb").write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    monkeypatch.setattr(budget, "REPO_ROOT", tmp_path)
    count = budget.count_notebook("lab 0", "nb.ipynb")
    # words, tags included (a reader sees them): "Title Intro words count as core" 6; "1 Setup core Two words" 5;
    # "2 Proof deep dive Three more words" 7; "Summary all-reduce don't" 3
    assert (count.words, count.core_words, count.deep_words) == (21, 14, 7)
    assert (count.code_cells, count.core_code_cells) == (2, 1)
    assert count.untagged == ["Summary"]
    lines = budget.budget_lines([count])
    assert (False, "nb.ipynb: sections without [core] or [deep dive]: ['Summary']") in lines


def test_the_counter_counts_every_markdown_word_a_reader_sees_tags_included():
    """The route's total is every word of every markdown cell, the `[core]` and `[deep dive]` tags too: the
    same number an outside check gets by counting the notebooks' markdown with the counter's WORD pattern."""
    every_word = 0
    for _, path in budget.route():
        cells = json.loads((REPO_ROOT / path).read_text())["cells"]
        every_word += sum(len(budget.WORD.findall("".join(cell["source"]))) for cell in cells if cell["cell_type"] == "markdown")
    assert sum(count.words for count in COUNTS) == every_word


def test_the_route_is_the_readmes_table():
    assert [step for step, _ in budget.route()][:3] == ["lecture 1", "lab 3", "lecture 2"]
    assert ("lecture 5b", "lectures/05b_memory.ipynb") in budget.route()
