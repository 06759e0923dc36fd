"""Two machines on one Linux host: network namespaces joined by a virtual cable.

A network namespace is a copy of Linux's network stack: its own interfaces, addresses, routes,
ports and firewall. Two of them joined by a veth pair (a virtual Ethernet cable, one end in each)
behave like two hosts on a LAN: here node1 at 192.168.77.1 and node2 at 192.168.77.2, each with an
interface called eth0 (and its own loopback, lo). Every process started on a host also gets its
own hostname (a UTS namespace) and its own /etc/hosts (bound over the real one in a mount
namespace of its own), so `node1` resolves as it would on a cluster. The hosts share the rest:
the file system (the repository, the Python environment, the data) and the CPUs.

Nothing outside the namespaces is touched: the machine's interfaces, addresses, /etc/hosts and
firewall stay as they are, and the addresses above exist only inside the namespaces this module
creates (so two sessions may use them at once). close() ends every process still in a namespace
(it can only be one this session started, or a child of one) and deletes the namespaces. A session
killed before its close() (a pytest run stopped with SIGKILL) leaves its namespaces, the daemons in
them and its folder; their names carry the owner's pid, so the next VirtualHosts() removes them,
and so does, from a shell:

    sudo .venv/bin/python -m ddp_course.cluster.netns --cleanup

Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN), iproute2 (`ip`), util-linux (`nsenter`, `unshare`) and,
for block_port, nftables (`nft`).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from itertools import count
from pathlib import Path

PREFIX = "ddpc"  # namespaces are named ddpc<owner pid>-<instance>-<host>
FOLDER_PREFIX = "ddpc_hosts_"  # each VirtualHosts' folder (hosts files, a cluster's state): ddpc_hosts_<owner pid>_...
SUBNET = "192.168.77"  # host i (from 1) is SUBNET.i/24
INTERFACE = "eth0"  # the name of each host's end of the cable, as on a typical server
# Debian's installer maps a host's own name to this address when the host has no fixed one
# (/etc/hosts: "127.0.1.1 myhost"): the root of gloo's classic wrong-interface failure.
DEBIAN_LOOPBACK_NAME_ADDRESS = "127.0.1.1"
ABSENT_HOST = "node3"  # in every /etc/hosts here, at SUBNET.3, where no host answers: a node that is down
REQUIRED_COMMANDS = ("ip", "nsenter", "unshare", "hostname", "mount")

_instances = count()  # VirtualHosts made by this process so far: a part of their namespaces' names

# Runs inside the new UTS and mount namespaces: set the hostname, put this host's hosts file over
# /etc/hosts (private propagation: the machine's own /etc/hosts is untouched), then become the command.
_ENTER_HOST = 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"'


@functools.cache  # the machine does not change while we run; and threads may ask at once
def missing_requirements() -> str | None:
    """Why virtual hosts cannot be made on this machine (one line), or None when they can."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (network namespaces): run as root, e.g. in a container or VM where you are root"
    missing = [command for command in REQUIRED_COMMANDS if shutil.which(command) is None]
    if missing:
        return f"needs {', '.join(missing)} (Debian: apt-get install iproute2 util-linux hostname mount)"
    probe = f"{PREFIX}{os.getpid()}-{next(_instances)}-probe"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip() or 'ip netns add failed'}"
    _run(["ip", "netns", "delete", probe], check=False)
    return None


class VirtualHosts:
    """Hosts node1 (SUBNET.1) and node2 (SUBNET.2), one cable between them; close() ends everything.

    Use it as a context manager. `loopback_name` lists hosts whose /etc/hosts maps their own name to
    127.0.1.1, as Debian does on a host without a fixed address. node3 (SUBNET.3) is in every
    /etc/hosts, but no host has its address: a connection to it fails with "No route to host" once
    ARP gives up (about 3 s), as one to a node that is down.
    """

    def __init__(self, loopback_name: tuple[str, ...] = ()):
        clean_up()
        self.names = ["node1", "node2"]
        self.addresses = {name: f"{SUBNET}.{i}" for i, name in enumerate(self.names, start=1)}
        self.absent_address = f"{SUBNET}.3"
        instance = next(_instances)
        self.namespaces = {name: f"{PREFIX}{os.getpid()}-{instance}-{name}" for name in self.names}
        self.dir = Path(tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}_"))
        self._processes: list[subprocess.Popen] = []
        try:
            self._build(loopback_name)
        except BaseException:
            self.close()
            raise

    # -- building and tearing down -------------------------------------------------------------

    def _build(self, loopback_name) -> None:
        for name, namespace in self.namespaces.items():
            _run(["ip", "netns", "add", namespace])
            self.hosts_file(name).write_text(self._hosts_text(name, name in loopback_name))
        # The cable: a veth pair created with one end in each namespace, both ends called eth0.
        first, second = self.namespaces.values()
        _run(["ip", "link", "add", INTERFACE, "netns", first, "type", "veth", "peer", "name", INTERFACE, "netns", second])
        for name, namespace in self.namespaces.items():
            _in(namespace, "ip", "link", "set", "lo", "up")
            _in(namespace, "ip", "addr", "add", f"{self.addresses[name]}/24", "dev", INTERFACE)
            _in(namespace, "ip", "link", "set", INTERFACE, "up")

    def _hosts_text(self, me: str, loopback_name: bool) -> str:
        lines = ["127.0.0.1 localhost"]
        if loopback_name:
            lines.append(f"{DEBIAN_LOOPBACK_NAME_ADDRESS} {me}")
        lines += [f"{address} {name}" for name, address in self.addresses.items() if not (loopback_name and name == me)]
        lines.append(f"{self.absent_address} {ABSENT_HOST}")  # listed, but no host has the address: down
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        """End every process on every host (SIGTERM, then SIGKILL), delete the namespaces and files.

        Bounded: at most END_GRACE_S + END_KILL_S for the hosts' processes, then REAP_S for each
        process start() made. A namespace whose processes outlived SIGKILL (stuck in the kernel) is
        kept, and said so on stderr: deleting its name would leave them running where no one finds
        them; `python -m ddp_course.cluster.netns --cleanup` tries again later.
        """
        for namespace, left in end_processes_in(list(self.namespaces.values())).items():
            if left:
                print(f"netns: kept {namespace}: processes {left} outlived SIGKILL "
                      "(python -m ddp_course.cluster.netns --cleanup tries again)", file=sys.stderr)  # fmt: skip
            else:
                _run(["ip", "netns", "delete", namespace], check=False)
        for process in self._processes:
            _reap(process)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "VirtualHosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- using the hosts ------------------------------------------------------------------------

    def hosts_file(self, name: str) -> Path:
        return self.dir / f"hosts.{name}"

    def command(self, name: str, argv) -> list[str]:
        """argv as run on host `name`: in its network namespace, with its hostname and /etc/hosts."""
        namespace = self.namespaces[name]
        return [
            "nsenter", f"--net=/run/netns/{namespace}",  # not `ip netns exec`: see slurm_cluster's docstring
            "unshare", "--uts", "--mount", "--propagation", "private", "--",
            "sh", "-c", _ENTER_HOST, name, str(self.hosts_file(name)), *map(str, argv),
        ]  # fmt: skip

    def start(self, name: str, argv, log_path, env=None) -> subprocess.Popen:
        """Start a long-running command (a daemon) on a host, its output to log_path; close() ends it."""
        with open(log_path, "ab") as log:
            process = subprocess.Popen(self.command(name, argv), stdout=log, stderr=subprocess.STDOUT, env=env,
                                       stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        self._processes.append(process)
        return process

    def run(self, name: str, argv, timeout_s: float = 30, env=None) -> subprocess.CompletedProcess:
        """Run a short command on a host and return what it printed (killed after timeout_s)."""
        return subprocess.run(self.command(name, argv), capture_output=True, text=True, timeout=timeout_s, env=env)

    def block_port(self, name: str, port: int) -> None:
        """A firewall on host `name` drops incoming TCP to `port` (nftables), as a closed port on a cluster does."""
        nft = ["nft", "add"]
        _in(self.namespaces[name], *nft, "table", "inet", "ddpc")
        _in(self.namespaces[name], *nft, "chain", "inet", "ddpc", "input", "{ type filter hook input priority 0; }")
        # Only what comes in over the network (eth0), as usual: the host still reaches its own port on lo.
        drop = ["iifname", INTERFACE, "tcp", "dport", str(port), "drop"]
        _in(self.namespaces[name], *nft, "rule", "inet", "ddpc", "input", *drop)

    def pids(self) -> list[int]:
        """Every process now running on any of the hosts."""
        return [pid for namespace in self.namespaces.values() for pid in namespace_pids(namespace)]


def namespace_pids(namespace: str) -> list[int]:
    """The processes in a named network namespace (what `ip netns pids` prints, without starting a process)."""
    try:
        wanted = os.stat(f"/run/netns/{namespace}")
    except OSError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                found = os.stat(f"/proc/{entry}/ns/net")
            except OSError:
                continue  # ended meanwhile, or a zombie (its namespaces are gone)
            if (found.st_dev, found.st_ino) == (wanted.st_dev, wanted.st_ino):
                pids.append(int(entry))
    return pids


# How long close() and clean_up() give the processes of a namespace: SIGTERM, then SIGKILL.
END_GRACE_S = 3.0  # for SIGTERM: a daemon (slurmd, slurmctld, munged) then stops cleanly
END_KILL_S = 10.0
REAP_S = 5.0  # then how long close() waits for each process it started before it SIGKILLs it


def end_processes_in(namespaces, grace_s: float = END_GRACE_S, kill_s: float = END_KILL_S) -> dict[str, list[int]]:
    """End every process in the namespaces: {namespace: pids still there after grace_s + kill_s (normally none)}."""

    def listed():
        return [pid for namespace in namespaces for pid in namespace_pids(namespace)]

    end_processes(listed, grace_s, kill_s)
    return {namespace: namespace_pids(namespace) for namespace in namespaces}


def end_processes(list_pids, grace_s: float, kill_s: float, poll_s: float = 0.1) -> list[int]:
    """SIGTERM every process list_pids() names; after grace_s, SIGKILL every one it still names;
    return what it names after kill_s more (normally nothing).

    list_pids() is asked again at every poll and whatever it names is signalled, not only what it
    named at the start: a process started meanwhile (slurmd forking a slurmstepd for a job step
    while it is being stopped) is ended too, instead of being waited for until the deadline and
    then left running.
    """
    term_until = time.monotonic() + grace_s
    kill_until = term_until + kill_s
    terminated: set[int] = set()
    while True:
        pids = list_pids()
        now = time.monotonic()
        if not pids or now >= kill_until:
            return pids
        for pid in pids:
            if now >= term_until:
                _signal(pid, signal.SIGKILL)  # again at every poll: cheap, and a new pid may have come
            elif pid not in terminated:
                _signal(pid, signal.SIGTERM)
                terminated.add(pid)
        time.sleep(poll_s)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # it ended since it was listed
        pass


def _reap(process: subprocess.Popen) -> None:
    """Wait for a process start() made (a daemon), at most REAP_S; then SIGKILL its session and wait again.

    Its pid is normally in a namespace and already ended; one that is not (nsenter stuck before
    it entered) would otherwise keep close() waiting forever.
    """
    try:
        process.wait(timeout=REAP_S)
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # start() gave it a session (and process group) of its own
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=REAP_S)
    except subprocess.TimeoutExpired:
        print(f"netns: process {process.pid} ({' '.join(process.args[-3:])}) outlived SIGKILL", file=sys.stderr)


def our_namespaces() -> list[str]:
    """Every network namespace this module created and that still exists (any session's)."""
    listed = _run(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]
    return [name for name in names if name.startswith(PREFIX) and name[len(PREFIX) :].split("-")[0].isdigit()]


def _owner_is_gone(pid_text: str) -> bool:
    """Has the session whose pid is in a namespace's or folder's name ended (killed before its close())?"""
    return pid_text.isdigit() and int(pid_text) != os.getpid() and not Path(f"/proc/{pid_text}").exists()


def stale_namespaces() -> list[str]:
    """Our namespaces whose owner is gone."""
    return [name for name in our_namespaces() if _owner_is_gone(name[len(PREFIX) :].split("-")[0])]


def stale_folders() -> list[Path]:
    """The folders of VirtualHosts whose owner is gone (hosts files, a cluster's munge key, state and logs)."""
    found = Path(tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}*_*")
    return sorted(path for path in found if path.is_dir() and _owner_is_gone(path.name[len(FOLDER_PREFIX) :].split("_")[0]))


def clean_up() -> list[str]:
    """Remove what sessions killed before their close() left: their namespaces, every process in
    them (slurmctld, slurmd, munged, jobs) and their folders. Never another live session's.
    Returns one line per thing removed (or kept, with why)."""
    done = []
    for namespace in stale_namespaces():
        found = len(namespace_pids(namespace))
        left = end_processes_in([namespace])[namespace]
        if left:
            done.append(f"kept namespace {namespace}: processes {left} outlived SIGKILL")
            continue
        _run(["ip", "netns", "delete", namespace], check=False)
        done.append(f"removed namespace {namespace} and the {found} processes in it")
    for folder in stale_folders():
        shutil.rmtree(folder, ignore_errors=True)
        done.append(f"removed {folder}")
    return done


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_course.cluster.netns", description=__doc__.splitlines()[0])
    parser.add_argument("--cleanup", action="store_true",
                        help="remove the namespaces, daemons and folders that killed sessions left (root)")  # fmt: skip
    args = parser.parse_args(argv)
    if not args.cleanup:
        parser.error("nothing to do: --cleanup removes what killed sessions left")
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        print("netns: --cleanup needs root (the namespaces and their daemons are root's)", file=sys.stderr)
        return 1
    if shutil.which("ip") is None:
        print("netns: no `ip` command (iproute2), so no namespace of this module can exist here", file=sys.stderr)
        return 1
    done = clean_up()
    print("\n".join(done) if done else "netns: nothing left by a killed session")
    return 0


def _in(namespace: str, *argv: str) -> None:
    _run(["ip", "netns", "exec", namespace, *argv])


def _run(argv, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip()}")
    return done


if __name__ == "__main__":
    sys.exit(main())
