"""Re-execute notebooks in place and store their outputs, the way `pytest --nbval` will re-run them.

    python -m ddp_course.authoring.notebooks lectures/01_data_parallelism.ipynb [more.ipynb ...]

nbval compares every cell's fresh output with the stored one, and skips cells that were never
executed, so a notebook must be saved executed. This runs each notebook top to bottom in its own
folder with this environment's Python (as `--nbval-current-env` does), drops the widget state
from the saved file, masks the absolute paths in its outputs (the folders of the machine that ran it),
and prints how long it took (lecture notebooks should stay under 30 s on a 2-core CPU).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import time
from pathlib import Path


# A stored output is read on the web by learners: an absolute path there shows them the folders of the
# machine that stored it (/work/..., /home/NAME/...). Storing keeps the file name and masks the folders,
# with the rules tests/nbval_sanitize.cfg applies to both sides of every comparison, in the same order
# (tests/test_portability.py checks it), so a stored output and a fresh run still compare equal.
TEMPORARY_PATH = "/tmp/[^\\s'\"]+"  # the rule's text as the sanitizer file writes it
# Two or more components after a slash that no word, dot, slash, tilde or hyphen precedes: not a
# relative path (.venv/lib/...), a URL's path (https://host/a/b) or a rate (Gb/s). The system's own
# files (/etc/hosts, /dev/shm, /proc/..., /sys/...) are the same on every machine: they stay.
ABSOLUTE_PATH = r"(?<![\w./~-])/(?!(?:etc|dev|proc|sys)/)(?:[\w.+-]+/)+([\w.+-]+)"
PATH_MASKS = ((TEMPORARY_PATH, "TMPPATH"), (ABSOLUTE_PATH, r".../\1"))


def mask_paths(text: str) -> str:
    """text with each temporary path as TMPPATH and each other absolute path as .../its file name."""
    for pattern, replacement in PATH_MASKS:
        text = re.sub(pattern, replacement, text)
    return text


def output_texts(output: dict) -> list[tuple[dict, str]]:
    """(the dict that holds it, its key) for every text of one stored output: a stream's text, each
    text/* representation, an error's value and traceback."""
    places = [(output, key) for key in ("text", "evalue", "traceback") if key in output]
    data = output.get("data", {})
    return places + [(data, mime) for mime in data if mime.startswith("text/")]


def mask_stored_paths(notebook) -> None:
    """Mask the absolute paths in every output of a notebook (an nbformat node or the JSON as a dict)."""
    for cell in notebook["cells"]:
        for output in cell.get("outputs", []):
            for holder, key in output_texts(output):
                value = holder[key]
                holder[key] = [mask_paths(part) for part in value] if isinstance(value, list) else mask_paths(value)


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
    mask_stored_paths(notebook)
    nbformat.write(notebook, path)
    return elapsed


def code_cell_sources(path: str | Path) -> list[str]:
    """The source of every code cell of a notebook, in order (a test reads exercises and checks this way)."""
    cells = json.loads(Path(path).read_text())["cells"]
    return ["".join(cell["source"]) for cell in cells if cell["cell_type"] == "code"]


def run_source(source: str, namespace: dict) -> str:
    """Execute a cell's source in namespace, as the kernel would, and return what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(source, "<notebook cell>", "exec"), namespace)
    return printed.getvalue()


def run_all_cells(path: str | Path) -> tuple[dict, dict[str, str]]:
    """Run a notebook's code cells in order in one fresh namespace, as a kernel would.

    Returns the namespace and {first line of each cell: what it printed}, so that a test can call
    the notebook's functions (an exercise's check, say) and read its outputs.
    """
    namespace = {"__name__": Path(path).stem}
    printed = {source.splitlines()[0]: run_source(source, namespace) for source in code_cell_sources(path)}
    return namespace, printed


@contextlib.contextmanager
def replaced(namespace: dict, **replacements):
    """Swap some names of a namespace (a solution for a wrong answer, say) for the block, then restore them."""
    saved = {name: namespace[name] for name in replacements}
    namespace.update(replacements)
    try:
        yield namespace
    finally:
        namespace.update(saved)


def cells_titled(path: str | Path, prefix: str) -> dict[str, tuple[str, str]]:
    """{first line: (source, stored stdout)} for the code cells whose source starts with prefix.

    Exercise cells start with "# Exercise N: ...", their checks with "# Check exercise N ...".
    """
    found = {}
    for cell in json.loads(Path(path).read_text())["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and source.startswith(prefix):
            stdout = "".join("".join(out.get("text", "")) for out in cell["outputs"] if out["output_type"] == "stream")
            found[source.splitlines()[0]] = (source, stdout)
    return found


def stored_cell(path: str | Path, marker: str) -> tuple[str, str]:
    """(source, stored text output) of the one code cell of a stored notebook whose source contains marker.

    A test reads what the notebook printed when it was stored (a table, a run's verdict lines) this way."""
    cells = [cell for cell in json.loads(Path(path).read_text())["cells"]
             if cell["cell_type"] == "code" and marker in "".join(cell["source"])]  # fmt: skip
    assert len(cells) == 1, f"{len(cells)} code cells of {path} contain {marker!r}"
    return "".join(cells[0]["source"]), "".join("".join(output.get("text", "")) for output in cells[0]["outputs"])


def shared_cells(path: str | Path) -> list[str]:
    """The sources of a notebook's code cells tagged "shared": the set-up a lecture and its solutions
    notebook must both run, word for word (the tests compare the two lists)."""
    cells = json.loads(Path(path).read_text())["cells"]
    return ["".join(cell["source"]) for cell in cells if "shared" in cell.get("metadata", {}).get("tags", [])]


def run_check(namespace: dict, number: int, answer) -> str:
    """Run a notebook's one-call check, check_exercise_<number>(answer), on an answer (a wrong one,
    say); return everything it printed. Its verdict is the last line."""
    return run_source(f"check_exercise_{number}(answer)", {**namespace, "answer": answer})


def check_verdict(namespace: dict, number: int, answer) -> str:
    """The last line run_check() printed: "exercise N: correct", "... not yet ..." or "... not solved yet ..."."""
    return run_check(namespace, number, answer).strip().splitlines()[-1]


def stub_verdicts(namespace: dict, lecture_path: str | Path, functions: dict[int, str]) -> dict[int, str]:
    """{exercise number: its check's verdict} on each of the lecture's untouched exercise stubs, run in a
    copy of namespace; functions: {number: the function the exercise asks for}."""
    verdicts = {}
    for title, (stub, _) in cells_titled(lecture_path, "# Exercise ").items():
        number = int(re.match(r"# Exercise (\d+):", title).group(1))
        scratch = dict(namespace)
        run_source(stub, scratch)
        verdicts[number] = check_verdict(scratch, number, scratch[functions[number]])
    return verdicts


def not_solved_verdicts(functions: dict[int, str]) -> dict[int, str]:
    """What every check says of an untouched stub: {number: "exercise N: not solved yet - fill in NAME above"}."""
    return {number: f"exercise {number}: not solved yet - fill in {name} above" for number, name in functions.items()}


def main(paths: list[str]) -> int:
    usage = "usage: python -m ddp_course.authoring.notebooks NOTEBOOK.ipynb [NOTEBOOK.ipynb ...]"
    if not paths or any(path.startswith("-") for path in paths):
        print(usage, file=sys.stderr)
        return 2
    not_notebooks = [path for path in paths if not (path.endswith(".ipynb") and Path(path).is_file())]
    if not_notebooks:
        print(f"not a notebook file: {', '.join(not_notebooks)}\n{usage}", file=sys.stderr)
        return 2
    for path in paths:
        print(f"{path}: executed in {execute_in_place(path):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
