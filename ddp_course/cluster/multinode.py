"""Several torchrun agents, as if each were a node: for tests and lab sheets; and what went wrong.

A multi-node job is one torchrun agent per node; the agents meet at a c10d rendezvous (one of
them hosts a TCPStore on the endpoint's port) and then start their workers. Two agents on this
machine with --rdzv-endpoint=127.0.0.1:PORT form the same job, and killing one agent together
with its workers is what losing a node looks like to the others.

Every agent runs in a process group of its own, its output goes to files (read at any time, also
while it runs), and every wait has a deadline, after which the agent and its workers are killed.
An agent can also run on a host of ddp_course.cluster.netns (a network namespace with its own address):
Agent(hosts.command("node1", agent_command(...))).

diagnose_launch() reads what the agents and their workers printed and names, in one line, why a
multi-node job never started: the failures of the first minutes on a new cluster (wrong interface,
a port the firewall drops, an endpoint nobody answers at), as ddp_course.faults does for the
failures of a running job. From a shell: python -m ddp_course.cluster.multinode lab3_1234.out
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddp_course.faults import Diagnosis, diagnose
from ddp_course.launch import REPO_ROOT, RunResult, child_environment, descendant_pids, kill_job, port_is_open, wait_until


def agent_command(script, args=(), nnodes="2", nproc=1, endpoint="127.0.0.1:29400", rdzv_id="job", torchrun_args=()):
    """One node's torchrun line: the same on every node of the job (endpoint and rdzv_id included)."""
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}",
        *map(str, torchrun_args), str(script), *map(str, args),
    ]  # fmt: skip


class Agent:
    """A command (a torchrun agent, or a script that starts some) running in the background."""

    def __init__(self, command, env=None, threads_per_rank=1, cwd=None):
        self.command = [str(part) for part in command]
        self._out = tempfile.TemporaryFile("w+")
        self._err = tempfile.TemporaryFile("w+")
        self._start = time.perf_counter()
        self.process = subprocess.Popen(
            self.command, cwd=cwd or REPO_ROOT, env=child_environment(os.environ, threads_per_rank, env, use_gpus=False),
            stdout=self._out, stderr=self._err, text=True, start_new_session=True,
        )  # fmt: skip

    def output(self) -> str:
        """What it printed on stdout so far."""
        self._out.seek(0)
        return self._out.read()

    def wait(self, timeout_s: float) -> RunResult:
        """Wait for the end, at most timeout_s; past it, kill the agent and its workers."""
        try:
            self.process.wait(timeout=max(timeout_s, 0))
            timed_out = False
        except subprocess.TimeoutExpired:
            kill_job(self.process)
            timed_out = True
        self._err.seek(0)
        return RunResult(
            self.command, None if timed_out else self.process.returncode, self.output(), self._err.read(),
            time.perf_counter() - self._start, timed_out,
        )  # fmt: skip

    def lose_node(self) -> None:
        """SIGKILL the agent and every worker it started (they run in sessions of their own): a node is gone."""
        for pid in [self.process.pid, *descendant_pids(self.process.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.process.wait()


def run_agents(commands, timeout_s: float, env=None, stagger_host: tuple[str, int] | None = None) -> list[RunResult]:
    """Start one agent per command, wait for all (one deadline for the lot), return their results.

    stagger_host=(host, port): start the first agent alone and the others once it listens there,
    so that the first one hosts the rendezvous store (which agent does is otherwise a race).
    """
    deadline = time.monotonic() + timeout_s
    agents = [Agent(commands[0], env)]
    if stagger_host:
        wait_until(lambda: port_is_open(*stagger_host) or agents[0].process.poll() is not None, timeout_s)
    agents += [Agent(command, env) for command in commands[1:]]
    return [agent.wait(deadline - time.monotonic()) for agent in agents]


# What torch 2.14 prints for each failure (ddp_course.cluster.cluster_runs produces every one on two virtual hosts).
_LOOPBACK_PEER = re.compile(r"Gloo connectFullMesh failed with .*?remote=\[(127\.[\d.]+)\]")
_STORE_CONNECT_TIMEOUT = re.compile(r"client socket has timed out after (\d+)ms while trying to connect to \(([^,]+),")
_STORE_NO_ROUTE = re.compile(r"failed to connect to any network address of \(([^,]+),.*No route to host")
_ROOT_CAUSE_FIRST = ["wrong interface", "unreachable", "rendezvous", "peer gone"]


def diagnose_launch(*outputs: str) -> Diagnosis:
    """One line for why a multi-node launch failed, from the stderr of its agents (and their workers).

    The agents of one job fail in a chain (the first one's failure closes the rendezvous store or
    its worker's connections, and the others report only that), so every output is read and the
    root cause wins: a worker's wrong interface, then an endpoint nobody answers at, then a
    rendezvous that timed out, then a peer that went away. No ports or timings of this run.
    """
    found = [_diagnose_one(text) for text in outputs]
    rank = {kind: position for position, kind in enumerate(_ROOT_CAUSE_FIRST)}
    return min(found, key=lambda diagnosis: rank.get(diagnosis.kind, len(rank)))


def _diagnose_one(text: str) -> Diagnosis:
    loopback = _LOOPBACK_PEER.search(text)
    if loopback:
        # gloo advertises the address its host's name resolves to (GLOO_SOCKET_IFNAME overrides it);
        # Debian's /etc/hosts line "127.0.1.1 myhost" makes that a loopback address, unreachable from elsewhere.
        return Diagnosis(
            "wrong interface",
            (
                f"gloo dialled a peer at {loopback.group(1)}, a loopback address (its host's name resolves to it): "
                "set GLOO_SOCKET_IFNAME, or NCCL_SOCKET_IFNAME for NCCL, to the interface the hosts share"
            ),
        )
    if "RendezvousConnectionError" in text:
        no_route = _STORE_NO_ROUTE.search(text)
        if no_route:
            return Diagnosis(
                "unreachable", (f"no host answers at the rendezvous endpoint {no_route.group(1)} (No route to host): it names a host that is down or not there")
            )
        timed_out = _STORE_CONNECT_TIMEOUT.search(text)
        if timed_out:
            return Diagnosis(
                "unreachable",
                (f"the rendezvous endpoint {timed_out.group(2)} did not answer within {timed_out.group(1)} ms: a firewall drops its port, or the host is down"),
            )
        if re.search(r"Failed to recv|Broken pipe|Connection reset", text):
            return Diagnosis("peer gone", "the agent hosting the rendezvous store ended: read that node's output")
    if "RendezvousTimeoutError" in text:
        return Diagnosis(
            "rendezvous", ("the other agents did not join before the rendezvous's join_timeout: they could not reach this endpoint, or never started")
        )
    errors = [line for line in text.splitlines() if re.match(r"^[\w.]+(Error|Exception): ", line)]
    return diagnose(RuntimeError(errors[-1] if errors else "no error message"))


def main(argv=None) -> int:
    """python -m ddp_course.cluster.multinode FILE...: one line naming why the launch whose output is in FILE failed."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ddp_course.cluster.multinode", description=main.__doc__)
    parser.add_argument("files", nargs="+", help="a SLURM job's output file, or each node's torchrun output")
    args = parser.parse_args(argv)
    try:
        texts = [Path(name).read_text(errors="replace") for name in args.files]
    except OSError as error:
        parser.error(f"cannot read {error.filename}: {error.strerror}")
    print(diagnose_launch(*texts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
