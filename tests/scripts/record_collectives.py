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
flag exits non-zero on purpose), "out_dir" (the row's own stdout and stderr, as
out_dir/stdout-r<rank>.txt and stderr-r<rank>.txt, instead of the launch's shared streams) and
"late_start" ({"rank": r, "seconds": s}: rank r starts the row s seconds after its peers, which then
wait for it in the script's own set-up - a slow rank, without a launch of its own). Each
rank imports torch once and runs the rows one after another, each as __main__ with its own argv;
the ranks start each row together (a barrier on torchrun's store: a row with a short timeout must
not spend it waiting for a peer still busy with the previous row); calls are counted per row and
each row ends with its own line on the launch's stdout:
    [collectives rank R row NAME] status S calls N violations M ops ...
The rows run through the course's one batched-launch runner, ddp_course/checking/rows.py: each row's
process group gets torchrun's store under a key prefix of its own, and what a script may change for
the rest of the process (environment variables, sys.path, the distributed debug level, the
repository's own modules) is put back after each row. A row that
fails (any exit status but its expected one, an exception included) ends the launch with its status,
or 1 if it passed where it should have failed: its peers may be waiting in a collective it will never
join, and the later rows would start from a broken state. So ranks whose statuses differ end the
launch visibly: torchrun stops the others. A row whose collectives time out on purpose goes last.
When torchrun restarts the launch (--max-restarts, for a row that crashes on purpose), the new
attempt skips the rows that passed on every rank in an earlier one: each rank leaves a marker file
beside ROWS.json for every row it passed. A skipped row prints no new line; its earlier one stands.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import time

import torch
import torch.distributed as dist

from ddp_course.checking.collectives import ALL_COLLECTIVES, install as install_wrappers
from ddp_course.checking.rows import give_each_group_its_own_store_keys, run_rows, run_script

calls: dict[str, int] = {}
violations: list[str] = []


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
    install_wrappers(ALL_COLLECTIVES, checked)


def report(row: str | None = None, status: int | None = None) -> None:
    rank = os.environ.get("RANK", "0")
    tag = f"[collectives rank {rank}]" if row is None else f"[collectives rank {rank} row {row}]"
    ops = ",".join(f"{op}={count}" for op, count in sorted(calls.items()))
    lines = [f"{tag} VIOLATION {problem}" for problem in violations]
    status_field = "" if status is None else f"status {status} "
    lines.append(f"{tag} {status_field}calls {sum(calls.values())} violations {len(violations)} ops {ops}")
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


def device_rule_failures(stdout: str, nproc: int) -> list[str]:
    """What a one-script run's summary lines (above) show wrong: a rank without its line, a rank that made
    no collective call through torch.distributed, every VIOLATION line; [] when nothing is wrong. For a
    test that launches a script under this recorder instead of a second launch of its own."""
    summaries = {int(m[1]): (int(m[2]), int(m[3])) for m in re.finditer(r"^\[collectives rank (\d+)\] calls (\d+) violations (\d+) ", stdout, re.M)}
    failures = [f"rank {rank} printed no summary line" for rank in range(nproc) if rank not in summaries]
    failures += [f"rank {rank} made no collective call" for rank, (calls, _) in summaries.items() if calls == 0]
    return failures + [line for line in stdout.splitlines() if line.startswith("[collectives rank") and "VIOLATION" in line]


def start_the_row(row: dict) -> None:
    """Forget the last row's calls; the row's late rank, if any, waits before the row starts (its peers run it)."""
    calls.clear()
    violations.clear()
    late = row.get("late_start")
    if late and os.environ.get("RANK") == str(late["rank"]):
        # On the launch's stderr: the row's own files are opened after this, when the script starts.
        sys.stderr.write(f"late start: rank {late['rank']} sleeps {late['seconds']} s before row {row['name']}\n")
        sys.stderr.flush()
        time.sleep(late["seconds"])


def report_row(row: dict, status: int) -> None:
    report(row["name"], status)


if __name__ == "__main__":
    install()
    if sys.argv[1] == "--rows":
        give_each_group_its_own_store_keys("row")
        with open(sys.argv[2]) as rows_file:
            rows = json.load(rows_file)
        status = run_rows(rows, os.path.dirname(os.path.abspath(sys.argv[2])), start_the_row, report_row)
        sys.stdout.flush()
        sys.stderr.flush()
        # os._exit: after a failing row a peer may be blocked in a collective, and torchrun must see the status.
        os._exit(status)
    script, *script_args = sys.argv[1:]
    try:
        run_script(script, script_args)
    finally:
        report()
