"""Test helper: a job that never finishes, for the launcher's timeout. Each worker says it started."""

import time

print("sleep_forever.py: started", flush=True)
while True:
    time.sleep(1)
