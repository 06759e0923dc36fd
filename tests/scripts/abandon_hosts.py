"""Make virtual hosts with a daemon on each, print what was made, then wait to be killed (tests/test_multinode.py).

What a test run stopped with SIGKILL leaves behind: namespaces, the processes in them and the
hosts' folder, with nobody left to call close(). Prints one JSON line once the daemons run.
"""

import json
import time

from ddp_course.launch import wait_until
from ddp_course.cluster.netns import VirtualHosts


def running_sleep(pid: int) -> bool:
    """Past the shell's trap: SIGTERM no longer ends it."""
    try:
        return open(f"/proc/{pid}/comm").read().strip() == "sleep"
    except OSError:
        return False


hosts = VirtualHosts()
for name in hosts.names:  # daemons that ignore SIGTERM, as a stuck slurmd might: only SIGKILL ends them
    hosts.start(name, ["sh", "-c", "trap '' TERM; exec sleep 300"], hosts.dir / f"{name}.log")
wait_until(lambda: [running_sleep(pid) for pid in hosts.pids()] == [True] * len(hosts.names), timeout_s=30)
print(json.dumps({"namespaces": sorted(hosts.namespaces.values()), "folder": str(hosts.dir), "pids": hosts.pids()}), flush=True)
time.sleep(600)
