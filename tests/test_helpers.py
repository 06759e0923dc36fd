"""Unit tests of the shared helpers in ddp_course/ (single process, no torchrun unless stated)."""

import argparse
import inspect
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ddp_course import checkpoint, cli, data, distributed, launch, models, reporting, seeding
from ddp_course.compare import max_relative_difference
from ddp_course.launch import REPO_ROOT, RunResult, import_script, run_torchrun

SCRIPTS = REPO_ROOT / "tests" / "scripts"
JOB_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def outside_torchrun(monkeypatch):
    for name in JOB_VARIABLES:
        monkeypatch.delenv(name, raising=False)


# ---- cli -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("parse", "text", "value"), [(cli.positive_int, "3", 3), (cli.non_negative_int, "0", 0), (cli.positive_float, "1e-3", 1e-3)])
def test_argument_types_accept_valid_values(parse, text, value):
    assert parse(text) == value


@pytest.mark.parametrize(
    ("parse", "text"),
    [(cli.positive_int, "0"), (cli.positive_int, "-2"), (cli.positive_int, "2.5"), (cli.non_negative_int, "-1"),
     (cli.positive_float, "0"), (cli.positive_float, "-1"), (cli.positive_float, "nan"), (cli.positive_float, "inf"),
     (cli.positive_float, "fast")],
)  # fmt: skip
def test_argument_types_reject_invalid_values(parse, text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse(text)


def test_list_arguments_for_sweeps():
    assert cli.int_list("1,2,4") == [1, 2, 4]
    assert cli.float_list("1,25.5") == [1.0, 25.5]
    assert cli.name_list("comm_bound, resnet18") == ["comm_bound", "resnet18"]
    for parse, text in ((cli.int_list, "1,0"), (cli.int_list, "1,,2"), (cli.float_list, "1,-3"), (cli.name_list, "a,")):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


@pytest.mark.parametrize(("rank", "prints"), [("0", True), ("1", False)])
def test_parser_error_is_one_line_from_rank_0_only(monkeypatch, capsys, rank, prints):
    monkeypatch.setenv("RANK", rank)
    sleeps = []
    monkeypatch.setattr(cli.time, "sleep", sleeps.append)  # record the quiet rank's grace instead of waiting
    parser = cli.CourseArgumentParser(prog="lab.py")
    parser.add_argument("--lr", type=cli.positive_float)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--lr", "-1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == ("lab.py: error: argument --lr: must be a positive number, got -1\n" if prints else "")
    # A quiet rank leaves rank 0 time to speak before torchrun stops the job; rank 0 exits at once.
    assert sleeps == ([] if prints else [cli.QUIET_RANK_GRACE_S])


# ---- distributed -----------------------------------------------------------------------------


def test_setup_without_torchrun_forms_a_group_of_one(outside_torchrun):
    ctx = distributed.setup_distributed("gloo", timeout_s=10)
    try:
        assert (ctx.rank, ctx.local_rank, ctx.world_size, ctx.is_main) == (0, 0, 1, True)
        assert ctx.backend == "gloo" and ctx.device == torch.device("cpu")
        value = torch.tensor([3.0])
        dist.all_reduce(value)  # a real collective on the one-process group
        assert value.item() == 3.0
    finally:
        distributed.teardown_distributed()
    assert not dist.is_initialized()


def fake_gpus(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize(
    ("gpus", "requested", "local_world_size", "expected"),
    [(0, "auto", 2, "gloo"), (2, "auto", 2, "nccl"), (8, "auto", 4, "nccl"), (1, "auto", 2, "gloo"),
     (2, "gloo", 2, "gloo"), (2, "nccl", 2, "nccl")],
)  # fmt: skip
def test_backend_follows_the_gpus_on_this_node(monkeypatch, outside_torchrun, gpus, requested, local_world_size, expected):
    fake_gpus(monkeypatch, gpus)
    assert distributed.choose_backend(requested, local_world_size) == expected


def test_more_ranks_than_gpus_falls_back_to_gloo_and_says_why(monkeypatch, outside_torchrun, capsys):
    fake_gpus(monkeypatch, 1)
    assert distributed.choose_backend("auto", 2) == "gloo"
    assert "2 processes on this node but only 1 GPU(s)" in capsys.readouterr().out


@pytest.mark.parametrize(("gpus", "local_world_size", "message"), [(0, 1, "none is visible"), (1, 2, "one GPU per process"), (4, 1, "unknown backend")])
def test_impossible_backend_requests_are_course_errors(monkeypatch, gpus, local_world_size, message):
    fake_gpus(monkeypatch, gpus)
    requested = "mpi" if message == "unknown backend" else "nccl"
    with pytest.raises(cli.CourseError, match=message):
        distributed.choose_backend(requested, local_world_size)


@pytest.mark.parametrize(
    ("choices", "expected"),
    [(["nccl", "nccl"], "nccl"), (["nccl", "gloo"], "gloo"), (["gloo", "nccl"], "gloo"), (["gloo", "gloo"], "gloo")],
)
def test_the_job_uses_nccl_only_when_every_rank_can(choices, expected):
    assert distributed.job_backend(choices) == expected


def test_nodes_with_different_gpus_agree_on_one_backend(monkeypatch):
    """Review finding 20: node 0 has 8 GPUs for its 8 processes, node 1 has none; `auto` alone would
    give node 0 NCCL and node 1 gloo. Through a shared store both ranks reach gloo."""
    import threading
    from datetime import timedelta

    # Each node's own verdict, with the device counts that node reports.
    fake_gpus(monkeypatch, 8)
    node0_choice = distributed.choose_backend("auto", local_world_size=8)
    fake_gpus(monkeypatch, 0)
    node1_choice = distributed.choose_backend("auto", local_world_size=1)
    assert (node0_choice, node1_choice) == ("nccl", "gloo")  # what `auto` per node would have mixed

    store = dist.HashStore()  # stands in for torchrun's TCP store, shared by every rank
    answers = {}

    def rank_main(rank, my_choice):
        answers[rank] = distributed.agree_on_backend(store, rank, 2, my_choice, timedelta(seconds=10))

    ranks = [threading.Thread(target=rank_main, args=(0, node0_choice)), threading.Thread(target=rank_main, args=(1, node1_choice))]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join(timeout=15)
    assert answers == {0: ("gloo", [1]), 1: ("gloo", [1])}


# Lab 3 writes the set-up out (join_process_group) where every other lab calls setup_distributed(): the
# two must take the same steps. Each case: torchrun's variables, GPUs on this node, --backend, and for a
# two-node job the backend every other rank chose (posted in torchrun's store, as agree_on_backend reads it).
NODE_RANK_1 = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
TWO_NODES_RANK_9 = {"RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
TWO_NODES_RANK_0 = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
SET_UP_CASES = {  # name: (environment, GPUs, --backend, the other node's choice, what both must do)
    "plain python": ({}, 0, "auto", None, "gloo cpu HashStore"),
    "2 CPU ranks": (NODE_RANK_1, 0, "auto", None, "gloo cpu env://"),
    "2 GPU ranks": (NODE_RANK_1, 2, "auto", None, "nccl cuda:1 env://"),
    "gloo asked on GPUs": (NODE_RANK_1, 2, "gloo", None, "gloo cpu env://"),
    "more ranks than GPUs": (NODE_RANK_1, 1, "auto", None, "gloo cpu env://"),
    "no LOCAL_WORLD_SIZE, 1 GPU": ({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}, 1, "auto", None, "gloo cpu env://"),
    "nccl asked, no GPU": (NODE_RANK_1, 0, "nccl", None, "CourseError"),
    "2 nodes of 8 GPUs": (TWO_NODES_RANK_9, 8, "auto", "nccl", "nccl cuda:1 PrefixStore"),
    "2 nodes, one without GPUs": (TWO_NODES_RANK_0, 8, "auto", "gloo", "gloo cpu PrefixStore"),
    "2 nodes, nccl asked": (TWO_NODES_RANK_9, 8, "nccl", None, "nccl cuda:1 env://"),
    "the group cannot form": (NODE_RANK_1, 2, "auto", None, "GroupJoinError"),
}  # fmt: skip
INIT_SIGNATURE = inspect.signature(dist.init_process_group)  # torch's own, read before a test replaces it


def set_up_steps(set_up, monkeypatch, capsys, environment, gpus, backend, others_chose, case):
    """Run set_up(backend, timeout_s=7) with torch's process-group calls recorded instead of made; return
    (the calls in order, with init_process_group's arguments as torch binds them, the result, the output)."""
    for name in (*JOB_VARIABLES, "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    fake_gpus(monkeypatch, gpus)
    calls = []

    def init_process_group(*args, **kwargs):
        bound = INIT_SIGNATURE.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        if arguments["store"] is not None:
            arguments["store"] = type(arguments["store"]).__name__  # a new store each call: compare its kind
        calls.append(("init_process_group", arguments))
        if case == "the group cannot form":
            raise RuntimeError("Connection refused\nat the first try")

    def rendezvous(url, rank, world_size, timeout):
        calls.append(("rendezvous", url, rank, world_size, timeout))
        store = dist.HashStore()  # stands in for torchrun's store; every other rank has posted its choice
        for other in range(world_size):  # 8 ranks per node: this node's others chose as this rank will
            if other != rank:
                store.set(f"ddp_course/backend/0/{other}", others_chose if other // 8 != rank // 8 else "nccl")
        yield store, rank, world_size

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "rendezvous", rendezvous)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    try:
        result = set_up(backend, timeout_s=7)
    except Exception as error:  # a refusal: compare its type and its one line
        result = (type(error).__name__, str(error))
    assert all(call[0] != "init_process_group" or call[1]["timeout"] == timedelta(seconds=7) for call in calls)
    output = capsys.readouterr()
    return calls, result, (output.out, output.err)


def summary(calls, result) -> str:
    """What a set-up did, in the words of SET_UP_CASES."""
    if isinstance(result, tuple):
        return result[0]
    [(_, arguments)] = [call for call in calls if call[0] == "init_process_group"]
    return f"{result.backend} {result.device} {arguments['store'] or 'env://'}"


@pytest.mark.parametrize("case", SET_UP_CASES)
def test_lab3s_inline_set_up_takes_the_steps_of_setup_distributed(monkeypatch, capsys, case):
    lab3 = import_script(REPO_ROOT / "labs" / "lab3_ddp.py")
    environment, gpus, backend, others_chose, expected = SET_UP_CASES[case]
    inline = set_up_steps(lab3.join_process_group, monkeypatch, capsys, environment, gpus, backend, others_chose, case)
    helper = set_up_steps(distributed.setup_distributed, monkeypatch, capsys, environment, gpus, backend, others_chose, case)
    assert inline == helper  # the same calls with the same arguments, the same context or error, the same output
    calls, result, (out, err) = inline
    assert summary(calls, result) == expected
    if expected.startswith("nccl"):  # the device is set before the group forms, and the group is bound to it
        assert [call[0] for call in calls][-2:] == ["set_device", "init_process_group"]
        assert calls[-2][1] == calls[-1][1]["device_id"] == torch.device("cuda", 1)
    if case == "2 nodes, one without GPUs":
        assert "note: ranks [8, 9, 10, 11, 12, 13, 14, 15] cannot use NCCL on their node" in out  # rank 0 speaks
    if case == "the group cannot form":  # rank 1 writes its own one line
        assert "error: rank 1 could not join the nccl process group: RuntimeError: Connection refused" in err


@pytest.mark.parametrize(("rank", "every_rank", "expected"), [("0", False, "hello\n"), ("1", False, ""), ("1", True, "[rank 1] hello\n")])
def test_log_speaks_once_or_with_a_rank_prefix(monkeypatch, capsys, rank, every_rank, expected):
    monkeypatch.setenv("RANK", rank)
    distributed.log("hello", every_rank=every_rank)
    assert capsys.readouterr().out == expected


def test_log_error_goes_to_stderr_on_rank_0(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    distributed.log_error("bad thing")
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.endswith("error: bad thing\n")


# ---- seeding ---------------------------------------------------------------------------------


def test_same_seed_gives_the_same_model():
    seeding.seed_everything(7)
    first = models.DigitsCNN().state_dict()
    seeding.seed_everything(7)
    second = models.DigitsCNN().state_dict()
    seeding.seed_everything(8)
    third = models.DigitsCNN().state_dict()
    assert max_relative_difference(first, second) == 0.0
    assert max_relative_difference(first, third) > 0.1


def test_rng_state_round_trips_through_a_safe_checkpoint(tmp_path):
    import random

    seeding.seed_everything(3)
    checkpoint.atomic_save({"rng": seeding.get_rng_state()}, tmp_path / "rng.pt")
    expected = (torch.rand(3), random.random())
    seeding.seed_everything(99)
    seeding.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True)["rng"])
    restored = (torch.rand(3), random.random())
    assert torch.equal(expected[0], restored[0]) and expected[1] == restored[1]


def test_a_dataloader_iterator_draws_from_the_default_generator_unless_it_has_its_own():
    """Why the labs give their DataLoaders a generator (finding 3 of the 2026-11-24 review): iter(loader)
    draws a base seed for its workers even with num_workers=0, which puts dropout one draw out of step."""
    dataset = torch.arange(8.0)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    iter(torch.utils.data.DataLoader(dataset, batch_size=4))
    assert not torch.equal(torch.get_rng_state(), before)  # the default stream moved
    before = torch.get_rng_state()
    own = torch.Generator().manual_seed(seeding.dataloader_seed(0, rank=1, epoch=2))
    iter(torch.utils.data.DataLoader(dataset, batch_size=4, generator=own))
    assert torch.equal(torch.get_rng_state(), before)  # untouched


def test_dataloader_seed_depends_on_seed_rank_and_epoch_only():
    seeds = {seeding.dataloader_seed(seed, rank, epoch) for seed in (0, 1) for rank in range(4) for epoch in range(3)}
    assert len(seeds) == 24 and all(0 <= seed < 2**63 for seed in seeds)
    assert seeding.dataloader_seed(0, 1, 2) == seeding.dataloader_seed(0, 1, 2)


def test_rank0_decides_alone_in_a_single_process(outside_torchrun):
    ctx = distributed.setup_distributed("gloo", timeout_s=30)
    try:
        from ddp_course.training import check_ranks_agree, rank0_decides

        assert rank0_decides(lambda: ("checkpoint_step00000025.pt", {"global_step": 30}), ctx) == (
            "checkpoint_step00000025.pt", {"global_step": 30},
        )  # fmt: skip
        check_ranks_agree("global_step", 25, "a path")  # one rank always agrees with itself
    finally:
        distributed.teardown_distributed()


# ---- data and models -------------------------------------------------------------------------


def test_digits_split_is_fixed_disjoint_and_standardized():
    splits = data.load_digits()
    train_images, train_labels = splits.train.tensors
    test_images, _ = splits.test.tensors
    assert (len(splits.train), len(splits.test)) == (1438, 359)
    assert train_images.shape[1:] == (1, 8, 8) and train_labels.dtype == torch.long
    assert set(train_labels.tolist()) == set(range(10))
    # Standardized in float32 with float32 statistics of 92,032 values: torch sums in blocks, so
    # each statistic is off by tens of float32 eps at most, on any CPU kernel. Checked in float64 so
    # the check adds no rounding of its own; 100 eps (1.2e-5) and 1000 eps (1.2e-4) leave a margin.
    eps = torch.finfo(torch.float32).eps
    assert abs(train_images.double().mean().item()) < 100 * eps
    assert abs(train_images.double().std().item() - 1) < 1000 * eps
    # Disjoint: no held-out image also appears in the training split.
    train_rows = {tuple(row.tolist()) for row in train_images.flatten(1)}
    overlap = sum(tuple(row.tolist()) in train_rows for row in test_images.flatten(1))
    assert overlap <= 2  # the raw data holds a couple of identical images; a leak would be hundreds
    assert torch.equal(data.load_digits().test.tensors[0], test_images)  # same split every call


def test_digits_are_read_without_importing_sklearn_and_equal_its_load_digits(monkeypatch):
    """data.digits_arrays() reads scikit-learn's CSV file itself (its import costs every rank seconds of CPU)."""
    with monkeypatch.context() as patched:
        patched.setitem(sys.modules, "sklearn.datasets", None)  # any `import sklearn.datasets` now fails
        pixels, labels = data.digits_arrays()
    from sklearn.datasets import load_digits as sklearn_digits

    sklearn_pixels, sklearn_labels = sklearn_digits(return_X_y=True)
    assert pixels.dtype == sklearn_pixels.dtype and labels.dtype == sklearn_labels.dtype
    assert (pixels == sklearn_pixels).all() and (labels == sklearn_labels).all() and pixels.shape == (1797, 64)


def test_unknown_dataset_is_a_course_error():
    with pytest.raises(cli.CourseError, match="unknown dataset 'mnist'"):
        data.load_dataset("mnist")


def test_digits_cnn_shapes_and_no_batchnorm_or_dropout():
    model = models.build_model("digits_cnn")
    assert model(torch.zeros(5, 1, 8, 8)).shape == (5, 10)
    forbidden = (torch.nn.modules.batchnorm._BatchNorm, torch.nn.Dropout)
    assert not any(isinstance(module, forbidden) for module in model.modules())


def test_cifar_resnet18_keeps_32x32_resolution_in_its_stem():
    model = models.build_model("resnet18")
    assert model.conv1.stride == (1, 1) and isinstance(model.maxpool, torch.nn.Identity)
    assert model.eval()(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize(("name", "input_shape", "parameters"), [("wide_mlp", (256,), 13_135_882), ("conv_net", (3, 32, 32), 94_538)])
def test_scaling_models_have_the_documented_sizes(name, input_shape, parameters):
    model = models.build_model(name)
    assert sum(p.numel() for p in model.parameters()) == parameters
    assert model(torch.zeros(2, *input_shape)).shape == (2, 10)


def test_format_table_aligns_columns_and_rounds():
    table = reporting.format_table([{"config": "a", "rate": 1234.5678, "x": None}, {"config": "long_name", "rate": 2.0}], ["config", "rate", "x"])
    assert table.splitlines() == [
        "   config  rate  x",
        "---------  ----  -",
        "        a  1235  -",
        "long_name     2  -",
    ]


def test_plot_scaling_writes_a_figure(tmp_path):
    records = [{"config": "c", "bucket_cap_mb": 25.0, "world_size": n, "samples_per_s": 100.0 * n * 0.9, "comm_fraction": 0.1 * n} for n in (1, 2, 4)]
    reporting.plot_scaling(records, str(tmp_path / "scaling.png"))
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"


def test_unknown_model_is_rejected():
    with pytest.raises(ValueError, match="unknown model"):
        models.build_model("vgg")


def test_relative_difference_is_per_tensor():
    reference = {"big": torch.full((100,), 10.0), "small": torch.full((2,), 1e-3)}
    nudged = {"big": reference["big"].clone(), "small": reference["small"] * 1.5}
    assert max_relative_difference(nudged, reference) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="different parameter names"):
        max_relative_difference({"big": reference["big"]}, reference)


# ---- checkpoint ------------------------------------------------------------------------------


def test_checkpoints_are_listed_by_step_not_by_name(tmp_path):
    for step in (9, 100, 10):
        checkpoint.atomic_save({"step": step}, checkpoint.checkpoint_path(tmp_path, step))
    (tmp_path / "checkpoint_step00000200.pt.tmp").write_bytes(b"half written")
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == [
        "checkpoint_step00000009.pt", "checkpoint_step00000010.pt", "checkpoint_step00000100.pt",
    ]  # fmt: skip
    assert checkpoint.latest_checkpoint(tmp_path).name == "checkpoint_step00000100.pt"
    assert checkpoint.latest_checkpoint(tmp_path / "missing") is None


def test_a_failed_save_leaves_the_previous_file_intact(tmp_path):
    path = tmp_path / "model.pt"
    checkpoint.atomic_save({"weights": torch.ones(3)}, path)
    with pytest.raises(Exception):
        checkpoint.atomic_save({"unpicklable": lambda: None}, path)
    assert torch.equal(torch.load(path, weights_only=True)["weights"], torch.ones(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]


def test_atomic_save_flushes_the_file_then_renames_then_flushes_the_directory(tmp_path, monkeypatch):
    """Review finding 29: without the directory fsync, a power loss can undo the rename."""
    import stat

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def recording_fsync(descriptor):
        events.append("fsync directory" if stat.S_ISDIR(os.fstat(descriptor).st_mode) else "fsync file")
        real_fsync(descriptor)

    def recording_replace(source, destination):
        events.append("replace")
        real_replace(source, destination)

    monkeypatch.setattr(checkpoint.os, "fsync", recording_fsync)
    monkeypatch.setattr(checkpoint.os, "replace", recording_replace)
    checkpoint.atomic_save({"weights": torch.ones(2)}, tmp_path / "model.pt")
    assert events == ["fsync file", "replace", "fsync directory"]


def test_save_checkpoint_keeps_the_newest_files(tmp_path, outside_torchrun):
    for step in range(1, 6):
        checkpoint.save_checkpoint({"global_step": step}, tmp_path, step, is_main=True, keep_last=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["checkpoint_step00000004.pt", "checkpoint_step00000005.pt"]


def test_save_checkpoint_writes_nothing_on_other_ranks(tmp_path, outside_torchrun):
    checkpoint.save_checkpoint({"global_step": 1}, tmp_path, 1, is_main=False)
    assert list(tmp_path.iterdir()) == []


def test_load_checkpoint_turns_every_failure_into_one_line(tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00" * 100)
    with pytest.raises(cli.CourseError, match="corrupt or not a checkpoint"):
        checkpoint.load_checkpoint(garbage)
    unsafe = tmp_path / "unsafe.pt"
    torch.save({"model": argparse.Namespace(x=1)}, unsafe)  # arbitrary objects need weights_only=False
    with pytest.raises(cli.CourseError, match="corrupt or not a checkpoint"):
        checkpoint.load_checkpoint(unsafe)
    partial = tmp_path / "partial.pt"
    torch.save({"model": {}}, partial)
    with pytest.raises(cli.CourseError, match="missing epoch"):
        checkpoint.load_checkpoint(partial, ("model", "epoch"))


def test_atomic_write_json(tmp_path, read_json):
    checkpoint.atomic_write_json({"b": 1, "a": [1.5]}, tmp_path / "out" / "m.json")
    assert read_json(tmp_path / "out" / "m.json") == {"a": [1.5], "b": 1}


# ---- launch (real torchrun jobs) -------------------------------------------------------------


@pytest.fixture(scope="module")
def launches():
    """{name: RunResult} of this file's three torchrun jobs, started together: two of them spend most of
    their time waiting (for the launcher's timeout, for the process group's), so the waits overlap.

    The caller sees two GPUs (review finding 2): every job is launched with CUDA_VISIBLE_DEVICES=0,1.
    """
    jobs = {
        "report rank": (SCRIPTS / "report_rank.py", ["--tag", "x"], 60),
        # 8 s: 4x the 2 s the workers took to start beside the other two jobs (load average 3)
        "sleep forever": (SCRIPTS / "sleep_forever.py", [], 8),
        "skip collective": (SCRIPTS / "skip_collective.py", ["--timeout-s", "3"], 60),
    }
    with pytest.MonkeyPatch.context() as patch, ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        patch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
        futures = {name: pool.submit(run_torchrun, script, args, nproc=2, timeout_s=timeout) for name, (script, args, timeout) in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.timeout(90)
def test_launcher_runs_every_rank_with_torchrun_environment_and_no_gpu(launches):
    """Review finding 2: with two GPUs visible to the caller, the launched job still sees none, so
    `--backend auto` picks gloo (report_rank.py counts the GPUs in CUDA_VISIBLE_DEVICES, as CUDA does)."""
    result = launches["report rank"]
    assert result.ok, result.describe()
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("[rank"))
    assert lines == [
        "[rank 0] world_size 2 local_rank 0 sum 1 tag x threads 1 cuda_visible_devices '' auto_backend gloo",
        "[rank 1] world_size 2 local_rank 1 sum 1 tag x threads 1 cuda_visible_devices '' auto_backend gloo",
    ]
    assert "--standalone" in result.command and "--nproc_per_node=2" in result.command


def test_child_environment_hides_gpus_unless_asked():
    parent = {"CUDA_VISIBLE_DEVICES": "0,1", "RANK": "3", "PATH": "/bin"}
    hidden = launch.child_environment(parent, threads_per_rank=1, env=None, use_gpus=False)
    assert hidden["CUDA_VISIBLE_DEVICES"] == "" and hidden["PATH"] == "/bin" and "RANK" not in hidden
    assert hidden["OMP_NUM_THREADS"] == "1"
    shown = launch.child_environment(parent, threads_per_rank=None, env=None, use_gpus=True)
    assert shown["CUDA_VISIBLE_DEVICES"] == "0,1" and "OMP_NUM_THREADS" not in shown
    explicit = launch.child_environment(parent, threads_per_rank=1, env={"CUDA_VISIBLE_DEVICES": "1"}, use_gpus=False)
    assert explicit["CUDA_VISIBLE_DEVICES"] == "1"  # an explicit env entry wins


@pytest.mark.timeout(90)
def test_launcher_kills_a_job_that_runs_past_its_timeout(launches):
    result = launches["sleep forever"]
    assert result.timed_out and result.returncode is None and not result.ok
    assert result.wall_s < 30
    # Both workers were running when the timeout struck, so "no leftover" below is not vacuous.
    # Counted as text, not as lines: the two workers share one pipe, and their lines can interleave.
    assert result.stdout.count("sleep_forever.py: started") == 2, result.describe()
    # SIGKILL takes effect asynchronously: poll for up to 5 s instead of sleeping a fixed second.
    deadline = time.monotonic() + 5
    while (leftovers := _sleep_forever_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert leftovers == []


def _sleep_forever_processes():
    return [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline(pid).endswith("sleep_forever.py")]


@pytest.mark.timeout(90)
def test_process_group_timeout_turns_a_hang_into_an_error(launches):
    """Rank 1 never joins rank 0's all_reduce: with a 3 s timeout the job fails instead of hanging."""
    result = launches["skip collective"]
    assert not result.timed_out and result.returncode != 0, result.describe()
    assert result.wall_s < 40, result.describe()
    assert "rank 0 timed out in all_reduce" in result.stdout, result.describe()


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def test_run_result_recognises_only_the_gloo_exit_abort():
    def result(returncode, stderr):
        return RunResult(command=["x"], returncode=returncode, stdout="", stderr=stderr, wall_s=0.1, timed_out=False)

    assert result(-6, "terminate called without an active exception\n").aborted_at_exit
    assert not result(1, "lab5_scaling.py: error: --amp needs a CUDA GPU\n").aborted_at_exit
    assert not result(0, "terminate called without an active exception\n").aborted_at_exit  # a job that succeeded


def test_start_in_background_returns_at_once_and_hands_over_the_result(monkeypatch):
    release = __import__("threading").Event()

    def slow_run(script, args, nproc, timeout_s, **options):
        release.wait(10)  # the "job" runs until the test lets it finish
        return (script, list(args), nproc, timeout_s, options)

    monkeypatch.setattr(launch, "run_torchrun", slow_run)
    future = launch.start_in_background("job.py", ["--x"], nproc=3, timeout_s=9, env={"A": "1"})
    assert not future.done()  # the caller goes on while the job runs
    release.set()
    assert future.result(timeout=10) == ("job.py", ["--x"], 3, 9, {"env": {"A": "1"}})


@pytest.mark.parametrize("arguments", [[], ["--help"], ["missing.ipynb"], ["README.md"]])
def test_notebook_runner_refuses_bad_input_with_usage_and_status_2(capsys, arguments):
    from ddp_course.authoring import notebooks

    assert notebooks.main(arguments) == 2
    assert "usage: python -m ddp_course.authoring.notebooks" in capsys.readouterr().err


def test_launch_log_records_every_command_and_the_summary_counts_crashes(monkeypatch, tmp_path, capsys):
    """DDP_COURSE_LAUNCH_LOG: one JSON line per command; --from-log counts crashes and fails on one."""
    import json
    import sys

    log_path = tmp_path / "launches.jsonl"
    monkeypatch.setenv(launch.LAUNCH_LOG_VARIABLE, str(log_path))
    launch.run_command([sys.executable, "-c", "import sys; sys.exit(3)"], timeout_s=60)
    crash = "terminate called without an active exception\nSignal 6 (SIGABRT) received by PID 7"
    launch.run_command([sys.executable, "-c", f"import sys; sys.stderr.write({crash!r}); sys.exit(1)"], timeout_s=60)
    first, second = (json.loads(line) for line in log_path.read_text().splitlines())
    assert first["returncode"] == 3 and not first["aborted_at_exit"] and not first["killed_by_signal"]
    assert second["aborted_at_exit"] and second["killed_by_signal"]
    assert first["launched_by"].startswith("tests/test_helpers.py::")
    stability = import_script(REPO_ROOT / "benchmarks" / "teardown_stability.py", "teardown_stability")
    assert stability.summarize_log(log_path) == 1  # an abort at exit makes the summary fail
    assert "2 launches, 1 aborted at exit" in capsys.readouterr().out
    log_path.write_text(log_path.read_text().splitlines()[0] + "\n")
    assert stability.summarize_log(log_path) == 0  # a plain non-zero exit (a negative test) is not an abort


def test_train_flops_per_sample_counts_forward_and_both_gradients_of_every_product():
    from ddp_course.models import WideMLP, train_flops_per_sample

    weights = [layer.weight.numel() for layer in WideMLP().layers if isinstance(layer, torch.nn.Linear)]
    # 2 FLOPs per multiply-add: forward x @ W, backward the weight's gradient and the input's gradient,
    # except for the first layer, whose input (the data) needs no gradient
    expected = 2 * sum(weights) + 2 * sum(weights) + 2 * sum(weights[1:])
    assert train_flops_per_sample("wide_mlp", (256,)) == expected


def test_lecture_5bs_step_flops_count_the_same_products_and_checkpointing_only_adds_forward_work():
    """memory_peaks.step_flops (lecture 5b, section 4): the plain step is the count derived above, at the batch."""
    from ddp_course.memory_peaks import MEMORY_BATCH, memory_model, step_flops

    weights = [layer.weight.numel() for layer in memory_model().layers if isinstance(layer, torch.nn.Linear)]
    plain = (2 * sum(weights) + 2 * sum(weights) + 2 * sum(weights[1:])) * MEMORY_BATCH
    assert step_flops(segments=0) == plain
    forward = 2 * sum(weights) * MEMORY_BATCH
    assert plain < step_flops(segments=4) <= plain + forward  # backward recomputes at most one forward pass
