"""The one verdict type that every checker, the grader and the GPU smoke check report with.

A check is decided by what a run did, never by reading the learner's source. Its verdict is one of
three statuses:

- PASS: the behaviour was seen and is right; `evidence` says what was measured.
- FAIL: the behaviour was seen and is wrong; `evidence` says what was measured and `hint` names the
  concept and where the course teaches it (printed after the evidence).
- BLOCKED: the check could not be decided (the job died first, or another check's failure already
  explains what this one would see); `evidence` says why. A blocked check earns nothing and costs
  nothing, but a result with any BLOCKED line is not a pass.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

STATUSES = ("PASS", "FAIL", "BLOCKED")


@dataclass(frozen=True)
class Verdict:
    check: str  # the check's short name, e.g. "data-split"
    status: str  # one of STATUSES
    evidence: str  # what was measured; for BLOCKED, why nothing could be decided
    hint: str = ""  # for FAIL: the concept, and where the course teaches it
    number: int | None = None  # the check's number in its checker's list, where it has one

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"a verdict's status is one of {', '.join(STATUSES)}, not {self.status!r}")

    @property
    def passed(self) -> bool:
        return self.status == "PASS"

    def line(self, name_width: int = 15, number_width: int = 2) -> str:
        """One line: number (right-aligned in number_width), name (padded to name_width), status and
        evidence, and the hint after a FAIL."""
        number = f"{self.number:>{number_width}} " if self.number is not None else ""
        text = f"{number}{self.check:<{name_width}} {self.status:<7} {self.evidence}"
        return text + (f" -- hint: {self.hint}" if self.status == "FAIL" and self.hint else "")


def tally(verdicts: Iterable[Verdict]) -> Counter:
    """How many verdicts have each status (every status present, zero where none)."""
    counts = Counter({status: 0 for status in STATUSES})
    counts.update(verdict.status for verdict in verdicts)
    return counts


def summary(verdicts: list[Verdict]) -> tuple[str, int]:
    """The result line, and the exit status: 0 only when there is at least one check and every one passed."""
    counts = tally(verdicts)
    line = (f"result: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['BLOCKED']} blocked"
            f" of {len(verdicts)} checks")  # fmt: skip
    return line, 0 if verdicts and counts["PASS"] == len(verdicts) else 1
