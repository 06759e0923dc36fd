"""Print this worker's MASTER_PORT and whether anyone holds it now (tests/test_multinode.py).

Run under torchrun. Nothing here binds the port for long: the probe is closed at once. A port no
socket holds is free for anyone to take before the rank-0 worker binds it.
"""

import os
import socket

port = int(os.environ["MASTER_PORT"])
with socket.socket() as probe:
    try:
        probe.bind(("", port))  # every IPv4 address: conflicts with a listener on any of them, or on [::]
        held = False
    except OSError:
        held = True
print(f"MASTER_PORT {port} held: {held}, agent store shared: {os.environ.get('TORCHELASTIC_USE_AGENT_STORE')}", flush=True)
