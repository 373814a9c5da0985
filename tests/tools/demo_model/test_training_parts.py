"""Pieces of the demo model's training script (tools/demo_model) that decide what it learns from:
the training items never leak held-out ones, the name options do what they say, and the structured
embedding table is built, fitted and started as documented. (Training itself is developer-run.)"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.tools.demo_model import data as D
from deepinfer.tools.demo_model.train import StructuredEmbedding


@pytest.fixture(scope="module")
def held():
    return D.held_out()


@pytest.fixture(scope="module")
def names():
    return D.name_pool(400)


def test_name_pool_is_fixed_and_disjoint_from_the_task_words(names):
    assert names == D.name_pool(400) and len(set(names)) == 400
    taken = {w.lower() for w in (*D.WORDS, *D.PLACES, *D.COLOURS, *D.SHAPES)}
    assert not any(n.lower() in taken for n in names)
    assert set(D.name_pool(100)) <= set(D.name_pool(400))  # a larger pool extends a smaller one


def test_training_items_never_hit_held_out_ones(held, names):
    rng = random.Random(1)
    for _ in range(300):
        assert D.training_items(rng, "add", held) not in set(held["add"])
        assert D.training_items(rng, "tool", held, names, 0.5) not in held["tool"]
        for task in ("copy", "reverse"):
            item = D.training_items(rng, task, held, names, 0.75, 3)
            assert item not in set(held[task]) and len(set(item)) == len(item)


def test_name_share_and_list_names(held, names):
    rng = random.Random(2)
    tool = [D.training_items(rng, "tool", held, names, 1.0) for _ in range(100)]
    assert all(t in names for t in tool)
    tool = [D.training_items(rng, "tool", held, names, 0.0) for _ in range(100)]
    assert all(t in D.PLACES for t in tool)
    lists = [D.training_items(rng, "copy", held, names, 1.0, 3) for _ in range(300)]
    counts = [sum(w in names for w in item) for item in lists]
    assert min(counts) >= 1 and max(counts) == 3
    lists = [D.training_items(rng, "copy", held, names, 1.0, 2) for _ in range(300)]
    assert max(sum(w in names for w in item) for item in lists) == 2


TOKENS = ["\u0120Paris", "Paris", "\u0120cat", "85", "7", "123", "\u0120Rome", "<think>", "012"]


def test_structured_table_shares_rows_between_spaced_and_unspaced_words():
    s = StructuredEmbedding(TOKENS, 8)
    assert s.kind.tolist() == [1, 1, 0, 2, 2, 2, 0, 0, 0, 0]  # + the shared row of unused ids
    s.randomize(free := torch.randn(len(TOKENS) + 1, 8), std=0.02)
    assert free[s.kind != 0].abs().sum() == 0 and free[s.kind == 0].abs().sum() > 0
    t = s.table(free)
    torch.testing.assert_close(t[0] - t[1], 2 * s.space.detach())  # " Paris" - "Paris" = 2 x spacing
    # "85" = ones[5] + tens[8] + hundreds[none]; "7" = ones[7] + tens[none] + hundreds[none]
    p = s.places.detach()
    torch.testing.assert_close(t[3], p[0, 5] + p[1, 8] + p[2, s.NONE])
    torch.testing.assert_close(t[4], p[0, 7] + p[1, s.NONE] + p[2, s.NONE])
    torch.testing.assert_close(t[2], free[2])  # " cat" has no unspaced partner: a free row


def test_structured_fit_keeps_the_table_and_decay_moves_it_onto_the_structure():
    s = StructuredEmbedding(TOKENS, 8)
    table = torch.randn(len(TOKENS) + 1, 8)
    free = table.clone()
    err = s.fit(free)
    assert 0 < err < 1
    torch.testing.assert_close(s.table(free), table)  # the warm start changes nothing at first
    s.decay_residual(free, 1.0)
    built = s.table(free)
    torch.testing.assert_close(built[s.kind == 0], table[s.kind == 0])
    torch.testing.assert_close(built[0] - built[1], 2 * s.space.detach())


def test_json_task_is_rendered_in_recipes_json_mode(held):
    renderer = D.ChatRenderer()
    ex = D.make_example("json", (37, 48), random.Random(0), False)
    assert ex.answer == '{"answer": 85}' and ex.user.startswith(("What is", "Compute", "37"))
    prompt = renderer.tokenizer.decode(renderer.prompt_ids(ex), skip_special_tokens=False)
    assert "designed to output JSON" in prompt  # recipe's JSON-mode system prompt, as served
    completion = renderer.tokenizer.decode(renderer.completion_ids(ex), skip_special_tokens=False)
    assert completion == '{"answer": 85}<｜end▁of▁sentence｜>'
    thinking = D.make_example("json", (37, 48), random.Random(0), True)
    completion = renderer.tokenizer.decode(renderer.completion_ids(thinking), skip_special_tokens=False)
    assert completion.endswith('37 + 48 = 85.</think>{"answer": 85}<｜end▁of▁sentence｜>'), completion
    rng = random.Random(3)
    assert all(D.training_items(rng, "json", held) not in set(held["json"]) for _ in range(300))


def test_reindex_vocabulary_keeps_shared_rows_in_their_new_places():
    from deepinfer.tools.demo_model.train import reindex_vocabulary

    old, new = [0, 5, 7, 9], [0, 3, 5, 9, 12]  # 7 dropped, 3 and 12 new
    state = {"embed": torch.arange(5.0)[:, None].repeat(1, 2), "route": torch.tensor([[1], [2], [3], [4], [5]]),
             "other": torch.ones(3)}
    fresh = {"embed": torch.full((6, 2), -1.0), "route": torch.zeros(6, 1, dtype=torch.long), "other": torch.zeros(3)}
    out = reindex_vocabulary(state, old, new, fresh)
    assert out["embed"][:, 0].tolist() == [0.0, -1.0, 1.0, 3.0, -1.0, 4.0]  # ids 0, 3 (new), 5, 9, 12 (new), unused row
    assert out["route"][:, 0].tolist() == [1, 0, 2, 4, 0, 5]
    assert out["other"] is state["other"]


def test_soup_averages_float_tensors_by_normalized_weight_and_refuses_differing_int_tables():
    from deepinfer.tools.demo_model.soup import average, parse_mix

    assert parse_mix("E:1,A:0.5,B") == [("E", 1.0), ("A", 0.5), ("B", 1.0)]
    table = torch.tensor([[0, 1], [1, 2]])
    states = {"E": {"w": torch.zeros(2, 3), "tid2eid": table},
              "A": {"w": torch.full((2, 3), 3.0), "tid2eid": table.clone()}}
    out = average(states, parse_mix("E:2,A:1"))
    assert torch.allclose(out["w"], torch.ones(2, 3)) and torch.equal(out["tid2eid"], table)
    states["A"]["tid2eid"] = table.flip(0)
    with pytest.raises(ValueError, match="tid2eid differs"):
        average(states, parse_mix("E:1,A:1"))


def test_held_out_tool_examples_ask_every_place_with_every_phrasing():
    exs = D.held_out_tool_examples(random.Random(0), thinking=True)
    places = D.held_out()["tool"]
    assert len(exs) == len(places) * len(D.TOOL_TEMPLATES)
    assert {(ex.answer, ex.user) for ex in exs} == {(p, t.format(c=p)) for p in places for t in D.TOOL_TEMPLATES}
    assert all(ex.thinking and ex.task == "tool" and ex.answer in ex.reasoning for ex in exs)
