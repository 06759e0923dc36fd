"""Lab 7: crash, restart and resume exactly; resume on another world size without losing a sample.

The sampler tests run in this process; the lab's own launches come further down.
"""

import pytest
from torch.utils.data import DistributedSampler

from ddp_course.resume import ResumableDistributedSampler, epoch_order, samples_consumed

# --- ResumableDistributedSampler (ddp_course/resume.py) ----------------------------------------------

# (samples, world size): even shards, padded shards, more padding than a shard, more ranks than samples
SIZES = [(1438, 2), (37, 4), (10, 3), (3, 5)]


def shards(num_samples, world_size, seed, epoch, start=0):
    samplers = [ResumableDistributedSampler(num_samples, world_size, rank, seed) for rank in range(world_size)]
    for sampler in samplers:
        sampler.set_epoch(epoch, start)
    return [list(sampler) for sampler in samplers]


@pytest.mark.parametrize(("num_samples", "world_size"), SIZES)
def test_from_the_start_it_is_distributed_sampler(num_samples, world_size):
    for rank, shard in enumerate(shards(num_samples, world_size, seed=7, epoch=3)):
        reference = DistributedSampler(range(num_samples), num_replicas=world_size, rank=rank, shuffle=True, seed=7)
        reference.set_epoch(3)
        assert shard == list(reference) and len(shard) == len(reference)


@pytest.mark.parametrize(("num_samples", "world_size"), SIZES)
def test_same_world_size_continues_where_the_uninterrupted_sampler_is(num_samples, world_size):
    batch_size, batches_done = 2, 1
    start = samples_consumed(0, batches_done, batch_size, world_size, num_samples)
    whole = shards(num_samples, world_size, seed=1, epoch=2)
    resumed = shards(num_samples, world_size, seed=1, epoch=2, start=start)
    assert resumed == [shard[batches_done * batch_size :] for shard in whole]


@pytest.mark.parametrize(("num_samples", "old", "new"), [(1438, 2, 1), (50, 2, 3), (101, 3, 8), (37, 3, 2), (40, 4, 2)])
def test_another_world_size_reads_the_rest_once(num_samples, old, new):
    """Old ranks read 3 batches of 4, new ranks the rest: every sample once, plus at most new - 1 padding."""
    start = samples_consumed(0, 3, 4, old, num_samples)
    before = [i for shard in shards(num_samples, old, seed=5, epoch=4) for i in shard[:12]]
    after_shards = shards(num_samples, new, seed=5, epoch=4, start=start)
    assert len({len(shard) for shard in after_shards}) == 1  # every new rank makes the same number of steps
    # Read step by step, rank by rank, the new ranks continue one process's order for this epoch...
    interleaved = [i for step in zip(*after_shards) for i in step]
    rest, padding = interleaved[: num_samples - start], interleaved[num_samples - start :]
    assert rest == epoch_order(num_samples, 5, 4)[start:]
    # ...so the rest holds every sample the old ranks did not read, once; padding repeats fewer than `new`.
    assert sorted(before + rest) == list(range(num_samples))
    assert len(padding) == (-(num_samples - start)) % new < new


@pytest.mark.parametrize(("old", "new", "failure"), [(2, 1, "repeats"), (1, 2, "skips")])
def test_a_batch_count_is_the_wrong_position(old, new, failure):
    """What the sampler avoids: skipping 3 batches of 4 per rank on the new world size."""
    num_samples = 40
    before = [i for shard in shards(num_samples, old, seed=0, epoch=0) for i in shard[:12]]
    naive = [i for shard in shards(num_samples, new, seed=0, epoch=0) for i in shard[12:]]
    if failure == "repeats":  # 2 ranks read 24 samples; 1 rank skipping 12 reads 12 of them again
        assert len(set(before) & set(naive)) == 12 and set(before) | set(naive) == set(range(num_samples))
    else:  # 1 rank read 12; 2 ranks skipping 12 each never read 12 others
        assert not set(before) & set(naive) and len(set(before) | set(naive)) == num_samples - 12


def test_samples_consumed_stops_at_the_end_of_the_epoch():
    assert samples_consumed(0, 10, 32, 2, 1438) == 640
    assert samples_consumed(640, 12, 32, 2, 1438) == 1408
    assert samples_consumed(640, 13, 32, 2, 1438) == 1438  # the 23rd batch holds 15 per rank: the epoch is done
    assert samples_consumed(640, 3, 32, 1, 1438) == 736


def test_bad_positions_are_refused():
    sampler = ResumableDistributedSampler(10, 2, 1)
    with pytest.raises(ValueError, match="samples_consumed must be in 0..10"):
        sampler.set_epoch(0, 11)
    with pytest.raises(ValueError, match="rank 2 is not in 0..1"):
        ResumableDistributedSampler(10, 2, 2)
