"""The batched verify path (`engine.spec_decode.verify_rows`, the torch backend's `_verify_batched`)
against the per-request prefill-chunk path: the same tokens, logprobs within float32 rounding, the
same caches.

Random `tiny` checkpoint (window 8, CSA rate 4 with the indexer, HCA rate 8): oracle drafts with
injected errors give verify chunks of every length, so windows, ring wrap-around, compressor window
ends inside a chunk and indexer selections all occur, in batches mixing verify chunks, plain decode
rows and prefill chunks (small token budget).
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.engine import SamplingParams
from deepinfer.engine.config import ModelConfig
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk
from deepinfer.engine.spec_decode.verify_rows import batch_verify_chunks
from deepinfer.engine.testing.make_checkpoint import _write_ours, random_weights
from deepinfer.engine.testing.presets import PRESETS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = {**PRESETS["tiny"].hf_config(), "num_nextn_predict_layers": 1}
    out = tmp_path_factory.mktemp("tiny")
    _write_ours(out, hf, random_weights(ModelConfig.from_hf_dict(hf), torch.float32, seed=5, mtp=True),
                torch.float32, 1 << 40)
    return str(out)


def _prompts(num: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (num,), generator=g).tolist()
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in lens]


def _run(engine: Engine, prompts, params, drafts_fn=None) -> list:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
        if drafts_fn is not None:
            for req in engine.scheduler.running.values():
                if req.spec_token_ids:
                    req.spec_token_ids = drafts_fn(req)
    return [outs[str(i)] for i in range(len(prompts))]


def _oracle(prompts, ref, k: int, error_rate: float, seed: int):
    rng = random.Random(seed)
    full = {str(i): p + r for i, (p, r) in enumerate(zip(prompts, ref))}

    def drafts(req):
        seq = full[req.req_id.split("#")[0]]
        return [t + 1 if rng.random() < error_rate else t for t in seq[req.num_tokens:req.num_tokens + k]] or [3]
    return drafts


def test_batched_verify_equals_per_chunk_verify(tiny):
    prompts = _prompts(6, 1, 40, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    ref = [o.token_ids for o in _run(Engine(EngineConfig(model=tiny, max_num_seqs=8)), prompts, params)]
    for k, budget in ((3, 2048), (7, 20)):
        got = {}
        for batched in (False, True):
            eng = Engine(EngineConfig(model=tiny, max_num_seqs=8, speculative_tokens=k, max_num_batched_tokens=budget))
            assert eng.spec.batched_verify  # the torch backend has the batched path
            eng.spec.batched_verify = batched
            got[batched] = _run(eng, prompts, params, _oracle(prompts, ref, k, 0.3, seed=k))
            m = eng.spec.metrics
            assert 0 < m.num_accepted_drafts < m.num_verified_drafts
        for a, b, r in zip(got[False], got[True], ref):
            assert a.token_ids == b.token_ids == r
            for la, lb in zip(a.logprobs, b.logprobs, strict=True):
                assert la.token_id == lb.token_id and la.top_token_ids == lb.top_token_ids
                assert abs(la.logprob - lb.logprob) <= 1e-5
                assert max(abs(x - y) for x, y in zip(la.top_logprobs, lb.top_logprobs)) <= 1e-5


def test_one_forward_batched_equals_per_chunk(tiny):
    """One target forward over verify chunks of lengths 1..4 (one a decode row), a prefill chunk beside them:
    the hidden states and every cache tensor agree within float32 rounding."""
    from deepinfer.engine.cache.kv_cache import V4KVCache

    eng = Engine(EngineConfig(model=tiny, max_num_seqs=8, speculative_tokens=3))
    model, bs = eng.model, eng.cache.block_size
    cache = V4KVCache(eng.model_config, 64, bs, 8)
    prompts = _prompts(5, 20, 40, seed=9)
    g = torch.Generator().manual_seed(1)
    tables = [list(range(8 * s, 8 * s + 8)) for s in range(5)]  # 8 blocks of `bs` tokens per slot
    seqs = [SeqChunk(s, tables[s], 0, len(p), 0) for s, p in enumerate(prompts[:4])]
    model(ForwardBatch.build(prompts[:4], seqs), cache)  # the prompts into slots 0..3
    verify_lens = [1, 2, 3, 4]
    chunks = [SeqChunk(s.slot, s.block_table, s.num_new_tokens, n, 0) for s, n in zip(seqs, verify_lens)]
    chunk_ids = [torch.randint(2, 512, (n,), generator=g).tolist() for n in verify_lens]
    chunks.append(SeqChunk(4, tables[4], 0, len(prompts[4]), 0))
    chunk_ids.append(prompts[4])
    batch = ForwardBatch.build(chunk_ids, chunks)
    before = {k: v.clone() for k, v in cache.state_tensors().items()}
    pools = {k: v.clone() for k, v in cache.compressed_pools().items()}
    outs, states = [], []
    for batched in (False, True):
        for k, v in cache.state_tensors().items():
            v.copy_(before[k])
        for k, v in cache.compressed_pools().items():
            v.copy_(pools[k])
        meta = model.build_attention_metadata(batch, cache)
        if batched:
            batch_verify_chunks(meta, {1, 2, 3})
            assert meta.verify is not None and len(meta.verify.chunks) == 3 and len(meta.prefill) == 1
        outs.append(model(batch, cache, meta))
        states.append({**{k: v.clone() for k, v in cache.state_tensors().items()},
                       **{k: v.clone() for k, v in cache.compressed_pools().items()}})
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    for k in states[0]:
        torch.testing.assert_close(states[1][k], states[0][k], rtol=1e-5, atol=1e-5)
