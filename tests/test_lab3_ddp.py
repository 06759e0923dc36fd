"""labs/lab3_ddp.py launched as a learner launches it: torchrun, 2 gloo ranks on the CPU.

Launches are shared, and started together. Every launch costs seconds of CPU for start-up (torch
imports in the torchrun agent and in each rank) while the work of most is well under a second, so
the module makes four launches, all started at once by the `jobs` fixture (one job's rendezvous and
waits overlap the others' CPU):
- the learner's default run, main()'s success path;
- tests/scripts/lab3_runs.py, one 2-rank job for every short run (one run of train() per test case:
  equivalence, resume, dropout, refused checkpoints, missing CIFAR-10) and the BatchNorm-buffer check;
- a bad flag (argparse's one line, exit 2) and --amp on the CPU (a CourseError: one line, exit 1),
  main()'s two refusal paths through torchrun.
A fixture that needs a job waits for it and asserts it exited as expected (a failed launch is a setup
error, reported with the job's output). Checks that need no second process run here (flag checks,
the one-process reference run, which runs while the jobs do).
"""

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ddp_course.checkpoint import list_checkpoints
from ddp_course.compare import max_relative_difference
from ddp_course.launch import REPO_ROOT, import_script, run_torchrun
from ddp_course.models import DigitsCNN
from ddp_course.seeding import seed_everything

LAB3 = REPO_ROOT / "labs" / "lab3_ddp.py"
# Keys of a checkpoint written by lab 3; restore() refuses a file without them.
CHECKPOINT_KEYS = {"model_name", "model", "optimizer", "scaler", "epoch", "step_in_epoch", "global_step", "rng_states"}

# "Equal up to float32 rounding" for runs that sum the same gradients in a different order (2 ranks
# and an all-reduce, or micro-batches, against one process). One float32 rounding is 2**-24 = 6e-8
# relative; these 6-step runs differed by 6e-8 to 8e-8 here, and between CPU kernel paths float32
# training drifts by 1e-7 to 1e-5 over tens of steps (CONTRIBUTING.md, "Portable outputs"), more with more steps.
# 1e-5 sits above that for 6 steps, and 1000x below what the bugs these tests guard against do:
# the old per-micro-batch weighting moved the weights by 2e-2, a different global batch by 6e-2.
ROUNDING_TOLERANCE = 1e-5
DIFFERENT_RESULT = 1e-3


def load_weights(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def import_lab3():
    return import_script(LAB3)


# --- the module's launches, started at once -----------------------------------------------------------

# Flags refused under torchrun, one launch each: main()'s two exit paths for a user mistake.
BAD_FLAGS_UNDER_TORCHRUN = [
    (["--accumulation-steps", "0"], r"--accumulation-steps: must be a positive integer"),  # argparse, exit 2
    (["--amp"], r"--amp needs a CUDA GPU \(bf16 or fp16 autocast\)"),  # a CourseError from train(), exit 1
]
# An unreachable proxy makes a CIFAR-10 download fail at once, online or not, so no test downloads 170 MB.
OFFLINE = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "no_proxy": ""}


@dataclass
class Launches:
    futures: dict  # "default", "runs", or a bad flag's args as a tuple -> Future of RunResult
    default_directory: Path  # the default run's metrics.json and final.pt
    runs_directory: Path  # the lab3_runs.py job's plan, files and checkpoint directories
    before: dict  # refused run name -> snapshot of its checkpoint directory before the job


@pytest.fixture(scope="module")
def jobs(run_lab3, tmp_path_factory):
    """Start the module's four launches at once; the fixtures below each wait for their own.

    Four jobs on 2 cores take about as much CPU as one after another, but no core idles while a job
    waits for its rendezvous or its ranks. Leaving the module waits for every job; no relaunch.
    """
    default_directory = tmp_path_factory.mktemp("default_run")
    runs_directory = tmp_path_factory.mktemp("runs")
    refused_plan, before = refused_run_plan(runs_directory)
    plan = [*short_run_plan(runs_directory), *refused_plan, {"name": "rank0_buffers", "check": "rank0_buffers"}]
    pool = ThreadPoolExecutor(max_workers=2 + len(BAD_FLAGS_UNDER_TORCHRUN), thread_name_prefix="lab3")
    # The longest job first; a loaded machine (every job here shares 2 cores) gets generous timeouts.
    futures = {"runs": pool.submit(run_plan, runs_directory, plan, env=OFFLINE, timeout_s=400)}
    # The learner's first command, with --metrics-json and --save: 10 epochs of 23 steps.
    default_flags = ["--metrics-json", default_directory / "metrics.json", "--save", default_directory / "final.pt"]
    futures["default"] = pool.submit(run_lab3, *default_flags, timeout_s=240)
    for args, _ in BAD_FLAGS_UNDER_TORCHRUN:
        futures[tuple(args)] = pool.submit(run_lab3, *args, timeout_s=120)
    yield Launches(futures, default_directory, runs_directory, before)
    pool.shutdown(wait=True)


def runs_job(jobs):
    """Wait for the lab3_runs.py job; it must exit 0: every run ended as "ok" or "CourseError", no other error."""
    result = jobs.futures["runs"].result()
    assert result.ok, result.describe()
    return result


# --- the default run: learning, progress lines, metrics, the saved model ---------------------------


@pytest.fixture(scope="module")
def default_run(jobs):
    """The learner's first command, with --metrics-json and --save: 10 epochs of 23 steps."""
    result = jobs.futures["default"].result()
    assert result.ok, result.describe()
    return result, jobs.default_directory


@pytest.mark.timeout(300)
def test_default_run_learns_above_97_percent(default_run, read_json):
    result, directory = default_run
    metrics = read_json(directory / "metrics.json")
    assert metrics["world_size"] == 2 and metrics["backend"] == "gloo" and metrics["device"] == "cpu"
    assert metrics["global_batch_size"] == 64  # 32 per rank x 2 ranks
    assert metrics["steps"] == 10 * 23  # 10 epochs x ceil(719 samples per rank / 32)
    assert metrics["eval_accuracy"] >= 0.97
    assert metrics["train_loss"] < 0.05
    assert metrics["wall_s"] > 0
    # The progress lines are the job's: every epoch scores all 359 held-out images exactly once.
    epoch_lines = re.findall(r"epoch (\d+)/10 .*\((\d+)/(\d+)\)", result.stdout)
    assert [int(epoch) for epoch, _, _ in epoch_lines] == list(range(1, 11))
    assert all(total == "359" for _, _, total in epoch_lines)
    epochs = metrics["epochs"]
    assert [entry["epoch"] for entry in epochs] == list(range(1, 11))
    assert epochs[-1]["eval_accuracy"] == metrics["eval_accuracy"] and epochs[-1]["step"] == 230
    assert epochs[0]["train_loss"] > epochs[-1]["train_loss"]
    assert "global_batch=64" in result.stdout


@pytest.mark.timeout(180)
def test_history_is_a_learning_curve_every_10_steps(default_run, read_json):
    """The default run records the job-wide loss every 10 steps: 23 points over 230 steps, not 10 epochs."""
    _, directory = default_run
    metrics = read_json(directory / "metrics.json")
    history = metrics["history"]
    assert metrics["log_every"] == 10 and len(history) >= 20
    assert [entry["step"] for entry in history] == list(range(10, 231, 10))
    # Step s lies in epoch ceil(s / 23); every point but the first covers 10 steps of 64 samples
    # (2 ranks' samples: the job-wide loss), except those holding an epoch's short last batch (2 x 15).
    assert [entry["epoch"] for entry in history] == [-(-entry["step"] // 23) for entry in history]
    assert all(entry["samples"] in (640, 640 - 2 * (32 - 15)) for entry in history)
    assert sum(entry["samples"] for entry in history) == 10 * 1438  # every sample of every epoch, once
    assert history[0]["train_loss"] > 1.0 > 0.1 > history[-1]["train_loss"]


@pytest.mark.timeout(180)
def test_config_line_says_amp_off_on_the_cpu(default_run, read_json):
    result, directory = default_run
    config = next(line for line in result.stdout.splitlines() if line.startswith("config:"))
    assert " amp=off " in config, config
    assert read_json(directory / "metrics.json")["amp"] == "off"


@pytest.mark.timeout(180)
def test_throughput_is_per_epoch(default_run, read_json):
    """One samples_per_s per epoch, each this epoch's samples / seconds (not a running average)."""
    result, directory = default_run
    metrics = read_json(directory / "metrics.json")
    epochs = metrics["epochs"]
    assert len(epochs) == 10 and all(entry["samples_per_s"] > 0 for entry in epochs)
    # 2 ranks x 719 samples (DistributedSampler's shards of the 1,438 digits, no padding needed).
    assert all(entry["samples"] == 1438 for entry in epochs)
    for entry in epochs:
        assert entry["samples_per_s"] == pytest.approx(entry["samples"] / entry["train_seconds"])
    # Each epoch line prints its own epoch's figure (rounded to whole samples/s).
    printed = [float(rate) for rate in re.findall(r"\| (\d+) samples/s", result.stdout)]
    assert printed == [pytest.approx(entry["samples_per_s"], abs=0.5) for entry in epochs]
    later = epochs[1:]
    expected = sum(entry["samples"] for entry in later) / sum(entry["train_seconds"] for entry in later)
    assert metrics["samples_per_s_after_first_epoch"] == pytest.approx(expected)
    assert "samples_per_s" not in metrics  # the old cumulative figure is gone, not silently redefined


@pytest.mark.timeout(180)
def test_saved_model_is_bare_and_on_the_cpu(default_run):
    _, directory = default_run
    weights = load_weights(directory / "final.pt")
    assert all(tensor.device.type == "cpu" for tensor in weights.values())
    model = DigitsCNN()
    model.load_state_dict(weights)  # strict: raises on "module." keys


class GpuTensorStandIn:
    """What model.state_dict() holds after a GPU run: a tensor on cuda:0 (faked: no GPU here)."""

    device = torch.device("cuda", 0)

    def __init__(self, values):
        self.values = values

    def cpu(self):
        return self.values


def test_save_moves_gpu_weights_to_the_cpu():
    """The launch above runs on the CPU, where every tensor is a CPU tensor anyway; this check fails on
    a lab that saves model.state_dict() as it is (a GPU run's file would then hold cuda:0 tensors)."""
    lab3 = import_lab3()
    model = torch.nn.Linear(2, 1)
    model.state_dict = lambda: {"weight": GpuTensorStandIn(torch.ones(1, 2)), "bias": GpuTensorStandIn(torch.zeros(1))}
    saved = lab3.cpu_state_dict(model)
    assert all(isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" for tensor in saved.values())


# --- short runs: one torchrun job for all of them ---------------------------------------------------

# tests/scripts/lab3_runs.py runs lab 3's train() once per entry of a plan, in one 2-rank job: the
# sixteen short runs cost one job's start-up (seconds per launch) instead of sixteen. Each run is still
# a real 2-rank run (DDP over gloo); main() and its exit codes are tested by this file's own launches.
RUNS_SCRIPT = REPO_ROOT / "tests" / "scripts" / "lab3_runs.py"


def run_plan(directory, runs, env=None, timeout_s=300):
    """Launch lab3_runs.py with runs (a list of {"name", "args" or "check", ...}) on 2 ranks; return its RunResult."""
    plan = directory / "plan.json"
    as_text = [{**run, "args": [str(arg) for arg in run["args"]]} if "args" in run else run for run in runs]
    plan.write_text(json.dumps(as_text, default=str, indent=1))
    return run_torchrun(RUNS_SCRIPT, [LAB3, plan], nproc=2, timeout_s=timeout_s, env=env)


def run_section(text, name):
    """The part of a lab3_runs.py job's stdout or stderr between the markers of run name and the next run."""
    sections = re.split(r"^=== run (\S+)\n", text, flags=re.MULTILINE)
    found = dict(zip(sections[1::2], sections[2::2], strict=True))
    assert name in found, f"no run {name} in:\n{text}"
    return found[name]


def run_outcome(result, name, expected="ok"):
    """Check that every rank ended run name with expected ("ok" or "CourseError") in < 90 s; return its stdout."""
    stdout = run_section(result.stdout, name)
    outcomes = sorted(re.findall(rf"^\[rank (\d)\] run {name}: (\w+) in ([\d.]+) s$", stdout, flags=re.MULTILINE))
    assert [(rank, outcome) for rank, outcome, _ in outcomes] == [("0", expected), ("1", expected)], result.describe()
    # A rank stuck in a collective would wait for the group's timeout; a run here takes seconds.
    assert all(float(seconds) < 90 for _, _, seconds in outcomes), result.describe()
    return stdout


def run_in_this_process(*args):
    """Lab 3's main() without torchrun: a group of one process (setup_distributed's in-memory store).

    On one thread, as every launched rank has (run_torchrun's threads_per_rank=1), so the one-process
    reference takes the same CPU kernel paths as the 2-rank runs it is compared with.
    """
    lab3 = import_lab3()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert lab3.main(lab3.parse_args([str(arg) for arg in args])) == 0
    finally:
        torch.set_num_threads(threads)


# --- 2 ranks, with and without accumulation, equal one process on the same global batch -----------

GLOBAL_BATCH = 384
STEPS = 6  # 4 steps per epoch at a global batch of 384: epoch 1 and 2 steps of epoch 2
# name: (processes, per-rank micro-batch, accumulation steps), all with the global batch 384
SAME_GLOBAL_BATCH = {"one_process": (1, 384, 1), "two_ranks": (2, 192, 1), "k2": (2, 96, 2), "k3": (2, 64, 3)}
DROPOUT_FLAGS = ["--dropout", 0.2, "--batch-size", 96, "--max-steps", STEPS]  # 8 batches per epoch: all in epoch 1


def short_run_plan(directory):
    """The 2-rank runs of the three sections below, in the order they depend on each other."""

    def flags(name):
        _, batch, accumulation = SAME_GLOBAL_BATCH[name]
        return ["--batch-size", batch, "--accumulation-steps", accumulation]

    def outputs(name):
        return ["--save", directory / f"{name}.pt", "--metrics-json", directory / f"{name}.json"]

    plan = [{"name": name, "args": [*flags(name), "--max-steps", STEPS, *outputs(name)]} for name in ("two_ranks", "k2", "k3")]
    # 2 ranks x 96 without accumulation (global batch 192): the same micro-batches as k2, a step after each.
    plan.append({"name": "half_global_batch", "args": ["--batch-size", 96, "--max-steps", STEPS, *outputs("half_global_batch")]})
    for name in ("two_ranks", "k3"):  # stop after 3 steps, resume to 6
        checkpoints = ["--checkpoint-dir", directory / f"{name}_checkpoints"]
        plan.append({"name": f"{name}_first", "args": [*flags(name), *checkpoints, "--max-steps", 3, "--checkpoint-every", 2]})
        plan.append({"name": f"{name}_resumed", "args": [*flags(name), *checkpoints, "--max-steps", STEPS, "--resume",
                                                         "--save", directory / f"{name}_resumed.pt"]})  # fmt: skip
    # 6 steps with dropout and a checkpoint every 2; then a resume from copies of checkpoints 2 and 4.
    # Rank 1 plays a node of a shared filesystem that still lists the directory as it was before the
    # newest save (NFS attribute caching): its latest_checkpoint() returns 2. Both are mid-epoch,
    # where the resumed run makes a new DataLoader iterator that the uninterrupted run did not make.
    straight = ["--checkpoint-dir", directory / "dropout_straight", "--checkpoint-every", 2]
    plan.append({"name": "dropout_straight", "args": [*DROPOUT_FLAGS, *straight, "--save", directory / "dropout_straight.pt"]})
    (directory / "dropout_resumed").mkdir()
    copies = [[directory / "dropout_straight" / name, directory / "dropout_resumed" / name]
              for name in (f"checkpoint_step{step:08d}.pt" for step in (2, 4))]  # fmt: skip
    plan.append({"name": "dropout_resumed", "copy": copies, "stale_listing": True,
                 "args": [*DROPOUT_FLAGS, "--checkpoint-dir", directory / "dropout_resumed", "--resume",
                          "--save", directory / "dropout_resumed.pt"]})  # fmt: skip
    return plan


@pytest.fixture(scope="module")
def short_runs(jobs):
    """Ten 6-step (or 3-step) 2-rank runs in one job, and the one-process reference in this process.

    1,438 training digits on 2 ranks are 719 per rank per epoch (DistributedSampler needs no padding),
    and 719 is prime, so every per-rank batch size leaves a short last micro-batch:
    - 2 ranks x 192, K = 1: 3 batches of 192 and one of 143 per rank, 4 steps per epoch;
    - 2 ranks x 96, K = 2: 7 micro-batches of 96 and one of 47: the epoch's last group is 96 + 47;
    - 2 ranks x 64, K = 3: 11 micro-batches of 64 and one of 15: the last group is 64 + 64 + 15;
    - 1 process x 384: 3 batches of 384 and one of 286 = 2 x 143, the same samples per step.
    Every run makes 4 steps in epoch 1 (the 4th on the short group) and 2 in epoch 2, so the
    comparison covers the epoch boundary. A mean loss per micro-batch divided by K gives each of the
    47 (or 15) samples of the short micro-batch 2x (or 4x) the weight of the others.
    """
    directory = jobs.runs_directory
    # The one-process reference, here while the launched jobs run (this process is otherwise idle).
    run_in_this_process("--batch-size", 384, "--max-steps", STEPS, "--save", directory / "one_process.pt",
                        "--metrics-json", directory / "one_process.json")  # fmt: skip
    return runs_job(jobs), directory


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["two_ranks", "k2", "k3"])
def test_two_ranks_equal_one_process_on_the_global_batch(short_runs, read_json, name):
    result, directory = short_runs
    nproc, batch, accumulation = SAME_GLOBAL_BATCH[name]
    stdout = run_outcome(result, name)
    assert f"world_size={nproc} " in stdout
    assert f"batch={batch}/rank accumulation={accumulation} global_batch={GLOBAL_BATCH}" in stdout
    metrics = read_json(directory / f"{name}.json")
    assert (metrics["world_size"], metrics["steps"], metrics["global_batch_size"], metrics["accumulation_steps"]) == (
        nproc, STEPS, GLOBAL_BATCH, accumulation,
    )  # fmt: skip
    assert [entry["step"] for entry in metrics["epochs"]] == [4, 6]  # the run crossed the end of epoch 1
    reference = read_json(directory / "one_process.json")
    assert (reference["world_size"], reference["global_batch_size"]) == (1, GLOBAL_BATCH)

    difference = max_relative_difference(load_weights(directory / f"{name}.pt"), load_weights(directory / "one_process.pt"))
    assert difference < ROUNDING_TOLERANCE, f"{name}: max relative difference {difference:.2e}"
    # The printed train loss is the per-sample mean over the epoch, as one process computes it.
    for entry, expected in zip(metrics["epochs"], reference["epochs"], strict=True):
        assert entry["train_loss"] == pytest.approx(expected["train_loss"], rel=ROUNDING_TOLERANCE)


@pytest.mark.timeout(600)
def test_the_equivalence_check_can_fail(short_runs):
    """The tolerance is far below what training and a different global batch change."""
    result, directory = short_runs
    run_outcome(result, "half_global_batch")
    one_process = load_weights(directory / "one_process.pt")
    seed_everything(0)
    assert max_relative_difference(one_process, DigitsCNN().state_dict()) > 1e-2  # the runs trained
    # 2 ranks x 96 without accumulation: the same micro-batches as K = 2, but a step after each.
    assert max_relative_difference(load_weights(directory / "half_global_batch.pt"), one_process) > DIFFERENT_RESULT


def test_samples_in_group_counts_the_short_micro_batch():
    lab3 = import_lab3()
    assert lab3.samples_in_group(0, 2, 96, 719) == 192
    assert lab3.samples_in_group(6, 2, 96, 719) == 96 + 47
    assert lab3.samples_in_group(9, 3, 64, 719) == 64 + 64 + 15
    assert lab3.samples_in_group(12, 1, 32, 719) == 32


# --- stop, resume, and compare with the uninterrupted runs above ------------------------------------


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["two_ranks", "k3"])
def test_resume_continues_exactly(short_runs, name):
    """3 steps, stop, resume to 6 == 6 steps in one go, bit for bit, across the end of epoch 1.

    With K = 3 the checkpoint falls after 9 micro-batches (checkpoints are taken on optimizer steps,
    so a resume never splits a group), and the resumed part holds the short group 64 + 64 + 15.
    """
    result, directory = short_runs
    run_outcome(result, f"{name}_first")
    resumed = run_outcome(result, f"{name}_resumed")
    assert "resumed from" in resumed and "step 3" in resumed
    resumed_weights, straight_weights = load_weights(directory / f"{name}_resumed.pt"), load_weights(directory / f"{name}.pt")
    assert resumed_weights.keys() == straight_weights.keys()
    assert all(torch.equal(resumed_weights[name], straight_weights[name]) for name in straight_weights)


@pytest.mark.timeout(600)
def test_checkpoints_are_kept_where_training_continues(short_runs):
    """--checkpoint-every 2 saved step 2, the stop saved 3; the resumed run saved the epoch end (4) and 6.

    The newest three are kept; each is a plain, safely loadable training state.
    """
    result, directory = short_runs
    for name in ("two_ranks_first", "k3_first", "k3_resumed"):
        run_outcome(result, name)
    checkpoints = directory / "k3_checkpoints"
    assert [path.name for path in list_checkpoints(checkpoints)] == [
        "checkpoint_step00000003.pt", "checkpoint_step00000004.pt", "checkpoint_step00000006.pt",
    ]  # fmt: skip
    stop = torch.load(checkpoints / "checkpoint_step00000003.pt", weights_only=True)
    assert (stop["epoch"], stop["step_in_epoch"]) == (0, 9)  # 3 steps x 3 micro-batches of 64
    state = torch.load(checkpoints / "checkpoint_step00000006.pt", weights_only=True)
    assert CHECKPOINT_KEYS <= state.keys()
    assert (state["global_step"], state["epoch"], state["step_in_epoch"]) == (6, 1, 6)  # 2 steps into epoch 2
    assert len(state["rng_states"]) == 2
    assert not any(name.startswith("module.") for name in state["model"])
    assert not list(checkpoints.glob("*.tmp"))
    plain = torch.load(directory / "two_ranks_checkpoints" / "checkpoint_step00000003.pt", weights_only=True)
    assert (plain["epoch"], plain["step_in_epoch"]) == (0, 3)


# --- dropout, and a rank that lists the checkpoint directory late -----------------------------------


@pytest.mark.timeout(600)
def test_resume_with_dropout_and_a_stale_listing_continues_exactly(short_runs):
    """Both ranks resume from step 4, the one rank 0 chose, and draw the uninterrupted run's dropout masks."""
    result, directory = short_runs
    run_outcome(result, "dropout_straight")
    resumed = run_outcome(result, "dropout_resumed")
    assert re.search(r"resumed from \S+checkpoint_step00000004\.pt: epoch 0, step 4", resumed), result.describe()
    resumed_weights = load_weights(directory / "dropout_resumed.pt")
    straight_weights = load_weights(directory / "dropout_straight.pt")
    assert resumed_weights.keys() == straight_weights.keys()
    assert all(torch.equal(resumed_weights[name], straight_weights[name]) for name in straight_weights)


@pytest.mark.timeout(600)
def test_the_dropout_run_differs_from_the_run_without_dropout(short_runs):
    """2 ranks x 96, 6 steps, with dropout 0.2 against half_global_batch (the same without dropout)."""
    result, directory = short_runs
    run_outcome(result, "dropout_straight")
    with_dropout, without = load_weights(directory / "dropout_straight.pt"), load_weights(directory / "half_global_batch.pt")
    difference = max_relative_difference(with_dropout, without)
    assert difference > DIFFERENT_RESULT, f"dropout changed the weights by only {difference:.2e}"


# --- BatchNorm buffers before evaluation --------------------------------------------------------------


@pytest.mark.timeout(600)
def test_every_rank_evaluates_with_rank_0s_batchnorm_statistics(jobs):
    """lab3_runs.py's check "rank0_buffers": ranks hold their own running statistics, then call
    copy_rank0_buffers (its code is in tests/scripts/lab3_runs.py); each prints what it holds."""
    result = runs_job(jobs)
    stdout = run_outcome(result, "rank0_buffers")
    lines = sorted(line for line in stdout.splitlines() if line.startswith("[rank ") and " mean " in line)
    assert lines == ["[rank 0] mean [1.0, 1.0, 1.0, 1.0] batches 10", "[rank 1] mean [1.0, 1.0, 1.0, 1.0] batches 10"]


# --- user mistakes: one clear line, a non-zero exit, no traceback ------------------------------------


def assert_one_clear_error(result, expected):
    """Non-zero exit, soon, one error line from the script, no traceback from the script."""
    assert not result.timed_out and result.returncode != 0, result.describe()
    # A rank stuck in a collective would wait for --timeout-s (300 s). A quick failure takes a few
    # seconds on a quiet machine; 90 s leaves room for a loaded one (39 s seen with 16 jobs on 2 cores).
    assert result.wall_s < 90, result.describe()
    script_errors = [line for line in result.stderr.splitlines() if line.startswith("lab3_ddp.py: error:")]
    assert len(script_errors) == 1, result.describe()
    assert re.search(expected, script_errors[0]), result.describe()
    # torchrun adds its own ChildFailedError report; no worker may print a Python traceback.
    assert "[rank0]: Traceback" not in result.stderr and "[rank1]: Traceback" not in result.stderr
    assert 'lab3_ddp.py", line' not in result.stderr, result.describe()


BAD_FLAGS = [
    (["--batch-size", "0"], r"--batch-size: must be a positive integer"),
    (["--batch-size", "many"], r"--batch-size: must be an integer"),
    (["--lr", "-0.1"], r"--lr: must be a positive number"),
    (["--lr", "0"], r"--lr: must be a positive number"),
    (["--epochs", "-1"], r"--epochs: must be a positive integer"),
    (["--dataset", "imagenet"], r"invalid choice: 'imagenet'"),
    (["--resume"], r"need --checkpoint-dir"),
    (["--accumulation-steps", "0"], r"--accumulation-steps: must be a positive integer"),
    (["--dropout", "-0.5"], r"--dropout: must be at least 0 and below 1, got -0.5"),
    (["--dropout", "0.1", "--dataset", "cifar10"], r"--dropout: only the digits model"),
]


@pytest.mark.parametrize(("args", "expected"), BAD_FLAGS)
def test_bad_flags_are_refused_with_one_line(args, expected, refused_flag_line):
    assert re.search(expected, refused_flag_line(import_lab3(), args))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_cannot_join_the_group_says_so_in_one_line(rank, monkeypatch, capsys):
    """The other rank of a 2-rank job never comes (rank 1: no store at the address; rank 0: no peer to
    connect to): main() returns 1 after --timeout-s with one line naming the rank and torch's error,
    where it used to raise (a traceback under torchrun). In a multi-node job each rank's line differs,
    so every rank writes its own (the wrong-interface diagnosis reads the line of whichever rank saw it)."""
    from ddp_course.launch import free_port

    environment = {"RANK": rank, "LOCAL_RANK": 0, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 1,
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": free_port()}  # fmt: skip
    for name, value in environment.items():
        monkeypatch.setenv(name, str(value))
    lab3 = import_lab3()
    assert lab3.main(lab3.parse_args(["--backend", "gloo", "--timeout-s", "1"])) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"error: rank {rank} could not join the gloo process group: " in lines[0], lines
    assert "timed out" in lines[0].lower() or "timeout" in lines[0].lower(), lines[0]


# Its timeout covers the module's other jobs: run alone, this test's teardown waits for them.
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("args", "expected"), BAD_FLAGS_UNDER_TORCHRUN)
def test_bad_flags_fail_with_one_line_under_torchrun(jobs, args, expected):
    """The same checks reach the learner through torchrun: one line from the job, not one per rank."""
    result = jobs.futures[tuple(args)].result()
    assert_one_clear_error(result, expected)


def write_checkpoint(directory, state, step=10):
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"checkpoint_step{step:08d}.pt"
    torch.save(state, path)
    return path


def snapshot(directory):
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def valid_state(model_name="digits_cnn", weights=None):
    model = DigitsCNN()
    return {
        "model_name": model_name, "model": weights or model.state_dict(),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).state_dict(), "scaler": {},
        "epoch": 0, "step_in_epoch": 10, "global_step": 10, "rng_states": [],
    }  # fmt: skip


def write_unusable_checkpoint(directory, case):
    if case == "corrupt":
        directory.mkdir()
        (directory / "checkpoint_step00000010.pt").write_bytes(b"PK\x03\x04 this is not a torch file")
    elif case == "other_model_name":
        write_checkpoint(directory, valid_state(model_name="resnet18"))
    elif case == "other_model_weights":
        write_checkpoint(directory, valid_state(weights=torch.nn.Linear(64, 10).state_dict()))
    else:
        write_checkpoint(directory, DigitsCNN().state_dict())  # a --save file, not a training state


UNUSABLE_CHECKPOINTS = {
    "corrupt": r"cannot load checkpoint .*corrupt or not a checkpoint",
    "other_model_name": r"holds a resnet18 model, but this run trains digits_cnn",
    "other_model_weights": r"does not fit this model",
    "not_a_training_checkpoint": r"not a training checkpoint of this lab \(missing",
}


def refused_run_plan(directory):
    """The runs of the lab3_runs.py job that must be refused, and a snapshot of each one's checkpoint directory.

    Missing CIFAR-10 (the job runs OFFLINE), the unusable checkpoints, and a fresh run (no --resume)
    into a directory that holds a valid checkpoint. Every case fails inside train() on every rank and
    raises a CourseError, which main() turns into one line and exit 1; that path through torchrun is
    launched for real by --amp (test_bad_flags_fail_with_one_line_under_torchrun).
    """
    plan = [{"name": "missing_cifar10", "args": ["--dataset", "cifar10", "--data-dir", directory / "cifar"]}]
    before = {}
    for case in UNUSABLE_CHECKPOINTS:
        checkpoints = directory / case
        write_unusable_checkpoint(checkpoints, case)
        before[case] = snapshot(checkpoints)
        plan.append({"name": case, "args": ["--checkpoint-dir", checkpoints, "--resume", "--checkpoint-every", 1]})
    fresh = directory / "fresh_run_checkpoints"
    write_checkpoint(fresh, valid_state())
    before["fresh_run"] = snapshot(fresh)
    plan.append({"name": "fresh_run", "args": ["--checkpoint-dir", fresh, "--max-steps", 2]})
    return plan, before


@pytest.fixture(scope="module")
def refused_runs(jobs):
    return runs_job(jobs), jobs.runs_directory, jobs.before


def assert_every_rank_refused(result, name, expected):
    """Every rank stopped the run with a CourseError, soon; rank 0 printed one error line; no traceback."""
    run_outcome(result, name, expected="CourseError")
    script_errors = [line for line in run_section(result.stderr, name).splitlines() if line.startswith("lab3_ddp.py: error:")]
    assert len(script_errors) == 1, result.describe()
    assert re.search(expected, script_errors[0]), result.describe()
    assert "Traceback" not in result.stderr, result.describe()


@pytest.mark.timeout(600)
def test_missing_cifar10_while_offline_fails_with_advice(refused_runs):
    result, _, _ = refused_runs
    expected = r"CIFAR-10 is not in .*could not be downloaded.*On a machine with internet run"
    assert_every_rank_refused(result, "missing_cifar10", expected)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("case", "expected"), UNUSABLE_CHECKPOINTS.items())
def test_unusable_checkpoint_fails_and_is_left_untouched(refused_runs, case, expected):
    result, directory, before = refused_runs
    assert_every_rank_refused(result, case, expected)
    assert snapshot(directory / case) == before[case]  # nothing overwritten, deleted or added


@pytest.mark.timeout(600)
def test_fresh_run_refuses_a_directory_with_checkpoints(refused_runs):
    result, directory, before = refused_runs
    assert_every_rank_refused(result, "fresh_run", r"already holds checkpoints: add --resume")
    assert snapshot(directory / "fresh_run_checkpoints") == before["fresh_run"]


# --- the sheet's self-check ------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_self_check_steps_per_epoch_are_a_ranks_loader_in_groups_and_the_checkers_count():
    from torch.utils.data import DataLoader, DistributedSampler

    from ddp_course.lab_self_checks import LAB3_SELF_CHECK
    from ddp_course.self_check import verdict

    digits, ranks, batch, accumulation = 1438, 3, 48, 3  # the checker's job, as the question states it
    # Independently: the loader a converted script builds on each rank, its batches counted in groups of k.
    batches = {len(DataLoader(range(digits), batch_size=batch, sampler=DistributedSampler(range(digits), ranks, rank)))
               for rank in range(ranks)}  # fmt: skip
    assert batches == {10}
    assert -(-10 // accumulation) == LAB3_SELF_CHECK.expected  # an epoch's short last group is a step too
    # The figure the checker measured on the solution, in the stored run the sheet prints (section 7).
    stored = (REPO_ROOT / "solutions" / "lab3_reference" / "convert_check_pass.txt").read_text()
    assert f"on {ranks} gloo ranks" in stored and f"--batch-size {batch} --accumulation {accumulation}" in stored
    epochs = int(re.search(r"--epochs (\d+)", stored).group(1))
    measured_steps = int(re.search(r"8 clipping +PASS +each of the (\d+) optimizer steps", stored).group(1))
    assert measured_steps == epochs * LAB3_SELF_CHECK.expected
    assert verdict(LAB3_SELF_CHECK, 4).startswith("self-check: correct")
    # The classic mistakes: the one-process script's count, ceil(1438 / (48 x 3)) = 10, and dropping the short group.
    for wrong in (-(-digits // (batch * accumulation)), 10 // accumulation):
        assert verdict(LAB3_SELF_CHECK, wrong) == f"self-check: not yet - {LAB3_SELF_CHECK.hint}"
