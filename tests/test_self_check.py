"""ddp_course/self_check.py: one line of feedback for an unanswered, right or wrong self-check answer."""

import pytest

from ddp_course.self_check import Question, verdict

STEPS = Question("self-check", 15, why="1438 samples / (2 ranks x 48) = 14.98, rounded up", hint="reread section 2")
WORD = Question("self-check", "rank", why="the sampler needs the global rank", hint="reread section 3")


def test_no_answer_says_how_to_answer():
    assert verdict(STEPS, None) == "self-check: not answered yet - set `answer` above and run this cell again"


@pytest.mark.parametrize("answer", [15, 15.0, 15.2])
def test_a_number_within_the_tolerance_is_correct_with_its_reason(answer):
    assert verdict(STEPS, answer) == "self-check: correct - 1438 samples / (2 ranks x 48) = 14.98, rounded up"


@pytest.mark.parametrize("answer", [14, 30, -15])
def test_a_wrong_number_gets_the_hint(answer):
    assert verdict(STEPS, answer) == "self-check: not yet - reread section 2"


@pytest.mark.parametrize("answer", ["15", True, [15]])
def test_a_number_question_refuses_other_types_in_one_line(answer):
    assert verdict(STEPS, answer) == f"self-check: not yet - the answer is a number (got {answer!r})"


@pytest.mark.parametrize(("answer", "ok"), [("rank", True), (" RANK ", True), ("local_rank", False), (3, False)])
def test_a_word_matches_case_and_spaces_aside(answer, ok):
    assert verdict(WORD, answer).startswith("self-check: correct" if ok else "self-check: not yet - reread section 3")
