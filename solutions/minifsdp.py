"""FSDP written from scratch (lecture 7, lab 8 part 1): every rank holds 1/N of each weight matrix.

DDP (lab 6) keeps a full replica of the model on every rank; ZeRO-1 (lab 6, part 4) shards only the
optimizer state. Fully sharded data parallelism (ZeRO-3, Rajbhandari et al. 2020; torch's FSDP) shards
the parameters too: each rank stores a slice of every weight matrix, and the full matrix exists only
while a module needs it.

    forward of a module:   all-gather its full weights -> run it -> free them
    backward of a module:  all-gather them again -> autograd computes the full gradient ->
                           reduce-scatter it: each rank receives the average over ranks of ITS slice
    optimizer step:        on the slices only (so its state is 1/N too); nothing is communicated

Usage, inside a job whose default process group exists (ddp_course.setup_distributed() under torchrun):

    model = FSDP(Net().to(device), compute_dtype=None)  # rank 0's weights are sharded over every rank
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # sees the local slices only
    for inputs, targets in loader:                      # each rank reads its own part of the batch
        optimizer.zero_grad()
        F.cross_entropy(model(inputs), targets).backward()  # hooks gather and reduce-scatter
        model.finish_gradient_synchronization()          # replicated parameters, then .grad is ready
        optimizer.step()
    weights = model.gather_full_params()                 # {name: full float32 tensor}, e.g. to save

model.state_dict() holds this rank's slices (keys start with "module."); gather_full_params() (a
collective: every rank calls it) rebuilds the full weights, for a checkpoint that loads into the bare model.

What is sharded: every parameter with two or more dimensions (weight matrices, embeddings) is split
along dimension 0 into world_size equal slices, zero rows padded at the end so the split is even. The
wrapped model's parameter is replaced by this rank's slice (an nn.Parameter of shape
(rows_per_rank, *rest)), so model.module.parameters() and model.parameters() yield exactly what the
optimizer must step. One-dimensional parameters (norm gains, biases) are small: they stay replicated
and their gradients are all-reduced, as in DDP.

How the full weights appear and vanish, per module that owns parameters (`named_parameters(recurse=False)`):
- a forward pre-hook gathers them into one padded "full" tensor per parameter (a leaf that requires
  grad) and shows the module a view of its real rows; a forward hook frees the storage (resize to 0
  bytes). Autograd keeps its reference to the freed tensor for backward;
- a hook on the module's outputs runs when their gradient is ready, just before the module's own
  backward: it gathers the weights again into the same storage, so autograd finds the values it saved;
- when autograd has accumulated the full tensor's gradient (post-accumulate-grad hook: after every use,
  so a tied weight is reduce-scattered once), it is reduce-scattered into the slice's .grad and freed.

compute_dtype (e.g. torch.float16) is the dtype of the full weights: the slices are cast before the
all-gather (half the bytes on the wire) and forward and backward run on them. Master weights (the
slices), their gradients, the replicated parameters and the optimizer step stay float32. Replicated
parameters are NOT cast: a layer that adds a float32 bias to a float16 matrix product (nn.Linear with
bias) then fails with a dtype error - use bias-free linears with compute_dtype, or keep it None.

Limits, on purpose (this is part 1): no prefetching and no overlap (every collective blocks); every rank
must run the same graph (same modules in the same order: they meet at every gather); a module must use
a weight only inside its own forward (model code that reads `self.layer.weight` from outside the layer
gets the slice); buffers are broadcast from rank 0 once and then left alone.

NCCL: every collective's tensors are on the parameters' device; put the model on cuda:LOCAL_RANK first.
Written for NCCL with care but run only on gloo/CPU so far.

The exercise labs/minifsdp.py is generated from this file (python -m ddp_course.exercises): each region
marked BEGIN SOLUTION ... END SOLUTION becomes a raise NotImplementedError carrying its TODO.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn

# torch 2.14 renamed all_gather_into_tensor / reduce_scatter_tensor to all_gather_single /
# reduce_scatter_single (the old names still work, with a FutureWarning); same arguments, same collective.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def rows_per_rank(rows: int, world_size: int) -> int:
    """Rows of dimension 0 in each rank's slice: ceil(rows / world_size); the last slices end in padding."""
    return -(-rows // world_size)


def shard_rows(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's slice of `full` along dimension 0, zero-padded to rows_per_rank rows (a new float32 tensor)."""
    # BEGIN SOLUTION
    # TODO(lab 8, part 1): take per = rows_per_rank(full.shape[0], world_size); return a float32 tensor of shape
    #   (per, *full.shape[1:]) holding rows rank*per ... rank*per+per-1 of full, zeros where full has no such row
    per = rows_per_rank(full.shape[0], world_size)
    shard = torch.zeros(per, *full.shape[1:], dtype=torch.float32, device=full.device)
    mine = full.detach()[rank * per : (rank + 1) * per]  # fewer than per rows (or none) at the end
    shard[: mine.shape[0]] = mine
    return shard
    # END SOLUTION


class ShardedParameter:
    """One parameter of two or more dimensions: this rank's float32 slice, and the full tensor while in use.

    `shard` (rows_per_rank, *rest) is the nn.Parameter the wrapped module and the optimizer see.
    `full` (world_size * rows_per_rank, *rest), in compute_dtype, is a leaf tensor kept for the whole
    run; its storage is allocated only between gather() and release(). Modules use its first `rows` rows.
    """

    def __init__(self, param: nn.Parameter, compute_dtype: torch.dtype, rank: int, world_size: int):
        self.shape = param.shape  # the unsharded, unpadded shape
        self.world_size = world_size
        self.shard = nn.Parameter(shard_rows(param, rank, world_size), requires_grad=param.requires_grad)
        padded = (world_size * self.shard.shape[0], *self.shape[1:])
        self.full = torch.empty(padded, dtype=compute_dtype, device=param.device, requires_grad=param.requires_grad)
        self.full_bytes = self.full.numel() * self.full.element_size()
        self.users = 0  # modules between their forward pre-hook and forward hook (nesting, tied weights)
        self.gradient_synchronized = False  # reduce-scattered in this step's backward
        self.release()

    @property
    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def gather(self) -> None:
        """Allocate the full tensor's storage and fill it with every rank's slice (in compute_dtype)."""
        if self.gathered:
            return
        # BEGIN SOLUTION
        # TODO(lab 8, part 2): resize self.full's untyped_storage() to self.full_bytes, then all_gather_single into
        #   self.full.data viewed flat, from self.shard detached, cast to self.full.dtype, viewed flat. Write
        #   through .data: autograd saved self.full in forward and must not see this refill as a modification
        self.full.untyped_storage().resize_(self.full_bytes)
        local = self.shard.detach().to(self.full.dtype)  # the cast halves the bytes sent for float16
        all_gather_single(self.full.data.view(-1), local.reshape(-1))
        # END SOLUTION

    def release(self) -> None:
        """Free the full tensor's memory; the tensor object (and autograd's reference to it) stays."""
        # BEGIN SOLUTION
        # TODO(lab 8, part 2): resize self.full's untyped_storage() to 0 bytes
        self.full.untyped_storage().resize_(0)
        # END SOLUTION

    def unpadded_view(self) -> torch.Tensor:
        """What the module computes with: the real rows of the full tensor (autograd tracks the view)."""
        return self.full.narrow(0, 0, self.shape[0])


class FSDP(nn.Module):
    """Fully sharded data parallelism: weight matrices sharded by rows, gathered only around their use.

    FSDP(module, compute_dtype=None). The wrapped model is `.module`; its parameters of two or more
    dimensions are replaced by this rank's slices. See the module docstring for the protocol.
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("create the process group first (ddp_course.setup_distributed() under torchrun)")
        if getattr(module, "_wrapped_by_minifsdp", False):
            raise RuntimeError("this module is already wrapped; wrap each model once (build a new one to compare)")
        module._wrapped_by_minifsdp = True
        self.module = module
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.compute_dtype = compute_dtype or torch.float32
        with torch.no_grad():  # every rank shards rank 0's weights, so the slices fit together
            for tensor in itertools.chain(module.parameters(), module.buffers()):
                dist.broadcast(tensor.detach(), src=0)
        self.sharded: dict[nn.Parameter, ShardedParameter] = {}  # keyed by the slice, one entry per tied weight
        self.replicated: list[nn.Parameter] = []  # one-dimensional, each once
        self._owned: dict[nn.Module, list[tuple[str, ShardedParameter]]] = {}
        self._shard_parameters()
        for owner in self._owned:
            owner.register_forward_pre_hook(self._before_forward)
            owner.register_forward_hook(self._after_forward)
        for handle in self.sharded.values():
            if handle.full.requires_grad:
                handle.full.register_post_accumulate_grad_hook(lambda _, handle=handle: self._reduce_scatter(handle))

    def _shard_parameters(self) -> None:
        """Replace every parameter of 2+ dimensions by its slice; a tied parameter gets one ShardedParameter."""
        by_original: dict[nn.Parameter, ShardedParameter] = {}
        for owner in self.module.modules():
            for name, param in list(owner.named_parameters(recurse=False)):
                if param.dim() < 2:
                    if all(param is not seen for seen in self.replicated):
                        self.replicated.append(param)
                    continue
                if param not in by_original:
                    by_original[param] = ShardedParameter(param, self.compute_dtype, self.rank, self.world_size)
                handle = by_original[param]
                setattr(owner, name, handle.shard)  # the module now holds the slice
                self.sharded[handle.shard] = handle
                self._owned.setdefault(owner, []).append((name, handle))

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    # --- forward: gather, use, free ---------------------------------------------------------------------

    def _before_forward(self, owner: nn.Module, inputs) -> None:
        """Forward pre-hook: gather the owner's weights and show it the full ones in place of the slices."""
        # BEGIN SOLUTION
        # TODO(lab 8, part 2): for each (name, handle) in self._owned[owner]: handle.gather(), count
        #   handle.users += 1, then owner.__dict__[name] = handle.unpadded_view() - an entry in the instance
        #   __dict__ is found before nn.Module.__getattr__ looks in owner._parameters, so it hides the slice
        for name, handle in self._owned[owner]:
            handle.gather()
            handle.users += 1
            owner.__dict__[name] = handle.unpadded_view()
        # END SOLUTION

    def _after_forward(self, owner: nn.Module, inputs, output):
        """Forward hook: hide and free the full weights; arrange for them to be gathered again in backward."""
        # BEGIN SOLUTION
        # TODO(lab 8, part 2): for each (name, handle) of the owner: remove owner.__dict__[name], count
        #   handle.users -= 1 and handle.release() when it reaches 0. Then, for every tensor in output (a tensor,
        #   or a tuple/list of them) that requires grad, tensor.register_hook(lambda grad:
        #   self._before_backward(owner))
        for name, handle in self._owned[owner]:
            del owner.__dict__[name]
            handle.users -= 1
            if handle.users == 0:  # a tied or nested user may still be running
                handle.release()
        outputs = output if isinstance(output, (tuple, list)) else [output]
        for tensor in outputs:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad: self._before_backward(owner))
        # END SOLUTION

    # --- backward: gather again, reduce-scatter, free ---------------------------------------------------

    def _before_backward(self, owner: nn.Module) -> None:
        """Runs when the gradient of the owner's output is ready, before the owner's backward needs its weights."""
        # BEGIN SOLUTION
        # TODO(lab 8, part 3): handle.gather() for each handle the owner uses (gather() skips one already there)
        for _, handle in self._owned[owner]:
            handle.gather()
        # END SOLUTION

    def _reduce_scatter(self, handle: ShardedParameter) -> None:
        """Post-accumulate-grad hook of handle.full: its slice's .grad += average over ranks of the slice's gradient."""
        # BEGIN SOLUTION
        # TODO(lab 8, part 3): take full.grad as float32 divided by self.world_size (then the sum is the average),
        #   reduce_scatter_single it (viewed flat) into a new tensor shaped like handle.shard (viewed flat); set or
        #   add it to handle.shard.grad; then full.grad = None, handle.release(), handle.gradient_synchronized = True
        gradient = handle.full.grad.to(torch.float32) / self.world_size
        mine = torch.empty_like(handle.shard)
        reduce_scatter_single(mine.view(-1), gradient.view(-1))
        handle.shard.grad = mine if handle.shard.grad is None else handle.shard.grad + mine
        handle.full.grad = None
        handle.release()
        handle.gradient_synchronized = True
        # END SOLUTION

    def finish_gradient_synchronization(self) -> None:
        """Call after backward() and before optimizer.step(): every trainable parameter of .module then has a
        float32 .grad of its own (local) shape holding the average over ranks of its gradient."""
        for handle in self.sharded.values():
            if handle.shard.requires_grad and not handle.gradient_synchronized and handle.shard.grad is None:
                handle.shard.grad = torch.zeros_like(handle.shard)  # no rank used it this step
            handle.gradient_synchronized = False
            handle.release()  # frozen weights gathered again for backward have no gradient hook to free them
        # BEGIN SOLUTION
        # TODO(lab 8, part 3): for each trainable parameter in self.replicated (a missing .grad counts as zeros),
        #   dist.all_reduce its .grad (a sum), then divide it by self.world_size - same order on every rank
        for param in self.replicated:
            if not param.requires_grad:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad)
            param.grad.div_(self.world_size)
        # END SOLUTION

    # --- the whole model --------------------------------------------------------------------------------

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """{name: full float32 tensor} for every parameter of .module (its named_parameters() names), unpadded.

        A collective: call it on every rank. Gathers the float32 slices, not the compute_dtype copies.
        """
        full = {}
        for name, param in self.module.named_parameters():
            if param not in self.sharded:
                full[name] = param.detach().clone()
                continue
            # BEGIN SOLUTION
            # TODO(lab 8, part 1): all_gather_single the float32 slice (param, detached, flat) into a new flat tensor
            #   of world_size * param.numel() elements, view it as (-1, *param.shape[1:]) and keep its first
            #   self.sharded[param].shape[0] rows (the padding is dropped)
            gathered = torch.empty(self.world_size * param.numel(), dtype=param.dtype, device=param.device)
            all_gather_single(gathered, param.detach().reshape(-1))
            full[name] = gathered.view(-1, *param.shape[1:])[: self.sharded[param].shape[0]]
            # END SOLUTION
        return full
