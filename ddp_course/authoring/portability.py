"""Re-run every notebook under nbval with other CPU numerics and report each cell whose output changed.

    python -m ddp_course.authoring.portability                    # all notebooks, scalar kernels and one thread
    python -m ddp_course.authoring.portability --variant avx2 --variant one-thread lectures/01_data_parallelism.ipynb

Why: nbval compares each cell's fresh output with the one stored on the machine that executed the
notebook. Learners run other CPUs (Intel and AMD with AVX2 or AVX-512, Apple and other ARM chips),
whose vectorised kernels and thread splits add floating-point numbers in other orders. A stored
output that depends on that order - a rounding-noise digit, a threshold inside the rounding spread -
passes here and fails there. Two switches reproduce other machines' rounding on this one:

- ATEN_CPU_CAPABILITY=default: PyTorch's non-vectorised CPU kernels (=avx2 / =avx512 pick those).
- OMP_NUM_THREADS=1: one thread per process, so reductions are not split across threads.

A notebook that passes nbval under these as well as normally states facts, not this CPU's rounding.

First, without running anything, it reads every stored output for absolute paths: a path of the machine
that stored the notebook (/work/..., /home/NAME/...) is not the learner's, and shows them another
machine's folders. Re-storing with `python -m ddp_course.authoring.notebooks` masks them.
Exit status 0 when every variant passes and no stored output holds an absolute path, 1 otherwise,
2 on a bad argument.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from ddp_course.launch import REPO_ROOT
from ddp_course.authoring.notebooks import ABSOLUTE_PATH, TEMPORARY_PATH, output_texts

NOTEBOOK_FOLDERS = ("lectures", "labs", "solutions")

# Each variant is a set of environment variables that changes the CPU's floating-point behaviour.
VARIANTS = {
    "scalar-1thread": {"ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"},  # both at once: what CI runs
    "scalar": {"ATEN_CPU_CAPABILITY": "default"},  # PyTorch's non-vectorised kernels
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2"},  # what most x86 laptops of the last decade run
    "one-thread": {"OMP_NUM_THREADS": "1"},  # reductions not split across threads
}
DEFAULT_VARIANT = "scalar-1thread"


def all_notebooks() -> list[Path]:
    return sorted(path for folder in NOTEBOOK_FOLDERS for path in (REPO_ROOT / folder).glob("*.ipynb"))


def stored_absolute_paths(notebook: Path) -> list[str]:
    """'notebook cell N (nbval's Cell M): /the/path' for each absolute path in a stored output.

    N counts every cell, as an editor shows them; nbval names code cells only, M of them before it.
    """
    found = []
    code_cells = 0
    for index, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        if cell["cell_type"] != "code":
            continue
        for output in cell.get("outputs", []):
            for holder, key in output_texts(output):
                value = holder[key]
                text = "".join(value) if isinstance(value, list) else str(value)
                for match in re.finditer(f"{TEMPORARY_PATH}|{ABSOLUTE_PATH}", text):
                    found.append(f"{display_name(notebook)} cell {index} (nbval's Cell {code_cells}): {match.group(0)}")
        code_cells += 1
    return found


def display_name(notebook: Path) -> str:
    return str(notebook.relative_to(REPO_ROOT)) if notebook.is_relative_to(REPO_ROOT) else str(notebook)


def changed_cells(junit_xml: Path) -> list[str]:
    """'notebook::Cell N: first line of the difference' for every failed or errored nbval item."""
    changed = []
    for case in ElementTree.parse(junit_xml).iter("testcase"):
        for problem in [*case.iter("failure"), *case.iter("error")]:
            message = (problem.get("message") or problem.text or "").strip().splitlines()
            where = f"{case.get('classname', '')}::{case.get('name', '')}"
            changed.append(f"{where}: {message[0] if message else 'failed'}")
    return changed


def run_variant(name: str, notebooks: list[Path], timeout_s: float) -> tuple[list[str], float, str]:
    """Run nbval over notebooks with the variant's environment; return (changed cells, seconds, tail)."""
    env = {**os.environ, **VARIANTS[name]}
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "nbval.xml"
        command = [
            sys.executable, "-m", "pytest", "--nbval", "-q", "-p", "no:cacheprovider",
            # pytest.ini gives these to the course's notebooks; a notebook outside the course gets them here
            # (as one argument: a path given alone would count in pytest's choice of its rootdir)
            "--nbval-current-env", f"--nbval-sanitize-with={REPO_ROOT / 'tests' / 'nbval_sanitize.cfg'}",
            f"--junitxml={report}", *map(str, notebooks),
        ]  # fmt: skip
        started = time.perf_counter()
        try:
            finished = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return [f"(variant {name} did not finish within {timeout_s:.0f} s)"], time.perf_counter() - started, ""
        seconds = time.perf_counter() - started
        tail = "\n".join(finished.stdout.strip().splitlines()[-3:])
        if not report.exists():  # pytest itself failed before running anything
            return [f"(pytest exited {finished.returncode} without a report)"], seconds, finished.stdout + finished.stderr
        changed = changed_cells(report)
        if finished.returncode != 0 and not changed:
            changed = [f"(pytest exited {finished.returncode}; see its output)"]
        return changed, seconds, tail


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ddp_course.authoring.portability", description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", help="notebooks to check (default: every notebook in the course)")
    parser.add_argument(
        "--variant", action="append", choices=VARIANTS,
        help=f"numerics to try, repeatable (default: {DEFAULT_VARIANT}, i.e. ATEN_CPU_CAPABILITY=default and OMP_NUM_THREADS=1)",
    )  # fmt: skip
    parser.add_argument("--timeout-s", type=float, default=3600, help="limit for each variant's whole run")
    args = parser.parse_args(argv)
    missing = [path for path in args.notebooks if not Path(path).is_file()]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    notebooks = [Path(path).resolve() for path in args.notebooks] or all_notebooks()
    stored_paths = [line for notebook in notebooks for line in stored_absolute_paths(notebook)]
    print(f"stored outputs of {len(notebooks)} notebook(s): {len(stored_paths)} absolute path(s)", flush=True)
    for line in stored_paths:
        print(f"  ABSOLUTE PATH {line}")
    any_changed = False
    for name in args.variant or [DEFAULT_VARIANT]:
        settings = " ".join(f"{key}={value}" for key, value in VARIANTS[name].items())
        print(f"variant {name} ({settings}): {len(notebooks)} notebook(s) under nbval ...", flush=True)
        changed, seconds, tail = run_variant(name, notebooks, args.timeout_s)
        for line in changed:
            print(f"  CHANGED {line}")
        print(f"  {tail.splitlines()[-1] if tail else ''} [{seconds:.0f} s]", flush=True)
        any_changed |= bool(changed)
    if stored_paths:
        print("NOT portable: the stored outputs above hold another machine's folders "
              "(re-store those notebooks with python -m ddp_course.authoring.notebooks)")  # fmt: skip
    if any_changed:
        print("NOT portable: the cells above print something that depends on the CPU's rounding")
    if not stored_paths and not any_changed:
        print("portable: every compared output is the same under these numerics, and no stored output holds an absolute path")
    return 1 if any_changed or stored_paths else 0


if __name__ == "__main__":
    sys.exit(main())
