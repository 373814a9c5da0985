"""What the HTTP front adds to recipe's sampling: the output constraint and the sampling penalties.

- `structured_output(request, encoding_name)`: recipe's `InferenceOptions.output_constraint` (JSON
  mode, `json_schema` and `regex` response formats, tool calls) as the token API's
  `StructuredOutput`, which every sampling stage enforces with xgrammar:

  | recipe kind          | token API constraint                                                   |
  |----------------------|------------------------------------------------------------------------|
  | `json`, empty schema | `json_schema` `{"type": "object"}` (JSON mode, `json_object`)         |
  | `json`, a schema     | `json_schema`                                                          |
  | `regex`              | `regex`                                                                |
  | `tool_call`          | `structural_tag`: text, or one DSML `tool_calls` block whose invokes   |
  |                      | name a listed tool and whose parameters follow its schema              |
  | `tool_call_required` | `structural_tag`: exactly a DSML `tool_calls` block (no text), from     |
  |                      | its first invoke when recipe put the block's opener in the prompt      |

  In thinking mode the prompt ends with `<think>`: the reasoning runs free up to `</think>` and the
  constraint covers the answer after it (`reasoning_end`; the tool-call tags carry their own
  reasoning part, from which DSML is excluded, as is any DSML tag but the block opener from the
  free text of `auto`: a call can only be written where the grammar holds it). A forced
  `tool_choice` in thinking mode, which recipe refuses (or relaxes, Anthropic's `any`), is served
  here as `tool_call_required` after the reasoning (`required_tool`). JSON mode asks for an object, not any JSON value: recipe's output parser keeps
  only JSON containers (a bare number or string comes back as spaces), and OpenAI's JSON mode means
  an object. The DSML structural tags are xgrammar's built-in DeepSeek-V4 / V4.1 formats,
  the syntax recipe renders and parses. A kind this server does not know is refused with a 400, so
  a constraint is never silently ignored.
- `penalties(body)`: `presence_penalty` / `frequency_penalty` of a Chat Completions body, which
  recipe validates but does not carry over; a value outside [-2, 2] is a 400 naming it.
"""

from __future__ import annotations

import json
import math
from typing import Any

import deepseek_recipe as recipe

from deepinfer.entrypoint.http.errors import invalid
from deepinfer.protos import common_pb2

REASONING_END = "</think>"
"""The text that closes the reasoning block of a thinking-mode answer (V4 and V4.1)."""
JSON_MODE_SCHEMA = '{"type":"object"}'
"""The constraint of JSON mode (recipe's `json` constraint without a schema)."""
PENALTY_NAMES = ("presence_penalty", "frequency_penalty")
MAX_ABS_PENALTY = 2.0

_STRUCTURAL_TAG_MODELS = {"v4": "deepseek_v4", "v4.1": "deepseek_v4_1"}
"""Chat encoding -> xgrammar's built-in structural-tag format of the model's tool-call syntax."""


def structured_output(request: recipe.ConversationRequest, encoding_name: str, *,
                      parallel_tool_calls: Any = None, prompt_token_ids: list[int] = (),
                      tokenizer: recipe.Tokenizer | None = None,
                      required_tool: str | None = None) -> common_pb2.StructuredOutput | None:
    """The token API constraint of a converted request, or None when it asks for none; 400 if unsupported.

    `parallel_tool_calls` is the body's field (Chat Completions, Responses): `false` allows one invoke
    per tool-call block; unset or `true`, several. `prompt_token_ids` (the rendered prompt) and
    `tokenizer` let a required tool call leave out the block opener that recipe already put at the end
    of the prompt (see `_drop_prefilled_opener`). `required_tool` (thinking mode, where recipe serves
    no forced tool_choice): the answer after the reasoning must be a call ("" = of any declared tool,
    else of the one named).
    """
    constraint = request.inference_options.output_constraint
    if constraint is None:
        return None
    thinking = request.conversation.thinking_mode
    kind, spec = constraint.kind, constraint.schema
    if required_tool is not None and kind in ("tool_call", "tool_call_required"):
        kind = "tool_call_required"
        if required_tool:
            tools = [t for t in json.loads(spec) if t.get("function", {}).get("name") == required_tool]
            if not tools:
                raise invalid(f"tool_choice names {required_tool!r}, which is not among the declared tools",
                              param="tool_choice")
            spec = json.dumps(tools)
    msg = common_pb2.StructuredOutput()
    if kind == "json":
        msg.json_schema = spec or JSON_MODE_SCHEMA
    elif kind == "regex":
        msg.regex = spec
    elif kind in ("tool_call", "tool_call_required"):
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise invalid(f"parallel_tool_calls must be a boolean, got {parallel_tool_calls!r}",
                          param="parallel_tool_calls")
        tag = _tool_call_tag(spec, kind == "tool_call_required", thinking, encoding_name, parallel_tool_calls is not False)
        if kind == "tool_call_required" and tokenizer is not None:
            tag = _drop_prefilled_opener(tag, prompt_token_ids, tokenizer)
        msg.structural_tag = json.dumps(tag, ensure_ascii=False)
        return msg
    else:
        raise invalid(f"this server cannot enforce the output constraint {kind!r} that the request asks for; "
                      "remove it (response_format / tool_choice)", param="response_format",
                      code="unsupported_output_constraint")
    if thinking:
        msg.reasoning_end = REASONING_END
    return msg


UNSERVED_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_grammar", "guided_choice", "structured_outputs")
"""vLLM's constraint fields; refused with a pointer to `response_format` rather than ignored."""


def response_format_constraint(response_format: Any, extra_fields: dict | None = None) -> dict | None:
    """The `structured_output` (token API fields) of a raw-prompt request's `response_format`; 400 if unsupported.

    `{"type": "text"}` or none -> None; `json_object` -> a JSON object; `json_schema` -> its `schema`
    (`{"json_schema": {"schema": ...}}`, as Chat Completions); `regex` -> `{"regex": ...}` (recipe's shape).
    `extra_fields` are the body's other fields: vLLM's guided_* constraints there are refused.
    """
    for name in UNSERVED_GUIDED_FIELDS:
        if (extra_fields or {}).get(name) is not None:
            raise invalid(f"{name} is not served; use response_format (json_object, json_schema or regex)", param=name,
                          code="unsupported_output_constraint")
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_schema": JSON_MODE_SCHEMA}
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, (dict, bool)):
            raise invalid("response_format.json_schema.schema must be a JSON Schema object", param="response_format")
        return {"json_schema": json.dumps(schema)}
    if kind == "regex":
        regex = response_format.get("regex")
        if not isinstance(regex, str) or not regex:
            raise invalid("response_format.regex must be a non-empty regular expression", param="response_format")
        return {"regex": regex}
    raise invalid(f"response_format {response_format!r} is not supported; use text, json_object, json_schema or regex",
                  param="response_format", code="unsupported_output_constraint")


def _drop_prefilled_opener(tag: dict, prompt_token_ids: list[int], tokenizer: recipe.Tokenizer) -> dict:
    """`tag` without its leading constant text when the prompt already ends with exactly that text.

    NOTE: for `tool_choice` required (non-thinking), recipe renders the prompt with the tool-call
    block's opener (V4: `\n\n<｜DSML｜tool_calls>\n`) already in place, and xgrammar's required tag
    starts with the same opener: held to both, the model would have to write a second opener, a text
    no model was trained to produce, and what followed went astray. The answer starts at the first
    invoke instead, which is also what recipe's output parser expects after that prompt.
    """
    fmt = tag.get("format") or {}
    elements = fmt.get("elements") if fmt.get("type") == "sequence" else None
    if not elements or elements[0].get("type") != "const_string":
        return tag
    opener = tokenizer.encode(elements[0]["value"])
    if opener and list(prompt_token_ids[-len(opener):]) == list(opener):
        fmt = {**fmt, "elements": elements[1:]}
        return {**tag, "format": fmt}
    return tag


def _tool_call_tag(tools_json: str, is_required: bool, thinking: bool, encoding_name: str, is_parallel: bool) -> dict:
    """xgrammar's DSML tool-call structural tag (as a JSON dict) for recipe's tool list."""
    import xgrammar

    tools = json.loads(tools_json)
    for tool in tools:  # recipe marks tools the model may only call after loading them; xgrammar lists them all
        tool.get("function", {}).pop("defer_loading", None)
    try:
        tag = xgrammar.get_model_structural_tag(
            _STRUCTURAL_TAG_MODELS[encoding_name], tools=tools, tool_choice="required" if is_required else "auto",
            reasoning="enabled" if thinking else "disabled", parallel_tool_calls=is_parallel)
    except ValueError as e:
        raise invalid(f"the tool definitions cannot be enforced as tool calls: {str(e)[:300]}", param="tools",
                      code="unsupported_output_constraint") from None
    tag = json.loads(tag.model_dump_json())
    _forbid_stray_dsml(tag)
    return tag


DSML_MARKER = "<｜DSML｜"
"""The start of every DSML tag (V4 and V4.1): what a tool call begins with."""
STRAY_DSML_TAGS = ("<｜DSML｜invoke", "<｜DSML｜parameter", "</｜DSML｜")
"""DSML tags that may only appear inside a tool-call block (after its `<｜DSML｜tool_calls>` opener)."""


def _forbid_stray_dsml(tag: dict) -> None:
    """Excludes DSML outside tool-call blocks from a tool-call tag (in place): from the free reasoning of
    thinking mode (all of it) and from the free text of `auto` (all but the block opener).

    NOTE: xgrammar's free parts exclude only `<think>` / `</think>`, so a model could open a call inside
    its reasoning, or write an invoke without the block opener that triggers the grammar; recipe's
    parser takes such calls, unconstrained (calls of undeclared tools, arguments that are not JSON).
    Excluded here, the tool-call grammar is the one place a call can be written.
    """
    elements = tag.get("format", {}).get("elements") or [tag.get("format", {})]
    for element in elements:
        content = element.get("content") if element.get("type") == "tag" else None
        if element.get("end") == REASONING_END and isinstance(content, dict) and content.get("type") == "any_text":
            content["excludes"] = [*content.get("excludes", []), DSML_MARKER]
        elif element.get("type") == "triggered_tags":
            element["excludes"] = [*element.get("excludes", []), *STRAY_DSML_TAGS]


def penalties(body: Any) -> dict[str, float]:
    """`presence_penalty` / `frequency_penalty` of a request body (those set and non-zero); 400 when out of range."""
    found: dict[str, float] = {}
    if not isinstance(body, dict):
        return found
    for name in PENALTY_NAMES:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise invalid(f"{name} must be a number in [-2, 2], got {value!r}", param=name)
        if not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
            raise invalid(f"{name} must be in [-2, 2], got {value}", param=name)
        if value:
            found[name] = float(value)
    return found
