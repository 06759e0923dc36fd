"""The course's website: built from the stored outputs, navigable by the route, honest, offline, accessible.

    pip install -r requirements-site.txt && apt-get install chromium
    pytest website/tests

Not collected by `pytest --nbval` (the site's tools are not part of a learner's set-up): without them
these tests skip with one reason, and DDP_COURSE_REQUIRE_SITE=1 (as .ci/run sets) makes that a failure.
One build serves every test of the module (about 1-2 minutes on 2 cores); the mutants fail before Sphinx runs.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import threading
from pathlib import Path

import pytest

from ddp_course.authoring import budget, website
from ddp_course.launch import REPO_ROOT

REQUIRED = os.environ.get("DDP_COURSE_REQUIRE_SITE") == "1"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def missing(what: str):
    if REQUIRED:
        pytest.fail(f"{what}, and DDP_COURSE_REQUIRE_SITE=1 asks for the site's tests", pytrace=False)
    pytest.skip(f"{what}: pip install -r requirements-site.txt (and apt-get install chromium for the browser test)",
                allow_module_level=True)  # fmt: skip


try:
    import latex2mathml  # noqa: F401
    import myst_nb  # noqa: F401
    import sphinx_book_theme  # noqa: F401
except ImportError as error:
    missing(f"the site's tools are not installed ({error.name})")

ROUTE = budget.route()


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return website.build(tmp_path_factory.mktemp("site") / "html")


def html_of(site: Path, notebook: str) -> str:
    return (site / notebook).with_suffix(".html").read_text()


def test_one_page_per_route_notebook_with_its_title(site):
    assert len(ROUTE) == 18
    for name, path in ROUTE:
        page = html_of(site, path)
        title = website.notebook_title(website.read_course(), path)
        assert title.split(":")[0] in page, f"{path}: its page lacks its title"
    assert (site / website.OPTIONAL_NOTEBOOK).with_suffix(".html").exists()
    assert (site / "labs" / "lab3_ddp.py.html").exists() and (site / "labs" / "convert_checklist.html").exists()


def test_the_navigation_lists_the_route_in_order_and_marks_the_deep_dive_labs(site):
    landing = (site / "index.html").read_text()
    navigation = re.search(r'<nav class="bd-links bd-docs-nav".*?</nav>', landing, flags=re.DOTALL).group(0)
    linked = [href.removeprefix("./") for href in re.findall(r'href="([^"#]+)\.html"', navigation)]
    route_pages = [path.removesuffix(".ipynb") for _, path in ROUTE]
    in_nav = [page for page in linked if page in route_pages]
    assert in_nav == route_pages
    assert "12. lab 6 (deep dive)" in navigation and "16. lab 8 (deep dive)" in navigation
    assert "Syllabus" in landing and "The route:" in landing  # the README is the landing page


def test_each_route_page_has_its_step_before_and_next(site):
    for index, (name, path) in enumerate(ROUTE):
        page = html_of(site, path)
        assert f"Route step {index + 1} of {len(ROUTE)}: {name}" in page
        next_links = re.findall(r'class="route-next" href="([^"]+)"', page)
        if index + 1 < len(ROUTE):
            expected = os.path.relpath(ROUTE[index + 1][1].removesuffix(".ipynb") + ".html", Path(path).parent)
            assert next_links and set(next_links) == {expected}, f"{path}: Next links {next_links}, expected {expected}"
        else:
            assert not next_links and "The end of the route" in page


def test_core_and_deep_dive_sections_are_marked(site):
    page = html_of(site, "lectures/04_ddp_internals.ipynb")
    assert '<section class="deep-dive" id="course-lecture-4-s3">' in page, "lecture 4 section 3 is not marked as a deep dive"
    assert '<section class="core" id="course-lecture-4-s2">' in page
    assert page.count("course-tag-deep-dive") >= 5 and "course-tag-core" in page
    assert "[deep dive]" not in page.split("<main")[1]  # the tag became a mark, not left as text
    assert "core-only-switch" in page


def test_every_page_is_stamped_with_the_torch_version_and_the_commit(site):
    stamp = website.current_stamp(REPO_ROOT, checked=False)
    pages = [path for path in site.rglob("*.html") if not str(path.relative_to(site)).startswith(website.SKIPPED_PAGES)]
    assert len(pages) >= 17 + 1 + 9
    for path in pages:
        text = path.read_text()
        assert website.STAMP_CLASS in text and f"<code>{stamp.torch}</code>" in text, path
        assert stamp.commit.split()[0] in text, path


def test_every_image_has_alt_text_that_says_what_it_shows(site):
    images = []
    for path in site.rglob("*.html"):
        page = website.parse_page(path)
        images += [(path.relative_to(site).as_posix(), src, alt) for src, alt in page.images]
    plots = [image for image in images if "_images/" in image[1] and "assets" not in image[1]]
    assert len(plots) >= 40, f"only {len(plots)} stored plots on the site"
    for page, src, alt in images:
        assert alt and len(alt) >= 25 and not website.FILE_NAME_ALT.match(alt), f"{page}: {src} alt={alt!r}"
    diagram_alts = {alt for _, src, alt in images if "torchrun_processes" in src}
    assert any("rank 3 on cuda:1" in alt for alt in diagram_alts), diagram_alts  # from assets/torchrun_processes.json


def test_widgets_say_what_they_do_and_load_no_widget_script(site):
    page = html_of(site, "lectures/02_collectives.ipynb")
    assert "live in JupyterLab" in page and "world_size" in page
    assert "widget-view+json" not in page and "require.js" not in page


def test_section_references_are_links_to_their_section(site):
    page = html_of(site, "lectures/06_debugging_fault_tolerance.ipynb")
    assert 'href="07_sharded_data_parallelism.html#course-lecture-7-s6"><span class="std std-ref">lecture 7 §6' in page
    checklist = (site / "labs" / "convert_checklist.html").read_text()
    assert 'href="../lectures/04_ddp_internals.html#course-lecture-4-s4-1"' in checklist  # "lecture 4 §4.1"
    assert 'id="course-lecture-7-s6"' in html_of(site, "lectures/07_sharded_data_parallelism.ipynb")
    assert website.check_site(site) == []  # every such link and its anchor resolve


def test_the_built_site_loads_nothing_from_the_internet(site):
    for path in list(site.rglob("*.html"))[:200]:
        for resource in website.parse_page(path).resources:
            assert not website.REMOTE.match(resource), f"{path}: {resource}"
    assert "cdn.jsdelivr" not in (site / "index.html").read_text()


# --- the checks bite: a mutant course or a broken page is refused --------------------------------------


@pytest.fixture
def course_copy(tmp_path) -> Path:
    """A copy of the course's files (not a git checkout: its stamp says so)."""
    root = tmp_path / "course"
    for name in ("lectures", "labs", "solutions", "assets", "website", "ddp_course"):
        shutil.copytree(REPO_ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__", "runs", "data", "*.pt"))
    for path in REPO_ROOT.iterdir():  # README.md and the files it links: CONTRIBUTING.md, CHANGELOG.md, LICENSE, ...
        if path.is_file() and not path.name.startswith("."):
            shutil.copyfile(path, root / path.name)
    return root


def edit_notebook(path: Path, edit) -> None:
    notebook = json.loads(path.read_text())
    edit(notebook["cells"])
    path.write_text(json.dumps(notebook))


def first_cell(cells, predicate):
    return next(cell for cell in cells if cell["cell_type"] == "code" and predicate(cell))


def build_problems(root: Path, tmp_path: Path) -> str:
    with pytest.raises(website.BuildError) as refused:
        website.build(tmp_path / "html", root=root)
    return str(refused.value)


def test_the_unchanged_copy_stages_without_a_problem(course_copy, tmp_path):
    """The mutants below are refused for their mutation alone: the copy they start from has no problem."""
    website.stage(website.read_course(course_copy), tmp_path, website.current_stamp(course_copy, checked=False))
    assert (tmp_path / "index.md").exists() and (tmp_path / "_course_site.json").exists()


def test_the_build_refuses_a_notebook_with_one_output_cleared(course_copy, tmp_path):
    def clear(cells):  # what JupyterLab's "Clear Cell Output" does
        cell = first_cell(cells, lambda cell: any(output.get("name") == "stdout" for output in cell["outputs"]))
        cell["outputs"], cell["execution_count"] = [], None

    edit_notebook(course_copy / "lectures" / "02_collectives.ipynb", clear)
    problems = build_problems(course_copy, tmp_path)
    assert problems.startswith("lectures/02_collectives.ipynb: code cell") and "has no stored outputs" in problems
    assert len(problems.splitlines()) == 1, problems
    assert not (tmp_path / "html").exists()


def test_the_build_refuses_a_printing_cell_whose_outputs_alone_were_removed(course_copy, tmp_path):
    def drop_outputs(cells):
        cell = first_cell(cells, lambda cell: website.unconditional_output_calls("".join(cell["source"])) and cell["outputs"])
        cell["outputs"] = []

    edit_notebook(course_copy / "labs" / "lab3_ddp.ipynb", drop_outputs)
    problems = build_problems(course_copy, tmp_path)
    assert problems.startswith("labs/lab3_ddp.ipynb: code cell") and "but stores no output" in problems
    assert len(problems.splitlines()) == 1, problems


def test_the_build_refuses_a_plot_without_alt_text(course_copy, tmp_path):
    def anonymous_plot(cells):
        cell = first_cell(cells, lambda cell: any("image/png" in output.get("data", {}) for output in cell["outputs"]))
        cell["source"] = ["draw_something()\n", "plt.show()\n"]  # names no title, no axes

    edit_notebook(course_copy / "lectures" / "03_samplers.ipynb", anonymous_plot)
    problems = build_problems(course_copy, tmp_path)
    assert problems.startswith("lectures/03_samplers.ipynb: code cell") and "stores a plot with no alt text" in problems
    assert len(problems.splitlines()) == 1, problems


def test_the_build_refuses_a_dead_link_and_a_reference_to_no_section(course_copy, tmp_path):
    def break_links(cells):
        cell = next(cell for cell in cells if cell["cell_type"] == "markdown")
        cell["source"].append("\nSee [the missing lab](../labs/lab99.py) and lecture 4 §9.9.\n")

    edit_notebook(course_copy / "lectures" / "05b_memory.ipynb", break_links)
    problems = build_problems(course_copy, tmp_path)
    assert "link to ../labs/lab99.py: no such file" in problems
    assert "'lecture 4 §9.9' names no section" in problems
    assert len(problems.splitlines()) == 2, problems


def test_the_html_check_finds_each_kind_of_broken_page(site, tmp_path):
    broken = tmp_path / "site"
    shutil.copytree(site, broken)
    page = broken / "lectures" / "01_data_parallelism.html"
    text = page.read_text()
    text = re.sub(r'<img alt="[^"]*"', '<img alt="1a2b3c4d5e6f7a8b9c0d.png"', text, count=1)
    text = re.sub(r'<img alt="Figure[^"]*"', '<img alt="None"', text, count=1)
    text = text.replace("</body>", '<a href="no_such_page.html">x</a><a href="#no-such-anchor">y</a>'
                                   '<script src="https://cdn.example.org/x.js"></script></body>')  # fmt: skip
    page.write_text(text)
    stamped = broken / "labs" / "lab3_ddp.html"
    stamped.write_text(stamped.read_text().replace(website.STAMP_CLASS, "something-else"))
    problems = "\n".join(website.check_site(broken))
    assert "lectures/01_data_parallelism.html: image" in problems and "has no alt text (alt='1a2b3c4d5e6f7a8b9c0d.png')" in problems
    assert "has no alt text (alt='None')" in problems
    assert "dead link no_such_page.html" in problems and "no anchor #no-such-anchor" in problems
    assert "loads https://cdn.example.org/x.js from the internet" in problems
    assert "labs/lab3_ddp.html: no stamp" in problems


# --- a real browser walks the route ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(site):
    handler = functools.partial(QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def handle(self):
        try:
            super().handle()
        except (BrokenPipeError, ConnectionResetError):  # the browser moved on before a file was sent
            pass


CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]  # fmt: skip
UNLOADED_IMAGES = """async () => {
    const images = Array.from(document.images);
    images.forEach((image) => { image.loading = "eager"; });
    await Promise.all(images.map((image) => image.decode().catch(() => null)));
    return images.filter((image) => !(image.complete && image.naturalWidth > 0)).map((image) => image.src);
}"""


@pytest.fixture(scope="module")
def browser_page(server):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing("playwright is not installed")
    if CHROMIUM is None:
        missing("no chromium on this machine (apt-get install chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        page = browser.new_page()
        page.set_default_timeout(30_000)
        page.left_localhost, page.console_errors = [], []

        def only_localhost(route):
            if route.request.url.startswith(server):
                route.continue_()
            else:
                page.left_localhost.append(route.request.url)
                route.abort()

        page.route("**/*", only_localhost)
        page.on("console", lambda message: message.type == "error" and page.console_errors.append(message.text))
        page.on("pageerror", lambda error: page.console_errors.append(str(error)))
        yield page
        browser.close()


def test_a_browser_walks_the_route_by_its_next_links(server, browser_page):
    page = browser_page
    page.goto(f"{server}/{ROUTE[0][1].removesuffix('.ipynb')}.html")
    for index, (name, path) in enumerate(ROUTE):
        assert page.url == f"{server}/{path.removesuffix('.ipynb')}.html", f"step {index + 1}: at {page.url}"
        assert page.locator(".route-here").first.inner_text().startswith(f"Route step {index + 1} of {len(ROUTE)}")
        assert page.locator(f".{website.STAMP_CLASS}").count() >= 1
        unloaded = page.evaluate(UNLOADED_IMAGES)
        assert not unloaded, f"{path}: images not loaded: {unloaded}"
        if index + 1 < len(ROUTE):
            with page.expect_navigation():
                page.locator("a.route-next").first.click()
    assert page.console_errors == [], page.console_errors
    assert page.left_localhost == [], page.left_localhost


def test_a_browser_folds_the_deep_dives_on_request(server, browser_page):
    page = browser_page
    page.goto(f"{server}/lectures/04_ddp_internals.html")
    deep_paragraph = page.locator("#course-lecture-4-s3 > p").first  # section 3 [deep dive]
    assert deep_paragraph.is_visible()
    page.locator(".core-only-switch").first.check()
    assert not deep_paragraph.is_visible()
    assert page.locator("#course-lecture-4-s1-1 > p").first.is_visible()  # section 1.1, in 1 [core]
    page.locator(".core-only-switch").first.uncheck()
    assert page.console_errors == [] and page.left_localhost == []


def test_search_finds_no_sync(server, browser_page):
    page = browser_page
    page.goto(f"{server}/search.html?q=no_sync")
    page.wait_for_selector("#search-results ul.search li", timeout=60_000)
    results = page.locator("#search-results ul.search li a").all_inner_texts()
    assert any("lab 3" in result.lower() or "Lecture 5a" in result for result in results), results
    assert page.console_errors == [] and page.left_localhost == []
