"""Lab 6: DDP from scratch - your wrappers checked against one process and torch's DDP, then timed.

labs/minddp.py is the exercise (solutions/minddp.py the finished version): NaiveDDP all-reduces
every gradient after backward; OverlapDDP launches one asynchronous all-reduce per parameter from a
hook as soon as its gradient is ready; BucketedDDP groups gradients into buckets of --bucket-cap-mb
and launches one asynchronous all-reduce per full bucket. For each implementation this script
  1. CHECKS: after --check-steps SGD steps on disjoint shards, the weights must equal those of ONE
     process training on the whole batch (every rank redoes that reference itself: it draws the
     whole batch) and those of torch's DistributedDataParallel, within a tolerance derived from
     float32's eps. A run without synchronisation is shown beside them: the check can fail (with one
     process it cannot differ, so it is skipped). Then two small models catch what the transformer
     cannot: a gradient order that depends on the rank, and parameters unused on some ranks (each
     wrapper must finish and average them as zeros). A case that has not finished after
     --case-timeout-s seconds is a hang: it prints FAIL and the job ends;
  2. TIMES a training step (warm-up, repeats interleaved across implementations, the slowest rank's
     time, median of the repeats; ratios are medians of same-repeat ratios) and prints a table;
  3. with --train-steps N, trains the model with a from-scratch wrapper and prints the job's loss.
The checks and the timing harness are ddp_course/checking/lab6.py; this script is their front end.
The model is ddp_course.models.CharTransformer (0.81 M parameters in 52 tensors, tied input/output
embeddings), a character-level language model of the standard library's own source code: no download.

From the repository root:
    the exercise, 2 CPU processes:  torchrun --standalone --nproc_per_node=2 labs/lab6_ddp_from_scratch.py --impl naive
    every finished wrapper:         torchrun --standalone --nproc_per_node=2 labs/lab6_ddp_from_scratch.py --module solutions
    smaller buckets:                ... --module solutions --impl bucketed --impl torch --bucket-cap-mb 1
    torch DDP's own default:        ... --module solutions --impl torch --bucket-cap-mb default   (1 MiB first bucket, then 25)
    your ZeRO-1 (part 4):           ... --impl torch --zero   (torch DDP + your ShardedOptimizer vs AdamW: checked, then timed)
    stretch goal, your own file:    ... --file labs/naive_ddp_stretch.py --impl naive   (the same check, on its NaiveDDP)
    train for 300 steps:            ... --module solutions --impl bucketed --train-steps 300 --repeats 0
    records and traces:             ... --module solutions --json runs/lab6.json --profile runs/lab6_trace
    N GPUs (NCCL; written with care, NOT YET RUN on a GPU):
                                    torchrun --standalone --nproc_per_node=N labs/lab6_ddp_from_scratch.py --module solutions
    one process (N = 1 or plain python: the check runs, its "no sync" control is skipped):
                                    python labs/lab6_ddp_from_scratch.py --module solutions

--profile DIR writes DIR/<impl>/trace_rank<r>.json for every rank: torch.profiler traces of a few
steps in Chrome's trace format (ddp_course.profiling reads them back and draws the timeline). Open one at https://ui.perfetto.dev ("Open trace file") or chrome://tracing
("Load"): the gloo all-reduces launched from the hooks appear while autograd's backward is still
running for OverlapDDP, BucketedDDP and torch DDP, and only after it for NaiveDDP. While it traces,
torch's profiler library prints "USDT ... profiler_start/stop" lines, and on a machine without a GPU
"gpuGetDeviceCount failed with code 35": both harmless (KINETO_LOG_LEVEL=5 hides the second).

What you should see: with labs/minddp.py untouched, one line naming the first TODO and exit status 1.
With --module solutions on 2 CPU ranks (20 s here), every wrapper passes the check (differences
of 1.2e-7 against a tolerance of 3.8e-5; the unsynchronised control differs by 7.8e-2), then the step
times: about 24 ms without communication, 30 ms for BucketedDDP and torch DDP, 60 ms for OverlapDDP and
90 ms for NaiveDDP, which pays a message's latency 52 times (solutions/lab6_reference/ has the numbers).
With --train-steps 300 the job-wide loss falls from 4.64 (ln 97: uniform guessing) to about 2.5.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_course.char_lm_job import MODEL_SHAPE  # noqa: F401 (the lab sheets read it as lab6.MODEL_SHAPE)
from ddp_course.char_lm_job import CONTEXT, global_batch, load_learner_module, my_rows, new_model  # the job labs 6, 8 and 9 share
from ddp_course.checking.lab6 import WRAPPER_CLASS, check_everything, job_records, report_times, time_and_profile, training_step, wrap
from ddp_course.checkpoint import atomic_write_json
from ddp_course.cli import CourseArgumentParser, CourseError, non_negative_int, positive_float, positive_int
from ddp_course.data import encode_text, load_stdlib_text, text_splits
from ddp_course.distributed import BACKENDS, log, log_error, setup_distributed, teardown_distributed

REPO_ROOT = Path(__file__).resolve().parent.parent
IMPLS = ("naive", "overlap", "bucketed", "torch")


def bucket_cap(text: str):
    """--bucket-cap-mb: a size in MiB, "none" for one bucket holding every gradient, or "default" for each
    wrapper's own default (torch DDP's bucket_cap_mb=None; BucketedDDP's 25 MiB)."""
    word = text.strip().lower()
    if word in ("none", "default"):
        return None if word == "none" else "default"
    return positive_float(text)


def parse_args(argv=None):
    parser = CourseArgumentParser(prog="lab6_ddp_from_scratch.py", description="Check and time DDP written from scratch.")
    parser.add_argument("--impl", action="append", choices=IMPLS + ("all",), help="implementation(s) to check and time; repeat the flag, or 'all' (default)")
    parser.add_argument("--module", choices=("labs", "solutions"), default="labs", help="labs: your labs/minddp.py; solutions: the finished one")
    parser.add_argument(
        "--file",
        metavar="PATH",
        help="take the wrappers from this Python file instead of --module (the stretch goal: NaiveDDP written from an empty file, checked with --impl naive)",
    )
    parser.add_argument(
        "--bucket-cap-mb", type=bucket_cap, default=25.0, help="BucketedDDP's and torch DDP's cap in MiB, 'none' (one bucket) or 'default' (each one's own)"
    )
    parser.add_argument("--batch-size", type=positive_int, default=4, help=f"windows of {CONTEXT} characters per rank")
    parser.add_argument("--check-steps", type=positive_int, default=5, help="SGD steps of the correctness check")
    parser.add_argument("--warmup-steps", type=positive_int, default=3, help="untimed steps first (torch DDP rebuilds its buckets)")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps per repeat")
    parser.add_argument("--repeats", type=non_negative_int, default=5, help="timing rounds, interleaved across impls (0: no timing)")
    parser.add_argument("--zero", action="store_true", help="also check part 4: torch DDP with your ShardedOptimizer(AdamW) against plain AdamW")
    parser.add_argument("--train-steps", type=non_negative_int, default=0, help="then train this many AdamW steps and print the loss")
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate of --train-steps")
    parser.add_argument("--seed", type=int, default=0, help="model initialization and batches")
    parser.add_argument("--json", help="write one record per implementation here")
    parser.add_argument("--profile", metavar="DIR", help="write a torch.profiler trace per implementation and rank here")
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    parser.add_argument("--timeout-s", type=positive_float, default=120.0, help="process-group timeout, seconds")
    parser.add_argument(
        "--case-timeout-s", type=positive_float, default=60.0, help="a check case still running after this many seconds is a hang: FAIL, and the job ends"
    )
    args = parser.parse_args(argv)
    chosen = args.impl or ["all"]
    args.impls = list(IMPLS) if "all" in chosen else [impl for impl in IMPLS if impl in chosen]
    if args.json and Path(args.json).is_dir():
        parser.error(f"--json {args.json} is a folder; give a file name")
    if args.profile and Path(args.profile).is_file():
        parser.error(f"--profile {args.profile} is a file; give a folder")
    if args.file and not Path(args.file).is_file():
        parser.error(f"--file {args.file} is not a file; give the Python file that defines your wrapper")
    # where the wrappers come from, as the log lines, the records and the error messages name it
    args.source = args.file or f"{args.module}/minddp.py"
    return args


def load_minddp(module: str, file: str | None = None, needed=()):
    """labs/minddp.py or solutions/minddp.py (or --file). With --file, every name in needed must be in it:
    one line says which is not."""
    loaded = load_learner_module(module, "minddp", file, root=REPO_ROOT)
    missing = [name for name in needed if not hasattr(loaded, name)]
    if file and missing:
        raise CourseError(f"{file} defines no {', '.join(missing)}: write it there, or pick another --impl (the stretch goal is --impl naive)")
    return loaded


def train(args, ctx, tokens, minddp, impl: str) -> list[list]:
    """--train-steps AdamW steps with impl; returns [[step, job-wide mean loss since the last line], ...]."""
    model = new_model(args, ctx)
    wrapped = wrap(impl, model, minddp, args.bucket_cap_mb, ctx)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed + 1)  # other batches than the check's
    every, window, curve = max(1, args.train_steps // 10), [], []
    log(f"training with {impl}: {args.train_steps} AdamW steps (lr {args.lr}), global batch {args.batch_size * ctx.world_size} windows")
    for step in range(1, args.train_steps + 1):
        inputs, targets = global_batch(tokens, generator, args, ctx)
        window.append(training_step(wrapped, optimizer, my_rows(inputs, ctx), my_rows(targets, ctx)))
        if step == 1 or step % every == 0 or step == args.train_steps:
            loss = torch.stack(window).mean()
            dist.all_reduce(loss)  # sum of the ranks' means; the shards are equal, so /world_size is the job's mean
            curve.append([step, float(loss) / ctx.world_size])
            log(f"  step {step:4d}  loss {curve[-1][1]:.3f}  (mean over steps {step - len(window) + 1}-{step}, all ranks)")
            window = []
    return curve


def run(args, ctx) -> tuple[list[dict], bool]:
    needed = [WRAPPER_CLASS[impl] for impl in args.impls if impl in WRAPPER_CLASS]
    needed += ["ShardedOptimizer", "optimizer_state_bytes"] if args.zero else []
    minddp = load_minddp(args.module, args.file, needed) if needed else None
    tokens, _ = text_splits(encode_text(load_stdlib_text()))  # the held-out end of the text is not used here
    log(f"config: impls={','.join(args.impls)} module={args.file or args.module} world_size={ctx.world_size} backend={ctx.backend} "
        f"device={ctx.device.type} batch={args.batch_size}x{CONTEXT} characters/rank bucket_cap_mb={args.bucket_cap_mb} "
        f"text={len(tokens)} characters of the standard library's source")  # fmt: skip
    checked, verdicts, passed = check_everything(args, ctx, tokens, minddp)
    times = time_and_profile(args, ctx, tokens, minddp) if args.repeats or args.profile else {}
    records = job_records(args, ctx, checked, verdicts, times)
    report_times(args, records, times)
    if args.train_steps:
        impl = "bucketed" if "bucketed" in args.impls else args.impls[0]
        records[args.impls.index(impl)]["train_losses"] = train(args, ctx, tokens, minddp, impl)
    return records, passed


def main(args) -> int:
    try:
        ctx = setup_distributed(args.backend, timeout_s=args.timeout_s)
        records, passed = run(args, ctx)  # plain numbers: every wrapper is out of reach now
        if args.json and ctx.is_main:
            atomic_write_json(records, args.json)
        if not passed:
            raise CourseError("the check FAILED: some weights differ from one process's (table above)")
        return 0
    except NotImplementedError as error:  # the exercise's TODOs: every rank reaches the same one
        log_error(f"{args.source} is not finished: {error}")
        return 1
    except CourseError as error:
        log_error(str(error))
        return 1
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_args()))
