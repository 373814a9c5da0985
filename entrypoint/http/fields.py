"""Request-body fields the HTTP front reads itself, beside recipe: each is honoured (carried into the
token API's sampling params) or refused with a 400 naming it, never silently dropped.

Recipe converts what the protocols define and ignores the rest of a body, so the front checks, per
API, what recipe would otherwise drop:

| field                                   | APIs                       | what happens                                 |
|-----------------------------------------|----------------------------|----------------------------------------------|
| `logit_bias` {token id: bias}           | chat, responses, messages  | carried (bias in [-100, 100])                |
| `min_tokens`                            | chat, responses, messages  | carried (vLLM's extension; EOS held back)    |
| `top_k`                                 | chat, responses, messages  | carried (Anthropic's field; vLLM's extension)|
| `repetition_penalty`                    | chat, responses, messages  | carried (vLLM's extension, > 0)              |
| `temperature` / `top_p` in thinking mode| chat, responses, messages  | see `HttpConfig.thinking_sampling`           |
| `prediction`, `audio`, `best_of`, ...   | chat, responses            | 400 (`UNSERVED_FIELDS`)                      |
| `role: "system"` inside `messages`      | messages                   | 400 (Anthropic takes the top-level `system`) |
| no `max_tokens`                         | messages                   | 400 (Anthropic requires it)                  |

Integers outside the signed 64-bit range anywhere in a body (a `seed` of 2**70) are a 400 naming
their path before recipe sees them (its parser would raise an OverflowError, a 500 before).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from deepinfer.entrypoint.http.errors import invalid

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
INT32_MAX = 2 ** 31 - 1
MAX_ABS_LOGIT_BIAS = 100.0
"""OpenAI's range of a `logit_bias` value."""

UNSERVED_FIELDS = {
    "prediction": "predicted outputs are not served; remove prediction",
    "audio": "audio output is not served; remove audio",
    "best_of": "best_of is not served; send several requests (seed + i)",
    "use_beam_search": "beam search is not served; remove use_beam_search",
    "guided_json": "guided_json is not served; use response_format (json_object, json_schema or regex)",
    "guided_regex": "guided_regex is not served; use response_format (json_object, json_schema or regex)",
    "guided_grammar": "guided_grammar is not served; use response_format (json_object, json_schema or regex)",
    "guided_choice": "guided_choice is not served; use response_format (json_object, json_schema or regex)",
    "structured_outputs": "structured_outputs is not served; use response_format (json_object, json_schema or regex)",
}
"""Fields a client may send that this server cannot honour: a 400 with this message (when set, not null)."""


@dataclass
class SamplingExtras:
    """The sampling fields of a body that recipe does not carry, validated."""

    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    top_k: int | None = None
    repetition_penalty: float | None = None
    temperature: float | None = None
    """The temperature the body asked for (None = unset); used in thinking mode only when the server
    honours the request's sampling there (`thinking_sampling = "request"`)."""
    top_p: float | None = None
    """As `temperature`."""


def check_integers(body: Any, path: str = "") -> None:
    """Raises 400 naming the first integer outside [-2**63, 2**63) in a parsed JSON body."""
    stack = [(path, body)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, bool):
            continue
        if isinstance(node, int) and not INT64_MIN <= node <= INT64_MAX:
            raise invalid(f"{where or 'the body'}: {node} is outside the 64-bit integer range", param=where or None)
        if isinstance(node, dict):
            stack.extend((f"{where}.{k}" if where else str(k), v) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(node))


def _number(body: dict, name: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(f"{name} must be a number, got {value!r}", param=name)
    if value < low or value > high or (low_open and value == low):
        bounds = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise invalid(f"{name} must be in {bounds}, got {value}", param=name)
    return float(value)


def _integer(body: dict, name: str, low: int, high: int = INT32_MAX) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise invalid(f"{name} must be an integer in [{low}, {high}], got {value!r}", param=name)
    return value


def sampling_extras(body: dict) -> SamplingExtras:
    """The fields of the table above that a chat / responses / messages body sets; 400 for bad values."""
    for name, message in UNSERVED_FIELDS.items():
        if body.get(name) is not None:
            raise invalid(message, param=name, code="unsupported_parameter")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise invalid(f"modalities {modalities!r} are not served; this model answers in text only", param="modalities",
                      code="unsupported_parameter")
    extras = SamplingExtras()
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise invalid("logit_bias must be an object mapping token ids to a bias in [-100, 100]", param="logit_bias")
        for key, value in bias.items():
            try:
                token_id = int(key)
            except (TypeError, ValueError):
                raise invalid(f"logit_bias key {key!r} is not a token id (an integer)", param="logit_bias") from None
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or abs(value) > MAX_ABS_LOGIT_BIAS):
                raise invalid(f"logit_bias[{key}] must be a number in [-100, 100], got {value!r}", param="logit_bias")
            extras.logit_bias[token_id] = float(value)
    extras.min_tokens = _integer(body, "min_tokens", 0) or 0
    top_k = _integer(body, "top_k", -1)
    extras.top_k = top_k if top_k not in (None, 0, -1) else None
    extras.repetition_penalty = _number(body, "repetition_penalty", 0.0, 1e9, low_open=True)
    extras.temperature = _number(body, "temperature", 0.0, 2.0)
    extras.top_p = _number(body, "top_p", 0.0, 1.0, low_open=True)
    return extras


MAX_N = 16
"""Largest `n` (choices per request) served; each choice is its own token call."""


def choice_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice `choice` of an n > 1 request: seed + choice, wrapped into the int64 range."""
    if seed is None or choice == 0:
        return seed
    return (seed + choice + 2 ** 63) % 2 ** 64 - 2 ** 63


def choices_n(body: dict, param: str = "n") -> int:
    """The body's `n` (choices to sample), 1 when unset; 400 outside [1, MAX_N] or with `stream` (the
    n choices are separate token calls, merged into one answer once all finished)."""
    n = body.get(param)
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise invalid(f"{param} must be an integer in [1, {MAX_N}], got {n!r}", param=param)
    if n > 1 and body.get("stream"):
        raise invalid(f"{param} > 1 is served without streaming only; set stream to false or send {n} requests",
                      param=param, code="unsupported_parameter")
    return n


def check_messages_body(body: dict) -> None:
    """Anthropic's Messages rules recipe does not enforce: `max_tokens` is required, and the system
    prompt goes in the top-level `system`, not in `messages`."""
    if body.get("max_tokens") is None:
        raise invalid("max_tokens: Field required (the Messages API needs an explicit max_tokens)", param="max_tokens")
    messages = body.get("messages")
    if isinstance(messages, list):
        for i, message in enumerate(messages):
            if isinstance(message, dict) and message.get("role") not in ("user", "assistant"):
                raise invalid(f"messages.{i}.role: Input should be 'user' or 'assistant' (put a system prompt in the "
                              "top-level `system` field)", param=f"messages.{i}.role")
