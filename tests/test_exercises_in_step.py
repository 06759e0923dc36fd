"""Every lecture's exercises cannot drift from their solutions (CONTRIBUTING.md, "Adding an exercise").

nbval runs each lecture and its solutions notebook. This module checks, for every pair, what nbval
cannot: each exercise cell of the lecture is what `python -m ddp_course.authoring.exercises --notebooks`
generates from its solution cell (every `# BEGIN SOLUTION` ... `# END SOLUTION` region replaced by the
stub that raises); the check cells are identical in both notebooks; and the stored outputs end in
"correct" (solutions) and "not solved yet" (lecture). Each lecture's tests/test_lectureNN_exercises.py
runs the checks against the solutions and wrong answers.
"""

import json
import re

import pytest

from ddp_course.launch import REPO_ROOT
from ddp_course.authoring.exercises import main as exercises_main
from ddp_course.authoring.exercises import notebook_pairs, stale_cells
from ddp_course.authoring.notebooks import cells_titled, shared_cells

# Lectures with exercises (lecture 2's exercises are checked by tests/test_02_collectives_exercises.py).
LECTURES = (
    "01_data_parallelism", "03_samplers", "04_ddp_internals", "05a_step_time", "05b_memory", "06_debugging_fault_tolerance",
    "07_sharded_data_parallelism",
)  # fmt: skip


def notebook_pair(name):
    return REPO_ROOT / "lectures" / f"{name}.ipynb", f"solutions/{name}_solutions.ipynb"


PAIRS = notebook_pairs(REPO_ROOT)


def test_every_solutions_notebook_has_its_lecture():
    assert len(PAIRS) == len(LECTURES) + 2  # lecture 2 and the optional notebook have their own tests too
    assert all(lecture.is_file() for lecture, _ in PAIRS), PAIRS


@pytest.mark.timeout(30)
@pytest.mark.parametrize("pair", PAIRS, ids=lambda pair: pair[0].stem)
def test_each_exercise_is_what_the_generator_makes_of_its_solution(pair):
    lecture_path, solutions_path = pair
    lecture, solutions = (json.loads(path.read_text()) for path in pair)
    shown = solutions_path.relative_to(REPO_ROOT).as_posix()
    exercises = cells_titled(lecture_path, "# Exercise ")
    assert 1 <= len(exercises) <= 4 and exercises.keys() == cells_titled(solutions_path, "# Exercise ").keys()
    assert stale_cells(lecture, solutions, shown) == []
    for title, (source, _) in exercises.items():
        assert "BEGIN SOLUTION" not in source and "raise NotImplementedError(" in source, title


def test_a_hand_edited_exercise_cell_is_found_stale(capsys, monkeypatch, tmp_path):
    """The generator's --check fails, naming the cell, when a lecture's exercise drifts from its solution."""
    for folder in ("lectures", "solutions"):
        (tmp_path / folder).mkdir()
    lecture_path, solutions_path = PAIRS[0]
    (tmp_path / "solutions" / solutions_path.name).write_text(solutions_path.read_text())
    lecture = json.loads(lecture_path.read_text())
    cell = next(c for c in lecture["cells"] if "".join(c["source"]).startswith("# Exercise "))
    cell["source"] = ["".join(cell["source"]).replace("raise NotImplementedError(", "return None  # (", 1)]
    (tmp_path / "lectures" / lecture_path.name).write_text(json.dumps(lecture))
    (tmp_path / "pyproject.toml").write_text("")
    monkeypatch.chdir(tmp_path)
    assert exercises_main(["--notebooks", "--check"]) == 1
    assert "is not what solutions/" in capsys.readouterr().err
    assert exercises_main(["--notebooks"]) == 0  # rewrites it
    assert exercises_main(["--notebooks", "--check"]) == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", LECTURES)
def test_check_cells_are_identical_and_stored_verdicts_are_honest(name):
    lecture, solutions_path = notebook_pair(name)
    solution_checks = cells_titled(REPO_ROOT / solutions_path, "# Check exercise ")
    lecture_checks = cells_titled(lecture, "# Check exercise ")
    assert solution_checks.keys() == lecture_checks.keys() and len(solution_checks) >= 1
    for title, (source, stdout) in solution_checks.items():
        number = re.match(r"# Check exercise (\d+)", title).group(1)
        assert source == lecture_checks[title][0], title
        # a check may print what it measured first; its verdict is the last line
        assert stdout.strip().splitlines()[-1] == f"exercise {number}: correct", title
        assert lecture_checks[title][1].strip().splitlines()[-1].startswith(f"exercise {number}: not solved yet"), title


ONE_CALL = re.compile(r"check_\w+\((\w+)\)")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("pair", PAIRS, ids=lambda pair: pair[0].stem)
def test_each_check_cell_is_one_call_with_what_its_exercise_defines(pair):
    """A check cell is its title and one call, `check_...(name)`, of the name its exercise cell defines:
    the learner's answer goes to the check as it is, with nothing else in the cell to edit or to break."""
    lecture_path, _ = pair
    exercises = {title.split(":")[0].split()[-1]: source for title, (source, _) in cells_titled(lecture_path, "# Exercise ").items()}
    for title, (source, _) in cells_titled(lecture_path, "# Check exercise ").items():
        number = re.match(r"# Check exercise (\d+)", title).group(1)
        [call] = source.splitlines()[1:]
        name = ONE_CALL.fullmatch(call).group(1)
        assert re.search(rf"^(def {name}\(|class {name}\b|{name} = )", exercises[number], re.MULTILINE), (title, name)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("pair", PAIRS, ids=lambda pair: pair[0].stem)
def test_solutions_copy_the_lecture_set_up_cells(pair):
    """The solutions notebook runs the lecture's own set-up cells (tag "shared"), not a drifting copy."""
    lecture_path, solutions_path = pair
    shared = shared_cells(solutions_path)
    assert set(shared) <= set(shared_cells(lecture_path))
    assert shared or lecture_path.stem in OWN_SET_UP, "a solutions notebook without the lecture's set-up cells"


# Solutions notebooks that import what their exercises use in a first cell of their own, and share nothing.
OWN_SET_UP = {"03_samplers"}
