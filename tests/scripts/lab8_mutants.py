"""Test helper: labs/lab8_fsdp.py judging wrong FSDPs, every row in ONE torchrun job (one gloo group).

    torchrun --standalone --nproc_per_node=2 tests/scripts/lab8_mutants.py --json rows.json [--rows a,b]

Each row runs the lab's own judge(args, ctx) - what main() runs between setting up and tearing down the
process group - on one FSDP module, and records its exit status and what rank 0 printed:
  untouched    labs/minifsdp.py as committed: the first TODO, in one line, status 1
  sums         the solution, but the reduce-scatter SUMS the ranks' gradient slices (forgets to average):
               the weights differ from one process's
  never_frees  the solution, but each unit's forward hook forgets to free its full weights: the weights
               are right (backward finds them still gathered), so only the around-use check and the
               bytes per step (backward gathers nothing: 2/3 of the formula) can catch it
One job instead of one per row: each torchrun start costs every rank seconds of imports. Rank 0 writes
{row: {"status", "stdout", "stderr"}} to --json. Exit status 0 when every row ran (whatever its verdict).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

from ddp_course.distributed import setup_distributed, teardown_distributed
from ddp_course.launch import REPO_ROOT, import_script

LAB8 = REPO_ROOT / "labs" / "lab8_fsdp.py"
lab8 = import_script(LAB8, "lab8_fsdp")
SMALL = ["--impl", "fsdp", "--check-steps", "1", "--warmup-steps", "1", "--repeats", "0"]


def summing(module):
    """The reduce-scatter sums: every slice's gradient is world_size times the average. It calls the
    collective through torch.distributed when it runs, so the lab's collective counter still sees it."""
    def reduce_scatter_sum(out, flat, *args, **kwargs):
        collective = getattr(module.dist, "reduce_scatter_single", None) or module.dist.reduce_scatter_tensor
        return collective(out, flat * module.dist.get_world_size(), *args, **kwargs)

    module.reduce_scatter_single = reduce_scatter_sum
    return module


def never_freeing(module):
    """_after_forward runs with every group's release() disabled: the full weights stay until backward."""
    original = module.FSDP._after_forward

    def after_forward_without_release(self, unit, inputs, output):
        groups = self._groups_of[unit]
        for group in groups:
            group.release = lambda: None  # an instance attribute hides ShardGroup.release
        try:
            return original(self, unit, inputs, output)
        finally:
            for group in groups:
                del group.release

    module.FSDP._after_forward = after_forward_without_release
    return module


ROWS = {  # row -> (--module, how to change the loaded minifsdp)
    "untouched": ("labs", None),
    "sums": ("solutions", summing),
    "never_frees": ("solutions", never_freeing),
}


def run_row(name: str, ctx) -> dict:
    module_name, mutate = ROWS[name]
    minifsdp = import_script(REPO_ROOT / module_name / "minifsdp.py", f"{name}_minifsdp")  # a fresh copy per row
    if mutate is not None:
        mutate(minifsdp)
    lab8.load_minifsdp = lambda module: minifsdp
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = lab8.judge(lab8.parse_args(["--module", module_name, *SMALL]), ctx)
    return {"status": status, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated, from: " + ", ".join(ROWS))
    parser.add_argument("--timeout-s", type=float, default=60.0, help="the longest any collective may wait")
    args = parser.parse_args()
    rows = args.rows.split(",")
    if set(rows) - set(ROWS):
        parser.error(f"unknown rows {sorted(set(rows) - set(ROWS))}")
    sys.argv[0] = str(LAB8)  # the lab's error lines start with its own name, as when torchrun runs it
    ctx = setup_distributed("gloo", timeout_s=args.timeout_s)
    try:
        results = {name: run_row(name, ctx) for name in rows}  # every wrapper is dropped inside run_row
    finally:
        teardown_distributed()
    if ctx.is_main:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
