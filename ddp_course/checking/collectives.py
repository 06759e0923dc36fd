"""The one list of torch.distributed's collectives that the course's tools watch, and one way to wrap them.

Two tools replace these functions in `torch.distributed` with wrappers: the collective recorder of the
tests (`tests/scripts/record_collectives.py`: is every tensor on the rank's device?) and the checkers'
observer (`ddp_course/checking/observer.py`: did every rank make the same calls?). Both take their names from here, so a collective torch
adds is added once. DDP's and FSDP's own collectives run in C++ and are never seen: the tools check the
Python code a learner or a lab writes.
"""

from __future__ import annotations

from typing import Callable

import torch.distributed as dist

# Calls that every rank of the group makes together: a rank that skips one leaves the others waiting.
GROUP_COLLECTIVES = (
    "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all", "all_to_all_single",
    "barrier", "broadcast", "broadcast_object_list", "gather", "gather_object", "monitored_barrier", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list",
    "all_gather_single", "reduce_scatter_single",  # torch 2.14's names for the *_tensor pair (FSDP uses them)
)  # fmt: skip
# Calls between two ranks only.
POINT_TO_POINT = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
ALL_COLLECTIVES = GROUP_COLLECTIVES + POINT_TO_POINT


def install(names: tuple[str, ...], wrap: Callable[[str, Callable], Callable]) -> list[str]:
    """Replace each named function of torch.distributed that this torch has by wrap(name, the function);
    returns the names replaced (an older torch lacks the newest ones)."""
    import torch.distributed.distributed_c10d as c10d

    replaced = []
    for name in names:
        if not hasattr(dist, name):
            continue
        wrapper = wrap(name, getattr(dist, name))
        setattr(dist, name, wrapper)
        if name in ("isend", "irecv"):
            # P2POp accepts only c10d's own isend/irecv (an identity check), so they are replaced there too.
            setattr(c10d, name, wrapper)
        replaced.append(name)
    return replaced
