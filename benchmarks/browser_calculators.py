"""Do the lectures' calculators follow their sliders in a real browser? (issue 20; not part of the suite)

    pip install playwright && apt-get install chromium     # not in requirements.txt: an optional check
    python benchmarks/browser_calculators.py [--chromium /usr/bin/chromium]

The tests move each calculator's sliders by setting `.value` in the kernel (tests/test_calculators.py and
the lecture tests); this checks the other half, the browser: it writes a notebook that builds the four
calculators exactly as the lectures do (lecture 1's communication bars, lecture 5a's step time and 5b's memory,
lecture 6's waste curve), starts JupyterLab on it, opens it in headless Chromium, runs every cell, then
presses the Right arrow 5 times on the first slider of each calculator. A calculator passes when both
its slider's readout and its drawing (the image and the text under it) change. One line per calculator;
exit status 0 only when all four follow. Screenshots of each calculator after the move go to --out.
"""

from __future__ import annotations

import argparse
import hashlib
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CELLS = {
    "lecture 1 communication": "from ddp_course.lecture01_checks import communication_calculator\n"
    "communication_calculator(millions_of_parameters=124.4, world_size=8)",
    "lecture 5b memory": "from ddp_course.calculators import memory_calculator\nmemory_calculator()",
    "lecture 5a step time": "from ddp_course.calculators import step_time_calculator\nstep_time_calculator()",
    "lecture 6 waste": "from ddp_course.lecture06_checks import waste_calculator\nwaste_calculator(checkpoint_s=60, mtbf_h=24, restart_s=300)",
}


def write_notebook(folder: Path) -> Path:
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in CELLS.values()]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = folder / "calculators.ipynb"
    nbformat.write(notebook, path)
    return path


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def drawing(box) -> str:
    """A fingerprint of what the calculator shows below its controls: its text and its images' sources."""
    sources = "".join(image.get_attribute("src") or "" for image in box.query_selector_all("img"))
    return hashlib.sha1((box.inner_text() + sources).encode()).hexdigest()


def check_in_browser(url: str, chromium: str, out: Path) -> list[tuple[str, str, str, bool]]:
    from playwright.sync_api import sync_playwright

    results = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 2400})
        page.goto(url)
        page.wait_for_selector(".jp-Notebook", timeout=60_000)
        time.sleep(3)  # the kernel connects
        page.click("text=Run", timeout=10_000)
        page.click("text=Run All Cells", timeout=10_000)
        page.wait_for_function("document.querySelectorAll('.widget-vbox .noUi-handle').length >= 4", timeout=120_000)
        time.sleep(5)  # the first drawings arrive
        boxes = [box for box in page.query_selector_all(".jp-OutputArea-output .widget-vbox") if box.query_selector(".noUi-handle")]
        for name, box in zip(CELLS, boxes):
            readout = box.query_selector(".widget-readout")
            value_before, drawing_before = readout.inner_text(), drawing(box)
            box.query_selector(".noUi-handle").focus()
            for _ in range(5):
                page.keyboard.press("ArrowRight")
            time.sleep(4)  # the kernel redraws and sends the new image
            value_after, drawing_after = readout.inner_text(), drawing(box)
            box.screenshot(path=str(out / f"{name.replace(' ', '_')}.png"))
            results.append((name, value_before, value_after, value_after != value_before and drawing_after != drawing_before))
        browser.close()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chromium", default="/usr/bin/chromium", help="the Chromium executable")
    parser.add_argument("--out", type=Path, help="where the screenshots go (default: a temporary folder)")
    args = parser.parse_args()
    if not Path(args.chromium).is_file():
        parser.error(f"--chromium {args.chromium}: no such file (apt-get install chromium)")
    try:
        import playwright  # noqa: F401
    except ImportError:
        parser.error("playwright is not installed (pip install playwright)")
    folder = Path(tempfile.mkdtemp(prefix="calculators_"))
    out = args.out or folder
    out.mkdir(parents=True, exist_ok=True)
    notebook = write_notebook(folder)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ServerApp.token=", "--ServerApp.password=",
         f"--ServerApp.root_dir={folder}", "--allow-root"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        time.sleep(10)  # the server starts
        results = check_in_browser(f"http://127.0.0.1:{port}/lab/tree/{notebook.name}", args.chromium, out)
    finally:
        server.terminate()
        server.wait(timeout=30)
    for name, before, after, follows in results:
        print(f"{name:<24} first slider {before} -> {after}: {'the drawing follows' if follows else 'NOTHING CHANGED'}")
    print(f"screenshots in {out}")
    return 0 if len(results) == len(CELLS) and all(follows for *_, follows in results) else 1


if __name__ == "__main__":
    sys.exit(main())
