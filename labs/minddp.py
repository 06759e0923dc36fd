# Exercise: replace each `raise NotImplementedError("TODO(...)")` below with working code, part by part.
# Generated from solutions/minddp.py by `python -m ddp_course.authoring.exercises solutions/minddp.py labs/minddp.py`:
# course maintainers edit the solution and regenerate this file; a test checks that the two agree.
"""DDP written from scratch (lab 6): three gradient-synchronising wrappers and a ZeRO-1 optimizer.

Every wrapper keeps one replica of a single-device model per process and makes the replicas' gradients
equal to the average over ranks before the optimizer steps. They differ in WHEN they communicate:

    NaiveDDP     after backward, one blocking all-reduce per gradient           (no overlap)
    OverlapDDP   during backward, one asynchronous all-reduce per gradient      (overlap, many small messages)
    BucketedDDP  during backward, one asynchronous all-reduce per bucket        (overlap, few large messages:
                 of gradients (about bucket_cap_mb MiB each)                     what torch's DDP does)

Usage, inside a job whose default process group exists (ddp_course.setup_distributed() under torchrun);
the three wrappers are interchangeable, and so is torch's DistributedDataParallel except for the one
extra call:

    model = BucketedDDP(Net().to(device), bucket_cap_mb=25.0)  # rank 0's weights are copied to every rank
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for inputs, targets in loader:                             # each rank reads its own shard
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()                                        # hooks launch the all-reduces
        model.finish_gradient_synchronization()                # wait: .grad is now the average over ranks
        optimizer.step()

    # Gradient accumulation over K micro-batches: the first K-1 backward passes communicate nothing.
    with model.no_sync():
        for micro_inputs, micro_targets in first_k_minus_1:
            F.cross_entropy(model(micro_inputs), micro_targets).div(K).backward()
    F.cross_entropy(model(last_inputs), last_targets).div(K).backward()
    model.finish_gradient_synchronization()                    # all-reduces the accumulated gradients

    # ZeRO stage 1: each rank keeps Adam's moments for its shard of the parameters only.
    optimizer = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)

Design choices: all but the bucket layout are what torch's reducer does (lecture 4 shows it on real jobs):
- Average = sum / world_size. With equal shards, the mean of the ranks' mean losses is the mean loss of
  the global batch, so the averaged gradient is the full-batch gradient. We divide by world_size before
  the asynchronous sum (as torch's default communication hook does), so waiting is all that is left.
- Same collectives in the same order on every rank. Collectives are matched by the order in which each
  rank issues them, not by name: if rank 0's first all-reduce is bucket 1 and rank 1's is bucket 0,
  they are summed together (silently, on gloo, when the sizes agree). So all-reduces are launched
  strictly in a fixed order, bucket 0 first; a ready bucket waits until all earlier ones have gone.
- Buckets filled from the end of parameters(), and kept: our choice, not torch's. Modules usually
  register parameters in forward order, and backward produces gradients in roughly reverse forward
  order, so bucket 0 (the last layers) fills first. Torch's reducer starts with one bucket holding
  every parameter (buckets along parameters(), then reversed, only with find_unused_parameters=True)
  and at the second forward rebuilds them in the order gradients really arrived, the first capped at
  1 MiB (lecture 4, section 2.3, the rules' one home).
- A missing gradient never hangs: a parameter that got no gradient in a step (unused by this rank's
  forward) is treated as a zero gradient when finish_gradient_synchronization() launches what is left,
  in the same order, so every rank issues the same collectives. Its .grad afterwards is the average of
  what the ranks had (zeros from the ranks that did not use it); a parameter no rank used ends the step
  with a zero .grad, where torch's DDP (find_unused_parameters=True) would leave None. The difference
  matters only to optimizers that move a parameter on a zero gradient (momentum, weight decay).
- Never a blocking call inside a hook: the hook only launches (async_op=True); waiting happens once, in
  finish_gradient_synchronization(), after backward has produced everything.

Contract: call finish_gradient_synchronization() after every backward() outside no_sync() and before
optimizer.step(). Buffers (BatchNorm statistics) are broadcast once, at construction; torch's DDP also
re-broadcasts them before every forward by default.

NCCL: every tensor a wrapper communicates lives on the parameters' device (nothing assumes the CPU).
Written for NCCL with care but run only on gloo/CPU so far.

The exercise labs/minddp.py is generated from this file (python -m ddp_course.authoring.exercises): each region
marked BEGIN SOLUTION ... END SOLUTION becomes a raise NotImplementedError carrying the TODO comment
that opens it. Each TODO says what must be true afterwards and leaves one design question per part open;
after a first attempt, solutions/lab6_hints.md has step-by-step hints for every TODO.
"""

from __future__ import annotations

import functools
import itertools
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

MIB = 1024 * 1024  # bucket_cap_mb counts mebibytes, as torch's DDP does


class _DataParallel(nn.Module):
    """What the three wrappers share: the wrapped module, the start-up broadcast, no_sync().

    The wrapped model is registered as the submodule `module`, so parameters(), train(), eval() and
    state_dict() work as on torch's DDP (state_dict keys start with "module."; save
    `wrapper.module.state_dict()` for a checkpoint that loads into the bare model).
    """

    def __init__(self, module: nn.Module):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("create the process group first (ddp_course.setup_distributed() under torchrun)")
        if getattr(module, "_wrapped_by_minddp", False):
            # Hooks stay on the parameters: a second wrapper's collectives would mix with the first one's.
            raise RuntimeError("this module is already wrapped; wrap each model once (build a new one to compare)")
        module._wrapped_by_minddp = True
        self.module = module
        self.world_size = dist.get_world_size()
        self.require_gradient_sync = True  # False inside no_sync()
        # Frozen parameters (requires_grad=False) get no gradient and are never communicated.
        # module.parameters() yields a tied (shared) parameter once, so it is averaged exactly once.
        self.trainable_parameters = [p for p in module.parameters() if p.requires_grad]
        self._broadcast_from_rank0()

    def _broadcast_from_rank0(self) -> None:
        """Copy rank 0's parameters (frozen ones included) and buffers to every rank, so all replicas start equal."""
        raise NotImplementedError(
            "TODO(lab 6, part 1): afterwards every parameter (frozen ones too) and every buffer holds rank "
            "0's values on every rank. Design question: collectives carry no names, so what must every rank "
            "agree on for its k-th broadcast to meet rank 0's k-th?"
        )

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    @contextmanager
    def no_sync(self):
        """Backward passes inside this block only accumulate local gradients; nothing is communicated.

        The next backward outside it (followed by finish_gradient_synchronization()) all-reduces the
        accumulated gradients, exactly as torch's DDP.no_sync() does.
        """
        previous = self.require_gradient_sync
        self.require_gradient_sync = False
        try:
            yield
        finally:
            self.require_gradient_sync = previous

    def finish_gradient_synchronization(self) -> None:
        """Call after backward() and before optimizer.step(): leaves the average over ranks in every .grad."""
        raise NotImplementedError


class NaiveDDP(_DataParallel):
    """The simplest correct DDP: after backward, one blocking all-reduce per gradient.

    Nothing overlaps: the ranks compute the whole backward pass, then wait for every message in turn.
    """

    def finish_gradient_synchronization(self) -> None:
        """All-reduce (sum) every gradient, then divide by world_size. Does nothing inside no_sync().

        A parameter without a gradient this step contributes zeros, and its .grad becomes the average.
        """
        if not self.require_gradient_sync:
            return
        raise NotImplementedError(
            "TODO(lab 6, part 1): afterwards each trainable parameter's .grad holds the average over ranks "
            "of the ranks' gradients; a rank whose parameter got no gradient this step contributes zeros "
            "(and still takes part: its peers are waiting for it)."
        )


class OverlapDDP(_DataParallel):
    """One asynchronous all-reduce per gradient, launched from the parameter's post-accumulate-grad hook.

    `register_post_accumulate_grad_hook` runs once per backward for each parameter, after autograd has
    added this backward's contribution into .grad (for a tied parameter: after all of them). The hook
    only launches; the all-reduce runs in the background while backward goes on with earlier layers.
    Launches follow one fixed order on every rank, reverse registration order: a gradient that is ready
    early waits until every gradient before it in that order has been launched.
    """

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self.launch_order = list(reversed(self.trainable_parameters))
        self._ready = [False] * len(self.launch_order)
        self._next_to_launch = 0  # launch_order[:_next_to_launch] have been launched this step
        self._pending_work = []
        for index, param in enumerate(self.launch_order):
            param.register_post_accumulate_grad_hook(functools.partial(self._on_gradient_ready, index))

    def _on_gradient_ready(self, index: int, param: nn.Parameter) -> None:
        """Autograd calls this when param.grad holds this backward's gradient."""
        if not self.require_gradient_sync:
            return
        if self._ready[index]:
            raise RuntimeError(
                "a gradient became ready twice before finish_gradient_synchronization(): call it after "
                "every backward outside no_sync(), and accumulate micro-batches inside no_sync()"
            )
        raise NotImplementedError(
            "TODO(lab 6, part 2): record that launch_order[index] is ready, then launch (self._launch) every "
            "gradient that may go now, and never wait here. Design question: a gradient can be ready on this "
            "rank before the gradients launched ahead of it on another rank - which ones may go now?"
        )

    def _launch(self, index: int) -> None:
        """Start the averaging all-reduce of launch_order[index].grad (zeros when it has none)."""
        raise NotImplementedError(
            "TODO(lab 6, part 2): start, without waiting, the all-reduce after which "
            "launch_order[index].grad holds the average over ranks (zeros if it has no gradient); keep its "
            "work for finish_gradient_synchronization()."
        )

    def finish_gradient_synchronization(self) -> None:
        """Launch, in order, what backward did not produce (zeros), wait for every all-reduce, reset.

        Does nothing inside no_sync().
        """
        if not self.require_gradient_sync:
            return
        raise NotImplementedError(
            "TODO(lab 6, part 2): afterwards every gradient has been launched (also those backward never "
            "produced), every all-reduce has completed, and the wrapper is ready for the next step."
        )


def assign_buckets(parameters: list[nn.Parameter], bucket_cap_mb: float | None) -> list[list[int]]:
    """Group parameters into buckets: lists of indices into `parameters`, bucket 0 launched first.

    Parameters are taken in REVERSE order (the order backward tends to produce their gradients) and
    packed greedily: a bucket is closed when the next parameter would take it past bucket_cap_mb MiB,
    or has another dtype or device (a bucket is one flat tensor). A parameter larger than the cap gets
    a bucket of its own. bucket_cap_mb=None puts every parameter in one bucket.
    """
    cap_bytes = float("inf") if bucket_cap_mb is None else bucket_cap_mb * MIB
    buckets, current, current_bytes, current_kind = [], [], 0, None
    for index in reversed(range(len(parameters))):
        param = parameters[index]
        size, kind = param.numel() * param.element_size(), (param.dtype, param.device)
        if current and (current_bytes + size > cap_bytes or kind != current_kind):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += size
        current_kind = kind
    if current:
        buckets.append(current)
    return buckets


@dataclass
class _Bucket:
    """One flat gradient buffer, allocated once, and the parameters whose gradients live in it."""

    parameters: list[nn.Parameter]  # in launch order
    buffer: torch.Tensor  # 1-D, on the parameters' device, sum of their numel() elements
    views: list[torch.Tensor]  # views[i]: the slice of buffer shaped like parameters[i]
    waiting_for: int  # gradients still to come this step
    work: dist.Work | None = None


class BucketedDDP(_DataParallel):
    """One asynchronous all-reduce per bucket of gradients, launched when the bucket's last gradient is ready.

    Buckets come from assign_buckets(): reverse registration order, at most bucket_cap_mb MiB each
    (None: one bucket). Each bucket's flat buffer is allocated once. When a gradient is ready the hook
    copies it into its slot of the buffer and points .grad at that slot (torch's
    gradient_as_bucket_view=True): later backward passes accumulate straight into the buffer, and the
    averaged result needs no copy back. Buckets are launched strictly in bucket-index order on every rank.

    After finish_gradient_synchronization(), each .grad is a view into a bucket buffer: zero_grad()
    (set_to_none=True) drops it and the next gradient is copied in again; zero_grad(set_to_none=False)
    zeroes it in place. Either way the buffer is reused.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = 25.0):
        super().__init__(module)
        if bucket_cap_mb is not None and bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive or None, not {bucket_cap_mb}")
        self.bucket_cap_mb = bucket_cap_mb
        assignment = assign_buckets(self.trainable_parameters, bucket_cap_mb)
        self.buckets = [self._make_bucket(indices) for indices in assignment]
        self._ready = [[False] * len(bucket.parameters) for bucket in self.buckets]
        self._next_to_launch = 0  # buckets[:_next_to_launch] have been launched this step
        for bucket_index, bucket in enumerate(self.buckets):
            for position, param in enumerate(bucket.parameters):
                hook = functools.partial(self._on_gradient_ready, bucket_index, position)
                param.register_post_accumulate_grad_hook(hook)

    def _make_bucket(self, indices: list[int]) -> _Bucket:
        parameters = [self.trainable_parameters[i] for i in indices]
        first = parameters[0]
        buffer = torch.zeros(sum(p.numel() for p in parameters), dtype=first.dtype, device=first.device)
        views, offset = [], 0
        for param in parameters:
            views.append(buffer[offset : offset + param.numel()].view(param.shape))
            offset += param.numel()
        return _Bucket(parameters, buffer, views, waiting_for=len(parameters))

    def _on_gradient_ready(self, bucket_index: int, position: int, param: nn.Parameter) -> None:
        """Autograd calls this when param.grad holds this backward's gradient."""
        if not self.require_gradient_sync:
            return
        if self._ready[bucket_index][position]:
            raise RuntimeError(
                "a gradient became ready twice before finish_gradient_synchronization(): call it after "
                "every backward outside no_sync(), and accumulate micro-batches inside no_sync()"
            )
        raise NotImplementedError(
            "TODO(lab 6, part 3): afterwards the gradient lives in its slot of the bucket "
            "(self._gradient_into_bucket), the bucket knows one fewer gradient is missing, and every bucket "
            "that may go now has been launched."
        )

    @staticmethod
    def _gradient_into_bucket(bucket: _Bucket, position: int) -> None:
        """Make parameters[position].grad the bucket's view, holding the same values (zeros if it had none)."""
        param, view = bucket.parameters[position], bucket.views[position]
        if param.grad is None:
            view.zero_()
        elif param.grad.data_ptr() != view.data_ptr():  # a fresh tensor: after zero_grad() or the first step
            view.copy_(param.grad)
        # else: backward accumulated straight into the view, nothing to move
        param.grad = view

    def _launch_ready_buckets(self) -> None:
        """Launch buckets in index order, from the next unlaunched one up to the first that is not full."""
        raise NotImplementedError(
            "TODO(lab 6, part 3): launch (self._launch_bucket) every bucket that may go now. Design "
            "question: bucket 2 can be full on rank 0 while bucket 1 is not, and on rank 1 the other way "
            "round - which buckets may go, so that every rank's k-th all-reduce is the same bucket?"
        )

    def _launch_bucket(self, bucket: _Bucket) -> None:
        """Start the averaging all-reduce of one full bucket."""
        raise NotImplementedError(
            "TODO(lab 6, part 3): start, without waiting, the all-reduce after which bucket.buffer holds the "
            "average over ranks; keep its work in bucket.work."
        )

    def finish_gradient_synchronization(self) -> None:
        """Fill and launch, in order, what backward did not produce (zeros), wait for every bucket, reset.

        Afterwards every .grad is a view of its averaged bucket. Does nothing inside no_sync().
        """
        if not self.require_gradient_sync:
            return
        raise NotImplementedError(
            "TODO(lab 6, part 3): afterwards every bucket has been launched (a gradient backward never "
            "produced counts as zeros), every all-reduce has completed, so every .grad is a view of its "
            "averaged bucket, and the bookkeeping is reset for the next step."
        )


# --- Part 4: ZeRO stage 1, beyond DDP ----------------------------------------------------------------


def partition_parameters(sizes: list[int], world_size: int, loads: list[int] | None = None) -> list[int]:
    """Owner rank of each parameter, given their sizes (elements): balanced, deterministic, no communication.

    Largest first, each to the rank with the least so far (ties: the lower rank, then the earlier
    parameter). Every rank computes the same answer from the same sizes. `loads` (elements already
    owned per rank, e.g. from earlier parameter groups) is updated in place.
    """
    loads = [0] * world_size if loads is None else loads
    owners = [0] * len(sizes)
    raise NotImplementedError(
        "TODO(lab 6, part 4): owners[i] is the rank that owns parameter i, the same on every rank, with the "
        "ranks' loads as even as whole tensors allow; add what each rank gets to loads. Design question: in "
        "which order should the tensors be handed out so that the fullest rank stays close to sum(sizes) / "
        "world_size?"
    )
    return owners


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1: every rank keeps optimizer state only for the parameters it owns.

    ShardedOptimizer(params, optimizer_cls, **kwargs) behaves like optimizer_cls(params, **kwargs) on
    every rank, but each parameter has one owner rank (partition_parameters, balanced by size). step()
    runs optimizer_cls on this rank's shard only - so Adam's two moments per element exist once in the
    job instead of once per rank - then broadcasts every parameter from its owner, so all replicas hold
    the same updated weights. Gradients must already be averaged (a DDP wrapper's job).

    param_groups lists ALL parameters with the hyperparameters you passed (a learning-rate scheduler can
    change them; step() copies them to the local optimizer). zero_grad() clears every gradient.
    state_dict() / load_state_dict() save and load THIS RANK's shard only: save one file per rank.
    process_group (default: the whole job) is the group that shards the state.
    """

    def __init__(self, params, optimizer_cls: type[torch.optim.Optimizer], process_group=None, **kwargs):
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self._optimizer_cls = optimizer_cls
        self._optimizer_kwargs = kwargs
        self._loads = [0] * self.world_size  # elements owned per rank, over all groups
        self.owners: list[tuple[nn.Parameter, int]] = []  # every parameter with its owner (a group rank)
        self.local_optimizer: torch.optim.Optimizer | None = None
        super().__init__(params, defaults=kwargs)  # calls add_param_group() for each group

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)  # the full group, with defaults filled in
        group = self.param_groups[-1]
        owners = partition_parameters([p.numel() for p in group["params"]], self.world_size, self._loads)
        self.owners.extend(zip(group["params"], owners))
        mine = [p for p, owner in zip(group["params"], owners) if owner == self.rank]
        local_group = {**{key: value for key, value in group.items() if key != "params"}, "params": mine}
        # A rank may own nothing in a group: the local optimizer gets an empty group, so that local
        # group i always matches param_groups[i].
        if self.local_optimizer is None:
            self.local_optimizer = self._optimizer_cls([local_group], **self._optimizer_kwargs)
        else:
            self.local_optimizer.add_param_group(local_group)

    def step(self, closure=None):
        """Update this rank's shard, then broadcast every parameter from its owner. Returns closure()'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        raise NotImplementedError(
            "TODO(lab 6, part 4): afterwards this rank's shard has been stepped with the hyperparameters now "
            "in self.param_groups (a scheduler may have changed them), and every rank holds every updated "
            "parameter."
        )
        return loss

    def _broadcast_from_owners(self) -> None:
        """Every rank receives each updated parameter from the rank that owns it (same order everywhere)."""
        raise NotImplementedError(
            "TODO(lab 6, part 4): afterwards every rank holds each parameter's values from its owner. owner "
            "is a rank of self.process_group; a collective's src is a rank of the whole job."
        )

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state (as the local optimizer's state_dict())."""
        return self.local_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what state_dict() returned on this same rank, with the same world size and parameters."""
        self.local_optimizer.load_state_dict(state_dict)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of tensors this rank holds in optimizer state (momentum buffers, Adam's moments and steps).

    For a ShardedOptimizer, the local shard's state: about 1/world_size of an unsharded optimizer's.
    """
    if isinstance(optimizer, ShardedOptimizer):
        optimizer = optimizer.local_optimizer
    return sum(value.numel() * value.element_size() for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor))
