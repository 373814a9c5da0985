"""V4.1 through the paged engine: the cache anatomy (`engine.cache.v41`), the paged step of
`engine.models.deepseek_v41` (chunked prefill, batched decode rows, prefix hits with frozen entries and
replay, Engram history per slot) against `forward_full`, and `LLM(...).generate` on the published-layout tiny
checkpoint (greedy tokens = the argmax of `forward_full` over each prefix). Tiny random model, float32, CPU."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.cache.layout import exact_replay_tokens
from deepinfer.engine.cache.v41 import V41CacheLayout, V41KVCache
from deepinfer.engine.config import V41Config
from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk
from deepinfer.engine.loader import CheckpointError, load_checkpoint
from deepinfer.engine.models.deepseek_v41 import engram_token_map_for, load_published
from deepinfer.engine.testing.make_checkpoint import make_checkpoint, random_v41_model
from tests.engine.v41.configs import flash_config, tiny_config

BLOCK = 4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return random_v41_model(V41Config.from_hf_dict(tiny_config()), seed=11).eval()


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _full(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.forward_full(torch.tensor(ids))


class Driver:
    """Runs the model's paged step over a private `V41KVCache`: one slot and a block table per sequence."""

    def __init__(self, model, num_seqs: int, max_len: int = 64) -> None:
        per = -(-max_len // BLOCK)
        self.model = model
        self.cache = V41KVCache(model.config, per * num_seqs, BLOCK, num_seqs)
        self.tables = [list(range(i * per, (i + 1) * per)) for i in range(num_seqs)]
        self.lens = [0] * num_seqs
        self.state_start = [0] * num_seqs
        self.frozen = [0] * num_seqs

    def step(self, work: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """One step over `(seq, new ids)` pairs; the logits of every new token, per pair."""
        seqs = [SeqChunk(i, self.tables[i], self.lens[i], len(ids), self.state_start[i], self.frozen[i])
                for i, ids in work]
        batch = ForwardBatch.build([ids for _, ids in work], seqs, logits="all")
        batch.attn_metadata = self.model.build_attention_metadata(batch, self.cache)
        logits = self.model.step(batch, self.cache)
        out, off = [], 0
        for i, ids in work:
            out.append(logits[off:off + len(ids)])
            off += len(ids)
            self.lens[i] += len(ids)
        return out


def test_cache_layout_follows_kv_source_ownership():
    flash = V41Config.from_hf_dict(flash_config())
    lay = V41CacheLayout.from_config(flash)
    pools = lay.pools(num_blocks=2, block_size=64, num_slots=3, itemsize=2)
    assert lay.pool_ratios == (2, 1) and lay.sources_per_ratio == (3, 1)
    assert pools["entries_r2"].shape == (3, 2, 32, 512) and pools["index_keys_r2"].shape == (3, 2, 32, 128)
    assert pools["entries_r1"].shape == (1, 2, 64, 512) and pools["window_kv"].shape == (40, 3, 128, 512)
    assert "comp_gate_r1" not in pools and pools["comp_gate_r2"].shape == (3, 3, 2, 512)
    assert pools["engram_tokens"].shape == (1, 3, 3) and pools["engram_tokens"].is_state
    assert [lay.source_row[i] for i in (0, 2, 7, 8, 19, 20, 39)] == [-1, 0, 0, 1, 2, 0, 0]
    # BF16 entries + index keys of the 4 sources: 3 x 640 / 2 + 640 per token, x 2 bytes
    assert lay.compressed_bytes_per_token(2) == 3200
    with pytest.raises(ValueError, match="multiple of every compress ratio"):
        lay.check_block_size(63)
    # replay covers the window rings, the compressor buffers and the Engram history
    assert exact_replay_tokens(flash) == 40 * 127 + 2 * 2 + 3


def test_fit_counts_the_dequantized_weights(tmp_path):
    """The loader holds V4.1's FP8 / FP4 weights dequantized: the memory plan counts them so."""
    from deepinfer.engine.fit import checkpoint_weight_bytes

    ck = make_checkpoint(tmp_path / "ck", format="published-v41", seed=1)
    wb = checkpoint_weight_bytes(ck, torch.float32, dequantized=True)
    assert wb.expert_bytes + wb.other_bytes == 4 * sum(p.numel() for p in load_published(ck).parameters())


def test_chunked_prefill_and_batched_decode_match_forward_full(model):
    """Three requests of 3, 11 and 19 prompt tokens (window 4, blocks of 4) prefilled in uneven chunks mixed with
    other requests' decode rows, then decoded together: every token's logits equal `forward_full`'s."""
    prompts = [_ids(3, 1), _ids(11, 2), _ids(19, 3)]
    gen = [_ids(6, 4 + i) for i in range(3)]
    d = Driver(model, 3)
    got: list[list[torch.Tensor]] = [[], [], []]
    plan = [[(0, prompts[0]), (1, prompts[1][:5]), (2, prompts[2][:2])],
            [(0, gen[0][:1]), (1, prompts[1][5:]), (2, prompts[2][2:9])],
            [(0, gen[0][1:2]), (2, prompts[2][9:])]]
    for work in plan:
        for (i, _), lg in zip(work, d.step(work)):
            got[i].append(lg)
    done = {0: 2, 1: 0, 2: 0}
    for t in range(4):
        work = [(i, [gen[i][done[i] + t]]) for i in range(3)]
        for (i, _), lg in zip(work, d.step(work)):
            got[i].append(lg)
    for i in range(3):
        seq = prompts[i] + gen[i][: done[i] + 4]
        ours = torch.cat(got[i])
        torch.testing.assert_close(ours, _full(model, seq)[: ours.shape[0]], rtol=1e-4, atol=1e-4)


def test_prefix_hit_reads_frozen_entries_and_replays_state(model):
    """A second request sharing 44 tokens (11 blocks) with the first: it reads those blocks' entries (frozen, not
    rewritten) and replays the exact number of tokens before them (30: from position 14) to rebuild its rings,
    compressor buffers and Engram history."""
    a = _ids(50, 7)
    b = a[:44] + _ids(9, 8)
    d = Driver(model, 2)
    d.step([(0, a)])
    hit = 44
    d.tables[1][: hit // BLOCK] = d.tables[0][: hit // BLOCK]  # shared blocks
    start = hit - exact_replay_tokens(model.config)
    assert start == 14
    d.lens[1] = d.state_start[1] = start
    d.frozen[1] = hit
    before = {n: t.clone() for n, t in d.cache.compressed_pools().items()}
    (lg,) = d.step([(1, b[start:])])
    for name, t in d.cache.compressed_pools().items():  # the shared blocks are untouched
        shared = d.tables[0][: hit // BLOCK]
        assert torch.equal(t[:, shared], before[name][:, shared]), name
    full = _full(model, b)
    torch.testing.assert_close(lg[hit - start:], full[hit:], rtol=1e-4, atol=1e-4)


def test_engram_history_crosses_steps(model):
    """One token at a time from position 0: each token's n-grams read the slot's history ring."""
    ids = _ids(9, 9)
    d = Driver(model, 1)
    got = torch.cat([d.step([(0, [t])])[0] for t in ids])
    torch.testing.assert_close(got, _full(model, ids), rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- the offline engine


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("v41paged") / "ck", format="published-v41", seed=5)


def _greedy_ok(ref, prompt: list[int], tokens: list[int]) -> None:
    logits = _full(ref, prompt + tokens)[len(prompt) - 1:-1]
    assert tokens == logits.argmax(-1).tolist()


def test_llm_generate_equals_forward_full_argmax(ckpt):
    from deepinfer import LLM, SamplingParams

    ref = load_published(ckpt)
    ref.set_engram_token_map(engram_token_map_for(ckpt, ref.config))
    # the full computation (decoder-side bounded replay off: tests/engine/v41/test_decoder_replay.py has it on)
    llm = LLM(str(ckpt), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, block_size=BLOCK,
              v41_decoder_replay=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [_ids(n, 20 + n) for n in (2, 7, 23, 41)]  # window 4: all but the first are longer
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        _greedy_ok(ref, p, list(o.outputs[0].token_ids))
    # a prefix-cache hit: a new prompt sharing the 41-token prompt's first 40 tokens (10 full blocks)
    computed = llm.engine.num_computed_tokens_total
    shared = prompts[3][:40] + _ids(5, 99)
    (o,) = llm.generate([shared], params, use_tqdm=False)
    # a cold prefill computes 45 + 7 tokens; the hit skips 40 - 30 (replay) of them
    assert llm.engine.num_computed_tokens_total - computed == len(shared) - (40 - exact_replay_tokens(ref.config)) + 7
    _greedy_ok(ref, shared, list(o.outputs[0].token_ids))
    llm.shutdown()


def test_engine_refuses_what_v41_does_not_build(ckpt, tmp_path):
    from deepinfer.engine.engine import Engine

    with pytest.raises(CheckpointError, match="attention_backend='torch'"):
        load_checkpoint(ckpt, attention_backend="triton")
    with pytest.raises(ValueError, match="DSpark"):
        Engine(model=str(ckpt), speculative_tokens=1, max_model_len=64)
    # NOTE: batch_invariant=True is served now (tests/engine/v41/test_batch_invariant.py)
    # NOTE: a `vision_config` is served now (engine.models.vision_v41; tests/engine/v41/test_vision.py)


def test_prompt_logprobs_and_bfloat16(ckpt):
    """Prompt logprobs (the engine's scratch pass over a private V4.1 cache) equal `forward_full`'s; a bfloat16
    engine runs (its tokens are not compared: BF16 rounding on a random tiny model)."""
    from deepinfer import LLM, SamplingParams

    ref = load_published(ckpt)
    ref.set_engram_token_map(engram_token_map_for(ckpt, ref.config))
    prompt = _ids(12, 5)
    llm = LLM(str(ckpt), max_model_len=64, max_num_seqs=2, block_size=BLOCK)
    (o,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), use_tqdm=False)
    want = _full(ref, prompt).log_softmax(-1)
    got = [lp.logprob for lp in o.prompt_logprobs[1:]]
    torch.testing.assert_close(torch.tensor(got), want[torch.arange(11), torch.tensor(prompt[1:])], rtol=1e-4,
                               atol=1e-4)
    llm.shutdown()
    llm = LLM(str(ckpt), max_model_len=64, max_num_seqs=2, dtype="bfloat16")
    (o,) = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(o.outputs[0].token_ids) == 4 and all(0 <= t < 64 for t in o.outputs[0].token_ids)
    llm.shutdown()
