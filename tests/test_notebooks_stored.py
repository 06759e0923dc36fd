"""Every notebook is stored the way `pytest --nbval` can check it: executed, mostly compared, no errors.

nbval never compares a cell whose stored execution_count is null, and compares nothing in a cell
marked NBVAL_IGNORE_OUTPUT or NBVAL_SKIP; a notebook saved cleared or mostly ignored would pass
while checking nothing. Re-execute an edited notebook with `python -m ddp_course.authoring.notebooks PATH`.
"""

import json

import pytest

from ddp_course.launch import REPO_ROOT

NOTEBOOKS = sorted(path for folder in ("lectures", "labs", "solutions") for path in (REPO_ROOT / folder).glob("*.ipynb"))
IGNORE_MARKERS = ("NBVAL_IGNORE_OUTPUT", "NBVAL_SKIP")


def code_cells(path):
    cells = json.loads(path.read_text())["cells"]
    return [cell for cell in cells if cell["cell_type"] == "code" and "".join(cell["source"]).strip()]


def test_every_folder_has_notebooks():
    folders = {path.parent.name for path in NOTEBOOKS}
    assert folders == {"lectures", "labs", "solutions"}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_notebook_is_stored_executed_with_most_cells_compared(path):
    cells = code_cells(path)
    assert cells, f"{path.name} has no code"
    unexecuted = [i for i, cell in enumerate(cells) if cell["execution_count"] is None]
    assert not unexecuted, f"{path.name}: code cells {unexecuted} are stored unexecuted: nbval compares nothing there"
    ignored = [cell for cell in cells if any(marker in "".join(cell["source"]) for marker in IGNORE_MARKERS)]
    assert len(ignored) <= 0.2 * len(cells), f"{path.name}: {len(ignored)} of {len(cells)} code cells are not compared"
    errors = [output.get("ename") for cell in cells for output in cell["outputs"] if output["output_type"] == "error"]
    assert not errors, f"{path.name} is stored with errors: {errors}"
    assert "widgets" not in json.loads(path.read_text())["metadata"], f"{path.name} stores widget state"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_no_heading_is_written_twice(path):
    """A heading repeated in two cells (one left at the end of the cell before) shows the reader a section twice."""
    notebook = json.loads(path.read_text())
    headings = [line.strip() for cell in notebook["cells"] if cell["cell_type"] == "markdown"
                for line in "".join(cell["source"]).splitlines() if line.startswith("#")]  # fmt: skip
    assert not {heading for heading in headings if headings.count(heading) > 1}
