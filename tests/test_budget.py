"""A course that fits a week (issue 31): the reading budgets hold, every section is tagged core or deep
dive, and the README's core-path table says what ddp_course.budget counts."""

import json
import re

import pytest

from ddp_course import budget
from ddp_course.launch import REPO_ROOT

COUNTS = [budget.count_notebook(step, path) for step, path in budget.route()]


def test_every_budget_holds_and_every_section_is_tagged():
    broken = [line for ok, line in budget.budget_lines(COUNTS) if not ok]
    assert not broken, "\n".join(broken)


def test_the_readmes_core_path_table_is_the_counters():
    readme = (REPO_ROOT / "README.md").read_text()
    core = re.search(r"^\| core path \| ([\d,]+) \| (\d+) \| about (\d+) hours \|$", readme, flags=re.MULTILINE)
    whole = re.search(r"^\| whole route \| ([\d,]+) \| (\d+) \| about (\d+) hours \|$", readme, flags=re.MULTILINE)
    assert core and whole, "the README's table of the core path and the whole route"
    core_words, core_code = sum(c.core_words for c in COUNTS), sum(c.core_code_cells for c in COUNTS)
    words, code = sum(c.words for c in COUNTS), sum(c.code_cells for c in COUNTS)
    assert (int(core[1].replace(",", "")), int(core[2])) == (core_words, core_code)
    assert (int(whole[1].replace(",", "")), int(whole[2])) == (words, code)
    assert int(core[3]) == round(budget.reading_hours(core_words, core_code))
    assert int(whole[3]) == round(budget.reading_hours(words, code))


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
    # words: "Title Intro words count as core" 6; "1 Setup Two words" 4; "2 Proof Three more words" 5; "Summary all-reduce don't" 3
    assert (count.words, count.core_words, count.deep_words) == (18, 13, 5)
    assert (count.code_cells, count.core_code_cells) == (2, 1)
    assert count.untagged == ["Summary"]
    lines = budget.budget_lines([count])
    assert (False, "nb.ipynb: sections without [core] or [deep dive]: ['Summary']") in lines


def test_the_route_is_the_readmes_table():
    assert [step for step, _ in budget.route()][:3] == ["lecture 1", "lab 3", "lecture 2"]
    assert ("lecture 5b", "lectures/05b_memory.ipynb") in budget.route()
