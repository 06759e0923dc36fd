"""Shared fixtures: run the labs the way a learner does (torchrun in a subprocess, with a timeout)."""

import json
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
