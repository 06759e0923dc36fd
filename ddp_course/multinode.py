"""Several torchrun agents, as if each were a node: for tests and lab sheets; and what went wrong.

A multi-node job is one torchrun agent per node; the agents meet at a c10d rendezvous (one of
them hosts a TCPStore on the endpoint's port) and then start their workers. Two agents on this
machine with --rdzv-endpoint=127.0.0.1:PORT form the same job, and killing one agent together
with its workers is what losing a node looks like to the others.

Every agent runs in a process group of its own, its output goes to files (read at any time, also
while it runs), and every wait has a deadline, after which the agent and its workers are killed.
An agent can also run on a host of ddp_course.netns (a network namespace with its own address):
Agent(hosts.command("node1", agent_command(...))).

diagnose_launch() reads what the agents and their workers printed and names, in one line, why a
multi-node job never started: the failures of the first minutes on a new cluster (wrong interface,
a port the firewall drops, an endpoint nobody answers at), as ddp_course.faults does for the
failures of a running job. From a shell: python -m ddp_course.multinode lab3_1234.out
"""

from __future__ import annotations

import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddp_course.faults import Diagnosis, diagnose
from ddp_course.launch import REPO_ROOT, RunResult, _descendant_pids, _kill_job, child_environment


# The ports the kernel hands out by itself, to every socket that binds port 0 (gloo's listeners,
# srun's, get_free_port()'s): Linux's default is 32768-60999, but busy servers and some Kubernetes
# nodes widen it (1024-65535, 15000-65000), so it is read, not assumed.
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
IANA_EPHEMERAL_RANGE = (49152, 65535)  # where there is no such file (macOS, Windows): their default
# Below this port sit many services' fixed ports (5432, 6379, 8080, 8888...): never picked.
QUIET_FLOOR = 10000
_PICK = random.SystemRandom()  # not the seeded `random`: seeded processes would all pick the same ports


def ephemeral_port_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """(first, last) of this host's ephemeral port range, as the kernel reads it."""
    try:
        first, last = map(int, path.read_text().split())
    except (OSError, ValueError):
        return IANA_EPHEMERAL_RANGE
    return first, last


def quiet_ports(ephemeral: tuple[int, int] | None = None) -> list[int]:
    """The ports from QUIET_FLOOR to 65535 outside the ephemeral range (default: this host's).

    The kernel never hands these out by itself, so one that is free now stays free until it is
    bound by number. A port from the ephemeral range, however free now, goes to the next socket
    that binds port 0 as easily as to us: labs/slurm/lab3.sbatch says how that once failed a job.
    """
    first, last = ephemeral or ephemeral_port_range()
    below, above = range(QUIET_FLOOR, min(first, 65536)), range(max(last + 1, QUIET_FLOOR), 65536)  # either may be empty
    return [*below, *above]


def free_port(host: str = "127.0.0.1", ephemeral: tuple[int, int] | None = None) -> int:
    """A TCP port free on host now, outside its ephemeral range (quiet_ports); bind to it soon, as it is not reserved."""
    candidates = quiet_ports(ephemeral)
    first, last = ephemeral or ephemeral_port_range()
    if not candidates:
        raise OSError(f"every port from {QUIET_FLOOR} to 65535 is in this host's ephemeral range ({first}-{last}, "
                      f"{EPHEMERAL_RANGE_FILE}): no port is safe from the next socket that binds port 0")  # fmt: skip
    for port in _PICK.sample(candidates, min(64, len(candidates))):
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:  # in use: try another
                continue
            return port
    raise OSError(f"no free port among 64 tries from {QUIET_FLOOR} to 65535 outside {first}-{last} on {host}")


def port_is_open(host: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1.0)
        return probe.connect_ex((host, port)) == 0


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
            _kill_job(self.process)
            timed_out = True
        self._err.seek(0)
        return RunResult(
            self.command, None if timed_out else self.process.returncode, self.output(), self._err.read(),
            time.perf_counter() - self._start, timed_out,
        )  # fmt: skip

    def lose_node(self) -> None:
        """SIGKILL the agent and every worker it started (they run in sessions of their own): a node is gone."""
        for pid in [self.process.pid, *_descendant_pids(self.process.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.process.wait()


def wait_until(condition, timeout_s: float, poll_s: float = 0.1) -> bool:
    """Poll condition() until it is true (True) or timeout_s passed (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll_s)
    return bool(condition())


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


# What torch 2.14 prints for each failure (ddp_course.cluster_runs produces every one on two virtual hosts).
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
        return Diagnosis("wrong interface", (
            f"gloo dialled a peer at {loopback.group(1)}, a loopback address (its host's name resolves to it): "
            "set GLOO_SOCKET_IFNAME, or NCCL_SOCKET_IFNAME for NCCL, to the interface the hosts share"))
    if "RendezvousConnectionError" in text:
        no_route = _STORE_NO_ROUTE.search(text)
        if no_route:
            return Diagnosis("unreachable", (
                f"no host answers at the rendezvous endpoint {no_route.group(1)} (No route to host): "
                "it names a host that is down or not there"))
        timed_out = _STORE_CONNECT_TIMEOUT.search(text)
        if timed_out:
            return Diagnosis("unreachable", (
                f"the rendezvous endpoint {timed_out.group(2)} did not answer within {timed_out.group(1)} ms: "
                "a firewall drops its port, or the host is down"))
        if re.search(r"Failed to recv|Broken pipe|Connection reset", text):
            return Diagnosis("peer gone", "the agent hosting the rendezvous store ended: read that node's output")
    if "RendezvousTimeoutError" in text:
        return Diagnosis("rendezvous", (
            "the other agents did not join before the rendezvous's join_timeout: they could not reach "
            "this endpoint, or never started"))
    errors = [line for line in text.splitlines() if re.match(r"^[\w.]+(Error|Exception): ", line)]
    return diagnose(RuntimeError(errors[-1] if errors else "no error message"))


def main(argv=None) -> int:
    """python -m ddp_course.multinode FILE...: one line naming why the launch whose output is in FILE failed."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ddp_course.multinode", description=main.__doc__)
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
