"""Lecture 1 section 4: what torchrun starts - agents, worker processes, their environment, one process group.

The example is a job of 2 machines ("nodes") x 2 GPUs, launched with the same command on each machine:
    torchrun --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d --rdzv-endpoint=node0:29400 --rdzv-id=job train.py
Each machine's torchrun agent meets the others at the rendezvous (a key-value store on node0), is given
its node rank, and starts one worker process per GPU with the variables of its environment() below
(torch/distributed/elastic/agent/server/api.py sets them: RANK = node rank x processes per node +
LOCAL_RANK when every node runs the same number). Each worker's init_process_group("env://") reads them
and joins the one process group of WORLD_SIZE ranks.
"""

from __future__ import annotations

NAME = "torchrun_processes"
TITLE = "torchrun -> processes -> environment -> process group, for 2 nodes x 2 GPUs"
NODES, PROCESSES_PER_NODE = 2, 2
ENDPOINT = "node0:29400"


def environment(node_rank: int, local_rank: int) -> dict[str, str]:
    """What torchrun puts in one worker's environment (the variables a training script reads)."""
    world_size = NODES * PROCESSES_PER_NODE
    return {
        "RANK": str(node_rank * PROCESSES_PER_NODE + local_rank),  # unique in the job
        "LOCAL_RANK": str(local_rank),  # unique on this machine: the GPU to use
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(PROCESSES_PER_NODE),
        "MASTER_ADDR": ENDPOINT.split(":")[0],  # where the store of the job's rendezvous listens
    }


def describe() -> dict:
    nodes = []
    for node_rank in range(NODES):
        workers = [{"env": environment(node_rank, local_rank), "device": f"cuda:{local_rank}"} for local_rank in range(PROCESSES_PER_NODE)]
        nodes.append({"name": f"node{node_rank}", "agent": f"torchrun agent (node rank {node_rank})", "workers": workers})
    return {
        "command": f"torchrun --nnodes={NODES} --nproc_per_node={PROCESSES_PER_NODE} --rdzv-backend=c10d --rdzv-endpoint={ENDPOINT} train.py",
        "rendezvous": f"c10d rendezvous: a key-value store at {ENDPOINT}",
        "nodes": nodes,
        "process_group": f'init_process_group("nccl"): one process group of {NODES * PROCESSES_PER_NODE} ranks',
        "note": "device from LOCAL_RANK, never from RANK: rank 3 uses cuda:1 on node1",
    }


def draw(description: dict):
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    figure, ax = plt.subplots(figsize=(10, 5.9))
    ax.set_xlim(0, 10)
    ax.set_ylim(-0.35, 6.3)
    ax.axis("off")

    def box(x, y, w, h, text, color, size=8.5, weight="normal"):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.04", facecolor=color, edgecolor="0.3"))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight, family="monospace" if "=" in text else None)

    def arrow(x0, y0, x1, y1, style="-|>"):
        ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle=style, mutation_scale=12, color="0.35"))

    ax.text(5, 6.1, description["command"] + "   (the same command on each node)", ha="center", fontsize=8.5, family="monospace")
    box(3.2, 5.25, 3.6, 0.45, description["rendezvous"], "#f6e3b4")
    nodes = description["nodes"]
    width = 10 / len(nodes)
    worker_boxes = []
    for n, node in enumerate(nodes):
        x0 = n * width + 0.15
        ax.add_patch(FancyBboxPatch((x0, 0.95), width - 0.3, 4.05, boxstyle="round,pad=0.02", facecolor="none", edgecolor="0.6", linestyle="--"))
        ax.text(x0 + 0.1, 4.82, node["name"], fontsize=9, weight="bold", va="top")
        box(x0 + 0.9, 4.2, width - 2.1, 0.45, node["agent"], "#d8e6f3", weight="bold")
        arrow(x0 + width / 2 - 0.15, 4.65, 5 + (n - 0.5) * 1.2, 5.25, style="<|-|>")
        slot = (width - 0.3) / len(node["workers"])
        for w, worker in enumerate(node["workers"]):
            wx = x0 + w * slot + 0.1
            env = worker["env"]
            lines = [f"worker: {worker['device']}", *(f"{key}={env[key]}" for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR"))]
            box(wx, 1.55, slot - 0.2, 2.2, "\n".join(lines), "#e4f1e0", size=7.5)
            arrow(x0 + width / 2 - 0.15, 4.2, wx + (slot - 0.2) / 2, 3.75)
            worker_boxes.append((wx + (slot - 0.2) / 2, 1.55))
    box(1.0, 0.15, 8.0, 0.5, description["process_group"], "#f3d9d9", weight="bold")
    for x, y in worker_boxes:
        arrow(x, y, x, 0.65)
    ax.text(5, -0.22, description["note"], ha="center", fontsize=8, color="0.2")
    return figure
