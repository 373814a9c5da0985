"""Batch-invariant mode with the persistent KV store tier (issue 23: "store hit vs miss").

A first engine computes a prompt and writes its full blocks to an embedded store in a tmp dir; a fresh engine
over the same directory (empty pools, as after a restart) loads the stored prefix, rebuilds the bounded state
by bounded replay over the window before it and prefills the rest. With `batch_invariant=True` that request
must give the cold run's tokens and bit-identical (`torch.equal`) prompt and generated logprobs, although the
hit computes the prompt in different pieces (replay window + suffix instead of one prefill); and seeded
temperature-1 sampling must draw the same tokens with and without the hit. With the mode off the generated
logprobs of the hit differ from the cold run's (so the first test can fail).

NOTE: prompt logprobs come from a separate scratch pass over the whole prompt (`Engine.prompt_logprobs`), which
a store hit does not change; the hit is seen in the generated logprobs, which the replayed/loaded KV feeds.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine import SamplingParams
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.kv_connector.store_connector import attach_store
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.kvstore import KVStore, KVStoreConfig

PROMPT = [(i * 37 + 11) % 500 + 3 for i in range(150)]  # 2 full blocks of 64 loadable, 22 tokens after them
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2)
SEEDED = SamplingParams(temperature=1.0, seed=4321, max_tokens=8, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("bi-store"), preset="tiny", seed=5))


def _engine(ckpt: str, store_dir=None, batch_invariant: bool = True):
    engine = Engine(EngineConfig(model=ckpt, max_num_seqs=4, batch_invariant=batch_invariant))
    conn = None if store_dir is None else attach_store(engine, KVStore(KVStoreConfig(directories=(str(store_dir),))))
    return engine, conn


def _run(engine: Engine, params: SamplingParams):
    """Drive the engine until the request is done and every store pin is released."""
    rid = engine.add_request(None, {"prompt_token_ids": PROMPT}, params)
    out = None
    while out is None or engine.num_kv_holds:
        engine.poll_kv_connector()
        if engine.has_runnable_requests():
            for o in engine.step():
                if o.request_id == rid and o.finished:
                    out = o
    return out


def _fingerprint(out) -> tuple[list[int], torch.Tensor]:
    """Generated ids and every logprob reported (sampled, top, then prompt) as one float64 tensor."""
    co = out.outputs[0]
    vals = []
    for lp in co.logprobs:
        vals += [lp.logprob, *lp.top_logprobs]
    for lp in (out.prompt_logprobs or [None])[1:]:
        vals += [lp.logprob, *lp.top_logprobs]
    return list(co.token_ids), torch.tensor(vals, dtype=torch.float64)


@pytest.fixture(scope="module")
def runs(ckpt, tmp_path_factory):
    """Cold (no store), the filling run (store attached, miss) and the hit on a fresh engine, per params."""
    store_dir = tmp_path_factory.mktemp("bi-store-dir")
    cold_engine, _ = _engine(ckpt)
    cold = {name: _fingerprint(_run(cold_engine, p)) for name, p in (("greedy", GREEDY), ("seeded", SEEDED))}
    filler, conn_a = _engine(ckpt, store_dir)
    miss = _fingerprint(_run(filler, GREEDY))
    assert conn_a.store.flush(20.0) and conn_a.store.stats()["blocks"] == len(PROMPT) // 64
    conn_a.store.close()
    hits, loaded = {}, {}
    for name, p in (("greedy", GREEDY), ("seeded", SEEDED)):
        engine, conn = _engine(ckpt, store_dir)  # a fresh engine each time, so the store (not the pool) serves it
        out = _run(engine, p)
        loaded[name] = conn.pop_loaded_tokens(out.request_id)
        hits[name] = _fingerprint(out)
        conn.store.close()
    return cold, miss, hits, loaded


def test_store_hit_logprobs_bit_identical_to_cold_run(runs):
    cold, miss, hits, loaded = runs
    assert loaded["greedy"] == 2 * 64, "the prefix was not served by the store"
    ref_ids, ref = cold["greedy"]
    assert miss[0] == ref_ids and torch.equal(miss[1], ref), "attaching a store (a miss) changed the result"
    ids, lps = hits["greedy"]
    assert ids == ref_ids
    assert lps.shape == ref.shape
    assert torch.equal(lps, ref), f"store hit vs cold: max |diff| {(lps - ref).abs().max().item():.3g}"


def test_seeded_sampling_same_tokens_with_and_without_store_hit(runs):
    cold, _, hits, loaded = runs
    assert loaded["seeded"] == 2 * 64
    assert hits["seeded"][0] == cold["seeded"][0]
    assert torch.equal(hits["seeded"][1], cold["seeded"][1])


def test_store_hit_differs_from_cold_run_with_the_mode_off(ckpt, tmp_path):
    cold_engine, _ = _engine(ckpt, batch_invariant=False)
    ref_ids, ref = _fingerprint(_run(cold_engine, GREEDY))
    filler, conn_a = _engine(ckpt, tmp_path, batch_invariant=False)
    _run(filler, GREEDY)
    assert conn_a.store.flush(20.0)
    conn_a.store.close()
    engine, conn = _engine(ckpt, tmp_path, batch_invariant=False)
    out = _run(engine, GREEDY)
    assert conn.pop_loaded_tokens(out.request_id) == 2 * 64
    conn.store.close()
    _, lps = _fingerprint(out)
    n_gen = 3 * GREEDY.max_tokens  # sampled + 2 top logprobs per generated token
    assert not torch.equal(lps[:n_gen], ref[:n_gen]), "mode off matched bit for bit: the test above cannot fail"
