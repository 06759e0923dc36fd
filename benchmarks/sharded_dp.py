"""Lab 8's benchmark: DDP, ZeRO-1, the from-scratch FSDP and fully_shard at 2 and 4 ranks, against the targets.

    flock /tmp/ddp_heavy.lock python benchmarks/sharded_dp.py [--ranks 2,4] [--repeats 5] [--json PATH]

Runs labs/lab8_fsdp.py --module solutions --impl all once per rank count (which also re-checks every
implementation's weights against one process), then once more on 2 ranks with the from-scratch FSDP
sending one message per weight matrix (--fsdp-units matrices) next to fully_shard, and prints one table
row per implementation and rank count. Its targets, with AdamW:
  - FSDP's per-rank model-state bytes (the fullest rank) <= 0.55x DDP's at 2 ranks and <= 0.30x at 4;
  - the from-scratch FSDP's step time <= 1.5x fully_shard's at 2 gloo ranks (the median over repeats of
    same-repeat ratios: the two ran back to back), with its default units (one message per block);
  - every implementation's bytes sent per step within 5% of the formula (ddp_course.sharding).
Exits with status 1 when a target is missed, 0 when all are met. Bytes do not depend on the machine's
load; the step-time ratio does: run it when the machine is quiet, and say its load.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from ddp_course.checkpoint import atomic_write_json
from ddp_course.cli import int_list, positive_int
from ddp_course.launch import REPO_ROOT, run_torchrun
from ddp_course.reporting import format_table

SCRIPT = REPO_ROOT / "labs" / "lab8_fsdp.py"
STATE_VS_DDP_MAX = {2: 0.55, 4: 0.30}
FSDP_VS_FULLY_SHARD_MAX = 1.5
BYTES_VS_FORMULA_TOLERANCE = 0.05


def run_job(nproc: int, args, folder: Path, impls=("all",), fsdp_units="blocks") -> list[dict]:
    """One job of nproc ranks: its records, one per implementation."""
    path = folder / f"ranks{nproc}_{fsdp_units}.json"
    job_args = ["--module", "solutions", "--json", path, "--steps", args.steps, "--repeats", args.repeats,
                "--fsdp-units", fsdp_units] + [flag for impl in impls for flag in ("--impl", impl)]  # fmt: skip
    result = run_torchrun(SCRIPT, job_args, nproc=nproc, timeout_s=600)
    if result.aborted_at_exit:  # the rare gloo crash after the work is done (ddp_course.launch): once more
        result = run_torchrun(SCRIPT, job_args, nproc=nproc, timeout_s=600)
    if not result.ok:
        print(result.describe(), file=sys.stderr)
        raise SystemExit(f"the job on {nproc} ranks failed (its output is above)")
    return json.loads(path.read_text())


def verdicts(records: list[dict]) -> list[tuple[str, bool]]:
    found = []
    for record in records:
        n, impl = record["world_size"], record["impl"]
        ratio = record["bytes_vs_formula"]
        found.append((f"{n} ranks {impl}: bytes per step {ratio:.3f}x the formula (within {BYTES_VS_FORMULA_TOLERANCE:.0%})",
                      abs(ratio - 1) <= BYTES_VS_FORMULA_TOLERANCE))  # fmt: skip
        found.append((f"{n} ranks {impl}: weights equal one process's", record["check_passed"]))
        found.append((f"{n} ranks {impl}: the lab's verdict (weights, bytes, full weights only around use)", record["passed"]))
        if impl in ("fsdp", "fully_shard") and n in STATE_VS_DDP_MAX:
            found.append((f"{n} ranks {impl}: model state {record['state_vs_ddp']:.3f}x DDP's <= {STATE_VS_DDP_MAX[n]}",
                          record["state_vs_ddp"] <= STATE_VS_DDP_MAX[n]))  # fmt: skip
        if impl == "fsdp" and n == 2 and record["backend"] == "gloo" and record["fsdp_units"] == "blocks":
            found.append((f"2 ranks: from-scratch FSDP step time {record['vs_fully_shard']:.2f}x fully_shard's "
                          f"<= {FSDP_VS_FULLY_SHARD_MAX}", record["vs_fully_shard"] <= FSDP_VS_FULLY_SHARD_MAX))  # fmt: skip
    return found


def table(records: list[dict]) -> str:
    rows = [{"ranks": r["world_size"], "impl": r["impl"], "units": r["fsdp_units"] or "-",
             "messages": r["messages_per_step"], "state_MiB": r["model_state_bytes"]["total"] / 2**20,
             "state_vs_ddp": r["state_vs_ddp"] or "-", "ring_model_MiB": r["ring_model_bytes_per_step"] / 2**20,
             "formula_MiB": r["bytes_per_step_predicted"] / 2**20, "bytes_ratio": r["bytes_vs_formula"],
             "step_ms": 1000 * r["step_time_s"], "vs_fully_shard": r["vs_fully_shard"]} for r in records]  # fmt: skip
    return format_table(rows, list(rows[0]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int_list, default=[2, 4], help="rank counts, comma-separated")
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps per repeat (passed to the lab)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="repeats per job (passed to the lab)")
    parser.add_argument("--json", help="also write every record here")
    args = parser.parse_args()
    if any(n < 2 for n in args.ranks):
        parser.error("--ranks: every rank count must be at least 2 (one process shards nothing)")
    load_at_start = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        records = [record for n in args.ranks for record in run_job(n, args, Path(folder))]
        results = verdicts(records)  # the targets are the default job's
        if 2 in args.ranks:  # the same FSDP, one message per weight matrix: what grouping buys (shown, no target)
            records += run_job(2, args, Path(folder), impls=("fsdp", "fully_shard"), fsdp_units="matrices")
    print(
        f"load average (1, 5, 15 min) at the start {load_at_start[0]:.2f}, {load_at_start[1]:.2f}, {load_at_start[2]:.2f}; "
        f"at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(table(records))
    for text, met in results:
        print(f"{'met   ' if met else 'MISSED'}  {text}")
    if args.json:
        atomic_write_json(records, args.json)
    return 0 if all(met for _, met in results) else 1


if __name__ == "__main__":
    sys.exit(main())
