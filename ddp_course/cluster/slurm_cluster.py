"""A real SLURM cluster of two nodes on this machine: submit labs/slurm/lab3.sbatch as on a cluster.

    sudo .venv/bin/python -m ddp_course.cluster.slurm_cluster            # start, submit lab 3 to 2 nodes, stop
    sudo .venv/bin/python -m ddp_course.cluster.slurm_cluster --shell    # a shell on the login node; exit stops all

Debian's Slurm 22.05 (packages slurm-wlm and munge; installed with apt-get when missing and you
are root): slurmctld and one slurmd per node, each node a network namespace with its own hostname
and address (ddp_course.cluster.netns: node1 at 192.168.77.1, node2 at 192.168.77.2), so `sbatch --nodes=2`
starts one task on each, and lab 3's torchrun agents meet at node1's address as on a real cluster.
The configuration is labs/slurm/local_cluster.conf, written into a temporary folder with the munge
key, the daemons' state, spool and logs. Stopping ends every process on the nodes and removes the
folder and the namespaces: the only lasting change is the installed packages.

Found while building it (Slurm 22.05.8 here):
- slurmd refuses to start without a cgroup file system ("No filesystem mounted on /sys/fs/cgroup",
  "Unable to initialize cgroup plugin") even with proctrack/linuxproc and task/none. `ip netns
  exec` mounts a fresh /sys without the cgroup mounts, so processes enter a node's namespace with
  `nsenter --net=...` instead, which leaves /sys as it is (netns.VirtualHosts.command).
- munged refuses a socket folder that not everyone can enter ("Socket is inaccessible: execute
  permissions for all required").
- Without slurmdbd (and the MySQL or MariaDB database it needs), plain `sacct` only says "Slurm
  accounting storage is disabled"; `sacct --completion` reads the jobcomp/filetxt record
  (labs/slurm/local_cluster.conf) and reports each job's state, exit code and nodes.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ddp_course.launch import REPO_ROOT
from ddp_course.cluster.netns import VirtualHosts, missing_requirements

CONF_TEMPLATE = REPO_ROOT / "labs" / "slurm" / "local_cluster.conf"
SBATCH = REPO_ROOT / "labs" / "slurm" / "lab3.sbatch"
# The command each Debian package provides that this module runs.
PACKAGE_OF = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client", "sacct": "slurm-client",
              "munged": "munge", "mungekey": "munge", "nft": "nftables", "ip": "iproute2"}  # fmt: skip
APT_PACKAGES = ("slurm-wlm", "munge", "nftables", "iproute2")  # slurm-wlm pulls slurmctld, slurmd and slurm-client
TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                   "BOOT_FAIL", "DEADLINE"}  # fmt: skip


class ClusterUnavailable(RuntimeError):
    """This machine cannot run the cluster; the message says what it needs, in one line."""


def missing_commands() -> list[str]:
    return [command for command in PACKAGE_OF if shutil.which(command) is None]


def unavailable_reason() -> str | None:
    """Why the cluster cannot run here (one line), or None. Installs nothing."""
    reason = missing_requirements()
    if reason:
        return reason
    missing = missing_commands()
    if missing:
        packages = sorted({PACKAGE_OF[command] for command in missing})
        return (f"needs {', '.join(missing)}: apt-get install --no-install-recommends {' '.join(APT_PACKAGES)} "
                f"(Debian 12 has Slurm 22.05; missing packages: {', '.join(packages)})")  # fmt: skip
    return None


def ensure_installed() -> None:
    """Install Debian's slurm-wlm, munge and nftables with apt-get where they are missing (root only)."""
    if not missing_commands():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise ClusterUnavailable(unavailable_reason())
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *APT_PACKAGES]
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print("installing:", " ".join(command), flush=True)
    if subprocess.run(command, env=environment).returncode != 0:  # an outdated package list: update once
        subprocess.run(["apt-get", "update", "-q"], env=environment, check=True)
        subprocess.run(command, env=environment, check=True)


@dataclass(frozen=True)
class JobRecord:
    """What `sacct --completion` says about a finished job."""

    job_id: str
    state: str  # COMPLETED, FAILED, CANCELLED, TIMEOUT...
    exit_code: str  # "status:signal" of the batch script, e.g. "0:0", "1:0"
    nodes: str  # e.g. node[1-2]


class SlurmCluster:
    """slurmctld + a slurmd on each of two virtual hosts, and munge; a context manager (close() stops all).

    Commands (sbatch, sacct, scontrol...) run on node1, the login node, with SLURM_CONF pointing at
    the cluster's configuration; jobs get the environment of the sbatch that submitted them.
    """

    def __init__(self, start_timeout_s: float = 60):
        reason = unavailable_reason()
        if reason:
            raise ClusterUnavailable(reason)
        self.hosts = VirtualHosts()
        try:
            self.dir = self.hosts.dir / "slurm"
            self.conf = self.dir / "slurm.conf"
            self._start(start_timeout_s)
        except BaseException:
            self.close()
            raise

    def _start(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        # munged insists that everyone can enter its socket's folder; the key stays private (mungekey: 0600).
        os.chmod(self.hosts.dir, 0o755)
        for folder, mode in (("", 0o755), ("munge-run", 0o755), ("munge-key", 0o700), ("state", 0o700), ("log", 0o755)):
            (self.dir / folder).mkdir(mode=mode, exist_ok=True)
        for node in self.hosts.names:
            (self.dir / "spool" / node).mkdir(parents=True)
        addresses = {f"{name}_address": address for name, address in self.hosts.addresses.items()}
        self.conf.write_text(CONF_TEMPLATE.read_text().format(dir=self.dir, **addresses))
        key = self.dir / "munge-key" / "munge.key"
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True, timeout=30)
        socket = self.dir / "munge-run" / "munge.socket"
        self._daemon("node1", "munged", ["munged", "--foreground", f"--key-file={key}", f"--socket={socket}",
                                          f"--pid-file={self.dir / 'munge-run' / 'munged.pid'}",
                                          f"--seed-file={self.dir / 'munge-key' / 'munged.seed'}"])  # fmt: skip
        self._wait(socket.exists, deadline, "munged did not create its socket")
        self._daemon("node1", "slurmctld", ["slurmctld", "-D", "-i"])  # -D: in the foreground; -i: no saved state yet
        for node in self.hosts.names:
            self._daemon(node, f"slurmd-{node}", ["slurmd", "-D", "-N", node])
        self._wait(self._nodes_idle, deadline, "the nodes never became idle")

    def _daemon(self, node: str, name: str, argv) -> None:
        self.hosts.start(node, argv, self.dir / "log" / f"{name}.out", env=self.environment())

    def _wait(self, condition, deadline: float, what: str) -> None:
        while not condition():
            if time.monotonic() > deadline:
                raise ClusterUnavailable(f"{what} (logs in {self.dir / 'log'}):\n{self.logs()}")
            time.sleep(0.2)

    def _nodes_idle(self) -> bool:
        states = self.run(["sinfo", "--noheader", "--Node", "--format=%N %t"], timeout_s=10, check=False).stdout.split()
        return states[1::2] == ["idle", "idle"]

    def logs(self, lines: int = 15) -> str:
        """The last lines of every daemon's log: where a cluster that does not start says why."""
        parts = []
        for log in sorted((self.dir / "log").glob("*")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"== {log.name}\n" + "\n".join(tail))
        return "\n".join(parts)

    # -- using the cluster ----------------------------------------------------------------------

    def environment(self, env=None) -> dict:
        """This process's environment with SLURM_CONF set and this Python's bin folder (a venv's torchrun)
        first on PATH, as in an activated venv (`sudo` resets PATH), then `env` on top. Jobs get it too."""
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)])
        return {**os.environ, "SLURM_CONF": str(self.conf), "PATH": path, **(env or {})}

    def run(self, argv, env=None, timeout_s: float = 30, check: bool = True) -> subprocess.CompletedProcess:
        """Run a SLURM command (sbatch, sacct, scontrol...) on the login node, node1."""
        done = self.hosts.run("node1", argv, timeout_s=timeout_s, env=self.environment(env))
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(map(str, argv))}: {done.stderr.strip()}")
        return done

    def sbatch(self, script, sbatch_args=(), env=None) -> str:
        """Submit a batch script (script None: sbatch_args has --wrap=COMMAND); returns the job id."""
        done = self.run(["sbatch", "--parsable", *map(str, sbatch_args), *([str(script)] if script else [])], env=env)
        return done.stdout.strip().split(";")[0]

    def records(self, job_ids) -> dict[str, JobRecord]:
        """The finished jobs among job_ids, as `sacct --completion` reports them."""
        fields = "JobID,State,ExitCode,NodeList"
        done = self.run(["sacct", "--completion", "--noheader", "--parsable2", f"--format={fields}",
                         f"--jobs={','.join(job_ids)}"], check=False)  # fmt: skip
        rows = [line.split("|") for line in done.stdout.splitlines() if line.count("|") == 3]
        return {row[0]: JobRecord(*row) for row in rows if row[0] in job_ids and row[1].split()[0] in TERMINAL_STATES}

    def wait(self, job_ids, timeout_s: float) -> dict[str, JobRecord]:
        """Wait until every job has ended (at most timeout_s; then scancel the rest), return sacct's records."""
        job_ids = [str(job) for job in job_ids]
        deadline = time.monotonic() + timeout_s
        # Poll the completion file itself (a read, where each sacct is a few processes), then ask sacct once.
        while len(self._ended(job_ids)) < len(job_ids) and time.monotonic() < deadline:
            time.sleep(0.25)
        late = [job for job in job_ids if job not in self._ended(job_ids)]
        if late:
            self.run(["scancel", *late], check=False)
            self._wait(lambda: self._ended(job_ids) == set(job_ids), time.monotonic() + 30, "scancel did not end them")
        return self.records(job_ids)

    def _ended(self, job_ids) -> set[str]:
        """The jobs among job_ids that jobcomp/filetxt has recorded (it writes a line when a job ends)."""
        path = self.dir / "jobcomp.txt"
        recorded = set(re.findall(r"^JobId=(\d+) ", path.read_text(), flags=re.MULTILINE)) if path.exists() else set()
        return recorded & set(job_ids)

    def tasks_launched(self, job_id: str, step: int = 0) -> dict[str, int]:
        """{node: how many times its slurmd was asked to launch the job's step}, from the slurmd logs."""
        request = f"launch task StepId={job_id}.{step} request"
        return {node: (self.dir / "log" / f"slurmd-{node}.log").read_text(errors="replace").count(request)
                for node in self.hosts.names}  # fmt: skip

    def close(self) -> None:
        """Stop the daemons and every job process (all of them run on the nodes), remove everything."""
        self.hosts.close()

    def __enter__(self) -> "SlurmCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_course.cluster.slurm_cluster", description=__doc__.splitlines()[0])
    parser.add_argument("--shell", action="store_true", help="open a shell on the login node instead of the demo job")
    args = parser.parse_args(argv)
    try:
        ensure_installed()
        cluster = SlurmCluster()
    except ClusterUnavailable as error:
        print(f"slurm_cluster: {error}", file=sys.stderr)
        return 1
    with cluster:
        print(f"cluster up: slurmctld on node1, slurmd on node1 ({cluster.hosts.addresses['node1']}) "
              f"and node2 ({cluster.hosts.addresses['node2']}); files in {cluster.dir}")  # fmt: skip
        if args.shell:
            print(
                "try: sinfo; NPROC_PER_NODE=1 OMP_NUM_THREADS=1 LAB3_ARGS='--epochs 3' sbatch --nodes=2 "
                "--cpus-per-task=2 --gpus-per-node=0 --output=/tmp/lab3_%j.out labs/slurm/lab3.sbatch; "
                "squeue; sacct --completion; cat /tmp/lab3_1.out"
            )
            subprocess.run(cluster.hosts.command("node1", [os.environ.get("SHELL", "bash")]), cwd=REPO_ROOT,
                           env=cluster.environment())  # fmt: skip
            return 0
        out = Path(tempfile.mkdtemp(prefix="lab3_sbatch_"))
        job = cluster.sbatch(SBATCH, ["--nodes=2", "--cpus-per-task=2", "--gpus-per-node=0", f"--chdir={REPO_ROOT}",
                                      f"--output={out}/lab3_%j.out"],
                             env={"NPROC_PER_NODE": "1", "OMP_NUM_THREADS": "1", "LAB3_ARGS": "--epochs 3"})  # fmt: skip
        print(f"submitted job {job}: sbatch --nodes=2 labs/slurm/lab3.sbatch; waiting for it (at most 10 minutes)")
        record = cluster.wait([job], timeout_s=600)[job]
        print((out / f"lab3_{job}.out").read_text(), end="")
        print(f"sacct --completion: job {record.job_id} {record.state}, exit code {record.exit_code}, nodes {record.nodes}")
        shutil.rmtree(out, ignore_errors=True)
        return 0 if record.state == "COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(main())
