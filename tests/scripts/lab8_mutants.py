"""Test helper: labs/lab8_fsdp.py on every implementation and judging wrong FSDPs, every row in ONE gloo group.

    torchrun --standalone --nproc_per_node=2 tests/scripts/lab8_mutants.py --json rows.json [--rows a,b]

tests/scripts/sharding_checks.py runs these rows in its 2-rank job (run_rows), beside lab 6's and lab 8's
other checks: one torch start-up for all of them. Each row runs the lab's own judge(args, ctx) - what main()
runs between setting up and tearing down the process group - and records its exit status, what rank 0
printed, and the records the lab wrote (--json). The lab on the finished code:
  all_impls          --impl all, few steps, one timing repeat: every implementation PASSes, status 0
On one FSDP module each, --impl fsdp:
  untouched          labs/minifsdp.py as committed: the first TODO, in one line, status 1
  sums               the solution, but the reduce-scatter SUMS the ranks' gradient slices (forgets to
                     average): the weights differ from one process's
  never_frees        the solution, but each unit's forward hook forgets to free its full weights: the
                     weights are right (backward finds them still gathered), so only the around-use check
                     and the bytes per step (backward gathers nothing: 2/3 of the formula) can catch it
--part K, on the exercise with parts 1 to J solved (the rest TODOs, as a learner has it):
  part1_untouched    --part 1, nothing solved: the part 1 TODO
  part2_solved_1     --part 2, part 1 solved: part 1 PASSes, then the part 2 TODO
  part2_solved_12    --part 2, parts 1 and 2 solved: PASS, status 0 (part 3's TODOs never run)
  part3_solved_12    --part 3, parts 1 and 2 solved: parts 1 and 2 PASS, then a part 3 TODO
  part2_never_frees  --part 2 on the never-freeing solution: part 2's around-use check FAILs
One job instead of one per row: each torchrun start costs every rank seconds of imports. Rank 0 writes
{row: {"status", "stdout", "stderr"}} to --json. Exit status 0 when every row ran (whatever its verdict).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import types
from pathlib import Path

from ddp_course.checking.rows import captured
from ddp_course.distributed import setup_distributed, teardown_distributed
from ddp_course.authoring.exercises import exercise_header, make_exercise
from ddp_course.launch import REPO_ROOT, import_script

LAB8 = REPO_ROOT / "labs" / "lab8_fsdp.py"
lab8 = import_script(LAB8, "lab8_fsdp")
SOLUTION = REPO_ROOT / "solutions" / "minifsdp.py"


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


def solved_up_to(last_part: int):
    """The exercise as generated from the solution, with parts 1 to last_part solved (a fresh module)."""

    def build(name):
        text = make_exercise(SOLUTION.read_text(), exercise_header("solutions/minifsdp.py", "labs/minifsdp.py"),
                             parts=range(last_part + 1, 4))  # fmt: skip
        module = types.ModuleType(name)
        sys.modules[name] = module
        exec(compile(text, f"<{name}>", "exec"), module.__dict__)
        return module

    return build


def from_file(folder: str, mutate=None):
    """labs/ or solutions/ minifsdp.py, freshly imported, changed by mutate if given."""

    def build(name):
        module = import_script(REPO_ROOT / folder / "minifsdp.py", name)
        return mutate(module) if mutate else module

    return build


FSDP_CHECK = ["--impl", "fsdp", "--check-steps", "1", "--warmup-steps", "1", "--repeats", "0"]
ALL_IMPLS = ["--impl", "all", "--check-steps", "2", "--warmup-steps", "1", "--steps", "1", "--repeats", "1"]
ROWS = {  # row -> (--module the lab is told, how to build the minifsdp it gets, the lab's other flags)
    "all_impls": ("solutions", from_file("solutions"), ALL_IMPLS),
    "untouched": ("labs", from_file("labs"), FSDP_CHECK),
    "sums": ("solutions", from_file("solutions", summing), FSDP_CHECK),
    "never_frees": ("solutions", from_file("solutions", never_freeing), FSDP_CHECK),
    "part1_untouched": ("labs", from_file("labs"), ["--part", "1"]),
    "part2_solved_1": ("labs", solved_up_to(1), ["--part", "2"]),
    "part2_solved_12": ("labs", solved_up_to(2), ["--part", "2"]),
    "part3_solved_12": ("labs", solved_up_to(2), ["--part", "3", "--check-steps", "1"]),
    "part2_never_frees": ("solutions", from_file("solutions", never_freeing), ["--part", "2"]),
}


def run_row(name: str, ctx) -> dict:
    module_name, build, flags = ROWS[name]
    minifsdp = build(f"{name}_minifsdp")  # a fresh copy per row
    lab8.load_minifsdp = lambda module: minifsdp
    with tempfile.TemporaryDirectory(prefix="lab8_row_") as folder:  # rank 0's records are the ones written
        records = Path(folder) / "records.json"
        args = lab8.parse_args(["--module", module_name, *flags, "--json", str(records)])
        result = captured(lambda: lab8.judge(args, ctx), LAB8)
        result["records"] = json.loads(records.read_text()) if records.exists() else None
    return result


def run_rows(ctx, rows=tuple(ROWS)) -> dict:
    """{row: its result}, every row in this job's process group; every wrapper is dropped inside run_row."""
    return {name: run_row(name, ctx) for name in rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated, from: " + ", ".join(ROWS))
    parser.add_argument("--timeout-s", type=float, default=60.0, help="the longest any collective may wait")
    args = parser.parse_args()
    rows = args.rows.split(",")
    if set(rows) - set(ROWS):
        parser.error(f"unknown rows {sorted(set(rows) - set(ROWS))}")
    ctx = setup_distributed("gloo", timeout_s=args.timeout_s)
    try:
        results = run_rows(ctx, rows)
    finally:
        teardown_distributed()
    if ctx.is_main:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
