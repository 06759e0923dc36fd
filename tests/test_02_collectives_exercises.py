"""Lecture 2's exercises and their solutions never drift apart.

solutions/02_collectives_solutions.ipynb is run by `pytest --nbval` (its checks print "correct").
This test proves that each exercise cell of the lecture is the solution cell with the block
between "# BEGIN SOLUTION" and "# END SOLUTION" replaced by a placeholder, that the check cells
are the same in both notebooks, and that the set-up cells the solutions copy are the lecture's.
"""

import nbformat
import pytest

from ddp_course.launch import REPO_ROOT

LECTURE = REPO_ROOT / "lectures" / "02_collectives.ipynb"
SOLUTIONS = REPO_ROOT / "solutions" / "02_collectives_solutions.ipynb"
EXERCISES = (1, 2, 3)


def cells_by_tag(path) -> dict[str, list[str]]:
    found = {}
    for cell in nbformat.read(path, as_version=4).cells:
        for tag in cell.get("metadata", {}).get("tags", []):
            found.setdefault(tag, []).append(cell.source)
    return found


def without_solution(source: str) -> str:
    """The learner's version: the marked block becomes `raise NotImplementedError  # YOUR CODE HERE`."""
    lines, skipping = [], False
    for line in source.splitlines():
        if line.strip().startswith("# BEGIN SOLUTION"):
            indent = line[: len(line) - len(line.lstrip())]
            lines.append(f"{indent}raise NotImplementedError  # YOUR CODE HERE")
            skipping = True
        elif line.strip().startswith("# END SOLUTION"):
            skipping = False
        elif not skipping:
            lines.append(line)
    return "\n".join(lines)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("number", EXERCISES)
def test_exercise_is_the_solution_with_the_marked_block_removed(number):
    lecture, solutions = cells_by_tag(LECTURE), cells_by_tag(SOLUTIONS)
    [solution] = solutions[f"solution-{number}"]
    [exercise] = lecture[f"exercise-{number}"]
    assert "# BEGIN SOLUTION" in solution and "# END SOLUTION" in solution
    assert "BEGIN SOLUTION" not in exercise and "raise NotImplementedError" in exercise
    assert exercise == without_solution(solution)
    assert lecture[f"check-{number}"] == solutions[f"check-{number}"]


@pytest.mark.timeout(30)
def test_solutions_copy_the_lecture_set_up_cells():
    lecture, solutions = cells_by_tag(LECTURE), cells_by_tag(SOLUTIONS)
    assert solutions["shared"] and set(solutions["shared"]) <= set(lecture["shared"])


@pytest.mark.timeout(30)
def test_stored_outputs_show_the_exercises_open_in_the_lecture_and_solved_in_the_solutions():
    def check_outputs(path):
        texts = []
        for cell in nbformat.read(path, as_version=4).cells:
            if "check" in "".join(cell.get("metadata", {}).get("tags", [])):
                texts.append("".join(out.get("text", "") for out in cell.outputs))
        return texts

    for path in (LECTURE, SOLUTIONS):  # nbval compares nothing in a cell stored without being run
        code_cells = [cell for cell in nbformat.read(path, as_version=4).cells if cell.cell_type == "code"]
        assert all(cell.execution_count is not None for cell in code_cells), f"{path.name} is stored unexecuted"
    assert all(text.startswith("not done yet") for text in check_outputs(LECTURE))
    assert [text.split(":")[0] for text in check_outputs(SOLUTIONS)] == [f"exercise {n}" for n in EXERCISES]
    assert all(": correct" in text for text in check_outputs(SOLUTIONS))
