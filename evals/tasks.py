"""The three evaluations: how each reads its data set's published layout, asks its question, and grades.

| task | data (published layout, see evals/README.md) | graded by |
|---|---|---|
| `aime` | JSONL / JSON / Parquet with `problem` and `answer` (MathArena's and most copies; `question`, `Problem` / `Answer` also read) | exact integer match of the final answer (`grading.extract_integer`) |
| `gpqa` | the GPQA Diamond CSV: `Question`, `Correct Answer`, `Incorrect Answer 1..3`, `Record ID` | the chosen letter over the four answers shuffled with a seed derived from `--seed`, the item and the sample |
| `hle` | Humanity's Last Exam as Parquet or JSONL: `id`, `question`, `answer`, `answer_type` (`exactMatch` / `multipleChoice`), `image` | multipleChoice: the chosen letter; exactMatch: `grading.is_exact_match` when the reference is a number or a short plain phrase, otherwise the item needs a judge model and is reported, not scored |

Prompt styles: `official` asks as the benchmark's usual harness does (AIME: reason step by step and box
the answer; GPQA: the options as `A) ...` lines and an `Answer: X` last line; HLE: its own system prompt
with the `Explanation / Exact Answer (Answer) / Confidence` response format); `bare` sends the question
(and GPQA's options) alone, for models trained without such instructions (the built-in demo model).
"""

from __future__ import annotations

import base64
import binascii
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer.evals import grading
from deepinfer.evals.data import DataError, Row, read_rows

PROMPT_STYLES = ("official", "bare")

SCORED, NEEDS_JUDGE, SKIPPED = "scored", "needs_judge", "skipped"
"""An item's status: graded here; reported but left to a judge model; not run (an image item on a model
without a vision tower)."""


@dataclass(frozen=True)
class Item:
    """One question of a data set, as read (the sample-dependent parts come from `Task.render`)."""

    id: str
    where: str
    """`file:line` it was read from (for messages)."""
    question: str
    reference: str
    """The reference answer as the data gives it (AIME: the integer; GPQA: the correct answer's text;
    HLE: its `answer`)."""
    kind: str
    """"integer" (AIME), "choice" (GPQA, HLE multipleChoice), "exact" (HLE exactMatch)."""
    status: str = SCORED
    choices: tuple[str, ...] = ()
    """GPQA: the correct answer, then the three incorrect ones (the data's order, before shuffling)."""
    letters: str = "ABCD"
    """The option letters a choice item offers."""
    images: tuple[str, ...] = ()
    """Data URLs of the item's images (HLE)."""
    why_not_scored: str | None = None


@dataclass(frozen=True)
class Prompt:
    """What one sample of an item sends and what it is graded against."""

    system: str | None
    user: str
    reference: str
    """The graded reference of this sample (GPQA: the correct answer's letter after shuffling)."""
    order: tuple[int, ...] = ()
    """GPQA: `order[i]` is the data's index of the answer shown as letter i (0 = the correct one)."""
    images: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class Grade:
    """The grading of one sample's answer: what was extracted, whether it is right, why there is none."""

    extracted: str | None
    is_correct: bool
    why_none: str | None = None


def _item_id(row: Row, names: tuple[str, ...], position: int) -> str:
    for name in names:
        value = row.get(name)
        if value is not None and str(value).strip():
            return str(value).strip()
    return f"#{position + 1}"


def _check_unique(items: list[Item]) -> list[Item]:
    seen: dict[str, str] = {}
    for item in items:
        if item.id in seen:
            raise DataError(f"duplicate item id {item.id!r} (also at {seen[item.id]}); ids key --resume",
                            where=item.where, field="id")
        seen[item.id] = item.where
    return items


def _text(row: Row, *names: str) -> str:
    name, value = row.require(*names)
    if not isinstance(value, str):
        raise DataError(f"must be text, got {type(value).__name__} {value!r:.60}", where=row.where, field=name)
    return value.strip()


class Task:
    """One evaluation: `load` a data file into items, `render` a sample's prompt, `grade` its answer."""

    name = ""
    title = ""

    def load(self, path: str | Path) -> list[Item]:
        rows = read_rows(path)
        return _check_unique([self.item(row, i) for i, row in enumerate(rows)])

    def item(self, row: Row, position: int) -> Item:
        raise NotImplementedError

    def render(self, item: Item, sample_seed: int, style: str) -> Prompt:
        raise NotImplementedError

    def grade(self, item: Item, prompt: Prompt, answer: str) -> Grade:
        raise NotImplementedError


class Aime(Task):
    """AIME: a problem whose answer is an integer (0-999 in the competition)."""

    name, title = "aime", "AIME"
    INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

    def item(self, row: Row, position: int) -> Item:
        question = _text(row, "problem", "question", "Problem", "Question")
        name, raw = row.require("answer", "Answer")
        value = raw if isinstance(raw, int) and not isinstance(raw, bool) else (
            grading.parse_integer(raw) if isinstance(raw, str) else None)
        if value is None:
            raise DataError(f"must be an integer (AIME answers are 0-999), got {raw!r:.60}", where=row.where,
                            field=name)
        item_id = _item_id(row, ("id", "ID", "problem_idx", "idx"), position)
        return Item(item_id, row.where, question, str(value), "integer")

    def render(self, item: Item, sample_seed: int, style: str) -> Prompt:
        user = item.question if style == "bare" else f"{item.question}\n\n{self.INSTRUCTION}"
        return Prompt(None, user, item.reference)

    def grade(self, item: Item, prompt: Prompt, answer: str) -> Grade:
        value, why = grading.extract_integer(answer)
        if value is None:
            return Grade(None, False, why)
        return Grade(str(value), value == int(prompt.reference))


class Gpqa(Task):
    """GPQA Diamond: four answers, the first column the correct one; shown shuffled, graded by letter."""

    name, title = "gpqa", "GPQA Diamond"
    COLUMNS = ("Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
    INSTRUCTION = ("Choose the correct option. End your response with a line of the form \"Answer: X\", "
                   "where X is one of A, B, C or D.")

    def item(self, row: Row, position: int) -> Item:
        question = _text(row, "Question")
        choices = tuple(_text(row, column) for column in self.COLUMNS)
        return Item(_item_id(row, ("Record ID", "id"), position), row.where, question, choices[0], "choice",
                    choices=choices)

    def render(self, item: Item, sample_seed: int, style: str) -> Prompt:
        order = list(range(len(item.choices)))
        random.Random(sample_seed).shuffle(order)
        lines = "\n".join(f"{letter}) {item.choices[i]}" for letter, i in zip(item.letters, order))
        user = f"{item.question}\n\n{lines}"
        if style != "bare":
            user = f"{user}\n\n{self.INSTRUCTION}"
        return Prompt(None, user, item.letters[order.index(0)], tuple(order))

    def grade(self, item: Item, prompt: Prompt, answer: str) -> Grade:
        letter, why = grading.extract_choice(answer, item.letters)
        return Grade(letter, letter == prompt.reference, why)


class Hle(Task):
    """Humanity's Last Exam: exactMatch items graded by exact match (when a string comparison can be
    right), multipleChoice items by letter; the rest need a judge model."""

    name, title = "hle", "Humanity's Last Exam"
    ANSWER_TYPES = ("exactMatch", "multipleChoice")
    # NOTE: HLE's published response format (its harness's system prompts); the field names are what
    # `grading.extract_exact` / `extract_choice` read.
    SYSTEM_EXACT = ("Your response should be in the following format:\n"
                    "Explanation: {your explanation for your final answer}\n"
                    "Exact Answer: {your succinct, final answer}\n"
                    "Confidence: {your confidence score between 0% and 100% for your answer}")
    SYSTEM_CHOICE = ("Your response should be in the following format:\n"
                     "Explanation: {your explanation for your answer choice}\n"
                     "Answer: {your chosen answer}\n"
                     "Confidence: {your confidence score between 0% and 100% for your answer}")

    def item(self, row: Row, position: int) -> Item:
        question = _text(row, "question")
        reference = _text(row, "answer")
        answer_type = _text(row, "answer_type")
        item_id = _item_id(row, ("id",), position)
        images = _images(row)
        if answer_type == "multipleChoice":
            letters = _option_letters(question, reference)
            if not re.fullmatch(r"[A-Za-z]", reference):
                return Item(item_id, row.where, question, reference, "choice", NEEDS_JUDGE, letters=letters,
                            images=images, why_not_scored="multipleChoice answer is not a single letter")
            return Item(item_id, row.where, question, reference.upper(), "choice", letters=letters, images=images)
        if answer_type == "exactMatch":
            if not grading.is_exact_gradable(reference):
                return Item(item_id, row.where, question, reference, "exact", NEEDS_JUDGE, images=images,
                            why_not_scored="free-form answer: equivalent spellings need a judge model")
            return Item(item_id, row.where, question, reference, "exact", images=images)
        raise DataError(f"must be one of {', '.join(self.ANSWER_TYPES)}, got {answer_type!r:.60}", where=row.where,
                        field="answer_type")

    def render(self, item: Item, sample_seed: int, style: str) -> Prompt:
        system = None if style == "bare" else (self.SYSTEM_CHOICE if item.kind == "choice" else self.SYSTEM_EXACT)
        return Prompt(system, item.question, item.reference, images=item.images)

    def grade(self, item: Item, prompt: Prompt, answer: str) -> Grade:
        if item.kind == "choice":
            letter, why = grading.extract_choice(answer, item.letters)
            return Grade(letter, letter == prompt.reference, why)
        text, why = grading.extract_exact(answer)
        if text is None:
            return Grade(None, False, why)
        return Grade(text, grading.is_exact_match(text, prompt.reference))


def _option_letters(question: str, reference: str) -> str:
    """The letters an HLE multiple-choice question offers: A up to the last option line's letter (lines
    like "A. ..." or "(B) ..."), at least up to the reference's; A-Z when no option line is found."""
    found = re.findall(r"(?m)^\s*\(?([A-Z])[.)]\s", question)
    last = max(found + ([reference.upper()] if re.fullmatch(r"[A-Za-z]", reference) else []), default="Z")
    return "".join(chr(c) for c in range(ord("A"), ord(last) + 1))


def _images(row: Row) -> tuple[str, ...]:
    """The HLE record's image as a data URL (its `image` field: "" when the item is text only)."""
    value = row.get("image")
    if value is None or (isinstance(value, str) and not value.strip()):
        return ()
    if isinstance(value, dict) and isinstance(value.get("bytes"), (bytes, bytearray)):  # a datasets Image struct
        return (f"data:image/png;base64,{base64.b64encode(value['bytes']).decode()}",)
    if not isinstance(value, str):
        raise DataError(f"must be a data URL string, got {type(value).__name__}", where=row.where, field="image")
    m = re.fullmatch(r"data:image/[\w.+-]+;base64,([A-Za-z0-9+/=\s]+)", value.strip())
    if not m:
        raise DataError(f"must be a base64 data URL (data:image/...;base64,...), got {value[:40]!r}...",
                        where=row.where, field="image")
    try:
        base64.b64decode(m.group(1), validate=False)
    except (binascii.Error, ValueError) as e:
        raise DataError(f"the base64 image does not decode ({e})", where=row.where, field="image") from None
    return (value.strip(),)


TASKS: dict[str, Task] = {t.name: t for t in (Aime(), Gpqa(), Hle())}
"""`--task` name -> the task."""
