"""Many short runs in one torchrun launch: the tests' and the checkers' way to pay for start-up once.

Most of a short torchrun launch is each process starting Python and importing torch (seconds); a
lab's 6-step run takes well under one. So the tests and the conversion checker run several scripts
("rows") one after another in the same processes, each as `__main__` with its own argv, as
`python SCRIPT ARGS` would:

    give_each_group_its_own_store_keys("row")   # once, before the first row
    status = run_rows(rows, markers_dir, on_row_end=report)

What a row may change for the rest of the process is put back after it: environment variables,
sys.path, the distributed debug level, and the modules imported from the course's own folders (labs
and solutions both hold a module named by --module). A row that ends with another status than the one
it expects stops the launch: its peers may wait in a collective it will never join.

Rows that do not need a script of their own - a lab's judge() called in one shared process group -
use `captured()` instead: the call's status and what it printed, for a test to read.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import io
import os
import runpy
import sys
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from ddp_course.launch import REPO_ROOT

# How long a rank waits at the start of a row for its peers to finish the previous one: far above any
# row here (a quiet rank's 15 s after a bad flag, lab 7's restarts); torchrun's own limit and the
# launching test's timeout still apply.
ROW_START_TIMEOUT_S = 300
# The folders whose scripts a row runs or imports. Only modules loaded from these are the course's own:
# a virtual environment may live inside the clone (the README's `python -m venv .venv`), and numpy's or
# scikit-learn's modules must never be forgotten - numpy refuses to load twice in a process.
COURSE_FOLDERS = ("labs", "solutions", "lectures", "tests", "benchmarks")


# --- one process group per row ---------------------------------------------------------------------
@functools.cache
def torchrun_store():
    """torchrun's key-value store for this job (env://: MASTER_ADDR and MASTER_PORT), connected once."""
    store, _, _ = next(dist.rendezvous("env://"))
    return store


def give_each_group_its_own_store_keys(prefix: str) -> None:
    """Let one process form torchrun's default group several times (one per row): the k-th group gets
    torchrun's store under the key prefix "<prefix>k/".

    Under torchrun every init_process_group("env://") talks to the same key-value store with the same
    keys, so a second group would read the first one's (now closed) addresses and fail to connect.
    With a prefix of its own (torch's PrefixStore) each group starts as if it were a new job; rank and
    world size still come from torchrun's environment. Replaces dist.init_process_group for good, which
    is why it lives here and never in what a lab imports."""
    real_init = dist.init_process_group
    groups_formed = [0]

    @functools.wraps(real_init)
    def init_process_group(*args, **kwargs):
        if kwargs.get("store") is None and kwargs.get("init_method") in (None, "env://"):
            groups_formed[0] += 1
            kwargs["store"] = dist.PrefixStore(f"{prefix}{groups_formed[0]}/", torchrun_store())
            kwargs.setdefault("rank", int(os.environ["RANK"]))
            kwargs.setdefault("world_size", int(os.environ["WORLD_SIZE"]))
            kwargs.pop("init_method", None)
        return real_init(*args, **kwargs)

    dist.init_process_group = init_process_group


def start_together(row_index: int) -> None:
    """Wait until every rank has reached row row_index (ROW_START_TIMEOUT_S at most): a row with a short
    timeout must not spend it waiting for a peer still busy with the previous row.

    The keys name the launch attempt: after a restart (--max-restarts) the ranks start over."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"rows/attempt{attempt}/start{row_index}/"
    torchrun_store().set(prefix + os.environ.get("RANK", "0"), "ready")
    ranks = range(int(os.environ.get("WORLD_SIZE", "1")))
    torchrun_store().wait([f"{prefix}{rank}" for rank in ranks], timedelta(seconds=ROW_START_TIMEOUT_S))


# --- what a row may leave behind ---------------------------------------------------------------------
def is_course_file(path: str, repo_root: str) -> bool:
    """True when path is a script of the course's own folders, not an installed library's file."""
    path = os.path.realpath(path)
    library_roots = {os.path.realpath(root) for root in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    if any(os.path.commonpath([path, root]) == root for root in library_roots):
        return False  # the interpreter's own files and every package installed into its environment
    if {"site-packages", "dist-packages"} & set(path.split(os.sep)):
        return False  # a package imported from some other environment's folder
    return any(os.path.commonpath([path, os.path.join(repo_root, folder)]) == os.path.join(repo_root, folder)
               for folder in COURSE_FOLDERS)  # fmt: skip


def own_modules(repo_root: str) -> set[str]:
    """Names of the loaded modules imported from the course's scripts (labs, solutions, lectures, ...)."""
    return {name for name, module in list(sys.modules.items())
            if is_course_file(getattr(module, "__file__", None) or os.sep, repo_root)}  # fmt: skip


@contextlib.contextmanager
def process_state_restored(repo_root: str):
    """Put back what a row may change for the rest of the process: environment variables (lab7_hangs sets
    DETAIL), sys.path, the distributed debug level, and the course's modules it imported (lab 6 and lab 8
    both import a module named by --module, from their own directory)."""
    saved_env, saved_path, saved_level = dict(os.environ), list(sys.path), dist.get_debug_level()
    modules_before = own_modules(repo_root)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path
        dist.set_debug_level(saved_level)
        for name in own_modules(repo_root) - modules_before:
            del sys.modules[name]


# --- running one row -----------------------------------------------------------------------------------
def run_script(script: str, script_args: list[str]) -> None:
    """Run script as __main__ with its arguments, as `python script ARGS` would."""
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


@contextlib.contextmanager
def row_streams(out_dir: str | None):
    """sys.stdout and sys.stderr to out_dir/stdout-r<rank>.txt and stderr-r<rank>.txt (None: unchanged).

    The labs look sys.stdout up at each write (ddp_course.distributed.log), so the redirect catches
    every line; only C++ writes (gloo's own warnings) still go to the launch's streams."""
    if out_dir is None:
        yield
        return
    rank = os.environ.get("RANK", "0")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"stdout-r{rank}.txt"), "w") as out, open(os.path.join(out_dir, f"stderr-r{rank}.txt"), "w") as err:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            yield


def exit_status(script: str, script_args: list[str], out_dir: str | None = None) -> int:
    """Run one row and return its exit status: 0, sys.exit's status, or 1 for an uncaught exception
    (its traceback printed, as Python prints it). With out_dir, what the row prints from Python goes
    to its own files there."""
    import traceback

    with row_streams(out_dir):
        try:
            run_script(script, script_args)
        except SystemExit as stop:
            if stop.code is None or isinstance(stop.code, int):
                return stop.code or 0
            print(stop.code, file=sys.stderr)  # sys.exit("message"), as Python itself would print it
            return 1
        except BaseException:
            traceback.print_exc()
            return 1
        return 0


# --- the rows of a launch --------------------------------------------------------------------------------
def passed_marker(markers_dir: str, row: str, rank: int | str) -> str:
    return os.path.join(markers_dir, f"passed-{row}-r{rank}")


def passed_in_earlier_attempt(markers_dir: str, row: str) -> bool:
    """True on a restarted attempt for a row that every rank passed before the restart.

    The previous attempt's processes are all gone by then, so every rank sees the same markers."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        return False
    return all(os.path.exists(passed_marker(markers_dir, row, rank)) for rank in range(int(os.environ["WORLD_SIZE"])))


def run_rows(rows: list[dict], markers_dir: str, on_row_start: Callable[[dict], None] = lambda row: None,
             on_row_end: Callable[[dict, int], None] = lambda row, status: None) -> int:  # fmt: skip
    """Run each row ({"name", "script", "args"}, optionally "out_dir" and "expect_status") in turn; stop at the
    first row that does not end with its expected status (returns that status, or 1 where it passed but
    should have failed). Each rank leaves a marker in markers_dir for every row it passed, so that a
    restarted launch (--max-restarts) skips the rows every rank passed before; a skipped row is not reported."""
    repo_root = str(REPO_ROOT)
    for index, row in enumerate(rows):
        if passed_in_earlier_attempt(markers_dir, row["name"]):
            continue  # a restarted launch: re-running it would find its own outputs (lab 7's checkpoints)
        start_together(index)
        with process_state_restored(repo_root):
            on_row_start(row)
            status = exit_status(row["script"], row["args"], row.get("out_dir"))
            gc.collect()  # DDP's reference cycles would keep the old group alive (ddp_course.distributed)
            if dist.is_initialized():  # a script that leaves its group would make the next init fail
                dist.destroy_process_group()
            on_row_end(row, status)
        if status != row.get("expect_status", 0):
            return status or 1
        open(passed_marker(markers_dir, row["name"], os.environ.get("RANK", "0")), "w").close()
    return 0


# --- rows that share one process group ---------------------------------------------------------------------
def captured(call: Callable[[], int], program: str | Path) -> dict:
    """Run call() (a lab's judge(args, ctx), say) with sys.argv[0] = program, so that its error lines start
    with the lab's own name as when torchrun runs it; {"status", "stdout", "stderr"} of what it printed."""
    out, err, saved_program = io.StringIO(), io.StringIO(), sys.argv[0]
    sys.argv[0] = str(program)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = call()
    finally:
        sys.argv[0] = saved_program
    return {"status": status, "stdout": out.getvalue(), "stderr": err.getvalue()}
