"""Run a lab script with every torch.distributed collective checked for the devices of its tensors.

    torchrun --standalone --nproc_per_node=2 tests/scripts/record_collectives.py LAB_SCRIPT [LAB ARGS...]

NCCL needs every tensor of a collective on the rank's GPU; a CPU tensor in an output list (review
finding 1) is handed to NCCL as a device pointer and crashes the job. This wrapper replaces each
collective in torch.distributed with a version that first checks that every tensor argument (the
inputs and each element of an output list) is on the device of the first tensor, and that this is
the device the group's backend works on (the rank's GPU for NCCL, the CPU for gloo), then calls the
real one. The lab runs unchanged, as __main__, with its own arguments (runpy). DDP's internal
collectives run in C++ and are not seen: we check the labs' own code.

At exit each rank prints one line:
    [collectives rank R] calls N violations M ops all_reduce=3,barrier=1,...
and one "[collectives rank R] VIOLATION ..." line per bad call.

Several scripts in one launch (most of a launch is Python and torch start-up, about 10 s):

    torchrun ... tests/scripts/record_collectives.py --rows ROWS.json

ROWS.json is a list of {"name": ..., "script": ..., "args": [...]}, each optionally with
"expect_status" (the exit status the row must end with, 0 unless given: a lab's planted bug or bad
flag exits non-zero on purpose) and "out_dir" (the row's own stdout and stderr, as
out_dir/stdout-r<rank>.txt and stderr-r<rank>.txt, instead of the launch's shared streams). Each
rank imports torch once and runs the rows one after another, each as __main__ with its own argv;
the ranks start each row together (a barrier on torchrun's store: a row with a short timeout must
not spend it waiting for a peer still busy with the previous row); calls are counted per row and
each row ends with its own line on the launch's stdout:
    [collectives rank R row NAME] status S calls N violations M ops ...
The rows' scripts create and destroy their process group in main(); each row's group gets torchrun's
store under a key prefix of its own (give_each_group_its_own_store_keys), since a second group on the
same keys would read the first one's closed addresses. What a script may change for the rest of the process (environment variables, sys.path,
the distributed debug level, the repository's own modules) is put back after each row. A row that
fails (any exit status but its expected one, an exception included) ends the launch with its status,
or 1 if it passed where it should have failed: its peers may be waiting in a collective it will never
join, and the later rows would start from a broken state. So ranks whose statuses differ end the
launch visibly: torchrun stops the others. A row whose collectives time out on purpose goes last.
When torchrun restarts the launch (--max-restarts, for a row that crashes on purpose), the new
attempt skips the rows that passed on every rank in an earlier one: each rank leaves a marker file
beside ROWS.json for every row it passed. A skipped row prints no new line; its earlier one stands.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import runpy
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from ddp_course.distributed import give_each_group_its_own_store_keys, torchrun_store

WRAPPED = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier", "monitored_barrier",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "all_gather_single", "reduce_scatter_single",  # torch 2.14's names for the *_tensor pair (FSDP uses them)
)  # fmt: skip
calls: dict[str, int] = {}
violations: list[str] = []
# How long a rank waits at the start of a row for its peers to finish the previous one: far above
# any row here (a quiet rank's 15 s after a bad flag, lab 7's restarts); torchrun's own limit and
# the launching test's timeout still apply.
ROW_START_TIMEOUT_S = 300


def tensors_in(value) -> list[torch.Tensor]:
    """Every tensor in an argument: a tensor, a (nested) list or tuple of tensors, or a P2POp's tensor."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in tensors_in(item)]
    if isinstance(value, dist.P2POp):
        return [value.tensor]
    return []


def device_problems(op: str, args, kwargs, expected: torch.device | None) -> list[str]:
    """What is wrong with the devices of one call's tensors ([] when nothing is).

    Every tensor must be on the first tensor's device, and that must be `expected` (None: not checked).
    """
    tensors = [t for value in (*args, *kwargs.values()) for t in tensors_in(value)]
    if not tensors:
        return []
    first = tensors[0].device
    problems = [f"{op}: tensor {i} on {t.device}, the first tensor on {first}" for i, t in enumerate(tensors) if t.device != first]
    if expected is not None and first != expected:
        problems.append(f"{op}: tensors on {first}, but this rank's backend works on {expected}")
    return problems


def expected_device(group) -> torch.device:
    """Where the group's backend wants tensors: this rank's current GPU for NCCL, the CPU otherwise."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def checked(op: str, real):
    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        calls[op] = calls.get(op, 0) + 1
        group = kwargs.get("group")
        # Object collectives pickle into tensors that torch places itself; only count them.
        if not op.endswith(("_object", "_object_list")):
            violations.extend(device_problems(op, args, kwargs, expected_device(group)))
        return real(*args, **kwargs)

    return wrapper


def install() -> None:
    import torch.distributed.distributed_c10d as c10d

    for op in (op for op in WRAPPED if hasattr(dist, op)):  # an older torch lacks the newest names
        wrapper = checked(op, getattr(dist, op))
        setattr(dist, op, wrapper)
        if op in ("isend", "irecv"):
            # P2POp accepts only c10d's own isend/irecv (an identity check), so they are replaced there too.
            setattr(c10d, op, wrapper)


def report(row: str | None = None, status: int | None = None) -> None:
    rank = os.environ.get("RANK", "0")
    tag = f"[collectives rank {rank}]" if row is None else f"[collectives rank {rank} row {row}]"
    ops = ",".join(f"{op}={count}" for op, count in sorted(calls.items()))
    lines = [f"{tag} VIOLATION {problem}" for problem in violations]
    status_field = "" if status is None else f"status {status} "
    lines.append(f"{tag} {status_field}calls {sum(calls.values())} violations {len(violations)} ops {ops}")
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


def run_script(script: str, script_args: list[str]) -> None:
    """Run script as __main__ with its arguments, as `python script ARGS` would."""
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


def exit_status(script: str, script_args: list[str], out_dir: str | None = None) -> int:
    """Run one row and return its exit status: 0, sys.exit's status, or 1 for an uncaught exception.

    With out_dir, what the row prints from Python (a traceback too) goes to its own files there."""
    with row_streams(out_dir):
        return _exit_status(script, script_args)


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


def _exit_status(script: str, script_args: list[str]) -> int:
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


# The folders whose scripts a row runs or imports. Only modules loaded from these are the course's
# own: a virtual environment may live inside the clone (the README's `python -m venv .venv`), and
# numpy's or scikit-learn's modules must never be forgotten - numpy refuses to load twice in a process.
COURSE_FOLDERS = ("labs", "solutions", "lectures", "tests", "benchmarks")


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


def passed_marker(markers_dir: str, row: str, rank: int | str) -> str:
    return os.path.join(markers_dir, f"passed-{row}-r{rank}")


def passed_in_earlier_attempt(markers_dir: str, row: str) -> bool:
    """True on a restarted attempt for a row that every rank passed before the restart.

    The previous attempt's processes are all gone by then, so every rank sees the same markers."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        return False
    return all(os.path.exists(passed_marker(markers_dir, row, rank)) for rank in range(int(os.environ["WORLD_SIZE"])))


def start_together(row_index: int) -> None:
    """Wait until every rank has reached row row_index (ROW_START_TIMEOUT_S at most).

    The keys name the launch attempt: after a restart (--max-restarts) the ranks start over."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"rows/attempt{attempt}/start{row_index}/"
    torchrun_store().set(prefix + os.environ.get("RANK", "0"), "ready")
    ranks = range(int(os.environ.get("WORLD_SIZE", "1")))
    torchrun_store().wait([f"{prefix}{rank}" for rank in ranks], timedelta(seconds=ROW_START_TIMEOUT_S))


def run_rows(rows: list[dict], markers_dir: str) -> int:
    """Run each row in turn, with its own counts and summary line; stop at the first row that does not
    end with its expected status (returns that status, or 1 where it passed but should have failed)."""
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    for index, row in enumerate(rows):
        if passed_in_earlier_attempt(markers_dir, row["name"]):
            continue  # a restarted launch: re-running it would find its own outputs (lab 7's checkpoints)
        start_together(index)
        saved_env, saved_path, saved_level = dict(os.environ), list(sys.path), dist.get_debug_level()
        modules_before = own_modules(repo_root)
        calls.clear()
        violations.clear()
        status = exit_status(row["script"], row["args"], row.get("out_dir"))
        gc.collect()  # DDP's reference cycles would keep the old group alive (ddp_course.distributed)
        if dist.is_initialized():  # a script that leaves its group would make the next init fail
            dist.destroy_process_group()
        report(row["name"], status)
        if status != row.get("expect_status", 0):
            return status or 1
        open(passed_marker(markers_dir, row["name"], os.environ.get("RANK", "0")), "w").close()
        # Put back what a script may change for the rest of the process (lab7_hangs sets DETAIL, the
        # faults demos set TORCH_FR_BUFFER_SIZE) and forget its modules: lab 6 and lab 8 both import a
        # module named by --module, from their own directory.
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path[:] = saved_path
        dist.set_debug_level(saved_level)
        for name in own_modules(repo_root) - modules_before:
            del sys.modules[name]
    return 0


if __name__ == "__main__":
    install()
    if sys.argv[1] == "--rows":
        give_each_group_its_own_store_keys("row")
        with open(sys.argv[2]) as rows_file:
            status = run_rows(json.load(rows_file), markers_dir=os.path.dirname(os.path.abspath(sys.argv[2])))
        sys.stdout.flush()
        sys.stderr.flush()
        # os._exit: after a failing row a peer may be blocked in a collective, and torchrun must see the status.
        os._exit(status)
    script, *script_args = sys.argv[1:]
    try:
        run_script(script, script_args)
    finally:
        report()
