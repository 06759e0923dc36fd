"""labs/ddp_minimal.py, the DDP script lecture 1 shows on one screen: short, and equal to one process.

The course's central claim, on the script a learner reads first: N ranks that each train on B samples
end on the weights of one process trained on the N*B samples of every rank (its "global batch"),
here on 2 and 3 ranks (3 ranks pad the 1,438 training images to 1,440: the reference pads the same way,
since it reads the very indices each rank's DistributedSampler hands out).
"""

import math
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from ddp_course.compare import max_relative_difference
from ddp_course.data import load_digits
from ddp_course.launch import REPO_ROOT, run_command, run_torchrun
from ddp_course.models import DigitsCNN

SCRIPT = REPO_ROOT / "labs" / "ddp_minimal.py"
EPOCHS, BATCH, LR, SEED = 2, 64, 0.05, 0
# Float32 rounds each operation by up to eps/2 (eps = 1.2e-7). DDP sums the same gradient terms as
# one process, in another order (per rank, then across ranks), so each step's gradient differs by a
# few eps relative, and training carries the difference on: 1e-7 to 1e-5 relative after tens of steps
# between CPUs (COURSE_GUIDE section 5). These runs make 24 (2 ranks) and 16 (3 ranks) steps; we allow
# 1e-4, ten times that spread and still 100 times below a real slip (one step with a gradient that is
# not the global average, e.g. summed instead of averaged, moves the weights by more than 1e-2 relative).
TOLERANCE = 1e-4


def one_process_on_the_global_batch(world_size: int) -> dict[str, torch.Tensor]:
    """One model, one optimizer; each step's batch is the union of the ranks' batches of that step."""
    torch.manual_seed(SEED)  # as the script: seed, then build the model (load_digits draws nothing)
    digits = load_digits()
    model = DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    samplers = [DistributedSampler(digits.train, world_size, rank, shuffle=True, seed=SEED) for rank in range(world_size)]
    images, labels = digits.train.tensors
    for epoch in range(EPOCHS):
        shards = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        for step in range(math.ceil(len(shards[0]) / BATCH)):
            # Every rank's batch has the same size (the sampler pads), so the mean over the union is the
            # average of the ranks' means: exactly what DDP's averaged gradient computes.
            batch = [index for shard in shards for index in shard[step * BATCH : (step + 1) * BATCH]]
            loss = F.cross_entropy(model(images[batch]), labels[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.state_dict()


def test_the_script_fits_on_one_screen():
    assert len(SCRIPT.read_text().splitlines()) <= 80


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_saved_weights_equal_one_process_on_the_global_batch(tmp_path, world_size):
    saved = tmp_path / "weights.pt"
    args = ["--epochs", EPOCHS, "--batch-size", BATCH, "--lr", LR, "--seed", SEED, "--save", saved]
    result = run_torchrun(SCRIPT, args, nproc=world_size, timeout_s=240)
    assert result.ok, result.describe()
    accuracy_lines = [line for line in result.stdout.splitlines() if "held-out accuracy" in line]
    assert len(accuracy_lines) == EPOCHS and accuracy_lines[-1].endswith("/359)"), result.stdout  # rank 0 alone speaks, for all 359
    weights = torch.load(saved, weights_only=True)  # the bare model's keys: it loads without DDP
    DigitsCNN().load_state_dict(weights)
    reference = one_process_on_the_global_batch(world_size)
    assert max_relative_difference(weights, reference) < TOLERANCE
    # The control: the same comparison against one process on a single rank's batch fails by far.
    assert max_relative_difference(weights, one_process_on_the_global_batch(1)) > 100 * TOLERANCE


def test_without_torchrun_it_says_how_to_launch_it():
    result = run_command([sys.executable, str(SCRIPT)], timeout_s=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "ddp_minimal.py: error: launch it with torchrun: torchrun --standalone --nproc_per_node=2 labs/ddp_minimal.py"
    )
