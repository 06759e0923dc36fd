"""The portability check (python -m ddp_course.portability) reports cells whose output depends on the CPU."""

import nbformat
import pytest

from ddp_course import portability

JUNIT_SAMPLE = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" tests="3">
  <testcase classname="lectures.01_data_parallelism.ipynb" name="Cell 13" time="0.1"/>
  <testcase classname="lectures.01_data_parallelism.ipynb" name="Cell 14" time="0.2">
    <failure message="Notebook cell execution failed&#10;Cell 14: Cell outputs differ">details</failure>
  </testcase>
  <testcase classname="labs.lab3_ddp.ipynb" name="Cell 6" time="3.0">
    <error message="timeout">details</error>
  </testcase>
</testsuite></testsuites>
"""


def test_changed_cells_lists_failures_and_errors_only(tmp_path):
    report = tmp_path / "report.xml"
    report.write_text(JUNIT_SAMPLE)
    assert portability.changed_cells(report) == [
        "lectures.01_data_parallelism.ipynb::Cell 14: Notebook cell execution failed",
        "labs.lab3_ddp.ipynb::Cell 6: timeout",
    ]


def notebook_printing(code: str, stored_output: str):
    cell = nbformat.v4.new_code_cell(code, execution_count=1)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=stored_output)]
    return nbformat.v4.new_notebook(cells=[cell])


@pytest.mark.timeout(120)
def test_only_the_cell_that_depends_on_the_numerics_settings_is_reported(tmp_path, capsys):
    # One nbval run (a kernel start is the cost) over two notebooks: one stored as if run with 2
    # threads, which the check runs with OMP_NUM_THREADS=1, and one that prints an exact fact.
    depends = tmp_path / "depends_on_threads.ipynb"
    nbformat.write(notebook_printing("import os\nprint(os.environ.get('OMP_NUM_THREADS'))", "2\n"), depends)
    exact = tmp_path / "exact.ipynb"
    nbformat.write(notebook_printing("print(sum(range(10)))", "45\n"), exact)
    assert portability.main([str(depends), str(exact), "--variant", "one-thread"]) == 1
    changed = [line for line in capsys.readouterr().out.splitlines() if "CHANGED" in line]
    assert len(changed) == 1 and "depends_on_threads" in changed[0] and "Cell 0" in changed[0]


def test_a_missing_notebook_is_one_clear_line(capsys):
    with pytest.raises(SystemExit) as stopped:
        portability.main(["no/such/notebook.ipynb"])
    assert stopped.value.code == 2
    assert "no such notebook: no/such/notebook.ipynb" in capsys.readouterr().err
