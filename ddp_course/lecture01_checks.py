"""Lecture 1's code that a reader does not need to read: the exercise checks and the communication calculator.

A check is one call in the notebook, `check_exercise_1(rank_token_loss)`: it builds a case, runs the
learner's function on every virtual rank, compares the result with one process, and prints its
verdict on the last line ("exercise N: correct", "... not yet", or "... not solved yet ..." while the
function still raises NotImplementedError). The optional notebook "Beyond data parallelism" checks its
exercise with `check_tensor_parallel_backward(rank_backward)`.

The calculator draws, for one model size P, world size N and gradient precision, the lower-bound time
of one ring all-reduce on each link (one bar per link); `communication_calculator()` is the widget,
whose output follows its sliders. tests/test_lecture01_calculator.py checks its numbers against the
formula and that moving a slider redraws it.
"""

from __future__ import annotations

import base64
import io
import threading

import torch
import torch.nn.functional as F
from torch import nn

from ddp_course.compare import max_relative_difference
from ddp_course.models import DigitsCNN
from ddp_course.seeding import seed_everything
from ddp_course.self_check import Question

# --- the self-check (the end of the Summary) -------------------------------------------------------

# Lab 3's defaults (32 per rank, learning rate 0.05, 2 ranks) moved to 8 GPUs with 2 accumulation
# steps: the global batch goes from 64 to 512, so the linear scaling rule multiplies the rate by 8.
SELF_CHECK = Question(
    name="self-check",
    expected=0.4,
    why="the global batch k*N*B grows from 1*2*32 = 64 to 2*8*32 = 512, 8 times, so 0.05 x 8 = 0.4",
    hint="reread section 8 (effective batch size and the learning rate): which batch does the rule scale with, "
    "and what makes it up?",
)

# --- exercise checks ------------------------------------------------------------------------------


def check_exercise_1(rank_token_loss) -> None:
    """Exercise 1: DDP's average of each rank's rank_token_loss gradient = the global per-token mean's."""
    torch.manual_seed(0)
    world_size, length, vocab = 2, 6, 5
    # float64: a right answer agrees to about 1e-16, far inside allclose's tolerance, on any CPU
    token_model = nn.Linear(4, vocab).double()  # a stand-in language model: token features -> logits
    features = torch.randn(world_size, 3, length, 4).double()  # (rank, sequences, length, features)
    targets = torch.randint(vocab, (world_size, 3, length))
    mask = torch.zeros(world_size, 3, length, dtype=torch.bool)
    mask[0, :, :5] = True  # rank 0: 15 real tokens
    mask[1, 0, :2] = True  # rank 1: 2 real tokens
    global_real_tokens = int(mask.sum())

    def token_losses(rank):
        logits = token_model(features[rank])  # (sequences, length, vocab)
        return F.cross_entropy(logits.transpose(1, 2), targets[rank], reduction="none")

    def gradient(loss):
        token_model.zero_grad()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in token_model.parameters()])

    reference = gradient(sum((token_losses(r) * mask[r]).sum() for r in range(world_size)) / global_real_tokens)
    try:
        per_rank = [gradient(rank_token_loss(token_losses(r), mask[r], global_real_tokens, world_size))
                    for r in range(world_size)]  # fmt: skip
    except NotImplementedError:
        print("exercise 1: not solved yet - fill in rank_token_loss above")
        return
    ddp_gradient = torch.stack(per_rank).mean(dim=0)  # what DDP's all-reduce gives every rank
    naive = torch.stack([gradient((token_losses(r) * mask[r]).sum() / mask[r].sum()) for r in range(world_size)])
    print("naive per-rank token mean equals the global token mean:", torch.allclose(naive.mean(dim=0), reference))
    print("exercise 1:", "correct" if torch.allclose(ddp_gradient, reference, atol=1e-6) else "not yet")


def check_exercise_2(accumulate_gradients) -> None:
    """Exercise 2: 2 virtual ranks x micro-batches of 10 and 6 = one process on the global batch of 32.

    The micro-batches differ in size, as an epoch's last one does: dividing each micro-batch's mean
    loss by their number then weights a sample of the short one more than one of the long one, and
    fails; every sample must count once in the mean.
    """
    micro_batch_sizes, world_size = [10, 6], 2
    per_rank_batch = sum(micro_batch_sizes)
    global_batch = per_rank_batch * world_size
    seed_everything(0)
    images, labels = torch.randn(global_batch, 1, 8, 8), torch.randint(10, (global_batch,))  # digit-shaped
    # float64: a right answer agrees to about 1e-15, so the 1e-5 below only separates right from wrong
    images, model = images.double(), DigitsCNN().double()

    model.zero_grad()
    F.cross_entropy(model(images), labels).backward()  # one process, global batch of 32
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}

    rank_gradients = []
    for rank_images, rank_labels in zip(images.chunk(world_size), labels.chunk(world_size)):
        micro_batches = list(zip(rank_images.split(micro_batch_sizes), rank_labels.split(micro_batch_sizes)))
        try:
            accumulate_gradients(model, micro_batches)
        except NotImplementedError:
            print("exercise 2: not solved yet - fill in accumulate_gradients above")
            return
        rank_gradients.append({name: p.grad.clone() for name, p in model.named_parameters()})
    averaged = {name: (rank_gradients[0][name] + rank_gradients[1][name]) / 2 for name in reference}
    print(f"global batch = ({' + '.join(map(str, micro_batch_sizes))}) x {world_size} = {global_batch}")
    ok = max_relative_difference(averaged, reference) < 1e-5
    print("exercise 2:", "correct" if ok else "not yet")


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
    same_weights = torch.allclose(torch.cat(grads_w1, dim=1), reference_w1) and torch.allclose(
        torch.cat(grads_w2, dim=0), reference_w2
    )
    print("every rank's grad_x equals autograd's:", same_x)
    print("the ranks' weight-gradient shards, put together, equal autograd's:", same_weights)
    print(f"all-reduces in the backward pass: {len(calls)}, of shapes {calls}")
    print("exercise 1:", "correct" if same_x and same_weights and len(calls) <= 1 else "not yet")


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
    ax.set(yscale="log", ylabel="ms per step (lower bound)", ylim=(min(times.values()) / 3, max(times.values()) * 5),
           title=f"P = {parameters / 1e6:,.4g} M, N = {world_size}, {precision}: {sent_mb:,.4g} MB sent per GPU")
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
