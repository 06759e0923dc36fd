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

    model = FSDP(Net().to(device), units=[...])          # rank 0's weights are sharded over every rank
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

Units: what travels in one message. FSDP(module, units=[block, ...]) makes each listed submodule a unit
(as torch's fully_shard(block) does) and the wrapped model the unit of every parameter outside them; with
units=None every module that owns a weight matrix is its own unit. A unit's sharded parameters are
communicated together: its slices are concatenated into one all-gather and its gradients into one
reduce-scatter. On gloo every message pays a fixed latency (lecture 2's alpha), so one message per
transformer block instead of one per matrix is what makes this FSDP as fast as torch's on CPU (lab 8,
section 6) - where torch's hides nothing either: fully_shard issues its collectives with async_op=False
and CPU streams are no-ops, so they block as ours do. On GPUs fully_shard overlaps them with compute
(separate CUDA streams, the next unit's all-gather issued early); this FSDP would lose there.

What must hold, per unit (how, and why that way, is in the comments of the solution's code; the
exercise labs/minifsdp.py asks it as one design question per part):
- when the unit's forward starts, its weights are gathered into one padded "full" tensor per parameter
  (a leaf that requires grad), and every module of the unit computes with a view of its real rows; when
  the forward ends they are freed - but the tensor objects, which autograd keeps for backward, stay;
- before autograd computes the unit's backward, the weights are gathered again into the same tensors,
  so autograd finds the values it saved;
- once autograd has the complete gradient of every full tensor of the unit (a tied weight: of every use),
  the unit's gradients are reduce-scattered in one message into the slices' .grad and freed.
  One-dimensional parameters are averaged in one all-reduce at the end.

compute_dtype (torch.bfloat16, or float16) is the dtype of the full weights: the slices are cast before
the all-gather (half the bytes on the wire) and forward and backward run on them. Master weights (the
slices), their gradients, the replicated parameters and the optimizer step stay float32. What it does
NOT do, unlike fully_shard's MixedPrecisionPolicy: cast the inputs (cast_forward_inputs) - a model whose
first layer is a Linear gets float32 inputs against float16 weights, so cast them yourself or start with
an embedding; cast the replicated parameters - a layer that adds a float32 bias to a float16 matrix
product (nn.Linear with bias) fails with a dtype error, so use bias-free linears; scale the loss - with
float16, small gradients underflow without a gradient scaler, so prefer bfloat16 (float16's exponent
range is the reason lecture 5b pairs it with GradScaler). Tested on CPU only, with float16 matrices and
float32 LayerNorms (tests/scripts/minifsdp_check.py); CUDA's support for layer_norm on mixed dtypes has
varied across releases: the compute_dtype path is NOT YET RUN on a GPU.

Limits, on purpose: no prefetching and no overlap (every collective blocks); every rank must run the
same graph (same units in the same order: they meet at every gather); a module must use a weight only
inside the forward of its unit (model code that reads `self.layer.weight` from elsewhere gets the slice);
buffers are broadcast from rank 0 once and then left alone.

NCCL: every collective's tensors are on the parameters' device; put the model on cuda:LOCAL_RANK first.
Written for NCCL with care but run only on gloo/CPU so far.

The exercise labs/minifsdp.py is generated from this file (python -m ddp_course.authoring.exercises): each region
marked BEGIN SOLUTION ... END SOLUTION becomes a raise NotImplementedError carrying its TODO, which says
what must hold afterwards (one design question per part). After a first attempt, solutions/lab8_hints.md
has a nudge per part and a step-by-step recipe per TODO; `torchrun --standalone --nproc_per_node=2
labs/lab8_fsdp.py --part K` checks parts 1 to K.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn

# torch 2.14 names them all_gather_single / reduce_scatter_single; all_gather_into_tensor and
# reduce_scatter_tensor still work there with a FutureWarning (torch/distributed/distributed_c10d.py of
# 2.14.1: all_gather_into_tensor is @deprecated, line 5176), and are the only names before 2.14.
# Same arguments, same collective; fully_shard calls the new names in 2.14.1 (_fsdp_collectives.py).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def rows_per_rank(rows: int, world_size: int) -> int:
    """Rows of dimension 0 in each rank's slice: ceil(rows / world_size); the last slices end in padding."""
    return -(-rows // world_size)


def shard_rows(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's slice of `full` along dimension 0, zero-padded to rows_per_rank rows (a new float32 tensor)."""
    # BEGIN SOLUTION
    # TODO(lab 8, part 1): return this rank's slice of full: rows [rank * per, (rank + 1) * per) with
    #   per = rows_per_rank(rows, world_size), as a new float32 tensor of exactly per rows (zeros where full
    #   has no such row). Design question: why must every rank's slice have the same number of rows, even
    #   when world_size does not divide the rows?
    # Every slice has per rows: all_gather_single takes equal parts from every rank and lays them end to
    # end, so the gathered buffer IS the padded matrix, row for row, and the padding sits at its end.
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
    run; its storage is allocated only while its unit's weights are gathered. Modules use its first `rows` rows.
    """

    def __init__(self, param: nn.Parameter, compute_dtype: torch.dtype, rank: int, world_size: int):
        self.shape = param.shape  # the unsharded, unpadded shape
        self.shard = nn.Parameter(shard_rows(param, rank, world_size), requires_grad=param.requires_grad)
        padded = (world_size * self.shard.shape[0], *self.shape[1:])
        self.full = torch.empty(padded, dtype=compute_dtype, device=param.device, requires_grad=param.requires_grad)
        self.full_bytes = self.full.numel() * self.full.element_size()
        self.full.untyped_storage().resize_(0)

    @property
    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def unpadded_view(self) -> torch.Tensor:
        """What the module computes with: the real rows of the full tensor (autograd tracks the view)."""
        return self.full.narrow(0, 0, self.shape[0])


class ShardGroup:
    """The sharded parameters of one unit, communicated together: one all-gather, one reduce-scatter.

    Flat layout of a message: rank r's part is its slices of every parameter, concatenated in `params`
    order. So the gathered buffer, viewed as (world_size, slice elements of the group), has rank r's slices
    in row r, and column block i of it is parameter i's full tensor, rank after rank (its rows in order).
    """

    def __init__(self, params: list[ShardedParameter], world_size: int):
        self.params = params
        self.world_size = world_size
        self.slice_sizes = [handle.shard.numel() for handle in params]
        self.users = 0  # for _before_forward / _after_forward's bookkeeping, if you want it (part 2)
        self.gradients_pending = {h for h in params if h.full.requires_grad}  # not yet accumulated this step

    @property
    def gathered(self) -> bool:
        return self.params[0].gathered

    def gather(self) -> None:
        """Allocate every full tensor of the group and fill them from every rank's slices, in ONE all-gather."""
        if self.gathered:
            return
        # BEGIN SOLUTION
        # TODO(lab 8, part 2): afterwards every handle.full holds the whole (padded) weight, in its own dtype,
        #   built from every rank's slice by ONE collective for the whole group (the class docstring gives the
        #   layout). Autograd may have saved handle.full in forward: it must not see this refill as a change.
        # The storage grows back to its size (release() shrank it to 0 bytes); writing through .data keeps
        # autograd's version counter still, so the tensor it saved is "unchanged" when backward reads it.
        for handle in self.params:
            handle.full.untyped_storage().resize_(handle.full_bytes)
        dtype = self.params[0].full.dtype  # the cast halves the bytes sent for float16
        local = torch.cat([handle.shard.detach().to(dtype).reshape(-1) for handle in self.params])
        everyone = torch.empty(self.world_size * local.numel(), dtype=dtype, device=local.device)
        all_gather_single(everyone, local)
        columns = everyone.view(self.world_size, -1).split(self.slice_sizes, dim=1)
        for handle, column in zip(self.params, columns):
            handle.full.data.view(self.world_size, -1).copy_(column)
        # END SOLUTION

    def release(self) -> None:
        """Free the full tensors' memory; the tensor objects (and autograd's references to them) stay."""
        # BEGIN SOLUTION
        # TODO(lab 8, part 2): afterwards the full tensors hold no memory; the tensor objects, which autograd may
        #   keep for backward, stay.
        for handle in self.params:
            handle.full.untyped_storage().resize_(0)
        # END SOLUTION

    def gradient_ready(self, handle: ShardedParameter) -> None:
        """Called once per backward for each trainable handle whose gradient is complete (FSDP._prepare_backward
        arranges it); when the last of the group has reported, the group reduce-scatters."""
        self.gradients_pending.discard(handle)
        if not self.gradients_pending:
            self.reduce_scatter()

    def reduce_scatter(self) -> None:
        """Each slice's .grad += the average over ranks of its gradient, for the whole group in ONE reduce-scatter;
        then free the full tensors. A trainable parameter without a gradient this step counts as zeros."""
        trainable = [handle for handle in self.params if handle.full.requires_grad]
        # BEGIN SOLUTION
        # TODO(lab 8, part 3): afterwards each trainable handle's shard.grad is (or, if it had one, has been
        #   increased by) this rank's rows of the AVERAGE over ranks of handle.full.grad, in float32 (a handle
        #   without a gradient counts as zeros), for the whole group in ONE reduce-scatter; then every
        #   full.grad and the full tensors' memory are freed.
        # Divided by world_size first, so the reduce-scatter's sum is the average; laid out as the gather is
        # (row r of the (world_size, -1) view is what rank r receives).
        gradients = [(h.full.grad if h.full.grad is not None else torch.zeros_like(h.full)).to(torch.float32) for h in trainable]
        flat = torch.cat([g.view(self.world_size, -1) / self.world_size for g in gradients], dim=1)
        mine = torch.empty(flat.shape[1], dtype=torch.float32, device=flat.device)
        reduce_scatter_single(mine, flat.reshape(-1))
        for handle, part in zip(trainable, mine.split([h.shard.numel() for h in trainable])):
            grad = part.view_as(handle.shard)
            handle.shard.grad = grad if handle.shard.grad is None else handle.shard.grad + grad
            handle.full.grad = None
        self.release()
        # END SOLUTION
        self.gradients_pending = set(trainable)  # the next step waits for all of them again


class FSDP(nn.Module):
    """Fully sharded data parallelism: weight matrices sharded by rows, gathered only around their use.

    FSDP(module, compute_dtype=None, units=None). The wrapped model is `.module`; its parameters of two or
    more dimensions are replaced by this rank's slices. `units`: submodules whose parameters travel
    together (e.g. the transformer blocks); the wrapped model is the unit of the rest. None: every module
    that owns a weight matrix is a unit of its own. See the module docstring for the protocol.
    """

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None, units=None):
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
        # Per unit: the (module, attribute name, handle) of every weight matrix its modules hold, and the
        # groups those handles belong to (its own, and another unit's for a weight tied across units).
        self._uses: dict[nn.Module, list[tuple[nn.Module, str, ShardedParameter]]] = {}
        self._groups_of: dict[nn.Module, list[ShardGroup]] = {}
        self._backward_prepared = False  # for _prepare_backward, if you want it (part 3)
        self._shard_parameters(self._units(units))
        for unit in self._uses:
            unit.register_forward_pre_hook(self._before_forward)
            unit.register_forward_hook(self._after_forward)

    def _units(self, units) -> list[nn.Module]:
        """The units in the wrapped model's module order, so an outer unit comes before the units inside it:
        the wrapped model and those given, or (units=None) every module that owns a weight matrix."""
        if units is None:
            return [m for m in self.module.modules() if any(p.dim() >= 2 for p in m.parameters(recurse=False))]
        chosen = {self.module, *units}
        if len(chosen.intersection(self.module.modules())) < len(chosen):
            raise ValueError("every unit must be a submodule of the wrapped module")
        return [m for m in self.module.modules() if m in chosen]

    def _shard_parameters(self, units: list[nn.Module]) -> None:
        """Replace every parameter of 2+ dimensions by its slice, and group the slices by unit.

        A module belongs to the innermost unit that contains it. A tied parameter gets one ShardedParameter,
        in the group of the first unit that holds it; every unit that uses it gathers that group."""
        unit_of = {}
        for unit in units:  # outer units first, so an inner unit claims its modules last
            for module in unit.modules():
                unit_of[module] = unit
        by_original: dict[nn.Parameter, ShardedParameter] = {}
        members: dict[nn.Module, list[ShardedParameter]] = {unit: [] for unit in units}
        group_of: dict[ShardedParameter, nn.Module] = {}
        for owner in self.module.modules():
            for name, param in list(owner.named_parameters(recurse=False)):
                if param.dim() < 2:
                    if all(param is not seen for seen in self.replicated):
                        self.replicated.append(param)
                    continue
                unit = unit_of.get(owner)
                if unit is None:
                    raise ValueError(f"{type(owner).__name__} owns a weight matrix but is in no unit")
                if param not in by_original:
                    by_original[param] = ShardedParameter(param, self.compute_dtype, self.rank, self.world_size)
                    members[unit].append(by_original[param])
                    group_of[by_original[param]] = unit
                handle = by_original[param]
                setattr(owner, name, handle.shard)  # the module now holds the slice
                self.sharded[handle.shard] = handle
                self._uses.setdefault(unit, []).append((owner, name, handle))
        groups = {unit: ShardGroup(params, self.world_size) for unit, params in members.items() if params}
        for unit, uses in self._uses.items():
            needed = []
            for _, _, handle in uses:
                group = groups[group_of[handle]]
                if all(group is not seen for seen in needed):
                    needed.append(group)
            self._groups_of[unit] = needed
        self.groups = list(groups.values())

    def forward(self, *inputs, **kwargs):
        output = self.module(*inputs, **kwargs)  # the units' hooks gather and free around their forward
        if torch.is_grad_enabled():  # a backward may follow (under no_grad, none can)
            self._prepare_backward()
        return output

    # --- forward: gather, use, free ---------------------------------------------------------------------

    def _before_forward(self, unit: nn.Module, inputs) -> None:
        """Forward pre-hook: gather the unit's weights and show its modules the full ones in place of the slices."""
        # BEGIN SOLUTION
        # TODO(lab 8, part 2): afterwards every group the unit uses is gathered, and every module of the unit
        #   finds the full weight (handle.unpadded_view()) under the parameter's name instead of the slice.
        #   Design question: units nest (the root's forward runs around the blocks') and a weight can be shared
        #   between units - how will _after_forward know whether it may free a group?
        # Count the units inside their forward per group: _after_forward frees a group when the count is 0.
        # An entry in the instance __dict__ is found before nn.Module.__getattr__ looks in owner._parameters.
        for group in self._groups_of[unit]:
            group.gather()
            group.users += 1
        for owner, name, handle in self._uses[unit]:
            owner.__dict__[name] = handle.unpadded_view()
        # END SOLUTION

    def _after_forward(self, unit: nn.Module, inputs, output):
        """Forward hook: hide and free the full weights; arrange for them to be gathered again in backward."""
        # BEGIN SOLUTION
        # TODO(lab 8, part 2): afterwards the unit's modules find their slices again; a group's full weights
        #   are freed unless a unit still inside its forward uses them; and self._before_backward(unit) will
        #   run before autograd computes this unit's backward (its weights must be back by then).
        # The unit's backward starts when the gradient of its output is ready: a hook on each output tensor
        # runs exactly then (a module's register_full_backward_pre_hook would do too).
        for owner, name, _ in self._uses[unit]:
            owner.__dict__.pop(name, None)  # a module used twice in the unit appears twice
        for group in self._groups_of[unit]:
            group.users -= 1
            if group.users == 0:  # an enclosing unit may still be running
                group.release()
        outputs = output if isinstance(output, (tuple, list)) else [output]
        for tensor in outputs:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(lambda grad: self._before_backward(unit))
        # END SOLUTION

    # --- backward: gather again; the groups reduce-scatter themselves ------------------------------------

    def _before_backward(self, unit: nn.Module) -> None:
        """Runs before autograd computes the unit's backward (_after_forward arranges it)."""
        # BEGIN SOLUTION
        # TODO(lab 8, part 3): afterwards every group the unit uses is gathered again: autograd is about to
        #   read the full weights it saved in forward.
        for group in self._groups_of[unit]:
            group.gather()  # returns at once for a group still gathered (tied to a unit already here)
        # END SOLUTION

    def _prepare_backward(self) -> None:
        """Runs at the end of every forward that records a graph (FSDP.forward), before its backward."""
        # BEGIN SOLUTION
        # TODO(lab 8, part 3): from now on, in every backward, group.gradient_ready(handle) must run exactly
        #   once for each trainable handle of each group, after handle.full.grad holds the gradient of EVERY
        #   use of that weight in the step. Design question: the tied embedding is used twice (by the embedding
        #   and by the head, perhaps in two units) - how do you know when its gradient is complete?
        # Not at its first use's backward: autograd adds the second use's gradient into the same leaf later.
        # A post-accumulate-grad hook runs once per backward per leaf, after every use has been accumulated
        # into .grad (torch.Tensor.register_post_accumulate_grad_hook). Registered once, at the first forward.
        if self._backward_prepared:
            return
        self._backward_prepared = True
        for group in self.groups:
            for handle in group.params:
                if handle.full.requires_grad:
                    handle.full.register_post_accumulate_grad_hook(lambda _, h=handle, g=group: g.gradient_ready(h))
        # END SOLUTION

    def finish_gradient_synchronization(self) -> None:
        """Call after backward() and before optimizer.step(): every trainable parameter of .module then has a
        float32 .grad of its own (local) shape holding the average over ranks of its gradient."""
        for group in self.groups:
            if len(group.gradients_pending) < sum(h.full.requires_grad for h in group.params):
                group.reduce_scatter()  # some of its weights were not used this step: theirs count as zeros
            elif any(h.shard.requires_grad and h.shard.grad is None for h in group.params):
                for handle in group.params:  # no rank used the group this step
                    if handle.shard.requires_grad and handle.shard.grad is None:
                        handle.shard.grad = torch.zeros_like(handle.shard)
            group.release()  # frozen weights gathered again for backward have no gradient hook to free them
        # BEGIN SOLUTION
        # TODO(lab 8, part 3): afterwards every trainable parameter in self.replicated has a .grad holding the
        #   average over ranks (a missing .grad counts as zeros), sent in ONE all-reduce for all of them.
        trainable = [param for param in self.replicated if param.requires_grad]
        if not trainable:
            return
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in trainable])
        dist.all_reduce(flat)  # a sum over ranks; every rank lists the parameters in the same order
        flat.div_(self.world_size)
        for param, part in zip(trainable, flat.split([p.numel() for p in trainable])):
            param.grad = part.view_as(param)
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
            # TODO(lab 8, part 1): full[name] = the whole float32 weight: every rank's slice of it, in rank
            #   order, without the padding rows (a collective: every rank runs this, in the same order).
            gathered = torch.empty(self.world_size * param.numel(), dtype=param.dtype, device=param.device)
            all_gather_single(gathered, param.detach().reshape(-1))
            full[name] = gathered.view(-1, *param.shape[1:])[: self.sharded[param].shape[0]]
            # END SOLUTION
        return full
