"""The repository stands on its own: one version everywhere it is named, and no file that points to notes
kept outside the repository (a learner's clone has only what is in it)."""

import os
import re

from ddp_course.launch import REPO_ROOT

# Folders that are not the course's own files: a virtual environment inside the clone, caches, lab outputs.
NOT_OURS = {
    ".git", ".venv", "venv", "__pycache__", ".ipynb_checkpoints", ".pytest_cache", "build", "data", "runs", "checkpoints",
}  # fmt: skip
TEXT_SUFFIXES = {".py", ".md", ".ipynb", ".cfg", ".ini", ".toml", ".cff", ".txt", ".sbatch", ".conf"}
# The maintainers' private design notes, by the names they went by. Written so that this file does not match.
OUTSIDE_NOTES = re.compile(r"COURSE[_ ]GUIDE|course[ ]guide|\.\./shared/|/work[/]shared", re.IGNORECASE)


def text(name):
    return (REPO_ROOT / name).read_text()


def latest_release():
    """(version, date) of CHANGELOG.md's first "## X.Y.Z - YYYY-MM-DD" heading."""
    match = re.search(r"^## (\d+\.\d+\.\d+) - (\d{4}-\d{2}-\d{2})$", text("CHANGELOG.md"), re.MULTILINE)
    assert match, "CHANGELOG.md has no release heading '## X.Y.Z - YYYY-MM-DD'"
    return match.groups()


def test_the_changelog_keeps_an_unreleased_section_above_the_latest_release():
    changelog = text("CHANGELOG.md")
    version, _ = latest_release()
    assert 0 <= changelog.find("\n## Unreleased\n") < changelog.find(f"\n## {version} - ")


def test_pyproject_citation_and_readme_name_the_changelogs_latest_version():
    version, date = latest_release()
    assert re.search(rf'^version = "{re.escape(version)}"', text("pyproject.toml"), re.MULTILINE)
    citation = text("CITATION.cff")
    assert re.search(rf"^version: {re.escape(version)}$", citation, re.MULTILINE)
    assert re.search(rf"^date-released: {date}$", citation, re.MULTILINE)
    assert re.search(r"^cff-version: 1\.2\.0$", citation, re.MULTILINE)
    assert f"version {version}" in text("README.md")


def course_text_files():
    for folder, subfolders, files in os.walk(REPO_ROOT):
        subfolders[:] = [name for name in subfolders if name not in NOT_OURS and not name.endswith(".egg-info")]
        for name in files:
            path = os.path.join(folder, name)
            if os.path.splitext(name)[1] in TEXT_SUFFIXES or path.endswith(os.path.join(".ci", "run")):
                yield path


def test_no_file_points_to_notes_outside_the_repository():
    found = []
    for path in course_text_files():
        with open(path, encoding="utf-8", errors="replace") as file:
            for number, line in enumerate(file, 1):
                if OUTSIDE_NOTES.search(line):
                    found.append(f"{os.path.relpath(path, REPO_ROOT)}:{number}: {line.strip()[:100]}")
    assert not found, "state the fact here or point to CONTRIBUTING.md instead:\n" + "\n".join(found)


def test_the_scan_reads_the_course_and_would_see_a_reference():
    scanned = {os.path.relpath(path, REPO_ROOT) for path in course_text_files()}
    assert {"README.md", "CONTRIBUTING.md", os.path.join(".ci", "run"), os.path.join("tests", "conftest.py")} <= scanned
    assert os.path.join("lectures", "01_data_parallelism.ipynb") in scanned
    assert not any(part in NOT_OURS for path in scanned for part in path.split(os.sep))
    assert OUTSIDE_NOTES.search("# see the " + "COURSE" + "_GUIDE, section 6")
