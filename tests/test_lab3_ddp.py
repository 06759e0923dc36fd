"""labs/lab3_ddp.py launched as a learner launches it: torchrun, 2 gloo ranks on the CPU."""

import json
import re

import pytest
import torch

from ddp_course.checkpoint import list_checkpoints
from ddp_course.compare import max_relative_difference
from ddp_course.models import DigitsCNN
from ddp_course.seeding import seed_everything

# Keys of a checkpoint written by lab 3; restore() refuses a file without them.
CHECKPOINT_KEYS = {"model_name", "model", "optimizer", "scaler", "epoch", "step_in_epoch", "global_step", "rng_states"}


def load_weights(path):
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.timeout(180)
def test_default_run_learns_above_97_percent(run_lab3, read_json, tmp_path):
    metrics_file = tmp_path / "metrics.json"
    result = run_lab3("--metrics-json", metrics_file)
    assert result.ok, result.describe()

    metrics = read_json(metrics_file)
    assert metrics["world_size"] == 2 and metrics["backend"] == "gloo" and metrics["device"] == "cpu"
    assert metrics["global_batch_size"] == 64  # 32 per rank x 2 ranks
    assert metrics["steps"] == 10 * 23  # 10 epochs x ceil(719 samples per rank / 32)
    assert metrics["eval_accuracy"] >= 0.97
    assert metrics["train_loss"] < 0.05
    assert metrics["samples_per_s"] > 0 and metrics["wall_s"] > 0
    # The progress lines are the job's: every epoch scores all 359 held-out images exactly once.
    epoch_lines = re.findall(r"epoch (\d+)/10 .*\((\d+)/(\d+)\)", result.stdout)
    assert [int(epoch) for epoch, _, _ in epoch_lines] == list(range(1, 11))
    assert all(total == "359" for _, _, total in epoch_lines)
    history = metrics["history"]
    assert [entry["epoch"] for entry in history] == list(range(1, 11))
    assert history[-1]["eval_accuracy"] == metrics["eval_accuracy"] and history[-1]["step"] == 230
    assert history[0]["train_loss"] > history[-1]["train_loss"]
    assert "global_batch=64" in result.stdout


@pytest.mark.timeout(240)
def test_two_ranks_equal_one_process_on_the_global_batch(run_lab3, tmp_path):
    steps = "15"  # all inside epoch 0 (22 full batches of 64 per epoch)
    ddp_run = run_lab3("--batch-size", "16", "--max-steps", steps, "--save", tmp_path / "ddp.pt")
    single_run = run_lab3("--batch-size", "32", "--max-steps", steps, "--save", tmp_path / "single.pt", nproc=1)
    assert ddp_run.ok, ddp_run.describe()
    assert single_run.ok, single_run.describe()

    ddp_weights, single_weights = load_weights(tmp_path / "ddp.pt"), load_weights(tmp_path / "single.pt")
    assert max_relative_difference(ddp_weights, single_weights) < 1e-5

    # The check can fail: training moved the weights far more than the tolerance, and a run with a
    # different global batch (1 rank x 16) lands measurably elsewhere.
    seed_everything(0)
    initial = DigitsCNN().state_dict()
    assert max_relative_difference(single_weights, initial) > 1e-2
    other_batch_run = run_lab3("--batch-size", "16", "--max-steps", steps, "--save", tmp_path / "other.pt", nproc=1)
    assert other_batch_run.ok, other_batch_run.describe()
    assert max_relative_difference(load_weights(tmp_path / "other.pt"), single_weights) > 1e-3


@pytest.mark.timeout(240)
def test_accumulation_equals_one_process_on_the_global_batch(run_lab3, tmp_path):
    """2 ranks x 2 micro-batches of 8 (no_sync on the first) == 1 process x 32, and != 2 ranks x 8."""
    steps = "10"  # inside epoch 0 (44 full global batches of 32)
    accumulated = run_lab3("--batch-size", "8", "--accumulation-steps", "2", "--max-steps", steps,
                           "--save", tmp_path / "accumulated.pt", "--metrics-json", tmp_path / "metrics.json")
    single = run_lab3("--batch-size", "32", "--max-steps", steps, "--save", tmp_path / "single.pt", nproc=1)
    no_accumulation = run_lab3("--batch-size", "8", "--max-steps", steps, "--save", tmp_path / "small.pt")
    for result in (accumulated, single, no_accumulation):
        assert result.ok, result.describe()
    assert "accumulation=2 global_batch=32" in accumulated.stdout

    accumulated_weights, single_weights = load_weights(tmp_path / "accumulated.pt"), load_weights(tmp_path / "single.pt")
    assert max_relative_difference(accumulated_weights, single_weights) < 1e-5
    assert max_relative_difference(load_weights(tmp_path / "small.pt"), single_weights) > 1e-3
    with open(tmp_path / "metrics.json") as file:
        metrics = json.load(file)
    assert (metrics["steps"], metrics["global_batch_size"], metrics["accumulation_steps"]) == (10, 32, 2)


@pytest.mark.timeout(240)
def test_resume_with_accumulation_continues_exactly(run_lab3, tmp_path):
    """Checkpoints fall on optimizer steps, so resuming never splits a group of micro-batches.

    719 samples per rank in batches of 16 are 45 micro-batches: 11 groups of 4 and a last group of 1,
    so 12 steps per epoch, and 20 steps cross an epoch end and a short group.
    """
    checkpoints, accumulate = tmp_path / "checkpoints", ["--accumulation-steps", "4", "--batch-size", "16"]
    first = run_lab3(*accumulate, "--max-steps", "7", "--checkpoint-dir", checkpoints, "--checkpoint-every", "7")
    assert first.ok, first.describe()
    resumed = run_lab3(*accumulate, "--max-steps", "20", "--checkpoint-dir", checkpoints, "--resume", "--save", tmp_path / "resumed.pt")
    straight = run_lab3(*accumulate, "--max-steps", "20", "--save", tmp_path / "straight.pt")
    assert resumed.ok and straight.ok, resumed.describe() + straight.describe()
    state = torch.load(checkpoints / "checkpoint_step00000007.pt", weights_only=True)
    assert (state["epoch"], state["step_in_epoch"]) == (0, 28)  # 7 steps x 4 micro-batches
    resumed_weights, straight_weights = load_weights(tmp_path / "resumed.pt"), load_weights(tmp_path / "straight.pt")
    assert all(torch.equal(resumed_weights[name], straight_weights[name]) for name in straight_weights)


@pytest.mark.timeout(240)
def test_resume_continues_exactly(run_lab3, tmp_path):
    """k steps, stop, resume for k more == 2k steps in one go, bit for bit (k=30 crosses an epoch end)."""
    checkpoints = tmp_path / "checkpoints"
    first = run_lab3("--max-steps", "30", "--checkpoint-dir", checkpoints, "--checkpoint-every", "10")
    assert first.ok, first.describe()
    resumed = run_lab3("--max-steps", "60", "--checkpoint-dir", checkpoints, "--resume", "--save", tmp_path / "resumed.pt")
    assert resumed.ok, resumed.describe()
    assert "resumed from" in resumed.stdout and "step 30" in resumed.stdout
    straight = run_lab3("--max-steps", "60", "--save", tmp_path / "straight.pt")
    assert straight.ok, straight.describe()

    resumed_weights, straight_weights = load_weights(tmp_path / "resumed.pt"), load_weights(tmp_path / "straight.pt")
    assert resumed_weights.keys() == straight_weights.keys()
    assert all(torch.equal(resumed_weights[name], straight_weights[name]) for name in straight_weights)

    # The newest three checkpoints are kept; each is a plain, safely loadable training state.
    assert [path.name for path in list_checkpoints(checkpoints)] == [
        "checkpoint_step00000030.pt", "checkpoint_step00000046.pt", "checkpoint_step00000060.pt",
    ]  # fmt: skip
    state = torch.load(checkpoints / "checkpoint_step00000060.pt", weights_only=True)
    assert CHECKPOINT_KEYS <= state.keys()
    assert (state["global_step"], state["epoch"], state["step_in_epoch"]) == (60, 2, 14)
    assert len(state["rng_states"]) == 2
    assert not any(name.startswith("module.") for name in state["model"])
    assert not list(checkpoints.glob("*.tmp"))


@pytest.mark.timeout(120)
def test_saved_model_loads_into_the_bare_model(run_lab3, tmp_path):
    result = run_lab3("--max-steps", "3", "--save", tmp_path / "final.pt")
    assert result.ok, result.describe()
    model = DigitsCNN()
    model.load_state_dict(load_weights(tmp_path / "final.pt"))  # strict: raises on "module." keys


def assert_one_clear_error(result, expected):
    """Non-zero exit within seconds, one error line from the script, no traceback from the script."""
    assert not result.timed_out and result.returncode != 0, result.describe()
    assert result.wall_s < 30, result.describe()
    script_errors = [line for line in result.stderr.splitlines() if line.startswith("lab3_ddp.py: error:")]
    assert len(script_errors) == 1, result.describe()
    assert re.search(expected, script_errors[0]), result.describe()
    # torchrun adds its own ChildFailedError report; no worker may print a Python traceback.
    assert "[rank0]: Traceback" not in result.stderr and "[rank1]: Traceback" not in result.stderr
    assert 'lab3_ddp.py", line' not in result.stderr, result.describe()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--batch-size", "0"], r"--batch-size: must be a positive integer"),
        (["--batch-size", "many"], r"--batch-size: must be an integer"),
        (["--lr", "-0.1"], r"--lr: must be a positive number"),
        (["--lr", "0"], r"--lr: must be a positive number"),
        (["--epochs", "-1"], r"--epochs: must be a positive integer"),
        (["--dataset", "imagenet"], r"invalid choice: 'imagenet'"),
        (["--resume"], r"need --checkpoint-dir"),
        (["--amp"], r"--amp needs a CUDA GPU"),
        (["--accumulation-steps", "0"], r"--accumulation-steps: must be a positive integer"),
    ],
)
def test_bad_flags_fail_with_one_line(run_lab3, args, expected):
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
