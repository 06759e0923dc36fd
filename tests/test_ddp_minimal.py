"""labs/ddp_minimal.py, the DDP script lecture 1 shows on one screen: short, and equal to one process.

The course's central claim, on the script a learner reads first: N ranks that each train on B samples
end on the weights of one process trained on the N*B samples of every rank (its "global batch"),
here on 2 and 3 ranks (3 ranks pad the 1,438 training images to 1,440: the reference pads the same way,
since it reads the very indices each rank's DistributedSampler hands out).

The 2- and 3-rank launches start together (the `jobs` fixture): each is mostly start-up, and one
job's rendezvous and waits overlap the other's CPU, as do the one-process references computed here.
"""

import functools
import math
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from ddp_course.compare import max_relative_difference
from ddp_course.data import load_digits
from ddp_course.launch import REPO_ROOT, import_script, run_torchrun
from ddp_course.models import DigitsCNN

SCRIPT = REPO_ROOT / "labs" / "ddp_minimal.py"
EPOCHS, BATCH, LR, SEED = 2, 64, 0.05, 0
# Float32 rounds each operation by up to eps/2 (eps = 1.2e-7). DDP sums the same gradient terms as
# one process, in another order (per rank, then across ranks), so each step's gradient differs by a
# few eps relative, and training carries the difference on: 1e-7 to 1e-5 relative after tens of steps
# between CPUs (CONTRIBUTING.md, "Portable outputs"). These runs make 24 (2 ranks) and 16 (3 ranks) steps; we allow
# 1e-4, ten times that spread and still 100 times below a real slip (one step with a gradient that is
# not the global average, e.g. summed instead of averaged, moves the weights by more than 1e-2 relative).
TOLERANCE = 1e-4
# The printed loss has 4 decimals (+-5e-5) and the same float32 drift; a loss of rank 0's samples alone
# differs from the job's by 5e-3 to 2e-2 in these runs (the test checks that it is more than 10x this).
LOSS_TOLERANCE = 2e-4


@functools.cache  # the 1-process control serves both world sizes; callers only read the results
def one_process_on_the_global_batch(world_size: int) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """One model, one optimizer; each step's batch is the union of the ranks' batches of that step.

    Returns the final weights, each epoch's mean train loss over every rank's samples (what the
    job must print) and over rank 0's samples alone (what a script that forgets the all-reduce prints).
    """
    torch.manual_seed(SEED)  # as the script: seed, then build the model (load_digits draws nothing)
    digits = load_digits()
    model = DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    samplers = [DistributedSampler(digits.train, world_size, rank, shuffle=True, seed=SEED) for rank in range(world_size)]
    images, labels = digits.train.tensors
    job_losses, rank0_losses = [], []
    for epoch in range(EPOCHS):
        shards = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        job, rank0 = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)  # [sum of losses, samples]
        for step in range(math.ceil(len(shards[0]) / BATCH)):
            # Every rank's batch has the same size (the sampler pads), so the mean over the union is the
            # average of the ranks' means: exactly what DDP's averaged gradient computes.
            batch = [index for shard in shards for index in shard[step * BATCH : (step + 1) * BATCH]]
            per_sample = F.cross_entropy(model(images[batch]), labels[batch], reduction="none")
            loss = per_sample.mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            first = len(shards[0][step * BATCH : (step + 1) * BATCH])  # rank 0's samples come first in the union
            job += torch.tensor([float(per_sample.detach().sum()), len(batch)], dtype=torch.float64)
            rank0 += torch.tensor([float(per_sample[:first].detach().sum()), first], dtype=torch.float64)
        job_losses.append(float(job[0] / job[1]))
        rank0_losses.append(float(rank0[0] / rank0[1]))
    return model.state_dict(), job_losses, rank0_losses


def test_the_script_fits_on_one_screen_with_its_gloo_workaround_marked():
    """At most 80 lines; the gloo exit workaround's lines (the early import, the gc.collect()) are in or
    beside a block marked NOT PART OF DDP, so a reader tells DDP from a torch quirk; it scores model.module."""
    lines = SCRIPT.read_text().splitlines()
    assert len(lines) <= 80
    markers = [number for number, line in enumerate(lines) if "NOT PART OF DDP" in line]
    code = {number: line.split("#")[0] for number, line in enumerate(lines)}
    workaround = [number for number, line in code.items() if "gc.collect()" in line or line.startswith("import torch.distributed.nn.functional")]
    assert len(workaround) == 2 and all(any(0 <= number - marker <= 3 for marker in markers) for number in workaround), (markers, workaround)
    assert "model.module.eval()" in SCRIPT.read_text()  # the bare model is scored (DDP's forward can broadcast buffers)


WORLD_SIZES = [2, 3]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """{world size: (Future of RunResult, path of its --save file)}, every launch started at once; no relaunch."""
    with ThreadPoolExecutor(max_workers=len(WORLD_SIZES), thread_name_prefix="ddp_minimal") as pool:
        futures = {}
        for world_size in WORLD_SIZES:
            saved = tmp_path_factory.mktemp(f"ranks{world_size}") / "weights.pt"
            args = ["--epochs", EPOCHS, "--batch-size", BATCH, "--lr", LR, "--seed", SEED, "--save", saved]
            futures[world_size] = pool.submit(run_torchrun, SCRIPT, args, nproc=world_size, timeout_s=240), saved
        yield futures  # leaving the block waits for every job, also when a test failed


# The timeout covers waiting for both jobs (run alone, a test's teardown waits for the other job too).
@pytest.mark.timeout(400)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_saved_weights_equal_one_process_on_the_global_batch(jobs, world_size):
    future, saved = jobs[world_size]
    # Computed while the jobs run: this process is otherwise idle waiting for them.
    reference, job_losses, rank0_losses = one_process_on_the_global_batch(world_size)
    result = future.result()
    assert result.ok, result.describe()
    accuracy_lines = [line for line in result.stdout.splitlines() if "held-out accuracy" in line]
    assert len(accuracy_lines) == EPOCHS and accuracy_lines[-1].endswith("/359)"), result.stdout  # rank 0 alone speaks, for all 359
    weights = torch.load(saved, weights_only=True)  # the bare model's keys: it loads without DDP
    DigitsCNN().load_state_dict(weights)
    assert max_relative_difference(weights, reference) < TOLERANCE
    # The control: the same comparison against one process on a single rank's batch fails by far.
    assert max_relative_difference(weights, one_process_on_the_global_batch(1)[0]) > 100 * TOLERANCE
    # The printed train loss is the job's (all-reduced over every rank's samples), to its 4 printed
    # decimals plus rounding drift (LOSS_TOLERANCE); rank 0's own samples give a loss further off.
    printed = [float(line.split("train loss ")[1].split(",")[0]) for line in accuracy_lines]
    assert all(abs(p - job) < LOSS_TOLERANCE for p, job in zip(printed, job_losses, strict=True)), (printed, job_losses)
    assert max(abs(job - rank0) for job, rank0 in zip(job_losses, rank0_losses)) > 10 * LOSS_TOLERANCE, (job_losses, rank0_losses)


def test_without_torchrun_it_says_how_to_launch_it(monkeypatch, capsys):
    """`python labs/ddp_minimal.py`, in this process: its main() sees no torchrun variables.

    The launches above run the same file under torchrun; this path needs no second process (a
    `python` launch would pay a torch import for one line). A parser.error exits with status 2 and
    prints the usage and one error line; any other exception (a traceback for a user mistake) fails here.
    """
    for variable in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(sys, "argv", [str(SCRIPT)])  # argparse names the program after argv[0], as `python` does
    ddp_minimal = import_script(SCRIPT)
    with pytest.raises(SystemExit) as stopped:
        ddp_minimal.main()
    assert stopped.value.code == 2
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == ("ddp_minimal.py: error: launch it with torchrun: torchrun --standalone --nproc_per_node=2 labs/ddp_minimal.py")
