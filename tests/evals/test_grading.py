"""Answer extraction from thinking and non-thinking outputs, malformed answers included (no model)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from deepinfer.evals import grading


@pytest.mark.parametrize("text, is_thinking, expected", [
    ("The user asks for the sum. 37 + 48 = 85.</think>85", True, ("The user asks for the sum. 37 + 48 = 85.", "85", True)),
    ("Still reasoning about 85 and 86", True, ("Still reasoning about 85 and 86", "", False)),  # cut by max_tokens
    ("85", False, ("", "85", True)),
    ("a</think>b</think>c", True, ("a", "b</think>c", True)),  # only the first closes the reasoning
])
def test_split_thinking(text, is_thinking, expected):
    assert grading.split_thinking(text, is_thinking) == expected


@pytest.mark.parametrize("answer, expected", [
    ("The answer is \\boxed{33}.", 33),
    ("\\boxed{033}", 33),  # AIME answers are written with leading zeros
    ("first \\boxed{12}, on reflection \\boxed{\\text{ 7 }}", 7),  # the last box wins
    ("\\boxed{$1,000$}", 1000),
    ("\\fbox{42}", 42),
    ("So the answer is 204.", 204),
    ("The answer is 12, which is less than 100.", 12),
    ("The answer is 1,000 exactly; not 999", 1000),
    ("**Answer:** 17", 17),
    ("85", 85),
    ("We get 3 cases, and 12 in all", 12),  # no box, no statement: the last integer
    ("\\boxed{\\frac{1}{2}} and 5", None),  # a boxed non-integer is malformed: no fallback to 5
    ("\\boxed{x+1}", None),
    ("no number here", None),
    ("", None),
    ("\\boxed{12", 12),  # an unclosed box is no box; the last integer counts
])
def test_extract_integer(answer, expected):
    value, why = grading.extract_integer(answer)
    assert value == expected
    assert (why is None) == (expected is not None)


def test_extract_integer_reads_only_the_answer_part_of_a_thinking_output():
    reasoning, answer, _ = grading.split_thinking("Maybe \\boxed{12}? No: 13.</think>The result is \\boxed{13}", True)
    assert grading.extract_integer(answer) == (13, None)
    _, answer, finished = grading.split_thinking("Maybe \\boxed{12}? Let me check", True)
    assert not finished and grading.extract_integer(answer) == (None, "empty answer")


@pytest.mark.parametrize("answer, expected", [
    ("Reasoning...\nAnswer: B", "B"),
    ("**Answer:** (c)", "C"),
    ("answer: [D]", "D"),
    ("Answer: A\nOn second thought\nAnswer: C", "C"),
    ("Explanation: ...\nAnswer: E\nConfidence: 80%", None),  # E is not offered among ABCD
    ("\\boxed{B}", "B"),
    ("\\boxed{\\text{C}}", "C"),
    ("(A)", "A"),
    ("B.", "B"),
    ("  d  ", "D"),
    ("\\boxed{42}", None),
    ("I think it is the second option", None),  # no letter given
    ("Answer: Because", None),  # a word is not a letter
    ("", None),
])
def test_extract_choice(answer, expected):
    letter, why = grading.extract_choice(answer, "ABCD")
    assert letter == expected
    assert (why is None) == (expected is not None)


def test_extract_choice_with_more_letters():
    assert grading.extract_choice("Answer: E", "ABCDE") == ("E", None)


@pytest.mark.parametrize("answer, expected", [
    ("Explanation: because\nExact Answer: 42\nConfidence: 90%", "42"),
    ("Explanation: x\nExact Answer: **Paris**\nConfidence: 50%", "Paris"),
    ("Answer: blue", "blue"),
    ("85", "85"),
    ("first line\nsecond line", None),  # no field and more than one line
    ("", None),
])
def test_extract_exact(answer, expected):
    assert grading.extract_exact(answer)[0] == expected


@pytest.mark.parametrize("a, b, equal", [
    ("42", "42.0", True),
    ("1/2", "$\\frac{1}{2}$", True),
    ("0.5", ".5", True),
    ("1,000", "1000", True),
    ("Paris.", "paris", True),
    ("  The   Hague ", "the hague", True),
    ("\\text{red}", "red", True),
    ("42", "43", False),
    ("red", "a red circle", False),
])
def test_exact_match(a, b, equal):
    assert grading.is_exact_match(a, b) is equal


def test_normalize_exact_values():
    assert grading.normalize_exact("$\\dfrac{3}{4}$") == Fraction(3, 4)
    assert grading.normalize_exact("-7") == Fraction(-7)


@pytest.mark.parametrize("reference, gradable", [
    ("85", True), ("3/4", True), ("$\\frac{1}{2}$", True), ("Paris", True), ("the Treaty of Ghent", True),
    ("$(x+1)^3$", False), ("x^2 + 1", False), ("a long sentence that explains some mechanism in detail", False),
])
def test_exact_gradable(reference, gradable):
    assert grading.is_exact_gradable(reference) is gradable
