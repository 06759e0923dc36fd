"""Re-execute notebooks in place and store their outputs, the way `pytest --nbval` will re-run them.

    python -m ddp_course.notebooks lectures/01_data_parallelism.ipynb [more.ipynb ...]

nbval compares every cell's fresh output with the stored one, and skips cells that were never
executed, so a notebook must be saved executed. This runs each notebook top to bottom in its own
folder with this environment's Python (as `--nbval-current-env` does), drops the widget state
from the saved file, and prints how long it took (lecture notebooks should stay under 30 s on a 2-core CPU).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path


def execute_in_place(path: str | Path, timeout_s: int = 600) -> float:
    """Execute the notebook at path, save it with outputs, and return the seconds it took."""
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=timeout_s,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent.resolve())}},  # cells run in the notebook's folder
        record_timing=False,  # per-cell timestamps would change every cell's metadata on every run
    )
    started = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - started
    notebook.metadata.pop("widgets", None)  # saved widget state is noise: nbval never compares it
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)  # timestamps stored by earlier runs
    nbformat.write(notebook, path)
    return elapsed


def main(paths: list[str]) -> int:
    if not paths:
        print("usage: python -m ddp_course.notebooks NOTEBOOK.ipynb [NOTEBOOK.ipynb ...]", file=sys.stderr)
        return 2
    for path in paths:
        print(f"{path}: executed in {execute_in_place(path):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
