"""Lecture 03's exercises cannot drift from their solutions (course guide 4.9).

nbval runs both notebooks; this module checks that each exercise cell of the lecture is its
solution cell with every block between the markers replaced by a stub that raises, that the check
cells are identical, and that the stored outputs say "correct" for the solutions and "not solved
yet" for the lecture. tests/test_lecture03_exercises.py runs the checks against the solutions and
against wrong answers.
"""

import json
import re

import pytest

from ddp_course.launch import REPO_ROOT

LECTURE = REPO_ROOT / "lectures" / "03_samplers.ipynb"
SOLUTIONS = REPO_ROOT / "solutions" / "03_samplers_solutions.ipynb"
STUB = "# YOUR CODE HERE (solution: solutions/03_samplers_solutions.ipynb)"


def cells_titled(path, prefix):
    """{first line: (source, stored stdout)} for the code cells whose source starts with prefix."""
    cells = json.loads(path.read_text())["cells"]
    found = {}
    for cell in cells:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and source.startswith(prefix):
            stdout = "".join("".join(out.get("text", "")) for out in cell["outputs"] if out["output_type"] == "stream")
            found[source.splitlines()[0]] = (source, stdout)
    return found


def without_solution(source, number):
    """Each `# SOLUTION START` ... `# SOLUTION END` block becomes the stub, at the block's indentation."""
    pattern = re.compile(r"^( *)# SOLUTION START\n.*?^ *# SOLUTION END$", re.MULTILINE | re.DOTALL)
    return pattern.sub(lambda m: f'{m.group(1)}{STUB}\n{m.group(1)}raise NotImplementedError("exercise {number}")', source)


@pytest.mark.timeout(30)
def test_each_exercise_is_its_solution_with_the_marked_parts_removed():
    solutions, exercises = cells_titled(SOLUTIONS, "# Exercise "), cells_titled(LECTURE, "# Exercise ")
    assert 2 <= len(solutions) <= 4 and solutions.keys() == exercises.keys()
    for title, (solution, _) in solutions.items():
        number = int(re.match(r"# Exercise (\d+):", title).group(1))
        assert "# SOLUTION START" in solution, title
        assert exercises[title][0] == without_solution(solution, number), title


@pytest.mark.timeout(30)
def test_check_cells_are_identical_and_stored_results_are_honest():
    solution_checks, lecture_checks = cells_titled(SOLUTIONS, "# Check exercise "), cells_titled(LECTURE, "# Check exercise ")
    assert solution_checks.keys() == lecture_checks.keys() and len(solution_checks) >= 2
    for title, (source, stdout) in solution_checks.items():
        number = re.match(r"# Check exercise (\d+)", title).group(1)
        assert source == lecture_checks[title][0], title
        # a check may print what it measured first; its verdict is the last line
        assert stdout.strip().splitlines()[-1] == f"exercise {number}: correct", title
        assert lecture_checks[title][1].strip().splitlines()[-1].startswith(f"exercise {number}: not solved yet"), title
