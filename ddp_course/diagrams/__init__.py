"""The course's diagrams: every figure in assets/ is drawn by code here, never by hand.

    python -m ddp_course.diagrams            # redraw every figure: assets/NAME.png and assets/NAME.json
    python -m ddp_course.diagrams --check    # exit 1 (one line per figure) if a committed figure is stale

A diagram is a module in this package with
    NAME: str                      the file name in assets/ (NAME.png, NAME.json)
    TITLE: str                     one line: what the figure shows
    describe() -> dict             everything the figure shows, as JSON-ready data: each box, arrow,
                                   label and number (a measured diagram reads its data here)
    draw(description) -> Figure    the matplotlib figure, drawn only from the description

The description is committed beside the PNG, with a fingerprint of the module's source. The test
(tests/test_diagrams.py) recomputes both: a figure is stale when what it should show changed (the
code it is drawn from, or the data) or when its drawing code changed, and the PNG was not redrawn.
The PNG's bytes are never compared: they depend on matplotlib's version and fonts.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent.parent / "assets"
# One module per diagram, in the order the route meets them.
MODULES = (
    "torchrun_processes",  # lecture 1 section 4: torchrun -> processes -> environment -> process group
    "ddp_backward",  # lecture 4: hooks, buckets, asynchronous all-reduce, the wait
    "failure_decision_tree",  # lecture 6 section 1: a hang, a wrong result or a crash?
    "sharded_memory_timeline",  # lecture 7: DDP vs FSDP memory over one step, from measured data
    "lab10_timeline",  # lab 10: each rank's steps split into data wait, compute, communication, waiting
)


def available_modules():
    """The diagram modules that exist (a diagram is added by writing its module and naming it above)."""
    package = Path(__file__).resolve().parent
    return [importlib.import_module(f"{__name__}.{name}") for name in MODULES if (package / f"{name}.py").exists()]


def fingerprint(module) -> str:
    """A short hash of the module's source: any change to what or how it draws changes it."""
    return hashlib.sha256(inspect.getsource(module).encode()).hexdigest()[:16]


def expected_record(module) -> dict:
    return {"name": module.NAME, "title": module.TITLE, "source_fingerprint": fingerprint(module),
            "description": module.describe()}  # fmt: skip


def committed_record(module) -> dict | None:
    path = ASSETS / f"{module.NAME}.json"
    return json.loads(path.read_text()) if path.exists() else None


def redraw(module) -> Path:
    """Write assets/NAME.json and assets/NAME.png for one diagram."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record = expected_record(module)
    (ASSETS / f"{module.NAME}.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    figure = module.draw(record["description"])
    path = ASSETS / f"{module.NAME}.png"
    figure.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(figure)
    return path


def stale(module) -> str | None:
    """Why the committed figure is stale, or None when it is current."""
    record = committed_record(module)
    if record is None or not (ASSETS / f"{module.NAME}.png").exists():
        return f"{module.NAME}: not drawn yet"
    # Round-trip through JSON so that tuples and lists, ints and floats compare as the file stores them.
    expected = json.loads(json.dumps(expected_record(module), sort_keys=True))
    if record["source_fingerprint"] != expected["source_fingerprint"]:
        return f"{module.NAME}: its drawing code changed since it was drawn"
    if record != expected:
        return f"{module.NAME}: what it shows changed since it was drawn"
    return None


def main(argv: list[str]) -> int:
    modules = available_modules()
    if "--check" in argv:
        problems = [problem for problem in map(stale, modules) if problem]
        for problem in problems:
            print(f"stale: {problem} (redraw: python -m ddp_course.diagrams)")
        return 1 if problems else 0
    for module in modules:
        print(f"drew {redraw(module).relative_to(ASSETS.parent)}: {module.TITLE}")
    return 0
