"""Multi-node for real: lab 3 across two hosts with their own addresses, by hand and under SLURM.

ddp_course.cluster.cluster_runs runs, once for this module and all at once: the one-node reference
(torchrun --standalone, 2 processes); two hosts (network namespaces node1 192.168.77.1 and node2
192.168.77.2, ddp_course.cluster.netns) with one torchrun agent each, a c10d rendezvous at node1:29400, in
three scenarios (gloo's wrong interface, the same fixed by GLOO_SOCKET_IFNAME, the rendezvous port
dropped by node1's firewall); and a real SLURM cluster of two nodes (Debian's Slurm 22.05,
ddp_course.cluster.slurm_cluster, started once) running labs/slurm/lab3.sbatch, its twin with a
rendezvous endpoint that names a node that is down, and labs/slurm/srun_cpus.sbatch.

It needs root, network namespaces and Debian's slurm-wlm, munge and nftables: elsewhere every test
here that runs something skips with one line saying what is missing, unless
DDP_COURSE_REQUIRE_CLUSTER=1 (set by .ci/run), which turns that skip into a failure.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ddp_course.cluster import cluster_runs, netns
from ddp_course.launch import REPO_ROOT, run_torchrun
from ddp_course.launch import QUIET_FLOOR, ephemeral_port_range, free_port, port_is_open, wait_until
from ddp_course.cluster.netns import our_namespaces

SBATCH = REPO_ROOT / "labs" / "slurm" / "lab3.sbatch"
SCRIPTS = REPO_ROOT / "tests" / "scripts"
REQUIRE_VARIABLE = "DDP_COURSE_REQUIRE_CLUSTER"
# The wrong-interface run again, node2's agent started this late: more than the 5 s rendezvous
# timeouts the run once had, as an agent whose start a loaded machine delays (cluster_runs.SLOW_START_RDZV).
LATE_START_S = 12


def skip_unless_the_machine_can(needs_slurm: bool = True):
    """Skip (one line) where the cluster (or, needs_slurm False, the namespaces) cannot run; fail
    instead under DDP_COURSE_REQUIRE_CLUSTER=1."""
    from ddp_course.cluster.slurm_cluster import unavailable_reason

    reason = unavailable_reason() if needs_slurm else netns.missing_requirements()
    if reason and os.environ.get(REQUIRE_VARIABLE) == "1":
        pytest.fail(f"{REQUIRE_VARIABLE}=1 but the cluster cannot run here: {reason}", pytrace=False)
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def runs_and_a_failure(tmp_path_factory):
    """cluster_runs.run_all(), and beside it (they mostly wait) a cluster whose user fails (see
    test_a_failing_test_leaves_no_daemon_job_or_namespace_behind) and the wrong interface with a late agent."""
    skip_unless_the_machine_can()
    with ThreadPoolExecutor(max_workers=2) as pool:
        failure = pool.submit(a_cluster_whose_user_fails)
        late = pool.submit(cluster_runs._by_hand, cluster_runs.Runs(tmp_path_factory.mktemp("late")), "wrong interface", LATE_START_S)
        runs = cluster_runs.run_all(tmp_path_factory.mktemp("cluster_runs"))
        return runs, failure.result(), late.result()


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
def test_the_wrong_interface_is_diagnosed_when_one_agent_starts_late(runs_and_a_failure):
    """Finding 18 of the 2026-11-28 review: with 5 s rendezvous timeouts, an agent that started more
    than 5 s after the other (a loaded machine) turned "wrong interface" into "rendezvous"."""
    node1, node2 = runs_and_a_failure[2]
    assert [node1.returncode, node2.returncode] == [1, 1] and not (node1.timed_out or node2.timed_out)
    diagnosis = cluster_runs.diagnose_launch(node1.stderr, node2.stderr)
    assert str(diagnosis).startswith("wrong interface: gloo dialled a peer at 127.0.1.1"), node1.stderr + node2.stderr


@pytest.mark.timeout(600)
def test_a_rendezvous_port_dropped_by_a_firewall_fails_within_its_timeout(facts):
    found = facts["by hand: blocked port"]
    assert found["exit statuses"] == [1, 1] and not found["stopped by the launcher"]
    # Dropped, not refused: node2's agent waited its whole read_timeout (5 s) for an answer.
    assert found["diagnosis"] == ("unreachable: the rendezvous endpoint node1 did not answer within 5000 ms: a firewall drops its port, or the host is down")


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
    assert found["diagnosis"] == ("unreachable: no host answers at the rendezvous endpoint node3 (No route to host): it names a host that is down or not there")
    assert "lab3.sbatch: 2 nodes x 1 processes, rendezvous node3:29400" in runs.job_outputs["wrong endpoint"]


@pytest.mark.timeout(600)
def test_the_diagnosis_from_a_shell_reads_the_job_output_file(runs, facts, tmp_path, capsys):
    from ddp_course.cluster.multinode import main

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
    """labs/slurm/recorded_runs.json (python -m ddp_course.cluster.cluster_runs --record) still says what happens."""
    assert cluster_runs.comparable(facts) == cluster_runs.comparable(cluster_runs.recorded())


def a_cluster_whose_user_fails() -> tuple[dict, dict]:
    """Start a cluster, run a job on both nodes, raise while it runs; return what ran then and what is left."""
    from ddp_course.cluster.slurm_cluster import SlurmCluster

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
    assert 'rdzv_endpoint="${RDZV_ENDPOINT:-${head_node}:${rdzv_port:-}}"' in text
    assert "29400" not in text and "29500" not in text
    # The port comes from the job's id, outside the node's ephemeral range, where srun's own listening sockets cannot take it.
    assert "< /proc/sys/net/ipv4/ip_local_port_range" in text and "bind((" not in text
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
GLOO_TO_LOOPBACK = (
    "RuntimeError: Gloo connectFullMesh failed with [../gloo/transport/tcp/pair.cc:152] timed out "
    "connecting: SO_ERROR: Connection refused, remote=[127.0.1.1]:16807$1"
)
STORE_CLOSED = (
    "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed.\n"
    "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store "
    "has failed. See inner exception for details."
)
DROPPED = (
    "torch.distributed.DistNetworkError: The client socket has timed out after 5000ms while trying to connect "
    "to (node1, 29400).\ntorch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection "
    "to the C10d store has failed. See inner exception for details."
)
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
    from ddp_course.cluster.multinode import diagnose_launch

    found = diagnose_launch(*outputs)
    assert found.kind == kind and "\n" not in str(found) and "29400" not in found.summary


# --- ports: outside the ephemeral range the host has (finding 16 of the 2026-11-28 review) ------------------
# Ranges some hosts set instead of Linux's 32768-60999: busy servers, some Kubernetes nodes.
LOWERED_RANGES = [(15000, 65000), (1024, 65000), (10000, 60999)]


@pytest.mark.parametrize("ephemeral", [None, (32768, 60999), *LOWERED_RANGES])
def test_free_port_is_free_not_fixed_and_outside_the_ephemeral_range(ephemeral):
    """None: this host's own range, read from /proc/sys/net/ipv4/ip_local_port_range."""
    first, last = ephemeral or ephemeral_port_range()
    ports = {free_port(ephemeral=ephemeral) for _ in range(3)}
    assert len(ports) > 1 and all(not port_is_open("127.0.0.1", port) for port in ports)
    assert all(QUIET_FLOOR <= port <= 65535 and not first <= port <= last for port in ports), (ports, first, last)


def test_free_port_refuses_in_one_line_where_the_ephemeral_range_leaves_no_port():
    with pytest.raises(OSError, match=r"^every port from 10000 to 65535 is in this host's ephemeral range \(1024-65535, "):
        free_port(ephemeral=(1024, 65535))


def test_the_ephemeral_range_is_read_from_the_kernel_setting(tmp_path):
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("15000\t65000\n")  # as the kernel writes it
    assert ephemeral_port_range(setting) == (15000, 65000)
    assert ephemeral_port_range(tmp_path / "absent") == (49152, 65535)  # no such file (macOS, Windows): IANA's
    if Path("/proc/sys/net/ipv4/ip_local_port_range").exists():
        assert ephemeral_port_range() == tuple(map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()))


def in_a_network_namespace_with(ephemeral: tuple[int, int], argv) -> list[str]:
    """argv in a fresh network namespace (root) whose ephemeral range is `ephemeral`: the setting is per namespace."""
    setting = f"echo '{ephemeral[0]} {ephemeral[1]}' > /proc/sys/net/ipv4/ip_local_port_range && ip link set lo up && exec \"$@\""
    return ["unshare", "--net", "--", "sh", "-c", setting, "sh", *map(str, argv)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ephemeral", LOWERED_RANGES)
def test_on_a_host_with_a_lowered_range_free_port_stays_outside_what_the_kernel_hands_out(ephemeral):
    """A real kernel with that range: sockets binding port 0 get ports inside it, free_port never does."""
    skip_unless_the_machine_can(needs_slurm=False)
    probe = (
        "import json, socket\n"
        "from ddp_course.launch import free_port\n"
        "kernel = []\n"
        "for _ in range(20):\n"
        "    with socket.socket() as s:\n"
        "        s.bind(('127.0.0.1', 0)); kernel.append(s.getsockname()[1])\n"
        "print(json.dumps({'kernel': kernel, 'ours': [free_port() for _ in range(20)]}))\n"
    )
    done = subprocess.run(in_a_network_namespace_with(ephemeral, [sys.executable, "-c", probe]), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    found, (first, last) = json.loads(done.stdout), ephemeral
    assert all(first <= port <= last for port in found["kernel"])
    assert all(QUIET_FLOOR <= port <= 65535 and not first <= port <= last for port in found["ours"])


def submit_sbatch_here(job_id: int, tmp_path: Path, ephemeral: tuple[int, int] | None = None) -> subprocess.CompletedProcess:
    """labs/slurm/lab3.sbatch as SLURM would run it on the head node, with scontrol and srun stand-ins
    (srun only prints its command); ephemeral: in a network namespace with that range (root)."""
    stand_ins = tmp_path / "bin"
    stand_ins.mkdir(exist_ok=True)
    for name, body in {"scontrol": r"printf 'node1\nnode2\n'", "srun": 'echo "srun $*"'}.items():
        (stand_ins / name).write_text(f"#!/bin/sh\n{body}\n")
        (stand_ins / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{stand_ins}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": str(job_id),
           "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2", "SLURM_CPUS_PER_TASK": "2"}  # fmt: skip
    for variable in ("RDZV_ENDPOINT", "NPROC_PER_NODE", "LAB3_ARGS", "TORCHRUN_ARGS"):  # the script's defaults
        env.pop(variable, None)
    argv = ["bash", str(SBATCH)]
    if ephemeral:
        argv = in_a_network_namespace_with(ephemeral, argv)
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env, cwd=REPO_ROOT)


def sbatch_port(done: subprocess.CompletedProcess) -> int:
    header = re.search(r"^lab3\.sbatch: 2 nodes x 8 processes, rendezvous node1:(\d+)$", done.stdout, flags=re.MULTILINE)
    assert done.returncode == 0 and header, done.stdout + done.stderr
    return int(header.group(1))


@pytest.mark.parametrize("job_id, port", [(5, 10005), (22767, 32767), (22768, 61000), (27303, 65535), (27304, 10000)])
def test_the_sbatch_script_maps_job_ids_to_the_ports_outside_the_default_ephemeral_range(tmp_path, job_id, port):
    """Linux's default range, 32768-60999, leaves 10000-32767 and 61000-65535: 27304 ports, in that order."""
    if ephemeral_port_range() != (32768, 60999):
        pytest.skip(f"this host's ephemeral range is {ephemeral_port_range()}, not Linux's default")
    assert sbatch_port(submit_sbatch_here(job_id, tmp_path)) == port


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ephemeral", LOWERED_RANGES)
def test_the_sbatch_script_picks_outside_a_lowered_ephemeral_range(tmp_path, ephemeral):
    skip_unless_the_machine_can(needs_slurm=False)
    first, last = ephemeral
    ports = [sbatch_port(submit_sbatch_here(job_id, tmp_path, ephemeral)) for job_id in (1, 4999, 5000, 5535, 77777)]
    assert all(QUIET_FLOOR <= port <= 65535 and not first <= port <= last for port in ports), ports
    assert len(set(ports)) > 1


@pytest.mark.timeout(120)
def test_the_sbatch_script_stops_in_one_line_where_the_ephemeral_range_leaves_no_port(tmp_path):
    skip_unless_the_machine_can(needs_slurm=False)
    done = submit_sbatch_here(7, tmp_path, (1024, 65535))
    assert done.returncode == 1 and "srun" not in done.stdout
    assert done.stderr == ("lab3.sbatch: every port from 10000 to 65535 is in node1's ephemeral range (1024-65535): "
                           "set RDZV_ENDPOINT=node1:PORT to a port no one uses\n")  # fmt: skip


# --- MASTER_PORT with a fresh store per attempt (finding 14 of the 2026-11-28 review) ---------------------


@pytest.mark.timeout(300)
def test_with_a_fresh_store_per_attempt_master_port_is_held_by_no_one_until_rank_0_binds_it():
    """What the sbatch script's comment says TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 costs: the workers'
    MASTER_PORT is an ephemeral port that nobody holds when the workers start (torch's get_free_port),
    where without the variable it is the agent's store, which holds it."""
    first, last = ephemeral_port_range()
    found = {}
    for disabled in ("1", "0"):
        done = run_torchrun(SCRIPTS / "master_port_free.py", nproc=1, timeout_s=240,
                            env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": disabled})  # fmt: skip
        assert done.ok, done.describe()
        port, held, shared = re.search(r"MASTER_PORT (\d+) held: (\w+), agent store shared: (\w+)", done.stdout).groups()
        found[disabled] = (first <= int(port) <= last, held, shared)
    assert found == {"1": (True, "False", "False"), "0": (True, "True", "True")}
    comments = " ".join(line.lstrip("# ") for line in SBATCH.read_text().splitlines() if line.startswith("#"))
    assert "get_free_port" in comments and "spends one of its 3 restarts" in comments


def test_a_rank_0_store_whose_port_a_listener_took_fails_with_the_error_the_sbatch_script_names():
    import socket

    import torch.distributed as dist

    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen()
        with pytest.raises(dist.DistNetworkError, match="EADDRINUSE, message: address already in use"):
            dist.TCPStore("127.0.0.1", listener.getsockname()[1], 1, True, wait_for_workers=False)
    assert '(DistNetworkError: "EADDRINUSE, message: address already in use")' in SBATCH.read_text()


# --- interfaces (finding 15 of the 2026-11-28 review) ------------------------------------------------------


def test_gloo_socket_ifname_takes_exact_interface_names_not_prefixes_or_wildcards():
    """What the sbatch script's comment says of GLOO_SOCKET_IFNAME, on this machine's loopback interface."""
    import torch.distributed as dist

    assert dist.ProcessGroupGloo.create_device(interface="lo") is not None
    for pattern in ("l", "lo*"):
        with pytest.raises(RuntimeError, match=f"Unable to find address for: {re.escape(pattern)}"):
            dist.ProcessGroupGloo.create_device(interface=pattern)


def test_the_sbatch_script_gives_each_variable_its_own_syntax():
    comments = " ".join(line.lstrip("# ") for line in SBATCH.read_text().splitlines() if line.startswith("#"))
    assert "ens*" not in comments.replace('"ens*" matches nothing', "")  # no glob offered as advice
    assert "=NAME for one exact name (=ens5)" in comments and "GLOO_SOCKET_IFNAME takes exact names" in comments
    assert "docker" in comments and "127.0.1.1" in comments


# --- stopping the hosts (finding 17 of the 2026-11-28 review) -----------------------------------------------


def stubborn(seconds: int = 300) -> list[str]:
    """A daemon that ignores SIGTERM (as a stuck one might): only SIGKILL ends it."""
    return ["sh", "-c", f"trap '' TERM; exec sleep {seconds}"]


@pytest.mark.timeout(120)
def test_close_also_ends_a_process_started_on_a_host_while_it_stops_them(monkeypatch):
    """slurmd may fork a slurmstepd while close() is stopping the hosts: a process that was not there
    when the processes were listed. Here one is started on node2 right after the first SIGKILL."""
    skip_unless_the_machine_can(needs_slurm=False)
    hosts = netns.VirtualHosts()
    late = []
    try:
        hosts.start("node1", stubborn(), hosts.dir / "stubborn.log")
        # Until it runs sleep, it is a shell that has not yet set its trap: SIGTERM would still end it.
        assert wait_until(lambda: commands(hosts.pids()) == ["sleep"], 30)
        real_kill, real_listing = os.kill, netns.namespace_pids

        def kill(pid, sig):
            if sig == signal.SIGKILL and not late:  # the first SIGKILL: start a process on node2 now
                late.append(subprocess.Popen(hosts.command("node2", stubborn(301)), start_new_session=True,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))  # fmt: skip
                node2 = hosts.namespaces["node2"]
                assert wait_until(lambda: late[0].pid in real_listing(node2) and commands([late[0].pid]) == ["sleep"], 30)
            real_kill(pid, sig)

        monkeypatch.setattr(os, "kill", kill)
        started = time.monotonic()
        hosts.close()
        monkeypatch.undo()
        assert late and late[0].wait(timeout=5) == -signal.SIGKILL
        assert time.monotonic() - started < netns.END_GRACE_S + netns.END_KILL_S
        assert not set(hosts.namespaces.values()) & set(our_namespaces())
    finally:
        monkeypatch.undo()
        for process in late:
            if process.poll() is None:
                process.kill()
                process.wait()
        hosts.close()


@pytest.mark.timeout(120)
def test_close_does_not_wait_forever_for_a_process_it_started(monkeypatch):
    """A process start() made that never entered a namespace (nsenter stuck), so ending the namespaces'
    processes does not end it: close() waits netns.REAP_S, then SIGKILLs its session."""
    skip_unless_the_machine_can(needs_slurm=False)
    hosts = netns.VirtualHosts()
    outside = subprocess.Popen(["sleep", "300"], start_new_session=True)
    hosts._processes.append(outside)  # as start() records its processes
    closing = threading.Thread(target=hosts.close, daemon=True)
    try:
        closing.start()
        closing.join(timeout=netns.END_GRACE_S + netns.END_KILL_S + 3 * netns.REAP_S)
        assert not closing.is_alive(), "close() still waits"
        assert outside.poll() == -signal.SIGKILL
    finally:
        if outside.poll() is None:
            outside.kill()
        closing.join(timeout=30)
        hosts.close()


@pytest.mark.timeout(180)
def test_the_cleanup_command_removes_what_a_killed_session_left():
    """`python -m ddp_course.cluster.netns --cleanup` after a session was SIGKILLed: namespaces, daemons, folder."""
    skip_unless_the_machine_can(needs_slurm=False)
    session = subprocess.Popen([sys.executable, str(SCRIPTS / "abandon_hosts.py")], stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    left = None
    try:
        left = json.loads(session.stdout.readline())
        session.send_signal(signal.SIGKILL)  # no close(), no finally: block, no atexit
        session.wait(timeout=30)
        assert set(left["namespaces"]) <= set(our_namespaces()) and all(cluster_runs._alive(pid) for pid in left["pids"])
        done = subprocess.run([sys.executable, "-m", "ddp_course.cluster.netns", "--cleanup"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
        assert done.returncode == 0, done.stderr
        for namespace in left["namespaces"]:
            assert f"removed namespace {namespace} and the 1 processes in it" in done.stdout, done.stdout
        assert f"removed {left['folder']}" in done.stdout
        assert not set(left["namespaces"]) & set(our_namespaces())
        assert not any(cluster_runs._alive(pid) for pid in left["pids"]) and not Path(left["folder"]).exists()
        again = subprocess.run([sys.executable, "-m", "ddp_course.cluster.netns", "--cleanup"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
        assert (again.returncode, again.stdout) == (0, "netns: nothing left by a killed session\n")
    finally:
        if session.poll() is None:
            session.kill()
            session.wait()
        netns.clean_up()


def test_the_cleanup_command_says_what_to_do_without_its_flag():
    done = subprocess.run([sys.executable, "-m", "ddp_course.cluster.netns"], capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 2 and done.stderr.splitlines()[-1] == (
        "python -m ddp_course.cluster.netns: error: nothing to do: --cleanup removes what killed sessions left"
    )
