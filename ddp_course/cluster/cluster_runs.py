"""Lab 7 section 6's runs: lab 3 across two hosts of their own, by hand and with SLURM, and what breaks.

    sudo .venv/bin/python -m ddp_course.cluster.cluster_runs            # run them (a minute or two), print the facts
    sudo .venv/bin/python -m ddp_course.cluster.cluster_runs --record   # and store them in labs/slurm/recorded_runs.json

Every run is lab 3 for 6 steps (as tests/test_lab3_ddp.py's equivalence runs), one process per
host, on the virtual hosts of ddp_course.cluster.netns (node1 at 192.168.77.1, node2 at 192.168.77.2):

    reference      one node: torchrun --standalone --nproc_per_node=2; the weights everything is compared with
    by hand        one torchrun agent per host, c10d rendezvous at node1:29400 (the namespaces are this
                   module's, so every port in them is free):
      wrong interface    node2's /etc/hosts maps its own name to 127.0.1.1, as Debian's installer
                         writes it: gloo advertises that address for node2, and node1 cannot reach it
      GLOO_SOCKET_IFNAME the same hosts with GLOO_SOCKET_IFNAME=eth0: trains
      blocked port       node1's firewall (nftables) drops port 29400 from the network
    SLURM          ddp_course.cluster.slurm_cluster: `sbatch --nodes=2 labs/slurm/lab3.sbatch`, its twin with
                   RDZV_ENDPOINT=node3:29400 (a node that is down), and labs/slurm/srun_cpus.sbatch

All start at once: the failing runs mostly wait for their timeouts (see FAIL_FAST_RDZV and
SLOW_START_RDZV for which, and why a run that must meet first gets longer ones). facts() turns the
results into what the sheet prints and the tests compare: states, exit statuses, diagnoses,
"weights equal", the accuracy; nothing that changes between runs (no ports chosen by the OS,
times or process ids).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ddp_course.launch import REPO_ROOT, RunResult, child_environment, run_torchrun
from ddp_course.cluster.multinode import Agent, agent_command, diagnose_launch
from ddp_course.cluster.netns import ABSENT_HOST, DEBIAN_LOOPBACK_NAME_ADDRESS, INTERFACE, VirtualHosts

LAB3 = REPO_ROOT / "labs" / "lab3_ddp.py"
SBATCH = REPO_ROOT / "labs" / "slurm" / "lab3.sbatch"
SRUN_CPUS = REPO_ROOT / "labs" / "slurm" / "srun_cpus.sbatch"
RECORD = REPO_ROOT / "labs" / "slurm" / "recorded_runs.json"
# 6 steps of a global batch of 384 (4 in epoch 1, 2 in epoch 2), as tests/test_lab3_ddp.py's equivalence runs.
LAB3_FLAGS = ["--max-steps", "6", "--batch-size", "192", "--timeout-s", "60"]
PORT = 29400  # inside namespaces of our own every port is free, so the endpoint can be fixed (and printed)
ENDPOINT = f"node1:{PORT}"
# The runs that fail AT the rendezvous give up within seconds instead of torch's defaults: 60 s for
# an agent to reach the rendezvous store (read_timeout) and 600 s for the others to join
# (join_timeout). Node1's firewall and node3's absence fail whatever the timing, so 5 s is enough.
FAIL_FAST_RDZV = "--rdzv-conf=read_timeout=5,join_timeout=5"
# The wrong interface fails AFTER the rendezvous, so both agents must meet first, and everything
# here starts at once on 2 cores: well over a dozen Python processes importing torch. One agent's
# start can then lag the other's by more than 5 s, and with FAIL_FAST_RDZV the early one gives up
# on the late one: with node2 started 12 s late, the diagnosis named the rendezvous endpoint
# ("did not answer within 5000 ms") instead of the wrong interface. These timeouts only bound the
# wait for a slow start: the run still ends as fast as gloo gives up on the refused address (4
# attempts, its retryLimit of 3), and the launcher's limit below still stops a run that hangs.
SLOW_START_RDZV = "--rdzv-conf=read_timeout=60,join_timeout=60"
LAUNCH_LIMIT_S = {"train": 300, "fail": 120}  # then the launcher kills the run (it counts as "stopped")
SBATCH_ARGS = ["--nodes=2", "--cpus-per-task=2", "--gpus-per-node=0"]  # the CPU settings of lab3.sbatch
BY_HAND = {  # scenario: (hosts whose name resolves to 127.0.1.1, extra environment, launch kind, rendezvous settings)
    "wrong interface": (("node2",), {}, "fail", [SLOW_START_RDZV]),
    "GLOO_SOCKET_IFNAME": (("node2",), {"GLOO_SOCKET_IFNAME": INTERFACE}, "train", []),  # torch's defaults
    "blocked port": ((), {}, "fail", [FAIL_FAST_RDZV]),
}


@dataclass
class Runs:
    """What every run of the module docstring printed and wrote (paths under `workdir`)."""

    workdir: Path
    reference: RunResult | None = None
    by_hand: dict[str, list[RunResult]] = field(default_factory=dict)  # scenario -> one result per agent
    jobs: dict[str, object] = field(default_factory=dict)  # "lab3" / "wrong endpoint" / "srun cpus" -> JobRecord
    job_outputs: dict[str, str] = field(default_factory=dict)
    tasks_per_node: dict[str, dict[str, int]] = field(default_factory=dict)  # job -> {node: tasks its slurmd launched}
    leftover_pids: list[int] = field(default_factory=list)  # processes of the hosts still alive after close()

    def weights(self, name: str) -> Path:
        return self.workdir / f"{name.replace(' ', '_')}.pt"


def run_all(workdir: str | Path) -> Runs:
    """Start every run at once, wait for all of them, return what they printed (see the module docstring)."""
    runs = Runs(Path(workdir))
    runs.workdir.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=2 + len(BY_HAND)) as pool:
        cluster_job = pool.submit(_slurm_runs, runs)
        by_hand = {name: pool.submit(_by_hand, runs, name) for name in BY_HAND}
        reference = pool.submit(run_torchrun, LAB3, [*LAB3_FLAGS, "--save", runs.weights("reference")], nproc=2,
                                timeout_s=LAUNCH_LIMIT_S["train"])  # fmt: skip
        runs.reference = reference.result()
        runs.by_hand = {name: future.result() for name, future in by_hand.items()}
        cluster_job.result()
    return runs


def _by_hand(runs: Runs, scenario: str, node2_late_s: float = 0) -> list[RunResult]:
    """One torchrun agent on each host, both naming node1:29400; returns their results (node1's first).

    node2_late_s: node2's agent starts that many seconds after node1's, as an agent whose start a
    loaded machine delays (tests/test_multinode.py checks that the diagnosis survives it).
    """
    loopback_name, env, kind, rdzv = BY_HAND[scenario]
    flags = [*LAB3_FLAGS, "--save", runs.weights(f"{scenario} late" if node2_late_s else scenario)]
    rdzv_id = scenario.replace(" ", "_")
    command = agent_command(LAB3, flags, nnodes="2", nproc=1, endpoint=ENDPOINT, rdzv_id=rdzv_id, torchrun_args=rdzv)
    late = ["sh", "-c", f'sleep {node2_late_s:g} && exec "$@"', "sh"] if node2_late_s else []
    with VirtualHosts(loopback_name=loopback_name) as hosts:
        if scenario == "blocked port":
            hosts.block_port("node1", PORT)
        deadline = time.monotonic() + LAUNCH_LIMIT_S[kind] + node2_late_s  # one for both agents
        agents = [Agent(hosts.command("node1", command), env), Agent(hosts.command("node2", [*late, *command]), env)]
        return [agent.wait(deadline - time.monotonic()) for agent in agents]


def _slurm_runs(runs: Runs) -> None:
    from ddp_course.cluster.slurm_cluster import SlurmCluster  # a module that needs the packages only when it runs

    environment = child_environment({}, 1, {"NPROC_PER_NODE": "1"}, use_gpus=False)  # one thread per rank, no GPU

    def lab3_args(name):
        return " ".join([*LAB3_FLAGS, "--save", str(runs.weights(name))])

    submissions = {
        "lab3": (SBATCH, {"LAB3_ARGS": lab3_args("slurm")}),
        "wrong endpoint": (SBATCH, {"LAB3_ARGS": lab3_args("slurm wrong endpoint"), "RDZV_ENDPOINT": f"{ABSENT_HOST}:{PORT}",
                                    "TORCHRUN_ARGS": FAIL_FAST_RDZV}),
        "srun cpus": (SRUN_CPUS, {}),
    }  # fmt: skip
    cluster = SlurmCluster()
    try:
        where = [f"--chdir={REPO_ROOT}", f"--output={runs.workdir / 'slurm_%j.out'}"]
        ids = {name: cluster.sbatch(script, [*SBATCH_ARGS, *where], {**environment, **env})
               for name, (script, env) in submissions.items()}  # fmt: skip
        records = cluster.wait(list(ids.values()), timeout_s=LAUNCH_LIMIT_S["train"])
        for name, job in ids.items():
            runs.jobs[name] = records[job]
            path = runs.workdir / f"slurm_{job}.out"
            runs.job_outputs[name] = path.read_text(errors="replace") if path.exists() else ""
            runs.tasks_per_node[name] = cluster.tasks_launched(job)
        pids = cluster.hosts.pids()
    finally:
        cluster.close()
    runs.leftover_pids = [pid for pid in pids if _alive(pid)]


def _alive(pid: int) -> bool:
    """Running (a zombie has ended: it only waits for its parent to read its status)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# -- facts: what the sheet prints and the tests compare ----------------------------------------


def facts(runs: Runs) -> dict:
    """The robust facts of every run (see the module docstring); `accuracy` values are this CPU's."""
    import torch

    def same_as_reference(name: str) -> bool:
        path = runs.weights(name)
        if not path.exists() or not runs.weights("reference").exists():
            return False
        ours, reference = (torch.load(p, map_location="cpu", weights_only=True) for p in (path, runs.weights("reference")))
        return ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)

    found = {"reference": {"trained": runs.reference.ok, "accuracy": accuracy(runs.reference.stdout)}}
    for scenario, results in runs.by_hand.items():
        entry = {"exit statuses": [result.returncode for result in results],
                 "stopped by the launcher": any(result.timed_out for result in results)}  # fmt: skip
        if BY_HAND[scenario][2] == "train":
            entry["weights equal the reference"] = same_as_reference(scenario)
        else:
            entry["diagnosis"] = str(diagnose_launch(*(result.stderr for result in results)))
        found[f"by hand: {scenario}"] = entry
    lab3, wrong = runs.jobs["lab3"], runs.jobs["wrong endpoint"]
    found["sbatch"] = {
        "sacct": f"{lab3.state} {lab3.exit_code} {lab3.nodes}",
        "torchrun tasks per node": runs.tasks_per_node["lab3"],
        "weights equal the reference": same_as_reference("slurm"),
        "accuracy": accuracy(runs.job_outputs["lab3"]),
    }
    found["sbatch: wrong endpoint"] = {
        # Not the exit code: srun reports 1 (the agent that failed) or 143 (the one it then terminated).
        "sacct": f"{wrong.state} {wrong.nodes}",
        "diagnosis": str(diagnose_launch(runs.job_outputs["wrong endpoint"])),
    }
    srun = dict(re.findall(r"^(without|with): (cpus \d+, tasks \d+)$", runs.job_outputs["srun cpus"], flags=re.MULTILINE))
    found["srun cpus"] = {"sacct": runs.jobs["srun cpus"].state, **srun}
    found["left running after the cluster stopped"] = len(runs.leftover_pids)
    return found


def accuracy(stdout: str) -> str | None:
    """The job's last held-out accuracy, e.g. "47.91% (172/359)"."""
    found = re.findall(r"held-out accuracy ([\d.]+% \(\d+/\d+\))", stdout)
    return found[-1] if found else None


def comparable(found: dict) -> dict:
    """facts() without the accuracy values, which another CPU's rounding may change (guide, section 5)."""
    return {run: {k: v for k, v in entry.items() if k != "accuracy"} if isinstance(entry, dict) else entry
            for run, entry in found.items()}  # fmt: skip


def lines(found: dict) -> list[str]:
    """The facts as the lab 7 sheet prints them."""

    def verdict(entry):
        statuses, stopped = entry["exit statuses"], entry["stopped by the launcher"]
        return f"trained: {statuses == [0, 0]}, exit statuses {statuses}, stopped by the launcher: {stopped}"

    wrong_iface, fixed, blocked = (found[f"by hand: {name}"] for name in BY_HAND)
    sbatch, wrong, srun = found["sbatch"], found["sbatch: wrong endpoint"], found["srun cpus"]
    return [
        f"one node (torchrun --standalone --nproc_per_node=2): held-out accuracy {found['reference']['accuracy']}",
        f"by hand, one agent per host, --rdzv-endpoint={ENDPOINT}:",
        f"  node2's /etc/hosts says '{DEBIAN_LOOPBACK_NAME_ADDRESS} node2': {verdict(wrong_iface)}",
        f"    {wrong_iface['diagnosis']}",
        f"  the same hosts, GLOO_SOCKET_IFNAME={INTERFACE}: {verdict(fixed)}",
        f"    weights equal the one-node run's: {fixed['weights equal the reference']}",
        f"  node1's firewall drops port {PORT}: {verdict(blocked)}",
        f"    {blocked['diagnosis']}",
        "SLURM 22.05, slurmctld on node1, slurmd on node1 and node2:",
        f"  sbatch --nodes=2 labs/slurm/lab3.sbatch: sacct {sbatch['sacct']}; torchrun tasks started: "
        + ", ".join(f"{node} {count}" for node, count in sbatch["torchrun tasks per node"].items()),
        f"    weights equal the one-node run's: {sbatch['weights equal the reference']}; held-out accuracy {sbatch['accuracy']}",
        f"  the same with RDZV_ENDPOINT={ABSENT_HOST}:{PORT} ({ABSENT_HOST} is down): sacct {wrong['sacct']}",
        f"    {wrong['diagnosis']}",
        f"  srun -vv in a job of --cpus-per-task=2: without --cpus-per-task '{srun.get('without')}', with it '{srun.get('with')}'",
        f"processes left running after the cluster stopped: {found['left running after the cluster stopped']}",
    ]


def recorded() -> dict:
    """The facts stored in labs/slurm/recorded_runs.json by `python -m ddp_course.cluster.cluster_runs --record`."""
    return json.loads(RECORD.read_text())["facts"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_course.cluster.cluster_runs", description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help=f"store the facts in {RECORD.relative_to(REPO_ROOT)}")
    args = parser.parse_args(argv)
    from ddp_course.cluster.slurm_cluster import ClusterUnavailable, ensure_installed, unavailable_reason

    try:
        ensure_installed()
    except ClusterUnavailable as error:
        print(f"cluster_runs: {error}", file=sys.stderr)
        return 1
    reason = unavailable_reason()
    if reason:
        print(f"cluster_runs: {reason}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="cluster_runs_") as workdir:
        found = facts(run_all(workdir))
    print("\n".join(lines(found)))
    if args.record:
        produced_by = "python -m ddp_course.cluster.cluster_runs --record (never edited by hand)"
        RECORD.write_text(json.dumps({"produced_by": produced_by, "facts": found}, indent=1) + "\n")
        print(f"recorded in {RECORD.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
