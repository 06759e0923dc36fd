"""labs/lab3_ddp.py launched as a learner launches it: torchrun, 2 gloo ranks on the CPU.

Launches are shared: each module-scoped fixture below runs its jobs once, asserts they exited
cleanly (a failed launch is a setup error, which pytest.ini's rerun-on-exit-abort rule can retry),
and several tests read the files and output of the same jobs.
"""

import re
import shutil
import textwrap

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
# training drifts by 1e-7 to 1e-5 over tens of steps (COURSE_GUIDE section 5), more with more steps.
# 1e-5 sits above that for 6 steps, and 1000x below what the bugs these tests guard against do:
# the old per-micro-batch weighting moved the weights by 2e-2, a different global batch by 6e-2.
ROUNDING_TOLERANCE = 1e-5
DIFFERENT_RESULT = 1e-3


def load_weights(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def launch(run_lab3, *args, nproc=2):
    """Run lab 3 and fail the calling fixture (a setup error, so it can be retried) unless it exited 0."""
    result = run_lab3(*args, nproc=nproc)
    assert result.ok, result.describe()
    return result


def import_lab3():
    return import_script(LAB3)


# --- the default run: learning, progress lines, metrics, the saved model ---------------------------


@pytest.fixture(scope="module")
def default_run(run_lab3, tmp_path_factory):
    """The learner's first command, with --metrics-json and --save: 10 epochs of 23 steps."""
    directory = tmp_path_factory.mktemp("default_run")
    result = launch(run_lab3, "--metrics-json", directory / "metrics.json", "--save", directory / "final.pt")
    return result, directory


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


# --- 2 ranks, with and without accumulation, equal one process on the same global batch -----------

GLOBAL_BATCH = 384
STEPS = 6  # 4 steps per epoch at a global batch of 384: epoch 1 and 2 steps of epoch 2
# name: (processes, per-rank micro-batch, accumulation steps), all with the global batch 384
SAME_GLOBAL_BATCH = {"one_process": (1, 384, 1), "two_ranks": (2, 192, 1), "k2": (2, 96, 2), "k3": (2, 64, 3)}


@pytest.fixture(scope="module")
def equivalent_runs(run_lab3, tmp_path_factory):
    """Five 6-step runs: four on the global batch 384, and 2 ranks x 96 without accumulation (192).

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
    directory = tmp_path_factory.mktemp("equivalence")
    results = {}
    for name, (nproc, batch, accumulation) in {**SAME_GLOBAL_BATCH, "half_global_batch": (2, 96, 1)}.items():
        results[name] = launch(
            run_lab3, "--batch-size", batch, "--accumulation-steps", accumulation, "--max-steps", STEPS,
            "--save", directory / f"{name}.pt", "--metrics-json", directory / f"{name}.json", nproc=nproc,
        )  # fmt: skip
    return results, directory


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["two_ranks", "k2", "k3"])
def test_two_ranks_equal_one_process_on_the_global_batch(equivalent_runs, read_json, name):
    results, directory = equivalent_runs
    nproc, batch, accumulation = SAME_GLOBAL_BATCH[name]
    assert f"batch={batch}/rank accumulation={accumulation} global_batch={GLOBAL_BATCH}" in results[name].stdout
    metrics = read_json(directory / f"{name}.json")
    assert (metrics["steps"], metrics["global_batch_size"], metrics["accumulation_steps"]) == (STEPS, GLOBAL_BATCH, accumulation)
    assert [entry["step"] for entry in metrics["epochs"]] == [4, 6]  # the run crossed the end of epoch 1

    difference = max_relative_difference(load_weights(directory / f"{name}.pt"), load_weights(directory / "one_process.pt"))
    assert difference < ROUNDING_TOLERANCE, f"{name}: max relative difference {difference:.2e}"
    # The printed train loss is the per-sample mean over the epoch, as one process computes it.
    reference = read_json(directory / "one_process.json")["epochs"]
    for entry, expected in zip(metrics["epochs"], reference, strict=True):
        assert entry["train_loss"] == pytest.approx(expected["train_loss"], rel=ROUNDING_TOLERANCE)


@pytest.mark.timeout(600)
def test_the_equivalence_check_can_fail(equivalent_runs):
    """The tolerance is far below what training and a different global batch change."""
    _, directory = equivalent_runs
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


@pytest.fixture(scope="module")
def resumed_runs(run_lab3, equivalent_runs):
    """Stop after 3 steps, resume to 6; the uninterrupted 6-step runs are equivalent_runs' two_ranks and k3."""
    _, directory = equivalent_runs
    runs = {}
    for name in ("two_ranks", "k3"):
        _, batch, accumulation = SAME_GLOBAL_BATCH[name]
        flags = ["--batch-size", batch, "--accumulation-steps", accumulation, "--checkpoint-dir", directory / f"{name}_checkpoints"]
        first = launch(run_lab3, *flags, "--max-steps", 3, "--checkpoint-every", 2)
        resumed = launch(run_lab3, *flags, "--max-steps", STEPS, "--resume", "--save", directory / f"{name}_resumed.pt")
        runs[name] = (first, resumed)
    return runs, directory


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["two_ranks", "k3"])
def test_resume_continues_exactly(resumed_runs, name):
    """3 steps, stop, resume to 6 == 6 steps in one go, bit for bit, across the end of epoch 1.

    With K = 3 the checkpoint falls after 9 micro-batches (checkpoints are taken on optimizer steps,
    so a resume never splits a group), and the resumed part holds the short group 64 + 64 + 15.
    """
    runs, directory = resumed_runs
    _, resumed = runs[name]
    assert "resumed from" in resumed.stdout and "step 3" in resumed.stdout
    resumed_weights, straight_weights = load_weights(directory / f"{name}_resumed.pt"), load_weights(directory / f"{name}.pt")
    assert resumed_weights.keys() == straight_weights.keys()
    assert all(torch.equal(resumed_weights[name], straight_weights[name]) for name in straight_weights)


@pytest.mark.timeout(600)
def test_checkpoints_are_kept_where_training_continues(resumed_runs):
    """--checkpoint-every 2 saved step 2, the stop saved 3; the resumed run saved the epoch end (4) and 6.

    The newest three are kept; each is a plain, safely loadable training state.
    """
    _, directory = resumed_runs
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

# Rank 1 plays a node of a shared filesystem that still lists the directory as it was before the
# newest save (NFS attribute caching): its latest_checkpoint() returns the second newest file.
STALE_LISTING = textwrap.dedent(
    """
    import os, sys
    from ddp_course.checkpoint import list_checkpoints
    from ddp_course.launch import import_script

    lab = import_script(sys.argv[1])
    sys.argv = sys.argv[1:]  # the lab's own name in its messages
    if os.environ["RANK"] == "1":
        lab.latest_checkpoint = lambda directory: list_checkpoints(directory)[-2]
    sys.exit(lab.main(lab.parse_args(sys.argv[1:])))
    """
)
DROPOUT_FLAGS = ["--dropout", 0.2, "--batch-size", 96, "--max-steps", STEPS]  # 8 batches per epoch: all in epoch 1


@pytest.fixture(scope="module")
def dropout_runs(run_lab3, tmp_path_factory):
    """6 steps with dropout and a checkpoint every 2; then a resume from copies of checkpoints 2 and 4,
    with rank 1 listing only 2. Both checkpoints are mid-epoch, where the resumed run makes a new
    DataLoader iterator that the uninterrupted run did not make."""
    directory = tmp_path_factory.mktemp("dropout")
    straight = launch(run_lab3, *DROPOUT_FLAGS, "--checkpoint-dir", directory / "straight", "--checkpoint-every", 2,
                      "--save", directory / "straight.pt")  # fmt: skip
    (directory / "resumed").mkdir()
    for step in (2, 4):
        name = f"checkpoint_step{step:08d}.pt"
        shutil.copy(directory / "straight" / name, directory / "resumed" / name)
    driver = directory / "stale_listing.py"
    driver.write_text(STALE_LISTING)
    flags = [*DROPOUT_FLAGS, "--checkpoint-dir", directory / "resumed", "--resume", "--save", directory / "resumed.pt"]
    resumed = run_torchrun(driver, [LAB3, *flags, "--timeout-s", 30], nproc=2, timeout_s=240)
    return straight, resumed, directory


@pytest.mark.timeout(600)
def test_resume_with_dropout_and_a_stale_listing_continues_exactly(dropout_runs):
    """Both ranks resume from step 4, the one rank 0 chose, and draw the uninterrupted run's dropout masks."""
    _, resumed, directory = dropout_runs
    assert resumed.ok, resumed.describe()
    assert re.search(r"resumed from \S+checkpoint_step00000004\.pt: epoch 0, step 4", resumed.stdout), resumed.describe()
    resumed_weights, straight_weights = load_weights(directory / "resumed.pt"), load_weights(directory / "straight.pt")
    assert resumed_weights.keys() == straight_weights.keys()
    assert all(torch.equal(resumed_weights[name], straight_weights[name]) for name in straight_weights)


@pytest.mark.timeout(600)
def test_the_dropout_run_differs_from_the_run_without_dropout(dropout_runs, equivalent_runs):
    """2 ranks x 96, 6 steps, with dropout 0.2 against half_global_batch (the same without dropout)."""
    straight, _, directory = dropout_runs
    _, no_dropout = equivalent_runs
    difference = max_relative_difference(load_weights(directory / "straight.pt"), load_weights(no_dropout / "half_global_batch.pt"))
    assert difference > DIFFERENT_RESULT, f"dropout changed the weights by only {difference:.2e}"


# --- BatchNorm buffers before evaluation --------------------------------------------------------------

BUFFER_CHECK = textwrap.dedent(
    """
    import importlib.util, sys
    import torch, torch.distributed as dist
    from ddp_course.distributed import log, setup_distributed, teardown_distributed

    spec = importlib.util.spec_from_file_location("lab3_ddp", sys.argv[1])
    lab3 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lab3)
    ctx = setup_distributed("gloo", timeout_s=30)
    model = torch.nn.BatchNorm1d(4)
    # What each rank holds after training: running statistics from its own last micro-batch.
    model.running_mean.fill_(ctx.rank + 1.0)
    model.num_batches_tracked.fill_(10 + ctx.rank)
    lab3.copy_rank0_buffers(model)
    # log() writes each line in one write: two ranks' print() calls can interleave on the shared pipe.
    log(f"mean {model.running_mean.tolist()} batches {int(model.num_batches_tracked)}", every_rank=True)
    del model
    teardown_distributed()
    """
)


@pytest.mark.timeout(120)
def test_every_rank_evaluates_with_rank_0s_batchnorm_statistics(tmp_path):
    script = tmp_path / "buffer_check.py"
    script.write_text(BUFFER_CHECK)
    result = run_torchrun(script, [LAB3], nproc=2, timeout_s=90)
    assert result.ok, result.describe()
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("[rank "))
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
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--accumulation-steps", "0"], r"--accumulation-steps: must be a positive integer"),  # argparse, exit 2
        (["--amp"], r"--amp needs a CUDA GPU \(bf16 or fp16 autocast\)"),  # a CourseError from train(), exit 1
    ],
)
def test_bad_flags_fail_with_one_line_under_torchrun(run_lab3, args, expected):
    """The same checks reach the learner through torchrun: one line from the job, not one per rank."""
    assert_one_clear_error(run_lab3(*args), expected)


@pytest.mark.timeout(60)
def test_missing_cifar10_while_offline_fails_with_advice(run_lab3, tmp_path):
    # An unreachable proxy makes the download fail at once, online or not, so no test downloads 170 MB.
    offline = {"http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "no_proxy": ""}
    result = run_lab3("--dataset", "cifar10", "--data-dir", tmp_path / "cifar", env=offline)
    assert_one_clear_error(result, r"CIFAR-10 is not in .*could not be downloaded.*On a machine with internet run")


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


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("corrupt", r"cannot load checkpoint .*corrupt or not a checkpoint"),
        ("other_model_name", r"holds a resnet18 model, but this run trains digits_cnn"),
        ("other_model_weights", r"does not fit this model"),
        ("not_a_training_checkpoint", r"not a training checkpoint of this lab \(missing"),
    ],
)
def test_unusable_checkpoint_fails_and_is_left_untouched(run_lab3, tmp_path, case, expected):
    directory = tmp_path / "checkpoints"
    if case == "corrupt":
        directory.mkdir()
        (directory / "checkpoint_step00000010.pt").write_bytes(b"PK\x03\x04 this is not a torch file")
    elif case == "other_model_name":
        write_checkpoint(directory, valid_state(model_name="resnet18"))
    elif case == "other_model_weights":
        write_checkpoint(directory, valid_state(weights=torch.nn.Linear(64, 10).state_dict()))
    else:
        write_checkpoint(directory, DigitsCNN().state_dict())  # a --save file, not a training state
    before = snapshot(directory)

    result = run_lab3("--checkpoint-dir", directory, "--resume", "--checkpoint-every", "1")
    assert_one_clear_error(result, expected)
    assert snapshot(directory) == before  # nothing overwritten, deleted or added


@pytest.mark.timeout(60)
def test_fresh_run_refuses_a_directory_with_checkpoints(run_lab3, tmp_path):
    directory = tmp_path / "checkpoints"
    write_checkpoint(directory, valid_state())
    before = snapshot(directory)
    result = run_lab3("--checkpoint-dir", directory, "--max-steps", "2")
    assert_one_clear_error(result, r"already holds checkpoints: add --resume")
    assert snapshot(directory) == before
