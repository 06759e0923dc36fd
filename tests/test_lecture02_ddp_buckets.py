"""DDP's bucket rules, as the course states them, hold for the installed torch.

Lecture 4 §2.3 is their home (lecture 2's exercise 2 and its solution link there); they say: DDP buckets at construction (in torch 2.14, with find_unused_parameters=False,
the first iteration runs with all gradients in one bucket), then rebuilds the buckets once, after
the first iteration, in the order gradients became ready; with bucket_cap_mb=None (the default)
the first bucket closes once it reaches dist._DEFAULT_FIRST_BUCKET_BYTES (1 MiB) and the others
at 25 MiB, while an explicit bucket_cap_mb=25 has no small first bucket. One process, a one-rank
gloo group through a FileStore (no port, no torchrun): about a second.

These are private DDP internals (`_has_rebuilt_buckets`, the reducer's bucket buffers): if a new
torch changes them, this test fails and the lecture's sentence needs checking again.
"""

import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn

MiB = 2**20


def three_layer_model() -> nn.Module:
    torch.manual_seed(0)
    # float32 parameters: 3 MiB + 4 KiB (first layer), 1.5 MiB + 2 KiB (second), 4 KiB + 8 B (last).
    return nn.Sequential(nn.Linear(1024, 768), nn.ReLU(), nn.Linear(768, 512), nn.ReLU(), nn.Linear(512, 2))


def parameter_bytes(model: nn.Module) -> list[int]:
    return [p.numel() * p.element_size() for p in model.parameters()]


def bucket_bytes(ddp) -> list[int]:
    """Bytes of every bucket, in the order DDP all-reduces them."""
    return [bucket.buffer().numel() * bucket.buffer().element_size() for bucket in ddp.reducer._get_zeros_like_grad_buckets()]


def buckets_before_and_after_first_iteration(**ddp_kwargs) -> tuple[list[int], bool, list[int]]:
    ddp = nn.parallel.DistributedDataParallel(three_layer_model(), **ddp_kwargs)
    try:
        before = bucket_bytes(ddp)
        for _ in range(2):  # buckets are rebuilt at the start of the second forward pass
            ddp(torch.randn(4, 1024)).sum().backward()
        return before, ddp._has_rebuilt_buckets, bucket_bytes(ddp)
    finally:
        del ddp
        gc.collect()  # no DDP reference cycle may outlive the process group (CONTRIBUTING.md, "gloo teardown")


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this test process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    gc.collect()
    dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_default_buckets_are_rebuilt_once_with_a_small_first_bucket(one_rank_group):
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == 1 * MiB
    sizes = parameter_bytes(three_layer_model())
    before, rebuilt, after = buckets_before_and_after_first_iteration()
    assert before == [sum(sizes)], "torch 2.14 starts with one bucket when find_unused_parameters=False"
    assert rebuilt
    # Rebuilt in the order gradients became ready (last layer first); the first bucket closes once it
    # reaches 1 MiB, so it ends with the second layer's 1.5 MiB weight; the rest fits one 25 MiB bucket.
    last_two_layers = sum(sizes[2:])
    assert after == [last_two_layers, sum(sizes[:2])]
    assert after[0] >= dist._DEFAULT_FIRST_BUCKET_BYTES > last_two_layers - sizes[2]


@pytest.mark.timeout(60)
def test_an_explicit_25_mb_cap_has_no_small_first_bucket(one_rank_group):
    sizes = parameter_bytes(three_layer_model())
    _, rebuilt, after = buckets_before_and_after_first_iteration(bucket_cap_mb=25)
    assert rebuilt
    assert after == [sum(sizes)]
