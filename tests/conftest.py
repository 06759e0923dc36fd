"""Shared fixtures: run the labs the way a learner does (torchrun in a subprocess, with a timeout)."""

import json

import pytest

from ddp_course.launch import REPO_ROOT, run_torchrun

LAB3 = REPO_ROOT / "labs" / "lab3_ddp.py"


@pytest.fixture(scope="session")
def run_lab3():
    """run_lab3(*args, nproc=2) -> RunResult of `torchrun --standalone --nproc_per_node=nproc lab3_ddp.py args`.

    Session-scoped (it holds no state) so that module-scoped fixtures can share one launch between tests.
    """

    def run(*args, nproc=2, timeout_s=120, env=None):
        return run_torchrun(LAB3, args, nproc=nproc, timeout_s=timeout_s, env=env)

    return run


@pytest.fixture(scope="session")
def read_json():
    def read(path):
        with open(path) as file:
            return json.load(file)

    return read
