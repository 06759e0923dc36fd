"""Lab 3 conversion checker: run your DDP version of labs/train_realistic.py on 3 CPU ranks and judge it by behaviour.

    cp labs/train_realistic.py labs/my_ddp.py     # then turn labs/my_ddp.py into a DDP script
    python labs/lab3_convert_check.py             # checks labs/my_ddp.py (about half a minute)
    python labs/lab3_convert_check.py SCRIPT      # checks another file
    python labs/lab3_convert_check.py --part A    # part A (lab 3 section 7): its 8 checks; the 5 others wait for part B
    python labs/lab3_convert_check.py --show-output SCRIPT    # also prints what SCRIPT printed
    python labs/lab3_convert_check.py --job-timeout-s 400 SCRIPT  # a slow machine: give the whole job longer

What SCRIPT must keep from labs/train_realistic.py: its flags (the checker passes SCRIPT_ARGS, with
--batch-size now per process, and --save <a temporary folder>/model.pt), DigitsNet and RandomShift,
load_digits(), torch.nn.utils.clip_grad_norm_ for clipping, the checkpoint's keys ("model",
"optimizer", "scheduler", "epoch"), and the form of its lines: "step N: train loss X, ..." every
--log-every steps and "epoch E/N: held-out accuracy A (c/t)" after every epoch.

The checker never reads SCRIPT's source. It observes SCRIPT through ddp_course/checking/observer.py, which
records which samples each rank read, every micro-batch the DataLoader delivered (after its
augmentation, also from worker processes), the gradients before and after every backward(), which
DDP forwards synchronised their backward (no_sync or not), every clip_grad_norm_ call, the weights,
gradients and learning rate at every optimizer step, every collective called from Python, every
torch.save and torch.load, and the BatchNorm buffers each held-out pass ends with. In ONE launch
it runs SCRIPT twice, in the same three processes: straight through 2 epochs, then resumed from a copy
of the checkpoint the first run wrote after epoch 1 (--resume), for 1 more epoch. The job runs as
three one-process nodes on this machine: three torchrun agents (--nnodes=3 --nproc_per_node=1) that
meet at a c10d rendezvous on 127.0.0.1, as three machines would; LOCAL_RANK is then 0 on every rank
while RANK is 0, 1 and 2, so a script that uses LOCAL_RANK where it means RANK shows it. Three ranks,
because 3 divides neither the 1438 training samples (a DistributedSampler pads them to 1440, 480 per
rank) nor the 359 held-out ones (slices of 120, 120 and 119): a number written for 2 ranks (a
schedule's length, a held-out slice, a loss divided by 2) gives wrong numbers here, and the padding
shows. Every check reads the world size from the observed run and compares all its ranks.

The reference is one process on the global batch, computed here: the starting script's DigitsNet at
each rank's recorded weights, on the micro-batches each rank received, each normalised by
BatchNorm on its own as the one-process script normalises each of its micro-batches (one process
that accumulates the 3 ranks' 3 micro-batches of a step as 9 micro-batches), with the starting
script's learning-rate schedule for that global batch. Thirteen checks, one line each:

   1 data-split      in every epoch the ranks read shares that cover the training set, each sample once
                     but for the sampler's padding
   2 epoch-shuffle   epoch 1 reads the samples in a new order
   3 equal-replicas  every rank holds the same weights before every optimizer step
   4 global-gradient every backward adds its micro-batch's mean-loss gradient / k to a .grad that
                     started empty, the all-reducing one averaged over ranks; after 3 steps the weights
                     are one process's on the same global batches (AdamW, schedule and clipping included)
   5 checkpoint      rank 0 alone writes --save (directly, or atomically: a temporary file renamed onto it);
                     a bare DigitsNet loads its "model" (no "module.")
   6 job-metrics     the last printed accuracy is the saved model's on the whole held-out set, each
                     image scored once
   7 clean-exit      every rank makes the same collective calls, calls destroy_process_group() after its
                     DDP model is gone, and the job exits with status 0
   8 clipping        one clip_grad_norm_ per optimizer step, after the all-reducing backward: the
                     averaged gradient's norm, equal on every rank, scaled as torch scales it
   9 lr-schedule     every rank's learning rate equals one process's at every optimizer step (its peak
                     --lr, or --lr x N or x sqrt(N): lecture 1's scaling rules)
  10 accumulation    every optimizer step runs k micro-batches and all-reduces once: only the last
                     one's backward synchronises (the others run under no_sync())
  11 printed-loss    one rank prints the loss, and what it prints is the job's: the mean over every
                     rank's samples since the last line, within half a unit of its last printed digit
  12 resume          in the resumed run every rank starts from the straight run's state at that step
                     (weights, learning rate, optimizer state: loaded with map_location, or received from
                     rank 0), and the run ends on the weights of the run that went straight through
  13 batchnorm       the ranks that score the held-out images (all, or rank 0 alone) hold the same
                     BatchNorm statistics when their pass ends, in the last pass the ones rank 0 saves
                     (local statistics or SyncBatchNorm: either, consistently)

Part A (lab 3 section 7, at route step 2) is judged by checks 1, 2, 3, 4, 6, 7, 9 and 11 alone
(--part A): the other five print WAITS, with where part B is set (lecture 6 section 9) and where
each one's concept is taught. A part-A script may leave part B's decisions as the one-process script
has them: check 6 then scores each rank's held-out images with that rank's own BatchNorm statistics
(whose statistics score the job is check 13's question, part B's).

Each line says PASS, FAIL with the evidence and a hint naming the concept and where the course
teaches it, or BLOCKED with the reason the check could not be decided: the job died before it could
be seen, or another check's failure already explains what this one would see (e.g. replicas that
started apart cannot agree on an accuracy). A script that trains no DDP model at all (the
one-process script, or a hand-written wrapper) FAILs check 4 with that one reason, and the checks
it would pass by doing nothing are BLOCKED. Exit status 0 only when all pass, 1 otherwise, 2 for a
bad command line. A job that hangs is killed after --job-timeout-s seconds (default JOB_TIMEOUT_S); a job that dies says
with which exception.

What it cannot see:
- the GPU half of the script. The job runs on CPUs with gloo (no GPU is visible to it), so the
  device choice (cuda:LOCAL_RANK, torch.cuda.set_device, device_ids), NCCL, SyncBatchNorm (torch
  2.14 runs it on GPUs only: convert to it only where the device is a GPU) and tensors left on the
  wrong device are never executed here. Read those
  lines against lecture 1's diff of labs/ddp_minimal.py, then run the script on a GPU machine.
  map_location is checked as present only: the CPU cannot show which device it names.
- check 6 barely sees one mistake the course warns about: the mean of the ranks' accuracies instead
  of their summed counts. With slices of 120, 120 and 119 images it differs from the job's accuracy
  by |a0 + a1 - 2 a2| / (3 x 359), which exceeds the tolerance of half an image in 359 (0.5/359 =
  1.4e-3) only when |a0 + a1 - 2 a2| > 1.5, so it nearly always passes. It is wrong all the same. (A DistributedSampler on the held-out set, which pads it to 360 with one repeated
  image, moves the accuracy by less than that too, but check 6 sees the repeat: it counts which
  images the ranks scored, and FAILs an image scored twice.)
- gloo's abort at exit itself: the observer destroys a group the script left open and ends its
  processes with os._exit, so check 7 judges the causes instead: it records each
  destroy_process_group() and whether the rank's DDP model was still alive then, and whether the
  script ended with its group open. The other cause (torch.distributed.nn.functional first imported
  after init_process_group) it cannot see: the observer makes that import before SCRIPT runs
  (ddp_course/checking/observer.py says why); the hint names both causes.
"""

from __future__ import annotations

import collections
import inspect
import math
import re
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from torch import nn

from ddp_course.checking import lab4  # lab 4's checker observes and judges some of what matters here
from ddp_course.checking.front_end import checker_parser, print_verdicts, script_to_check
from ddp_course.checking.verdict import Verdict, summary
from ddp_course.cli import positive_float

DEFAULT_SCRIPT = "labs/my_ddp.py"
# The job: 3 gloo ranks as three one-process nodes (LOCAL_RANK is 0 on every rank, see the docstring).
# 3 divides neither the 1438 training samples (DistributedSampler pads them to 1440) nor the 359
# held-out ones (120, 120 and 119 for each rank's slice), so a number written for 2 ranks shows.
# Every check reads the world size from the observed run (Observation.world_size), never from here.
NODES = 3
WORLD_SIZE = NODES  # one process per node
EPOCHS, BATCH_SIZE, ACCUMULATION, PEAK_LR, WARMUP_STEPS, CLIP_NORM, LOG_EVERY = 2, 48, 3, 4e-3, 3, 0.5, 2
# 480 samples per rank: 10 micro-batches of 48, so 4 optimizer steps per epoch (of 3, 3, 3 and 1
# micro-batches), 8 in the run; the clip norm is below the early gradients' norm, so it clips.
SCRIPT_ARGS = [
    "--epochs", str(EPOCHS), "--seed", "0", "--batch-size", str(BATCH_SIZE), "--accumulation", str(ACCUMULATION),
    "--lr", str(PEAK_LR), "--weight-decay", "0.05", "--warmup-steps", str(WARMUP_STEPS), "--clip-norm", str(CLIP_NORM),
    "--workers", "1", "--log-every", str(LOG_EVERY),
]  # fmt: skip  # + --save PATH, and --resume for the second run
RESUME_AFTER_EPOCH = 1  # the second run starts from the checkpoint the first wrote after this epoch
RECORDED_STEPS = 1000  # the observer saves the details of every optimizer step (there are 10)
REFERENCE_STEPS = 3  # steps replayed in one process for check 4
JOB_TIMEOUT_S = 150  # both runs, start-up included
TOLERANCE = 1e-4  # relative, for recomputed gradients and norms; float32 recomputation agrees to about 1e-6
REPLICA_TOLERANCE = 1e-6  # relative; DDP keeps the replicas bit for bit equal
REPLAY_TOLERANCE = 1e-3  # relative, on the distance the weights travelled in the replay
OBSERVER_ENV = {"LAB4_OBSERVE_STEPS": str(RECORDED_STEPS), "LAB4_OBSERVE_SNAPSHOTS": "1"}

CHECKS = {
    1: ("data-split", "give the DataLoader a DistributedSampler with the job-wide rank (RANK, or dist.get_rank()), never LOCAL_RANK, which starts at 0 again on every machine: in every epoch each rank must read its own share (lecture 1 section 4: labs/ddp_minimal.py's sampler; lab 3 section 2)"),
    2: ("epoch-shuffle", "call sampler.set_epoch(epoch) before each epoch: the sampler shuffles with its seed plus the epoch number (lecture 1 section 4: labs/ddp_minimal.py's set_epoch line; lab 3 section 2)"),
    3: ("equal-replicas", "DDP broadcasts rank 0's weights when it wraps the model (unless init_sync=False), then gives every rank the same averaged gradient; replicas that start apart never meet again (lecture 1 section 5.4)"),
    4: ("global-gradient", "DDP's backward averages the gradients over ranks: back-propagate each micro-batch's mean loss / k as the one-process script does, no extra factor for the world size, and clear the gradients after each optimizer step (lecture 1 sections 2-3; lab 3 section 3)"),
    5: ("checkpoint", "save once, on rank 0 (ranks writing the same file race), the bare model's weights: model.module.state_dict() (or the model you wrapped), then a barrier (lab 3 section 2; lecture 6 section 4)"),
    6: ("job-metrics", "each rank scores only its part of the held-out set, each image once (a DistributedSampler pads it with repeats, a slice written for one world size overlaps at another): all-reduce the counts (correct, seen) before printing the accuracy (lecture 1 section 4: labs/ddp_minimal.py scores a slice per rank and all-reduces the counts; lab 3 section 2)"),
    7: ("clean-exit", "every rank must make the same collective calls in the same order (a collective inside `if rank == 0:` waits forever), and end with destroy_process_group(). A gloo job aborts at exit (terminate called without an active exception) when its process group outlives destroy_process_group(), for two causes: a DDP model still alive (return from the function that built it, or del it, then gc.collect() before destroy_process_group()), which this check observes, and torch.distributed.nn.functional first imported after init_process_group (import it before), which it cannot (the checker makes that import itself). labs/ddp_minimal.py marks both workarounds, and makes its barrier on every rank, outside `if rank == 0:` (lecture 1 section 4)"),
    8: ("clipping", "clip once per optimizer step, after the backward that all-reduces (the last micro-batch's): then clip_grad_norm_ sees the averaged gradient, and every rank computes the same norm; clipping earlier clips each rank's own partial gradient with its own norm (lecture 4 section 4.1)"),
    9: ("lr-schedule", "step the scheduler once per optimizer step, and count the schedule's steps from what this rank runs: ceil(len(train_loader) / accumulation) per epoch, which the DistributedSampler already divides by the world size; the peak may be --lr, or --lr scaled by N or sqrt(N), the schedule's shape stays one process's (lecture 1 section 8)"),
    10: ("accumulation", "run every micro-batch but a step's last under ddp_model.no_sync(): their gradients stay local and add up in .grad, and the last backward all-reduces the sum, once per optimizer step (lab 3 section 3)"),
    11: ("printed-loss", "all-reduce [sum of per-sample losses, samples] over the ranks, then print on rank 0 alone: each rank only sees its own shard's loss (lab 3 section 2, job-wide numbers)"),
    12: ("resume", "every rank must go on from the checkpoint rank 0 wrote (model, optimizer and scheduler): each rank loads it with map_location=its device, or rank 0 loads it and broadcasts it (broadcast_object_list); loading on rank 0 alone leaves the other ranks' optimizer and schedule at their start (lecture 6 section 4)"),
    13: ("batchnorm", "BatchNorm's running statistics are each rank's own: DDP copies rank 0's buffers only at the first forward through the DDP model after a synchronised one, whatever the mode (not inside no_sync()), so the bare model (model.module) keeps its own. Score with the model rank 0 saves: evaluate through the DDP model, or give every rank rank 0's buffers first (dist.broadcast each), or let rank 0 alone score the whole held-out set; SyncBatchNorm on GPUs (lecture 1 section 5.2; lecture 4 section 2.7)"),
}  # fmt: skip
# The exercise comes in two parts (issue 38, section 2). Part A, at route step 2 (lab 3 section 7), makes
# the job DDP: process group, sampler and set_epoch, the schedule's length, the printed loss and accuracy;
# everything it needs is taught in lecture 1 and lab 3. Part B, the capstone after lecture 6 (lecture 6
# section 9), takes the same labs/my_ddp.py through what lectures 4 and 6 teach: clipping, BatchNorm,
# checkpoint and resume, accumulation. `--part A` judges part A's checks alone and says where each other
# check's concept is taught; the default, `--part B`, judges all thirteen.
PART_A_CHECKS = (1, 2, 3, 4, 6, 7, 9, 11)
PART_B_CHECKS = (5, 8, 10, 12, 13)
PART_B_HOME = "lecture 6 section 9"  # where part B is set
WAITS_FOR = {  # part B's checks: what each judges, and where the course teaches it (core, before lecture 6 ends)
    5: "who saves the checkpoint, and what, taught in lecture 6 section 4",
    8: "where in the step to clip, taught in lecture 4 section 4.1",
    10: "one all-reduce per optimizer step with no_sync(), taught in lab 3 section 3",
    12: "every rank resuming from rank 0's file, taught in lecture 6 section 4",
    13: "whose BatchNorm statistics score and are saved, taught in lecture 1 section 5.2 and lecture 4 section 2.7",
}


def waiting_line(number: int) -> str:
    """Part A's line for a part-B check: not judged; where part B is set, and where the check's concept is taught."""
    name, _ = CHECKS[number]
    return f"{number:>2} {name:<15} {'WAITS':<7} for part B ({PART_B_HOME}): {WAITS_FOR[number]}"


# The held-out accuracy the script printed: the first decimal number (or number followed by %) after "accuracy".
ACCURACY = re.compile(r"accuracy.*?(\d+\.\d+|\d+(?=\s*%))(\s*%)?", re.IGNORECASE)
# A training-loss line: "step N: train loss X, ...".
LOSS_LINE = re.compile(r"\bstep (\d+)\b.*?\bloss (\d+\.\d+)")


def verdict(number: int, status: str, evidence: str) -> Verdict:
    """Check `number`'s verdict (ddp_course.checking's one type), with its name and hint from CHECKS."""
    name, hint = CHECKS[number]
    return Verdict(name, status, evidence, hint=hint, number=number)


def renumbered(number: int, lab4_verdict: Verdict) -> Verdict:
    """A verdict of lab 4's checker, under this checker's number (and name and hint)."""
    return verdict(number, lab4_verdict.status, lab4_verdict.evidence)


def named(ranks) -> str:
    """'rank 0', 'ranks 0 and 1', 'ranks 0, 1 and 2': the ranks, in words."""
    ranks = [str(rank) for rank in ranks]
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return f"ranks {', '.join(ranks[:-1])} and {ranks[-1]}"


# --- the job: two runs in one launch --------------------------------------------------------------------
def script_args(out_dir: Path) -> list:
    """The straight run's flags: SCRIPT_ARGS, and its checkpoint goes into out_dir."""
    return [*SCRIPT_ARGS, "--save", out_dir / "model.pt"]


def resumed_args(out_dir: Path) -> list:
    return [*script_args(out_dir), "--resume"]


def first_checkpoint(straight_dir: Path) -> Path:
    """The observer's copy of the first file rank 0 saved in the straight run: the checkpoint of epoch 1."""
    return straight_dir / "saved" / f"{RESUME_AFTER_EPOCH}-r0.pt"


def runs(script: Path, out_dir: Path) -> list[dict]:
    """The straight run, then the resumed one, which starts from a copy of the straight run's epoch-1 checkpoint."""
    straight, resumed = out_dir / "straight", out_dir / "resumed"
    return [
        {"name": "straight", "out_dir": straight, "script": script, "args": script_args(straight), "env": OBSERVER_ENV},
        {"name": "resumed", "out_dir": resumed, "script": script, "args": resumed_args(resumed), "env": OBSERVER_ENV,
         "copy": [[str(first_checkpoint(straight)), str(resumed / "model.pt")]]},
    ]  # fmt: skip


def observe(script: Path, out_dir: Path, timeout_s: float = JOB_TIMEOUT_S) -> tuple:
    """(straight, resumed) Observations of one launch of the two runs, killed after timeout_s."""
    observed = lab4.observe_runs(runs(script, out_dir), out_dir, timeout_s, nodes=NODES, world_size=WORLD_SIZE)
    return observed["straight"], observed["resumed"]


# --- the exercise's contract: the starting script's model and schedule -----------------------------------
# labs/train_realistic.py stands alone (a learner reads and copies it whole), so the checker keeps its own
# copy of the two things a conversion must not change; tests/test_checkers.py checks that they are the
# script's (the same parameters and outputs, the same learning rates).
class DigitsNet(nn.Module):
    """labs/train_realistic.py's model: two 3x3 convolutions with BatchNorm and a linear classifier."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, kernel_size=3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
            nn.MaxPool2d(2), nn.Flatten(),
        )  # fmt: skip
        self.classifier = nn.Linear(32 * 4 * 4, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images))


def lr_at(step: int, total_steps: int, warmup_steps: int, peak_lr: float) -> float:
    """labs/train_realistic.py's schedule: a linear warm-up to peak_lr, then a cosine to 0."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak_lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


# --- what the runs left ---------------------------------------------------------------------------------
def recorded_steps(obs) -> list[dict[int, dict]]:
    """[{rank: what the observer saved at that optimizer step}], for the steps every rank recorded."""
    steps = []
    for step in range(1, RECORDED_STEPS + 1):
        records = {rank: obs.step_record(rank, step) for rank in obs.ranks}
        if any(record is None for record in records.values()):
            break
        steps.append(records)
    return steps


def stdout_of(obs, rank: int) -> str:
    path = obs.out_dir / f"stdout-r{rank}.txt"
    return path.read_text() if path.exists() else ""


def reference_model():
    return DigitsNet()


class Reference:
    """One process on the global batch, at each rank's recorded weights: micro-batch gradients and losses.

    A micro-batch's gradient is that of its mean cross-entropy, with BatchNorm in training mode
    (statistics of that micro-batch alone), at the weights rank r held in that step (the weights do
    not change within a step). Computed once per (step, rank, micro-batch) and cached.
    """

    def __init__(self, steps):
        self.steps, self.model, self.cache = steps, reference_model(), {}
        self.shapes_ok = bool(steps) and steps[0][0]["shapes"] == [list(p.shape) for p in self.model.parameters()]

    def micro_batch(self, step: int, rank: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gradient of the mean loss, per-sample losses) of micro-batch `index` of `step` (0-based) on `rank`."""
        key = (step, rank, index)
        if key not in self.cache:
            self.cache[key] = self._forward(step, rank, index, backward=True)
        return self.cache[key]

    def losses(self, step: int, rank: int, index: int) -> torch.Tensor:
        """The per-sample losses alone (a forward pass only, unless the gradient is known already)."""
        key = (step, rank, index)
        return self.cache[key][1] if key in self.cache else self._forward(step, rank, index, backward=False)[1]

    def _forward(self, step: int, rank: int, index: int, backward: bool):
        record = self.steps[step][rank]
        images, labels = record["micro_batches"][index]["tensors"][:2]
        vector_to_parameters(record["params"].clone(), self.model.parameters())
        self.model.train()  # BatchNorm normalises with this micro-batch's statistics, as in the job
        self.model.zero_grad(set_to_none=True)
        with torch.enable_grad() if backward else torch.no_grad():
            losses = F.cross_entropy(self.model(images), labels, reduction="none")
        if not backward:
            return None, losses
        losses.mean().backward()
        return parameters_to_vector(p.grad for p in self.model.parameters()).detach(), losses.detach()

    def step_gradient(self, step: int) -> torch.Tensor:
        """One process's gradient for a step: the mean over ranks of each rank's micro-batch gradients / k."""
        per_rank = []
        for rank in self.steps[step]:
            count = len(self.steps[step][rank]["micro_batches"])
            per_rank.append(sum(self.micro_batch(step, rank, j)[0] for j in range(count)) / ACCUMULATION)
        return torch.stack(per_rank).mean(dim=0)


def micro_batches_ok(steps) -> str | None:
    """Why the recorded micro-batches cannot be used for a recomputation, or None."""
    for number, records in enumerate(steps, start=1):
        for rank, record in records.items():
            batches = record["micro_batches"]
            if not batches:
                return f"in step {number} rank {rank} trained on no batch from a DataLoader over the digits"
            if any(len(mb["tensors"]) < 2 for mb in batches):
                return f"in step {number} rank {rank}'s batches are not (images, labels) pairs"
            if any(mb["grad_after"] is None for mb in batches):
                return f"in step {number} rank {rank} ran a micro-batch without a backward() of a DDP model's loss"
    return None


# --- checks 1 and 2: which samples each rank read -------------------------------------------------------
def check_data_split(obs, train_size: int) -> Verdict:
    """In each of the run's epochs, shares that cover the training set, each sample read once but for
    DistributedSampler's padding: it repeats (-train_size) % world_size samples, so that every rank
    reads as many (1438 samples on 3 ranks: 2 repeats, 480 each)."""
    padding = -train_size % obs.world_size
    for epoch in range(EPOCHS):
        orders = {rank: obs.batches(rank, "train", epoch) for rank in obs.ranks}
        silent = [rank for rank, order in orders.items() if not order]
        if silent:
            return verdict(1, "BLOCKED", f"rank {silent[0]} read no training batch in epoch {epoch}: the job {obs.ended()}")
        for rank in obs.ranks:
            for other in range(rank + 1, obs.world_size):
                shared = set(orders[rank]) & set(orders[other])
                if len(shared) > padding:
                    first = next(i for i in orders[rank] if i in shared)
                    return verdict(
                        1,
                        "FAIL",
                        f"ranks {rank} and {other} both trained on sample {first} in epoch {epoch} ({len(shared)} of the {train_size} training samples were read by both)",
                    )
        read = [index for order in orders.values() for index in order]
        repeats = len(read) - len(set(read))
        if repeats > padding:
            return verdict(
                1,
                "FAIL",
                f"{repeats} training samples were read more than once in epoch {epoch}; padding to a multiple of {obs.world_size} ranks repeats {padding}",
            )
        unread = set(range(train_size)) - set(read)
        if unread:
            return verdict(1, "FAIL", f"{len(unread)} training samples were read by no rank in epoch {epoch} (sample {min(unread)}, ...)")
    sizes = ", ".join(str(len(obs.batches(rank, "train", 0))) for rank in obs.ranks)
    padded = f", {padding} of them twice: the sampler's padding to {train_size + padding}" if padding else ", each once"
    return verdict(1, "PASS", f"in each of the {EPOCHS} epochs the ranks read shares ({sizes} samples) covering all {train_size}{padded}")


# --- check 3: equal replicas ----------------------------------------------------------------------------
def check_equal_replicas(obs, steps) -> Verdict:
    if not steps:
        return verdict(3, "BLOCKED", f"no optimizer step was recorded on every rank: the job {obs.ended()}")
    for number, records in enumerate(steps, start=1):
        for rank in records:  # every rank against rank 0
            difference = lab4.relative(records[0]["params"], records[rank]["params"])
            if difference <= REPLICA_TOLERANCE:
                continue
            if number == 1:
                return verdict(
                    3,
                    "FAIL",
                    f"before the first optimizer step rank {rank}'s weights differ from rank 0's (relative difference {difference:.2f}): the replicas started apart",
                )
            applied = lab4.relative(steps[number - 2][0]["grads"], steps[number - 2][rank]["grads"])
            if applied > REPLICA_TOLERANCE:  # different gradients, different weights: the gradient's checks say why
                return verdict(
                    3,
                    "BLOCKED",
                    f"the replicas started equal, but ranks 0 and {rank} applied different gradients in step {number - 1} (relative difference {applied:.1e}): checks 4 and 8 judge those",
                )
            return verdict(
                3,
                "FAIL",
                f"the replicas started equal and applied the same gradient in step {number - 1}, but before step {number} rank {rank}'s weights differ from rank 0's (relative difference {difference:.1e}): the optimizers differ",
            )
    made = [sum(event["kind"] == "step" for event in obs.events.get(rank, [])) for rank in obs.ranks]
    if len(set(made)) > 1:
        counts = ", ".join(f"rank {rank} {count}" for rank, count in zip(obs.ranks, made))
        return verdict(3, "FAIL", f"the ranks made different numbers of optimizer steps ({counts})")
    return verdict(3, "PASS", f"all {obs.world_size} ranks held the same weights before each of their {len(steps)} optimizer steps")


# --- check 4: each backward's gradient, and the one-process replay -------------------------------------
def check_global_gradient(obs, steps, reference, others_pass: dict[int, bool]) -> Verdict:
    if not steps:
        return verdict(4, "BLOCKED", f"no optimizer step was recorded on every rank: the job {obs.ended()}")
    if not reference.shapes_ok:
        return verdict(4, "BLOCKED", "the optimizer's parameters are not those of labs/train_realistic.py's DigitsNet")
    if problem := micro_batches_ok(steps[:REFERENCE_STEPS]):
        return verdict(4, "BLOCKED", problem)
    observed_parts, expected_parts = [], []
    for step, records in enumerate(steps[:REFERENCE_STEPS]):
        for rank, record in records.items():
            first = record["micro_batches"][0]["grad_before"]
            if first is not None and float(first.abs().max()) > 0:
                return verdict(
                    4,
                    "FAIL",
                    f"step {step + 1}'s first backward on rank {rank} added to a gradient left over from step {step}: gradients pile up from step to step",
                )
        ranks = list(records)
        for j, micro_batch in enumerate(records[0]["micro_batches"]):
            expected = [reference.micro_batch(step, rank, j)[0] / ACCUMULATION for rank in ranks]
            befores = [records[rank]["micro_batches"][j]["grad_before"] for rank in ranks]
            befores = [torch.zeros_like(expected[0]) if b is None else b for b in befores]
            afters = [records[rank]["micro_batches"][j]["grad_after"] for rank in ranks]
            if micro_batch["synced"]:  # DDP averaged: after = mean over ranks of (before + this micro-batch's gradient)
                apart = next((rank for rank, after in zip(ranks, afters) if lab4.relative(afters[0], after) > TOLERANCE), None)
                if apart is not None:
                    return verdict(
                        4, "FAIL", f"after the all-reducing backward of step {step + 1} ranks 0 and {apart} hold different gradients: they were not averaged"
                    )
                observed_parts.append(afters[0] - torch.stack(befores).mean(dim=0))
                expected_parts.append(torch.stack(expected).mean(dim=0))
            else:  # a local backward: after = before + this micro-batch's gradient, on each rank
                for rank in ranks:
                    observed_parts.append(afters[rank] - befores[rank])
                    expected_parts.append(expected[rank])
    observed, expected = torch.cat(observed_parts), torch.cat(expected_parts)
    scale, residual = lab4.best_multiple(observed, expected)
    global_batch = f"{obs.world_size} ranks x {ACCUMULATION} micro-batches of {BATCH_SIZE}"
    if residual > TOLERANCE:
        return verdict(
            4,
            "FAIL",
            f"the backward passes of the first {REFERENCE_STEPS} steps do not add the mean-loss gradients of their micro-batches: relative difference {lab4.relative(observed, expected):.2f}",
        )
    if abs(scale - 1) > TOLERANCE:
        return verdict(
            4,
            "FAIL",
            f"each backward adds {scale:.2f} x its micro-batch's mean-loss gradient / {ACCUMULATION}: the step's gradient is {scale:.2f} x the global batch's ({global_batch})",
        )
    gradients = f"every backward of the first {REFERENCE_STEPS} steps added its micro-batch's mean-loss gradient / {ACCUMULATION} to an empty .grad, the all-reducing one averaged over ranks: the global batch's gradient ({global_batch})"
    blocking = [number for number in (3, 8, 9) if not others_pass.get(number)]
    if blocking:
        return verdict(4, "PASS", f"{gradients}; not replayed in one process, as check {', '.join(map(str, blocking))} failed")
    replay = replay_in_one_process(steps[: REFERENCE_STEPS + 1], reference)
    if isinstance(replay, str):
        return verdict(4, "PASS", f"{gradients}; {replay}")
    difference, step = replay
    if difference > REPLAY_TOLERANCE:
        return verdict(
            4,
            "FAIL",
            f"{gradients}, but after {step} steps rank 0's weights are not those of one process with the same optimizer, schedule and clipping on the same global batches (relative difference {difference:.2f})",
        )
    return verdict(
        4,
        "PASS",
        f"{gradients}; after {REFERENCE_STEPS} steps the weights equal one process's on the same global batches (AdamW, schedule and clipping replayed)",
    )


def replay_in_one_process(steps, reference) -> tuple[float, int] | str:
    """Train one DigitsNet on the global batches with the script's optimizer, from rank 0's first weights.

    Each step: one process's gradient (Reference.step_gradient, recomputed at the replay's own weights),
    clipped to CLIP_NORM as clip_grad_norm_ does, the recorded learning rate, the optimizer's step.
    Returns the worst relative difference between the distances rank 0's weights and the replay's
    travelled from the start, and the step after which it occurred; or why no replay was possible.
    """
    first = steps[0][0]
    settings = first["optimizer"]
    optimizer_class = getattr(torch.optim, settings["class"], None)
    if not isinstance(optimizer_class, type) or len(settings["groups"]) != 1:
        return f"not replayed in one process: its optimizer ({settings['class']}, {len(settings['groups'])} parameter groups) is not one torch.optim optimizer with one group"
    model = reference_model()
    vector_to_parameters(first["params"].clone(), model.parameters())
    accepted = inspect.signature(optimizer_class).parameters
    optimizer = optimizer_class(model.parameters(), **{k: v for k, v in settings["groups"][0]["settings"].items() if k in accepted and k != "params"})
    # The same micro-batches, at the replay's own weights (copies: the recorded steps stay as they were).
    replay = Reference([{rank: dict(record) for rank, record in records.items()} for records in steps])
    worst = (0.0, 0)
    for number, records in enumerate(replay.steps[:-1], start=1):
        for rank in records:
            records[rank]["params"] = parameters_to_vector(model.parameters()).detach().clone()
        replay.cache = {}
        gradient = replay.step_gradient(number - 1)
        gradient = gradient * min(1.0, CLIP_NORM / (float(gradient.norm()) + 1e-6))  # torch's clip_grad_norm_ rule
        optimizer.param_groups[0].update(records[0]["optimizer"]["groups"][0]["settings"])  # the schedule's lr
        for parameter, piece in zip(model.parameters(), split_like(gradient, model), strict=True):
            parameter.grad = piece
        optimizer.step()
        travelled_ddp = steps[number][0]["params"] - first["params"]
        travelled_replay = parameters_to_vector(model.parameters()).detach() - first["params"]
        worst = max(worst, (lab4.relative(travelled_ddp, travelled_replay), number))
    return worst


def split_like(flat: torch.Tensor, model) -> list[torch.Tensor]:
    pieces, offset = [], 0
    for parameter in model.parameters():
        pieces.append(flat[offset : offset + parameter.numel()].view_as(parameter).clone())
        offset += parameter.numel()
    return pieces


# --- check 5: the checkpoint ----------------------------------------------------------------------------
def load_checkpoint(path: Path):
    """(the model's state dict from the file at path, or None; why it is unusable, or None)."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # not a torch file, or not safe to load
        return None, f"it does not load with torch.load(weights_only=True) ({type(error).__name__})"
    state = saved.get("model") if isinstance(saved, dict) and isinstance(saved.get("model"), dict) else saved
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        return None, "it holds no state_dict (a dict of tensors), neither as itself nor under the key 'model'"
    return state, None


def check_checkpoint(obs, steps) -> tuple[Verdict, dict | None]:
    """Who wrote --save, and whether a bare DigitsNet loads it; plus the weights it holds (keys without 'module.')."""
    path = (obs.out_dir / "model.pt").resolve()
    writers = [rank for rank in obs.ranks if any(e["kind"] == "save" and e["path"] == str(path) for e in obs.events.get(rank, []))]
    if not path.exists():
        if obs.finished:
            return verdict(5, "FAIL", "the job finished but wrote no file at --save"), None
        return verdict(5, "BLOCKED", f"no file at --save: the job {obs.ended()} before writing it"), None
    state, problem = load_checkpoint(path)
    if problem:
        return verdict(5, "FAIL", problem), None
    model, weights, evidence = lab4.load_into_bare_model(state, reference_model)
    if evidence:
        return verdict(5, "FAIL", evidence), weights
    if len(writers) > 1:
        return verdict(5, "FAIL", f"{named(writers)} each called torch.save on {path.name}: one file, {len(writers)} writers"), weights
    if steps and torch.equal(parameters_to_vector(model.parameters()), steps[0][0]["params"]):
        return verdict(5, "FAIL", "it holds the initial weights: training never reached the saved file"), weights
    who = "rank 0 alone wrote it" if writers == [0] else f"rank {writers[0]} wrote it" if writers else "no rank called torch.save on it"
    status = "PASS" if writers == [0] else "FAIL"
    return verdict(5, status, f"{who}; its 'model' loads into a bare DigitsNet (strict) and holds trained weights"), weights


# --- check 6: the printed accuracy ----------------------------------------------------------------------
def printed_accuracy(stdout: str) -> float | None:
    """The accuracy in the last line of output that reports one, as a fraction."""
    value = None
    for line in stdout.splitlines():
        match = ACCURACY.search(line)
        if match:
            number = float(match.group(1))
            value = number / 100 if match.group(2) or number > 1 else number
    return value


@torch.no_grad()
def count_correct(weights: dict, images: torch.Tensor, labels: torch.Tensor) -> int:
    model = reference_model()
    model.load_state_dict(weights)
    return int((model.eval()(images).argmax(dim=1) == labels).sum())


def last_held_out_reads(obs) -> dict[int, list[int]]:
    """{rank: the held-out images it read in its last pass over them}, for the ranks that read any."""
    reads = {rank: obs.batches(rank, "held_out", obs.passes(rank, "held_out") - 1) for rank in obs.ranks}
    return {rank: images for rank, images in reads.items() if images}


def scored_more_than_once(reads: dict[int, list[int]], total: int) -> str | None:
    """Which held-out images the last pass read more than once, in words, or None: DistributedSampler pads
    the held-out set to a multiple of the world size with repeats, and a slice written for another world
    size overlaps; either way the job's accuracy, summed over the ranks' slices, counts those images
    again. Not when one rank scored every image: it can print its own count (rank 0 alone scoring the
    set, or, wastefully, every rank scoring all of it), and the printed accuracy then says which."""
    if any(len(set(images)) == total for images in reads.values()):
        return None
    counts = collections.Counter(index for images in reads.values() for index in images)
    repeated = sorted(index for index, count in counts.items() if count > 1)
    if not repeated:
        return None
    first = repeated[0]
    readers = named(rank for rank, images in reads.items() if first in images)
    return f"in the last held-out pass {len(repeated)} of the {total} held-out images were scored more than once (image {first}: {readers}), so they count again in the accuracy"


def last_pass_buffers(obs) -> dict[int, dict]:
    """{rank: the BatchNorm buffers its DDP model held when its last held-out pass ended}, for the ranks the observer saw score."""
    found = {}
    for rank in obs.ranks:
        for event in obs.events.get(rank, []):
            if event["kind"] == "buffers":
                found[rank] = event["buffers"]  # the last one wins
    return found


def with_buffers(weights: dict, buffers: dict) -> dict:
    """weights, with the running statistics of one rank's BatchNorm layers (the observer's flat lists) in place of the saved ones."""
    own = dict(weights)
    for name, values in buffers.items():
        if name in own:
            own[name] = torch.tensor(values, dtype=own[name].dtype).reshape(own[name].shape)
    return own


def count_with_own_buffers(obs, weights, images, labels, reads) -> int | None:
    """Part A's count when the ranks scored with their own BatchNorm statistics (part B decides whose):
    each rank's images scored by the saved weights with that rank's own running statistics, summed over
    the ranks (or, where one rank scored every image, that rank's count). None when a rank's statistics
    were not seen."""
    buffers = last_pass_buffers(obs)
    whole = next((rank for rank, read in reads.items() if len(set(read)) == len(labels)), None)
    scorers = [whole] if whole is not None else list(reads)
    if not scorers or any(rank not in buffers for rank in scorers):
        return None
    return sum(count_correct(with_buffers(weights, buffers[rank]), images[torch.tensor(reads[rank])], labels[torch.tensor(reads[rank])]) for rank in scorers)


def check_job_metrics(obs, weights, held_out, blocked_by: str | None, own_buffers: bool = False) -> Verdict:
    """The last printed accuracy is the job's. own_buffers (part A, when the ranks' BatchNorm statistics
    differ): each rank's images are scored with its own statistics, as it scored them."""
    reported = printed_accuracy(obs.run.stdout)
    if reported is None:
        if obs.finished:
            return verdict(6, "FAIL", "the job printed no line with the word accuracy and a number (as in: held-out accuracy 0.9721)")
        return verdict(6, "BLOCKED", f"no accuracy was printed: the job {obs.ended()} before")
    if blocked_by:
        return verdict(6, "BLOCKED", blocked_by)
    images, labels = held_out.tensors
    reads = last_held_out_reads(obs)
    if twice := scored_more_than_once(reads, len(labels)):
        return verdict(6, "FAIL", twice)
    if weights is None:
        return verdict(6, "BLOCKED", "no usable weights at --save to recompute the accuracy from")
    if own_buffers:
        return check_own_buffers_accuracy(obs, weights, images, labels, reads, reported)
    correct, total = count_correct(weights, images, labels), len(labels)
    if abs(reported - correct / total) < 0.5 / total:
        shares = f"{', '.join(str(len(images)) for images in reads.values())} by {named(reads)}" if reads else "by no DataLoader the observer saw"
        return verdict(
            6,
            "PASS",
            f"the last printed accuracy {reported:.4f} is the saved model's on all {total} held-out images ({correct}/{total}), each scored once ({shares})",
        )
    whole = f"on all {total} held-out images it scores {correct / total:.4f} ({correct}/{total})"
    for rank in obs.ranks:
        seen = sorted(set(obs.batches(rank, "held_out", obs.passes(rank, "held_out") - 1)))
        if seen and len(seen) < total:
            shard = torch.tensor(seen)
            shard_correct = count_correct(weights, images[shard], labels[shard])
            if abs(reported - shard_correct / len(seen)) < 0.5 / len(seen):
                return verdict(
                    6,
                    "FAIL",
                    f"the last printed accuracy {reported:.4f} is the saved model's score on the {len(seen)} held-out images rank {rank} evaluated ({shard_correct}/{len(seen)}); {whole}",
                )
    return verdict(6, "FAIL", f"the last printed accuracy is {reported:.4f}, but {whole}")


def check_own_buffers_accuracy(obs, weights, images, labels, reads, reported: float) -> Verdict:
    """Check 6 in part A when the ranks scored with their own BatchNorm statistics (see count_with_own_buffers)."""
    total = len(labels)
    correct = count_with_own_buffers(obs, weights, images, labels, reads)
    if correct is None:
        return verdict(6, "BLOCKED", "the ranks scored with their own BatchNorm statistics, and the observer did not see every scoring rank's")
    shares = ", ".join(str(len(read)) for read in reads.values())
    if abs(reported - correct / total) < 0.5 / total:
        return verdict(6, "PASS", f"the last printed accuracy {reported:.4f} counts all {total} held-out images once ({correct}/{total}; {shares} by {named(reads)}), "
                                  "each rank's scored with its own BatchNorm statistics: which ones score the job is part B's (check 13)")  # fmt: skip
    return verdict(
        6,
        "FAIL",
        f"the last printed accuracy is {reported:.4f}, but the ranks' counts on their own images ({shares} by {named(reads)}) sum to {correct}/{total} = {correct / total:.4f}",
    )


# --- check 7: a clean exit ------------------------------------------------------------------------------
def check_clean_exit(obs) -> Verdict:
    collectives = lab4.check_collectives(obs)
    if collectives.status == "FAIL":
        # Lab 4's scripts take --timeout-s; a script here sets its process group's timeout itself.
        return verdict(7, "FAIL", collectives.evidence.replace("until --timeout-s", "until their process group's timeout"))
    if not obs.finished:
        return verdict(7, "FAIL", f"the job {obs.ended()}")
    if problem := teardown_problem(obs):
        return verdict(7, "FAIL", problem)
    return verdict(7, "PASS", f"{collectives.evidence} with exit status 0; every rank destroyed its process group after its DDP model was gone")


def teardown_problem(obs) -> str | None:
    """How a rank left its process group in a way that can make gloo abort at exit, or None.

    The observer records each destroy_process_group() and whether the rank's DDP model was still alive
    then, and whether the group was still open when the script ended (it then destroys the group itself,
    and its processes end with os._exit: the abort would not happen here, so it is judged from these)."""
    for rank in obs.ranks:
        events = obs.events.get(rank, [])
        alive = next((e for e in events if e["kind"] == "destroy" and e["default_group"] and e["ddp_model_alive"]), None)
        if alive:
            return (f"rank {rank} called destroy_process_group() while its DDP model was still alive (kept by a variable, or by "
                    "DDP's reference cycles that only gc.collect() frees): its process group outlives destroy, and gloo can abort "
                    "at exit (terminate called without an active exception)")  # fmt: skip
        if any(e["kind"] == "exit" and e.get("group_open") for e in events):
            return f"rank {rank}'s script ended with its process group still open: call destroy_process_group() at the end (after gc.collect())"
    return None


# --- check 8: clipping ----------------------------------------------------------------------------------
def check_clipping(obs, steps, reference, gradient_ok: bool) -> Verdict:
    if not steps:
        return verdict(8, "BLOCKED", f"no optimizer step was recorded on every rank: the job {obs.ended()}")
    clipped, first = 0, None
    for number, records in enumerate(steps, start=1):
        norms = []
        for rank, record in records.items():
            clips, backwards = record["clips"], len(record["micro_batches"])
            if not clips:
                return verdict(
                    8,
                    "FAIL",
                    f"rank {rank} made no clip_grad_norm_ call in step {number} (clip with torch.nn.utils.clip_grad_norm_, as labs/train_realistic.py does)",
                )
            if len(clips) > 1 or clips[0]["after_backwards"] != backwards:
                return verdict(
                    8,
                    "FAIL",
                    f"rank {rank} called clip_grad_norm_ {len(clips)} times in step {number}, the first after backward {clips[0]['after_backwards']} of {backwards}: it clipped a gradient not yet averaged over ranks, with its own norm",
                )
            clip = clips[0]
            if abs(clip["max_norm"] - CLIP_NORM) > 1e-12:
                return verdict(8, "FAIL", f"rank {rank} clipped to {clip['max_norm']:g}, not to --clip-norm {CLIP_NORM:g}")
            synced = record["micro_batches"][-1]["grad_after"] if record["micro_batches"] else None
            if clip["before"] is not None and synced is not None and lab4.relative(clip["before"], synced) > TOLERANCE:
                return verdict(
                    8,
                    "FAIL",
                    f"rank {rank}'s clip_grad_norm_ in step {number} was given other gradients than the step's last backward left (relative difference {lab4.relative(clip['before'], synced):.2f})",
                )
            coefficient = min(1.0, clip["max_norm"] / (clip["norm"] + 1e-6))
            if clip["before"] is not None and (
                lab4.relative(clip["after"], clip["before"] * coefficient) > TOLERANCE or lab4.relative(record["grads"], clip["after"]) > TOLERANCE
            ):
                return verdict(8, "FAIL", f"rank {rank}'s gradients in step {number} are not the clipped ones at the optimizer step")
            norms.append(clip["norm"])
        apart = next((rank for rank, norm in enumerate(norms) if abs(norms[0] - norm) > TOLERANCE * max(norms)), None)
        if apart is not None:
            return verdict(
                8, "FAIL", f"in step {number} rank 0 clipped with norm {norms[0]:.4f} and rank {apart} with {norms[apart]:.4f}: each clipped its own gradient"
            )
        clipped += norms[0] > CLIP_NORM
        first = first if first is not None else norms[0]
    evidence = (
        f"each of the {len(steps)} optimizer steps clipped once, after its all-reducing backward, with the same norm on every rank "
        f"({clipped} of {len(steps)} above --clip-norm {CLIP_NORM:g}; step 1: {first:.4f}"
    )  # fmt: skip
    if gradient_ok and reference.shapes_ok and not micro_batches_ok(steps[:1]):
        evidence += f", one process's global gradient: {float(reference.step_gradient(0).norm()):.4f}"
    return verdict(8, "PASS", evidence + ")")


# --- check 9: the learning-rate schedule ----------------------------------------------------------------
def one_process_schedule(train_size: int, steps: int, world_size: int) -> list[float]:
    """The starting script's learning rates for one process on the global batch (per step: world x batch x k samples)."""
    steps_per_epoch = math.ceil(train_size / (world_size * BATCH_SIZE * ACCUMULATION))
    total = EPOCHS * steps_per_epoch
    return [lr_at(step, total, WARMUP_STEPS, PEAK_LR) for step in range(steps)]


# The peak learning rate a conversion may choose: --lr as it is, or scaled with the global batch by
# lecture 1's rules (section 8): linearly (SGD) or by the square root (Adam). The schedule's shape must be one process's.
LR_SCALINGS = {"--lr": lambda n: 1.0, "--lr x N (linear scaling)": lambda n: float(n), "--lr x sqrt(N) (square-root scaling)": math.sqrt}


def lr_scaling(steps, expected: list[float], world_size: int) -> tuple[float, str]:
    """(factor, its name): the scaling of --lr under which rank 0's learning rates follow one process's
    schedule (expected, unscaled) for the most steps, at least the first two; (1, '--lr') when none does.
    One step alone can match by chance: a scheduler stepped with every micro-batch reaches 3 x the first
    warm-up rate at the first optimizer step, which is the linear rule's at 3 ranks."""
    lrs = [records[0]["optimizer"]["groups"][0]["settings"].get("lr") for records in steps]
    best = (1.0, "--lr", 0)
    for name, rule in LR_SCALINGS.items():
        factor = rule(world_size)
        followed = 0
        for lr, wanted in zip(lrs, expected):
            if not (isinstance(lr, float) and abs(lr - factor * wanted) <= 1e-9 * factor * PEAK_LR):
                break
            followed += 1
        if followed >= min(2, len(lrs)) and followed > best[2]:
            best = (factor, name, followed)
    return best[0], best[1]


def check_lr_schedule(obs, steps, train_size: int) -> Verdict:
    if not steps:
        return verdict(9, "BLOCKED", f"no optimizer step was recorded on every rank: the job {obs.ended()}")
    one_process = one_process_schedule(train_size, len(steps), obs.world_size)
    factor, peak = lr_scaling(steps, one_process, obs.world_size)
    expected = [factor * lr for lr in one_process]
    for number, records in enumerate(steps, start=1):
        for rank, record in records.items():
            lr = record["optimizer"]["groups"][0]["settings"].get("lr")
            if not isinstance(lr, float) or abs(lr - expected[number - 1]) > 1e-9 * factor * PEAK_LR:
                shown = ", ".join(f"{r[rank]['optimizer']['groups'][0]['settings'].get('lr', float('nan')):.2e}" for r in steps[:6])
                wanted = ", ".join(f"{value:.2e}" for value in expected[:6])
                return verdict(
                    9,
                    "FAIL",
                    f"rank {rank}'s learning rate at optimizer step {number} is {lr:.3e}, one process's is {expected[number - 1]:.3e} (steps 1-6: {shown}; one process: {wanted})",
                )
    return verdict(
        9,
        "PASS",
        f"at each of the {len(steps)} optimizer steps every rank's learning rate is one process's schedule on the global batch (warm-up over {WARMUP_STEPS} steps to the peak {peak} = {factor * PEAK_LR:.3g}, then a cosine)",
    )


# --- check 10: accumulation -----------------------------------------------------------------------------
def check_accumulation(obs, steps) -> Verdict:
    if not steps:
        return verdict(10, "BLOCKED", f"no optimizer step was recorded on every rank: the job {obs.ended()}")
    micro_batches = 0
    for number, records in enumerate(steps, start=1):
        for rank, record in records.items():
            count, forwards = len(record["micro_batches"]), record["forwards"]
            micro_batches += count if rank == 0 else 0
            if count != ACCUMULATION and not (number % (len(steps) // EPOCHS) == 0 and 0 < count < ACCUMULATION):
                return verdict(10, "FAIL", f"optimizer step {number} ran {count} micro-batch(es) on rank {rank}, not --accumulation {ACCUMULATION}")
            if forwards["synced"] + forwards["unsynced"] == 0:
                return verdict(10, "BLOCKED", "no forward of a DistributedDataParallel model was seen: no all-reduce to count")
            if forwards["synced"] != 1:
                return verdict(
                    10,
                    "FAIL",
                    f"in optimizer step {number} rank {rank} ran {forwards['synced']} backward passes that all-reduce (of {count} micro-batches): the gradient is correct (check 4), but it costs {forwards['synced']} x the communication of one all-reduce per optimizer step",
                )
            if not record["micro_batches"][-1]["synced"]:
                return verdict(
                    10,
                    "FAIL",
                    f"in optimizer step {number} the all-reducing backward on rank {rank} was not the last micro-batch's: the later ones' gradients stayed local",
                )
    short = sorted({len(record["micro_batches"]) for records in steps for record in records.values()} - {ACCUMULATION})
    remainder = f" (an epoch's last: {', '.join(map(str, short))})" if short else ""
    return verdict(
        10,
        "PASS",
        f"every optimizer step ran {ACCUMULATION} micro-batches on each rank{remainder} and only the last one's backward all-reduced: {len(steps)} all-reduces for {len(steps)} optimizer steps ({micro_batches} micro-batches per rank)",
    )


# --- check 11: the printed loss -------------------------------------------------------------------------
def check_printed_loss(obs, steps, reference) -> Verdict:
    lines = {rank: [(int(m.group(1)), m.group(2)) for m in map(LOSS_LINE.search, stdout_of(obs, rank).splitlines()) if m] for rank in obs.ranks}
    speakers = [rank for rank, found in lines.items() if found]
    if not speakers:
        if obs.finished:
            return verdict(11, "FAIL", "no rank printed a line with 'step N' and 'loss X' (as in: step 10: train loss 0.4321)")
        return verdict(11, "BLOCKED", f"no loss line was printed: the job {obs.ended()}")
    if len(speakers) > 1:
        return verdict(11, "FAIL", f"{named(speakers)} each printed {len(lines[speakers[1]])} loss lines: one line per job, from one rank")
    if not reference.shapes_ok or micro_batches_ok(steps):
        return verdict(11, "BLOCKED", "the micro-batches cannot be recomputed (see check 4)")
    speaker, previous = speakers[0], 0
    for step, text in lines[speaker]:
        if not 0 < step <= len(steps) or step <= previous:
            return verdict(11, "FAIL", f"rank {speaker} printed a loss for step {step}, which is not a step the job made after the previous line's")
        losses = {rank: torch.cat([reference.losses(s, rank, j) for s in range(previous, step) for j in range(len(steps[s][rank]["micro_batches"]))])
                  for rank in obs.ranks}  # fmt: skip
        job = float(torch.cat(list(losses.values())).double().mean())
        printed = float(text)
        decimals = len(text.split(".")[1])
        tolerance = 0.5 * 10**-decimals + 1e-5 * abs(job)  # half a unit of the last printed digit, plus float32 recomputation
        if abs(printed - job) > tolerance:
            own = float(losses[speaker].double().mean())
            if abs(printed - own) <= tolerance:
                return verdict(
                    11,
                    "FAIL",
                    f"the loss printed at step {step}, {text}, is rank {speaker}'s own samples' mean; over every rank's samples since the last line it is {job:.{decimals}f}",
                )
            return verdict(11, "FAIL", f"the loss printed at step {step} is {text}; over every rank's samples since the last line it is {job:.{decimals}f}")
        previous = step
    return verdict(
        11,
        "PASS",
        f"rank {speaker} alone printed the loss, {len(lines[speaker])} times, each the mean over every rank's samples since the line before (within half a unit of its last digit)",
    )


# --- check 12: resume -----------------------------------------------------------------------------------
def steps_before_resume(obs) -> int:
    """How many optimizer steps rank 0 of the straight run made before the epoch the resumed run starts with."""
    return sum(e["kind"] == "step" and e["epoch"] < RESUME_AFTER_EPOCH for e in obs.events.get(0, []))


def resumed_state_differs(straight_record: dict, resumed_record: dict) -> str | None:
    """What differs between a rank's first resumed step and the straight run's step at the same point, or None."""
    weights = lab4.relative(straight_record["params"], resumed_record["params"])
    if weights > REPLICA_TOLERANCE:
        return f"other weights than the straight run's (relative difference {weights:.1e})"
    lrs = [record["optimizer"]["groups"][0]["settings"].get("lr") for record in (straight_record, resumed_record)]
    if lrs[0] != lrs[1] and not (isinstance(lrs[0], float) and isinstance(lrs[1], float) and abs(lrs[0] - lrs[1]) <= 1e-9 * abs(lrs[0])):
        return f"the learning rate {lrs[1]:.3e}, not the straight run's {lrs[0]:.3e} (the scheduler's state)"
    norms = [record.get("optimizer_state_norm", 0.0) for record in (straight_record, resumed_record)]
    if abs(norms[0] - norms[1]) > REPLICA_TOLERANCE * max(norms[0], 1e-12):
        return f"another optimizer state than the straight run's (its norm {norms[1]:.4g}, not {norms[0]:.4g}: AdamW's moments and step counts)"
    return None


def check_resume(straight, resumed, replicas_ok: bool, straight_steps=None) -> Verdict:
    """Every rank's first step of the resumed run starts from the state the straight run had at that point
    (weights, learning rate, optimizer state), however the state got there (each rank's torch.load, or rank
    0's load and a broadcast), and the resumed run ends on the straight run's weights."""
    if not straight.finished:
        return verdict(12, "BLOCKED", f"the first run {straight.ended()}, so no second run resumed from it")
    if not first_checkpoint(straight.out_dir).exists():
        return verdict(12, "BLOCKED", "rank 0 of the first run wrote no checkpoint to resume from")
    saved = str((straight.out_dir / "model.pt").resolve())
    first_save = next((e for e in straight.events.get(0, []) if e["kind"] == "save" and e["path"] == saved), None)
    if first_save is not None and first_save.get("epoch", 0) != RESUME_AFTER_EPOCH - 1:
        return verdict(
            12,
            "FAIL",
            f"rank 0 first wrote --save during epoch {first_save['epoch'] + 1}, not at the end of epoch {RESUME_AFTER_EPOCH}: a checkpoint every epoch is what a resume starts from",
        )
    if not replicas_ok:
        return verdict(12, "BLOCKED", "the first run's replicas differ (check 3): a resume from rank 0's file cannot follow them")
    if not resumed.finished:
        return verdict(12, "FAIL", f"the run with --resume {resumed.ended()}")
    target = str((resumed.out_dir / "model.pt").resolve())
    loaded = []
    for rank in resumed.ranks:
        loads = [e for e in resumed.events.get(rank, []) if e["kind"] == "load" and e["path"] == target]
        if loads and loads[0]["map_location"] is None:
            return verdict(
                12,
                "FAIL",
                f"rank {rank} loaded the checkpoint without map_location: on GPUs every rank would put the tensors saved from cuda:0 on cuda:0 (the CPU cannot show it; the checker reads the argument)",
            )
        loaded += [rank] if loads else []
    straight_steps = recorded_steps(straight) if straight_steps is None else straight_steps
    resumed_steps, before = recorded_steps(resumed), steps_before_resume(straight)
    if not resumed_steps:
        return verdict(12, "FAIL", "the run with --resume made no optimizer step on every rank")
    if len(straight_steps) <= before:
        return verdict(12, "BLOCKED", f"the straight run recorded no step after epoch {RESUME_AFTER_EPOCH} to compare the resumed run with")
    # Step by step: a scheduler that was not restored still starts at the saved learning rate (the
    # optimizer's state holds it), and shows only at the resumed run's second step.
    for number, (records, straight_records) in enumerate(zip(resumed_steps, straight_steps[before:]), start=before + 1):
        for rank in records:
            differs = resumed_state_differs(straight_records[rank], records[rank])
            if differs:
                how = "loaded the checkpoint" if rank in loaded else "never loaded the checkpoint (and was not sent its contents)"
                return verdict(
                    12,
                    "FAIL",
                    f"rank {rank} {how}, but at optimizer step {number} the resumed run had {differs}: every rank must go on from rank 0's file, model, optimizer and scheduler",
                )
    straight_state, problem = load_checkpoint(straight.out_dir / "model.pt")
    resumed_state, problem_resumed = load_checkpoint(resumed.out_dir / "model.pt")
    if problem or problem_resumed:
        return verdict(12, "BLOCKED", "a final checkpoint is unusable (check 5)")
    difference = max(
        lab4.relative(straight_state[name].double(), resumed_state[name].double()) for name in straight_state if straight_state[name].is_floating_point()
    )
    if difference > REPLICA_TOLERANCE:
        return verdict(
            12,
            "FAIL",
            f"resumed after epoch {RESUME_AFTER_EPOCH}, the run ends on other weights than the run that went straight through (relative difference {difference:.1e})",
        )
    received = [rank for rank in resumed.ranks if rank not in loaded]
    how = f"{named(loaded)} loaded rank 0's checkpoint of epoch {RESUME_AFTER_EPOCH} (map_location given: checked as present only, the CPU cannot show which device it names)"
    if received:
        how += f", {named(received)} received its contents"
    return verdict(
        12,
        "PASS",
        f"{how}; at each optimizer step from step {before + 1} on, every rank had the straight run's weights, learning rate and optimizer state, and the run ended on the straight run's weights (relative difference {difference:.0e})",
    )


# --- check 13: BatchNorm's buffers ----------------------------------------------------------------------
def buffer_difference(mine: dict, theirs: dict) -> tuple[str, float] | None:
    """(the first buffer that differs, its relative difference) between two {name: values}, or None."""
    for name, values in mine.items():
        if name not in theirs:
            continue
        off = lab4.relative(torch.tensor(values), torch.tensor(theirs[name]))
        if off > REPLICA_TOLERANCE:
            return name, off
    return None


def check_batchnorm(obs, saved_weights: dict | None = None) -> Verdict:
    """The model that scored the held-out images is the one rank 0 saves: in each held-out pass every rank
    that scored (one rank, or all of them) held the same BatchNorm statistics when its pass ended, and in
    the last pass they are the ones in the checkpoint at --save."""
    by_pass: dict[int, dict[int, dict]] = {}
    for rank in obs.ranks:
        for event in obs.events.get(rank, []):
            if event["kind"] == "buffers":
                by_pass.setdefault(event["epoch"], {})[rank] = event["buffers"]
    if not by_pass:
        if not obs.finished:
            return verdict(13, "BLOCKED", f"no held-out pass of a DDP model was seen: the job {obs.ended()}")
        return verdict(13, "BLOCKED", "no pass over the held-out digits was seen while a DistributedDataParallel model existed")
    for number, scored in sorted(by_pass.items()):
        first = min(scored)
        for rank, buffers in sorted(scored.items()):
            different = buffer_difference(scored[first], buffers)
            if different:
                name, off = different
                saves = ", which are the ones rank 0 saves" if first == 0 else ""
                return verdict(
                    13,
                    "FAIL",
                    f"in held-out pass {number} rank {rank} scored with other BatchNorm statistics than rank {first}{saves} ({name}: relative difference {off:.1e}): the ranks scored different models",
                )
    last = by_pass[max(by_pass)]
    scorers = named(sorted(last))
    if saved_weights is not None:
        saved = {name: value.reshape(-1).double().tolist() for name, value in saved_weights.items() if "running" in name}
        different = buffer_difference(last[min(last)], saved)
        if different:
            name, off = different
            return verdict(
                13,
                "FAIL",
                f"the last held-out pass ({scorers}) scored with other BatchNorm statistics than the checkpoint at --save holds ({name}: relative difference {off:.1e}): the printed accuracy is not the saved model's",
            )
    names = [name for name in last[min(last)] if "running" in name]
    who = f"{scorers} scored" if len(last) == 1 else f"{scorers} all scored"
    return verdict(
        13,
        "PASS",
        f"in each of the {len(by_pass)} held-out passes {who} with the same BatchNorm statistics ({len(names)} running buffers), in the last the ones rank 0 saves",
    )


# --- all checks -----------------------------------------------------------------------------------------
def check(script: Path, out_dir: Path, job_timeout_s: float = JOB_TIMEOUT_S, part: str = "B"):
    """Run script under observation (two runs, one launch) and decide the checks of `part`, in order."""
    straight, resumed = observe(script, out_dir, job_timeout_s)
    return (straight, resumed), judge(straight, resumed, part)


def judge(straight, resumed, part: str = "B") -> list[Verdict]:
    """The verdicts on one observed job (its straight and resumed runs), in order: all thirteen for part
    B (the default), part A's eight (PART_A_CHECKS) for part "A".

    The recomputation runs on one thread, as each rank did: many small matrices gain nothing from
    more, and on a loaded machine OpenMP's threads only wait for each other (5x slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        verdicts = judge_runs(straight, resumed, part)
    finally:
        torch.set_num_threads(threads)
    return [v for v in verdicts if v.number in PART_A_CHECKS] if part == "A" else verdicts


# A script that trains no DDP model passes some checks by doing nothing: with the same seed on every rank
# its replicas agree, its clean exit makes no collective, it clips and reshuffles as the one-process
# script did; a hand-written wrapper (lab 6's) even keeps the replicas equal while it sums gradients
# without dividing. The checks read DDP's own behaviour, so without a DDP model check 4 FAILs with
# that one reason, and every check that would have passed becomes BLOCKED.
NOT_CONVERTED = (
    "no rank trained a torch.nn.parallel.DistributedDataParallel model (no forward of one before an optimizer step): "
    "the checks judge DDP's gradient averaging, so a script without it (the one-process script, or a hand-written wrapper) "
    "is not a conversion yet; wrap the model in DistributedDataParallel (checks 1 and 5 say where else to start)"
)
NOT_CONVERTED_BLOCKED = "no rank trained a DistributedDataParallel model (check 4): passing this check proves nothing yet"


def trained_ddp(steps) -> bool:
    """Whether any rank's recorded micro-batches went through a DDP model's forward (synchronised or not)."""
    return any(record["forwards"]["synced"] + record["forwards"]["unsynced"] for records in steps for record in records.values())


def judge_runs(straight, resumed, part: str = "B") -> list[Verdict]:
    steps = recorded_steps(straight)  # read once: loading the step files is half of judging's time
    verdicts = judge_each_check(straight, resumed, steps, part)
    if steps and not trained_ddp(steps):
        return [
            verdict(4, "FAIL", NOT_CONVERTED) if v.number == 4 else verdict(v.number, "BLOCKED", NOT_CONVERTED_BLOCKED) if v.status == "PASS" else v
            for v in verdicts
        ]
    return verdicts


def judge_each_check(straight, resumed, steps, part: str = "B") -> list[Verdict]:
    """The thirteen verdicts; steps: recorded_steps(straight). In part A, BatchNorm (check 13) is part B's
    decision: ranks that score with their own statistics do not block check 6, which then scores each
    rank's images with that rank's statistics."""
    splits = lab4.digits()  # loaded once per process
    reference = Reference(steps)
    replicas = check_equal_replicas(straight, steps)
    checkpoint, weights = check_checkpoint(straight, steps)
    clipping_first = check_clipping(straight, steps, reference, gradient_ok=False)
    schedule = check_lr_schedule(straight, steps, len(splits.train))
    others = {3: replicas.status == "PASS", 8: clipping_first.status == "PASS", 9: schedule.status == "PASS"}
    gradient = check_global_gradient(straight, steps, reference, others)
    clipping = check_clipping(straight, steps, reference, gradient_ok=gradient.status == "PASS") if clipping_first.status == "PASS" else clipping_first
    batchnorm = check_batchnorm(straight, weights)
    if replicas.status != "PASS" and steps:
        metrics_blocked = "the ranks' weights differ (check 3): no one model's accuracy is the job's"
    elif batchnorm.status == "FAIL" and part != "A":
        metrics_blocked = "the ranks scored with different BatchNorm statistics (check 13): no one model's accuracy is the job's"
    else:
        metrics_blocked = None
    return [
        check_data_split(straight, len(splits.train)),
        renumbered(2, lab4.check_epoch_shuffle(straight)),
        replicas,
        gradient,
        checkpoint,
        check_job_metrics(straight, weights, splits.test, metrics_blocked, own_buffers=part == "A" and batchnorm.status == "FAIL"),
        check_clean_exit(straight),
        clipping,
        schedule,
        check_accumulation(straight, steps),
        check_printed_loss(straight, steps, reference),
        check_resume(straight, resumed, replicas_ok=replicas.status != "FAIL", straight_steps=steps),
        batchnorm,
    ]


def main(argv=None) -> int:
    parser = checker_parser(
        "lab3_convert_check.py",
        "Check your DDP version of labs/train_realistic.py by running it on 2 CPU ranks (see the docstring).",
        DEFAULT_SCRIPT,
        f"your DDP script (default {DEFAULT_SCRIPT}); it must keep labs/train_realistic.py's flags, with --batch-size per process",
    )
    parser.add_argument(
        "--job-timeout-s", type=positive_float, default=JOB_TIMEOUT_S, metavar="SECONDS",
        help=f"kill the whole job (both runs) after this many seconds (default {JOB_TIMEOUT_S}; more on a slow machine)",
    )  # fmt: skip
    parser.add_argument(
        "--part", choices=["A", "B"], default="B",
        help="A: part A's eight checks (lab 3 section 7), the others said to wait for part B; B (default): all thirteen (part B, lecture 6 section 9)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    start_hint = " (start with: cp labs/train_realistic.py labs/my_ddp.py, then make it a DDP script)"
    script = script_to_check(parser, args.script, start_hint if args.script == DEFAULT_SCRIPT else "")

    shown = " ".join([*SCRIPT_ARGS, "--save", "<temporary folder>/model.pt"])
    judged = f", part A ({len(PART_A_CHECKS)} of its {len(CHECKS)} checks)" if args.part == "A" else ""
    print(
        f"lab 3 conversion checker{judged}: {args.script} on {WORLD_SIZE} gloo ranks ({NODES} one-process nodes), {shown}; then again with --resume", flush=True
    )
    with tempfile.TemporaryDirectory(prefix="lab3_check_") as out_dir:
        (straight, resumed), verdicts = check(script, Path(out_dir), args.job_timeout_s, args.part)
        if args.show_output:
            for name, obs in (("first run", straight), ("resumed run", resumed)):
                print(f"--- the script's stdout, {name}\n{obs.run.stdout}--- its stderr\n{obs.run.stderr}--- end of the script's output")
    print(f"the first run {straight.ended()}; the resumed run {resumed.ended()}")
    if args.part == "A":
        return print_part_a(verdicts)
    return print_verdicts(verdicts)


def print_part_a(verdicts: list[Verdict]) -> int:
    """Part A's lines in check order, a WAITS line for each part-B check, the result line of part A's
    checks and how many wait; the exit status: 0 when every part-A check passed."""
    lines = {v.number: v.line() for v in verdicts} | {number: waiting_line(number) for number in PART_B_CHECKS}
    for number in sorted(lines):
        print(lines[number])
    result, status = summary(verdicts)
    print(f"{result} of part A; {len(PART_B_CHECKS)} checks wait for part B ({PART_B_HOME})")
    return status


if __name__ == "__main__":
    sys.exit(main())
