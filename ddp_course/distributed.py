"""Process-group set-up and teardown, and rank-aware logging.

torchrun starts one process per device and tells each who it is through environment variables:
RANK (0..WORLD_SIZE-1, unique in the job), LOCAL_RANK (0..LOCAL_WORLD_SIZE-1, unique on this
node), WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Without them (plain `python
lab.py`) we form a one-process group so that the same code path runs.
"""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose. torch.distributed.nn.functional declares its
# functions with `group=group.WORLD` defaults, evaluated when the module is first imported; DDP's first
# construction imports it lazily (through torch._dynamo), after init_process_group, so ten default
# arguments keep the default group alive after destroy_process_group(). Its gloo worker threads then
# meet the interpreter's shutdown and can abort the process ("terminate called without an active
# exception"). Imported here, the defaults capture None. (benchmarks/teardown_stability.py measures it.)
import torch.distributed.nn.functional  # noqa: F401,E402

from ddp_course.cli import CourseError
from ddp_course.faults import first_line

BACKENDS = ("auto", "nccl", "gloo")
# A process group's timeout bounds every wait in it, joining the job included. Starting Python and
# importing torch, scikit-learn and torch._dynamo takes seconds of CPU per rank, and on a busy machine
# one rank can reach a collective tens of seconds after its peer: not a hang. Scripts that show a hang
# with a short timeout form the group with this one and train on training_group(timeout_s).
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class DistContext:
    """Who this process is in the job, and where its tensors live."""

    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0 prints, saves files and speaks for the job."""
        return self.rank == 0


def current_rank() -> int:
    """This process's rank, also before the process group exists (0 outside torchrun)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def log(message: str, every_rank: bool = False) -> None:
    """Print once for the job (rank 0), or on every rank with a "[rank r]" prefix."""
    rank = current_rank()
    if every_rank:
        _write_line(sys.stdout, f"[rank {rank}] {message}")
    elif rank == 0:
        _write_line(sys.stdout, message)


def log_error(message: str) -> None:
    """Report a problem once for the job, on stderr: rank 0 speaks, as every rank sees the same."""
    if current_rank() == 0:
        _write_line(sys.stderr, f"{os.path.basename(sys.argv[0])}: error: {message}")


def _write_line(stream, line: str) -> None:
    # One write per line: ranks share the terminal, and print()'s separate writes of the text and
    # the newline let another rank's line land in between.
    stream.write(line + "\n")
    stream.flush()


def choose_backend(requested: str, local_world_size: int) -> str:
    """Resolve --backend on this node: NCCL needs one GPU per process on this node, gloo runs anywhere.

    With `auto` on a node that has GPUs but fewer than processes (say 1 GPU, 2 processes), the
    node falls back to gloo and says why. Across nodes, setup_distributed() makes the choice
    job-wide (job_backend).

    SLURM: `cuda:LOCAL_RANK` assumes every process of a node sees all its GPUs. Start one task per
    node that runs torchrun (the README's script); with --gpus-per-task=1 each task sees one GPU
    numbered 0, and cuda:1... do not exist.
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "gloo":
        return "gloo"
    if requested == "nccl":
        if gpus == 0:
            raise CourseError("--backend nccl needs CUDA GPUs and none is visible; use --backend gloo")
        if local_world_size > gpus:
            raise CourseError(
                f"--backend nccl needs one GPU per process: {local_world_size} processes on this node "
                f"but {gpus} GPU(s); lower --nproc_per_node or use --backend gloo"
            )
        return "nccl"
    if requested != "auto":
        raise CourseError(f"unknown backend {requested!r}; choose one of {', '.join(BACKENDS)}")
    if gpus and local_world_size <= gpus:
        return "nccl"
    if gpus:
        # Two NCCL ranks on one GPU fail with "Duplicate GPU detected"; say why we fall back.
        log(f"note: {local_world_size} processes on this node but only {gpus} GPU(s); NCCL needs one GPU per process, so this run uses gloo on the CPU")
    return "gloo"


def job_backend(choices: list[str]) -> str:
    """One backend for the whole job from every rank's own choice: NCCL only if every rank can use it.

    Ranks that initialise different backends never meet (the rendezvous fails or hangs), so a job
    where any node can only run gloo (no GPU, or fewer GPUs than processes) runs gloo everywhere.
    """
    return "nccl" if all(choice == "nccl" for choice in choices) else "gloo"


def agree_on_backend(store, rank: int, world_size: int, my_choice: str, timeout: timedelta) -> tuple[str, list[int]]:
    """Every rank posts its own choice in the job's store and reads everyone's; returns the job's
    backend (job_backend) and the ranks that could not use NCCL. Every rank gets the same answer."""
    # The restart count keeps the keys of a restarted job (torchrun --max-restarts) apart from the last attempt's.
    prefix = f"ddp_course/backend/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    store.set(f"{prefix}{rank}", my_choice)
    keys = [f"{prefix}{r}" for r in range(world_size)]
    store.wait(keys, timeout)
    choices = [store.get(key).decode() for key in keys]
    return job_backend(choices), [r for r, choice in enumerate(choices) if choice != "nccl"]


class GroupJoinError(CourseError):
    """The process group could not be formed (init_process_group, or the multi-node backend agreement).

    Unlike other CourseErrors the ranks do not share one verdict: in a multi-node job one rank dials an
    address it cannot reach and the others time out waiting for it, so each rank's own line is what
    ddp_course.cluster.multinode's diagnosis reads. Ranks other than 0 have written theirs when this is raised;
    the lab's log_error() writes rank 0's.
    """


def join_failure(rank: int, backend: str, error: Exception) -> GroupJoinError:
    """One line (the error's first) instead of a traceback; written at once on ranks other than 0."""
    message = (
        f"rank {rank} could not join the {backend} process group: {type(error).__name__}: {first_line(str(error))} "
        "(multi-node: python -m ddp_course.cluster.multinode OUTPUT_FILES names the cause from every node's output)"
    )
    if rank != 0:
        _write_line(sys.stderr, f"{os.path.basename(sys.argv[0])}: error: {message}")
    return GroupJoinError(message)


def setup_distributed(backend: str = "auto", timeout_s: float = 300.0) -> DistContext:
    """Join the process group torchrun prepared (or form a one-process group) and pick the device.

    Pair every call with teardown_distributed() in a `finally`. timeout_s bounds every wait in the
    default group, joining it included: a rank that never arrives makes the others fail after
    timeout_s instead of hanging forever. For a timeout shorter than a slow start (a hang shown in
    seconds), pass START_TIMEOUT_S here and train on training_group(short timeout).

    --backend auto is decided for the whole job: on one node every rank sees the same GPUs and
    reaches the same choice; across nodes (WORLD_SIZE != LOCAL_WORLD_SIZE) the nodes may differ,
    so the ranks agree through torchrun's store before creating the group (agree_on_backend).
    """
    launched_by_torchrun = "RANK" in os.environ
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    timeout = timedelta(seconds=timeout_s)

    resolved = choose_backend(backend, local_world_size)
    store = None
    try:
        if launched_by_torchrun and backend == "auto" and world_size != local_world_size:
            resolved, store = agree_across_nodes(rank, world_size, resolved, timeout)
        device = _join_group(resolved, rank, local_rank, world_size, timeout, store, launched_by_torchrun)
    except RuntimeError as error:  # torch's DistError family, and gloo's connect failures, are RuntimeErrors
        raise join_failure(rank, resolved, error) from None
    return DistContext(rank, local_rank, world_size, resolved, device)


def agree_across_nodes(rank: int, world_size: int, my_choice: str, timeout: timedelta):
    """--backend auto in a job of several nodes: one backend for the whole job (agree_on_backend), and
    the store to form the default group with. Returns (the job's backend, that store)."""
    # The same rendezvous init_process_group("env://") makes, done first so that we can use its store.
    store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    backend, without_nccl = agree_on_backend(store, rank, world_size, my_choice, timeout)
    if backend == "gloo" and len(without_nccl) < world_size:
        log(f"note: ranks {without_nccl} cannot use NCCL on their node, so the whole job uses gloo on the CPU")
    return backend, dist.PrefixStore("default_pg", store)  # as init_process_group does with its own rendezvous's store


def _join_group(resolved, rank, local_rank, world_size, timeout, store, launched_by_torchrun) -> torch.device:
    """setup_distributed's network part: pick the device, form the group (with `store` when the nodes
    agreed through it). Returns this rank's device."""
    if resolved == "nccl":
        # The device comes from LOCAL_RANK, never from RANK: on node 1 of a 2x8 job RANK is 8..15.
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    options = {"backend": resolved, "timeout": timeout}
    if resolved == "nccl":
        options["device_id"] = device  # binds the group to this GPU (no guessing at the first barrier)
    if store is not None:
        dist.init_process_group(store=store, rank=rank, world_size=world_size, **options)
    elif launched_by_torchrun:
        dist.init_process_group(**options)  # reads MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    else:
        # An in-memory store: a group of one needs no network port.
        dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **options)
    return device


def training_group(timeout_s: float) -> dist.ProcessGroup:
    """Every rank of the job, in a new group whose collectives give up after timeout_s.

    Call it on every rank once the slow start-up is done (data loaded, model built), just before
    DDP(..., process_group=group); then pass group= to the training's own collectives. The default
    group (setup_distributed(timeout_s=START_TIMEOUT_S)) waits out a slow start; this group turns a
    rank stuck in training into an error after timeout_s, wherever the ranks started.
    """
    # DDP's constructor imports torch._dynamo before its first collective: seconds of CPU, and not
    # equally fast on every rank. Imported here, before the barrier, that time is start-up too.
    import torch._dynamo  # noqa: F401

    dist.barrier()  # every rank has started, under the default group's generous timeout
    # The ranks leave the barrier together, so the new group connects well within timeout_s.
    return dist.new_group(timeout=timedelta(seconds=timeout_s))


def teardown_distributed() -> None:
    """Leave the process group cleanly.

    Call it after the DDP model is out of reach (return from the function that built it). DDP keeps
    reference cycles, so the model survives until the garbage collector runs; if it is still alive
    when the group is destroyed, it keeps the group (and gloo's worker threads) alive into the
    interpreter's shutdown, which can abort the process ("terminate called without an active
    exception", about 1 run in 5 on our 2-core CPU machines). Collecting first made that 0 in 95
    runs; the import at the top of this module closes the other way the group outlived destroy.
    """
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
