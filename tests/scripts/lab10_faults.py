"""Lab 10's nine planted faults, each as text edits of the fixed script (solutions/lab10_slow_ddp.py).

labs/lab10_slow_ddp.py is the solution with every fault's edits applied (below its own docstring);
tests/test_lab10.py checks that, and builds "the solution plus one fault" from the same edits, so that
each fault can be shown to fail its own check and no other. FAULTS maps each fault to the check
(ddp_course/checking/lab10.py) it must fail, and its edits: (text in the solution, text in the broken
script), each found exactly once.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOLUTION = REPO / "solutions" / "lab10_slow_ddp.py"
BROKEN = REPO / "labs" / "lab10_slow_ddp.py"

FAULTS: dict[str, tuple[str, list[tuple[str, str]]]] = {
    "threads": (
        "threads",
        [
            (
                """        # Fix 1: torchrun gives each rank OMP_NUM_THREADS=1; the broken script asked every rank for
        # all the machine's cores, so N ranks ran N x cores threads on cores cores. Split them.
        torch.set_num_threads(max(1, min(torch.get_num_threads(), usable_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))
""",
                """        torch.set_num_threads(usable_cores())  # torchrun leaves one thread per rank: use every core
""",
            )
        ],
    ),
    "data": (
        "data-wait",
        [
            (
                '''def standardize(images: torch.Tensor) -> torch.Tensor:
    """Each image to zero mean and unit variance, a whole batch (B, 1, 8, 8) in three tensor operations.

    Fix 2: the broken script did this per sample in Python inside the Dataset, and the step waited
    for it: the data-wait share of the timeline was most of the step.
    """
''',
                '''def standardize(images: torch.Tensor) -> torch.Tensor:
    """Each image of a batch (B, 1, 8, 8) to zero mean and unit variance."""
''',
            ),
            (
                """def usable_cores() -> int:""",
                '''class Standardized(Dataset):
    """The training images, each standardized as it is read (the formula written out, pixel by pixel)."""

    def __init__(self, base):
        self.base = base

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index):
        image, label = self.base[index]  # (1, 8, 8)
        pixels = [image[0, row, col] for row in range(image.shape[1]) for col in range(image.shape[2])]
        mean = sum(pixels) / len(pixels)
        std = (sum((pixel - mean) ** 2 for pixel in pixels) / (len(pixels) - 1)).sqrt().clamp_min(1e-6)
        return torch.stack([(pixel - mean) / std for pixel in pixels]).view_as(image), label


def usable_cores() -> int:''',
            ),
            (
                "from torch.utils.data import DataLoader, DistributedSampler, Subset\n",
                "from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset\n",
            ),
            ("    sampler = DistributedSampler(splits.train,", "    splits.train = Standardized(splits.train)\n    sampler = DistributedSampler(splits.train,"),
            (
                "            images, labels = standardize(images.to(ctx.device)), labels.to(ctx.device)\n            last_micro",
                "            images, labels = images.to(ctx.device), labels.to(ctx.device)\n            last_micro",
            ),
        ],
    ),
    "accumulation": (
        "syncs-per-step",
        [
            (
                """            # Fix 3: only the last micro-batch of a step all-reduces; the others add to .grad locally.
            with ddp_model.no_sync() if not last_micro else contextlib.nullcontext():
                with torch.autocast(ctx.device.type, dtype=amp.dtype, enabled=amp.enabled):
                    loss = F.cross_entropy(ddp_model(images), labels) / args.accum_steps
                scaler.scale(loss).backward()
""",
                """            with torch.autocast(ctx.device.type, dtype=amp.dtype, enabled=amp.enabled):
                loss = F.cross_entropy(ddp_model(images), labels) / args.accum_steps
            scaler.scale(loss).backward()  # the micro-batches' gradients add up in .grad
""",
            )
        ],
    ),
    "buckets": (
        "buckets",
        [
            (
                """    # Fix 4: DDP's own bucket size (bucket_cap_mb=None), not 0.01 MB: the 0.6 MB of gradients go in
    # one all-reduce instead of paying gloo's per-call latency once per tiny bucket.
""",
                "",
            ),
            (
                """    ddp_model = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None)""",
                """    ddp_model = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None,
                    bucket_cap_mb=0.01)  # small buckets: communication starts sooner in backward""",
            ),
        ],
    ),
    "unused": (
        "unused-search",
        [
            (
                """    # Fix 5: no find_unused_parameters: every parameter gets a gradient in every step, so the search
    # for unused ones (a walk of the autograd graph after every forward) found nothing, at a cost.
""",
                "",
            ),
            (
                """    ddp_model = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None""",
                """    ddp_model = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None,
                    find_unused_parameters=True""",
            ),
        ],
    ),
    "straggler": (
        "rank-balance",
        [
            (
                """            # Fix 6: nothing here that only rank 0 does; the held-out accuracy is computed once
            # per epoch, below, by every rank on its slice.
""",
                """            if ctx.is_main:  # a progress line: rank 0 scores the whole held-out set after every step
                correct, seen = count_correct(model, DataLoader(splits.test, batch_size=256), ctx).tolist()
                log(f"step {step} | held-out accuracy {correct / seen:.2%}")
""",
            )
        ],
    ),
    "learning-rate": (
        "accuracy",
        [
            (
                '''    """Fix 7: the linear scaling rule with warm-up (Goyal et al., 2017).

    --lr was tuned for a global batch of --base-batch; a batch k times bigger takes k times fewer
    steps per epoch, so each step is allowed k times the learning rate, reached gradually over
    --warmup-steps steps because the first steps of a fresh model cannot take the full size.
    """
    peak = args.lr * global_batch / args.base_batch
    return peak * min(1.0, (step + 1) / args.warmup_steps) if args.warmup_steps else peak
''',
                '''    """The learning rate of each step: --lr, which worked well for this model."""
    return args.lr
''',
            )
        ],
    ),
    "batch-norm": (
        "batch-norm",
        [
            (
                """    # Fix 9: each BatchNorm layer normalises with the statistics of the batch it is given, on each rank
    # alone: here a whole micro-batch of --batch-size images. The broken script cut every micro-batch
    # into 8 for less memory (same global batch, 8 times the micro-batches), so BatchNorm saw 2 images
    # at a time: noisy statistics in training, poor running averages for evaluation. On CPU, where
    # SyncBatchNorm raises, enough images per rank is the fix (or GroupNorm/LayerNorm, which use no
    # batch statistics); a bigger batch per rank would be a bigger global batch, for fix 7 to scale to.
""",
                """    # The same global batch in micro-batches 8 times smaller, 8 times as many: 8 times less activation memory.
    args.batch_size, args.accum_steps = args.batch_size // 8, args.accum_steps * 8
""",
            )
        ],
    ),
    "timeout": (
        "time-out",
        [
            (
                '''    """Rank 0 writes the weights; nobody goes on before the file is complete.

    Fix 8: the others used to wait in a barrier of the default group, whose timeout (--timeout-s)
    is there to catch a hung collective in seconds; a save slower than that killed a healthy job.
    They now wait on a group made for this phase, with its own, longer timeout. Raising the
    default group's timeout instead would make every real hang take that long to surface.
    """
''',
                '''    """Rank 0 writes the weights; nobody goes on before the file is complete."""
''',
            ),
            ("    dist.barrier(group=checkpoint_group)\n", "    dist.barrier()\n"),
            (
                """    # Fix 8: a group for the checkpoint phase only, with a timeout that fits a slow save.
    checkpoint_group = dist.new_group(timeout=timedelta(seconds=args.save_timeout_s)) if args.save else None
""",
                "",
            ),
            ("def save_checkpoint(model, args, ctx, checkpoint_group) -> None:", "def save_checkpoint(model, args, ctx) -> None:"),
            ("            save_checkpoint(model, args, ctx, checkpoint_group)", "            save_checkpoint(model, args, ctx)"),
            ("from datetime import timedelta\n", ""),
            ("""    parser.add_argument("--save-timeout-s", type=positive_float, default=600.0, help="how long the others wait for a save")\n""", ""),
        ],
    ),
}


def code_of(path: Path) -> str:
    """A script's text below its module docstring (the docstrings of the two scripts differ on purpose)."""
    text = path.read_text()
    end = text.index('"""', text.index('"""') + 3) + 3
    return text[end:]


def with_faults(names, extra_edits=()) -> str:
    """The solution's code (below its docstring) with the named faults' edits applied, in FAULTS order, then extra_edits."""
    code = code_of(SOLUTION)
    edits = [(name, edit) for name in FAULTS if name in names for edit in FAULTS[name][1]]
    for name, (old, new) in edits + [("extra", edit) for edit in extra_edits]:
        if code.count(old) != 1:
            raise ValueError(f"fault {name}: {old[:60]!r} found {code.count(old)} times, not once")
        code = code.replace(old, new)
    return code


def write_variant(names, path: Path, extra_edits=()) -> Path:
    """A runnable script: a docstring, then the solution's code with the named faults (and extra_edits)."""
    path.write_text(f'"""Lab 10 variant: the solution with {", ".join(names) or "no fault"} planted."""' + with_faults(names, extra_edits))
    return path


# Not a fault of the lab: the same extra work on every rank, slower with no other signature - the
# throughput check's own negative control. 24 forward passes: with 12 it measured 0.24-0.26x the
# reference's speed until the model gained its input BatchNorm (2026-11-30); then 0.38x, too near the
# 0.4 limit, because DDP now also broadcasts rank 0's BatchNorm buffers before each forward of the
# reference (a fixed cost per step), while the extra passes, through the bare module, broadcast nothing.
EXTRA_WORK = [
    (
        "                scaler.scale(loss).backward()\n",
        """                scaler.scale(loss).backward()
            with torch.no_grad():  # 24 more forward passes, on every rank alike
                for _ in range(24):
                    ddp_model.module(images)
""",
    )
]
