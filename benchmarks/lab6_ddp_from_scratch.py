"""Lab 6's benchmark: the from-scratch wrappers against torch's DDP on the character transformer, 2 ranks.

    flock /tmp/ddp_heavy.lock python benchmarks/lab6_ddp_from_scratch.py [--rounds 3] [--bucket-caps 25,1]

Runs labs/lab6_ddp_from_scratch.py --module solutions (all implementations, which also re-checks their
weights against one process) once per bucket cap per round, the caps interleaved round after round.
Inside each job the implementations' timings are interleaved and each job reports, per implementation,
the median of same-repeat ratios to torch DDP's step time; the benchmark keeps the median over rounds,
so a slow moment of the machine that hits one repeat or one round does not decide the verdict.

Targets, checked at every cap: BucketedDDP at most 1.10x torch DDP's step time, and NaiveDDP
slower than both. Exits with status 1 when one is missed, 0 when all are met.
At 25 MiB this model's 3.1 MiB of gradients make ONE bucket (nothing can overlap with backward);
at 1 MiB they make four, about one per transformer block.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from ddp_course.checkpoint import atomic_write_json
from ddp_course.cli import float_list, positive_int
from ddp_course.launch import REPO_ROOT, run_torchrun
from ddp_course.reporting import format_table

SCRIPT = REPO_ROOT / "labs" / "lab6_ddp_from_scratch.py"
BUCKETED_VS_TORCH_MAX = 1.10


def run_job(cap: float, args, folder: Path) -> dict[str, dict]:
    """One 2-rank job at one bucket cap: {impl: its record}."""
    path = folder / f"cap{cap:g}.json"
    job_args = ["--module", "solutions", "--impl", "all", "--bucket-cap-mb", cap, "--json", path,
                "--steps", args.steps, "--repeats", args.repeats]  # fmt: skip
    result = run_torchrun(SCRIPT, job_args, nproc=2, timeout_s=600)
    if result.aborted_at_exit:  # the rare gloo crash after the work is done (ddp_course.launch): once more
        result = run_torchrun(SCRIPT, job_args, nproc=2, timeout_s=600)
    if not result.ok:
        print(result.describe(), file=sys.stderr)
        raise SystemExit(f"the job at bucket cap {cap:g} MiB failed (its output is above)")
    return {record["impl"]: record for record in json.loads(path.read_text())}


def summarise(cap: float, rounds: list[dict[str, dict]]) -> dict:
    """Median over rounds of each implementation's step time and of its ratio to torch DDP's (each job's
    ratio is itself the median of same-repeat ratios: see the lab's median_ratio)."""
    summary = {"bucket_cap_mb": cap, "rounds": len(rounds)}
    summary["no_sync_ms"] = 1000 * statistics.median(r["torch"]["step_time_no_sync_s"] for r in rounds)
    for impl in ("naive", "overlap", "bucketed", "torch"):
        summary[f"{impl}_ms"] = 1000 * statistics.median(r[impl]["step_time_s"] for r in rounds)
        summary[f"{impl}_vs_torch"] = statistics.median(r[impl]["vs_torch_ddp"] for r in rounds)
    summary["bucketed_vs_torch_by_round"] = [r["bucketed"]["vs_torch_ddp"] for r in rounds]
    summary["checks_passed"] = all(record["check_passed"] for r in rounds for record in r.values())
    return summary


def verdicts(summary: dict) -> list[tuple[str, bool]]:
    return [
        (f"BucketedDDP / torch DDP = {summary['bucketed_vs_torch']:.3f} <= {BUCKETED_VS_TORCH_MAX}",
         summary["bucketed_vs_torch"] <= BUCKETED_VS_TORCH_MAX),
        (f"NaiveDDP slower than BucketedDDP ({summary['naive_ms']:.1f} > {summary['bucketed_ms']:.1f} ms)",
         summary["naive_ms"] > summary["bucketed_ms"]),
        (f"NaiveDDP slower than torch DDP ({summary['naive_ms']:.1f} > {summary['torch_ms']:.1f} ms)",
         summary["naive_ms"] > summary["torch_ms"]),
        ("every implementation passed the weight check", summary["checks_passed"]),
    ]  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive_int, default=3, help="jobs per bucket cap, interleaved")
    parser.add_argument("--bucket-caps", type=float_list, default=[25.0, 1.0], help="MiB, comma-separated")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps per repeat (passed to the lab)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="repeats per job (passed to the lab)")
    parser.add_argument("--json", help="also write the summaries here")
    args = parser.parse_args()
    results = {cap: [] for cap in args.bucket_caps}
    with tempfile.TemporaryDirectory() as folder:
        for number in range(1, args.rounds + 1):
            for cap in args.bucket_caps:
                print(f"round {number}/{args.rounds}: bucket cap {cap:g} MiB ...", flush=True)
                results[cap].append(run_job(cap, args, Path(folder)))
    summaries = [summarise(cap, rounds) for cap, rounds in results.items()]
    columns = ["bucket_cap_mb", "no_sync_ms", "naive_ms", "overlap_ms", "bucketed_ms", "torch_ms", "naive_vs_torch",
               "overlap_vs_torch", "bucketed_vs_torch"]  # fmt: skip
    print(f"2 ranks, medians over {args.rounds} rounds (each job: median of {args.repeats} x {args.steps} steps, slowest rank)")
    print(format_table(summaries, columns))
    met = True
    for summary in summaries:
        for text, ok in verdicts(summary):
            print(f"  {'met   ' if ok else 'MISSED'}  cap {summary['bucket_cap_mb']:g} MiB: {text}")
            met &= ok
    if args.json:
        atomic_write_json(summaries, args.json)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
