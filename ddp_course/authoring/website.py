"""Build the course as a static website, from the notebooks' stored outputs (nothing is executed).

    pip install -r requirements-site.txt                  # the site's tools: not part of a learner's set-up
    python -m ddp_course.authoring.website                          # -> build/site/index.html
    python -m http.server --directory build/site 8000     # then open http://localhost:8000

The landing page is the README (its syllabus is the route); the navigation lists the 18 route steps in
order, then the optional notebook, the lab scripts and checklists as source pages, and the solutions.
Every page carries a stamp: the torch version and the commit its outputs were checked with.

The build refuses, in one line per problem, before Sphinx runs:
  - a notebook code cell stored without its outputs (`pytest --nbval` would compare nothing there);
  - a stored plot without alt text (derived from the cell's titles, axis labels and legend labels, or
    written in website/figure_alt.json, keyed by notebook and cell id);
  - a link to a file that does not exist, or a "lecture N §x" reference to a section that does not.
After Sphinx, it checks the built HTML: every image has alt text, every internal link and anchor
resolves, no page loads a script, style or font from the internet, and every page has the stamp.
Nothing is downloaded: maths is rendered to MathML at build time, and widgets become a line of text.
"""

from __future__ import annotations

import argparse
import ast
import base64
import html.parser
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlsplit

from ddp_course.authoring import budget
from ddp_course.launch import REPO_ROOT

WEBSITE_DIR = REPO_ROOT / "website"  # conf.py, the Sphinx extension, CSS/JS, figure_alt.json
OPTIONAL_NOTEBOOK = "lectures/optional_beyond_data_parallelism.ipynb"
MARKDOWN_FOLDERS = ("lectures", "labs", "solutions", "assets")
# The lab scripts are pages of their own even when no notebook links them.
SOURCE_PAGE_GLOBS = ("labs/*.py", "labs/slurm/*")
LANGUAGES = {".py": "python", ".sbatch": "bash", ".sh": "bash", ".json": "json", ".conf": "text", ".md": "markdown"}
STAMP_CLASS = "course-stamp"

# "lecture 4 §2.4", "Lecture 6, section 1", "lab 3 §4": a reference to a numbered section of another notebook.
SECTION_REFERENCE = re.compile(r"\b([Ll]ecture|[Ll]ab) (\d+[ab]?)(?: §|,? section )(\d+(?:\.\d+)?)\b")
NUMBERED_HEADING = re.compile(r"^(#{2,3}) (\d+(?:\.\d+)?)\.? ", flags=re.MULTILINE)
# Plain text only: a reference inside inline code, maths or an existing link is left alone.
PROTECTED = re.compile(r"`[^`]*`|\$[^$]*\$|\[[^\]]*\]\([^)]*\)")
MARKDOWN_LINK = re.compile(r"(\]\()([^)\s]+)(\))")
CODE = re.compile(r"```.*?```|`[^`\n]*`", flags=re.DOTALL)  # a link written inside code is an example, not a link
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


class BuildError(Exception):
    """The site cannot be built honestly; each line says what and where."""


# ---------------------------------------------------------------------------------------------------
# What the course is made of
# ---------------------------------------------------------------------------------------------------


@dataclass
class Course:
    root: Path
    route: list[tuple[str, str]]  # [(step name, notebook path)] from the README's syllabus table
    notebooks: list[str] = field(default_factory=list)  # every notebook that becomes a page
    markdown: list[str] = field(default_factory=list)  # .md files that become pages (the README is the landing page)
    sources: list[str] = field(default_factory=list)  # files shown as source pages
    folders: list[str] = field(default_factory=list)  # linked folders, shown as a list of their files

    @property
    def step_names(self) -> dict[str, str]:
        """{'lecture 4': 'lectures/04_ddp_internals.ipynb', 'lab 3': 'labs/lab3_ddp.ipynb', ...}"""
        return {name: path for name, path in self.route}


def read_course(root: Path = REPO_ROOT) -> Course:
    readme = (root / "README.md").read_text()
    course = Course(root, budget.route(readme))  # the same parser as the budget and tests/test_route.py
    solutions = sorted(str(path.relative_to(root)) for path in (root / "solutions").glob("*.ipynb"))
    course.notebooks = [path for _, path in course.route] + [OPTIONAL_NOTEBOOK] + solutions
    course.markdown = sorted(str(path.relative_to(root)) for folder in MARKDOWN_FOLDERS for path in (root / folder).glob("*.md"))
    sources = {str(path.relative_to(root)) for pattern in SOURCE_PAGE_GLOBS for path in root.glob(pattern) if path.is_file()}
    for page, text in markdown_texts(course):
        for target in link_targets(text):
            resolved = resolve(page, target)
            if resolved is None or resolved in course.notebooks or resolved in course.markdown or resolved == "README.md":
                continue
            if (root / resolved).is_dir():
                course.folders.append(resolved)
            elif (root / resolved).is_file() and resolved.endswith(".md"):  # CONTRIBUTING.md, CHANGELOG.md: pages
                course.markdown.append(resolved)
            elif (root / resolved).is_file() and not resolved.endswith(".png"):
                sources.add(resolved)
    course.sources = sorted(sources)
    course.markdown = sorted(set(course.markdown))
    course.folders = sorted(set(course.folders))
    return course


def markdown_texts(course: Course):
    """(page path, markdown text) of every page: the notebooks' markdown cells, the .md files, the README."""
    for path in course.notebooks:
        cells = json.loads((course.root / path).read_text())["cells"]
        yield path, "\n\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "markdown")
    for path in ["README.md", *course.markdown]:
        yield path, (course.root / path).read_text()


def in_code(text: str) -> list[range]:
    """The character ranges of text's code spans and fenced blocks."""
    return [range(*match.span()) for match in CODE.finditer(text)]


def link_targets(text: str) -> list[str]:
    code = in_code(text)
    return [match.group(2) for match in MARKDOWN_LINK.finditer(text) if not any(match.start() in span for span in code)]


def resolve(page: str, target: str) -> str | None:
    """The repository path a relative link points at, or None for an external link or a same-page anchor."""
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not parts.path:
        return None
    resolved = (Path(page).parent / unquote(parts.path)).as_posix()
    normal = []
    for part in resolved.split("/"):
        if part == "..":
            if not normal:
                return "../" + resolved  # above the repository: reported as missing
            normal.pop()
        elif part not in ("", "."):
            normal.append(part)
    return "/".join(normal)


# ---------------------------------------------------------------------------------------------------
# Checks before the build: stored outputs, alt text, references
# ---------------------------------------------------------------------------------------------------


def unconditional_output_calls(source: str) -> list[str]:
    """Top-level statements that always show something: print(...), display(...), plt.show(), a bare expression.

    A cell with one of these and no stored output had its output cleared. Statements inside functions,
    loops and branches are not counted (they may not run), nor a last expression ending in ';'.
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:  # IPython magics: not plain Python, judged by execution_count alone
        return []
    shown = []
    for statement in tree.body:
        if not isinstance(statement, ast.Expr):
            continue
        call = statement.value
        if isinstance(call, ast.Call):
            name = ast.unparse(call.func)
            if name in ("print", "display", "plt.show", "IPython.display.display"):
                shown.append(ast.unparse(statement)[:60])
    return shown


def stored_output_problems(path: str, notebook: dict) -> list[str]:
    problems = []
    for index, cell in enumerate(notebook["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or not source.strip():
            continue
        where = f"{path}: code cell {index} (id {cell.get('id', '?')})"
        if cell.get("execution_count") is None:
            problems.append(f"{where} has no stored outputs (never executed or cleared): "
                            f"run `python -m ddp_course.authoring.notebooks {path}`")  # fmt: skip
        elif not cell.get("outputs") and unconditional_output_calls(source):
            problems.append(f"{where} shows {unconditional_output_calls(source)[0]!r} but stores no output: "
                            f"run `python -m ddp_course.authoring.notebooks {path}`")  # fmt: skip
    return problems


FIGURE_TEXT_CALLS = {"title": "title", "set_title": "title", "suptitle": "title", "xlabel": "x axis",
                     "set_xlabel": "x axis", "ylabel": "y axis", "set_ylabel": "y axis"}  # fmt: skip
FIGURE_TEXT_KEYWORDS = {"title": "title", "xlabel": "x axis", "ylabel": "y axis", "label": "series"}
CHART_KINDS = {"plot": "line", "semilogx": "line", "semilogy": "line", "loglog": "line", "bar": "bar",
               "barh": "bar", "imshow": "grid", "hist": "histogram", "scatter": "scatter", "step": "line",
               "fill_between": "area", "broken_barh": "timeline"}  # fmt: skip


def field_words(expression: ast.AST) -> str:
    """An f-string field as words: a plain name stays (`world_size`), an expression is known only when run."""
    return ast.unparse(expression) if isinstance(expression, (ast.Name, ast.Attribute)) else "(value)"


def readable_string(node: ast.AST) -> str | None:
    """A string literal or f-string as a reader would say it: an f-string's fields become their names."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        text = node.value
    elif isinstance(node, ast.JoinedStr):
        text = "".join(part.value if isinstance(part, ast.Constant) else field_words(part.value) for part in node.values)
    else:
        return None
    text = re.sub(r"\$([^$]*)\$", r"\1", text)  # maths: S, not $S$
    text = re.sub(r"\\(?:mathrm|text)\{([^}]*)\}", r"\1", text).replace("\\", "")
    return " ".join(text.split()) or None


def derived_alt_text(source: str) -> str | None:
    """What a plotting cell's figure shows, read from its source: titles, axis labels, series labels, chart kinds.

    None when the source names nothing (the figure is then described in website/figure_alt.json).
    """
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    found: dict[str, list[str]] = {"title": [], "x axis": [], "y axis": [], "series": []}
    kinds: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name in CHART_KINDS and CHART_KINDS[name] not in kinds:
            kinds.append(CHART_KINDS[name])
        if name in FIGURE_TEXT_CALLS and node.args and (text := readable_string(node.args[0])):
            found[FIGURE_TEXT_CALLS[name]].append(text)
        for keyword in node.keywords:
            if keyword.arg in FIGURE_TEXT_KEYWORDS and (text := readable_string(keyword.value)):
                found[FIGURE_TEXT_KEYWORDS[keyword.arg]].append(text)
    if not found["title"] and not (found["x axis"] and found["y axis"]):
        return None
    parts = [f"{' and '.join(kinds) or 'a'} chart" + (f": {'; '.join(found['title'])}" if found["title"] else "")]
    for what in ("x axis", "y axis", "series"):
        if found[what]:
            parts.append(f"{what}: {', '.join(dict.fromkeys(found[what]))}")
    return "Figure, " + ". ".join(parts) + "."


def load_figure_alt(root: Path) -> dict:
    path = root / "website" / "figure_alt.json"
    return json.loads(path.read_text()) if path.exists() else {}


def image_alt_texts(path: str, notebook: dict, written: dict) -> tuple[dict[tuple[str, int], str], list[str]]:
    """{(cell id, image index in the cell): alt text} for every stored image of a notebook, and the problems."""
    alts, problems = {}, []
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] != "code":
            continue
        images = [output for output in cell.get("outputs", []) if "image/png" in output.get("data", {})]
        cell_id = cell.get("id", str(index))
        for number, _ in enumerate(images):
            text = written.get(path, {}).get(cell_id)
            text = text[number] if isinstance(text, list) and number < len(text) else text
            text = text if isinstance(text, str) else derived_alt_text("".join(cell["source"]))
            if not text:
                problems.append(f"{path}: code cell {index} (id {cell_id}) stores a plot with no alt text: give the "
                                f"figure a title and axis labels, or describe it in website/figure_alt.json")  # fmt: skip
            elif len(images) > 1:
                alts[cell_id, number] = f"{text} (figure {number + 1} of {len(images)})"
            else:
                alts[cell_id, number] = text
    return alts, problems


def section_targets(course: Course) -> dict[tuple[str, str], str]:
    """{(step name, section number): label} for every numbered section of every route notebook."""
    targets = {}
    for name, path in course.route:
        cells = json.loads((course.root / path).read_text())["cells"]
        for cell in cells:
            if cell["cell_type"] == "markdown":
                for match in NUMBERED_HEADING.finditer("".join(cell["source"])):
                    targets[name, match.group(2)] = section_label(name, match.group(2))
    return targets


def section_label(step: str, number: str) -> str:
    return f"course-{step.replace(' ', '-')}-s{number}"


def section_references(text: str) -> list[tuple[str, str, str]]:
    """[(the words as written, step name, section number)] in the plain text of a markdown cell."""
    found = []
    for plain in PROTECTED.split(text):
        for match in SECTION_REFERENCE.finditer(plain):
            found.append((match.group(0), f"{match.group(1).lower()} {match.group(2)}", match.group(3)))
    return found


# ---------------------------------------------------------------------------------------------------
# Staging: the course rewritten as a Sphinx source tree (the repository is never changed)
# ---------------------------------------------------------------------------------------------------


def source_page_name(path: str) -> str:
    return f"{path}.md"  # labs/lab3_ddp.py -> labs/lab3_ddp.py.md -> labs/lab3_ddp.py.html


def rewrite_links(text: str, page: str, course: Course, problems: list[str]) -> str:
    """Point every relative link at the page the site has for its target; report targets that do not exist."""

    code = in_code(text)

    def rewrite(match: re.Match) -> str:
        target = match.group(2)
        resolved = resolve(page, target)
        if resolved is None or any(match.start() in span for span in code):
            return match.group(0)
        parts = urlsplit(target)
        anchor = f"#{parts.fragment}" if parts.fragment else ""
        prefix = "../" * page.count("/")
        if not (course.root / resolved).exists():
            problems.append(f"{page}: link to {target}: no such file in the repository")
            return match.group(0)
        if resolved == "README.md":
            new = f"{prefix}index.md{anchor}"
        elif resolved in course.sources:
            new = f"{prefix}{source_page_name(resolved)}{anchor}"
        elif resolved in course.folders:
            new = f"{prefix}{resolved.rstrip('/')}/index.md"
        else:
            return match.group(0)
        return f"{match.group(1)}{new}{match.group(3)}"

    return MARKDOWN_LINK.sub(rewrite, text)


def link_section_references(text: str, page: str, labels: dict, problems: list[str]) -> str:
    """Turn each "lecture N §x" into a link to that section; report one that names no section."""
    pieces = []
    last = 0
    for protected in [*PROTECTED.finditer(text), None]:
        end = protected.start() if protected else len(text)
        plain = text[last:end]

        def link(match: re.Match) -> str:
            step = f"{match.group(1).lower()} {match.group(2)}"
            label = labels.get((step, match.group(3)))
            if label is None:
                problems.append(f"{page}: '{match.group(0)}' names no section of the course ({step} has no §{match.group(3)})")
                return match.group(0)
            return f"{{ref}}`{match.group(0)} <{label}>`"

        pieces.append(SECTION_REFERENCE.sub(link, plain))
        if protected:  # inside code or a link: left as written, but it must still name a real section
            for match in SECTION_REFERENCE.finditer(protected.group(0)):
                step = f"{match.group(1).lower()} {match.group(2)}"
                if (step, match.group(3)) not in labels:
                    problems.append(f"{page}: '{match.group(0)}' names no section of the course ({step} has no §{match.group(3)})")
            pieces.append(protected.group(0))
            last = protected.end()
    return "".join(pieces)


def label_numbered_headings(text: str, step: str | None) -> str:
    """Put a MyST target before each numbered heading of a route notebook, for "lecture N §x" links."""
    if step is None:
        return text
    return NUMBERED_HEADING.sub(lambda match: f"({section_label(step, match.group(2))})=\n{match.group(0)}", text)


def widget_line(output: dict) -> str:
    """What a stored widget would do, from its recorded state (the controls' descriptions), as one line."""
    state = output.get("data", {}).get("text/plain", "")
    state = "".join(state) if isinstance(state, list) else state
    controls = list(dict.fromkeys(re.findall(r"description='([^']+)'", state)))
    named = f" ({', '.join(controls)}{', ...' if state.endswith('…') else ''})" if controls else ""
    return (f"*Interactive widget, live in JupyterLab:* moving its controls{named} recomputes and redraws "
            f"its result. A static page cannot run it: open the notebook in JupyterLab to use it.")  # fmt: skip


def stage_notebook(path: str, course: Course, staging: Path, labels: dict, written_alt: dict, problems: list[str]):
    notebook = json.loads((course.root / path).read_text())
    problems.extend(stored_output_problems(path, notebook))
    alts, alt_problems = image_alt_texts(path, notebook, written_alt)
    problems.extend(alt_problems)
    steps = {notebook_path: name for name, notebook_path in course.route}
    figures = staging / "_figures"
    figures.mkdir(exist_ok=True)
    stem = path.replace("/", "-").removesuffix(".ipynb")
    for index, cell in enumerate(notebook["cells"]):
        if cell["cell_type"] == "markdown":
            text = "".join(cell["source"])
            text = rewrite_links(text, path, course, problems)
            text = link_section_references(text, path, labels, problems)
            cell["source"] = label_numbered_headings(text, steps.get(path))
            continue
        if cell["cell_type"] != "code":
            continue
        cell_id = cell.get("id", str(index))
        image_number = 0
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "image/png" in data:
                # Our own file name and alt text (MyST-NB would name it by hash and give it that as alt).
                name = f"{stem}-{cell_id}-{image_number}.png"
                (figures / name).write_bytes(base64.b64decode(data["image/png"]))
                alt = alts.get((cell_id, image_number), "")
                depth = "../" * path.count("/")
                output["data"] = {"text/markdown": f"```{{image}} {depth}_figures/{name}\n:alt: {alt}\n```\n"}
                output["metadata"] = {}
                image_number += 1
            elif WIDGET_MIME in data:
                output["data"] = {"text/markdown": widget_line(output)}
    target = staging / path
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(notebook))


def stage_markdown(path: str, course: Course, staging: Path, labels: dict, problems: list[str], name: str | None = None):
    text = (course.root / path).read_text()
    text = rewrite_links(text, path, course, problems)
    text = link_section_references(text, path, labels, problems)
    target = staging / (name or path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def stage_source(path: str, course: Course, staging: Path):
    target = staging / path
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(course.root / path, target)
    language = LANGUAGES.get(Path(path).suffix, "text")
    fence = "````"
    page = (f"# `{path}`\n\nThe file as it is in the repository ({(course.root / path).stat().st_size:,} bytes).\n\n"
            f"{fence}{{literalinclude}} {Path(path).name}\n:language: {language}\n:linenos:\n{fence}\n")  # fmt: skip
    (staging / source_page_name(path)).write_text(page)


def stage_folder(path: str, course: Course, staging: Path):
    files = sorted(item for item in (course.root / path).rglob("*") if item.is_file())
    rows = "\n".join(f"- `{item.relative_to(course.root / path)}` ({item.stat().st_size:,} bytes)" for item in files)
    target = staging / path / "index.md"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(f"# `{path}/`\n\nA folder of recorded data the notebooks read; its files:\n\n{rows}\n")


def notebook_title(course: Course, path: str) -> str:
    cells = json.loads((course.root / path).read_text())["cells"]
    first = next(cell for cell in cells if cell["cell_type"] == "markdown")
    heading = next(line for line in "".join(first["source"]).splitlines() if line.startswith("# "))
    return heading[2:].strip()


def deep_dive_steps(readme: str) -> set[str]:
    """Route steps the syllabus marks as a whole deep dive ("(deep dive" in the row: labs 1, 2, 6, 7, 8, 9 and 10)."""
    rows = re.findall(r"^\| \d+ \| ((?:lecture|lab) \d+\w?) \|(.*)$", readme, flags=re.MULTILINE)
    return {name for name, rest in rows if "(deep dive" in rest}


def toctree(caption: str, entries: list[str]) -> str:
    lines = "\n".join(entries)
    return f"\n```{{toctree}}\n:caption: {caption}\n:hidden:\n:maxdepth: 1\n\n{lines}\n```\n"


def entry(title: str, path: str) -> str:
    title = title.replace("<", "(").replace(">", ")").replace("`", "")  # a toctree title is plain text
    return f"{title} <{Path(path).with_suffix('').as_posix() if path.endswith(('.ipynb', '.md')) else path}>"


def stage_landing_page(course: Course, staging: Path, labels: dict, problems: list[str]):
    readme = (course.root / "README.md").read_text()
    deep = deep_dive_steps(readme)
    route = [entry(f"{index}. {name}{' (deep dive)' if name in deep else ''}: {notebook_title(course, path).split(': ', 1)[-1]}", path)
             for index, (name, path) in enumerate(course.route, start=1)]  # fmt: skip
    solutions = [path for path in course.notebooks if path.startswith("solutions/")]
    lab_pages = [path for path in course.sources if path.startswith("labs/")] + [path for path in course.markdown if path.startswith("labs/")]
    other_sources = [path for path in course.sources if not path.startswith("labs/")]
    solution_pages = solutions + [path for path in course.markdown if path.startswith("solutions/")]
    more = [path for path in course.markdown if path.startswith(("lectures/", "assets/")) or "/" not in path] + other_sources
    text = rewrite_links(readme, "README.md", course, problems)
    text = link_section_references(text, "README.md", labels, problems)
    text += toctree("The route", route)
    text += toctree("Optional", [entry(notebook_title(course, OPTIONAL_NOTEBOOK), OPTIONAL_NOTEBOOK)])
    text += toctree("Lab scripts and checklists", [entry(path, source_page_name(path) if path in course.sources else path) for path in lab_pages])
    text += toctree("Solutions", [entry(path, source_page_name(path) if path in course.sources else path) for path in solution_pages]
                    + [entry(f"{path}/", f"{path}/index.md") for path in course.folders])  # fmt: skip
    text += toctree("Reference", [entry(path, source_page_name(path) if path in course.sources else path) for path in more])
    (staging / "index.md").write_text(text)


@dataclass
class Stamp:
    torch: str
    commit: str
    checked: bool  # True only when the caller says `pytest --nbval` passed on this tree (as .ci/run does)

    def html(self) -> str:
        if self.checked:
            said = "re-checked by <code>pytest --nbval</code>, which passed before this build"
        else:
            said = "<strong>not re-checked by this build</strong> (run <code>pytest --nbval</code>)"
        return (
            f'<p class="{STAMP_CLASS}">Stored outputs as of commit <code>{self.commit}</code> with torch '
            f"<code>{self.torch}</code>; {said}. Nothing on this site was executed to build it.</p>"
        )


def current_stamp(root: Path, checked: bool) -> Stamp:
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        commit += " (uncommitted changes)" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown (not a git checkout)"
    return Stamp(torch_version, commit, checked)


def stage(course: Course, staging: Path, stamp: Stamp) -> None:
    """Write the Sphinx source tree; raise BuildError listing every problem found on the way."""
    problems: list[str] = []
    labels = section_targets(course)
    written_alt = load_figure_alt(course.root)
    for path in course.notebooks:
        stage_notebook(path, course, staging, labels, written_alt, problems)
    for path in course.markdown:
        stage_markdown(path, course, staging, labels, problems)
    for path in course.sources:
        stage_source(path, course, staging)
    for path in course.folders:
        stage_folder(path, course, staging)
    shutil.copytree(course.root / "assets", staging / "assets", dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.md"))
    stage_landing_page(course, staging, labels, problems)
    readme = (course.root / "README.md").read_text()
    site = {
        "route": [{"step": name, "doc": path.removesuffix(".ipynb")} for name, path in course.route],
        "deep_dive_steps": sorted(deep_dive_steps(readme)),
        "stamp_html": stamp.html(),
        "diagram_alt": diagram_alt_texts(course.root),
    }
    (staging / "_course_site.json").write_text(json.dumps(site, indent=1))
    if problems:
        raise BuildError("\n".join(dict.fromkeys(problems)))


# ---------------------------------------------------------------------------------------------------
# The diagrams: alt text from the description committed beside each PNG (assets/NAME.json)
# ---------------------------------------------------------------------------------------------------


def describe_torchrun_processes(description: dict) -> str:
    nodes = "; ".join(
        f"{node['name']} runs the {node['agent']}, which starts "
        + ", ".join(f"rank {worker['env']['RANK']} on {worker['device']} (LOCAL_RANK {worker['env']['LOCAL_RANK']})" for worker in node["workers"])
        for node in description["nodes"]
    )  # fmt: skip
    return (
        f"Diagram of what `{description['command']}` starts: {nodes}. The agents meet at a "
        f"{description['rendezvous']}; the workers form {description['process_group']}. {description['note']}."
    )


def describe_ddp_backward(description: dict) -> str:
    buckets = "; ".join(f"bucket {index}: {', '.join(bucket)}" for index, bucket in enumerate(description["buckets"]))
    return (
        f"Diagram of DDP's backward in four lanes ({'; '.join(description['lanes'])}). Backward reaches the "
        f"layers in the order {', '.join(description['backward_order'])}; the buckets are {buckets}; each bucket's "
        f"all-reduce is launched as soon as its last gradient is ready. {description['end']}. "
        f"Model: {description['model']}; {description['ddp_flags']}; {description['note']}."
    )


def describe_failure_decision_tree(description: dict) -> str:
    branches = []
    for branch in description["branches"]:
        leaves = "; ".join(f"{' '.join(leaf['symptom'].split())}: {' '.join(leaf['tool'].split())} (shown in {leaf['shown']})"
                           for leaf in branch["leaves"])  # fmt: skip
        branches.append(f"{branch['failure']} ({' '.join(branch['test'].split())}): {leaves}")
    return "Decision tree: is the failure a hang, a wrong result or a crash? " + " | ".join(branches)


def describe_sharded_memory_timeline(description: dict) -> str:
    parts = []
    for name, series in description["series"].items():
        totals = [sum(values) for values in zip(*series["mib"].values())]
        peak = max(totals)
        parts.append(f"{name}: peak {peak:.1f} MiB at sample {totals.index(peak)} of {len(totals)}, "
                     f"{totals[0]:.1f} MiB before the step")  # fmt: skip
    phases = ", ".join(f"{phase} from sample {start}" for phase, start in sorted(description["phase_starts"].items(), key=lambda item: item[1]))
    return (
        f"Stacked-area chart of the bytes one rank holds over one AdamW step ({', '.join(description['categories'])}), "
        f"measured; phases: {phases}. " + "; ".join(parts) + "."
    )


def describe_rank_timeline(description: dict) -> str:
    panels = []
    for panel in description["panels"].values():
        ranks = []
        for rank, bars in panel["bars"].items():
            milliseconds = {category: 0.0 for category in description["categories"]}
            for category, _start, duration in bars:
                milliseconds[category] += duration
            total = sum(milliseconds.values())
            shares = ", ".join(f"{category} {100 * spent / total:.0f} %" for category, spent in milliseconds.items())
            facts = panel["facts"][rank]
            ranks.append(
                f"rank {rank} ({total:.0f} ms: {shares}; intra-op threads: {facts['threads']}, "
                f"all-reduce calls per step: {facts['allreduce_calls_per_step']}, buckets: {facts['buckets_per_round']})"
            )
        panels.append(f"{panel['title']}: " + "; ".join(ranks))
    steps = description["steps"]
    return (
        f"Timeline chart, one bar per rank, of steps {steps[0]} to {steps[-1]}, each rank's time coloured by "
        f"{', '.join(description['categories'])}, measured. " + " | ".join(panels) + "."
    )


DIAGRAM_DESCRIBERS = {
    "torchrun_processes": describe_torchrun_processes,
    "ddp_backward": describe_ddp_backward,
    "failure_decision_tree": describe_failure_decision_tree,
    "sharded_memory_timeline": describe_sharded_memory_timeline,
    "lab10_timeline": describe_rank_timeline,
}


def diagram_alt_texts(root: Path) -> dict[str, str]:
    """{'assets/NAME.png': alt text} for every diagram, from its committed description; a diagram without a describer fails."""
    texts, problems = {}, []
    for record_path in sorted((root / "assets").glob("*.json")):
        record = json.loads(record_path.read_text())
        describer = DIAGRAM_DESCRIBERS.get(record_path.stem)
        if describer is None:
            problems.append(f"assets/{record_path.name}: no alt-text describer in ddp_course/authoring/website.py (DIAGRAM_DESCRIBERS)")
            continue
        texts[f"assets/{record_path.stem}.png"] = f"{record['title']}. {describer(record['description'])}"
    if problems:
        raise BuildError("\n".join(problems))
    return texts


# ---------------------------------------------------------------------------------------------------
# Checks after the build: alt text, links and anchors, nothing from the internet, the stamp
# ---------------------------------------------------------------------------------------------------

FILE_NAME_ALT = re.compile(r"^\S+\.(png|jpe?g|gif|svg|webp)$|^[0-9a-f]{16,}(\.\w+)?$", flags=re.IGNORECASE)
REMOTE = re.compile(r"^(https?:)?//", flags=re.IGNORECASE)
SKIPPED_PAGES = ("_static/", "_sources/", "_images/", "_downloads/")


class PageParser(html.parser.HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.images: list[tuple[str, str | None]] = []  # (src, alt)
        self.resources: list[str] = []  # what the page loads: scripts, styles, fonts, images, frames
        self.stamped = False

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        for key in ("id", "name"):
            if attributes.get(key):
                self.ids.add(attributes[key])
        if STAMP_CLASS in (attributes.get("class") or "").split():
            self.stamped = True
        if tag == "a" and attributes.get("href"):
            self.links.append(attributes["href"])
        if tag == "img":
            self.images.append((attributes.get("src", ""), attributes.get("alt")))
        for key in ("src", "srcset", "data"):
            if attributes.get(key) and tag != "a":
                self.resources.append(attributes[key])
        if (
            tag == "link"
            and attributes.get("href")
            and set((attributes.get("rel") or "").split()) & {"stylesheet", "preload", "icon", "modulepreload", "prefetch"}
        ):
            self.resources.append(attributes["href"])


def parse_page(path: Path) -> PageParser:
    parser = PageParser()
    parser.feed(path.read_text(errors="replace"))
    return parser


def check_site(out: Path) -> list[str]:
    """Every problem of a built site, one line each: empty when it is fit to publish."""
    pages = {path: parse_page(path) for path in sorted(out.rglob("*.html")) if not str(path.relative_to(out)).startswith(SKIPPED_PAGES)}
    problems = []
    for path, page in pages.items():
        name = path.relative_to(out).as_posix()
        if not page.stamped:
            problems.append(f"{name}: no stamp (torch version and commit)")
        for src, alt in page.images:
            if not alt or len(alt.split()) < 3 or FILE_NAME_ALT.match(alt.strip()) or alt.strip() == Path(src).name:
                # a file name, a hash, "None" or "figure" says nothing of what the figure shows
                problems.append(f"{name}: image {src} has no alt text (alt={alt!r})")
        for resource in page.resources:
            if REMOTE.match(resource):
                problems.append(f"{name}: loads {resource} from the internet")
        for link in page.links:
            problem = dead_link(out, path, link, pages)
            if problem:
                problems.append(f"{name}: {problem}")
    for css in sorted(out.rglob("*.css")):
        for url in re.findall(r"url\(\s*['\"]?((?:https?:)?//[^'\")]+)", css.read_text(errors="replace")):
            problems.append(f"{css.relative_to(out).as_posix()}: loads {url} from the internet")
        for url in re.findall(r"@import\s+['\"]((?:https?:)?//[^'\"]+)", css.read_text(errors="replace")):
            problems.append(f"{css.relative_to(out).as_posix()}: imports {url} from the internet")
    return problems


def dead_link(out: Path, page: Path, link: str, pages: dict[Path, PageParser]) -> str | None:
    parts = urlsplit(link)
    if parts.scheme or parts.netloc or link.startswith(("javascript:", "mailto:")):
        return None
    target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
    if target.is_dir():
        target = target / "index.html"
    if not target.is_file() or out.resolve() not in target.resolve().parents:
        return f"dead link {link} (no such file on the site)"
    fragment = unquote(parts.fragment)
    if fragment and target.suffix == ".html":
        parsed = pages.get(target) or next((parser for key, parser in pages.items() if key.resolve() == target.resolve()), None)
        parsed = parsed or parse_page(target)
        if fragment not in parsed.ids:
            return f"dead link {link} (no anchor #{fragment} in {target.name})"
    return None


# ---------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------


def build(out: Path, root: Path = REPO_ROOT, checked: bool = False, jobs: str = "auto") -> Path:
    """Build the site into `out` (replaced); raise BuildError with every problem found."""
    try:
        from sphinx.cmd.build import build_main
    except ImportError as missing:
        raise BuildError(f"the site's tools are not installed ({missing.name}): pip install -r requirements-site.txt") from None
    course = read_course(root)
    with tempfile.TemporaryDirectory(prefix="course-site-src-") as staging_dir:
        staging = Path(staging_dir)
        stage(course, staging, current_stamp(root, checked))
        if out.exists():
            shutil.rmtree(out)
        doctrees = staging / "_doctrees"
        # -W: a Sphinx warning (a reference or anchor it cannot resolve, a bad image) fails the build.
        arguments = ["-b", "html", "-q", "-W", "--keep-going", "-j", jobs, "-c", str(root / "website"),
                     "-d", str(doctrees), str(staging), str(out)]  # fmt: skip
        status = build_main(arguments)
        if status != 0:
            raise BuildError(f"Sphinx failed (exit {status}); its warnings are above")
    problems = check_site(out)
    if problems:
        raise BuildError("\n".join(problems))
    return out


def site_size(out: Path) -> int:
    return sum(path.stat().st_size for path in out.rglob("*") if path.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "site", help="the site's folder (replaced); default build/site")
    parser.add_argument("--after-nbval", action="store_true",
                        help="say in the stamp that `pytest --nbval` passed on this tree: only right after it did (.ci/run)")  # fmt: skip
    parser.add_argument("--jobs", default="auto", help="Sphinx's parallel readers (default: auto, one per core)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        out = build(args.out.resolve(), checked=args.after_nbval, jobs=args.jobs)
    except BuildError as error:
        for line in str(error).splitlines():
            print(f"website: {line}", file=sys.stderr)
        return 1
    pages = sum(1 for path in out.rglob("*.html") if not str(path.relative_to(out)).startswith(SKIPPED_PAGES))
    print(f"website: {pages} pages, {site_size(out) / 2**20:.1f} MiB in {out} ({time.perf_counter() - started:.0f} s); "
          f"serve it with: python -m http.server --directory {out} 8000")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
