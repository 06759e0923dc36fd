"""Several observed jobs in one torchrun launch: lab 4's observer (labs/lab4_observe.py), row after row.

    torchrun --standalone --nproc_per_node=2 tests/scripts/observe_rows.py ROWS.json

ROWS.json is a list of {"name": ..., "out_dir": ..., "script": ..., "args": [...]}. For tests only
(tests/test_lab3_convert_check.py): most of an observed job is Python, torch and torch._dynamo
start-up (about 10 CPU-seconds for the agent and 2 ranks), and the lab 3 checker's planted mistakes
are 7 short jobs of the same kind. Here each rank starts once and runs the rows one after another,
each exactly as labs/lab4_observe.py's main() runs its one script: a fresh Recorder writing into the
row's out_dir, the script run as __main__ with its own argv, then the "exit" event and the finished
state. What differs from a launch of its own is written into out_dir for the test to read:

- stdout-r<rank>.txt, stderr-r<rank>.txt: what the row's script printed from Python (torchrun would
  have collected it);
- status-r<rank>.json: {"status": the script's exit status, "wall_s": seconds}: the job's exit status.

The observer's patches are installed once and report to the current row's Recorder. Each row's
process group gets torchrun's store under a key prefix of its own (record_collectives.py). A row
that fails on some rank ends the launch with its status: a peer may be blocked in DDP's gradient
all-reduce, which the observer cannot rescue; the later rows leave no status file.
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

from ddp_course.launch import import_script
from record_collectives import give_each_row_its_own_store_keys

OBSERVER = Path(__file__).resolve().parents[2] / "labs" / "lab4_observe.py"


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
    proxy.current = recorder = observer.Recorder(out_dir, rank, world_size)
    saved_argv, saved_path, saved_env = list(sys.argv), list(sys.path), dict(os.environ)
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
