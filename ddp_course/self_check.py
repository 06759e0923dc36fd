"""Self-checks: a question at the end of a core notebook, answered in the notebook, with feedback at once.

A notebook's last core section asks one question whose answer is a number (or a short word), then runs

    answer = None  # your answer
    self_check(LECTURE_3_SELF_CHECK, answer)

and `self_check` prints one line: "not answered yet" while `answer` is None, "correct" with the reason
when it matches, or "not yet" with a hint that names the section to reread. A number matches within
the question's relative tolerance (answers from a reader's own arithmetic are rounded); a word matches
case-insensitively, ignoring surrounding spaces. Each lecture keeps its questions in its own
`ddp_course/lectureNN_checks.py`, beside its exercise checks, so the answer is one click away but not
on the page.

Where the learner ran something, the expected value can come from their own run: build the Question in
the notebook from what the cell printed (`Question(..., expected=measured)`), and the check compares
their prediction with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Question:
    """One self-check: its name in the printed line, the expected answer, how close a number must be,
    what a right answer shows (printed with "correct") and the hint for a wrong one (names a section)."""

    name: str
    expected: float | str
    why: str
    hint: str
    relative_tolerance: float = 0.02

    def matches(self, answer) -> bool:
        if isinstance(self.expected, str):
            return isinstance(answer, str) and answer.strip().lower() == self.expected.strip().lower()
        if isinstance(answer, bool) or not isinstance(answer, (int, float)):
            return False
        return math.isclose(float(answer), float(self.expected), rel_tol=self.relative_tolerance)


def verdict(question: Question, answer) -> str:
    """The one line self_check prints for this answer."""
    if answer is None:
        return f"{question.name}: not answered yet - set `answer` above and run this cell again"
    if question.matches(answer):
        return f"{question.name}: correct - {question.why}"
    if not isinstance(question.expected, str) and (isinstance(answer, bool) or not isinstance(answer, (int, float))):
        return f"{question.name}: not yet - the answer is a number (got {answer!r})"
    return f"{question.name}: not yet - {question.hint}"


def self_check(question: Question, answer) -> None:
    print(verdict(question, answer))
