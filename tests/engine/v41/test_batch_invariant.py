"""Batch-invariant mode for DeepSeek-V4.1 (`batch_invariant=True`: `engine.batch_invariant._enable_v41`, the paged
path of `engine.models.deepseek_v41`): a request's prompt and generated logprobs are bit-identical (`torch.equal`)
alone, beside random companions, under chunked prefill at several budgets, with a prefix-cache hit, after
preemption and with `speculative="dspark"` (real drafts, nearly all rejected, and oracle drafts accepted up to a
wrong one), on tiny published-layout checkpoints whose dense linears stay FP8 (32x32 blocks) and experts MXFP4;
decoder-side bounded replay on (the default) and off. With the mode off the same comparisons differ somewhere (so
these tests can fail). Seeded sampling repeats across companions. Plus the V4.1 ops of the mode against the
model's own math.

What "batch invariant" means under decoder-side bounded replay (docs/V4_1.md §15): the layers after the last KV
source compute a request's positions from `num_prompt_tokens - sliding_window` on, a start fixed by the prompt
alone, so the generated tokens and logprobs are one function of (prompt, parameters, seed) whatever the batch,
chunking, prefix hit, preemption or speculation. Prompt logprobs come from the engine's scratch pass, which
computes every position in every layer (the full computation), so they do not depend on the step either.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.batch_invariant import BatchInvariantMode, v41_attn_output, v41_index_scores_tiled
from deepinfer.engine.config import V41Config
from deepinfer.engine.testing.make_checkpoint import (
    TINY_V41_TEXT_CONFIG,
    make_checkpoint,
    random_v41_model,
    write_published_v41,
)
from tests.engine.test_batch_invariance import (  # GREEDY: the target's parameters (logprobs and prompt logprobs)
    GREEDY,
    _assert_all_equal,
    _assert_alone_equals_beside_companions,
    _assert_seeded_sampling_repeats,
    _assert_some_differ,
    _beside_companions,
    _fingerprint,
    _preempted,
)
from tests.engine.test_batch_invariance import _companions as companions

VOCAB = 64
TARGET_LEN = 48
VARIANT = {**TINY_V41_TEXT_CONFIG, "sliding_window": 8, "index_topk": 2, "candidate_topk_blocks": 2,
           "candidate_block_size": 3, "num_experts_per_tok": 3}
"""A second random V4.1 shape: a wider window, fewer index picks, two candidate blocks of 3 entries, top-3 experts."""


def _ids(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(3, VOCAB - 1, (n,), generator=g).tolist()


TARGET = _ids(TARGET_LEN, torch.Generator().manual_seed(11))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("v41bi") / "ck", format="published-v41", seed=5))


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    return str(write_published_v41(tmp_path_factory.mktemp("v41bi_var") / "ck", seed=7, text_config=VARIANT))


@pytest.fixture(scope="module")
def dspark_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("v41bi_dspark") / "ck"
    return str(make_checkpoint(out, format="published-v41", seed=3, dspark=True))


def _companions(num: int, seed: int) -> tuple[list[dict], list[SamplingParams]]:
    """`num` greedy requests of random prompts (1 .. 59 tokens of this vocabulary) and lengths."""
    return companions(num, seed, 60, _ids)


def _cases(ckpt: str, batch_invariant: bool, decoder_replay: bool = True, dtype: str = "float32",
           full: bool = True) -> dict[str, tuple[list[int], torch.Tensor]]:
    """The target request's fingerprint in every scenario (CPU-cheap sizes; window 4 or 8, blocks of 4); `full`
    False: alone, beside 8 companions, chunked at 5 and 16 tokens, a prefix hit (no larger batch, no preemption)."""
    got = {}

    def run(name, llm, num_companions=0, seed=0, position=0):
        got[name] = _beside_companions(llm, TARGET, _companions, num_companions, seed, position)

    kw = dict(batch_invariant=batch_invariant, v41_decoder_replay=decoder_replay, block_size=4, max_model_len=128,
              dtype=dtype)
    llm = LLM(ckpt, max_num_seqs=24, **kw)
    run("alone", llm)
    run("batch 9", llm, 8, seed=2, position=4)
    if full:
        run("batch 2", llm, 1, seed=1)
        run("batch 21", llm, 20, seed=3, position=13)
    for budget in (5, 16):
        chunked = LLM(ckpt, max_num_seqs=8, max_num_batched_tokens=budget, **kw)
        run(f"chunks of {budget}, batch 4", chunked, 3, seed=4 + budget, position=1)
    # prefix-cache hit: a request sharing the first 44 tokens (11 blocks) runs first, then the target hits them
    cached = LLM(ckpt, max_num_seqs=8, enable_prefix_caching=True, **kw)
    cached.generate([{"prompt_token_ids": TARGET[:44] + [7, 8, 9]}], SamplingParams(max_tokens=1), use_tqdm=False)
    hit = cached.generate([{"prompt_token_ids": TARGET}], GREEDY, use_tqdm=False)[0]
    assert hit.num_cached_tokens > 0
    got["prefix hit"] = _fingerprint(hit)
    if full:  # preemption: a pool too small for every request at once; the target arrives last, so it is the victim
        got["preempted and recomputed (first 6 tokens)"] = _preempted(LLM(ckpt, max_num_seqs=10, num_blocks=40, **kw),
                                                                     TARGET, _companions, 5, 40, 24)
    return got


def test_logprobs_bit_identical_with_the_mode_on(ckpt):
    """Decoder-side bounded replay on (the default): every scenario gives the bits of the request alone."""
    _assert_all_equal(_cases(ckpt, batch_invariant=True))


def test_logprobs_bit_identical_on_a_second_shape_replay_off(variant):
    """Another random V4.1 shape with decoder replay off (every layer over every position)."""
    _assert_all_equal(_cases(variant, batch_invariant=True, decoder_replay=False, full=False))


def test_logprobs_bit_identical_in_bfloat16(ckpt):
    """A bfloat16 engine: decode rows and prefill chunks meet the cache's dtype at the same points (queries and keys
    in it, compressor projections rounded to its buffers, ratio-1 entries pooled in float32)."""
    _assert_all_equal(_cases(ckpt, batch_invariant=True, dtype="bfloat16", full=False))


def test_the_same_comparison_differs_with_the_mode_off(ckpt):
    _assert_some_differ(_cases(ckpt, batch_invariant=False, full=False))


def test_seeded_sampling_repeats_across_companions_and_seeds_differ(ckpt):
    llm = LLM(ckpt, batch_invariant=True, max_num_seqs=16, max_num_batched_tokens=24, block_size=4, max_model_len=128)
    _assert_seeded_sampling_repeats(llm, TARGET, _companions)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_restart_continuation_is_bit_identical_with_replay_off(ckpt, dtype):
    """Issue 23's "across a decode-worker restart" (a migration re-submits prompt + the k tokens the client has, with
    `max_tokens - k`, to another instance) with decoder-side replay off: the continuation's prefill, chunked beside
    other companions, gives the logits the original decode steps gave, so greedy and seeded tokens and every logprob
    after the restart equal the uninterrupted run's. NOTE: with replay on a continuation needs the original prompt
    length (`num_original_prompt_tokens`, else its tail starts k positions later): test_replay_continuation.py. The
    positions the original run decoded one at a time are prefill rows here: in bfloat16 both paths must meet the
    cache's dtype at the same points."""
    k, max_tokens = 4, 10
    kw = dict(batch_invariant=True, v41_decoder_replay=False, block_size=4, max_model_len=128, dtype=dtype)
    first = LLM(ckpt, max_num_seqs=8, **kw)
    second = LLM(ckpt, max_num_seqs=8, max_num_batched_tokens=16, **kw)
    for sp in (dict(temperature=0.0), dict(temperature=1.0, seed=4321)):
        prompts, params = _companions(4, seed=21)
        prompts.insert(2, {"prompt_token_ids": TARGET})
        params.insert(2, SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=2, **sp))
        full = first.generate(prompts, params, use_tqdm=False)[2].outputs[0]
        prompts, params = _companions(3, seed=22)
        prompts.insert(1, {"prompt_token_ids": TARGET + list(full.token_ids[:k])})
        params.insert(1, SamplingParams(max_tokens=max_tokens - k, ignore_eos=True, logprobs=2, prompt_logprobs=2,
                                        **sp))
        cont = second.generate(prompts, params, use_tqdm=False)[1]

        def lps(entries):
            return torch.tensor([v for lp in entries for v in (lp.logprob, *lp.top_logprobs)], dtype=torch.float64)

        assert list(cont.outputs[0].token_ids) == list(full.token_ids[k:]), sp
        assert torch.equal(lps([*cont.prompt_logprobs[len(TARGET):], *cont.outputs[0].logprobs]),
                           lps(full.logprobs)), sp


# --------------------------------------------------------------------------- speculative="dspark"


class _OracleDrafts:
    """After the real DSpark drafter ran (its rings committed), its drafts for a request whose tokens so far follow
    one of `expected` become that continuation with every third draft position wrong: acceptance then stops at
    every draft index somewhere in the run (and the compressor buffers are rebuilt after accepted positions)."""

    def __init__(self, propose, expected: list[list[int]]) -> None:
        self.real, self.expected = propose, expected

    def propose(self, features, seqs):
        drafts, probs, feats = self.real(features, seqs)
        for i, s in enumerate(seqs):
            lo, hi = s.first_pos + 1, s.first_pos + 1 + len(s.next_token_ids)
            match = [e for e in self.expected if e[lo:hi] == s.next_token_ids]
            if not drafts[i] or len(match) != 1:
                continue
            p = hi - 1  # position of the newest known token; drafts are positions p + 1 ..
            true = (match[0][p + 1:p + 1 + len(drafts[i])] + [5] * len(drafts[i]))[:len(drafts[i])]
            drafts[i] = [t if (p + j) % 3 != 2 else (t + 1) % VOCAB for j, t in enumerate(true)]
        return drafts, probs, feats


def _dspark_cases(ckpt: str, batch_invariant: bool) -> dict[str, dict[int, tuple[list[int], torch.Tensor]]]:
    """Greedy tokens + logprobs of 4 requests (3 to 47 prompt tokens, chunked prefill) without speculation, with
    the DSpark drafter's own drafts, and with oracle drafts; per case: request index -> fingerprint."""
    g = torch.Generator().manual_seed(3)
    prompts = [_ids(n, g) for n in (3, 17, 29, 47)]
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    kw = dict(batch_invariant=batch_invariant, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16,
              block_size=4)

    def run(llm):
        return {i: _fingerprint(o) for i, o in enumerate(llm.generate(prompts, sp, use_tqdm=False))}

    got = {"alone": run(LLM(ckpt, **kw))}
    llm = LLM(ckpt, speculative="dspark", num_draft_tokens=3, **kw)
    got["dspark drafts"] = run(llm)
    spec = llm.engine.spec
    spec.drafter.propose = _OracleDrafts(spec.drafter.propose, [p + got["alone"][i][0]
                                                                for i, p in enumerate(prompts)]).propose
    before = llm.engine.speculative_stats()["num_accepted_drafts"]
    got["oracle drafts"] = run(llm)
    assert llm.engine.speculative_stats()["num_accepted_drafts"] > before
    return got


def test_dspark_speculation_is_bit_identical_with_the_mode_on(dspark_ckpt):
    """Verified positions (a verify chunk runs as a prefill chunk) give the bits of plain decode steps, whether
    their drafts are rejected or accepted; with the mode off the logprobs differ somewhere."""
    got = _dspark_cases(dspark_ckpt, batch_invariant=True)
    ref = got.pop("alone")
    for name, outs in got.items():
        for i, (ids, lps) in outs.items():
            assert ids == ref[i][0], (name, i)
            assert torch.equal(lps, ref[i][1]), f"{name}: request {i}'s logprobs differ from no speculation"
    off = _dspark_cases(dspark_ckpt, batch_invariant=False)
    ref = off.pop("alone")
    assert any(not torch.equal(outs[i][1], ref[i][1]) for outs in off.values() for i in ref), (
        "with batch_invariant=False speculation matched bit for bit: the test above cannot fail")


# --------------------------------------------------------------------------- the mode's V4.1 ops


@pytest.fixture(scope="module")
def model():
    return random_v41_model(V41Config.from_hf_dict({"model_type": "deepseek_v41", "text_config": TINY_V41_TEXT_CONFIG}),
                            seed=1).eval()


def test_v41_ops_match_the_model_and_rows_do_not_depend_on_the_batch(model):
    """`v41_index_scores_tiled` and `v41_attn_output` compute the model's `Indexer.scores` / `Attention.output`
    (close), and inside the mode a row's bits do not depend on how many rows come with it or, for the indexer,
    on whether the keys are shared (a prefill chunk) or per row (decode rows) and how many columns follow."""
    g = torch.Generator().manual_seed(0)
    cfg = model.config
    attn = model.layers[2].attn
    n, C = 70, 13
    x, qr = torch.randn(n, cfg.hidden_size, generator=g), torch.randn(n, cfg.q_lora_rank, generator=g)
    keys = torch.randn(C, cfg.index_head_dim, generator=g)
    cos, sin = model._rope("compress", torch.arange(n))
    with torch.no_grad():
        want = attn.indexer.scores(x, qr, keys, cos, sin)
        out = torch.randn(n, cfg.num_attention_heads, cfg.head_dim, generator=g)
        want_o = attn.output(out, cos, sin)
        with BatchInvariantMode():
            got = v41_index_scores_tiled(attn.indexer, x, qr, keys, cos, sin)
            got_o = v41_attn_output(attn, out, cos, sin)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_o, want_o, rtol=1e-5, atol=1e-5)
            per_row = torch.cat([keys[None].expand(5, -1, -1), torch.randn(5, 9, cfg.index_head_dim, generator=g)], 1)
            rows = slice(3, 8)
            assert torch.equal(v41_index_scores_tiled(attn.indexer, x[rows], qr[rows], per_row, cos[rows],
                                                      sin[rows])[:, :C], got[rows])
            for m in (1, 2, 17):
                assert torch.equal(v41_attn_output(attn, out[5:5 + m], cos[5:5 + m], sin[5:5 + m]), got_o[5:5 + m])
            streams = torch.randn(40, 3, 24, generator=g)  # a middle-dim mean (the DSpark features), keepdim too
            full = streams.mean(dim=1)
            torch.testing.assert_close(full, streams.sum(1) / 3)
            for m in (1, 3, 17):
                assert torch.equal(streams[2:2 + m].mean(dim=1), full[2:2 + m])
                assert torch.equal(streams[2:2 + m].mean(1, keepdim=True), full[2:2 + m, None])


@pytest.mark.gpu
def test_batch_invariant_v41_on_gpu(ckpt, dspark_ckpt):
    """The same guarantee on CUDA in bfloat16 (FP8 linears through their torch reference and the fixed-tile matmul):
    a request's logprobs alone equal those beside companions, chunked, and with DSpark speculation."""
    kw = dict(batch_invariant=True, device="cuda", dtype="bfloat16", block_size=4, max_model_len=128)
    _assert_alone_equals_beside_companions(ckpt, kw, TARGET, _companions)
    ref = LLM(dspark_ckpt, **kw).generate([{"prompt_token_ids": TARGET}], GREEDY, use_tqdm=False)[0]
    llm = LLM(dspark_ckpt, speculative="dspark", num_draft_tokens=3, max_num_seqs=8, **kw)
    prompts, params = _companions(5, seed=77)
    out = llm.generate([{"prompt_token_ids": TARGET}] + prompts, [GREEDY] + params, use_tqdm=False)[0]
    (ids, lps), (ref_ids, ref_lps) = _fingerprint(out), _fingerprint(ref)
    assert ids == ref_ids and torch.equal(lps, ref_lps), "dspark speculation beside companions"
