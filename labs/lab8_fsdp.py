"""Lab 8: sharded data parallelism - DDP, ZeRO-1, ZeRO-2 and FSDP (yours and torch's), checked, weighed and timed.

labs/minifsdp.py is the exercise (solutions/minifsdp.py the finished version): FSDP written from scratch,
every rank keeping 1/N of each weight matrix. This script runs lab 6's character transformer under
  ddp          torch's DistributedDataParallel: everything replicated, gradients all-reduced
  zero1        torch DDP + lab 6's ShardedOptimizer (solutions/minddp.py): Adam's state sharded,
               each updated parameter broadcast from the rank that owns it
  zero2        ZeRO-2 without DDP (labs/minizero2.py, complete: read it): full weights, gradients
               reduce-scattered bucket by bucket during backward, 1/N of the gradients and of Adam's state
               kept, the updated slices all-gathered
  fsdp         your FSDP from scratch (--module labs, the default) or ours (--module solutions)
  fully_shard  torch's FSDP2 (torch.distributed.fsdp.fully_shard) on a DeviceMesh of the job's ranks
  fully_shard_keep  the same with reshard_after_forward=False: each block's weights kept from its forward
               to its backward (SHARD_GRAD_OP): ZeRO-2's bytes per step, 1/N of the weights between steps
and for each one
  1. CHECKS: after --check-steps SGD steps on disjoint shards, the full weights must equal those of ONE
     process training on the whole global batch, within 64 x steps x float32 eps x max|w| (lab 6's bound:
     another summation order changes a sum by about eps relative per operation; the margin is about 100x
     the differences seen and far below the unsynchronised control, which must differ);
  2. WEIGHS the model state each rank keeps between steps with AdamW (parameters, gradients, optimizer
     state: bytes of the tensors' storages, ddp_course.sharding), on the fullest rank, and the weights it
     holds at the fullest moment of a step (its own plus any gathered full weights, sampled at every
     module's entry and exit and before every module's backward); on GPUs also torch.cuda's peak;
  3. COUNTS the bytes one step communicates (every collective recorded with its payload, turned into
     bytes each rank sends by lecture 2's ring costs) against the formula (lecture 7), and the messages;
  4. JUDGES: an implementation PASSes when its weights equal one process's (1.) and its bytes per step
     are within 5 % of the formula (3.); the from-scratch FSDP must also hold full weights only around
     their use: none left after forward, and never more than the unit that holds the tied embedding (the
     root's) plus the largest other unit at once. A FAIL line says which concept failed; exit status 1;
  5. TIMES an AdamW step: warm-up, repeats interleaved across implementations, the slowest rank's time,
     the median over repeats.

The checks are ddp_course/checking/lab8.py, on the implementations of ddp_course/sharded_training.py (which
lab 9 shares); this script is their front end and chooses the from-scratch code they run.

From the repository root:
    your FSDP, part by part:     torchrun --standalone --nproc_per_node=2 labs/lab8_fsdp.py --part 1   (then 2, then 3)
    your FSDP, 2 CPU processes:  torchrun --standalone --nproc_per_node=2 labs/lab8_fsdp.py --impl fsdp
    everything, ours:            torchrun --standalone --nproc_per_node=2 labs/lab8_fsdp.py --module solutions --impl all
    memory at 4 ranks:           torchrun --standalone --nproc_per_node=4 labs/lab8_fsdp.py --module solutions --repeats 1
    records:                     ... --json runs/lab8.json
    N GPUs (NCCL; written with care, NOT YET RUN on a GPU):
                                 torchrun --standalone --nproc_per_node=N labs/lab8_fsdp.py --module solutions

Sharding needs 2 or more ranks: on one process (plain python, or a machine with one GPU) the lab refuses
with one line and exit status 1 - one rank would shard nothing and send nothing.

What you should see: with labs/minifsdp.py untouched and --impl fsdp, one line naming the first TODO
and exit status 1. With --module solutions on 2 CPU ranks every implementation PASSes, FSDP keeps about
half of DDP's bytes per rank between steps (a quarter at 4 ranks) and at most the root's and one block's
full weights more during a step, communicates 1.5x DDP's bytes, and every byte count (a ring-cost count of the collectives each rank
called: a count, not a measurement of the wire) is within a few per cent of the formula (solutions/lab8_reference/).
"""

import sys
from pathlib import Path

import minizero2  # labs/minizero2.py, beside this script: ZeRO-2 from scratch, complete code to read
from ddp_course.char_lm_job import CONTEXT, load_learner_module  # the job labs 6, 8 and 9 share
from ddp_course.checking.lab8 import check_parts, run  # the checks, weighing, counting and timing
from ddp_course.checkpoint import atomic_write_json
from ddp_course.cli import CourseArgumentParser, CourseError, non_negative_int, positive_float, positive_int
from ddp_course.distributed import BACKENDS, log_error, setup_distributed, teardown_distributed
from ddp_course.sharded_training import BATCH_SIZE, CASE_TIMEOUT_S, CHECK_STEPS, IMPLS  # lab 8's defaults, shared with lab 9

REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    parser = CourseArgumentParser(prog="lab8_fsdp.py", description="Check, weigh and time DDP, ZeRO-1 and FSDP.")
    parser.add_argument("--impl", action="append", choices=IMPLS + ("all",), help="implementation(s); repeat the flag, or 'all' (default)")
    parser.add_argument(
        "--module", choices=("labs", "solutions"), default="labs", help="the FSDP of --impl fsdp: labs (your labs/minifsdp.py) or solutions (the finished one)"
    )
    parser.add_argument(
        "--part", type=int, choices=(1, 2, 3), help="check --module's minifsdp.py, parts 1 to PART only (3: the whole check of --impl fsdp), and stop"
    )
    parser.add_argument(
        "--fsdp-units",
        choices=("blocks", "matrices"),
        default="blocks",
        help="what --impl fsdp sends in one message: each block's weights (as fully_shard) or each matrix",
    )
    parser.add_argument("--batch-size", type=positive_int, default=BATCH_SIZE, help=f"windows of {CONTEXT} characters per rank")
    parser.add_argument("--check-steps", type=positive_int, default=CHECK_STEPS, help="SGD steps of the correctness check")
    parser.add_argument("--warmup-steps", type=positive_int, default=2, help="untimed AdamW steps first")
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps per repeat")
    parser.add_argument("--repeats", type=non_negative_int, default=5, help="timing rounds, interleaved across impls (0: no timing)")
    parser.add_argument("--seed", type=int, default=0, help="model initialization and batches")
    parser.add_argument("--json", help="write one record per implementation here")
    parser.add_argument("--backend", choices=BACKENDS, default="auto")
    parser.add_argument("--timeout-s", type=positive_float, default=120.0, help="process-group timeout, seconds")
    parser.add_argument(
        "--case-timeout-s", type=positive_float, default=CASE_TIMEOUT_S, help="a check still running after this many seconds is a hang: FAIL, and the job ends"
    )
    args = parser.parse_args(argv)
    chosen = args.impl or ["all"]
    args.impls = list(IMPLS) if "all" in chosen else [impl for impl in IMPLS if impl in chosen]
    if args.json and Path(args.json).is_dir():
        parser.error(f"--json {args.json} is a folder; give a file name")
    return args


def load_minifsdp(module: str):
    """labs/minifsdp.py (the exercise) or solutions/minifsdp.py (the finished version)."""
    return load_learner_module(module, "minifsdp", root=REPO_ROOT)


def modules_for(impls, module: str = "solutions") -> dict:
    """The from-scratch code the implementations need: lab 6's ShardedOptimizer, ZeRO-2, an FSDP."""
    modules = {"minddp": load_learner_module("solutions", "minddp", root=REPO_ROOT)} if "zero1" in impls else {}
    if "zero2" in impls:
        modules["minizero2"] = minizero2
    if "fsdp" in impls:
        modules["minifsdp"] = load_minifsdp(module)
    return modules


def judge(args, ctx) -> int:
    """Run everything in the job's process group; print the verdicts; return the exit status (0: every PASS)."""
    try:
        if ctx.world_size < 2:
            raise CourseError(
                f"lab 8 needs 2 or more ranks (one rank shards nothing and sends nothing): torchrun "
                f"--standalone --nproc_per_node=2 labs/lab8_fsdp.py, or 2+ GPUs; this job has {ctx.world_size}"
            )
        if args.part:
            if not check_parts(args, ctx, load_minifsdp(args.module)):
                raise CourseError(f"--part {args.part} FAILED: see the FAIL lines above")
            return 0
        records, passed = run(args, ctx, modules_for(args.impls, args.module))  # plain numbers: every wrapper is out of reach now
        if args.json and ctx.is_main:
            atomic_write_json(records, args.json)
        if not passed:
            raise CourseError("the check FAILED: see the FAIL lines above")
        return 0
    except NotImplementedError as error:  # the exercise's TODOs: every rank reaches the same one
        log_error(f"{args.module}/minifsdp.py is not finished: {error}")
        return 1
    except CourseError as error:
        log_error(str(error))
        return 1


def main(args) -> int:
    try:
        ctx = setup_distributed(args.backend, timeout_s=args.timeout_s)
        return judge(args, ctx)
    except CourseError as error:  # e.g. --backend nccl without a GPU
        log_error(str(error))
        return 1
    finally:
        teardown_distributed()


if __name__ == "__main__":
    sys.exit(main(parse_args()))
