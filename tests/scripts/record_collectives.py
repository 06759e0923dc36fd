"""Run a lab script with every torch.distributed collective checked for the devices of its tensors.

    torchrun --standalone --nproc_per_node=2 tests/scripts/record_collectives.py LAB_SCRIPT [LAB ARGS...]

NCCL needs every tensor of a collective on the rank's GPU; a CPU tensor in an output list (review
finding 1) is handed to NCCL as a device pointer and crashes the job. This wrapper replaces each
collective in torch.distributed with a version that first checks that every tensor argument (the
inputs and each element of an output list) is on the device of the first tensor, and that this is
the device the group's backend works on (the rank's GPU for NCCL, the CPU for gloo), then calls the
real one. The lab runs unchanged, as __main__, with its own arguments (runpy). DDP's internal
collectives run in C++ and are not seen: we check the labs' own code.

At exit each rank prints one line:
    [collectives rank R] calls N violations M ops all_reduce=3,barrier=1,...
and one "[collectives rank R] VIOLATION ..." line per bad call.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys

import torch
import torch.distributed as dist

WRAPPED = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single",
    "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier", "monitored_barrier",
    "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
    "all_gather_single", "reduce_scatter_single",  # torch 2.14's names for the *_tensor pair (FSDP uses them)
)  # fmt: skip
calls: dict[str, int] = {}
violations: list[str] = []


def tensors_in(value) -> list[torch.Tensor]:
    """Every tensor in an argument: a tensor, a (nested) list or tuple of tensors, or a P2POp's tensor."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in tensors_in(item)]
    if isinstance(value, dist.P2POp):
        return [value.tensor]
    return []


def device_problems(op: str, args, kwargs, expected: torch.device | None) -> list[str]:
    """What is wrong with the devices of one call's tensors ([] when nothing is).

    Every tensor must be on the first tensor's device, and that must be `expected` (None: not checked).
    """
    tensors = [t for value in (*args, *kwargs.values()) for t in tensors_in(value)]
    if not tensors:
        return []
    first = tensors[0].device
    problems = [f"{op}: tensor {i} on {t.device}, the first tensor on {first}" for i, t in enumerate(tensors) if t.device != first]
    if expected is not None and first != expected:
        problems.append(f"{op}: tensors on {first}, but this rank's backend works on {expected}")
    return problems


def expected_device(group) -> torch.device:
    """Where the group's backend wants tensors: this rank's current GPU for NCCL, the CPU otherwise."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def checked(op: str, real):
    @functools.wraps(real)
    def wrapper(*args, **kwargs):
        calls[op] = calls.get(op, 0) + 1
        group = kwargs.get("group")
        # Object collectives pickle into tensors that torch places itself; only count them.
        if not op.endswith(("_object", "_object_list")):
            violations.extend(device_problems(op, args, kwargs, expected_device(group)))
        return real(*args, **kwargs)

    return wrapper


def install() -> None:
    import torch.distributed.distributed_c10d as c10d

    for op in (op for op in WRAPPED if hasattr(dist, op)):  # an older torch lacks the newest names
        wrapper = checked(op, getattr(dist, op))
        setattr(dist, op, wrapper)
        if op in ("isend", "irecv"):
            # P2POp accepts only c10d's own isend/irecv (an identity check), so they are replaced there too.
            setattr(c10d, op, wrapper)


def report() -> None:
    rank = os.environ.get("RANK", "0")
    ops = ",".join(f"{op}={count}" for op, count in sorted(calls.items()))
    lines = [f"[collectives rank {rank}] VIOLATION {problem}" for problem in violations]
    lines.append(f"[collectives rank {rank}] calls {sum(calls.values())} violations {len(violations)} ops {ops}")
    sys.stdout.write("\n".join(lines) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    script, *script_args = sys.argv[1:]
    install()
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # as `python script` would
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        report()
