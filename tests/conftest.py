"""Shared fixtures: run the labs the way a learner does (torchrun in a subprocess, with a timeout); each test's marker."""

import contextlib
import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest

from ddp_course.launch import REPO_ROOT, import_script, run_torchrun

LAB3 = REPO_ROOT / "labs" / "lab3_ddp.py"


@pytest.fixture(scope="session")
def run_lab3():
    """run_lab3(*args, nproc=2) -> RunResult of `torchrun --standalone --nproc_per_node=nproc lab3_ddp.py args`.

    Session-scoped (it holds no state) so that module-scoped fixtures can share one launch between tests.
    """

    def run(*args, nproc=2, timeout_s=120, env=None):
        return run_torchrun(LAB3, args, nproc=nproc, timeout_s=timeout_s, env=env)

    return run


SHARDING_CHECKS = REPO_ROOT / "tests" / "scripts" / "sharding_checks.py"
MINDDP_SUITE_ON = {2: "wrappers", 4: "zero"}  # world size -> the minddp suite that runs there
# world size -> lab 9's parts that run there: its 4-rank parts (HSDP, resuming on another world size) at 4,
# and the model no rank builds whole (a quarter per rank shows it best); the memory timeline at both (the
# predicted peak is checked at 2 and 4 ranks). solutions/lab9_reference/ holds the same parts' records.
LAB9_PARTS_ON = {2: "memory,checkpoint,clip", 4: "memory,meta,hsdp,resume"}


@pytest.fixture(scope="session")
def sharding_checks(tmp_path_factory):
    """sharding_checks(nproc) -> (RunResult, path of the minddp JSON) of tests/scripts/sharding_checks.py.

    One launch per world size serves tests/test_minddp.py, tests/test_minifsdp.py, tests/test_lab8_fsdp.py
    and tests/test_lab9_fsdp_practice.py (lab 6's, lab 8's and lab 9's checks need the same gloo group).
    Beside the minddp JSON lie lab9.json (both world sizes) and lab8.json (2 ranks): lab 8's rows and lab
    9's report (`path.with_name("lab9.json")`). The first test that asks starts both world sizes' launches
    at once and waits for its own: one after the other they took 22 s here, and the 2-rank job's start-up
    and waits left a core idle (issue 22). Every later test reuses them.
    """
    launched = {}
    pool = ThreadPoolExecutor(max_workers=len(MINDDP_SUITE_ON), thread_name_prefix="sharding_checks")

    def launch(nproc):
        path = tmp_path_factory.mktemp(f"sharding_checks_{nproc}") / "minddp.json"
        args = ["--minddp-suite", MINDDP_SUITE_ON[nproc], "--minddp-json", path, "--timeout-s", "90",
                "--lab9-json", path.with_name("lab9.json"), "--lab9-parts", LAB9_PARTS_ON[nproc]]  # fmt: skip
        if nproc == 2:
            args += ["--lab8-json", path.with_name("lab8.json")]
        return run_torchrun(SHARDING_CHECKS, args, nproc=nproc, timeout_s=400), path

    def run(nproc):
        if not launched:
            launched.update({size: pool.submit(launch, size) for size in MINDDP_SUITE_ON})
        return launched[nproc].result()

    yield run
    pool.shutdown(wait=True)  # the session ends after both launches, also when a test failed


@pytest.fixture(scope="session")
def lab2_launches(tmp_path_factory):
    """The launches tests/test_lab2_sampler.py and tests/test_lab2_join.py share (tests/scripts/lab2_launches.py).

    Started by the first test that asks; `.row(key)` waits for the launch that holds that run. The
    session waits for every launch before it ends.
    """
    module = import_script(REPO_ROOT / "tests" / "scripts" / "lab2_launches.py", "lab2_launches")
    launches = module.Lab2Launches(tmp_path_factory)
    yield launches
    launches.wait_for_all()


@pytest.fixture(scope="session")
def read_json():
    def read(path):
        with open(path) as file:
            return json.load(file)

    return read


@pytest.fixture
def refused_flag_line(capsys):
    """refused_flag_line(lab_module, args) -> the one error line a lab's parse_args prints for bad flags.

    Called in this process (no torchrun: every flag check goes through the same parser.error path,
    which the labs' tests also launch once under torchrun). It fails the test unless the lab exits
    with status 2 and prints exactly one "<lab>.py: error: ..." line; any other exception (a
    traceback for a user mistake) fails it too.
    """

    def refuse(lab_module, args):
        with pytest.raises(SystemExit) as stopped:
            lab_module.parse_args(args)
        assert stopped.value.code == 2
        prefix = f"{lab_module.__name__}.py: error:"
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith(prefix)]
        assert len(errors) == 1, errors
        return errors[0]

    return refuse


# ---- Markers: which kind of test each item is (pytest.ini declares them; CONTRIBUTING.md, "Tests").
#
# Every item gets exactly one marker, from its file, so no test file carries a marker of its own:
#   notebook  a cell of a notebook that `pytest --nbval` re-runs (any item collected from an .ipynb);
#   cluster   a module that starts hosts in network namespaces and a SLURM cluster (root, Debian packages);
#   torchrun  a module that starts other processes: torchrun jobs mostly, also elastic agents, a notebook
#             kernel, a grading worker, git;
#   unit      a module that runs in the pytest process and starts no process: `pytest -m unit` is the
#             maintainer's inner loop (about a minute on 2 cores).
# A module with one launching test among many quick ones counts as torchrun: the rule is per file, so a
# new test's marker is its file's. tests/test_markers.py fails on a test file listed nowhere (or twice),
# and a run that selects only unit tests refuses to start a process (refuse_processes below), so a
# module listed as unit that starts one fails there with its name.
CLUSTER_MODULES = {"test_multinode"}
UNIT_MODULES = {
    "test_02_collectives_exercises", "test_amp_choice", "test_budget", "test_calculators", "test_convert_checklist",
    "test_cross_references",
    "test_diagrams", "test_lab_sheets", "test_self_check", "test_suite_budget", "test_verdict",
    "test_exercises_in_step", "test_faults", "test_launch_failures", "test_launch_helpers",
    "test_lecture01_calculator", "test_lecture01_exercises", "test_lecture02_ddp_buckets",
    "test_lecture03_exercises", "test_lecture05_exercises", "test_lecture06_calculator",
    "test_lecture06_exercises", "test_links", "test_markers", "test_notation", "test_notebooks_stored",
    "test_parameter_counts", "test_repository_files", "test_route", "test_sharding", "test_text_transformer",
}  # fmt: skip
TORCHRUN_MODULES = {
    "test_checkers", "test_cifar10_prepare", "test_lab10", "test_ddp_minimal", "test_device_discipline", "test_lab4_check_tolerance",
    "test_exercise_generator_clones", "test_gpu_smoke", "test_grade", "test_helpers", "test_lab1_collectives",
    "test_lab2_join", "test_lab2_sampler", "test_lab3_ddp", "test_lab5_scaling", "test_lab6_ddp_from_scratch",
    "test_lab7_fault_tolerance", "test_lab7_hangs", "test_lab8_fsdp", "test_lab9_fsdp_practice",
    "test_lecture04_demos", "test_lecture04_exercises", "test_lecture05_perf_job", "test_lecture06",
    "test_lecture07", "test_minddp", "test_minifsdp", "test_portability", "test_profiling", "test_sheet_jobs",
}  # fmt: skip
MODULES_BY_MARKER = {"cluster": CLUSTER_MODULES, "torchrun": TORCHRUN_MODULES, "unit": UNIT_MODULES}


def marker_of(path) -> str | None:
    """The one marker of every item collected from path (a pathlib.Path); None for an unlisted test module."""
    if path.suffix == ".ipynb":
        return "notebook"
    return next((marker for marker, modules in MODULES_BY_MARKER.items() if path.stem in modules), None)


# pytest-xdist (pytest.ini: `-n 2`) runs two test files at a time, each file whole on one worker, in order,
# so that its module fixtures launch its jobs once. Files that share a session fixture's launches are one
# unit of work, on one worker, or each worker would launch them again.
SHARED_LAUNCH_GROUPS = {
    "test_lab8_fsdp": "sharding_checks", "test_lab9_fsdp_practice": "sharding_checks", "test_minddp": "sharding_checks",
    "test_minifsdp": "sharding_checks", "test_lab2_join": "lab2_launches", "test_lab2_sampler": "lab2_launches",
}  # fmt: skip

with contextlib.suppress(ImportError):  # without xdist the suite runs one file at a time
    from xdist.scheduler import LoadFileScheduling

    class FilesSharingLaunchesTogether(LoadFileScheduling):
        """xdist's `--dist loadfile`, with the files of SHARED_LAUNCH_GROUPS as one unit each. (Its
        `--dist loadgroup` would do it with marks, but it changes every test's id, and nbval then starts a
        new kernel for every cell.)"""

        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SHARED_LAUNCH_GROUPS.get(os.path.splitext(os.path.basename(path))[0], path)

    def pytest_xdist_make_scheduler(config, log):
        return FilesSharingLaunchesTogether(config, log)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        marker = marker_of(item.path)
        if marker is not None:
            item.add_marker(marker)


# ---- Temporary files: the suite's processes leave theirs in one folder, which the session removes.
# torchrun's agent leaves a torchelastic_* folder per launch, and a sheet's SheetJobs folder outlives its
# kernel (nbval kills kernels, so no exit handler runs): thousands of folders in /tmp after a few runs.
# Children inherit TMPDIR; this process keeps its own temporary folder (pytest's tmp_path stays where
# pytest keeps it for inspection), which is why gettempdir() is read before TMPDIR changes.
_SUITE_TMPDIR: dict[str, str] = {}


TMPDIR_BEFORE_SUITE = "DDP_COURSE_TMPDIR_BEFORE_SUITE"  # what TMPDIR was before the suite (for xdist's workers)


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        keep_the_controllers_folders()
        return
    tempfile.gettempdir()  # fixes this process's own temporary folder before TMPDIR changes
    _SUITE_TMPDIR["previous"] = os.environ[TMPDIR_BEFORE_SUITE] = os.environ.get("TMPDIR", "")
    _SUITE_TMPDIR["folder"] = os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="ddp_course_suite_")


def keep_the_controllers_folders():
    """An xdist worker (`-n 2`) starts with TMPDIR already the suite's folder, which the controller removes at
    the end. Its own temporary folder must be the controller's, not that folder: mkdtemp makes it readable by
    root alone, and munged (tests/test_multinode.py) refuses a socket under a folder that others cannot enter."""
    suite_folder = os.environ["TMPDIR"]
    before = os.environ.get(TMPDIR_BEFORE_SUITE, "")
    if before:
        os.environ["TMPDIR"] = before
    else:
        os.environ.pop("TMPDIR", None)
    tempfile.tempdir = None  # gettempdir() looks again, at TMPDIR as it was before the suite
    tempfile.gettempdir()
    os.environ["TMPDIR"] = suite_folder


def pytest_unconfigure(config):
    folder = _SUITE_TMPDIR.pop("folder", None)
    if folder is None:
        return
    if _SUITE_TMPDIR["previous"]:
        os.environ["TMPDIR"] = _SUITE_TMPDIR["previous"]
    else:
        os.environ.pop("TMPDIR", None)
    shutil.rmtree(folder, ignore_errors=True)


class ProcessStartRefused(RuntimeError):
    pass


REFUSED_STARTS: list[str] = []  # what each refused start was, in case a caller swallowed the exception


def refuse_processes(reason: str):
    """Make every process start in this pytest process raise ProcessStartRefused(reason); returns the undo.

    subprocess.run, check_output and Popen all start their program through Popen._execute_child, and
    multiprocessing (torch's spawn too) through BaseProcess.start, so patching the two catches every launch
    helper in ddp_course.launch and everything a test might call directly."""
    import multiprocessing.process
    import subprocess

    originals = (subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start)

    def refuse_program(popen, args, *rest, **kwargs):
        REFUSED_STARTS.append(" ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args))
        raise ProcessStartRefused(f"{reason}: {REFUSED_STARTS[-1]}")

    def refuse_process(process):
        REFUSED_STARTS.append(f"multiprocessing {process.name}")
        raise ProcessStartRefused(f"{reason}: {REFUSED_STARTS[-1]}")

    subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start = refuse_program, refuse_process

    def undo():
        subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start = originals

    return undo


UNIT_ONLY_REASON = "a unit test started a process; list its module in TORCHRUN_MODULES (tests/conftest.py)"


@pytest.fixture(scope="session", autouse=True)
def unit_runs_start_no_process(request):
    """When every selected item is a unit test (`pytest -m unit`, or unit modules only), starting a process fails.

    Only then: in a mixed run, a torchrun module's session fixture may still be launching jobs from its
    own threads while a unit test runs, and those launches are meant."""
    items = request.session.items
    if not items or any(item.get_closest_marker("unit") is None for item in items):
        yield
        return
    # A library's own one-time helper is not the test's: matplotlib's first import on a new machine runs
    # `fc-list` to build its font cache, so that import happens before the refusal starts.
    with contextlib.suppress(ImportError):
        import matplotlib.font_manager  # noqa: F401
    # Likewise torch's first import: its CUDA path finder looks for libdl with ctypes.util.find_library, which
    # runs `/sbin/ldconfig -p` (a unit module whose tests are the first to import torch failed when run alone).
    with contextlib.suppress(ImportError):
        import torch  # noqa: F401
    undo = refuse_processes(UNIT_ONLY_REASON)
    yield
    undo()


@pytest.fixture(autouse=True)
def no_refused_start_was_swallowed(unit_runs_start_no_process):
    """A refused start fails its test even if the code under test caught ProcessStartRefused."""
    before = len(REFUSED_STARTS)
    yield
    if len(REFUSED_STARTS) > before:
        pytest.fail(f"{UNIT_ONLY_REASON}: {REFUSED_STARTS[before:]}", pytrace=False)


# ---- Where the suite's time goes: seconds per test file (setup, call and teardown of its items).
# The suite has a budget (README, "Tests": at most 90 runs of the main job); the 15 slowest items do
# not say which file to make cheaper when a module-scoped fixture launches jobs that many tests share.
_SECONDS_PER_FILE: dict[str, float] = {}


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _SECONDS_PER_FILE[path] = _SECONDS_PER_FILE.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if len(_SECONDS_PER_FILE) < 2:
        return
    slowest = sorted(_SECONDS_PER_FILE.items(), key=lambda item: item[1], reverse=True)[:15]
    terminalreporter.write_sep("=", "seconds per test file (the 15 slowest)")
    for path, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f} s  {path}")
