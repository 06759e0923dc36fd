"""ddp_course.sharding: storage-counted bytes, the collective counter and the per-step formula.

In this process, on a one-rank gloo group (collectives run and return at once): every count is
checked against numbers worked out by hand. The counter's job-level numbers (2 and 4 ranks, every
stage) are checked against the formula by tests/test_lab8_fsdp.py.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ddp_course import sharding
from ddp_course.launch import REPO_ROOT, import_script


@pytest.fixture(scope="module")
def one_rank_group():
    """A gloo process group of one rank in this process, destroyed afterwards."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_storage_bytes_counts_each_storage_once():
    base = torch.zeros(10, 4)  # 160 bytes
    views = [base, base[2:], base.t(), base.view(-1)]  # one storage, counted whole
    other = torch.zeros(3, dtype=torch.float16)  # 6 bytes
    assert sharding.storage_bytes(views + [other, None]) == 160 + 6


def test_storage_bytes_counts_a_freed_storage_as_zero():
    full = torch.zeros(8, 8)
    full.untyped_storage().resize_(0)  # what FSDP does with full weights between uses
    assert sharding.storage_bytes([full]) == 0


def test_model_state_bytes_with_adamw_and_tied_weights():
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5))  # 15 + 15 + 5 floats
    model[1].weight = model[0].weight  # tied: one storage, counted once (15 + 5 floats)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.tensor([0, 1])).sum().backward()
    optimizer.step()
    counted = sharding.model_state_bytes(model.parameters(), optimizer)
    # AdamW's state per parameter: exp_avg and exp_avg_sq (same size) and a float32 step scalar
    assert counted == {"parameters": 80, "gradients": 80, "optimizer_state": 2 * 80 + 2 * 4, "total": 80 + 80 + 168}


def test_model_state_bytes_without_gradients_or_state():
    model = nn.Linear(4, 2)
    counted = sharding.model_state_bytes(model.parameters(), torch.optim.SGD(model.parameters(), lr=0.1))
    assert counted == {"parameters": 40, "gradients": 0, "optimizer_state": 0, "total": 40}


def test_model_state_bytes_reads_a_sharded_optimizers_local_shard(one_rank_group):
    minddp = import_script(REPO_ROOT / "solutions" / "minddp.py", "solutions_minddp")
    model = nn.Linear(4, 2)
    optimizer = minddp.ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    assert sharding.model_state_bytes(model.parameters(), optimizer)["optimizer_state"] == 2 * 40 + 2 * 4


def test_storage_bytes_of_a_dtensor_is_its_local_shard(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    dtensor = distribute_tensor(torch.zeros(6, 2), mesh, [Shard(0)])
    assert sharding.storage_bytes([dtensor]) == dtensor.to_local().numel() * 4 == 48


@pytest.mark.filterwarnings("ignore:`torch.distributed.*` is deprecated:FutureWarning")  # the old names, on purpose
def test_count_collectives_records_each_kind_and_its_payload(one_rank_group):
    vector = torch.zeros(10)  # 40 bytes
    with sharding.count_collectives() as counter:
        dist.all_reduce(vector)
        dist.broadcast(vector, src=0)
        dist.all_gather([torch.zeros(10)], vector)
        dist.all_gather_into_tensor(torch.zeros(10), vector)  # calls c10d's all_gather_single: counted once
        dist.reduce_scatter_tensor(torch.zeros(10), vector)
        if hasattr(dist, "all_gather_single"):  # torch 2.14's names
            dist.all_gather_single(torch.zeros(10), vector)
            dist.reduce_scatter_single(torch.zeros(10), vector)
    renamed = 1 if hasattr(dist, "all_gather_single") else 0
    assert counter.calls[:5] == [("all_reduce", 40), ("broadcast", 40), ("all_gather", 40), ("all_gather", 40), ("reduce_scatter", 40)]
    assert counter.bytes_by_kind() == {"all_reduce": 40, "broadcast": 40, "all_gather": 80 + 40 * renamed, "reduce_scatter": 40 + 40 * renamed}


def test_count_collectives_restores_torch_distributed_and_the_modules(one_rank_group):
    originals = {name: getattr(dist, name) for name in sharding.COLLECTIVES if hasattr(dist, name)}
    module = types.SimpleNamespace(my_all_reduce=dist.all_reduce, unrelated=len)
    with sharding.count_collectives(module) as counter:
        assert dist.all_reduce is not originals["all_reduce"]
        module.my_all_reduce(torch.zeros(3))  # an alias saved before the block, as minifsdp does
    assert counter.calls == [("all_reduce", 12)]
    assert module.my_all_reduce is originals["all_reduce"] and module.unrelated is len
    assert {name: getattr(dist, name) for name in originals} == originals
    dist.all_reduce(torch.zeros(3))
    assert counter.calls == [("all_reduce", 12)]  # nothing recorded after the block


def test_count_collectives_sees_minifsdps_own_aliases(one_rank_group):
    minifsdp = import_script(REPO_ROOT / "solutions" / "minifsdp.py", "solutions_minifsdp")
    model = minifsdp.FSDP(nn.Sequential(nn.Linear(4, 6, bias=False), nn.LayerNorm(6)))
    with sharding.count_collectives() as missed:  # torch.distributed alone: the aliases bypass it
        model(torch.ones(2, 4)).sum().backward()
    with sharding.count_collectives(minifsdp) as counter:
        model(torch.ones(2, 4)).sum().backward()
        model.finish_gradient_synchronization()
    assert missed.calls == []
    # 24 floats gathered before forward and before backward, 24 reduce-scattered; LayerNorm's 12 all-reduced
    assert counter.bytes_by_kind() == {"all_gather": 2 * 96, "reduce_scatter": 96, "all_reduce": 2 * 24}


def test_count_collectives_sees_ddp_through_a_python_comm_hook(one_rank_group):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    plain, hooked = DDP(nn.Linear(4, 2)), DDP(nn.Linear(4, 2))
    hooked.register_comm_hook(None, default_hooks.allreduce_hook)
    with sharding.count_collectives() as counter:
        plain(torch.ones(1, 4)).sum().backward()  # the C++ reducer's all-reduce is invisible
        assert counter.calls == []
        hooked(torch.ones(1, 4)).sum().backward()
    assert counter.calls == [("all_reduce", 40)]  # one bucket: the 10 gradients
    del plain, hooked


def test_ring_model_bytes_use_the_ring_costs():
    counter = sharding.CollectiveCounter([("all_reduce", 100), ("all_gather", 100), ("reduce_scatter", 100), ("broadcast", 100)])
    assert counter.ring_model_bytes_per_rank(4) == pytest.approx(2 * 0.75 * 100 + 3 * 0.75 * 100)
    assert counter.ring_model_bytes_per_rank(1) == 0


@pytest.mark.parametrize("n", [2, 4, 8])
def test_predicted_bytes_per_step(n):
    ddp = sharding.predicted_bytes_per_step("ddp", 1000, 0, n)
    assert ddp == pytest.approx(2 * (n - 1) / n * 1000)
    assert sharding.predicted_bytes_per_step("zero2", 1000, 0, n) == pytest.approx(ddp)
    assert sharding.predicted_bytes_per_step("zero1", 1000, 0, n) == pytest.approx(1.5 * ddp)
    assert sharding.predicted_bytes_per_step("fsdp", 1000, 0, n) == pytest.approx(1.5 * ddp)  # ZeRO-3: 1.5x DDP
    fsdp = sharding.predicted_bytes_per_step("fsdp", 1000, 10, n)  # replicated 1-D parameters: all-reduced
    assert fsdp == pytest.approx(1.5 * ddp + 2 * (n - 1) / n * 10)


def test_predicted_bytes_per_step_refuses_an_unknown_stage():
    with pytest.raises(ValueError, match="stage must be one of"):
        sharding.predicted_bytes_per_step("zero3", 1, 0, 2)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_predicted_state_bytes_per_stage(n):
    """Parameters 4, gradients 4, Adam 8 bytes per element; each stage shards one more of them."""
    assert sharding.predicted_state_bytes("ddp", 400, 0, n) == 1600
    assert sharding.predicted_state_bytes("zero1", 400, 0, n) == pytest.approx(800 + 800 / n)
    assert sharding.predicted_state_bytes("zero2", 400, 0, n) == pytest.approx(400 + 1200 / n)
    assert sharding.predicted_state_bytes("fsdp", 400, 40, n) == pytest.approx(1600 / n + 160)
    assert sharding.predicted_state_bytes("fsdp", 400, 0, 1) == sharding.predicted_state_bytes("ddp", 400, 0, 1)


def test_step_watch_samples_every_module_boundary_and_counts_each_storage_once():
    """A two-layer model: entry and exit of every module in forward, before every module's backward, and
    "after forward" (the outermost module's hook); a tensor listed in two categories counts in the first."""
    model = nn.Sequential(nn.Linear(4, 3, bias=False), nn.Linear(3, 2, bias=False))  # 12 + 6 floats
    weights = list(model.parameters())
    extra = torch.zeros(5)  # 20 bytes
    watch = sharding.StepWatch({"weights": lambda: weights, "extra": lambda: [extra, weights[0]]})
    with watch.during(model):
        model(torch.ones(1, 4)).sum().backward()
    labels = [label for label, _ in watch.samples]
    assert labels == ["forward > model", "forward > 0", "forward < 0", "forward > 1", "forward < 1", "forward < model",
                      "after forward", "backward > 1", "backward > model", "backward > 0"]  # fmt: skip
    # (layer 1's output IS the model's: both hooks sit on one tensor, in the order they were registered)
    assert watch.at("after forward") == {"weights": 72, "extra": 20}  # weights[0] counted once, as a weight
    assert watch.peak() == 92 and watch.peak("extra") == 20
    extra.untyped_storage().resize_(0)  # freed: counts 0, as FSDP's full weights between uses
    watch.sample("freed")
    assert watch.at("freed") == {"weights": 72, "extra": 0}
    model(torch.ones(1, 4))  # the hooks are gone after the block
    assert watch.samples[-1][0] == "freed"


def test_cuda_peak_is_none_on_a_cpu_device():
    with sharding.cuda_peak(torch.device("cpu")) as found:
        torch.zeros(1000)
    assert found == {"bytes": None}


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="bytes_written reads Linux's /proc/self/io")
def test_bytes_written_measures_what_this_process_writes(tmp_path):
    """What the process passes to write-like calls during the block - a file here; sockets the same way."""
    with open(tmp_path / "out.bin", "wb", buffering=0) as file, sharding.bytes_written() as written:
        file.write(b"x" * 100_000)
    assert written["bytes"] == 100_000
