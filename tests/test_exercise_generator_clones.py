"""The exercise generator names paths from the files it is given, not from where ddp_course is installed.

An instructor with two clones of the course and one virtual environment has ddp_course installed
(editable) from clone A and runs `python -m ddp_course.authoring.exercises ... --check` inside clone B. The
header of a generated exercise names the solution and the exercise relative to *their* repository,
so clone B's stored labs/minddp.py must check as up to date there (it failed before: the paths were
taken relative to clone A and came out absolute).
"""

import shutil
import subprocess
import sys

from ddp_course.authoring.exercises import repository_root
from ddp_course.launch import REPO_ROOT

PAIRS = [("solutions/minddp.py", "labs/minddp.py")]


def second_clone(tmp_path):
    """A second repository holding this one's solution and exercise files (git init: a clone's marker)."""
    clone = tmp_path / "second-clone"
    for solution, exercise in PAIRS:
        for relative in (solution, exercise):
            (clone / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO_ROOT / relative, clone / relative)
    subprocess.run(["git", "init", "-q", str(clone)], check=True)
    return clone


def generator(*args, cwd):
    command = [sys.executable, "-m", "ddp_course.authoring.exercises", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, timeout=60)


def test_the_installed_package_is_not_the_second_clone(tmp_path):
    clone = second_clone(tmp_path)
    assert repository_root(clone / "labs" / "minddp.py") == clone.resolve()
    assert repository_root(REPO_ROOT / "labs" / "minddp.py") == REPO_ROOT


def test_a_second_clone_checks_its_own_exercises_with_the_first_clones_package(tmp_path):
    clone = second_clone(tmp_path)
    for solution, exercise in PAIRS:
        from_inside = generator(solution, exercise, "--check", cwd=clone)
        assert from_inside.returncode == 0, from_inside.stderr
        from_elsewhere = generator(clone / solution, clone / exercise, "--check", cwd=tmp_path)
        assert from_elsewhere.returncode == 0, from_elsewhere.stderr
        rewritten = generator(clone / solution, clone / exercise, cwd=tmp_path)  # rewriting changes nothing
        assert rewritten.returncode == 0 and (clone / exercise).read_text() == (REPO_ROOT / exercise).read_text()
