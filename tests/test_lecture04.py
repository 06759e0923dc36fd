"""Lecture 04's exercises cannot drift from their solutions, and the stored verdicts are honest.

Each exercise cell of the lecture must be its solution cell with every `# SOLUTION START` ...
`# SOLUTION END` block replaced by the stub that raises; the check cells must be the same in both
notebooks; the stored outputs must end in "correct" (solutions) and "not solved yet" (lecture).
tests/test_lecture04_exercises.py runs the checks against wrong answers; tests/test_lecture04_demos.py
checks the facts the lecture prints from its 2-rank job.
"""

import json
import re

import pytest

from ddp_course.launch import REPO_ROOT

LECTURE = REPO_ROOT / "lectures" / "04_ddp_internals.ipynb"
SOLUTIONS = REPO_ROOT / "solutions" / "04_ddp_internals_solutions.ipynb"
STUB = "# YOUR CODE HERE (solution: solutions/04_ddp_internals_solutions.ipynb)"
MARKED_BLOCK = re.compile(r"^( *)# SOLUTION START\n.*?^ *# SOLUTION END$", re.MULTILINE | re.DOTALL)


def titled_cells(path, prefix):
    """{first line: (source, stored stdout)} of the code cells starting with prefix."""
    found = {}
    for cell in json.loads(path.read_text())["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] == "code" and text.startswith(prefix):
            printed = "".join("".join(out.get("text", "")) for out in cell["outputs"] if out["output_type"] == "stream")
            found[text.splitlines()[0]] = (text, printed)
    return found


def stubbed(solution_source, number):
    return MARKED_BLOCK.sub(lambda m: f'{m.group(1)}{STUB}\n{m.group(1)}raise NotImplementedError("exercise {number}")', solution_source)


@pytest.mark.timeout(30)
def test_exercise_cells_are_the_solutions_without_the_marked_blocks():
    solved, lecture = titled_cells(SOLUTIONS, "# Exercise "), titled_cells(LECTURE, "# Exercise ")
    assert 2 <= len(solved) <= 4 and solved.keys() == lecture.keys()
    for title, (source, _) in solved.items():
        number = int(re.match(r"# Exercise (\d+):", title).group(1))
        assert "# SOLUTION START" in source, title
        assert lecture[title][0] == stubbed(source, number), title


@pytest.mark.timeout(30)
def test_checks_are_shared_and_stored_verdicts_match():
    solved, lecture = titled_cells(SOLUTIONS, "# Check exercise "), titled_cells(LECTURE, "# Check exercise ")
    assert solved.keys() == lecture.keys() and len(solved) >= 2
    for title, (source, printed) in solved.items():
        number = re.match(r"# Check exercise (\d+)", title).group(1)
        assert source == lecture[title][0], title
        assert printed.strip().splitlines()[-1] == f"exercise {number}: correct", title
        assert lecture[title][1].strip().splitlines()[-1].startswith(f"exercise {number}: not solved yet"), title
