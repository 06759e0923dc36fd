"""Every cross-reference names a section that exists: "lecture 4 §2.5", "lab 3, section 4", "L6 §1",
'lecture 6, "Determinism"', and, inside a notebook, "section 7.2" (its own headings).

A notebook's sections are its numbered `## N.` and `### N.M` headings. Cutting or renumbering one
leaves every sentence that pointed to it dangling, and nothing else notices: the text still reads, and
nbval compares no markdown. This test reads the notebooks (markdown and code), the README, the
checklist, the lab scripts, the solutions, the course package and the lectures' scripts, and resolves
each reference against the headings that exist. It also fails on a lecture that does not exist (the
"lecture 5" that the split into 5a and 5b left behind).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddp_course.launch import REPO_ROOT

# --- the sections that exist ------------------------------------------------------------------

NUMBERED_HEADING = re.compile(r"^#{2,3} (\d+(?:\.\d+)*)\.?\s", re.MULTILINE)  # "## 3. Title", "### 2.7 Title"
ANY_HEADING = re.compile(r"^#{1,4} (.+)$", re.MULTILINE)


@dataclass(frozen=True)
class Notebook:
    """What a reference can name in one lecture or lab sheet: its section numbers and heading titles."""

    name: str  # "lecture 4", "lab 3"
    sections: frozenset[str]
    titles: tuple[str, ...]


def markdown_of(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "\n\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "markdown")


def notebook_of(name: str, path: Path) -> Notebook:
    markdown = markdown_of(path)
    return Notebook(name, frozenset(NUMBERED_HEADING.findall(markdown)), tuple(ANY_HEADING.findall(markdown)))


def course_notebooks(root: Path = REPO_ROOT) -> dict[str, Notebook]:
    """{"lecture 4": ..., "lecture 5a": ..., "lab 3": ...} from the file names (04_*.ipynb, lab3_*.ipynb)."""
    notebooks = {}
    for path in sorted((root / "lectures").glob("[0-9]*.ipynb")):
        name = "lecture " + re.match(r"0*(\d+[ab]?)_", path.name).group(1)
        notebooks[name] = notebook_of(name, path)
    for path in sorted((root / "labs").glob("lab*.ipynb")):
        name = "lab " + re.match(r"lab(\d+)_", path.name).group(1)
        notebooks[name] = notebook_of(name, path)
    return notebooks


# --- the references ---------------------------------------------------------------------------

NUMBER = r"\d+(?:\.\d+)*"
ITEM = rf"{NUMBER}(?:\s*[-–]\s*{NUMBER})?"  # "2.3" or a range "2-3"
# "2.3"; "2, 3 and 5"; "1.2 and §5.2"; "7-8". A list goes on after a comma only if it ends in "and N".
NUMBERS = rf"(?P<numbers>{ITEM}(?:(?:\s*,\s*§?\s*{ITEM})*\s*,?\s+and\s+§?\s*{ITEM})?)"
LINK_END = r"(?:\]\([^)\s]*\))?"  # "[lecture 4](04_ddp_internals.ipynb), section 2.3"
NAMED = rf"(?:\b(?P<kind>lecture|lab)\s+|\b(?-i:L)(?=\d))(?P<id>\d+[ab]?)\b{LINK_END}(?:'s)?,?\s*"  # L6: lecture 6
SECTION_REFERENCE = re.compile(rf"{NAMED}(?:§\s*|sections?\s+){NUMBERS}(?![\w.]*\d)", re.IGNORECASE)
TITLE_REFERENCE = re.compile(rf'\b(?P<kind>lecture|lab)\s+(?P<id>\d+[ab]?){LINK_END},\s+"(?P<title>[^"]+)"', re.IGNORECASE)
OWN_SECTION_REFERENCE = re.compile(rf"\bsections?\s+{NUMBERS}(?![\w.]*\d)", re.IGNORECASE)
# A paper's section, cited after its year: (Goyal et al. 2017, section 2.1); 2021, "Title", section 2.2.
CITATION_BEFORE = re.compile(r"\b(?:19|20)\d\d[a-z]?\)?,\s*(?:\"[^\"]*\",\s*)?$")
LECTURE_MENTION = re.compile(r"\blectures?\s+(?P<ids>\d+[ab]?(?:(?:\s*,\s*\d+[ab]?)*\s*,?\s+and\s+\d+[ab]?)?)\b(?!\.\d)", re.IGNORECASE)
# Names that contain a lecture number but are not references to a notebook.
NOT_REFERENCES = {
    "lecture 5 reference run": "the label of solutions/lecture5_reference/, the run lecture 5a reads",
}


def numbers_in(text: str) -> list[str]:
    """Each section a list names; a range of whole numbers names every one between."""
    named = []
    for item in re.findall(ITEM, text):
        ends = [part.strip() for part in re.split(r"[-–]", item)]
        if len(ends) == 2 and all(end.isdigit() for end in ends):
            named += [str(n) for n in range(int(ends[0]), int(ends[1]) + 1)]
        else:
            named += ends
    return named


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def broken_references(text: str, where: str, notebooks: dict[str, Notebook], own: Notebook | None = None) -> list[str]:
    """One line per reference in text that names no existing lecture, lab or section.

    own: the notebook whose headings a bare "section x" names (None: bare references are not checked).
    """
    for phrase in NOT_REFERENCES:
        text = re.sub(re.escape(phrase), lambda match: " " * len(match.group(0)), text, flags=re.IGNORECASE)
    broken = []

    def target(match: re.Match) -> tuple[str, Notebook | None]:
        kind = "lecture" if match.group("kind") is None else match.group("kind").lower()
        name = f"{kind} {match.group('id').lower()}"
        return name, notebooks.get(name)

    consumed = list(text)
    for match in SECTION_REFERENCE.finditer(text):
        consumed[match.start() : match.end()] = " " * (match.end() - match.start())
        name, notebook = target(match)
        quoted = " ".join(match.group(0).split())
        if notebook is None:
            broken.append(f"{where}:{line_of(text, match.start())}: '{quoted}': there is no {name}")
            continue
        missing = [number for number in numbers_in(match.group("numbers")) if number not in notebook.sections]
        if missing:
            broken.append(f"{where}:{line_of(text, match.start())}: '{quoted}': {name} has no section "
                          f"{', '.join(missing)} (it has {', '.join(sorted(notebook.sections, key=section_order))})")  # fmt: skip
    for match in TITLE_REFERENCE.finditer(text):
        name, notebook = target(match)
        if notebook is None or not any(match.group("title").lower() in title.lower() for title in notebook.titles):
            broken.append(f'{where}:{line_of(text, match.start())}: {name} has no heading "{match.group("title")}"')
    unconsumed = "".join(consumed)
    if own is not None:
        for match in OWN_SECTION_REFERENCE.finditer(unconsumed):
            if CITATION_BEFORE.search(unconsumed[max(0, match.start() - 200) : match.start()]):
                continue
            missing = [number for number in numbers_in(match.group("numbers")) if number not in own.sections]
            if missing:
                quoted = " ".join(match.group(0).split())
                broken.append(f"{where}:{line_of(text, match.start())}: '{quoted}': {own.name} has no section {', '.join(missing)}")
    lectures = {name for name in notebooks if name.startswith("lecture ")}
    for match in LECTURE_MENTION.finditer(text):
        for lecture_id in re.findall(r"\d+[ab]?", match.group("ids")):
            if f"lecture {lecture_id.lower()}" not in lectures:
                quoted = " ".join(match.group(0).split())
                broken.append(f"{where}:{line_of(text, match.start())}: '{quoted}': there is no lecture {lecture_id}")
    return broken


def section_order(number: str) -> tuple[int, ...]:
    return tuple(int(part) for part in number.split("."))


# --- what is read -----------------------------------------------------------------------------

TEXT_FILES = ("README.md", "lectures/README.md", "solutions/README.md", "labs/*.md", "labs/*.py", "labs/slurm/*",
              "solutions/*.md", "solutions/*.py", "ddp_course/**/*.py", "lectures/scripts/*.py")  # fmt: skip
NOTEBOOK_FOLDERS = ("lectures", "labs", "solutions")


def own_notebook(path: Path, notebooks: dict[str, Notebook]) -> Notebook:
    """The notebook a bare "section x" in path names: its own, or its lecture's for a solutions notebook."""
    lecture = REPO_ROOT / "lectures" / path.name.replace("_solutions", "")
    if path.parent.name == "solutions" and lecture.is_file():
        return notebook_of(lecture.name, lecture)
    return notebook_of(path.name, path)


def every_text() -> list[tuple[str, str, Path | None]]:
    """(text, where, notebook path or None) for every file the course's references live in; a notebook
    contributes each cell, so that a broken reference is reported with its cell."""
    texts = []
    for pattern in TEXT_FILES:
        for path in sorted(REPO_ROOT.glob(pattern)):
            if path.is_file():
                texts.append((path.read_text(), str(path.relative_to(REPO_ROOT)), None))
    for folder in NOTEBOOK_FOLDERS:
        for path in sorted((REPO_ROOT / folder).glob("*.ipynb")):
            for index, cell in enumerate(json.loads(path.read_text())["cells"]):
                texts.append(("".join(cell["source"]), f"{path.relative_to(REPO_ROOT)} cell {index}", path))
    return texts


# --- the tests --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def notebooks():
    return course_notebooks()


def test_the_headings_are_found(notebooks):
    assert {"lecture 1", "lecture 4", "lecture 5a", "lecture 5b", "lecture 7", "lab 3", "lab 9"} <= set(notebooks)
    assert "lecture 5" not in notebooks
    assert {"1", "1.1", "1.2", "2.3", "2.7", "7"} <= notebooks["lecture 4"].sections


def test_every_reference_names_a_section_that_exists(notebooks):
    owners: dict[Path, Notebook] = {}
    broken = []
    for text, where, path in every_text():
        if path is not None and path not in owners:
            owners[path] = own_notebook(path, notebooks)
        own = None if path is None else owners[path]
        broken += broken_references(text, where, notebooks, own)
    assert not broken, "dangling references:\n" + "\n".join(broken)


@pytest.mark.parametrize(
    "planted",
    [
        "the device (lecture 4 §1.4)",  # the checklist's old row 2: lecture 4 has 1.1 and 1.2 only
        "no parameters after wrapping: lecture 4, section 2.8",
        "see [lecture 4](04_ddp_internals.ipynb), section 9",
        "the leaves marked L6 §10",  # lecture 6 ends with section 9
        "lecture 1 §2-11",  # a range whose end is gone
        "lecture 4 §1.2 and §5.9",  # the second of a list
        "Lecture 5 measures what overlap and buckets are worth",  # split into 5a and 5b
        "a preview of lectures 5a, 5 and 6",
        'lecture 6, "Checkpoints for crashed jobs"',
        "lab 10 §9",  # its sheet has sections 1-6
    ],
)
def test_a_planted_broken_reference_is_reported(notebooks, planted):
    broken = broken_references(f"Some prose.\n{planted}.\n", "planted.md", notebooks)
    assert len(broken) == 1 and broken[0].startswith("planted.md:2: "), broken


@pytest.mark.parametrize(
    "sound",
    [
        "lecture 1 §4; lecture 4 §1.2 and §5.2",
        "lecture 4, section 2.3, the rules' one home",
        "[lecture 6\n§1](../lectures/06_debugging_fault_tolerance.ipynb)",
        "lecture 1 §2-3",
        "sections 2, 3 and 5 of the paper (Higham 2002, §4.2)",  # bare: not checked outside a notebook
        "L6 §1 uneven, L3 §5",
        'lecture 6, "Checkpoints for resumable jobs"',
        "lectures 5a, 5b and 6",
        "the lecture 5 reference run",
        "lab 6, part 3",  # a lab script's part, not a sheet's section
    ],
)
def test_a_sound_reference_is_not_reported(notebooks, sound):
    assert broken_references(sound, "sound.md", notebooks) == []


def test_a_bare_section_is_read_against_its_own_notebook(notebooks):
    own = notebooks["lecture 6"]
    assert broken_references("the interval (section 7.2's model)", "cell", notebooks, own) == []
    assert broken_references("the interval (section 10's model)", "cell", notebooks, own) == ["cell:1: 'section 10': lecture 6 has no section 10"]
    # A named reference is read against the notebook it names, not against its own.
    assert broken_references("lecture 4, section 2.7", "cell", notebooks, own) == []
