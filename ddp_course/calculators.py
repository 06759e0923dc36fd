"""Lectures 5a and 5b's cost models and the two calculators built on them.

The formulas are the lecture's, and the lecture checks each against a measurement: the all-reduce
and step model against lab 5's reference steps (section 3), the memory terms against measured peaks
(section 8). tests/test_calculators.py holds the numbers to the formulas and checks that each
calculator's output follows its sliders.

Notation (README): $P$ parameters, $B$ per-rank batch, $N$ ranks, $S$ bytes per all-reduce, a link is
(alpha in seconds, bandwidth in bytes/s). Reference GPU: NVIDIA H100 SXM (80 GB).

    step_time(parameters, flops_per_step, gpus_per_node, nodes, link_name, overlap) -> dict of seconds
    memory_breakdown(parameters, batch, activation_bytes_per_sample, ...)        -> dict of bytes
    step_time_calculator(), memory_calculator()                                   -> ipywidgets boxes
"""

from __future__ import annotations

import io
import math

# Assumptions with sources (lecture 5a, section 3). Replace them with your hardware's.
H100_BF16_FLOPS = 989e12  # dense bf16 tensor-core peak, NVIDIA H100 SXM datasheet
H100_MEMORY_BYTES = 80e9  # H100 SXM: 80 GB of HBM3
MFU = 0.40  # assumed model FLOPs utilization of a well-tuned job
EFFICIENCY_OF_LINKS = 0.8  # assumed share of nominal bandwidth an all-reduce achieves
NVLINK = (1e-6, EFFICIENCY_OF_LINKS * 450e9)  # NVLink 4: 450 GB/s per direction per GPU, ~1 us
NETWORK_ALPHA_S = 5e-6  # per message across nodes (RDMA)
BUCKET_BYTES = 25 * 2**20  # DDP's bucket size after its first, small bucket
BACKWARD_SHARE = 2 / 3  # backward is about twice the forward (lecture 5a, section 1)

# Links between nodes: (Gb/s of one network card, how many GPUs share that card).
LINKS = {"100 Gb/s per node": (100, "node"), "400 Gb/s per node": (400, "node"), "400 Gb/s per GPU": (400, 1)}

OPTIMIZER_STATE_BYTES = {"SGD": 0, "SGD + momentum": 4, "Adam": 8}  # fp32 state per parameter


def allreduce_seconds(n_bytes, gpus_per_node, nodes, inside, between=None, buckets=1):
    """Ring all-reduce of n_bytes per rank (lecture 2): inside one node, or hierarchical across nodes.

    inside / between: (alpha_s, bandwidth_bytes_per_s) of the links in a node / of each GPU's share of
    the network. Hierarchical (nodes > 1): reduce-scatter + all-gather inside each node (one ring's
    worth of traffic), and a ring across nodes on each GPU's 1/gpus_per_node shard. Each of `buckets`
    all-reduces pays the latency terms once.
    """
    alpha_in, bandwidth_in = inside
    within = buckets * 2 * (gpus_per_node - 1) * alpha_in + 2 * (gpus_per_node - 1) / gpus_per_node * n_bytes / bandwidth_in
    if nodes == 1:
        return within
    alpha_net, bandwidth_net = between
    shard = n_bytes / gpus_per_node
    return within + buckets * 2 * (nodes - 1) * alpha_net + 2 * (nodes - 1) / nodes * shard / bandwidth_net


def exposed_seconds(allreduce_s, backward_s, overlap):
    """The all-reduce time left after hiding up to overlap x backward behind it."""
    return max(0.0, allreduce_s - overlap * backward_s)


def network_link(link_name, gpus_per_node):
    """(alpha, bytes/s) of one GPU's share of the network: a card's nominal rate x 80%, split among
    the GPUs that share it."""
    gbit_per_s, shared_by = LINKS[link_name]
    sharing = gpus_per_node if shared_by == "node" else shared_by
    return NETWORK_ALPHA_S, EFFICIENCY_OF_LINKS * gbit_per_s * 1e9 / 8 / sharing


def gpt2_parameters(layers=12, width=768, context=1024, vocabulary=50257):
    """GPT-2's parameter count from its shape: token and position embeddings (the output layer shares the
    token embedding), and per layer attention (4 d^2 + 4 d), MLP (8 d^2 + 5 d) and two LayerNorms (4 d)."""
    per_layer = 12 * width**2 + 13 * width
    return vocabulary * width + context * width + layers * per_layer + 2 * width  # + the final LayerNorm


def step_time(parameters, flops_per_step, gpus_per_node, nodes, link_name="400 Gb/s per node", overlap=1.0):
    """Predicted seconds of one step on H100s: compute, the fp32 gradient all-reduce, its exposed part.

    compute = FLOPs per GPU per step / (MFU x peak); the all-reduce of 4P bytes in 25 MiB buckets;
    up to overlap x backward (2/3 of compute) hides it. efficiency = compute / step.
    """
    compute_s = flops_per_step / (MFU * H100_BF16_FLOPS)
    gradient_bytes = 4 * parameters  # gradients stay fp32 under mixed precision
    between = network_link(link_name, gpus_per_node) if nodes > 1 else None
    ring_s = allreduce_seconds(gradient_bytes, gpus_per_node, nodes, NVLINK, between, buckets=math.ceil(gradient_bytes / BUCKET_BYTES))
    exposed_s = exposed_seconds(ring_s, BACKWARD_SHARE * compute_s, overlap)
    step_s = compute_s + exposed_s
    return {"compute_s": compute_s, "allreduce_s": ring_s, "exposed_s": exposed_s, "step_s": step_s, "efficiency": compute_s / step_s}


def memory_breakdown(
    parameters, batch, activation_bytes_per_sample, optimizer="Adam", amp=False, checkpoint_segments=0, layers=24, zero1_ranks=1, bucket_view=False
):
    """Bytes one DDP rank holds, term by term (lecture 5b, section 3; fp32 weights, gradients and state).

    activation_bytes_per_sample: what autograd saves for backward per sample in fp32, for `layers`
    equal layers. amp: activations in 16 bits (half) plus a 16-bit copy of the weights autocast casts.
    checkpoint_segments s > 0: only the s segment inputs are kept (s/layers of the activations) plus one
    segment's recomputed activations (1/s). zero1_ranks: the optimizer state is sharded over them.
    bucket_view: DDP built with gradient_as_bucket_view=True (no second copy of the gradients).
    """
    activations = activation_bytes_per_sample * batch
    if checkpoint_segments:
        activations *= min(1.0, checkpoint_segments / layers) + 1 / checkpoint_segments
    if amp:
        activations /= 2
    return {
        "weights": 4 * parameters,
        "gradients": 4 * parameters,
        "DDP buckets": 0 if bucket_view else 4 * parameters,
        "optimizer state": OPTIMIZER_STATE_BYTES[optimizer] * parameters / zero1_ranks,
        "16-bit weight copies": 2 * parameters if amp else 0,
        "activations": activations,
    }


# --- figures: the static one before each calculator and the calculator's own are drawn by these ---


def draw_step_bars(ax, predictions):
    """Stacked bars, one per {label: step_time(...)}: compute, then the exposed all-reduce (ms)."""
    labels = list(predictions)
    compute = [predictions[k]["compute_s"] * 1e3 for k in labels]
    exposed = [predictions[k]["exposed_s"] * 1e3 for k in labels]
    ax.barh(labels, compute, color="tab:blue", label="compute")
    ax.barh(labels, exposed, left=compute, color="tab:red", label="exposed all-reduce")
    for y, k in enumerate(labels):
        ax.text(compute[y] + exposed[y], y, f" {predictions[k]['efficiency']:.0%}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="ms per step (efficiency = compute / step)")
    ax.legend(fontsize=8, loc="lower right")


def draw_memory_bars(ax, breakdowns, memory_bytes=H100_MEMORY_BYTES):
    """Stacked bars, one per {label: memory_breakdown(...)}, against the GPU's memory (GB)."""
    labels = list(breakdowns)
    left = [0.0] * len(labels)
    for term in next(iter(breakdowns.values())):
        sizes = [breakdowns[k][term] / 1e9 for k in labels]
        ax.barh(labels, sizes, left=left, label=term)
        left = [a + b for a, b in zip(left, sizes)]
    ax.axvline(memory_bytes / 1e9, color="black", ls="--", label=f"H100 SXM: {memory_bytes / 1e9:.0f} GB")
    ax.invert_yaxis()
    ax.set(xlabel="GB per rank")
    ax.legend(fontsize=7, loc="lower right")


# --- calculators: sliders -> the formula -> a text line and the figure, in an Output widget ---


def _show(output, text, draw):
    """Replace output's content with a line of text and a figure drawn by draw(ax)."""
    import matplotlib.pyplot as plt
    from IPython.display import Image

    figure, ax = plt.subplots(figsize=(7, 2.2))
    draw(ax)
    figure.tight_layout()
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=80)
    plt.close(figure)  # shown through the Output widget only, never by the inline backend
    output.outputs = ()
    output.append_stdout(text + "\n")
    output.append_display_data(Image(data=png.getvalue()))


def _calculator(controls, render):
    """A box of controls and an Output that render(**values) -> (text, draw) fills on every change."""
    import ipywidgets as widgets

    output = widgets.Output()

    def update(_=None):
        _show(output, *render(**{name: control.value for name, control in controls.items()}))

    for control in controls.values():
        control.observe(update, names="value")
    update()
    box = widgets.VBox([*controls.values(), output])
    box.controls, box.output = controls, output  # for tests, and for a reader who wants the numbers
    return box


def step_time_calculator():
    """Sliders for parameters, FLOPs per step, GPUs per node, nodes, link and overlap -> step_time()."""
    import ipywidgets as widgets

    style = {"description_width": "150px"}
    controls = {
        "parameters": widgets.FloatLogSlider(value=gpt2_parameters(), base=10, min=7, max=11, description="parameters P", style=style),
        "flops_per_step": widgets.FloatLogSlider(value=7.04e12, base=10, min=11, max=16, description="FLOPs per GPU per step", style=style),
        "gpus_per_node": widgets.IntSlider(value=8, min=1, max=8, description="GPUs per node", style=style),
        "nodes": widgets.IntSlider(value=2, min=1, max=128, description="nodes", style=style),
        "link_name": widgets.Dropdown(options=list(LINKS), value="400 Gb/s per node", description="link between nodes", style=style),
        "overlap": widgets.FloatSlider(value=1.0, min=0.0, max=1.0, step=0.05, description="overlap o", style=style),
    }

    def render(**values):
        t = step_time(**values)
        gpus = values["gpus_per_node"] * values["nodes"]
        text = (
            f"{gpus} GPUs: compute {t['compute_s'] * 1e3:.2f} ms + exposed all-reduce {t['exposed_s'] * 1e3:.2f} ms"
            f" (of {t['allreduce_s'] * 1e3:.2f} ms) = step {t['step_s'] * 1e3:.2f} ms; efficiency {t['efficiency']:.0%}"
        )
        return text, lambda ax: draw_step_bars(ax, {f"{gpus} GPUs": t})

    return _calculator(controls, render)


def memory_calculator():
    """Sliders for P, B, activation bytes per sample, optimizer, AMP, checkpointing, ZeRO-1 -> memory_breakdown()."""
    import ipywidgets as widgets

    style = {"description_width": "190px"}
    controls = {
        "parameters": widgets.FloatLogSlider(value=1.5e9, base=10, min=7, max=11, description="parameters P", style=style),
        "batch": widgets.IntSlider(value=32, min=1, max=256, description="per-rank batch B", style=style),
        "activation_bytes_per_sample": widgets.FloatLogSlider(value=2e9, base=10, min=6, max=11, description="activation bytes per sample", style=style),
        "optimizer": widgets.Dropdown(options=list(OPTIMIZER_STATE_BYTES), value="Adam", description="optimizer", style=style),
        "amp": widgets.Checkbox(value=False, description="AMP (16-bit activations)", style=style),
        "checkpoint_segments": widgets.IntSlider(value=0, min=0, max=48, description="checkpoint segments (0: off)", style=style),
        "layers": widgets.IntSlider(value=48, min=1, max=128, description="layers", style=style),
        "zero1_ranks": widgets.IntSlider(value=1, min=1, max=64, description="ZeRO-1 ranks", style=style),
        "bucket_view": widgets.Checkbox(value=False, description="gradient_as_bucket_view", style=style),
    }

    def render(**values):
        terms = memory_breakdown(**values)
        total = sum(terms.values())
        verdict = "fits" if total <= H100_MEMORY_BYTES else "does NOT fit"
        text = (
            f"{total / 1e9:.1f} GB per rank: {verdict} in an 80 GB H100 ("
            + ", ".join(f"{name} {size / 1e9:.1f}" for name, size in terms.items() if size)
            + " GB)"
        )
        return text, lambda ax: draw_memory_bars(ax, {"this set-up": terms})

    return _calculator(controls, render)
