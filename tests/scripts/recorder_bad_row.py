"""Rows for the recorder's own test (tests/test_device_discipline.py): one that makes a mixed-device
call, one that fails with a given exit status.

    torchrun ... tests/scripts/record_collectives.py --rows ROWS.json   (ROWS name this script)
    args: --mixed-device | --exit-status N
"""

import sys

import torch
import torch.distributed as dist


def main(argv: list[str]) -> int:
    dist.init_process_group("gloo")
    if argv[0] == "--mixed-device":
        try:  # the recorder checks before the real call; gloo then refuses the meta tensor itself
            dist.all_reduce(torch.zeros(1, device="meta"))
        except (RuntimeError, NotImplementedError, ValueError):
            pass
        dist.all_reduce(torch.zeros(1))  # one good call, so both ranks are still in step
        dist.destroy_process_group()
        return 0
    dist.barrier()
    dist.destroy_process_group()
    return int(argv[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
