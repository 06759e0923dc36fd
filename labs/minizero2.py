"""ZeRO-2 written from scratch (lab 8, lab 9): data parallelism without DDP, gradients and optimizer state sharded.

Complete code to read, not an exercise. DDP (lab 6) all-reduces every gradient and every rank steps
the whole model. ZeRO stage 2 (Rajbhandari et al. 2020, "P_os+g") splits that all-reduce into its two
halves and puts the optimizer step in between, as modern training code does without the DDP wrapper:

    backward:   as a bucket of gradients becomes complete, reduce-scatter it (asynchronously): each rank
                receives the average over ranks of ITS 1/N of the bucket; one reduce-scatter stays in
                flight while backward fills the next bucket, then it is waited for and its bucket freed
    step:       the optimizer updates this rank's 1/N only (so Adam's state is 1/N too)
    after it:   all-gather the updated 1/N slices: every rank has the whole updated model again

Per rank it keeps the full weights (4P bytes in float32), 1/N of the gradients (4P/N) and 1/N of Adam's
state (8P/N); during backward at most the buckets not yet reduce-scattered hold full gradients. It sends
a reduce-scatter and an all-gather of every parameter per step: 2 (N-1)/N x S, exactly DDP's bytes
(lecture 7, section 2). The FSDP that is to ZeRO-2 what this is to ZeRO-3 keeps the full weights between
forward and backward: fully_shard(..., reshard_after_forward=False) (torch's SHARD_GRAD_OP) - but it
frees them after backward, so between steps it holds 1/N of the weights; this one keeps them.

Usage, inside a job whose default process group exists (ddp_course.setup_distributed() under torchrun):

    model = ZeRO2(Net().to(device))                       # rank 0's weights copied to every rank
    optimizer = ShardedStep(model, torch.optim.AdamW, lr=1e-3)  # steps this rank's slices, then all-gathers
    for inputs, targets in loader:                       # each rank reads its own part of the batch
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()   # hooks reduce-scatter full buckets, async
        model.finish_gradient_synchronization()          # the rest, then wait: the slices' .grad is ready
        optimizer.step()                                 # update the slices, all-gather the weights

Design, as in lab 6's BucketedDDP (solutions/minddp.py), whose reasons hold here too: parameters are
bucketed in reverse registration order (backward produces their gradients roughly last-first); bucket k
is launched only after buckets 0..k-1, so every rank's k-th reduce-scatter is the same bucket; a bucket
is complete when every parameter's gradient has been accumulated - a post-accumulate-grad hook, which a
tied weight (used twice) triggers once, after both uses; a gradient backward never produced counts as
zeros, launched by finish_gradient_synchronization() in the same order on every rank. Each bucket is
padded to a multiple of world_size elements so that its reduce-scatter and all-gather split evenly; a
parameter's gradient is copied into its bucket and then dropped (.grad = None), so the full gradient
lives only in buckets still waiting for their reduce-scatter: when a bucket is launched, the one launched
before it is waited for and freed; finish_gradient_synchronization() waits for the last.

How many buckets hold full gradients at once depends on the order gradients arrive in. In bucket order,
at most two: the one in flight and the one being filled. In another order - modules called in another
order than they were registered, a parameter without a gradient in a step - a gradient for a later
bucket opens that bucket's buffer, which must wait for every bucket before it: up to all of them, DDP's
memory. So, as DDP's reducer does (Reducer::rebuild_buckets), the first step records the order the
gradients arrived in (rank 0's, so that every rank agrees) and, if a gradient arrived for a bucket before
an earlier bucket was complete, builds the buckets again in that order; from the second step on, if backward keeps that order, the bound is two.

NCCL: every buffer is made on the parameters' device. Written for NCCL with care but run only on
gloo/CPU so far.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn

MIB = 1024 * 1024
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.14: old names
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Bucket:
    """Some parameters whose gradients travel in one reduce-scatter and whose weights in one all-gather.

    The bucket's flat layout is its parameters' elements, concatenated, padded with zeros to a multiple of
    world_size; rank r owns elements [r * per_rank, (r + 1) * per_rank) of it. The weights live in one flat
    buffer of that layout (each parameter's .data is a view into it), and `shard`, the nn.Parameter only
    the optimizer sees, is a view of this rank's part: no second copy, and the optimizer's update lands
    in the weights themselves.
    """

    def __init__(self, parameters: list[nn.Parameter], rank: int, world_size: int):
        self.parameters = parameters
        self.sizes = [p.numel() for p in parameters]
        self.per_rank = -(-sum(self.sizes) // world_size)
        self.rank, self.world_size = rank, world_size
        self.weights = self.flatten([p.detach() for p in parameters])
        for param, part in zip(parameters, self.weights.split(self.sizes + [self.weights.numel() - sum(self.sizes)])):
            param.data = part.view_as(param)  # the module computes with views of the flat buffer
        self.shard = nn.Parameter(self.weights[rank * self.per_rank : (rank + 1) * self.per_rank])  # a view too
        self.gradients: torch.Tensor | None = None  # the full flat gradient, while backward fills it
        self.waiting_for = len(parameters)  # parameters whose gradient is not in yet
        self.ready = [False] * len(parameters)
        self.work = None  # the reduce-scatter in flight
        self.shard_gradient: torch.Tensor | None = None  # where it lands: this rank's slice, averaged

    def flatten(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """One padded flat float32 tensor of the bucket's layout."""
        flat = torch.zeros(self.per_rank * self.world_size, dtype=torch.float32, device=tensors[0].device)
        torch.cat([t.reshape(-1) for t in tensors], out=flat[: sum(self.sizes)])
        return flat

    def gradient_in(self, index: int) -> None:
        """Copy parameter index's gradient (zeros if it has none) into the flat gradient; drop the parameter's own."""
        param = self.parameters[index]
        if self.gradients is None:  # the first gradient of this step: the bucket's buffer appears
            self.gradients = torch.zeros(self.per_rank * self.world_size, dtype=torch.float32, device=param.device)
        if param.grad is not None:
            offset = sum(self.sizes[:index])
            self.gradients[offset : offset + param.numel()].copy_(param.grad.reshape(-1))
            param.grad = None  # from here on only the bucket holds this gradient
        self.ready[index] = True
        self.waiting_for -= 1

    def launch(self) -> None:
        """Start, without waiting, the reduce-scatter after which shard_gradient is this rank's average."""
        self.gradients.div_(self.world_size)  # the sum of averages-in-waiting is the average
        self.shard_gradient = torch.empty(self.per_rank, dtype=torch.float32, device=self.gradients.device)
        self.work = reduce_scatter_single(self.shard_gradient, self.gradients, async_op=True)

    def finish(self) -> None:
        """Wait for the reduce-scatter; hand the result to the shard (accumulating); free the full gradient."""
        self.work.wait()
        self.shard.grad = self.shard_gradient if self.shard.grad is None else self.shard.grad + self.shard_gradient
        self.gradients = self.shard_gradient = self.work = None
        self.waiting_for, self.ready = len(self.parameters), [False] * len(self.parameters)

    def gather_weights(self) -> None:
        """All-gather every rank's updated slice into the flat weights: the parameters (views) are updated."""
        all_gather_single(self.weights, self.shard.detach().clone())  # the input must not alias the output


class ZeRO2(nn.Module):
    """ZeRO stage 2: full weights on every rank; gradients reduce-scattered bucket by bucket during backward
    into this rank's slices; the optimizer (ShardedStep) steps only those. See the module docstring."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("create the process group first (ddp_course.setup_distributed() under torchrun)")
        self.module = module
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        with torch.no_grad():  # every rank starts from rank 0's weights and buffers
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor.detach(), src=0)
        self.trainable = [p for p in module.parameters() if p.requires_grad]  # a tied weight once
        self.cap_bytes = bucket_cap_mb * MIB
        self._build_buckets(self.trainable[::-1])  # first guess: backward runs roughly last-first
        self._arrival_order: list[int] | None = []  # indices into self.trainable, during the first step only
        self.rebuilt = False  # whether the first step found another order and rebuilt the buckets
        self._next_to_launch = 0  # buckets before it have been launched
        self._next_to_finish = 0  # buckets before it have been reduce-scattered, and their full gradients freed
        for position, param in enumerate(self.trainable):
            param.register_post_accumulate_grad_hook(lambda _, position=position: self._gradient_ready(position))

    def _build_buckets(self, order: list[nn.Parameter]) -> None:
        """Buckets of consecutive parameters of `order`, and where each parameter sits: (bucket, index)."""
        self.buckets = [Bucket(group, self.rank, self.world_size) for group in split(order, self.cap_bytes)]
        self._place = {id(p): (bucket, index) for bucket in self.buckets for index, p in enumerate(bucket.parameters)}

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def shards(self) -> list[nn.Parameter]:
        """This rank's slices, one per bucket: what the optimizer steps."""
        return [bucket.shard for bucket in self.buckets]

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The full flat gradients that exist right now (buckets not yet reduce-scattered): for accounting."""
        return [b.gradients for b in self.buckets if b.gradients is not None] + [b.shard_gradient for b in self.buckets if b.shard_gradient is not None]

    def _gradient_ready(self, position: int) -> None:
        self._gradient_in(position)
        self._launch_ready_buckets()
        self._finish_all_but_the_latest()

    def _gradient_in(self, position: int) -> None:
        bucket, index = self._place[id(self.trainable[position])]
        bucket.gradient_in(index)
        if self._arrival_order is not None:
            self._arrival_order.append(position)

    def _finish_all_but_the_latest(self) -> None:
        """Keep one reduce-scatter in flight (it overlaps the backward of the next bucket); wait for the older
        ones and free their full gradients. With gradients arriving in bucket order, at most two buckets
        hold full gradients at any moment: the one in flight and the one being filled (module docstring)."""
        while self._next_to_finish < self._next_to_launch - 1:
            self.buckets[self._next_to_finish].finish()
            self._next_to_finish += 1

    def _launch_ready_buckets(self) -> None:
        """Launch every complete bucket whose predecessors have gone: the same order on every rank."""
        while self._next_to_launch < len(self.buckets) and self.buckets[self._next_to_launch].waiting_for == 0:
            self.buckets[self._next_to_launch].launch()
            self._next_to_launch += 1

    def finish_gradient_synchronization(self) -> None:
        """After backward: launch what backward did not (missing gradients count as zeros), wait for every
        reduce-scatter; then each shard's .grad is the average over ranks of its slice of the gradient."""
        positions = {id(p): position for position, p in enumerate(self.trainable)}
        for bucket in self.buckets[self._next_to_launch :]:
            for param, ready in zip(bucket.parameters, bucket.ready):
                if not ready:
                    self._gradient_in(positions[id(param)])
        self._launch_ready_buckets()
        for bucket in self.buckets[self._next_to_finish :]:  # the rest: wait for them
            bucket.finish()
        self._next_to_launch = self._next_to_finish = 0
        if self._arrival_order is not None:  # the first step: rebuild the buckets in the order observed
            order, self._arrival_order = self._arrival_order, None
            self._rebuild_in_order(order)

    def _rebuild_in_order(self, order: list[int]) -> None:
        """Rank 0's observed order (broadcast: every rank must launch the same bucket k-th); if it is not the
        buckets' order, new buckets in that order, carrying the weights and this step's averaged gradients
        over. Before the optimizer's first step: ShardedStep then steps the new slices."""
        device = self.trainable[0].device
        observed = torch.tensor(order, dtype=torch.int64, device=device)
        dist.broadcast(observed, src=0)
        new_order = [self.trainable[position] for position in observed.tolist()]
        bucket_of = {id(p): k for k, bucket in enumerate(self.buckets) for p in bucket.parameters}
        arrivals = [bucket_of[id(p)] for p in new_order]
        if arrivals == sorted(arrivals):  # each bucket complete before the next one's first gradient (the order
            return  # inside a bucket does not matter: it is one buffer)
        full_gradients = {}  # each parameter's averaged gradient, gathered from the slices (once, W bytes)
        for bucket in self.buckets:
            flat = torch.empty_like(bucket.weights)
            all_gather_single(flat, bucket.shard.grad)
            for param, part in zip(bucket.parameters, flat.split(bucket.sizes + [flat.numel() - sum(bucket.sizes)])):
                full_gradients[id(param)] = part.view_as(param)
        self._build_buckets(new_order)
        for bucket in self.buckets:
            gradient = bucket.flatten([full_gradients[id(p)] for p in bucket.parameters])
            bucket.shard.grad = gradient[bucket.rank * bucket.per_rank : (bucket.rank + 1) * bucket.per_rank].clone()
        self.rebuilt = True

    def gather_weights(self) -> None:
        """After the optimizer stepped the slices: every rank's full weights are the updated ones again."""
        for bucket in self.buckets:
            bucket.gather_weights()


def split(parameters: list[nn.Parameter], cap_bytes: float) -> list[list[nn.Parameter]]:
    """Consecutive groups of at most cap_bytes of float32 (a larger parameter gets a bucket of its own)."""
    buckets, current, size = [], [], 0
    for param in parameters:
        if current and size + 4 * param.numel() > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(param)
        size += 4 * param.numel()
    return buckets + [current] if current else buckets


class ShardedStep:
    """The optimizer of a ZeRO2 model: optimizer_cls over the model's slices, then the all-gather.

    Exposes param_groups and state (of the slices) and local_optimizer (for ddp_course.sharding's count)."""

    def __init__(self, model: ZeRO2, optimizer_cls, **kwargs):
        self.model = model
        self.local_optimizer = optimizer_cls(model.shards(), **kwargs)
        self.param_groups, self.state = self.local_optimizer.param_groups, self.local_optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.local_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        shards = self.model.shards()
        if [id(s) for s in self.param_groups[0]["params"]] != [id(s) for s in shards]:  # the model rebuilt its buckets
            if self.state:
                raise RuntimeError("ZeRO2's buckets changed after the optimizer's first step")
            self.param_groups[0]["params"] = shards  # before any state exists: the new slices, nothing to carry
        self.local_optimizer.step()
        self.model.gather_weights()
