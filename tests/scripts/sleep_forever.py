"""Test helper: a job that never finishes, for the launcher's timeout."""

import time

while True:
    time.sleep(1)
