"""Lab 2: DistributedSampler in real processes - who reads which sample, and exact evaluation metrics.

Launch from the repository root:

    laptop, 2 CPU processes (gloo):  torchrun --standalone --nproc_per_node=2 labs/lab2_sampler.py
    3 processes, bigger skew:         torchrun --standalone --nproc_per_node=3 labs/lab2_sampler.py --eval-size 31
    N GPUs on one machine (NCCL):     torchrun --standalone --nproc_per_node=N labs/lab2_sampler.py
    2 nodes x 8 GPUs (on each node):  torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d \
                                          --rdzv-endpoint=NODE0_HOST:29400 --rdzv-id=lab2 labs/lab2_sampler.py
    watch a check catch a bug:        add --bug same-rank (or wrong-world-size, no-set-epoch, padded-eval)

Every rank builds a real DistributedSampler over a toy dataset whose sample i is the number i
(--dataset-size, default 11), reads its shard through a DataLoader for --epochs epochs, with and
without drop_last, and all_gather_object hands every rank's shards to every rank. Rank 0 prints them
and one PASS/FAIL line per check: one permutation split by stride, no sample read twice except the
padding, every sample read, what drop_last drops, set_epoch reshuffles, the same seed reproduces.
Then a DigitsCNN trained briefly on rank 0 (and broadcast) scores --eval-size held-out digits: as
DistributedSampler pads them (some counted twice), and exactly (all-reduced counts over unpadded
shards), which must equal one process scoring the same samples. Exit status 1 if any check fails.

What you should see with 2 ranks: 11 samples give shards of 6 + 6, so one sample per epoch is
read twice (a different one each epoch); drop_last gives 5 + 5 and drops one. The padded eval
counts 360 answers for 359 digits; the exact count is over 359 and matches one process; 7 PASS lines.
"""

import argparse
import math
import sys
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

from ddp_course.checkpoint import atomic_save, atomic_write_json
from ddp_course.cli import CourseArgumentParser, CourseError, non_negative_int, positive_float, positive_int
from ddp_course.data import load_digits
from ddp_course.distributed import BACKENDS, log, log_error, setup_distributed, teardown_distributed
from ddp_course.models import DigitsCNN
from ddp_course.seeding import seed_everything

BUGS = ("none", "same-rank", "wrong-world-size", "no-set-epoch", "padded-eval")


def parse_args(argv=None) -> argparse.Namespace:
    parser = CourseArgumentParser(prog="lab2_sampler.py", description="Check DistributedSampler in real processes.")
    parser.add_argument("--dataset-size", type=positive_int, default=11, help="samples in the toy dataset")
    parser.add_argument("--epochs", type=positive_int, default=3, help="epochs of shards to read (2 or more)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="sampler seed and model initialization")
    parser.add_argument("--eval-size", type=positive_int, default=359, help="score the first N held-out digits")
    parser.add_argument("--train-steps", type=non_negative_int, default=20, help="SGD steps (batch 32) before eval")
    parser.add_argument("--bug", choices=BUGS, default="none", help="plant a classic mistake; a check must FAIL")
    parser.add_argument("--backend", choices=BACKENDS, default="auto", help="auto: nccl with a GPU per rank, else gloo")
    parser.add_argument("--json", help="rank 0 writes the shards, checks and eval figures here")
    parser.add_argument("--save-model", help="rank 0 writes the evaluated model's state_dict here")
    parser.add_argument("--timeout-s", type=positive_float, default=120.0, help="process-group timeout, seconds")
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error("--epochs must be 2 or more, to see set_epoch reshuffle")
    return args


def make_sampler(dataset, ctx, args, shuffle=True, drop_last=False) -> DistributedSampler:
    """The sampler every rank builds; --bug plants the classic rank and world-size mistakes."""
    num_replicas, rank = ctx.world_size, ctx.rank
    if args.bug == "same-rank":  # e.g. a hard-coded rank=0, or LOCAL_RANK used as the rank on 2 nodes
        rank = 0
    if args.bug == "wrong-world-size":  # e.g. a stale world size: the job expects one process more
        num_replicas += 1
    return DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=args.seed, drop_last=drop_last)


def read_shards(ctx, args, drop_last=False) -> list[list[int]]:
    """The sample ids this rank's DataLoader yields, one list per epoch."""
    dataset = TensorDataset(torch.arange(args.dataset_size))  # sample i is the number i
    sampler = make_sampler(dataset, ctx, args, drop_last=drop_last)
    loader = DataLoader(dataset, batch_size=64, sampler=sampler)  # no shuffle=True: the sampler shuffles
    shards = []
    for epoch in range(args.epochs):
        if args.bug != "no-set-epoch":
            sampler.set_epoch(epoch)  # the permutation is drawn from seed + epoch
        shards.append([int(sample) for (batch,) in loader for sample in batch])
    return shards


def seeded_permutation(n: int, seed: int, epoch: int) -> list[int]:
    """The documented rule: every rank draws the same permutation from a generator seeded with seed + epoch."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def pad_to_multiple(order: list[int], world_size: int) -> list[int]:
    """DistributedSampler's padding: repeat the head of the order until world_size divides its length."""
    padding = world_size * math.ceil(len(order) / world_size) - len(order)
    return order + (order * math.ceil(padding / len(order)))[:padding]  # several rounds if n < world_size


def interleave(shards: list[list[int]]) -> list[int]:
    """The global order the shards came from: rank r's i-th sample sits at position r + i * world_size."""
    order = [-1] * sum(map(len, shards))
    for rank, shard in enumerate(shards):
        for i, sample in enumerate(shard):
            order[rank + i * len(shards)] = sample
    return order


def check_shards(padded, dropped, rerun, n, args) -> list[tuple[str, bool, str]]:
    """(name, passed, detail) per check; padded[epoch][rank] is a shard (drop_last False), dropped the same."""
    world, epochs = len(padded[0]), range(len(padded))
    padding = world * math.ceil(n / world) - n  # positions to fill so that every rank reads as many
    counts = [Counter(sample for shard in padded[e] for sample in shard) for e in epochs]
    repeats = [sorted(s for s, c in counts[e].items() for _ in range(c - 1)) for e in epochs]
    missing = [sorted(set(range(n)) - counts[e].keys()) for e in epochs]
    kept = [Counter(sample for shard in dropped[e] for sample in shard) for e in epochs]
    cut = [sorted(set(range(n)) - kept[e].keys()) for e in epochs]
    orders = [interleave(padded[e]) for e in epochs]
    return [
        ("split", all(sorted(o[:n]) == list(range(n)) and o == pad_to_multiple(o[:n], world) for o in orders),
         f"rank r reads positions r, r+{world}, ... of one permutation padded to {world} x {math.ceil(n / world)}"),
        ("disjoint", all(len(r) == padding for r in repeats),
         f"no sample read twice except {padding} padding duplicate(s) per epoch; read twice: {repeats}"),
        ("coverage", not any(missing), f"all {n} samples read in each epoch; never read: {missing}"),
        ("drop_last", all(max(kept[e].values(), default=1) == 1 and len(cut[e]) == n % world for e in epochs)
         and all(len(shard) == n // world for e in epochs for shard in dropped[e]),
         f"{n // world} per rank, none twice, {n % world} dropped per epoch: {cut}"),
        ("set_epoch", all(orders[e][:n] == seeded_permutation(n, args.seed, e) for e in epochs),
         f"epoch e reads the permutation of seed {args.seed} + e; {len(set(map(tuple, orders)))} different "
         f"orders in {len(orders)} epochs"),
        ("same seed", rerun == padded, f"fresh samplers with seed {args.seed} read the same shards in every epoch"),
    ]  # fmt: skip


def train_briefly(splits, ctx, args) -> DigitsCNN:
    """A DigitsCNN that knows a little: a perfect model would hide the skew (duplicates of right answers)."""
    seed_everything(args.seed)
    model = DigitsCNN(splits.num_classes).to(ctx.device)
    if ctx.is_main and args.train_steps:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        loader = DataLoader(splits.train, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(args.seed))
        step = 0
        while step < args.train_steps:
            for images, labels in loader:
                loss = F.cross_entropy(model(images.to(ctx.device)), labels.to(ctx.device))
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step += 1
                if step == args.train_steps:
                    break
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)  # every rank now holds rank 0's weights, as DDP does at wrap time
    return model.eval()


@torch.no_grad()
def count_correct(model, dataset, positions: list[int], device) -> list[int]:
    """[correct, total] of model on dataset[positions], in batches of 128, as an evaluation loop does."""
    correct = 0
    for images, labels in DataLoader(Subset(dataset, positions), batch_size=128):
        correct += int((model(images.to(device)).argmax(dim=1) == labels.to(device)).sum())
    return [correct, len(positions)]


def evaluate(splits, ctx, args) -> dict:
    """The held-out accuracy as a padded DistributedSampler gives it, and exactly."""
    model = train_briefly(splits, ctx, args)
    eval_set = Subset(splits.test, range(args.eval_size))  # the first N held-out digits
    sampler = make_sampler(eval_set, ctx, args, shuffle=False)
    shard = list(sampler)
    # Padding fills the positions n .. W*ceil(n/W)-1 of the padded list. Rank r owns positions
    # r, r+W, ..., so its first len(range(r, n, W)) samples are real and the rest are duplicates.
    real = len(range(sampler.rank, args.eval_size, sampler.num_replicas))
    unpadded = shard if args.bug == "padded-eval" else shard[:real]
    mine = count_correct(model, eval_set, shard, ctx.device) + count_correct(model, eval_set, unpadded, ctx.device)
    per_rank = [None] * ctx.world_size
    dist.all_gather_object(per_rank, {"rank": ctx.rank, "padded": mine[:2], "exact": mine[2:], "padding": shard[real:]})
    counts = torch.tensor(mine, device=ctx.device)  # [padded correct, padded total, correct, total]
    dist.all_reduce(counts)  # sum over ranks: the job's counts, not rank 0's
    padded_correct, padded_total, correct, total = counts.tolist()
    # The reference: one process scores every sample once (each rank can; it is cheap and needs no message).
    single_correct, single_total = count_correct(model, eval_set, list(range(args.eval_size)), ctx.device)
    if args.save_model and ctx.is_main:
        atomic_save({name: t.cpu() for name, t in model.state_dict().items()}, args.save_model)
    exact, padded = correct / max(total, 1), padded_correct / max(padded_total, 1)
    duplicates = padded_total - args.eval_size  # 0 .. W-1 with the right rank and world size
    return {
        "size": args.eval_size, "train_steps": args.train_steps, "padded_correct": padded_correct,
        "padded_total": padded_total, "padded_accuracy": padded, "exact_correct": correct, "exact_total": total,
        "exact_accuracy": exact, "single_process_correct": single_correct, "single_process_total": single_total,
        "skew": padded - exact, "duplicates": duplicates,
        # Worst case: every duplicate is right (or every one wrong): (c + d) / (n + d) - c / n.
        "max_skew": max(duplicates, 0) * max(exact, 1 - exact) / max(padded_total, 1),
        "padding_samples": sorted(s for r in per_rank for s in r["padding"]), "per_rank": per_rank,
    }  # fmt: skip


def run_checks(ctx, args) -> dict:
    splits = load_digits()
    if args.eval_size > len(splits.test):
        raise CourseError(f"--eval-size must be at most {len(splits.test)} (the held-out digits), got {args.eval_size}")
    mine = {"padded": read_shards(ctx, args), "dropped": read_shards(ctx, args, drop_last=True)}
    mine["rerun"] = read_shards(ctx, args)  # fresh sampler, same seed: must reproduce every epoch
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, mine)  # pickles; on NCCL it uses this rank's current CUDA device
    shards = {key: [[gathered[r][key][e] for r in range(ctx.world_size)] for e in range(args.epochs)] for key in mine}
    n = args.dataset_size
    log(f"config: world_size={ctx.world_size} backend={ctx.backend} dataset_size={n} epochs={args.epochs} "
        f"seed={args.seed} eval_size={args.eval_size} train_steps={args.train_steps} bug={args.bug}")  # fmt: skip
    for epoch, epoch_shards in enumerate(shards["padded"]):
        log(f"epoch {epoch}: " + " | ".join(f"rank {r} {preview(s)}" for r, s in enumerate(epoch_shards)))
    log("drop_last, epoch 0: " + " | ".join(f"rank {r} {preview(s)}" for r, s in enumerate(shards["dropped"][0])))
    checks = check_shards(shards["padded"], shards["dropped"], shards["rerun"], n, args)

    ev = evaluate(splits, ctx, args)
    log(f"eval: DigitsCNN after {args.train_steps} SGD steps on rank 0, broadcast; {ev['size']} held-out digits")
    log(
        f"  padded (sampler as is): {ev['padded_correct']}/{ev['padded_total']} = {ev['padded_accuracy']:.3%}; "
        f"counted twice: held-out samples {ev['padding_samples']}"
    )
    log(
        f"  exact (all-reduced counts, unpadded shards): {ev['exact_correct']}/{ev['exact_total']} = "
        f"{ev['exact_accuracy']:.3%}; skew {100 * ev['skew']:+.3f} points, at most {100 * ev['max_skew']:.3f} "
        f"with {ev['duplicates']} duplicate(s) (never more than world_size - 1 = {ctx.world_size - 1})"
    )
    log("  per rank (exact): " + " | ".join(f"rank {r['rank']} {r['exact'][0]}/{r['exact'][1]}" for r in ev["per_rank"]))
    exact_ok = (ev["exact_correct"], ev["exact_total"]) == (ev["single_process_correct"], ev["single_process_total"])
    checks.append(("exact metric", exact_ok, f"all-reduced {ev['exact_correct']}/{ev['exact_total']} vs one process "
                   f"scoring all {ev['size']}: {ev['single_process_correct']}/{ev['single_process_total']}"))  # fmt: skip
    for name, passed, detail in checks:
        log(f"{'PASS' if passed else 'FAIL'} {name}: {detail}")
    failed = [name for name, passed, _ in checks if not passed]
    log(f"{len(failed)} of {len(checks)} checks FAILED: {', '.join(failed)}" if failed else f"all {len(checks)} checks passed")
    return {
        "world_size": ctx.world_size, "backend": ctx.backend, "device": ctx.device.type, "dataset_size": n,
        "epochs": args.epochs, "seed": args.seed, "bug": args.bug, "shards": shards["padded"],
        "drop_last_shards": shards["dropped"], "checks": {name: passed for name, passed, _ in checks}, "eval": ev,
    }  # fmt: skip


def preview(samples: list[int], limit: int = 12) -> str:
    shown = " ".join(map(str, samples[:limit]))
    return f"[{shown}{' ...' if len(samples) > limit else ''}] ({len(samples)})"


def main(args) -> int:
    try:
        ctx = setup_distributed(args.backend, timeout_s=args.timeout_s)
        report = run_checks(ctx, args)  # every rank computes the same verdict from the gathered shards
        if args.json and ctx.is_main:
            atomic_write_json(report, args.json)
        return 0 if all(report["checks"].values()) else 1
    except CourseError as error:
        log_error(str(error))
        return 1
    finally:
        teardown_distributed()  # gc.collect(), then destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(parse_args()))
