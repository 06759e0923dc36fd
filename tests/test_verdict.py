"""The one verdict type: its line, its tally and the exit status of a result."""

import pytest

from ddp_course.checking.verdict import Verdict, summary, tally


def test_a_fail_line_carries_its_evidence_and_its_hint():
    verdict = Verdict("data-split", "FAIL", "rank 1 read 12 samples rank 0 read", hint="lecture 3 section 2", number=1)
    assert verdict.line() == " 1 data-split      FAIL    rank 1 read 12 samples rank 0 read -- hint: lecture 3 section 2"


def test_pass_and_blocked_lines_carry_no_hint():
    assert "hint" not in Verdict("clean-exit", "PASS", "status 0", hint="never shown").line()
    assert "hint" not in Verdict("clean-exit", "BLOCKED", "the job died first", hint="never shown").line()


def test_an_unknown_status_is_refused():
    with pytest.raises(ValueError, match="PASS, FAIL, BLOCKED"):
        Verdict("x", "OK", "")


def test_only_all_passed_exits_zero():
    passed, failed, blocked = (Verdict("a", s, "") for s in ("PASS", "FAIL", "BLOCKED"))
    assert summary([passed, passed]) == ("result: 2 passed, 0 failed, 0 blocked of 2 checks", 0)
    assert summary([passed, blocked])[1] == 1
    assert summary([passed, failed])[1] == 1
    assert summary([])[1] == 1  # nothing checked is not a pass
    assert tally([failed, failed, blocked]) == {"PASS": 0, "FAIL": 2, "BLOCKED": 1}
