"""Checks for lecture 3's exercises (lectures/03_samplers.ipynb): one call each, with the learner's answer.

    check_exercise_1(rank_eval_sums)
    check_exercise_2(resume_shard)
    check_exercise_3(BlockDistributedSampler)

Each prints its verdict as its last line: "exercise N: correct", "exercise N: not yet" (a property
failed), or "exercise N: not solved yet - fill in NAME above" while the answer still raises
NotImplementedError. Ranks are virtual: each check builds every rank's sampler and loader in this
process, which is exactly what the real ranks would compute (DistributedSampler needs no messages).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ddp_course.self_check import Question

# The self-check at the end of the Summary: 3 nodes x 4 processes, each sampler built with
# rank=LOCAL_RANK and num_replicas=WORLD_SIZE = 12, on 1,438 samples. LOCAL_RANK is 0-3 on every node,
# so only shards 0-3 of 12 are read (each by 3 processes): 4 x 120 = 480 samples; 958 are never read.
SELF_CHECK = Question(
    name="self-check",
    expected=100 * 958 / 1438,  # 66.6 %
    why="LOCAL_RANK is 0-3 on every node, so only 4 of the 12 shards (4 x 120 = 480 samples) are read, each "
    "3 times: 958 of 1,438, about two thirds, are never read",
    hint="reread section 4 (rank and world-size mismatches): which shards do the 12 processes ask for, and how many of the 12 does nobody ask for?",
)


def _not_solved(number: int, name: str) -> None:
    print(f"exercise {number}: not solved yet - fill in {name} above")


def _verdict(number: int, ok: bool) -> None:
    print(f"exercise {number}:", "correct" if ok else "not yet")


def check_exercise_1(rank_eval_sums) -> None:
    """Summed over every rank, [correct, scored, summed loss] equals one process scoring each held-out digit once."""
    from ddp_course.data import load_digits
    from ddp_course.models import DigitsCNN
    from ddp_course.seeding import seed_everything

    seed_everything(0)
    model = DigitsCNN().double().eval()  # untrained: plenty of wrong answers, so padding changes the counts
    images, labels = load_digits().test.tensors
    test = TensorDataset(images.double(), labels)
    n = len(test)
    with torch.no_grad():
        logits = model(images.double())  # one process, every held-out sample once
    one_process = [int((logits.argmax(dim=1) == labels).sum()), n, float(F.cross_entropy(logits, labels, reduction="sum"))]
    # Tolerance on the summed loss: float64 eps x (n terms summed) x (1,024, the longest dot product of the
    # forward pass); rounding errors grow at most linearly with the number of terms (Higham 2002, ch. 3).
    tolerance = torch.finfo(torch.float64).eps * n * 1024
    ok = True
    for world_size, batch_size, epoch in [(1, 64, 0), (2, 64, 1), (3, 50, 2), (8, 16, 3), (64, 4, 4), (64, 5, 5)]:
        sums = torch.zeros(3, dtype=torch.float64)  # what the all-reduce of the ranks' sums gives
        for rank in range(world_size):
            sampler = DistributedSampler(test, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            try:
                sums += rank_eval_sums(model, DataLoader(test, batch_size=batch_size, sampler=sampler), rank, world_size, n)
            except NotImplementedError:
                return _not_solved(1, "rank_eval_sums")
        ok = ok and sums[:2].tolist() == one_process[:2]
        ok = ok and abs(float(sums[2]) - one_process[2]) <= tolerance * one_process[2]
    _verdict(1, ok)


def check_exercise_2(resume_shard) -> None:
    """After a restart on another world size: nothing skipped, nothing twice, balanced, one process's order."""
    try:
        resume_shard(10, 0, 0, 2, 2, 1, 3, 0)
    except NotImplementedError:
        return _not_solved(2, "resume_shard")
    ok = True
    # (n, seed, epoch, old world size, batch per rank, steps done, new world size); the last case stops
    # after the final (padded) step of the epoch: nothing is left to read
    for n, seed, epoch, old, batch, steps, new in [
        (50, 5, 4, 3, 4, 3, 2),
        (50, 5, 4, 2, 4, 3, 3),
        (101, 0, 1, 3, 5, 4, 8),
        (37, 2, 0, 8, 2, 2, 3),
        (37, 2, 0, 4, 3, 1, 1),
        (20, 1, 3, 4, 2, 3, 2),
    ]:
        dataset = TensorDataset(torch.arange(n))
        read_before = []  # what the old ranks' loaders delivered in the first `steps` steps
        for rank in range(old):
            sampler = DistributedSampler(dataset, num_replicas=old, rank=rank, shuffle=True, seed=seed)
            sampler.set_epoch(epoch)
            batches = [batch_ids.tolist() for (batch_ids,) in DataLoader(dataset, batch_size=batch, sampler=sampler)]
            read_before += [i for ids in batches[:steps] for i in ids]
        shards = [resume_shard(n, seed, epoch, old, batch, steps, new, rank) for rank in range(new)]
        read_after = [i for shard in shards for i in shard]
        ok = ok and set(read_before) | set(read_after) == set(range(n))  # nothing skipped
        ok = ok and len(read_after) == len(set(read_after)) and not set(read_after) & set(read_before)  # nothing twice
        ok = ok and max(map(len, shards)) - min(map(len, shards)) <= 1  # balanced
        # the order: step by step, rank by rank, the new ranks read what one process reads next
        one_process = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
        one_process.set_epoch(epoch)
        interleaved = [shard[j] for j in range(max(map(len, shards), default=0)) for shard in shards if j < len(shard)]
        ok = ok and interleaved == list(one_process)[n - len(interleaved) :]
    _verdict(2, ok)


def files_opened(indices, block_size: int) -> int:
    """How many files (blocks of block_size consecutive samples) a list of sample ids touches."""
    return len({i // block_size for i in indices})


def check_exercise_3(BlockDistributedSampler) -> None:  # noqa: N803 - the learner's class
    """DistributedSampler's guarantees, few files per rank, a plan that changes with the epoch and only with it."""
    n, block_size, world_size = 1000, 50, 4
    torch_shard = list(DistributedSampler(range(n), num_replicas=world_size, rank=0, shuffle=True, seed=0))
    print(
        f"DistributedSampler, {n} samples in {n // block_size} files, {world_size} ranks: "
        f"rank 0 opens {files_opened(torch_shard, block_size)} files for {len(torch_shard)} samples"
    )
    ok = True
    try:
        for n, block_size, world_size in [(1000, 50, 4), (1000, 50, 3), (360, 8, 8), (60, 20, 1), (64, 4, 5)]:
            plans = {}  # (seed, epoch) -> every rank's indices
            for seed, epoch in [(0, 0), (0, 1), (3, 0)]:
                torch.manual_seed(seed + epoch + 1)  # a sampler must not depend on the global random state
                shards = []
                for rank in range(world_size):
                    sampler = BlockDistributedSampler(n, block_size, world_size, rank, seed=seed)
                    sampler.set_epoch(epoch)
                    shards.append(list(sampler))
                    ok = ok and len(sampler) == len(shards[-1]) == math.ceil(n / world_size)
                    ok = ok and files_opened(shards[-1], block_size) <= math.ceil(len(sampler) / block_size) + 2
                reads = [i for shard in shards for i in shard]
                ok = ok and set(reads) == set(range(n)) and len(reads) - n <= world_size - 1
                plans[seed, epoch] = shards
            ok = ok and plans[0, 0] != plans[0, 1] and plans[0, 0] != plans[3, 0]  # the plan changes
            again = BlockDistributedSampler(n, block_size, world_size, world_size - 1, seed=0)
            again.set_epoch(1)
            ok = ok and list(again) == plans[0, 1][-1]  # and is reproducible
    except NotImplementedError:
        return _not_solved(3, "BlockDistributedSampler")
    _verdict(3, ok)


def draw_coverage(counts: torch.Tensor, title: str, ax) -> None:
    """Section 4's heat-map of a (ranks, n) read-count table: rows are the ranks, then their total; columns
    the sample ids. A correct epoch has a total row of ones (anything else is printed red)."""
    table = torch.cat([counts, counts.sum(dim=0, keepdim=True)])
    ranks, n = counts.shape
    ax.imshow(table, cmap="Blues", vmin=0, vmax=3, aspect="auto")
    for row in range(table.shape[0]):
        for sample in range(n):
            value = int(table[row, sample])
            is_total = row == ranks
            colour = "red" if is_total and value != 1 else "black"
            ax.text(sample, row, str(value), ha="center", va="center", fontsize=7, color=colour,
                    fontweight="bold" if is_total else "normal")  # fmt: skip
    ax.set_yticks(range(table.shape[0]), [f"rank {r}" for r in range(ranks)] + ["total"], fontsize=8)
    ax.set_xticks(range(n), range(n), fontsize=7)
    ax.set_xlabel("sample id", fontsize=8)
    ax.set_title(title, fontsize=9)
