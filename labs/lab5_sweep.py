"""Lab 5's checkpoint sweep: one torchrun job of labs/lab5_scaling.py per configuration, bucket cap,
world size and round, then the scaling efficiency of each point, a table and a figure.

It runs through lab 5's own command line (no torchrun: it launches the jobs itself):

    python labs/lab5_scaling.py --sweep 1,2 --json runs/scaling.json

What one job measures (DDP and no_sync step times, the communication fraction) is lab5_scaling.py's
measure(); this file is the bookkeeping around many jobs: how rounds are interleaved and which one is
kept (run_sweep's docstring says why), and how efficiency is computed.
"""

import json
import sys
from pathlib import Path

from ddp_course.checkpoint import atomic_write_json
from ddp_course.cli import CourseError
from ddp_course.launch import run_torchrun
from ddp_course.reporting import format_table, plot_scaling

SCALING_SCRIPT = Path(__file__).with_name("lab5_scaling.py")


def cap_label(cap) -> str:
    """A --bucket-cap-mb value in words: the string "default" (DDP's own choice) or a size in MiB."""
    return "DDP's default buckets" if isinstance(cap, str) else f"buckets of {cap:g} MiB"


def run_sweep(args) -> int:
    """Launch one torchrun job per (config, bucket cap, world size) and round; add the scaling efficiency.

    A shared machine (a laptop with a browser open, a cloud VM with busy neighbours) slows some jobs
    down for seconds at a time, and a 1-rank job that ran in a slow moment against a 2-rank job that
    did not makes up an efficiency. So the sweep measures every point --rounds times, interleaved
    (1, 2, 1, 2, ... ranks), and keeps each point's fastest round: other programs slow a job down,
    they do not speed it up, so the fastest round is the closest to what the hardware can do. (Inside
    each job, every mode's time is already the median of --repeats timings.) Every round's throughput
    is kept in the record (samples_per_s_by_round), so the spread stays visible.
    """
    points = [(config, cap, world_size) for config in args.configs for cap in args.bucket_caps for world_size in args.sweep]
    rounds_of = {point: [] for point in points}
    for round_number in range(1, args.rounds + 1):
        for point in points:
            config, cap, world_size = point
            print(f"round {round_number}/{args.rounds}: measuring {config} on {world_size} rank(s), {cap_label(cap)} ...", flush=True)
            rounds_of[point].append(run_job(args, *point))
    records = [fastest_round(rounds_of[point]) for point in points]
    add_efficiency(records, strong=bool(args.global_batch))
    atomic_write_json(records, args.json)
    columns = ["config", "bucket_cap_mb", "world_size", "per_rank_batch", "samples_per_s", "step_time_s", "comm_fraction"]
    print(format_table(records, columns + ["strong_scaling_efficiency" if args.global_batch else "weak_scaling_efficiency"]))
    plot_path = args.plot or str(Path(args.json).with_suffix(".png"))
    plot_scaling(records, plot_path)
    print(f"results: {args.json}   figure: {plot_path}")
    return 0


def run_job(args, config: str, cap, world_size: int) -> dict:
    """One torchrun job of lab5_scaling.py measuring one configuration; returns its record."""
    result_file = Path(args.json).resolve().parent / f".lab5_{config}_{cap}_{world_size}.json"
    job_args = ["--config", config, "--bucket-cap-mb", cap, "--json", result_file,
                "--warmup-steps", args.warmup_steps, "--steps", args.steps, "--repeats", args.repeats,
                "--comm-hook", args.comm_hook, "--backend", args.backend, "--timeout-s", args.timeout_s]  # fmt: skip
    job_args += ["--amp"] * args.amp
    job_args += ["--global-batch", args.global_batch] if args.global_batch else []
    job_args += ["--batch-size", args.batch_size] if args.batch_size else []
    # use_gpus: the jobs see the GPUs this driver sees (none when a test or notebook hid them).
    launch = dict(nproc=world_size, threads_per_rank=args.threads_per_rank, timeout_s=600, use_gpus=True)
    job = run_torchrun(SCALING_SCRIPT, job_args, **launch)
    if job.aborted_at_exit:  # a rare gloo crash at exit, after the work: see ddp_course.launch
        print("  a rank aborted while exiting (a rare gloo teardown crash, not your measurement): measuring again")
        job = run_torchrun(SCALING_SCRIPT, job_args, **launch)
    if not job.ok:
        print(job.describe(), file=sys.stderr)
        raise CourseError(f"the {config} job on {world_size} rank(s) failed (its output is above)")
    return read_and_remove(result_file)


def fastest_round(rounds: list[dict]) -> dict:
    """The round with the highest throughput, noting every round's throughput beside it."""
    best = dict(max(rounds, key=lambda record: record["samples_per_s"]))
    best["samples_per_s_by_round"] = [record["samples_per_s"] for record in rounds]
    return best


def read_and_remove(path: Path) -> dict:
    record = json.loads(path.read_text())
    path.unlink()
    return record


def add_efficiency(records: list[dict], strong: bool) -> None:
    """efficiency = global throughput / (N x one rank's throughput); 1.0 is perfect scaling.

    Weak scaling keeps the per-rank batch (the global batch grows with N); strong scaling keeps the
    global batch (each rank's share shrinks). The formula is the same in samples per second.
    """
    key = "strong_scaling_efficiency" if strong else "weak_scaling_efficiency"
    for record in records:
        single = [r for r in records if r["world_size"] == 1 and r["config"] == record["config"]
                  and r["bucket_cap_mb"] == record["bucket_cap_mb"]]  # fmt: skip
        efficiency = record["samples_per_s"] / (record["world_size"] * single[0]["samples_per_s"]) if single else None
        record["weak_scaling_efficiency"] = None if strong else efficiency
        record[key] = efficiency
