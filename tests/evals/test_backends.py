"""Prompt rendering through recipe (thinking modes, system prompts, max_tokens) and the answer split,
on the built-in checkpoint's tokenizer and chat encoding (no model weights loaded)."""

from __future__ import annotations

import pytest

from deepinfer.engine.builtin_model import builtin_model_path
from deepinfer.evals.backends import renderer_for
from deepinfer.evals.tasks import Prompt


@pytest.fixture(scope="module")
def renderer():
    return renderer_for(builtin_model_path())


def _text(renderer, ids):
    return renderer.tokenizer.decode(ids, skip_special_tokens=False)


def test_thinking_modes_render_as_recipe_does(renderer):
    prompt = Prompt(None, "What is 37 + 48?", "85")
    off, _ = renderer.render(prompt, "off", 16, None)
    high, _ = renderer.render(prompt, "high", 16, None)
    top, _ = renderer.render(prompt, "max", 16, None)
    assert _text(renderer, off).endswith("<｜User｜>What is 37 + 48?<｜Assistant｜></think>")
    assert _text(renderer, high).endswith("<｜Assistant｜><think>") and _text(renderer, top).endswith("<｜Assistant｜><think>")
    assert "Reasoning Effort:" in _text(renderer, high) and "Reasoning Effort:" not in _text(renderer, off)
    assert _text(renderer, high) != _text(renderer, top)  # each effort has its own preamble


def test_system_prompt_is_rendered(renderer):
    ids, _ = renderer.render(Prompt("Answer briefly.", "Q?", "A"), "off", 16, None)
    assert "Answer briefly.<｜User｜>Q?" in _text(renderer, ids)


@pytest.mark.parametrize("thinking, default", [("off", 8192), ("high", 65536), ("max", 131072)])
def test_max_tokens_follow_recipe_and_the_context(renderer, thinking, default):
    prompt = Prompt(None, "Q?", "A")
    ids, max_tokens = renderer.render(prompt, thinking, None, None)
    assert max_tokens == default  # no context length known (a cluster without --max-model-len)
    assert renderer.render(prompt, thinking, None, 4096)[1] == 4096 - len(ids)
    assert renderer.render(prompt, thinking, 100, 4096)[1] == 100
    assert renderer.render(prompt, thinking, 5000, 4096)[1] == 4096 - len(ids)
    with pytest.raises(ValueError, match="raise --max-model-len"):
        renderer.render(prompt, thinking, None, len(ids))


def test_split_on_token_ids(renderer):
    ids = renderer.tokenizer.encode("Sum: 85.</think>85<｜end▁of▁sentence｜>", add_special_tokens=False).ids
    assert renderer.split(ids, "high") == ("Sum: 85.", "85", True)
    assert renderer.split(ids[:3], "high")[1:] == ("", False)  # cut before </think>: no answer
    assert renderer.split(renderer.tokenizer.encode("85", add_special_tokens=False).ids, "off") == ("", "85", True)


def test_unknown_thinking_mode_is_refused(renderer):
    with pytest.raises(ValueError, match="--thinking must be one of off, high, max"):
        renderer.check_thinking("medium")
