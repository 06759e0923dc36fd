"""Every test module has one marker (unit, torchrun or cluster; notebook cells get notebook), from the lists in
tests/conftest.py, so `pytest -m unit` is a fast inner loop that a new module cannot silently join or leave."""

import re
import subprocess
from pathlib import Path

import pytest

import conftest
from ddp_course.launch import REPO_ROOT

TEST_MODULES = sorted(path.stem for path in (REPO_ROOT / "tests").glob("test_*.py"))
DECLARED = {"unit", "torchrun", "notebook", "cluster"}


def test_every_test_module_is_in_exactly_one_list():
    unlisted = [name for name in TEST_MODULES if conftest.marker_of(Path(f"{name}.py")) is None]
    assert not unlisted, f"add each to one list in tests/conftest.py (UNIT_, TORCHRUN_ or CLUSTER_MODULES): {unlisted}"
    lists = list(conftest.MODULES_BY_MARKER.values())
    twice = {name for i, first in enumerate(lists) for second in lists[i + 1 :] for name in first & second}
    assert not twice, f"listed under two markers: {twice}"


def test_no_list_names_a_module_that_is_gone():
    listed = set().union(*conftest.MODULES_BY_MARKER.values())
    assert not listed - set(TEST_MODULES), f"no such test module: {listed - set(TEST_MODULES)}"


def test_notebook_cells_are_notebook_items_and_modules_take_their_lists_marker():
    assert conftest.marker_of(REPO_ROOT / "lectures" / "01_data_parallelism.ipynb") == "notebook"
    assert conftest.marker_of(REPO_ROOT / "tests" / "test_lab3_ddp.py") == "torchrun"
    assert conftest.marker_of(REPO_ROOT / "tests" / "test_multinode.py") == "cluster"
    assert conftest.marker_of(REPO_ROOT / "tests" / "test_route.py") == "unit"


def test_pytest_ini_declares_the_four_markers(pytestconfig):
    declared = {line.split(":")[0].strip() for line in pytestconfig.getini("markers")}
    assert DECLARED <= declared
    assert set(conftest.MODULES_BY_MARKER) | {"notebook"} == DECLARED


def test_this_module_carries_the_unit_marker(request):
    assert request.node.get_closest_marker("unit") is not None
    assert {marker.name for marker in request.node.iter_markers()} & DECLARED == {"unit"}


def test_a_refused_start_raises_names_the_command_and_is_undone():
    recorded = len(conftest.REFUSED_STARTS)
    undo = conftest.refuse_processes("refused here")
    try:
        with pytest.raises(conftest.ProcessStartRefused, match="refused here: torchrun --standalone"):
            subprocess.run(["torchrun", "--standalone", "lab.py"], timeout=5)
        patched = subprocess.Popen._execute_child
    finally:
        undo()
        # this test's own refusal is not a unit test starting a process (conftest fails a test that does)
        del conftest.REFUSED_STARTS[recorded:]
    assert subprocess.Popen._execute_child is not patched


SHARED_SESSION_FIXTURES = ("sharding_checks", "lab2_launches")  # session fixtures of tests/conftest.py that launch jobs


def test_files_sharing_a_session_fixtures_launches_run_on_one_worker():
    """Under pytest-xdist a session fixture is per worker: every file that asks for one of the launching session
    fixtures is in that fixture's group of SHARED_LAUNCH_GROUPS, or a second worker would launch its jobs again."""
    users = {
        name: fixture
        for name in TEST_MODULES
        for fixture in SHARED_SESSION_FIXTURES
        if re.search(rf"def \w+\([^)]*\b{fixture}\b", (REPO_ROOT / "tests" / f"{name}.py").read_text())  # a parameter
    }
    assert users == conftest.SHARED_LAUNCH_GROUPS


def test_the_scheduler_keeps_each_file_and_each_shared_group_whole():
    scheduler = conftest.FilesSharingLaunchesTogether.__new__(conftest.FilesSharingLaunchesTogether)
    scope = scheduler._split_scope
    assert scope("tests/test_lab8_fsdp.py::test_x") == scope("tests/test_minddp.py::test_y[2]") == "sharding_checks"
    assert scope("tests/test_lab2_join.py::a") == scope("tests/test_lab2_sampler.py::b") == "lab2_launches"
    assert scope("lectures/01_data_parallelism.ipynb::Cell 3") == scope("lectures/01_data_parallelism.ipynb::Cell 9")
    assert scope("tests/test_lab3_ddp.py::a") != scope("tests/test_lab5_scaling.py::a")
