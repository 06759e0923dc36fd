"""What the three checkers' command lines share (labs/lab3_convert_check.py, labs/lab4_check.py,
labs/lab10_check.py): the script argument and --show-output, finding the script from any folder, and
printing the verdicts with the result line. Each checker's main() adds its own options and decides.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from ddp_course.checking.verdict import Verdict, summary
from ddp_course.cli import CourseArgumentParser
from ddp_course.launch import REPO_ROOT


def checker_parser(prog: str, description: str, default_script: str, script_help: str) -> CourseArgumentParser:
    """A parser with the arguments every checker takes: the script (optional, with a default) and --show-output."""
    parser = CourseArgumentParser(prog=prog, description=description)
    parser.add_argument("script", nargs="?", default=default_script, help=script_help)
    parser.add_argument("--show-output", action="store_true", help="also print the script's stdout and stderr")
    return parser


def script_to_check(parser: CourseArgumentParser, given: str, missing_hint: str = "") -> Path:
    """The absolute path of the script to check. A relative path that does not exist here is read from the
    repository's root, so that the default (labs/...) works from any folder; a missing script is one line
    and exit 2 (parser.error), with missing_hint appended (how to make it)."""
    script = Path(given)
    if not script.is_absolute() and not script.exists():
        script = REPO_ROOT / script
    if not script.is_file():
        parser.error(f"no such script: {given}{missing_hint}")
    return script.resolve()


def print_verdicts(verdicts: Iterable[Verdict], **line_format) -> int:
    """Print one line per check, then the result line; the exit status: 0 only when every check passed."""
    verdicts = list(verdicts)
    for verdict in verdicts:
        print(verdict.line(**line_format))
    result, status = summary(verdicts)
    print(result)
    return status
