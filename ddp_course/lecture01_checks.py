"""Lecture 1's code that a reader does not need to read: the exercise checks and the communication calculator.

A check is one call in the notebook, `check_exercise_1(accumulate_step)`: it builds a case, runs the
learner's function on every virtual rank, compares the result with one process, and prints its
verdict on the last line ("exercise N: correct", "... not yet - <why>", or "... not solved yet ..." while the
function still raises NotImplementedError). The optional notebook "Beyond data parallelism" checks its
exercise with `check_tensor_parallel_backward(rank_backward)`.

Sections 2 and 3 draw their figures with `draw_gradient_arrows` and `draw_gaps` (the cells print the
numbers a learner reads; only the drawing is here).

The calculator draws, for one model size P, world size N and gradient precision, the lower-bound time
of one ring all-reduce on each link (one bar per link); `communication_calculator()` is the widget,
whose output follows its sliders. tests/test_lecture01_calculator.py checks its numbers against the
formula and that moving a slider redraws it.
"""

from __future__ import annotations

import base64
import copy
import io
import threading

import torch
import torch.nn.functional as F
from torch import nn

from ddp_course.self_check import Question

# --- the self-check (the end of the Summary) -------------------------------------------------------

# Lab 3's defaults (32 per rank, learning rate 0.05, 2 ranks) moved to 8 GPUs with 2 accumulation
# steps: the global batch goes from 64 to 512, so the linear scaling rule multiplies the rate by 8.
SELF_CHECK = Question(
    name="self-check",
    expected=0.4,
    why="the global batch k*N*B grows from 1*2*32 = 64 to 2*8*32 = 512, 8 times, so 0.05 x 8 = 0.4",
    hint="reread section 8 (effective batch size and the learning rate): which batch does the rule scale with, and what makes it up?",
)

# --- exercise checks ------------------------------------------------------------------------------


# How long a virtual rank waits in all_reduce for the others: a right answer's ranks meet within
# milliseconds; a rank that never calls makes the others give up after this (tests shorten it).
EXERCISE_1_WAIT_S = 5.0


def check_exercise_1(accumulate_step) -> None:
    """Exercise 1: the last step of an epoch, 2 virtual ranks x 2 micro-batches of padded sequences.

    The four micro-batches hold 15, 4, 6 and 2 real tokens: each rank's loss must be its real tokens'
    summed loss over the GLOBAL count (which needs one all-reduce, before the first backward) times the
    world size (DDP's mean divides by it). Runs each rank in a thread (`run_virtual_ranks`, the optional
    notebook's harness), averages the ranks' .grad as DDP's all-reduce does, and compares with one process
    on every real token. A FAIL names the concept: the tokens' weights, the scale, the number of
    backward() calls, or ranks that disagree on the collectives.
    """
    torch.manual_seed(0)
    world_size, sequences, length, features, vocab = 2, 3, 6, 4, 5
    real_per_sequence = {(0, 0): [6, 6, 3], (0, 1): [4, 0, 0], (1, 0): [3, 2, 1], (1, 1): [2, 0, 0]}  # (rank, micro)
    # float64: a right answer agrees to about 1e-16, far inside allclose's tolerance, on any CPU
    token_model = nn.Linear(features, vocab).double()  # a stand-in language model: token features -> logits
    rank_micro_batches = []
    for rank in range(world_size):
        micro_batches = []
        for micro in range(2):
            inputs = torch.randn(sequences, length, features, dtype=torch.float64)
            targets = torch.randint(vocab, (sequences, length))
            mask = torch.arange(length) < torch.tensor(real_per_sequence[rank, micro])[:, None]  # right padding
            micro_batches.append((inputs, targets, mask))
        rank_micro_batches.append(micro_batches)

    def masked_sum(model, inputs, targets, mask):
        return (F.cross_entropy(model(inputs).transpose(1, 2), targets, reduction="none") * mask).sum()

    everything = [batch for micro_batches in rank_micro_batches for batch in micro_batches]
    token_model.zero_grad()
    (sum(masked_sum(token_model, *batch) for batch in everything) / sum(int(m.sum()) for *_, m in everything)).backward()
    reference = torch.cat([p.grad.flatten() for p in token_model.parameters()])

    replicas, backward_calls = [copy.deepcopy(token_model) for _ in range(world_size)], [0] * world_size
    for rank, replica in enumerate(replicas):
        replica.weight.register_hook(lambda grad, rank=rank: backward_calls.__setitem__(rank, backward_calls[rank] + 1))

    def one_rank(replica, micro_batches, all_reduce):
        accumulate_step(replica, micro_batches, world_size, lambda value: all_reduce(torch.as_tensor(value)))

    try:
        run_virtual_ranks(one_rank, list(zip(replicas, rank_micro_batches)), timeout_s=EXERCISE_1_WAIT_S)
    except NotImplementedError:
        print("exercise 1: not solved yet - fill in accumulate_step above")
        return
    except threading.BrokenBarrierError:
        print("exercise 1: not yet - the ranks called all_reduce a different number of times (a real job hangs)")
        return
    counts = ", ".join(f"rank {r}: {' + '.join(str(int(m.sum())) for *_, m in mbs)}" for r, mbs in enumerate(rank_micro_batches))
    print(f"real tokens per micro-batch: {counts}")
    if any(p.grad is None for replica in replicas for p in replica.parameters()):
        print("exercise 1: not yet - no gradient in .grad: call backward() on each micro-batch's loss")
        return
    ddp_gradient = torch.stack([torch.cat([p.grad.flatten() for p in r.parameters()]) for r in replicas]).mean(dim=0)
    if backward_calls != [2] * world_size:
        print(
            f"exercise 1: not yet - backward() ran {backward_calls} times per rank: once per micro-batch, so that "
            "only one micro-batch's activations live at a time"
        )
    elif torch.allclose(ddp_gradient, reference):
        print("exercise 1: correct")
    elif F.cosine_similarity(ddp_gradient, reference, dim=0) > 1 - 1e-9:  # the right direction, the wrong size
        scale = float(ddp_gradient.norm() / reference.norm())
        print(
            f"exercise 1: not yet - the right direction, {scale:.3g} times the right size: which count divides, "
            "and what does DDP's mean divide by (section 5.1)?"
        )
    else:
        print(
            "exercise 1: not yet - the tokens are not weighted equally: which count divides each micro-batch's "
            "sum, and which ranks' tokens does it count (section 5.1)?"
        )


def run_virtual_ranks(rank_function, per_rank_args, timeout_s=10):
    """Run rank_function(*args, all_reduce) for every rank in its own thread.

    Returns the ranks' results and the shape of each all-reduce, in call order. A rank that skips a
    call makes the others time out (an error, like a real collective), instead of hanging forever.
    """
    world_size = len(per_rank_args)
    barrier = threading.Barrier(world_size, timeout=timeout_s)
    inputs, calls, results, errors = [None] * world_size, [], [None] * world_size, []

    def make_all_reduce(rank):
        def all_reduce(tensor):
            inputs[rank] = tensor.detach().clone()
            barrier.wait()  # every rank has put in its tensor
            total = sum(inputs)  # the same order of additions on every rank: identical results
            if rank == 0:
                calls.append(tuple(tensor.shape))
            barrier.wait()  # every rank has its sum before the next call overwrites the inputs
            return total

        return all_reduce

    def run(rank):
        try:
            results[rank] = rank_function(*per_rank_args[rank], make_all_reduce(rank))
        except Exception as error:  # noqa: BLE001 - re-raised below, after every thread has stopped
            errors.append(error)
            barrier.abort()  # release the ranks waiting for this one

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return results, calls


def check_tensor_parallel_backward(rank_backward) -> None:
    """The optional notebook's exercise: 4 threads as ranks, gradients against autograd on the unsplit MLP."""
    torch.manual_seed(0)
    batch, d_model, d_ff, world_size = 3, 8, 32, 4
    # float64: the split changes only the order of additions, so the results agree to float64 rounding
    x, w1, w2, grad_y = (torch.randn(*shape, dtype=torch.float64)
                         for shape in [(batch, d_model), (d_model, d_ff), (d_ff, d_model), (batch, d_model)])  # fmt: skip
    leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
    (F.gelu(leaves[0] @ leaves[1]) @ leaves[2]).backward(grad_y)  # autograd on the unsplit MLP
    reference_x, reference_w1, reference_w2 = (t.grad for t in leaves)

    shards = zip(w1.chunk(world_size, dim=1), w2.chunk(world_size, dim=0))  # columns of w1, rows of w2
    try:
        results, calls = run_virtual_ranks(rank_backward, [(x, w1_r, w2_r, grad_y) for w1_r, w2_r in shards])
    except NotImplementedError:
        print("exercise 1: not solved yet - fill in rank_backward above")
        return
    grads_x, grads_w1, grads_w2 = zip(*results)
    same_x = all(torch.allclose(g, reference_x) for g in grads_x)
    same_weights = torch.allclose(torch.cat(grads_w1, dim=1), reference_w1) and torch.allclose(torch.cat(grads_w2, dim=0), reference_w2)
    print("every rank's grad_x equals autograd's:", same_x)
    print("the ranks' weight-gradient shards, put together, equal autograd's:", same_weights)
    print(f"all-reduces in the backward pass: {len(calls)}, of shapes {calls}")
    print("exercise 1:", "correct" if same_x and same_weights and len(calls) <= 1 else "not yet")


# --- section 2's and section 3's figures (the lecture prints the numbers; these only draw them) --------


def draw_gradient_arrows(rank_gradients, full_batch_gradient, averaged_gradient):
    """Section 2: each rank's 2-d gradient as a grey arrow, the full-batch one as a thick blue arrow and the
    ranks' average as an orange dot on its tip (the figure shows that the average lands exactly there)."""
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=(5, 4))
    for rank, gradient in enumerate(rank_gradients):
        ax.annotate("", xy=gradient.tolist(), xytext=(0, 0), arrowprops=dict(arrowstyle="->", color="tab:gray"))
        ax.text(*gradient.tolist(), f" rank {rank}", color="tab:gray")
    ax.annotate("", xy=full_batch_gradient.tolist(), xytext=(0, 0), arrowprops=dict(arrowstyle="->", lw=3, color="tab:blue"))
    ax.plot(*averaged_gradient.tolist(), "o", color="tab:orange", markersize=10, label=f"average of the {len(rank_gradients)} ranks")
    ax.plot([], [], color="tab:blue", lw=3, label="full-batch gradient")  # a legend entry for the arrow
    ax.set(xlabel="dL/dw[0]", ylabel="dL/dw[1]", title=f"{len(rank_gradients)} virtual ranks, 2 samples each")
    ax.axhline(0, color="k", lw=0.5)
    ax.axvline(0, color="k", lw=0.5)
    ax.legend(loc="upper right")
    corners = torch.stack(list(rank_gradients) + [torch.zeros_like(full_batch_gradient)])  # arrows do not autoscale
    ax.set_xlim(corners[:, 0].min() - 2, corners[:, 0].max() + 4)
    ax.set_ylim(corners[:, 1].min() - 2, corners[:, 1].max() + 2)


def draw_gaps(gaps, tolerance):
    """Section 3: {run: [max relative difference from one process after each step]} on a log scale, with
    the tolerance as a dashed line (DDP's curve stays under it, the control's far above)."""
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=(6, 3.5))
    for label, values in gaps.items():
        ax.semilogy(range(1, len(values) + 1), values, marker=".", label=label)
    ax.axhline(tolerance, color="k", ls="--", lw=1, label=f"tolerance {tolerance:g}")
    ax.set(xlabel="optimizer step", ylabel="max relative difference\nfrom one process, batch 32", ylim=(1e-9, 10))
    ax.legend(fontsize=8)


# --- the communication calculator -----------------------------------------------------------------

# Bandwidth per direction per GPU, bytes/s (beta in the README's notation), for the reference GPU:
# - NVLink 4 on an NVIDIA H100 SXM: 900 GB/s both directions together (H100 datasheet) -> 450 GB/s;
# - PCIe Gen5 x16: 32 GT/s x 16 lanes x 128/130 encoding / 8 bits = 63 GB/s, about 64 GB/s (the H100
#   datasheet's "PCIe Gen5: 128 GB/s" counts both directions; PCI-SIG, PCI Express Base Specification 5.0);
# - 100 Gb/s Ethernet, one card per GPU: 100e9 / 8 = 12.5 GB/s (IEEE 802.3).
LINKS = {"NVLink 4": 450e9, "PCIe Gen5 x16": 64e9, "100 GbE": 12.5e9}
LINK_COLORS = {"NVLink 4": "tab:green", "PCIe Gen5 x16": "tab:blue", "100 GbE": "tab:red"}


def ring_allreduce_bytes_per_gpu(parameters, bytes_per_value, world_size):
    """Bytes each GPU sends (and receives) in one ring all-reduce of the gradient: 2 (N-1)/N x S."""
    payload = parameters * bytes_per_value  # S
    return 2 * (world_size - 1) / world_size * payload


def ring_allreduce_seconds(parameters, bytes_per_value, world_size, bandwidth):
    """Idealised lower bound: the link runs at full bandwidth (bytes/s), no latency, no protocol overhead."""
    return ring_allreduce_bytes_per_gpu(parameters, bytes_per_value, world_size) / bandwidth


def link_milliseconds(parameters, world_size, bytes_per_value=4, links=LINKS):
    """{link: lower-bound milliseconds of one ring all-reduce of the gradient} - the calculator's bars."""
    return {link: ring_allreduce_seconds(parameters, bytes_per_value, world_size, bandwidth) * 1e3
            for link, bandwidth in links.items()}  # fmt: skip


def draw_link_bars(ax, parameters, world_size, bytes_per_value=4):
    """One bar per link: the lower-bound all-reduce time of one step, its value written on the bar."""
    times = link_milliseconds(parameters, world_size, bytes_per_value)
    bars = ax.bar(list(times), list(times.values()), color=[LINK_COLORS[link] for link in times])
    ax.bar_label(bars, labels=[f"{ms:,.3g} ms" for ms in times.values()])
    precision = {4: "float32", 2: "bf16"}.get(bytes_per_value, f"{bytes_per_value} bytes")
    sent_mb = ring_allreduce_bytes_per_gpu(parameters, bytes_per_value, world_size) / 1e6
    ax.set(
        yscale="log",
        ylabel="ms per step (lower bound)",
        ylim=(min(times.values()) / 3, max(times.values()) * 5),
        title=f"P = {parameters / 1e6:,.4g} M, N = {world_size}, {precision}: {sent_mb:,.4g} MB sent per GPU",
    )
    return times


def calculator_summary(parameters, world_size, bytes_per_value):
    """The text beside the calculator's drawing (and what a test reads): every bar's value."""
    times = link_milliseconds(parameters, world_size, bytes_per_value)
    bars = ", ".join(f"{link} {ms:,.4g} ms" for link, ms in times.items())
    return f"P = {parameters / 1e6:,.4g} M, N = {world_size}, {bytes_per_value} bytes per value: {bars}"


def _figure_output(parameters, world_size, bytes_per_value):
    """The calculator's drawing as one Jupyter display output (PNG + its text), made without pyplot or a kernel."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6, 3.2), layout="constrained")
    draw_link_bars(figure.add_subplot(), parameters, world_size, bytes_per_value)
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=80)
    return {
        "output_type": "display_data",
        "data": {"image/png": base64.b64encode(png.getvalue()).decode(), "text/plain": calculator_summary(parameters, world_size, bytes_per_value)},
        "metadata": {},
    }  # fmt: skip


def communication_calculator(millions_of_parameters=124.4, world_size=8, bytes_per_value=4):
    """Sliders for P (millions), N and the gradient precision above an Output that redraws the bars.

    Returns the widget; `.children` = (P slider, N slider, precision, output). The drawing is put into
    the Output's `outputs` directly (no kernel needed to capture it), so a test can move a slider by
    setting its `.value` and read what a browser would now show.
    """
    from ipywidgets import Dropdown, FloatLogSlider, IntSlider, Output, VBox

    millions = FloatLogSlider(value=millions_of_parameters, base=10, min=-1, max=4, step=0.1, description="P (M)")
    ranks = IntSlider(value=world_size, min=2, max=256, description="N (GPUs)")
    precision = Dropdown(options=[("float32", 4), ("bf16", 2)], value=bytes_per_value, description="gradients")
    output = Output()

    def redraw(_change=None):
        output.outputs = (_figure_output(millions.value * 1e6, ranks.value, precision.value),)

    for control in (millions, ranks, precision):
        control.observe(redraw, names="value")
    redraw()
    return VBox([millions, ranks, precision, output])
