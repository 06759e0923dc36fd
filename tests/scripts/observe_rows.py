"""Several observed jobs in one torchrun launch: lab 4's observer (labs/lab4_observe.py), row after row.

    torchrun --standalone --nproc_per_node=2 tests/scripts/observe_rows.py ROWS.json

ROWS.json is a list of {"name": ..., "out_dir": ..., "script": ..., "args": [...], "env": {...}}. For
tests only (tests/test_checkers.py: lab 4's broken-DDP checker and lab 3's conversion checker): most
of an observed job is Python, torch and torch._dynamo start-up (about 10 CPU-seconds for the agent
and 2 ranks), and the two checkers' planted mistakes are 14 short jobs of the same kind. Here each
rank starts once and runs the rows one after another, each exactly as labs/lab4_observe.py's main()
runs its one script: the row's "env" set (a checker's own observer settings, e.g. lab 3's
LAB4_OBSERVE_STEPS, which the observer reads per Recorder), a fresh Recorder writing into the row's
out_dir, the script run as __main__ with its own argv, then the "exit" event and the finished state;
afterwards the environment is restored, so a row's env applies to that row only. What differs from
a launch of its own is written into out_dir for the test to read:

- stdout-r<rank>.txt, stderr-r<rank>.txt: what the row's script printed from Python (torchrun would
  have collected it);
- status-r<rank>.json: {"status": the script's exit status, "wall_s": seconds}: the job's exit status.

The observer's patches are installed once and report to the current row's Recorder. Each row's
process group gets torchrun's store under a key prefix of its own (record_collectives.py). A row
that fails on some rank ends the launch with its status: a peer may be blocked in DDP's gradient
all-reduce, which the observer cannot rescue; the later rows leave no status file.

The tests import this file too (ddp_course.launch.import_script) for the launching side:
observe_in_one_launch() writes ROWS.json, launches it, and reads each row back as the Observation
that the checker's own observe() would have given (row_observation), for the checker to judge.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import runpy
import sys
import time
import traceback
from pathlib import Path

import torch.distributed as dist

from ddp_course.launch import RunResult, import_script

OBSERVER = Path(__file__).resolve().parents[2] / "labs" / "lab4_observe.py"


# --- the launching side, in the test process -------------------------------------------------------------
def observe_in_one_launch(lab4, jobs: dict, folder: Path, timeout_s: float, nodes: int = 1) -> dict:
    """{name: Observation} of each job, observed as lab4.observe would, all in one torchrun launch, in order.

    lab4 is labs/lab4_check.py as a module; jobs is {name: (script, script_args, env)}: script_args(out_dir)
    gives the script's flags, env the checker's own observer settings for that row only ({} for
    lab 4's, as lab4.observe's env); timeout_s bounds the whole launch; nodes: the launch runs as
    that many nodes on this host, as lab4.observe(nodes=...) does (lab4.run_job).
    """
    out_dirs = {name: folder / f"{name}-observed" for name in jobs}
    rows = [{"name": name, "out_dir": str(out_dirs[name]), "script": str(script), "args": [str(a) for a in script_args(out_dirs[name])],
             "env": dict(env)} for name, (script, script_args, env) in jobs.items()]  # fmt: skip
    rows_file = folder / "rows.json"
    rows_file.write_text(json.dumps(rows, indent=1))
    # lab4.observe's environment for every row: GPUs hidden, collectives rescued, the digits from a file.
    env = {"CUDA_VISIBLE_DEVICES": "", "LAB4_OBSERVE_RESCUE": "1", "LAB4_OBSERVE_DIGITS": str(lab4.save_digits(folder / "digits.pt"))}
    launch = lab4.run_job(Path(__file__).resolve(), [rows_file], nodes, timeout_s, env)
    return {name: row_observation(lab4, launch, out_dir, timeout_s) for name, out_dir in out_dirs.items()}


def row_observation(lab4, launch: RunResult, out_dir: Path, timeout_s: float):
    """One row's Observation: its own output and exit status, as if it had had a launch of its own."""
    ranks = range(lab4.WORLD_SIZE)
    statuses = [json.loads(path.read_text()) if (path := out_dir / f"status-r{rank}.json").exists() else None for rank in ranks]
    reached = all(statuses)
    status = next((s["status"] for s in statuses if s and s["status"]), 0) if reached else launch.returncode

    def read(stream):  # every rank's, as torchrun would have collected them
        return "".join(path.read_text() for rank in ranks if (path := out_dir / f"{stream}-r{rank}.txt").exists())

    run = RunResult(
        command=[*launch.command, f"(row {out_dir.name})"], returncode=status, stdout=read("stdout"),
        stderr=read("stderr") + ("" if reached else f"RuntimeError: this row did not finish (an earlier row failed?)\n{launch.stderr}"),
        wall_s=max(s["wall_s"] for s in statuses) if reached else launch.wall_s, timed_out=launch.timed_out and not reached,
    )  # fmt: skip
    observation = lab4.Observation(run, out_dir, timeout_s=timeout_s)
    for rank in ranks:
        path = out_dir / f"events-r{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        observation.events[rank] = [event for event in map(lab4.parse_event, lines) if event is not None]
    return observation


# --- the ranks' side, under torchrun ---------------------------------------------------------------------
class CurrentRecorder:
    """What the observer's patches report to: the Recorder of the row that runs now."""

    def __init__(self):
        self.current = None

    def __getattr__(self, name):
        return getattr(self.current, name)


def run_row(observer, proxy: CurrentRecorder, row: dict, rank: int, world_size: int) -> int:
    """lab4_observe.main() for one row, with the script's output in files; returns its exit status."""
    out_dir, script = Path(row["out_dir"]), Path(row["script"]).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    saved_argv, saved_path, saved_env = list(sys.argv), list(sys.path), dict(os.environ)
    os.environ.update(row.get("env", {}))  # before the Recorder, which reads LAB4_OBSERVE_STEPS and _RESCUE
    proxy.current = recorder = observer.Recorder(out_dir, rank, world_size)
    sys.argv = [str(script), *row["args"]]
    sys.path[0] = str(script.parent)  # as if python had been started on SCRIPT itself
    started, status = time.monotonic(), 1
    with open(out_dir / f"stdout-r{rank}.txt", "w") as out, open(out_dir / f"stderr-r{rank}.txt", "w") as err:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(str(script), run_name="__main__")
                status = 0
            except SystemExit as done:
                status = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
                if isinstance(done.code, str):
                    print(done.code, file=sys.stderr)  # sys.exit("message"), as Python itself would print it
            except BaseException:
                traceback.print_exc()
            finally:
                recorder.emit(kind="exit", status=status)
                recorder.write_state(finished=True)
                recorder.events.close()
    gc.collect()  # DDP's reference cycles would keep the row's group alive (ddp_course/distributed.py)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.argv, sys.path[:] = saved_argv, saved_path
    os.environ.clear()
    os.environ.update(saved_env)
    (out_dir / f"status-r{rank}.json").write_text(json.dumps({"status": status, "wall_s": time.monotonic() - started}))
    return status


def main(rows_file: str) -> int:
    # Found beside this file only when it runs as a script (sys.path[0]); the tests' import needs none of it.
    from record_collectives import give_each_row_its_own_store_keys

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    observer = import_script(OBSERVER, name="lab4_observe")
    proxy = CurrentRecorder()
    observer.install(proxy)
    give_each_row_its_own_store_keys()
    for row in json.loads(Path(rows_file).read_text()):
        status = run_row(observer, proxy, row, rank, world_size)
        if status != 0:
            return status
    return 0


if __name__ == "__main__":
    status = main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # after a failing row a peer may be blocked in a collective; torchrun must see the status
