"""Lab 4 checker: run a DDP training script on 2 CPU ranks, watch what it does, judge seven checks.

    python labs/lab4_check.py                            # checks labs/lab4_broken_ddp.py
    python labs/lab4_check.py path/to/your_fixed_copy.py
    python labs/lab4_check.py --show-output SCRIPT       # also print what the script itself printed
    python labs/lab4_check.py --job-timeout-s 120 SCRIPT # a slow machine: give the whole job longer

The script runs under torchrun with 2 gloo ranks on the CPU, launched through ddp_course/checking/observer.py,
which records every batch each rank read, the first optimizer steps' parameters and gradients, and
every collective called from Python. The checker never reads the script's source: each verdict
comes from what the run did, from the file it saved, and from the metrics it reported, which the
checker recomputes. The script must accept the lab's flags (--epochs, --batch-size, --lr, --seed,
--backend, --timeout-s, --save, --metrics-json), train ddp_course.models.DigitsCNN on
ddp_course.data.load_digits() and read its data with DataLoaders in the main process.

One line per check: PASS, FAIL with the evidence and a hint about the concept involved, or BLOCKED
with the reason the check could not be observed (the job died before it). Exit status 0 only when
all seven pass. A job that hangs is stopped: the script gets a short --timeout-s, and the whole run
is killed after --job-timeout-s seconds (default JOB_TIMEOUT_S). A check takes about 20 s on a quiet
2-core CPU.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from ddp_course.checking.front_end import checker_parser, print_verdicts, script_to_check
from ddp_course.checking.verdict import Verdict
from ddp_course.cli import positive_float
from ddp_course.data import DatasetSplits, load_digits
from ddp_course.launch import LAUNCH_LOG_VARIABLE, RunResult, append_to_launch_log, free_port, run_torchrun
from ddp_course.models import DigitsCNN
from ddp_course.cluster.multinode import agent_command, run_agents

OBSERVER = Path(__file__).resolve().parent / "observer.py"
DEFAULT_SCRIPT = "labs/lab4_broken_ddp.py"
WORLD_SIZE = 2
BATCH_SIZE = 128  # per rank: 6 steps per epoch with a correct split, 12 without one
# Two epochs show whether the second one is shuffled anew; 6 to 12 steps of 256 samples at the lab's
# learning rate keep even the broken script's loss finite, so its run reaches the end. --timeout-s
# stays above observer.STALL_S, so that an unmatched collective is recorded before gloo gives up.
SCRIPT_ARGS = ["--epochs", "2", "--batch-size", str(BATCH_SIZE), "--lr", "0.05", "--seed", "0", "--backend", "gloo", "--timeout-s", "10"]
JOB_TIMEOUT_S = 60  # the script's own --timeout-s ends a hung collective long before this
# Checks 2 and 7 compare gradients with a tolerance derived from the numbers compared: see rounding_tolerance.
FLOAT32_UNIT_ROUNDOFF = 2.0**-24  # each float32 operation is exact to within this relative error

CHECKS = {
    1: ("data-split", "DDP averages gradients, it does not split the data: in every epoch each rank must read its own share of the samples"),
    2: ("fresh-gradients", "backward() adds to the .grad already there: each optimizer step must start from empty gradients"),
    3: ("saved-model", "DDP wraps your model and names its tensors after the wrapper: save what a bare model (for inference or a new job) can load"),
    4: ("epoch-shuffle", "a distributed sampler shuffles with a seed and the epoch number; if it never learns the epoch, every epoch repeats the first one's order"),
    5: ("collectives", "a collective finishes only when every rank of the group calls it, in the same order; a collective in a branch that some ranks skip leaves the others waiting (TORCH_DISTRIBUTED_DEBUG=DETAIL names both calls; on gloo, try it on a small reproduction without DDP)"),
    6: ("reported-accuracy", "each rank scores only its slice of the held-out set: the job's accuracy needs every rank's counts"),
    7: ("gradient-scale", "DDP's all-reduce already averages the gradients over ranks; any extra scaling of the loss changes every step's size"),
}  # fmt: skip


# How lab 4's lines look: one-digit numbers, names padded to its longest (reported-accuracy).
LINE_FORMAT = {"name_width": 18, "number_width": 1}


def verdict(number: int, status: str, evidence: str) -> Verdict:
    """Check `number`'s verdict (ddp_course.checking's one type), with its name and hint from CHECKS."""
    name, hint = CHECKS[number]
    return Verdict(name, status, evidence, hint=hint, number=number)


@dataclass
class Observation:
    """What one observed run left behind."""

    run: RunResult
    out_dir: Path
    events: dict[int, list[dict]] = field(default_factory=dict)  # rank -> its events, in order
    timeout_s: float | None = None  # the job's time limit; None: JOB_TIMEOUT_S
    world_size: int = WORLD_SIZE  # how many ranks the job ran: the launch's, never assumed by a check

    @property
    def ranks(self) -> range:
        return range(self.world_size)

    @property
    def finished(self) -> bool:
        return self.run.ok

    @property
    def limit_s(self) -> float:
        return JOB_TIMEOUT_S if self.timeout_s is None else self.timeout_s

    def ended(self) -> str:
        """How the job ended, in words that fit after 'the job'."""
        if self.run.timed_out:
            return f"hung and was killed after {self.limit_s:g} s"
        if self.run.ok:
            return "finished"
        return f"died (exit status {self.run.returncode}: {failure_reason(self.run.stderr)})"

    def batches(self, rank: int, role: str, epoch: int) -> list[int]:
        """Sample indices rank read from the train or held-out set in that pass, in order."""
        found = []
        for event in self.events.get(rank, []):
            if event["kind"] == "batch" and event["role"] == role and event["epoch"] == epoch:
                found.extend(event["indices"])
        return found

    def passes(self, rank: int, role: str) -> int:
        return 1 + max((e["epoch"] for e in self.events.get(rank, []) if e["kind"] == "batch" and e["role"] == role), default=-1)

    def final_states(self) -> dict[int, dict | None]:
        """Each rank's last published state (what it was doing when the job ended)."""
        states = {}
        for rank in self.ranks:
            path = self.out_dir / f"state-r{rank}.json"
            states[rank] = json.loads(path.read_text()) if path.exists() else None
        return states

    def step_record(self, rank: int, step: int) -> dict | None:
        path = self.out_dir / f"step-r{rank}-{step}.pt"
        return torch.load(path, weights_only=True) if path.exists() else None


def failure_reason(stderr: str) -> str:
    """The script's own error line, or the first exception a rank printed."""
    for pattern in (
        r"^\S+\.py: error: (.*)$",
        r"^\[rank\d+\]: ([\w.]+(?:Error|Exception): .*)$",
        r"^([\w.]+(?:Error|Exception): .*)$",
    ):  # [\w.]: _pickle.PicklingError too
        found = [re.sub(r"^(\w+: )\[[^\]]*\]\s*", r"\1", line)[:200] for line in re.findall(pattern, stderr, flags=re.MULTILINE)]
        if found:  # a rank that timed out says why; its peer may only see the connection it left
            return next((line for line in found if "Timed out" in line), found[0])
    return "no error message"


@functools.cache
def digits() -> DatasetSplits:
    """The digits splits, loaded once per process: scikit-learn's import and its CSV cost about a second."""
    return load_digits()


def save_digits(path: Path) -> Path:
    """Write the digits tensors for the observed ranks, which read them instead of importing scikit-learn."""
    splits = digits()
    torch.save({"train": splits.train.tensors, "test": splits.test.tensors, "num_classes": splits.num_classes}, path)
    return path


def default_script_args(out_dir: Path) -> list:
    """Lab 4's flags for the checked script, which writes its model and metrics into out_dir."""
    return [*SCRIPT_ARGS, "--save", out_dir / "model.pt", "--metrics-json", out_dir / "metrics.json"]


def run_job(script: Path, args, nodes: int, timeout_s: float, env: dict, world_size: int = WORLD_SIZE) -> RunResult:
    """script under torchrun on world_size ranks: one node (--standalone), or `nodes` nodes on this host.

    Several nodes are several torchrun agents (--nnodes=nodes, world_size // nodes processes each)
    that meet at a c10d rendezvous on 127.0.0.1 at a free port, as the machines of a multi-node job
    do (ddp_course/cluster/multinode.py). On two one-process nodes LOCAL_RANK is 0 on both ranks while RANK is
    0 and 1: a script that uses LOCAL_RANK where it means RANK shows it. One RunResult for the job:
    the agents' outputs one after the other, the first non-zero exit status, timed out if any agent was.
    """
    if nodes == 1:
        return run_torchrun(script, args, nproc=world_size, timeout_s=timeout_s, env=env)
    if world_size % nodes:
        raise ValueError(f"{world_size} ranks do not split evenly over {nodes} nodes")
    port = free_port()
    command = agent_command(script, args, nnodes=str(nodes), nproc=world_size // nodes, endpoint=f"127.0.0.1:{port}", rdzv_id=f"observed{port}")
    # The first agent hosts the rendezvous store; the other starts once it listens.
    agents = run_agents([command] * nodes, timeout_s, env=env, stagger_host=("127.0.0.1", port))
    timed_out = any(agent.timed_out for agent in agents)
    status = None if timed_out else next((agent.returncode for agent in agents if agent.returncode), 0)
    run = RunResult(
        command=[*agents[0].command, f"(and {nodes - 1} more agent{'s' if nodes > 2 else ''} with the same command)"], returncode=status,
        stdout="".join(agent.stdout for agent in agents), stderr="".join(agent.stderr for agent in agents),
        wall_s=max(agent.wall_s for agent in agents), timed_out=timed_out,
    )  # fmt: skip
    if os.environ.get(LAUNCH_LOG_VARIABLE):  # counted like any launch (ddp_course/launch.py)
        append_to_launch_log(os.environ[LAUNCH_LOG_VARIABLE], run)
    return run


def observe(script: Path, out_dir: Path, rescue: bool = True, script_args=None, env=None, timeout_s=None, nodes: int = 1) -> Observation:
    """Run script on WORLD_SIZE observed ranks. By default with lab 4's flags, on one node; another
    checker passes its own script_args (the whole list), extra environment variables, time limit and
    number of nodes (see run_job)."""
    if script_args is None:
        script_args = default_script_args(out_dir)
    env = {
        "CUDA_VISIBLE_DEVICES": "", "LAB4_OBSERVE_RESCUE": "1" if rescue else "0",
        "LAB4_OBSERVE_DIGITS": str(save_digits(Path(out_dir) / "digits.pt")),  # the same tensors, about 2 CPU-seconds less per job
        **(env or {}),
    }  # fmt: skip
    limit_s = JOB_TIMEOUT_S if timeout_s is None else timeout_s
    run = run_job(OBSERVER, [out_dir, script, *script_args], nodes, limit_s, env)
    observation = Observation(run, out_dir, timeout_s=limit_s)
    read_events(observation)
    return observation


def read_events(observation: Observation) -> None:
    """Each rank's events, from the files the observer wrote in the run's folder."""
    for rank in observation.ranks:
        path = observation.out_dir / f"events-r{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        observation.events[rank] = [event for event in map(parse_event, lines) if event is not None]


def observe_runs(runs: list[dict], folder: Path, timeout_s: float, nodes: int = 1, env=None, world_size: int = WORLD_SIZE) -> dict:
    """{name: Observation} of several runs observed one after another in ONE launch (the observer's --runs),
    on world_size ranks over `nodes` nodes (see run_job).

    runs: [{"name", "out_dir", "script", "args", "env" (the run's own LAB4_OBSERVE_* settings),
    "copy" (optional [[source, target]], done before the run)}]; each Observation is what observe()
    would have given for that run alone: its own output and exit status, read from its out_dir.
    """
    runs_file = folder / "runs.json"
    runs_file.write_text(json.dumps([{**run, "out_dir": str(run["out_dir"]), "script": str(run["script"]), "args": [str(a) for a in run["args"]]}
                                     for run in runs], indent=1))  # fmt: skip
    env = {"CUDA_VISIBLE_DEVICES": "", "LAB4_OBSERVE_RESCUE": "1", "LAB4_OBSERVE_DIGITS": str(save_digits(folder / "digits.pt")), **(env or {})}
    launch = run_job(OBSERVER, ["--runs", runs_file], nodes, timeout_s, env, world_size)
    return {run["name"]: run_observation(launch, Path(run["out_dir"]), timeout_s, world_size) for run in runs}


def run_observation(launch: RunResult, out_dir: Path, timeout_s: float, world_size: int = WORLD_SIZE) -> Observation:
    """One run's Observation from a --runs launch: its own output and exit status, as if it had had a launch of its own."""
    ranks = range(world_size)
    statuses = [json.loads(path.read_text()) if (path := out_dir / f"status-r{rank}.json").exists() else None for rank in ranks]
    reached = all(statuses)
    skipped = next((s["skipped"] for s in statuses if s and s.get("skipped")), None)
    status = next((s["status"] for s in statuses if s and s["status"]), 0) if reached else launch.returncode

    def read(stream):  # every rank's, as torchrun would have collected them
        return "".join(path.read_text() for rank in ranks if (path := out_dir / f"{stream}-r{rank}.txt").exists())

    if skipped:
        why = f"RuntimeError: this run was skipped: {skipped}\n"
    elif not reached:
        why = f"RuntimeError: this run did not finish (an earlier run failed?)\n{launch.stderr}"
    else:
        why = ""
    run = RunResult(
        command=[*launch.command, f"(run {out_dir.name})"], returncode=1 if skipped else status, stdout=read("stdout"),
        stderr=read("stderr") + why, wall_s=max(s["wall_s"] for s in statuses) if reached else launch.wall_s,
        timed_out=launch.timed_out and not reached,
    )  # fmt: skip
    observation = Observation(run, out_dir, timeout_s=timeout_s, world_size=world_size)
    read_events(observation)
    return observation


def parse_event(line: str) -> dict | None:
    try:
        return json.loads(line)
    except ValueError:
        return None  # half a line, from a rank killed while writing it


# --- checks 1 and 4: which samples each rank read --------------------------------------------------------
def check_data_split(obs: Observation, train_size: int) -> Verdict:
    orders = {rank: obs.batches(rank, "train", 0) for rank in obs.ranks}
    silent = [rank for rank, order in orders.items() if not order]
    if silent:
        return verdict(1, "BLOCKED", f"rank {silent[0]} read no training batch: the job {obs.ended()}")
    for rank in obs.ranks:
        for other in range(rank + 1, obs.world_size):
            shared = set(orders[rank]) & set(orders[other])
            # DistributedSampler pads the last round with fewer than world_size repeated samples.
            if len(shared) >= obs.world_size:
                first = next(i for i in orders[rank] if i in shared)
                return verdict(
                    1, "FAIL",
                    f"ranks {rank} and {other} both trained on sample {first} in epoch 0 ({len(shared)} of the "
                    f"{train_size} training samples were read by both)",
                )  # fmt: skip
    epoch_complete = obs.finished or all(obs.passes(rank, "train") > 1 for rank in obs.ranks)
    if not epoch_complete:
        return verdict(1, "BLOCKED", f"epoch 0 never completed: the job {obs.ended()}")
    unread = set(range(train_size)) - set().union(*orders.values())
    if unread:
        return verdict(1, "FAIL", f"{len(unread)} training samples were read by no rank in epoch 0 (sample {min(unread)}, ...)")
    sizes = ", ".join(str(len(orders[rank])) for rank in obs.ranks)
    return verdict(1, "PASS", f"in epoch 0 the ranks read disjoint shares ({sizes} samples) covering all {train_size}")


def check_epoch_shuffle(obs: Observation) -> Verdict:
    repeated = []
    for rank in obs.ranks:
        first, second = obs.batches(rank, "train", 0), obs.batches(rank, "train", 1)
        if not second:
            return verdict(4, "BLOCKED", f"rank {rank} never started a second epoch: the job {obs.ended()}")
        if second == first[: len(second)]:
            repeated.append((rank, second))
    if len(repeated) == obs.world_size:
        rank, order = repeated[0]
        start = ", ".join(map(str, order[:4]))
        return verdict(4, "FAIL", f"rank {rank} read the same {len(order)} samples in the same order in epochs 0 and 1 ({start}, ...)")
    return verdict(4, "PASS", "every rank read its samples in a new order in epoch 1")


# --- checks 2 and 7: gradients against a recomputed reference ----------------------------------------------
@dataclass
class GradientStep:
    """One optimizer step's gradient as the job held it, the one it should be, and how far apart rounding may put them."""

    observed: torch.Tensor  # rank 0's .grad at the step (DDP has averaged it over the ranks)
    reference: torch.Tensor  # the mean-loss gradient over the global batch, recomputed here
    tolerance: float  # relative: see rounding_tolerance


def reference_gradient(records: dict[int, dict], images: torch.Tensor, labels: torch.Tensor, own_params: bool = False) -> tuple[torch.Tensor, float]:
    """(gradient, tolerance): the gradient of the loss DDP should optimize, the mean over ranks of each
    rank's mean batch loss, and how far another float32 computation of it may be (rounding_tolerance).

    At rank 0's weights; with own_params, each rank's batch at that rank's weights (what averaging
    the ranks' gradients gives even when the replicas differ).
    """
    model = DigitsCNN()
    vector_to_parameters(records[0]["params"], model.parameters())
    per_rank, terms, positions = [], [], 1
    for rank in sorted(records):
        if own_params:
            vector_to_parameters(records[rank]["params"], model.parameters())
        batch = torch.tensor(records[rank]["batch"])
        model.zero_grad(set_to_none=True)
        with AbsoluteTerms(model) as absolute:
            F.cross_entropy(model(images[batch]), labels[batch]).backward()
        per_rank.append(parameters_to_vector(p.grad for p in model.parameters()))
        terms.append(absolute.sums())
        positions = max(positions, absolute.positions)
    gradient, absolute_sums = torch.stack(per_rank).mean(dim=0), torch.stack(terms).mean(dim=0)
    longest_sum = sum(len(record["batch"]) for record in records.values()) * positions + len(records)
    return gradient, rounding_tolerance(gradient, absolute_sums, longest_sum)


def rounding_tolerance(gradient: torch.Tensor, absolute_sums: torch.Tensor, longest_sum: int) -> float:
    """How far, relative to its norm, two float32 computations of `gradient` may differ.

    Every component of a weight gradient is a sum: over the samples of the global batch and, for a
    convolution, over the positions of its 8x8 output (`longest_sum` terms at most, with the average
    over ranks). Computed in float32, a sum of n terms is exact to within gamma_n = n*u / (1 - n*u)
    times the sum of the terms' absolute values (u: the unit roundoff; Higham, Accuracy and
    Stability of Numerical Algorithms, section 4.2), whatever the order: the order is what a CPU's
    vector width changes. The ranks' computation and this one may each be that far off, hence 2 x.

    The bound grows with cancellation: late in training the per-sample gradients point every way,
    their sum is small and its rounding, relative to it, is large. It is about 2e-2 for lab 4's
    first steps (gamma_n ~ 1e-3, absolute sums ~9x the gradient's norm), and covers what float32
    also does: a pre-activation within rounding of 0 that one computation puts on the other side of
    a ReLU switches that sample's gradient through that unit on or off. One such switch in the
    classifier's hidden layer moved the gradients of lab 4's first steps by 0.3% (median over its
    units and samples; about 1% at most), more than the fixed tolerance of 0.1% this replaced, which
    was reported to fail a correct step on a CPU with AVX-512. The bugs checks 2 and 7 look for are
    far outside it: a gradient that piles up differs by 90% or more, a loss scaled by the world size
    by a factor of 2.
    """
    n_u = longest_sum * FLOAT32_UNIT_ROUNDOFF
    gamma = n_u / (1 - n_u)
    return float(2 * gamma * absolute_sums.norm() / gradient.norm().clamp_min(1e-30))


class AbsoluteTerms:
    """Within `with AbsoluteTerms(model) as absolute:` (one forward and backward pass), record what
    each weight gradient sums; then absolute.sums() gives, for every gradient component in
    parameters() order, the sum of the absolute values of its terms, and absolute.positions the
    most positions any layer sums over (8 x 8 = 64 for lab 4's convolutions).

    A Linear layer's weight gradient is grad_output^T @ input, a sum over the batch; a Conv2d's
    sums grad_output x input over the batch and every output position. The same products of the
    absolute values give the absolute sums.
    """

    def __init__(self, model: nn.Module):
        self.layers = [m for m in model.modules() if list(m.parameters(recurse=False))]
        if any(not isinstance(m, (nn.Linear, nn.Conv2d)) for m in self.layers):
            raise TypeError("AbsoluteTerms knows the sums of Linear and Conv2d layers only")
        self.seen: dict[nn.Module, list[torch.Tensor]] = {}
        self.positions = 1

    def __enter__(self) -> "AbsoluteTerms":
        self.hooks = [layer.register_forward_hook(self._keep) for layer in self.layers]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self.hooks:
            hook.remove()

    def _keep(self, layer, inputs, output) -> None:
        self.seen[layer] = [inputs[0].detach()]
        if isinstance(layer, nn.Conv2d):
            self.positions = max(self.positions, output[0, 0].numel())
        output.register_hook(lambda grad_output: self.seen[layer].append(grad_output.detach()))

    def sums(self) -> torch.Tensor:
        parts = []
        for layer in self.layers:
            inputs, grad_output = (tensor.abs() for tensor in self.seen[layer])
            if isinstance(layer, nn.Conv2d):
                weight = torch.nn.grad.conv2d_weight(inputs, layer.weight.shape, grad_output, layer.stride, layer.padding, layer.dilation, layer.groups)
                bias = grad_output.sum(dim=(0, 2, 3))
            else:
                weight, bias = grad_output.T @ inputs, grad_output.sum(dim=0)
            parts += [weight.reshape(-1)] + ([bias] if layer.bias is not None else [])
        return torch.cat(parts)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / a.norm().clamp_min(1e-30))


def best_multiple(observed: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(c, relative residual) of the least-squares fit observed ~ c x reference."""
    c = float(observed @ reference / (reference @ reference))
    return c, relative(observed, c * reference)


def gradient_steps(obs: Observation, train, count: int = 3, own_params: bool = False) -> tuple[list[GradientStep], str | None]:
    """[GradientStep per recorded step, at most count], or a reason why none could be compared."""
    images, labels = train.tensors
    expected_shapes = [list(p.shape) for p in DigitsCNN().parameters()]
    steps = []
    for step in range(1, count + 1):
        records = {rank: obs.step_record(rank, step) for rank in obs.ranks}
        if any(record is None for record in records.values()):
            break
        if records[0]["shapes"] != expected_shapes:
            return [], "the optimizer's parameters are not those of a DigitsCNN"
        if records[0]["missing_grads"] or not records[0]["batch"]:
            return [], f"in step {step} some parameters had no gradient, or no training batch was read"
        reference, tolerance = reference_gradient(records, images, labels, own_params)
        steps.append(GradientStep(records[0]["grads"], reference, tolerance))
    return steps, None


def check_gradient_scale(steps, problem: str | None, obs: Observation) -> tuple[Verdict, float | None]:
    """Verdict on step 1's gradient, and its scale against the reference (None: not a multiple of it)."""
    if problem:
        return verdict(7, "BLOCKED", problem), None
    if not steps:
        return verdict(7, "BLOCKED", f"no optimizer step was recorded on every rank: the job {obs.ended()}"), None
    first = steps[0]
    scale, residual = best_multiple(first.observed, first.reference)
    global_batch = f"{obs.world_size} ranks x {BATCH_SIZE} samples"
    if residual > first.tolerance:
        off = relative(first.observed, first.reference)
        return verdict(
            7, "FAIL", f"step 1's gradient is not the gradient of the mean loss over the global batch ({global_batch}): relative difference {off:.2f}"
        ), None
    if abs(scale - 1) > first.tolerance:
        return verdict(7, "FAIL", f"step 1's gradient is {scale:.2f} x the gradient of the mean loss over the global batch ({global_batch})"), scale
    return verdict(7, "PASS", f"step 1's gradient equals the gradient of the mean loss over the global batch ({global_batch})"), scale


def check_fresh_gradients(steps, problem: str | None, scale: float | None, obs: Observation) -> Verdict:
    """Does each step's .grad hold only its own batch's gradient? Judged at each step's own scale.

    The scale of a gradient is check 7's business: a loss multiplied by the world size gives every
    step twice its gradient, fresh all the same, and must fail check 7 alone. So a step passes here
    when its gradient is SOME multiple of its own batch's reference gradient, and gradients that pile
    up show as a step whose gradient minus the previous step's is such a multiple. scale is only
    asked whether step 1's gradient is a multiple of its reference at all (None: it is not, and no
    later step can be judged by this comparison).
    """
    if problem:
        return verdict(2, "BLOCKED", problem)
    if len(steps) < 2:
        return verdict(2, "BLOCKED", f"fewer than 2 optimizer steps were recorded: the job {obs.ended()}")
    if scale is None:
        return verdict(2, "BLOCKED", "step 1's gradient is not a multiple of the reference (check 7), so later steps cannot be compared")
    for step in range(1, len(steps)):
        this, previous = steps[step], steps[step - 1]
        if best_multiple(this.observed, this.reference)[1] <= this.tolerance:
            continue
        if best_multiple(this.observed - previous.observed, this.reference)[1] <= this.tolerance:
            return verdict(2, "FAIL", f"step {step + 1}'s gradient is step {step}'s gradient plus that of its own batch: gradients pile up from step to step")
        return verdict(2, "FAIL", f"step {step + 1}'s gradient is neither its own batch's gradient nor that plus step {step}'s")
    return verdict(2, "PASS", f"steps 2 to {len(steps)} each hold only the gradient of their own batch")


# --- checks 3 and 6: the saved model and the reported accuracy ---------------------------------------------
def load_into_bare_model(state: dict, make_model) -> tuple:
    """(make_model() with state loaded strictly, or None; the weights with any 'module.' prefix removed,
    or None when even those do not fit; why state does not load as it is, or None when it does).
    Lab 3's conversion checker asks the same of its model."""
    weights = {name.removeprefix("module."): tensor for name, tensor in state.items()}
    model = make_model()
    try:
        model.load_state_dict(state)
    except RuntimeError:  # below: say why, and whether the weights fit once 'module.' is dropped
        pass
    else:
        return model, weights, None
    name, wrapped = type(model).__name__, [key for key in state if key.startswith("module.")]
    if wrapped:
        evidence = (
            f"its keys start with 'module.' ('{wrapped[0]}'), so it does not load into a bare {name}, which expects '{wrapped[0].removeprefix('module.')}'"
        )
    else:
        expected = set(model.state_dict())
        evidence = f"it does not load into a bare {name} (unexpected keys {sorted(set(state) - expected)[:2]}, missing {sorted(expected - set(state))[:2]})"
    try:
        make_model().load_state_dict(weights)
    except RuntimeError:
        weights = None
    return None, weights, evidence


def check_saved_model(obs: Observation) -> tuple[Verdict, dict | None]:
    """Verdict on the --save file, and the weights it holds (keys without 'module.') when usable."""
    path = obs.out_dir / "model.pt"
    if not path.exists():
        if obs.finished:
            return verdict(3, "FAIL", "the job finished but wrote no file at --save"), None
        return verdict(3, "BLOCKED", f"no file at --save: the job {obs.ended()} before writing it"), None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # not a torch file, or not safe to load
        return verdict(3, "FAIL", f"the file at --save does not load with torch.load(weights_only=True) ({type(error).__name__})"), None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        return verdict(3, "FAIL", "the file at --save is not a state_dict (a dict of tensors)"), None
    model, weights, evidence = load_into_bare_model(state, DigitsCNN)
    if evidence:
        return verdict(3, "FAIL", evidence), weights
    first_step = obs.step_record(0, 1)
    if first_step is not None and torch.equal(parameters_to_vector(model.parameters()), first_step["params"]):
        return verdict(3, "FAIL", "it holds the initial weights: training never reached the saved file"), weights
    return verdict(3, "PASS", "it loads into a bare DigitsCNN (strict) and holds trained weights"), weights


@torch.no_grad()
def count_correct(weights: dict, images: torch.Tensor, labels: torch.Tensor) -> int:
    model = DigitsCNN()
    model.load_state_dict(weights)
    return int((model.eval()(images).argmax(dim=1) == labels).sum())


def check_reported_accuracy(obs: Observation, weights: dict | None, held_out) -> Verdict:
    metrics_path = obs.out_dir / "metrics.json"
    if not metrics_path.exists():
        if obs.finished:
            return verdict(6, "FAIL", "the job finished but wrote no --metrics-json")
        return verdict(6, "BLOCKED", f"no --metrics-json: the job {obs.ended()} before writing it")
    reported = json.loads(metrics_path.read_text()).get("eval_accuracy")
    if not isinstance(reported, (int, float)):
        return verdict(6, "FAIL", "--metrics-json has no numeric eval_accuracy")
    return accuracy_verdict(6, reported, obs, weights, held_out)


def accuracy_verdict(number: int, reported: float, obs: Observation, weights: dict | None, held_out, name: str = "eval_accuracy") -> Verdict:
    """Is reported the saved weights' accuracy on the whole held-out set? If not, is it one rank's slice's?"""
    if weights is None:
        return verdict(number, "BLOCKED", "no usable weights at --save to recompute the accuracy from")
    images, labels = held_out.tensors
    correct, total = count_correct(weights, images, labels), len(labels)
    if abs(reported - correct / total) < 0.5 / total:
        return verdict(number, "PASS", f"the reported {name} {reported:.4f} is the saved model's on all {total} held-out images ({correct}/{total})")
    whole = f"on all {total} held-out images it scores {correct / total:.4f} ({correct}/{total})"
    for rank in obs.ranks:
        seen = sorted(set(obs.batches(rank, "held_out", obs.passes(rank, "held_out") - 1)))
        if seen and len(seen) < total:
            shard = torch.tensor(seen)
            shard_correct = count_correct(weights, images[shard], labels[shard])
            if abs(reported - shard_correct / len(seen)) < 0.5 / len(seen):
                return verdict(
                    number, "FAIL",
                    f"the reported {name} {reported:.4f} is the saved model's score on the {len(seen)} held-out "
                    f"images rank {rank} evaluated ({shard_correct}/{len(seen)}); {whole}",
                )  # fmt: skip
    return verdict(number, "FAIL", f"the reported {name} is {reported:.4f}, but {whole}")


# --- check 5: collectives ----------------------------------------------------------------------------------
def where(call: dict) -> str:
    return f"{call['what']} after optimizer step {call['step']} (epoch {max(call['epoch'], 0)})"


def describe_unmatched(event: dict) -> str:
    called = f"rank {event['rank']} called {where(event)}"
    peer, did = event["peer"], event["peer_did"]
    if did == "other_call":
        return f"{called} while rank {peer} called {event['peer_what']}"
    if did == "went_on":
        return f"{called}; rank {peer} went on training without making that call"
    if did == "finished":
        return f"{called}; rank {peer} finished without making that call"
    if did == "stalled":
        return f"{called}; rank {peer} made no matching call within {event['stall_s']:g} s"
    return f"{called}, but rank {peer} called it as {event['peer_what']}"


def check_collectives(obs: Observation) -> Verdict:
    events = [e for rank in obs.ranks for e in obs.events.get(rank, [])]
    unmatched = sorted((e for e in events if e["kind"] == "collective" and e["decision"] == "skip"), key=lambda e: (e["progress"], e["rank"]))
    if unmatched:
        first = unmatched[0]
        # The other side of the same mismatch, as that rank recorded it (whichever rank decided first).
        other = next((e for e in unmatched if e["rank"] != first["rank"] and e["progress"] == first["progress"] and e["key"] != first["key"]), None)
        mismatch = f"rank {first['rank']} called {where(first)} while rank {other['rank']} called {other['what']}" if other else describe_unmatched(first)
        epochs = ", ".join(str(epoch) for epoch in sorted({max(e["epoch"], 0) for e in unmatched}))
        return verdict(
            5, "FAIL",
            f"{mismatch} (calls went unmatched in epoch {epochs}; unobserved, the ranks would wait there until "
            f"--timeout-s and the job would die)",
        )  # fmt: skip
    errors = sorted((e for e in events if e["kind"] == "collective_error"), key=lambda e: e["rank"])
    if errors:
        waited = " while ".join(f"rank {e['rank']} waited in {where(e)}" for e in errors)
        # The rank that timed out first says why; its peer may then only see the closed connection.
        reason = next((e["error"] for e in errors if "Timed out" in e["error"]), errors[0]["error"])
        return verdict(5, "FAIL", f"{waited}, until gloo gave up: {reason}")
    if obs.run.timed_out:
        stuck = [(rank, state["inside"]) for rank, state in obs.final_states().items() if state and state["inside"]]
        inside = "; ".join(f"rank {rank} was waiting in {where(call)}" for rank, call in stuck) or "no rank was inside a collective called from Python"
        return verdict(5, "FAIL", f"the job hung and was killed after {obs.limit_s:g} s: {inside}")
    if not obs.finished:
        return verdict(5, "BLOCKED", f"the job {obs.ended()} before every collective could be observed")
    calls = sum(1 for e in obs.events.get(0, []) if e["kind"] == "collective")
    return verdict(5, "PASS", f"every rank made the same {calls} collective calls, in the same order, and the job finished")


def check(script: Path, out_dir: Path, rescue: bool = True, job_timeout_s: float | None = None) -> tuple[Observation, list[Verdict]]:
    """Run script under observation and decide the seven checks, in order (job_timeout_s None: JOB_TIMEOUT_S)."""
    obs = observe(script, out_dir, rescue, timeout_s=job_timeout_s)
    return obs, judge(obs)


def judge(obs: Observation) -> list[Verdict]:
    """The seven checks, in order, from what one observed run left behind."""
    splits = digits()
    steps, problem = gradient_steps(obs, splits.train)
    scale_verdict, scale = check_gradient_scale(steps, problem, obs)
    saved_verdict, weights = check_saved_model(obs)
    return [
        check_data_split(obs, len(splits.train)),
        check_fresh_gradients(steps, problem, scale, obs),
        saved_verdict,
        check_epoch_shuffle(obs),
        check_collectives(obs),
        check_reported_accuracy(obs, weights, splits.test),
        scale_verdict,
    ]


def main(argv=None) -> int:
    parser = checker_parser(
        "lab4_check.py", "Check a DDP training script by running it (see the docstring).",
        DEFAULT_SCRIPT, f"the script to check (default {DEFAULT_SCRIPT})",
    )  # fmt: skip
    parser.add_argument(
        "--no-rescue", action="store_true",
        help="let unmatched collectives run as they would unobserved (the job then waits for --timeout-s and dies)",
    )  # fmt: skip
    parser.add_argument(
        "--job-timeout-s", type=positive_float, default=JOB_TIMEOUT_S, metavar="SECONDS",
        help=f"kill the whole job after this many seconds (default {JOB_TIMEOUT_S}; more on a slow machine)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    script = script_to_check(parser, args.script)

    print(f"lab 4 checker: {args.script} under torchrun, {WORLD_SIZE} gloo ranks on the CPU: {' '.join(SCRIPT_ARGS)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="lab4_check_") as out_dir:
        obs, verdicts = check(script, Path(out_dir), rescue=not args.no_rescue, job_timeout_s=args.job_timeout_s)
    if args.show_output:
        print(f"--- the script's stdout\n{obs.run.stdout}--- its stderr\n{obs.run.stderr}--- end of the script's output")
    print(f"the job {obs.ended()}")
    return print_verdicts(verdicts, **LINE_FORMAT)


if __name__ == "__main__":
    sys.exit(main())
