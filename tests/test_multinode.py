"""Multi-node for real: lab 3 across two hosts with their own addresses, by hand and under SLURM.

ddp_course.cluster_runs runs, once for this module and all at once: the one-node reference
(torchrun --standalone, 2 processes); two hosts (network namespaces node1 192.168.77.1 and node2
192.168.77.2, ddp_course.netns) with one torchrun agent each, a c10d rendezvous at node1:29400, in
three scenarios (gloo's wrong interface, the same fixed by GLOO_SOCKET_IFNAME, the rendezvous port
dropped by node1's firewall); and a real SLURM cluster of two nodes (Debian's Slurm 22.05,
ddp_course.slurm_cluster, started once) running labs/slurm/lab3.sbatch, its twin with a
rendezvous endpoint that names a node that is down, and labs/slurm/srun_cpus.sbatch.

It needs root, network namespaces and Debian's slurm-wlm, munge and nftables: elsewhere every test
here that runs something skips with one line saying what is missing, unless
DDP_COURSE_REQUIRE_CLUSTER=1 (set by .ci/run), which turns that skip into a failure.
"""

import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ddp_course import cluster_runs
from ddp_course.launch import REPO_ROOT
from ddp_course.multinode import free_port, port_is_open
from ddp_course.netns import our_namespaces

SBATCH = REPO_ROOT / "labs" / "slurm" / "lab3.sbatch"
REQUIRE_VARIABLE = "DDP_COURSE_REQUIRE_CLUSTER"


def skip_unless_the_machine_can():
    """Skip (one line) where the cluster cannot run; fail instead under DDP_COURSE_REQUIRE_CLUSTER=1."""
    from ddp_course.slurm_cluster import unavailable_reason

    reason = unavailable_reason()
    if reason and os.environ.get(REQUIRE_VARIABLE) == "1":
        pytest.fail(f"{REQUIRE_VARIABLE}=1 but the cluster cannot run here: {reason}", pytrace=False)
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def runs_and_a_failure(tmp_path_factory):
    """cluster_runs.run_all(), and beside it (it mostly waits) a cluster whose user fails: see the last test."""
    skip_unless_the_machine_can()
    with ThreadPoolExecutor(max_workers=1) as pool:
        failure = pool.submit(a_cluster_whose_user_fails)
        runs = cluster_runs.run_all(tmp_path_factory.mktemp("cluster_runs"))
        return runs, failure.result()


@pytest.fixture(scope="module")
def runs(runs_and_a_failure):
    return runs_and_a_failure[0]


@pytest.fixture(scope="module")
def facts(runs):
    return cluster_runs.facts(runs)


def same_weights(path_a, path_b) -> bool:
    a, b = (torch.load(path, map_location="cpu", weights_only=True) for path in (path_a, path_b))
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def ranks_with_local_rank_0(stdout: str) -> list[str]:
    return sorted(re.findall(r"\[rank (\d)\] local_rank 0 trains on cpu", stdout))


@pytest.mark.timeout(600)
def test_two_hosts_train_like_one_node_once_gloo_is_told_the_interface(runs):
    node1, node2 = runs.by_hand["GLOO_SOCKET_IFNAME"]
    assert runs.reference.ok, runs.reference.describe()
    assert node1.ok and node2.ok, node1.describe() + node2.describe()
    stdout = node1.stdout + node2.stdout
    # One job of world size 2: rank 0 prints the config once; each host's agent started local_rank 0.
    assert stdout.count("config:") == 1 and "world_size=2" in stdout
    assert ranks_with_local_rank_0(stdout) == ["0", "1"]
    assert same_weights(runs.weights("GLOO_SOCKET_IFNAME"), runs.weights("reference"))


@pytest.mark.timeout(600)
def test_gloo_on_the_wrong_interface_fails_with_its_diagnosis_within_its_timeout(facts):
    """node2's name resolves to 127.0.1.1: gloo advertises it, node1 dials it and is refused."""
    found = facts["by hand: wrong interface"]
    assert found["exit statuses"] == [1, 1] and not found["stopped by the launcher"]
    assert found["diagnosis"].startswith("wrong interface: gloo dialled a peer at 127.0.1.1")
    assert "GLOO_SOCKET_IFNAME" in found["diagnosis"] and "NCCL_SOCKET_IFNAME" in found["diagnosis"]


@pytest.mark.timeout(600)
def test_a_rendezvous_port_dropped_by_a_firewall_fails_within_its_timeout(facts):
    found = facts["by hand: blocked port"]
    assert found["exit statuses"] == [1, 1] and not found["stopped by the launcher"]
    # Dropped, not refused: node2's agent waited its whole read_timeout (5 s) for an answer.
    assert found["diagnosis"] == ("unreachable: the rendezvous endpoint node1 did not answer within 5000 ms: "
                                  "a firewall drops its port, or the host is down")


@pytest.mark.timeout(600)
def test_sbatch_on_two_nodes_trains_like_one_node(runs, facts):
    """A real `sbatch --nodes=2 labs/slurm/lab3.sbatch`: one torchrun per node, rendezvous on node1."""
    output = runs.job_outputs["lab3"]
    assert facts["sbatch"]["sacct"] == "COMPLETED 0:0 node[1-2]", output
    assert facts["sbatch"]["torchrun tasks per node"] == {"node1": 1, "node2": 1}  # slurmd's launch requests
    header = re.search(r"lab3\.sbatch: 2 nodes x 1 processes, rendezvous node1:(\d+)", output)
    assert header and 1024 <= int(header.group(1)) <= 65535, output
    assert output.count("config:") == 1 and "world_size=2" in output and ranks_with_local_rank_0(output) == ["0", "1"]
    assert facts["sbatch"]["weights equal the reference"] and same_weights(runs.weights("slurm"), runs.weights("reference"))
    assert facts["sbatch"]["accuracy"] == facts["reference"]["accuracy"] is not None


@pytest.mark.timeout(600)
def test_sbatch_with_an_endpoint_that_names_a_node_that_is_down_fails_with_its_diagnosis(runs, facts):
    found = facts["sbatch: wrong endpoint"]
    # FAILED on its own: not CANCELLED by cluster.wait's deadline, nor TIMEOUT.
    assert found["sacct"] == "FAILED node[1-2]", runs.job_outputs["wrong endpoint"]
    assert runs.jobs["wrong endpoint"].exit_code != "0:0"
    assert found["diagnosis"] == (
        "unreachable: no host answers at the rendezvous endpoint node3 (No route to host): "
        "it names a host that is down or not there")
    assert "lab3.sbatch: 2 nodes x 1 processes, rendezvous node3:29400" in runs.job_outputs["wrong endpoint"]


@pytest.mark.timeout(600)
def test_the_diagnosis_from_a_shell_reads_the_job_output_file(runs, facts, tmp_path, capsys):
    from ddp_course.multinode import main

    path = tmp_path / "lab3_2.out"
    path.write_text(runs.job_outputs["wrong endpoint"])
    assert main([str(path)]) == 0
    assert capsys.readouterr().out == facts["sbatch: wrong endpoint"]["diagnosis"] + "\n"


@pytest.mark.timeout(600)
def test_slurm_22_05_srun_does_not_inherit_cpus_per_task_as_the_sbatch_script_says(facts):
    assert facts["srun cpus"] == {"sacct": "COMPLETED", "without": "cpus 2, tasks 2", "with": "cpus 4, tasks 2"}
    comments = " ".join(line.lstrip("# ") for line in SBATCH.read_text().splitlines() if line.startswith("#"))
    assert '"cpus 2, tasks 2" without the flag and "cpus 4, tasks 2" with it' in comments


@pytest.mark.timeout(600)
def test_nothing_is_left_running_after_the_runs(facts):
    assert facts["left running after the cluster stopped"] == 0
    assert not [name for name in our_namespaces() if name.startswith(f"ddpc{os.getpid()}-")]


@pytest.mark.timeout(600)
def test_the_recorded_runs_the_lab_7_sheet_shows_are_these(facts):
    """labs/slurm/recorded_runs.json (python -m ddp_course.cluster_runs --record) still says what happens."""
    assert cluster_runs.comparable(facts) == cluster_runs.comparable(cluster_runs.recorded())


def a_cluster_whose_user_fails() -> tuple[dict, dict]:
    """Start a cluster, run a job on both nodes, raise while it runs; return what ran then and what is left."""
    from ddp_course.slurm_cluster import SlurmCluster

    try:
        with SlurmCluster() as cluster:
            cluster.sbatch(None, ["--nodes=2", "--output=/dev/null", "--wrap=srun sleep 300"])
            deadline = time.monotonic() + 60
            while commands(cluster.hosts.pids()).count("sleep") < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            started = dict(zip(cluster.hosts.pids(), commands(cluster.hosts.pids())))
            raise RuntimeError("a test failing on purpose")
    except RuntimeError as error:
        if str(error) != "a test failing on purpose":
            raise
    left = {"processes": [pid for pid in started if cluster_runs._alive(pid)],
            "namespaces": set(cluster.hosts.namespaces.values()) & set(our_namespaces())}  # fmt: skip
    return started, left


@pytest.mark.timeout(600)
def test_a_failing_test_leaves_no_daemon_job_or_namespace_behind(runs_and_a_failure):
    """The cluster stops however the code using it ends: here by an exception while a job runs on both nodes."""
    started, left = runs_and_a_failure[1]
    names = list(started.values())
    assert {"munged", "slurmctld", "slurmd", "slurmstepd"} <= set(names) and names.count("sleep") == 2, started
    assert left == {"processes": [], "namespaces": set()}


def commands(pids) -> list[str]:
    names = []
    for pid in pids:
        try:
            names.append(open(f"/proc/{pid}/comm").read().strip())
        except OSError:
            names.append("(ended)")
    return names


def test_the_sbatch_script_starts_one_torchrun_per_node():
    """C8 of the seed review: one task per node, torchrun starts the per-GPU processes; no fixed port."""
    text = SBATCH.read_text()
    directives = re.findall(r"^#SBATCH (.+)$", text, flags=re.MULTILINE)
    assert "--ntasks-per-node=1" in directives and not any("gpus-per-task" in line for line in directives)
    srun = text[text.index("\nsrun ") :]
    assert "--ntasks-per-node=1" in srun and "torchrun --nnodes=" in srun
    assert '--rdzv-endpoint="$rdzv_endpoint"' in srun
    assert 'rdzv_endpoint="${RDZV_ENDPOINT:-${head_node}:${rdzv_port}}"' in text
    assert "29400" not in text and "29500" not in text
    # The port comes from the job's id below the ephemeral range, where srun's own listening sockets cannot take it.
    assert "rdzv_port=$((10000 + SLURM_JOB_ID % 20000))" in text and "bind((" not in text
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text


def test_the_sbatch_script_asks_srun_for_the_cpus_again_and_says_what_survives_a_lost_node():
    """Findings 9 and 16 of the 2026-11-24 review: Slurm 22.05-23.02's srun does not inherit
    --cpus-per-task from sbatch; --max-restarts covers a crashed process, not a lost node."""
    text = SBATCH.read_text()
    srun = text[text.index("\nsrun ") :]
    assert '--cpus-per-task="$SLURM_CPUS_PER_TASK"' in srun.splitlines()[1]
    comments = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("# "))
    assert "#SBATCH --requeue" in comments and "--no-kill" in comments and "--nnodes=MIN:MAX" in comments


# What torch 2.14's agents and workers printed in the runs above (cut to the lines that matter), so that
# diagnose_launch is also checked on machines that cannot make the hosts.
GLOO_TO_LOOPBACK = ("RuntimeError: Gloo connectFullMesh failed with [../gloo/transport/tcp/pair.cc:152] timed out "
                    "connecting: SO_ERROR: Connection refused, remote=[127.0.1.1]:16807$1")
STORE_CLOSED = ("torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed.\n"
                "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store "
                "has failed. See inner exception for details.")
DROPPED = ("torch.distributed.DistNetworkError: The client socket has timed out after 5000ms while trying to connect "
           "to (node1, 29400).\ntorch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection "
           "to the C10d store has failed. See inner exception for details.")
NOBODY_JOINED = "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError"


@pytest.mark.parametrize("outputs, kind", [
    ((GLOO_TO_LOOPBACK, STORE_CLOSED), "wrong interface"),
    ((STORE_CLOSED, GLOO_TO_LOOPBACK), "wrong interface"),  # the root cause wins, whichever node printed it
    ((NOBODY_JOINED, DROPPED), "unreachable"),
    ((NOBODY_JOINED,), "rendezvous"),
    ((STORE_CLOSED,), "peer gone"),
    (("ValueError: something else entirely",), "error"),
])  # fmt: skip
def test_diagnose_launch_names_the_root_cause_of_a_chain_of_failures(outputs, kind):
    from ddp_course.multinode import diagnose_launch

    found = diagnose_launch(*outputs)
    assert found.kind == kind and "\n" not in str(found) and "29400" not in found.summary


def test_free_port_is_free_not_fixed_and_below_the_ephemeral_range():
    ports = {free_port() for _ in range(3)}
    assert len(ports) > 1 and all(20000 <= port < 32768 and not port_is_open("127.0.0.1", port) for port in ports)
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")  # Linux: the range binding port 0 draws from
    if ephemeral.exists():
        assert max(ports) < int(ephemeral.read_text().split()[0])
