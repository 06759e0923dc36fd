"""A hang, a wrong result or a crash? The decision tree of lecture 6, section 1.

Three questions sort a failing job; each leaf is a symptom, the tool that names its cause, and where
the course runs that case (lecture 6 section 1 runs every leaf marked "L6 §1" on 2 gloo ranks;
"L4", "lab 4", "lab 7" and "L3" are the other notebooks that show it). The figure replaces the
lecture's field-guide table: the same rows, read as a tree.
"""

from __future__ import annotations

NAME = "failure_decision_tree"
TITLE = "Hang, wrong result or crash: three questions, then the tool that names the cause and where the course shows it"

FAILURES = [
    {
        "failure": "hang",
        "test": "nothing new is printed,\nno process has exited\n(after the timeout: 'Timed out',\nDistStoreError, ...)",
        "leaves": [
            (
                "init_process_group never returns",
                "init timeout -> DistStoreError (WORLD_SIZE differs)\nor DistNetworkError (nothing at MASTER_ADDR:PORT)",
                "L6 §1 start-up demos",
            ),
            (
                "ranks wait in different collectives\n(one behind `if rank == 0:`)",
                "TORCH_DISTRIBUTED_DEBUG=DETAIL\n(on gloo: in a reproduction without DDP)",
                "L6 §1 rank0-only, lab 4 §2",
            ),
            ("one rank never arrives\n(stuck in I/O, a deadlock)", "dist.monitored_barrier names it;\npy-spy dump --pid PID", "L6 §1 missing-rank"),
            ("at an epoch's end: one rank\nhas more batches", "all-gather the batch counts;\nfix: Join([model])", "L6 §1 uneven, L3 §5"),
            ("a parameter used on some ranks only", "timeout on some ranks, error on others;\nfind_unused_parameters=True", "L4 §2.4"),
            ("on NCCL: SIGABRT, no Python error", "watchdog + flight-recorder dumps,\ncompared by sequence number", "L6 §2, exercise 1"),
        ],
    },
    {
        "failure": "wrong result",
        "test": "the job finishes,\nbut the numbers are off",
        "leaves": [
            ("replicas differ from each other", "all-gather a checksum of the parameters", "L6 §1 load-after-wrap, exercise 3"),
            ("ranks agree, one process does not", "one process on the global batch as reference\n(DETAIL misses same-shaped swaps)", "L6 §1 order-swap"),
            ("another N differs in the last digits", "not a bug: reduction order;\na tolerance from the arithmetic", "L6 §3"),
        ],
    },
    {
        "failure": "crash",
        "test": "a process exits\nwith an error",
        "leaves": [
            (
                "every rank raises at the next iteration",
                "the message; TORCH_DISTRIBUTED_DEBUG=INFO\nnames the parameters without gradients",
                "L6 §1 unused-param, L4 §2.4",
            ),
            (
                "one process dies (exit -9: OOM killer,\n-6: NCCL watchdog, 1: an exception)",
                "torchrun's report: Root Cause rank and exit code;\n@record adds the traceback",
                "L6 §1, restart: L6 §5, lab 7",
            ),
        ],
    },
]


def describe() -> dict:
    return {
        "question": "A distributed job misbehaves: which failure is it?",
        "first": "every wait has a timeout (init_process_group(timeout=...)), so a hang ends as an error saying where each rank waited",
        "branches": [
            {"failure": branch["failure"], "test": branch["test"], "leaves": [{"symptom": s, "tool": t, "shown": w} for s, t, w in branch["leaves"]]}
            for branch in FAILURES
        ],  # fmt: skip
    }


def draw(description: dict):
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    colours = {"hang": "tab:orange", "wrong result": "tab:purple", "crash": "tab:red"}
    rows = sum(len(branch["leaves"]) for branch in description["branches"])
    row_height = 1.0
    fig, ax = plt.subplots(figsize=(15, 0.78 * rows + 1.6))
    top = rows * row_height

    def box(x, y, width, height, text, colour, alpha=0.25, fontsize=8.5, weight="normal"):
        ax.add_patch(FancyBboxPatch((x, y - height / 2), width, height, boxstyle="round,pad=0.03", color=colour, alpha=alpha))
        ax.text(x + width / 2, y, text, ha="center", va="center", fontsize=fontsize, fontweight=weight)

    root_y = top / 2 - 0.5
    box(0.0, root_y, 2.2, 1.4, "the job\nmisbehaves:\nwhich failure?", "grey", fontsize=10, weight="bold")
    row = 0
    for branch in description["branches"]:
        leaves = branch["leaves"]
        ys = [top - (row + i) * row_height - 0.5 for i in range(len(leaves))]
        branch_y = sum(ys) / len(ys)
        colour = colours[branch["failure"]]
        ax.plot([2.2, 2.7], [root_y, branch_y], color="black", linewidth=1)
        box(2.7, branch_y, 2.9, 1.25, f"{branch['failure'].upper()}\n{branch['test']}", colour, alpha=0.35, fontsize=7.5)
        for leaf, y in zip(leaves, ys):
            ax.plot([5.6, 6.0], [branch_y, y], color=colour, linewidth=1)
            box(6.0, y, 3.3, 0.85, leaf["symptom"], colour, alpha=0.15, fontsize=7.5)
            box(9.45, y, 3.9, 0.85, leaf["tool"], "tab:green", alpha=0.15, fontsize=7.5)
            ax.text(13.5, y, leaf["shown"], ha="left", va="center", fontsize=8, color="dimgrey")
        row += len(leaves)
    for x, title in ((7.65, "symptom"), (11.4, "the tool that names the cause"), (14.2, "shown in")):
        ax.text(x, top + 0.1, title, ha="center", va="bottom", fontsize=9, fontweight="bold")
    ax.set_title(f"{description['question']}  (First: {description['first']}.)", fontsize=9.5)
    ax.set(xlim=(-0.1, 16.2), ylim=(-0.2, top + 0.6))
    ax.axis("off")
    return fig
