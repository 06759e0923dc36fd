"""Name the cause of a torch.distributed failure in one short, deterministic line.

A failed collective raises a RuntimeError whose text depends on the tool that caught it, and
carries details that change from run to run (source paths, ports, timings of the C++ logs). Lab 7's
hang scenarios and lecture 6's demos print `kind: summary` instead, so that a notebook can compare
the lines. The kinds, with the text gloo (torch 2.14) raises for each:

    mismatch      TORCH_DISTRIBUTED_DEBUG=DETAIL compared the collective's fingerprint (op type,
                  tensor shapes, dtypes, devices) across ranks before running it:
                  "Detected mismatch between collectives on ranks. ..."
    missing rank  dist.monitored_barrier on rank 0 waited its timeout for the others:
                  "Rank 1 failed to pass monitoredBarrier in 3000 ms"
    timeout       a collective waited the process group's timeout for a peer:
                  "Timed out waiting 3000ms for recv operation to complete"
    peer gone     the peer's end of the connection closed - it gave up first, crashed or exited:
                  "Connection closed by peer [127.0.0.1]:PORT ..."
    rendezvous    init_process_group: the ranks never all met in the store (they disagree on
                  WORLD_SIZE, or one never started). Rank 0, which hosts the store, raises
                  "Timed out after 3 seconds waiting for clients. 2/3 clients joined."; a rank
                  waiting for a peer's address raises "wait timeout after 3000ms, keys: .../0"
    unreachable   init_process_group: nothing listens at MASTER_ADDR:MASTER_PORT (a wrong port,
                  a master that never started, a firewall):
                  "The client socket has timed out after 3000ms while trying to connect to (HOST, PORT)."
    error         anything else (the first line, as raised)

On NCCL most of these never reach Python: the watchdog aborts the process (see lecture 6).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MISMATCH = "Detected mismatch between collectives"


@dataclass(frozen=True)
class Diagnosis:
    kind: str  # one of: mismatch, missing rank, timeout, peer gone, rendezvous, unreachable, error
    summary: str  # deterministic for a given failure: no paths, ports or timings

    def __str__(self) -> str:
        return f"{self.kind}: {self.summary}"


def diagnose(error: BaseException, rank: int | None = None) -> Diagnosis:
    """Classify a torch.distributed error; rank (this process's) picks its own fingerprint out of a mismatch."""
    text = str(error)
    if MISMATCH in text:
        return Diagnosis("mismatch", describe_mismatch(text, rank))
    startup = diagnose_startup(text)
    if startup:
        return startup
    missing = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier in (\d+) ms", text)
    if missing:
        ranks = missing.group(1).strip().rstrip(",")
        return Diagnosis("missing rank", f"rank(s) {ranks} did not reach monitored_barrier within {missing.group(2)} ms")
    timed_out = re.search(r"Timed out waiting (\d+)ms", text)
    if timed_out:
        return Diagnosis("timeout", f"no peer answered within {timed_out.group(1)} ms (the process group's timeout)")
    if re.search(r"Connection (closed|reset) by peer", text):
        return Diagnosis("peer gone", "the peer closed its connection (it gave up first, crashed or exited)")
    return Diagnosis("error", first_line(text))


def diagnose_startup(text: str) -> Diagnosis | None:
    """The errors init_process_group(init_method="env://") raises when the ranks never meet, or None."""
    clients = re.search(r"waiting for clients\. (\d+)/(\d+) clients joined", text)
    if clients:
        joined, expected = clients.groups()
        expects = f"{expected} processes this rank expects (WORLD_SIZE)"
        return Diagnosis("rendezvous", f"only {joined} of the {expects} reached the store")
    key = re.search(r"wait timeout after (\d+)ms, keys: (\S+)", text)
    if key:
        peer = re.search(r"/(\d+)$", key.group(2))  # the key names the rank whose address it waited for
        whose = f"rank {peer.group(1)}'s" if peer else "a peer's"
        return Diagnosis("rendezvous", f"{whose} address never appeared in the store within {key.group(1)} ms")
    connect = re.search(r"client socket has timed out after (\d+)ms while trying to connect", text)
    if connect:
        return Diagnosis("unreachable", f"no store answered at MASTER_ADDR:MASTER_PORT within {connect.group(1)} ms")
    return None


def first_line(text: str) -> str:
    """The first line of an error, without gloo's "[path/to/file.cc:123] " prefix."""
    lines = text.strip().splitlines() or [""]
    return re.sub(r"^\[[^\]]*\]\s*", "", lines[0])


def describe_mismatch(text: str, rank: int | None = None) -> str:
    """DETAIL's report cut to what is stable: this rank's operation and the aspects that differ.

    The peer's fingerprint is left out on purpose: a barrier's fingerprint carries no tensors and
    torch 2.14 prints the peer's op type of a barrier mismatch inconsistently (REDUCE or GATHER for
    a BARRIER), so only this rank's own entry and the list of differing aspects are reliable.
    """
    mine = None
    if rank is not None:
        own = re.search(rf"Rank {rank} is running collective: CollectiveFingerPrint\((.*?)\)[,.]", text)
        if own:
            fields = dict(re.findall(r"(OpType|TensorShape)=(\[[^\]]*\]|[A-Z_]+)", own.group(1)))
            mine = " ".join(value for key, value in sorted(fields.items()))  # e.g. "ALLREDUCE [4]"
    aspects = re.findall(r"(Op type|Tensor shapes|Tensor dtypes|Tensor devices|Collective sequence number)", text)
    differ = ", ".join(dict.fromkeys(aspect.lower() for aspect in aspects)) or "an unknown aspect"
    ran = f"this rank ran {mine}; " if mine else ""
    return f"{MISMATCH} ({ran}they differ in {differ})"


def run_plain_ranks(command: list, world_size_by_rank: dict, timeout_s: float = 60) -> dict:
    """Start one plain `python` process per rank - no torchrun - each told its own RANK and WORLD_SIZE.

    This is how a job is started by hand or by a cluster script (lecture 6's start-up demos): every
    process gets MASTER_ADDR and one free MASTER_PORT, where rank 0's init_process_group hosts the
    store. Give {0: 3, 1: 2} and the ranks disagree on the world size; leave rank 0 out and nothing
    listens on the port. Returns {rank: RunResult}; every process is killed after timeout_s.
    """
    from concurrent.futures import ThreadPoolExecutor

    from ddp_course.launch import free_port, run_command

    port = free_port()
    with ThreadPoolExecutor(max_workers=len(world_size_by_rank)) as pool:
        jobs = {
            rank: pool.submit(
                run_command,
                command,
                timeout_s=timeout_s,
                env={"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
            )
            for rank, world_size in world_size_by_rank.items()
        }
        return {rank: job.result() for rank, job in jobs.items()}
