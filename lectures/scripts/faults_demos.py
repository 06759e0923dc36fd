"""Lecture 6's field-guide demos: wrong results, a crash that raises, the flight recorder; start-up failures.

    torchrun --standalone --nproc_per_node=2 lectures/scripts/faults_demos.py --json report.json --trace-dir traces

Four demos on 2 gloo ranks, one after the other, each on its own process group so that one broken
group does not stop the next demo:

  order-swap      both ranks all-reduce two same-shaped tensors, in a different order (as when each
                  process iterates over a set whose order differs). With TORCH_DISTRIBUTED_DEBUG=DETAIL
                  on the group: no error - the fingerprints (op type, shapes, dtypes) agree - and
                  every result is wrong. Only a check of the numbers sees it.
  load-after-wrap rank 0 loads a checkpoint into the model AFTER DDP wrapped it (DDP broadcast rank
                  0's weights only at construction). Training runs without an error and the replicas
                  differ; an all-gathered checksum of the parameters shows it. Loading before the
                  wrap, on every rank, keeps them identical.
  unused-param    a DDP model with a layer forward() never uses, on every rank: the second iteration
                  raises "Expected to have finished reduction ..." on EVERY rank (an error, not a
                  hang); with TORCH_DISTRIBUTED_DEBUG=INFO when DDP is built, the error names the parameters.
  flight-recorder TORCH_FR_BUFFER_SIZE (read when a group is created) keeps each rank's last
                  collectives. Rank 0 calls one all-reduce more than rank 1 (which goes on to a barrier);
                  both time out after --timeout-s, and each rank dumps its buffer into --trace-dir as
                  fr_RANK (a pickle; torch._C._distributed_c10d._dump_fr_trace is private API, what
                  NCCL's TORCH_NCCL_DUMP_ON_TIMEOUT=1 writes by itself).

With --lab7-scenarios rank0-only,missing-rank,uneven the job then runs those hang scenarios of
labs/lab7_hangs.py, one after the other, each on its own group as lab 7 makes it, with lab 7's own
functions (imported, not copied): the same bug, tool and diagnosis as `torchrun ... lab7_hangs.py
--scenario NAME --timeout-s T`, in one launch instead of one per scenario (each launch costs seconds
of process start-up). Each rank's "stopped in WHERE: KIND: CAUSE" line goes into the report.

Rank 0 writes every demo's facts (booleans, counts, names: no timings) to --json. With --crash-at-exit,
rank 1 then raises an exception (a stand-in for "CUDA out of memory") in a main() decorated with
torch.distributed.elastic's @record, so torchrun's failure report shows the crash: Root Cause, the
rank, its exit code and, from the error file @record writes, the exception. Otherwise the script
exits 0. gloo only; on NCCL the same bugs behave as lecture 6,
section 2 describes (not run here).

Start-up failures need processes that never meet, so they run without torchrun, as plain `python`
processes given RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (ddp_course.faults.run_plain_ranks):

    RANK=0 WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=PORT python faults_demos.py --init-only &
    RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=PORT python faults_demos.py --init-only

--init-only calls init_process_group("gloo", init_method="env://", timeout=--timeout-s), prints one
line - "[rank R] init_process_group raised ERRORTYPE after the T s timeout: KIND: SUMMARY" - and
exits 1 (0 if the job formed). Ranks that disagree on WORLD_SIZE, or a MASTER_PORT where nothing
listens (start rank 1 alone), both end in a rendezvous error after the timeout, not a hang.
"""

import os

os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "64")  # before any process group exists

import pickle  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from ddp_course.checkpoint import atomic_write_json  # noqa: E402
from ddp_course.cli import CourseArgumentParser, positive_float  # noqa: E402
from ddp_course.distributed import log, setup_distributed, teardown_distributed  # noqa: E402
from ddp_course.faults import diagnose  # noqa: E402
from ddp_course.launch import REPO_ROOT, import_script  # noqa: E402
from ddp_course.seeding import seed_everything  # noqa: E402


def parse_args(argv=None):
    parser = CourseArgumentParser(prog="faults_demos.py", description="Lecture 6: wrong results, a raise, the flight recorder.")
    parser.add_argument("--json", help="rank 0 writes every demo's facts here (required under torchrun)")
    parser.add_argument("--trace-dir", help="each rank dumps its flight recorder here, fr_RANK (required under torchrun)")
    parser.add_argument("--timeout-s", type=positive_float, default=2.0, help="the flight-recorder and start-up demos' wait")
    parser.add_argument("--crash-at-exit", action="store_true", help="rank 1 raises at the end: torchrun's failure report")
    parser.add_argument("--lab7-scenarios", default="", help="then lab 7's hang scenarios, comma-separated (one job, see above)")
    parser.add_argument("--init-only", action="store_true", help="plain python: init_process_group from the environment, report")
    args = parser.parse_args(argv)
    args.lab7_scenarios = [name for name in args.lab7_scenarios.split(",") if name]
    unknown = sorted(set(args.lab7_scenarios) - set(lab7_hangs_module().SCENARIOS)) if args.lab7_scenarios else []
    if unknown:
        parser.error(f"--lab7-scenarios: no such scenario in labs/lab7_hangs.py: {', '.join(unknown)}")
    if not args.init_only and not (args.json and args.trace_dir):
        parser.error("--json and --trace-dir are required (unless --init-only)")
    return args


START_UP_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def init_only(args) -> int:
    """One rank of a job started by hand: does init_process_group(env://) form the job, or what does it raise?"""
    missing = [name for name in START_UP_VARIABLES if name not in os.environ]
    if missing:
        print(f"faults_demos.py: error: --init-only needs {', '.join(missing)} in the environment", file=sys.stderr)
        return 2
    rank, timeout_s = int(os.environ["RANK"]), args.timeout_s
    started = time.monotonic()
    try:
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=timeout_s))
    except RuntimeError as error:  # DistStoreError and DistNetworkError are RuntimeErrors
        # When, in words that do not change from run to run: the store retries until the timeout.
        when = "after" if time.monotonic() - started >= timeout_s else "before"
        print(f"[rank {rank}] init_process_group raised {type(error).__name__} {when} the {timeout_s:g} s timeout: {diagnose(error, rank)}", flush=True)
        return 1
    print(f"[rank {rank}] init_process_group formed a job of {dist.get_world_size()}", flush=True)
    dist.destroy_process_group()
    return 0


def group_with_debug(level):
    """A new group created under a debug level (the level is read when a group or a DDP is built)."""
    dist.set_debug_level(level)
    try:
        return dist.new_group()
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)


def order_swap(rank: int) -> dict:
    group = group_with_debug(dist.DebugLevel.DETAIL)
    loss_sum, correct = torch.tensor([float(rank + 1)] * 2), torch.tensor([10.0 * (rank + 1)] * 2)
    order = [loss_sum, correct] if rank == 0 else [correct, loss_sum]  # the bug
    try:
        for tensor in order:
            dist.all_reduce(tensor, group=group)
        error = None
    except RuntimeError as caught:
        error = str(diagnose(caught, rank))
    right = loss_sum.tolist() == [3.0, 3.0] and correct.tolist() == [30.0, 30.0]  # 1 + 2, 10 + 20
    return {"error": error, "results_right": right}


class TwoLayers(torch.nn.Module):
    def __init__(self, use_head: bool = True):
        super().__init__()
        self.body, self.head, self.use_head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1), use_head

    def forward(self, x):
        hidden = self.body(x)
        return self.head(hidden) if self.use_head else hidden  # use_head=False: head gets no gradient


def replicas_identical(model) -> bool:
    """The tool: all-gather one float64 checksum of the parameters and compare (cheap, any time)."""
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum().reshape(1)
    everyone = [torch.empty_like(checksum) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, checksum)
    return all(torch.equal(c, everyone[0]) for c in everyone)


def train_two_steps(load_after_wrap: bool, rank: int) -> bool:
    seed_everything(0)
    model = TwoLayers()
    checkpoint = {k: v + 1.0 for k, v in model.state_dict().items()}  # "the checkpoint to resume from"
    if not load_after_wrap:
        model.load_state_dict(checkpoint)  # every rank, before the wrap: right
    ddp_model = DDP(model)
    if load_after_wrap and rank == 0:
        model.load_state_dict(checkpoint)  # the bug: after the wrap, on rank 0 only
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        ddp_model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    return replicas_identical(model)


def unused_parameter(rank: int) -> dict:
    dist.set_debug_level(dist.DebugLevel.INFO)  # = TORCH_DISTRIBUTED_DEBUG=INFO when DDP is built
    try:
        seed_everything(0)
        ddp_model = DDP(TwoLayers(use_head=False), process_group=dist.new_group())
    finally:
        dist.set_debug_level(dist.DebugLevel.OFF)
    for iteration in range(3):
        try:
            ddp_model(torch.ones(2, 4)).sum().backward()
        except RuntimeError as error:
            lines = str(error).splitlines()
            named = [line.split(": ", 1)[1] for line in lines if line.startswith("Parameters which did not receive grad")]
            return {"raised_at_iteration": iteration, "first_sentence": lines[0].split(". ")[0] + ".", "unused_named": named[0] if named else None}
    return {"raised_at_iteration": None}


def flight_recorder(rank: int, args) -> dict:
    group = dist.new_group(timeout=timedelta(seconds=args.timeout_s), group_desc="hang_demo")
    values = torch.ones(4)
    dist.all_reduce(values, group=group)  # both ranks: collective 1
    try:
        if rank == 0:
            dist.all_reduce(values, group=group)  # the bug: rank 0 only
        dist.barrier(group)
        kind = "no error"
    except RuntimeError as error:
        kind = diagnose(error, rank).kind
    dump = torch._C._distributed_c10d._dump_fr_trace(includeCollectives=True)  # private API, see the docstring
    path = Path(args.trace_dir) / f"fr_{rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(dump)
    entries = [e for e in pickle.loads(dump)["entries"] if e["process_group"][1] == "hang_demo"]
    return {"kind": kind, "entries": len(entries)}


def lab7_hangs_module():
    """labs/lab7_hangs.py, imported (labs/ is not a package): its scenarios, not a copy of them."""
    return import_script(REPO_ROOT / "labs" / "lab7_hangs.py")


def lab7_hangs(ctx, scenarios, timeout_s) -> dict:
    """Run lab 7's scenarios one after the other; {scenario: this rank's outcome line}."""
    lab7 = lab7_hangs_module()
    outcomes = {}
    for scenario in scenarios:
        lab7_args = lab7.parse_args(["--scenario", scenario, "--timeout-s", str(timeout_s)])
        # lab 7 turns DETAIL on before its group exists (the level is read when a group is built)
        dist.set_debug_level(dist.DebugLevel.DETAIL if lab7.TOOLS[scenario] == "DETAIL" else dist.DebugLevel.OFF)
        try:
            group = lab7.scenario_group(ctx, lab7_args)  # a barrier on the default group first: every rank is here
        finally:
            dist.set_debug_level(dist.DebugLevel.OFF)
        try:
            outcomes[scenario] = lab7.RUNNERS[scenario](ctx, group, lab7_args)
        except lab7.Stopped as stop:
            outcomes[scenario] = stop.line
    return outcomes


def run(ctx, args) -> dict:
    facts = {"order_swap": order_swap(ctx.rank)}
    facts["replicas_identical"] = {"load_after_wrap_on_rank0": train_two_steps(True, ctx.rank), "load_before_wrap_everywhere": train_two_steps(False, ctx.rank)}
    facts["unused_parameter"] = unused_parameter(ctx.rank)
    facts["flight_recorder"] = flight_recorder(ctx.rank, args)
    if args.lab7_scenarios:  # after the flight recorder's dump: their collectives do not crowd its buffer
        facts["lab7_hangs"] = lab7_hangs(ctx, args.lab7_scenarios, args.timeout_s)
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, facts)  # the default group is still healthy
    return {"per_rank": everyone}


@record  # writes the exception to torchrun's error file, which its failure report prints
def main(args) -> int:
    ctx = setup_distributed("gloo", timeout_s=120)  # generous: only the flight-recorder group is short
    try:
        report = run(ctx, args)  # plain data: every DDP model is out of reach now
        if ctx.is_main:
            atomic_write_json(report, args.json)
        log("demos done")
        dist.barrier()  # the report is on disk before anyone crashes
    finally:
        teardown_distributed()
    if args.crash_at_exit and ctx.rank == 1:
        raise RuntimeError("CUDA out of memory (simulated by faults_demos.py --crash-at-exit)")
    return 0


if __name__ == "__main__":
    arguments = parse_args()
    sys.exit(init_only(arguments) if arguments.init_only else main(arguments))
