"""Every lecture's exercises cannot drift from their solutions (CONTRIBUTING.md, "Adding an exercise").

nbval runs each lecture and its solutions notebook. This module checks, for every pair, what nbval
cannot: each exercise cell of the lecture is its solution cell with every `# SOLUTION START` ...
`# SOLUTION END` block replaced by the stub that raises; the check cells are identical in both
notebooks; and the stored outputs end in "correct" (solutions) and "not solved yet" (lecture). Each
lecture's tests/test_lectureNN_exercises.py runs the checks against the solutions and wrong answers.
"""

import re

import pytest

from ddp_course.launch import REPO_ROOT
from ddp_course.notebooks import cells_titled, without_solution

# Lectures with exercises (lecture 2's exercises are checked by tests/test_02_collectives_exercises.py).
LECTURES = (
    "01_data_parallelism", "03_samplers", "04_ddp_internals", "05a_step_time", "05b_memory", "06_debugging_fault_tolerance",
    "07_sharded_data_parallelism",
)  # fmt: skip


def notebook_pair(name):
    return REPO_ROOT / "lectures" / f"{name}.ipynb", f"solutions/{name}_solutions.ipynb"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", LECTURES)
def test_each_exercise_is_its_solution_with_the_marked_parts_removed(name):
    lecture, solutions_path = notebook_pair(name)
    solutions, exercises = cells_titled(REPO_ROOT / solutions_path, "# Exercise "), cells_titled(lecture, "# Exercise ")
    assert 1 <= len(solutions) <= 4 and solutions.keys() == exercises.keys()  # lecture 5b has one
    for title, (solution, _) in solutions.items():
        number = int(re.match(r"# Exercise (\d+):", title).group(1))
        assert "# SOLUTION START" in solution and "# SOLUTION END" in solution, title
        assert exercises[title][0] == without_solution(solution, number, solutions_path), title


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
