"""Lecture 01's exercises cannot drift from their solutions (course guide 4.9).

nbval runs both notebooks; this module checks that each exercise cell in the lecture is its
solution cell with the part between the markers removed, that the check cells are the same in
both notebooks, and that the stored outputs say "correct" for the solutions and "not solved yet"
for the lecture. tests/test_lecture01_exercises.py runs the checks against the solutions and
against wrong answers.
"""

import json
import re

import pytest

from ddp_course.launch import REPO_ROOT

LECTURE = REPO_ROOT / "lectures" / "01_data_parallelism.ipynb"
SOLUTIONS = REPO_ROOT / "solutions" / "01_data_parallelism_solutions.ipynb"
SOLUTION_START, SOLUTION_END = "# SOLUTION START", "# SOLUTION END"


def code_cells(path):
    with open(path) as file:
        cells = json.load(file)["cells"]
    return [cell for cell in cells if cell["cell_type"] == "code"]


def joined(text):
    """A notebook stores multi-line text either as one string or as a list of lines."""
    return text if isinstance(text, str) else "".join(text)


def source(cell):
    return joined(cell["source"])


def cells_titled(path, prefix):
    """{first line: cell} for the code cells whose first line starts with prefix."""
    return {source(cell).splitlines()[0]: cell for cell in code_cells(path) if source(cell).startswith(prefix)}


def stored_stdout(cell):
    return "".join(joined(output["text"]) for output in cell["outputs"] if output["output_type"] == "stream")


def without_solution(solution_source, number):
    """The exercise a learner sees: the marked block replaced by a placeholder that raises."""
    kept, inside = [], False
    for line in solution_source.split("\n"):
        if line.strip() == SOLUTION_START:
            indent = line[: len(line) - len(line.lstrip())]
            kept.append(f"{indent}# YOUR CODE HERE (solution: solutions/01_data_parallelism_solutions.ipynb)")
            kept.append(f'{indent}raise NotImplementedError("exercise {number}")')
            inside = True
        elif line.strip() == SOLUTION_END:
            inside = False
        elif not inside:
            kept.append(line)
    return "\n".join(kept)


@pytest.mark.timeout(30)
def test_each_exercise_is_its_solution_with_the_marked_part_removed():
    solutions = cells_titled(SOLUTIONS, "# Exercise ")
    exercises = cells_titled(LECTURE, "# Exercise ")
    assert 2 <= len(solutions) <= 4 and solutions.keys() == exercises.keys()
    for title, cell in solutions.items():
        number = int(re.match(r"# Exercise (\d+):", title).group(1))
        assert SOLUTION_START in source(cell) and SOLUTION_END in source(cell), title
        assert source(exercises[title]) == without_solution(source(cell), number), title


@pytest.mark.timeout(30)
def test_check_cells_are_identical_and_stored_results_are_honest():
    solution_checks = cells_titled(SOLUTIONS, "# Check exercise ")
    lecture_checks = cells_titled(LECTURE, "# Check exercise ")
    assert solution_checks.keys() == lecture_checks.keys() and len(solution_checks) >= 2
    for title, cell in solution_checks.items():
        number = re.match(r"# Check exercise (\d+)", title).group(1)
        assert source(cell) == source(lecture_checks[title]), title
        assert f"exercise {number}: correct" in stored_stdout(cell), title
        assert f"exercise {number}: not solved yet" in stored_stdout(lecture_checks[title]), title
