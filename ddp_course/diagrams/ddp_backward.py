"""DDP's backward, drawn from a real run: per-parameter hooks -> reducer -> bucket ready -> asynchronous
all-reduce -> the wait at the end of backward() (lecture 4, section 2.2).

What the figure shows is measured, not made up: describe() runs lecture 4's OutOfOrderNet under real
DistributedDataParallel (a gloo group of one process in this process, the same model, flags and logging
hooks as the lecture's 2-rank job, lectures/scripts/ddp_internals_demos.py's demo_launch_order "default"
case) and records its buckets and, in its third iteration, the order of two kinds of event: a
parameter's gradient is ready (a post-accumulate-grad hook) and the reducer launches a bucket's
all-reduce (a communication hook). tests/test_lecture04_demos.py checks that this order is the one both
ranks of the lecture's job logged. Only the order is measured; the widths of the boxes are schematic
(real durations vary from run to run).
"""

from __future__ import annotations

NAME = "ddp_backward"
TITLE = "DDP's backward: hooks mark gradients ready, full buckets are all-reduced while backward goes on, backward() waits at the end"

BUCKET_CAP_MB = 0.005  # lecture 4's launch-order demo: 5 KiB caps, so each layer gets a bucket of its own


def measured_run() -> dict:
    """{"buckets": [[name, ...], ...], "events": [["ready", name] | ["launch", index], ...]} of real DDP.

    The third iteration, after DDP rebuilt its buckets in gradient-ready order (lecture 4, section 2.3).
    """
    import torch

    from ddp_course import lecture04_models as demos
    from ddp_course.lecture04_checks import one_process_group, quiet_stderr

    with one_process_group(), quiet_stderr():
        torch.manual_seed(0)
        ddp = demos.DDP(demos.OutOfOrderNet(), bucket_cap_mb=BUCKET_CAP_MB)
        log = []
        demos.logging_hooks(ddp, log)
        demos.train_steps(ddp, 2, rank=0)
        log.clear()
        demos.train_steps(ddp, 1, rank=0)  # the third iteration: the rebuilt buckets
        buckets = demos.bucket_names(ddp)
        sizes = {name: p.numel() * p.element_size() for name, p in ddp.module.named_parameters()}
        del ddp
    return {"buckets": buckets, "events": [list(event) for event in log], "parameter_bytes": sizes}


def describe() -> dict:
    run = measured_run()
    layers = []  # layers in the order backward computes their gradients
    for kind, name in run["events"]:
        if kind == "ready" and name.split(".")[0] not in layers:
            layers.append(name.split(".")[0])
    return {
        "model": "OutOfOrderNet (lecture 4): head defined first, used last",
        "ddp_flags": f"bucket_cap_mb={BUCKET_CAP_MB}, third iteration (buckets rebuilt in ready order)",
        "buckets": run["buckets"],
        "events": run["events"],
        "parameter_bytes": run["parameter_bytes"],
        "backward_order": layers,
        "lanes": [
            "autograd (main thread): backward computes each layer's gradients, last layer first",
            "per-parameter hook: 'this .grad is ready' -> the reducer copies it into its bucket",
            "reducer: a bucket is complete -> all-reduce it asynchronously, strictly in bucket order",
            "communication (a gloo thread; on NCCL a CUDA stream): the all-reduces run while backward goes on",
        ],
        "end": "backward() returns only after every bucket's all-reduce finished and its averages are in .grad",
        "note": "event order measured on real DDP; box widths schematic",
    }


def draw(description: dict):
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    colours = {"head": "tab:red", "proj": "tab:orange", "hidden": "tab:green", "embed": "tab:blue"}
    lane_y = {"compute": 3.0, "hooks": 2.0, "reducer": 1.0, "comm": 0.0}
    step = 1.0  # x distance between consecutive events (schematic time)

    fig, ax = plt.subplots(figsize=(13, 5.2))
    x, ready_x, launch_x = 0.5, {}, {}
    for kind, name in description["events"]:
        x += step
        if kind == "ready":
            ready_x[name] = x
        else:
            launch_x[name] = x  # name is the bucket's index

    def box(x0, y, width, label, colour, alpha=0.55, fontsize=8):
        ax.add_patch(FancyBboxPatch((x0, y - 0.3), width, 0.6, boxstyle="round,pad=0.02", color=colour, alpha=alpha))
        ax.text(x0 + width / 2, y, label, ha="center", va="center", fontsize=fontsize)

    # Lane 1: backward's computation, layer by layer (each ends when its last gradient is ready).
    for layer in description["backward_order"]:
        mine = [x for name, x in ready_x.items() if name.startswith(layer + ".")]
        box(min(mine) - 0.8, lane_y["compute"], max(mine) - min(mine) + 0.9, f"{layer}: grads", colours[layer])
    # Lane 2: one hook per parameter fires when its gradient is accumulated.
    for name, x0 in ready_x.items():
        ax.plot([x0, x0], [lane_y["compute"] - 0.3, lane_y["hooks"] + 0.15], color="grey", linewidth=0.8)
        ax.plot(x0, lane_y["hooks"], marker="v", color=colours[name.split(".")[0]], markersize=9)
        ax.text(x0, lane_y["hooks"] - 0.28, name, ha="center", va="top", fontsize=6.5, rotation=20)
    # Lane 3: the reducer launches bucket i once it is complete and buckets 0..i-1 are launched.
    for index, x0 in launch_x.items():
        last_ready = max(ready_x[name] for name in description["buckets"][index])
        ax.annotate(
            "",
            xy=(x0, lane_y["reducer"] + 0.3),
            xytext=(last_ready, lane_y["hooks"] - 0.55),
            arrowprops={"arrowstyle": "->", "color": "black", "linewidth": 0.8},
        )
        layers = sorted({name.split(".")[0] for name in description["buckets"][index]})
        box(x0 - 0.45, lane_y["reducer"], 0.9, f"bucket {index}\nready", colours[layers[0]], alpha=0.3, fontsize=7)
    # Lane 4: each all-reduce starts at its launch and runs while backward computes the next layers.
    last_event = x
    for index, x0 in launch_x.items():
        width = 2.6 * step
        box(x0, lane_y["comm"], width, f"all-reduce {index}", "lightgrey", alpha=0.9)
        ax.annotate(
            "", xy=(x0, lane_y["comm"] + 0.3), xytext=(x0, lane_y["reducer"] - 0.3), arrowprops={"arrowstyle": "->", "color": "black", "linewidth": 0.8}
        )
        last_event = max(last_event, x0 + width)
    wait_x = last_event + 0.3
    ax.axvline(wait_x, color="black", linestyle="--", linewidth=1)
    ax.text(wait_x + 0.1, 1.5, "backward() returns:\nevery all-reduce done,\naverages in .grad\n-> optimizer.step()", va="center", fontsize=8)
    backward_done = max(ready_x.values()) + 0.2
    ax.plot([backward_done, wait_x], [lane_y["compute"]] * 2, color="black", linestyle=":", linewidth=1)
    ax.text(
        (backward_done + wait_x) / 2,
        lane_y["compute"] + 0.12,
        "gradients done: waits for the all-reduces",
        ha="center",
        va="bottom",
        fontsize=7.5,
        style="italic",
    )

    titles = ["autograd\n(backward)", "per-parameter\nhooks", "reducer\n(buckets)", "communication\n(async)"]
    for (lane, y), title in zip(lane_y.items(), titles):
        ax.text(-0.2, y, title, ha="right", va="center", fontsize=9, fontweight="bold")
    bucket_text = "   ".join(f"bucket {i}: {', '.join(b)}" for i, b in enumerate(description["buckets"]))
    ax.set_title(f"One DDP backward, as real DDP ran it: {description['model']}\n{bucket_text}", fontsize=9)
    ax.text(0.5, -0.75, f"{description['note']}; {description['ddp_flags']}", fontsize=7, color="dimgrey")
    ax.set(xlim=(-2.6, wait_x + 3.4), ylim=(-0.9, 3.6))
    ax.axis("off")
    return fig
