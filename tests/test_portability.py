"""The portability check (python -m ddp_course.authoring.portability) reports cells whose output depends on the CPU,
and stored outputs that hold the absolute paths of the machine that stored them."""

import re

import nbformat
import pytest

from ddp_course.authoring import notebooks, portability
from ddp_course.launch import REPO_ROOT

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


# --- absolute paths in stored outputs -----------------------------------------------------------

# Lines of a torchrun failure report as lab 3's sheet once stored them, on the machine that stored it.
RECORDED_REPORT = """\
E1127 20:43:59.542000 1704 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 2) local_rank: 0 (pid: 1731) of binary: /work/wt-cut1/.venv/bin/python
  File "/work/wt-cut1/.venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1142, in <module>
/home/alice/ddp-course/labs/lab3_ddp.py FAILED
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
node2's /etc/hosts says '127.0.1.1 node2'; a checkpoint in /tmp/tmpk2x9/ckpt.pt; 100/400 Gb/s, (N-1)/N
"""


def sanitizer_rules():
    from nbval.plugin import get_sanitize_patterns

    return get_sanitize_patterns((REPO_ROOT / "tests" / "nbval_sanitize.cfg").read_text())


def sanitized(text):
    for pattern, replacement in sanitizer_rules():
        text = re.sub(pattern, replacement, text)
    return text


def test_storing_keeps_the_file_names_and_masks_the_machines_folders():
    masked = notebooks.mask_paths(RECORDED_REPORT)
    assert "/work/" not in masked and "/home/" not in masked and "/tmp/" not in masked
    assert "of binary: .../python\n" in masked
    assert 'File ".../run.py", line 1142' in masked
    assert ".../lab3_ddp.py FAILED" in masked
    # What is not a machine's folder stays: a relative path, a URL, the system's files, rates and fractions.
    for kept in (".venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1002]",
                 "https://pytorch.org/docs/stable/elastic/errors.html", "/etc/hosts", "100/400 Gb/s, (N-1)/N"):  # fmt: skip
        assert kept in masked
    assert notebooks.mask_paths(masked) == masked  # masking a stored output again changes nothing


def test_the_sanitizer_masks_paths_with_the_rules_storing_uses():
    # The same rules, in the same order, so that a stored (masked) output and a fresh one compare equal.
    rules = sanitizer_rules()
    assert [rule for rule in rules if rule in notebooks.PATH_MASKS] == list(notebooks.PATH_MASKS)
    assert sanitized(notebooks.mask_paths(RECORDED_REPORT)) == sanitized(RECORDED_REPORT)


def notebook_with_outputs(*outputs: tuple[str, str]):
    """A markdown cell, then one stored code cell per (source, stored stdout)."""
    cells = [nbformat.v4.new_markdown_cell("# A sheet")]
    for number, (source, stored) in enumerate(outputs, start=1):
        cell = nbformat.v4.new_code_cell(source, execution_count=number)
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=stored)]
        cells.append(cell)
    return nbformat.v4.new_notebook(cells=cells)


def test_a_stored_absolute_path_is_one_line_naming_the_notebook_and_cell(tmp_path):
    planted = tmp_path / "planted.ipynb"
    nbformat.write(notebook_with_outputs(("print(45)", "45\n"), ("# NBVAL_IGNORE_OUTPUT\nprint(report)", RECORDED_REPORT)), planted)
    assert portability.stored_absolute_paths(planted) == [
        f"{planted} cell 2 (nbval's Cell 1): /work/wt-cut1/.venv/bin/python",
        f"{planted} cell 2 (nbval's Cell 1): /work/wt-cut1/.venv/lib/python3.11/site-packages/torch/distributed/run.py",
        f"{planted} cell 2 (nbval's Cell 1): /home/alice/ddp-course/labs/lab3_ddp.py",
        f"{planted} cell 2 (nbval's Cell 1): /tmp/tmpk2x9/ckpt.pt;",
    ]


def test_no_stored_output_of_the_course_holds_an_absolute_path():
    found = [line for path in portability.all_notebooks() for line in portability.stored_absolute_paths(path)]
    assert not found, "re-store these notebooks with python -m ddp_course.authoring.notebooks:\n" + "\n".join(found)


@pytest.mark.timeout(300)
def test_a_stored_path_fails_the_check_and_a_masked_one_passes_nbval(tmp_path, capsys):
    # Stored by the course's own storing: the cell prints where a package lies on this machine, the file
    # keeps .../__init__.py. nbval then compares the fresh absolute path with it through the sanitizer: no
    # change. (The standard library's json, not ddp_course: a clone under /tmp would print TMPPATH instead.)
    masked = tmp_path / "masked.ipynb"
    nbformat.write(notebook_with_outputs(("import json\nprint(json.__file__)", "")), masked)
    notebooks.execute_in_place(masked, timeout_s=120)
    assert nbformat.read(masked, as_version=4).cells[1].outputs[0].text == ".../__init__.py\n"
    # Planted: an absolute path in a stored output that nbval never compares (as in lab 3's failure report).
    planted = tmp_path / "planted.ipynb"
    nbformat.write(notebook_with_outputs(("# NBVAL_IGNORE_OUTPUT\nprint('elsewhere')", "/home/alice/labs/lab3_ddp.py FAILED\n")), planted)
    assert portability.main([str(masked), str(planted), "--variant", "one-thread"]) == 1
    printed = capsys.readouterr().out.splitlines()
    assert not [line for line in printed if "CHANGED" in line], printed
    assert [line.strip() for line in printed if "ABSOLUTE PATH" in line] == [f"ABSOLUTE PATH {planted} cell 1 (nbval's Cell 0): /home/alice/labs/lab3_ddp.py"]
    assert any(line.startswith("NOT portable: the stored outputs above hold another machine's folders") for line in printed)
