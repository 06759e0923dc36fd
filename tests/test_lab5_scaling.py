"""labs/lab5_scaling.py: one measurement under torchrun, the sweep driver, and the pieces they share.

Timing thresholds (efficiency >= 0.85 / < 0.6) are measured by the driver itself on a quiet machine
and reported in the lab's notes, not asserted here: a loaded CI machine would make them flaky.

Launches cost seconds each on a 2-core machine, so the module makes few, shares them between
assertions and runs them 3 at a time (the `jobs` fixture): one 2-rank measurement, one sweep driver
running two small jobs, one refused measurement and one bad command line - 4 torchrun jobs and 2
plain Python processes, where this module used to start 13 and 6. Everything that does not need real processes - argument
parsing, the refusals, the interleaved rounds, the efficiencies, the plot, the devices the
all_gather sees - runs in-process on the lab's own functions.
"""

import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from ddp_course.authoring.notebooks import stored_cell
from ddp_course.cli import CourseError
from ddp_course.launch import REPO_ROOT, import_script, run_command, run_torchrun

LAB5 = REPO_ROOT / "labs" / "lab5_scaling.py"
FAST = ["--warmup-steps", "1", "--steps", "2", "--repeats", "1"]
SWEEP_FIELDS = {"config", "world_size", "samples_per_s", "step_time_s", "comm_fraction", "weak_scaling_efficiency", "backend", "device"}
# WideMLP's gradient buckets in MiB, in the order DDP sends them after its rebuild (layer sizes
# 2048x10+10, 3 x 2048x2048+2048, 256x2048+2048 floats). DDP's default caps the first bucket at
# 1 MiB: it closes after the first 16 MiB weight. An explicit 25 MiB cap has no small first bucket.
DEFAULT_LAYOUT = [16.09, 32.02, 2.01]
EXPLICIT_25_LAYOUT = [32.09, 18.02]


def run_driver(*args, timeout_s=240):
    return run_command([sys.executable, str(LAB5), *map(str, args)], timeout_s=timeout_s)


@pytest.fixture(scope="module")
def lab5():
    """The lab script imported as a module (its main() only runs from the command line)."""
    return import_script(LAB5)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every launch of this module, started at once and run 3 at a time: {name: Future}.

    A test waits for its own job's result (a failed job fails only its test). The two short refusals
    go first, so the tests that read them do not wait behind the long jobs. No relaunch of a failed job.
    """
    one = tmp_path_factory.mktemp("lab5_one") / "r.json"
    sweep = tmp_path_factory.mktemp("lab5_sweep")
    # One 2-rank job: strong-scaling batch split, fp16 compression hook, an explicit 25 MiB cap.
    measurement_args = ["--config", "comm_bound", "--global-batch", "8", "--comm-hook", "fp16", "--bucket-cap-mb", "25",
                        "--json", one, *FAST]  # fmt: skip
    # The checkpoint's sweep with DDP's default buckets, shrunk: comm_bound only, 1 round, 2 jobs.
    sweep_args = ["--sweep", "1,2", "--configs", "comm_bound", "--rounds", "1", "--json", sweep / "sweep.json", *FAST]
    pool = ThreadPoolExecutor(max_workers=3)
    futures = {
        "bad flag": pool.submit(run_driver, "--sweep", "1,x", "--json", "o.json", timeout_s=60),
        "refused": pool.submit(run_torchrun, LAB5, ["--global-batch", "7"], nproc=2, timeout_s=120),
        "measurement": pool.submit(lambda: (run_torchrun(LAB5, measurement_args, nproc=2), one)),
        "sweep": pool.submit(lambda: (run_driver(*sweep_args), sweep)),
    }
    yield futures
    pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def measurement(jobs):
    result, path = jobs["measurement"].result()
    assert result.ok, result.describe()
    return result, json.loads(path.read_text())


@pytest.fixture(scope="module")
def default_sweep(jobs):
    result, folder = jobs["sweep"].result()
    assert result.ok, result.describe()
    return result, json.loads((folder / "sweep.json").read_text()), folder


@pytest.mark.timeout(180)  # covers the shared launch when this test is the first to use it
def test_one_measurement_under_torchrun(measurement):
    result, record = measurement
    assert (record["world_size"], record["backend"], record["device"]) == (2, "gloo", "cpu")
    assert (record["per_rank_batch"], record["global_batch"]) == (4, 8)  # --global-batch 8 split over 2 ranks
    assert record["gradient_mb"] == pytest.approx(13_135_882 * 4 / 1e6, rel=1e-3)  # WideMLP's fp32 gradients
    assert (record["comm_hook"], record["amp"]) == ("fp16", "off")
    assert "amp=off" in result.stdout and "comm_hook=fp16" in result.stdout  # rank 0's configuration line
    assert len(record["per_rank_samples_per_s"]) == 2
    assert record["samples_per_s"] == pytest.approx(8 / record["step_time_s"])
    assert record["step_time_s"] == pytest.approx(max(4 / rate for rate in record["per_rank_samples_per_s"]))  # slowest rank
    assert 0 <= record["comm_fraction"] < 1
    assert record["comm_fraction"] == pytest.approx(max(0.0, 1 - record["step_time_no_sync_s"] / record["step_time_s"]))
    assert "comm_fraction" in result.stdout  # rank 0's table


@pytest.mark.timeout(180)
def test_explicit_25_mib_cap_has_no_small_first_bucket(measurement):
    _, record = measurement
    assert record["bucket_cap_mb"] == 25.0
    assert record["bucket_sizes_mib"] == EXPLICIT_25_LAYOUT


@pytest.mark.timeout(300)
def test_default_sweep_measures_ddps_own_buckets(default_sweep):
    result, records, folder = default_sweep
    assert [(r["bucket_cap_mb"], r["world_size"]) for r in records] == [("default", 1), ("default", 2)]
    for record in records:
        assert SWEEP_FIELDS <= record.keys()
        assert record["config"] == "comm_bound" and record["per_rank_batch"] == 4
        # bucket_cap_mb=None reached DDP: a first bucket smaller than 25 MiB (passing 25.0 would give EXPLICIT_25_LAYOUT).
        assert record["bucket_sizes_mib"] == DEFAULT_LAYOUT
        assert len(record["samples_per_s_by_round"]) == 1
    assert records[0]["weak_scaling_efficiency"] == 1.0
    assert records[1]["weak_scaling_efficiency"] == pytest.approx(records[1]["samples_per_s"] / (2 * records[0]["samples_per_s"]))
    assert (folder / "sweep.png").stat().st_size > 10_000
    assert "weak_scaling_efficiency" in result.stdout and "DDP's default buckets" in result.stdout
    assert not list(folder.glob(".lab5_*"))  # per-job files are cleaned up


def test_all_gather_keeps_every_tensor_on_the_rank_device(lab5, monkeypatch):
    """Review finding 1: the step-time gather sent a CUDA input with CPU outputs, which crashes NCCL.

    The fake rank's device is "meta": its tensors carry a device but no data, so a CPU-only machine
    sees what a GPU rank would hand to all_gather. The old code (outputs built with zeros_like of a
    CPU tensor) fails here: its output list is on the CPU.
    """
    calls = []

    def recording_all_gather(outputs, tensor, *args, **kwargs):
        calls.append((tensor.device, [output.device for output in outputs]))

    monkeypatch.setattr(lab5.dist, "all_gather", recording_all_gather)
    rank = SimpleNamespace(device=torch.device("meta"), backend="nccl", world_size=2, rank=0, local_rank=0)
    gathered = lab5.gather_from_every_rank(rank, [0.25, 0.125])
    assert calls == [(torch.device("meta"), [torch.device("meta")] * 2)]
    assert [t.device.type for t in gathered] == ["meta", "meta"]


def test_bucket_caps_accept_default_and_sizes(lab5):
    assert lab5.parse_args([]).bucket_cap_mb == "default"
    assert lab5.parse_args(["--sweep", "1,2", "--json", "o.json"]).bucket_caps == ["default"]
    assert lab5.parse_args(["--bucket-caps", "default,1,25,100"]).bucket_caps == ["default", 1.0, 25.0, 100.0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--sweep", "1,2"], r"--sweep needs --json"),
        (["--sweep", "1", "--configs", "huge", "--json", "o.json"], r"unknown config\(s\) huge"),
        (["--steps", "0"], r"--steps: must be a positive integer"),
        (["--bucket-caps", "default,0"], r"--bucket-caps: must be a positive number"),
        (["--bucket-cap-mb", "big"], r"--bucket-cap-mb: must be a number"),
    ],
)
def test_bad_flags_fail_with_one_line(lab5, refused_flag_line, args, expected):
    assert re.search(expected, refused_flag_line(lab5, args))


@pytest.mark.timeout(180)  # covers the shared launches when this test is the first to wait
def test_bad_flag_on_the_command_line_fails_with_one_line(jobs):
    result = jobs["bad flag"].result()
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode == 2 and len(errors) == 1, result.describe()
    assert "--sweep: must be an integer" in errors[0] and "Traceback" not in result.stderr, result.describe()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"global_batch": 7}, "does not split evenly over 2 ranks"),
        ({"amp": True}, "--amp needs a CUDA GPU"),
    ],
)
def test_impossible_measurements_are_refused(lab5, flags, expected):
    args = SimpleNamespace(**{**vars(lab5.parse_args([])), **flags})
    cpu_rank = SimpleNamespace(device=torch.device("cpu"), backend="gloo", world_size=2)
    with pytest.raises(CourseError, match=re.escape(expected)):
        lab5.check_measurement(cpu_rank, args)


@pytest.mark.timeout(180)
def test_refused_measurement_under_torchrun_prints_one_line(jobs):
    result = jobs["refused"].result()
    errors = [line for line in result.stderr.splitlines() if line.startswith("lab5_scaling.py: error:")]
    assert result.returncode != 0 and len(errors) == 1 and "does not split evenly over 2 ranks" in errors[0], result.describe()
    assert "[rank0]: Traceback" not in result.stderr and 'lab5_scaling.py", line' not in result.stderr, result.describe()


def test_rounds_interleave_and_keep_the_fastest(lab5, monkeypatch, tmp_path, capsys):
    """run_sweep's bookkeeping with fake jobs: rounds interleaved, fastest kept, every round listed,
    strong-scaling efficiency, and a plot with DDP's default next to an explicit cap."""
    throughputs = iter([100.0, 150.0, 200.0, 290.0, 120.0, 140.0, 180.0, 300.0])  # round 1 then round 2

    def fake_job(args, config, cap, world_size):
        batch = args.global_batch // world_size
        return {"config": config, "bucket_cap_mb": cap, "world_size": world_size, "per_rank_batch": batch,
                "samples_per_s": next(throughputs), "step_time_s": 0.1, "comm_fraction": 0.5}  # fmt: skip

    sweep = sys.modules[lab5.run_sweep.__module__]  # labs/lab5_sweep.py, which lab5_scaling.py imports
    monkeypatch.setattr(sweep, "run_job", fake_job)
    out = tmp_path / "strong.json"
    args = lab5.parse_args(["--sweep", "1,2", "--configs", "comm_bound", "--bucket-caps", "default,25", "--global-batch", "8",
                            "--json", str(out)])  # fmt: skip
    assert lab5.run_sweep(args) == 0
    rounds = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("round ")]
    assert rounds == ["round 1/2"] * 4 + ["round 2/2"] * 4
    records = json.loads(out.read_text())
    assert [(r["bucket_cap_mb"], r["world_size"], r["per_rank_batch"]) for r in records] == [
        ("default", 1, 8), ("default", 2, 4), (25.0, 1, 8), (25.0, 2, 4)]  # fmt: skip
    assert [r["samples_per_s_by_round"] for r in records] == [[100.0, 120.0], [150.0, 140.0], [200.0, 180.0], [290.0, 300.0]]
    assert [r["samples_per_s"] for r in records] == [120.0, 150.0, 200.0, 300.0]
    assert [r["strong_scaling_efficiency"] for r in records] == [1.0, 150 / 240, 1.0, 300 / 400]
    assert all(r["weak_scaling_efficiency"] is None for r in records)
    assert out.with_suffix(".png").stat().st_size > 10_000


# --- the sheet's self-check (labs/lab5_scaling.ipynb, Summary): the learning rate for comm_bound on 16 ranks ---


def test_the_self_check_scales_the_learning_rate_with_comm_bounds_global_batch(lab5):
    from fractions import Fraction

    from ddp_course.lab_self_checks import LAB5_SELF_CHECK
    from ddp_course.self_check import verdict

    notebook = REPO_ROOT / "labs" / "lab5_scaling.ipynb"
    per_rank = lab5.CONFIGS["comm_bound"].batch_size
    _, sizes = stored_cell(notebook, "model_sizes = configuration_sizes(")
    assert re.search(rf"comm_bound +\w+ +batch +{per_rank} per rank", sizes), sizes  # what the learner read there
    # The recipe and the rule as the sheet's stored table applies them: peak lr = 0.1 x global batch / 32.
    _, table = stored_cell(notebook, "base_lr, base_batch, warmup_epochs")
    rows = [line.split() for line in table.splitlines()[1:] if line.strip()]
    assert [(int(ranks), int(batch), float(lr)) for ranks, batch, _, lr, _ in rows] == [
        (ranks, ranks * 32, float(Fraction("0.1") * ranks)) for ranks in (1, 2, 8, 64)]  # fmt: skip
    peak_lr = Fraction("0.1") * (16 * per_rank) / 32
    assert LAB5_SELF_CHECK.expected == float(peak_lr) == 0.2
    assert verdict(LAB5_SELF_CHECK, float(peak_lr)).startswith("self-check: correct - ")
    # The recipe's lr unchanged; 16 x the recipe's lr (as if each rank brought 32); the per-rank batch's 4/32 of it.
    for mistake in (0.1, 1.6, 0.0125):
        assert verdict(LAB5_SELF_CHECK, mistake) == f"self-check: not yet - {LAB5_SELF_CHECK.hint}"
