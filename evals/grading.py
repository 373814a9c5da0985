"""Answer extraction and grading: pure functions of the model's output text (no model, no I/O).

A completion is split once by `split_thinking` into its reasoning and its answer (the text after
`</think>` in thinking mode); every extractor below reads the answer part only, so a number or a
letter that the reasoning mentions on the way never counts. What each task accepts:

- AIME (`extract_integer`): the last `\\boxed{...}` of the answer, else the last "answer is N" /
  "Answer: N", else the last integer of the answer; the reference is an integer and the two must be
  equal as integers ("033" = 33). A boxed answer that is not an integer (`\\boxed{x+1}`) is
  malformed: no answer, never a fallback to another number.
- multiple choice (`extract_choice`, GPQA Diamond and HLE's multipleChoice items): the last
  "Answer: X" (markdown bold and brackets allowed), else `\\boxed{X}`, else an answer that is nothing
  but one letter ("B", "(B)", "B."); a letter outside the offered ones is no answer.
- exact match (`extract_exact`, HLE's exactMatch items): the last "Exact Answer:" field (HLE's own
  response format), else the last "Answer:" field, else the whole answer when it is one line;
  compared by `normalize_exact` (case, spacing, surrounding `$`, a final period; numbers and
  fractions by value).
"""

from __future__ import annotations

import re
from fractions import Fraction

THINK_END = "</think>"
"""The text that closes the reasoning of a thinking-mode completion (DeepSeek-V4 and V4.1)."""


def split_thinking(text: str, is_thinking: bool) -> tuple[str, str, bool]:
    """`(reasoning, answer, is_reasoning_finished)` of a completion's text.

    In thinking mode the prompt ends with `<think>`, so the completion is `reasoning</think>answer`;
    without `</think>` the reasoning never finished (cut by max_tokens) and there is no answer. Outside
    thinking mode the whole completion is the answer.
    """
    if not is_thinking:
        return "", text, True
    head, sep, tail = text.partition(THINK_END)
    if not sep:
        return text, "", False
    return head, tail, True


def _boxed_contents(text: str) -> list[str]:
    """Contents of every `\\boxed{...}` (and `\\fbox{...}`) in `text`, braces balanced, in order."""
    out = []
    for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append(text[m.end():i - 1])
    return out


_INTEGER_TEXT = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+|[+-]?\d+")
_LATEX_NOISE = re.compile(r"\\[,;!: ]|\\text\{\s*\}|\$|\\\(|\\\)|\\displaystyle|\^\{?\\circ\}?|\\%|%")


def parse_integer(text: str) -> int | None:
    """The integer `text` spells (`"033"`, `"1,000"`, `"$42$"`, `"\\text{42}"`, `"42."`), else None."""
    s = _LATEX_NOISE.sub("", text).strip()
    s = re.sub(r"^\\(?:text|mathrm|textbf|mathbf)\{(.*)\}$", r"\1", s).strip().rstrip(".").strip()
    if not re.fullmatch(_INTEGER_TEXT, s):
        return None
    return int(s.replace(",", ""))


_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*[:\s]*\**\s*\$?\s*(" + _INTEGER_TEXT.pattern + ")", re.IGNORECASE)


def extract_integer(answer: str) -> tuple[int | None, str | None]:
    """`(value, why_none)`: the integer final answer of an AIME completion's answer part (see the module
    docstring for the order of the rules); `why_none` says why there is none."""
    boxed = _boxed_contents(answer)
    if boxed:
        value = parse_integer(boxed[-1])
        return (value, None) if value is not None else (None, f"boxed answer is not an integer: {boxed[-1][:80]!r}")
    stated = _ANSWER_IS.findall(answer)
    if stated:
        value = parse_integer(stated[-1])
        if value is not None:
            return value, None
    numbers = _INTEGER_TEXT.findall(answer)
    if numbers:
        return int(numbers[-1].replace(",", "")), None
    return None, "no integer in the answer" if answer.strip() else "empty answer"


_CHOICE_FIELD = re.compile(r"answer\s*[*_]*\s*[:：]\s*[*_]*\s*[\(\[]?\s*([A-Za-z])\s*[\)\]]?(?![A-Za-z])", re.IGNORECASE)
_LONE_LETTER = re.compile(r"[*_\s]*[\(\[]?([A-Za-z])[\)\]]?[.:]?[*_\s]*")


def extract_choice(answer: str, letters: str) -> tuple[str | None, str | None]:
    """`(letter, why_none)`: the chosen option letter (upper case) of an answer part; `letters` are the
    offered ones ("ABCD"). A letter outside them is no answer."""
    letters = letters.upper()
    found = None
    fields = _CHOICE_FIELD.findall(answer)
    if fields:
        found = fields[-1]
    else:
        boxed = _boxed_contents(answer)
        if boxed:
            inner = re.sub(r"\\text\{([^}]*)\}", r"\1", boxed[-1]).strip()
            m = re.fullmatch(_LONE_LETTER, inner)
            if not m:
                return None, f"boxed answer is not a letter: {boxed[-1][:80]!r}"
            found = m.group(1)
        else:
            m = re.fullmatch(_LONE_LETTER, answer.strip()) if answer.strip() else None
            if m:
                found = m.group(1)
    if found is None:
        return None, "no chosen letter in the answer" if answer.strip() else "empty answer"
    found = found.upper()
    if found not in letters:
        return None, f"letter {found} is not one of the options {letters}"
    return found, None


_EXACT_FIELD = re.compile(r"exact\s+answer\s*[*_]*\s*[:：]\s*(.*)", re.IGNORECASE)
_ANSWER_FIELD = re.compile(r"(?<![A-Za-z])answer\s*[*_]*\s*[:：]\s*(.*)", re.IGNORECASE)


def extract_exact(answer: str) -> tuple[str | None, str | None]:
    """`(text, why_none)`: the final short answer of an exact-match completion's answer part."""
    for pattern in (_EXACT_FIELD, _ANSWER_FIELD):
        hits = [h.strip().strip("*_").strip() for h in pattern.findall(answer)]
        hits = [h for h in hits if h]
        if hits:
            return hits[-1], None
    lines = [line.strip() for line in answer.strip().splitlines() if line.strip()]
    if len(lines) == 1:
        return lines[0], None
    return None, "no 'Exact Answer:' line and more than one line of answer" if lines else "empty answer"


def normalize_exact(text: str) -> str | Fraction:
    """The comparison key of an exact answer: its value when it is a number or fraction (`"0.50"`,
    `"1/2"`, `"$\\frac{1}{2}$"` -> 1/2), else its text in lower case with collapsed spaces and without
    surrounding `$`, quotes, `\\text{}` or a final period."""
    s = text.strip()
    s = re.sub(r"^\$+|\$+$", "", s).strip()
    s = re.sub(r"\\(?:text|mathrm)\{([^}]*)\}", r"\1", s)
    s = s.strip().rstrip(".").strip().strip("\"'`").strip()
    m = re.fullmatch(r"\\[dt]?frac\{\s*([+-]?\d+)\s*\}\{\s*(\d+)\s*\}", s)
    if m:
        s = f"{m.group(1)}/{m.group(2)}"
    number = s.replace(",", "") if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?", s) else s
    if re.fullmatch(r"[+-]?(\d+(\.\d*)?|\.\d+)(e[+-]?\d+)?|[+-]?\d+\s*/\s*\d+", number, re.IGNORECASE):
        try:
            return Fraction(number.replace(" ", ""))
        except (ValueError, ZeroDivisionError):
            pass
    return re.sub(r"\s+", " ", s).lower()


def is_exact_match(extracted: str, reference: str) -> bool:
    """Whether two exact answers agree after `normalize_exact`."""
    return normalize_exact(extracted) == normalize_exact(reference)


_MARKUP = re.compile(r"[\\^_{}$=<>|]")


def is_exact_gradable(reference: str, max_words: int = 4) -> bool:
    """Whether an exact-match reference can be graded by string comparison at all: a number or fraction,
    or a short plain phrase (at most `max_words` words, no LaTeX or math markup). Longer or formula
    answers admit equivalent spellings that only a judge model can accept (HLE's own grading)."""
    key = normalize_exact(reference)
    if isinstance(key, Fraction):
        return True
    if not key or _MARKUP.search(reference) or "\n" in reference.strip():
        return False
    return len(key.split()) <= max_words
