"""Multi-node on one host: two torchrun agents are one job, and labs/slurm/lab3.sbatch runs as written.

(a) Two agents of one process each, meeting at a c10d rendezvous on 127.0.0.1 (a free port), train
    lab 3 to the same weights as one agent with two processes.
(b) The sbatch script itself, with stand-in srun and scontrol (tests/scripts/fake_slurm/) first on
    PATH: srun starts the script's per-node torchrun twice on this machine, with the variables SLURM
    gives each task, so the script a learner submits is the script that was tested.
Both compare with one shared reference launch; the three launches run at once (the `jobs` fixture),
and every launch has a timeout.
"""

import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from ddp_course.launch import REPO_ROOT, run_command
from ddp_course.multinode import agent_command, free_port, port_is_open, run_agents

LAB3 = REPO_ROOT / "labs" / "lab3_ddp.py"
SBATCH = REPO_ROOT / "labs" / "slurm" / "lab3.sbatch"
FAKE_SLURM = REPO_ROOT / "tests" / "scripts" / "fake_slurm"
# 6 steps of a global batch of 384 (4 steps in epoch 1, 2 in epoch 2), as tests/test_lab3_ddp.py's equivalence runs.
LAB3_FLAGS = ["--max-steps", "6", "--batch-size", "192", "--timeout-s", "60"]


def load_weights(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def same_weights(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def reference_launch(run_lab3, path):
    """The reference: `torchrun --standalone --nproc_per_node=2`, one agent with two processes."""
    return run_lab3(*LAB3_FLAGS, "--save", path, nproc=2, timeout_s=240)


def two_agents_launch(path):
    port = free_port()
    command = agent_command(LAB3, [*LAB3_FLAGS, "--save", path], nnodes="2", nproc=1, endpoint=f"127.0.0.1:{port}",
                            rdzv_id="lab3_two_agents")  # fmt: skip
    return run_agents([command, command], timeout_s=300, stagger_host=("127.0.0.1", port))


def sbatch_launch(path):
    environment = {
        # fake srun and scontrol first; then this interpreter's bin (torchrun, python) as an activated venv has it
        "PATH": os.pathsep.join([str(FAKE_SLURM), str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        # what SLURM sets for the batch script of `sbatch --nodes=2` (two "nodes" that are this machine)
        "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.1",
        "SLURM_CPUS_PER_TASK": "32",  # from the script's #SBATCH --cpus-per-task=32
        # the script's two settings for a CPU-only machine: one process per node, a short lab 3 run
        "NPROC_PER_NODE": "1", "LAB3_ARGS": " ".join([*LAB3_FLAGS, "--save", str(path)]),
    }  # fmt: skip
    return run_command(["bash", SBATCH], timeout_s=300, env=environment)


@pytest.fixture(scope="module")
def jobs(run_lab3, tmp_path_factory):
    """The module's three lab 3 jobs, started at once (each {name: (Future, weights path)}).

    Each is a 2-process job of a few seconds of training after seconds of start-up: run together,
    the 2 cores stay busy while one job waits for its rendezvous. No relaunch of a failed job.
    """
    paths = {name: tmp_path_factory.mktemp(name) / "weights.pt" for name in ("one_agent", "two_agents", "sbatch")}
    pool = ThreadPoolExecutor(max_workers=3)
    futures = {
        "one_agent": pool.submit(reference_launch, run_lab3, paths["one_agent"]),
        "two_agents": pool.submit(two_agents_launch, paths["two_agents"]),
        "sbatch": pool.submit(sbatch_launch, paths["sbatch"]),
    }
    yield {name: (futures[name], paths[name]) for name in futures}
    pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def one_agent(jobs):
    future, path = jobs["one_agent"]
    result = future.result()
    assert result.ok, result.describe()
    return load_weights(path)


@pytest.fixture(scope="module")
def two_agents(jobs):
    future, path = jobs["two_agents"]
    results = future.result()
    for result in results:
        assert result.ok, result.describe()
    return results, path


@pytest.mark.timeout(700)
def test_two_agents_of_one_process_train_like_one_agent_of_two(one_agent, two_agents):
    results, path = two_agents
    stdout = "".join(result.stdout for result in results)
    # One job: rank 0 (on one of the agents) prints the config once, for a world of 2.
    assert stdout.count("config:") == 1 and "world_size=2" in stdout
    # Each agent started one process, local_rank 0, with global ranks 0 and 1.
    assert sorted(re.findall(r"\[rank (\d)\] local_rank 0 trains on cpu", stdout)) == ["0", "1"]
    assert same_weights(load_weights(path), one_agent)


@pytest.fixture(scope="module")
def sbatch_run(jobs):
    future, path = jobs["sbatch"]
    result = future.result()
    assert result.ok, result.describe()
    return result, path


@pytest.mark.timeout(700)
def test_the_sbatch_script_trains_like_one_agent_of_two(one_agent, sbatch_run):
    result, path = sbatch_run
    header = re.search(r"lab3\.sbatch: 2 nodes x 1 processes, rendezvous 127\.0\.0\.1:(\d+)", result.stdout)
    assert header and 1024 <= int(header.group(1)) <= 65535, result.describe()
    assert result.stdout.count("config:") == 1 and "world_size=2" in result.stdout
    assert sorted(re.findall(r"\[rank (\d)\] local_rank 0 trains on cpu", result.stdout)) == ["0", "1"]
    assert same_weights(load_weights(path), one_agent)


def test_the_sbatch_script_starts_one_torchrun_per_node():
    """C8 of the seed review: one task per node, torchrun starts the per-GPU processes; no fixed port."""
    text = SBATCH.read_text()
    directives = re.findall(r"^#SBATCH (.+)$", text, flags=re.MULTILINE)
    assert "--ntasks-per-node=1" in directives and not any("gpus-per-task" in line for line in directives)
    srun = text[text.index("\nsrun ") :]
    assert "--ntasks-per-node=1" in srun and "torchrun --nnodes=" in srun
    assert '--rdzv-endpoint="${head_node}:${rdzv_port}"' in srun and "29400" not in text and "29500" not in text
    assert "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text


def test_the_sbatch_script_asks_srun_for_the_cpus_again_and_says_what_survives_a_lost_node():
    """Findings 9 and 16 of the 2026-11-24 review: Slurm 22.05-23.02's srun does not inherit
    --cpus-per-task from sbatch; --max-restarts covers a crashed process, not a lost node."""
    text = SBATCH.read_text()
    srun = text[text.index("\nsrun ") :]
    assert '--cpus-per-task="$SLURM_CPUS_PER_TASK"' in srun.splitlines()[1]
    comments = " ".join(line.lstrip("# ") for line in text.splitlines() if line.startswith("# "))
    assert "#SBATCH --requeue" in comments and "--no-kill" in comments and "--nnodes=MIN:MAX" in comments


@pytest.mark.timeout(60)
def test_fake_srun_starts_each_task_with_its_slurm_variables(tmp_path):
    environment = {
        "PATH": os.pathsep.join([str(FAKE_SLURM), os.environ.get("PATH", "")]),
        "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node-a,node-b",
    }  # fmt: skip
    report = 'echo "task $SLURM_PROCID node $SLURM_NODEID local $SLURM_LOCALID on $SLURMD_NODENAME"'
    result = run_command(["srun", "--ntasks-per-node=1", "bash", "-c", report], timeout_s=30, env=environment)
    assert result.ok, result.describe()
    assert sorted(result.stdout.splitlines()) == ["task 0 node 0 local 0 on node-a", "task 1 node 1 local 0 on node-b"]
    # A failing task fails srun (--kill-on-bad-exit=1): the sbatch test cannot pass on a broken node.
    failing = run_command(["srun", "bash", "-c", 'exit $((3 * SLURM_PROCID))'], timeout_s=30, env=environment)
    assert failing.returncode == 3


def test_free_port_is_free_and_not_fixed():
    ports = {free_port() for _ in range(3)}
    assert all(1024 <= port <= 65535 and not port_is_open("127.0.0.1", port) for port in ports)
