"""The store as the engine's KV connector (offline engine, tiny built-in-style model, embedded store).

A prompt served by one engine is written to the store; a fresh engine over the same directory (nothing in
memory survives, as after a restart) loads its longest stored prefix, rebuilds the bounded state by bounded
replay and must give the cold run's greedy tokens while computing fewer. A local prefix hit wins over the
store; a corrupt block shortens the loaded prefix; a store that is down serves every request from scratch.
The restart with real processes (a prefill instance stopped and started again) is test_store_cluster.py.
"""

from __future__ import annotations

import pytest

from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.kv_connector.store_connector import StoreConnector, attach_store, engine_fingerprint
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.kvstore import KVStore, KVStoreConfig, chain_keys

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = [(i * 37 + 11) % 500 + 3 for i in range(300)]  # 4 full blocks of 64 loadable, 44 tokens after them


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=7))


@pytest.fixture(scope="module")
def cold(ckpt):
    return LLM(ckpt).generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def run(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY):
    """Drive an engine with a connector until the request is done and every pin is released."""
    rid = engine.add_request(None, {"prompt_token_ids": prompt}, params)
    out = None
    while out is None or engine.num_kv_holds:
        engine.poll_kv_connector()
        if engine.has_runnable_requests():
            for o in engine.step():
                if o.request_id == rid and o.finished:
                    out = o
    return out


def _engine_with_store(ckpt, store_dir, **store_kw) -> tuple[Engine, StoreConnector]:
    engine = Engine(EngineConfig(model=ckpt, max_num_seqs=4))
    store = KVStore(KVStoreConfig(directories=(str(store_dir),), **store_kw))
    return engine, attach_store(engine, store)


def test_store_hit_equals_cold_run(ckpt, cold, tmp_path):
    eng_a, conn_a = _engine_with_store(ckpt, tmp_path)
    out = run(eng_a, PROMPT)
    assert out.outputs[0].token_ids == cold and conn_a.pop_loaded_tokens(out.request_id) == 0
    assert conn_a.store.flush(20.0) and conn_a.store.stats()["blocks"] == len(PROMPT) // 64
    # the same prompt again on A: the local prefix cache serves it, the store is not read
    again = run(eng_a, PROMPT)
    assert again.outputs[0].token_ids == cold and conn_a.pop_loaded_tokens(again.request_id) == 0
    conn_a.store.close()

    eng_b, conn_b = _engine_with_store(ckpt, tmp_path)  # a new instance: empty pools, the store on disk
    before = eng_b.timings["tokens"]
    out_b = run(eng_b, PROMPT)
    assert conn_b.pop_loaded_tokens(out_b.request_id) == 4 * 64
    assert out_b.outputs[0].token_ids == cold
    computed = eng_b.timings["tokens"] - before
    # the prompt's last 44 tokens plus the bounded replay (44 tokens) and the decode steps, not 300
    assert computed == (len(PROMPT) - 4 * 64) + eng_b.replay_tokens + len(cold) - 1
    assert out_b.num_cached_tokens == 4 * 64
    assert conn_b.store.stats()["hit_rate"]["chat"] == 1.0
    # the loaded blocks joined B's prefix cache: the next request hits locally
    again_b = run(eng_b, PROMPT)
    assert conn_b.pop_loaded_tokens(again_b.request_id) == 0 and again_b.num_cached_tokens == 4 * 64
    assert again_b.outputs[0].token_ids == cold
    conn_b.store.close()


def test_corrupt_block_shortens_the_prefix(ckpt, cold, tmp_path):
    eng_a, conn_a = _engine_with_store(ckpt, tmp_path)
    run(eng_a, PROMPT)
    conn_a.store.flush(20.0)
    keys = chain_keys(engine_fingerprint(eng_a), PROMPT, 64)
    entry = conn_a.store.index.get(keys[2].hex())
    conn_a.store.backend.tamper(keys[2].hex(), entry.ref, lambda b: b[:200] + bytes([b[200] ^ 1]) + b[201:])
    conn_a.store.close()

    eng_b, conn_b = _engine_with_store(ckpt, tmp_path)
    out = run(eng_b, PROMPT)
    assert conn_b.pop_loaded_tokens(out.request_id) == 2 * 64  # blocks 0 and 1; block 2 refused and deleted
    assert out.outputs[0].token_ids == cold
    assert conn_b.store.metrics.corrupt_blocks == 1
    conn_b.store.flush(20.0)  # the recomputed blocks were written again
    assert conn_b.store.stored_prefix(keys) == 4
    conn_b.store.close()


def test_store_down_serves_every_request(ckpt, cold, tmp_path):
    from tests.kvstore.test_store_contract import _Broken

    eng_a, conn_a = _engine_with_store(ckpt, tmp_path)
    run(eng_a, PROMPT)  # the index lists the prompt's blocks ...
    conn_a.store.close()
    engine = Engine(EngineConfig(model=ckpt, max_num_seqs=4))
    cfg = KVStoreConfig(directories=(str(tmp_path),), lookup_timeout_s=0.2)
    inner = KVStore(cfg, start_threads=False)
    store = KVStore(cfg, backend=_Broken(inner.backend, "down"))  # ... but every read and write fails
    conn = attach_store(engine, store)
    out = run(engine, PROMPT)
    assert out.outputs[0].token_ids == cold and conn.pop_loaded_tokens(out.request_id) == 0
    assert store.metrics.degraded == {"unavailable": 1}
    other = run(engine, PROMPT[:100] + [7] * 200)  # backing off: not even asked; its new blocks are dropped
    assert other.finished and store.metrics.degraded["backing_off"] == 1
    assert store.flush(20.0) and store.metrics.dropped_writes > 0
    store.close()
    inner.close()


def test_other_model_never_reads_the_blocks(ckpt, tmp_path, tmp_path_factory):
    other = str(make_checkpoint(tmp_path_factory.mktemp("tiny-other"), preset="tiny", seed=8))
    eng_a, conn_a = _engine_with_store(ckpt, tmp_path)
    run(eng_a, PROMPT)
    conn_a.store.close()
    eng_b, conn_b = _engine_with_store(other, tmp_path)
    assert engine_fingerprint(eng_b) != engine_fingerprint(eng_a)
    out = run(eng_b, PROMPT)
    assert conn_b.pop_loaded_tokens(out.request_id) == 0
    conn_b.store.close()


def test_finished_conversation_turn_is_saved_for_the_next_turn(ckpt, tmp_path):
    """What a decode instance does at the end of a chat turn (`DecodeCore`, `StoreConnector.save_computed`): the
    prompt's and the answer's full blocks, still cached in the pool after the request finished, go to the store;
    the next turn (prompt + answer + a new message) then loads the whole previous conversation on another engine
    and gives the cold run's tokens."""
    turn1 = PROMPT[:150]
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    decode = Engine(EngineConfig(model=ckpt, max_num_seqs=4))  # no connector: a decode engine's pools
    store = KVStore(KVStoreConfig(directories=(str(tmp_path),)))
    writer = StoreConnector.for_engine(decode, store)
    answer = run(decode, turn1, params).outputs[0].token_ids
    # 150 + 100 tokens, the last one's KV never computed: 249 computed, 3 full blocks of 64
    assert writer.save_computed(turn1 + answer, "agent") == 3
    assert store.flush(20.0) and store.stats()["classes"]["agent"]["blocks"] == 3
    assert writer.save_computed(turn1 + answer, "agent") == 0  # already stored: nothing written twice
    assert writer.save_computed([5] * 200) == 0  # nothing of it is cached here
    store.close()

    turn2 = turn1 + answer + [(i * 13 + 5) % 500 + 3 for i in range(40)]
    cold = LLM(ckpt).generate([{"prompt_token_ids": turn2}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    prefill, conn = _engine_with_store(ckpt, tmp_path)
    out = run(prefill, turn2)
    assert conn.pop_loaded_tokens(out.request_id) == 3 * 64 and out.num_cached_tokens == 3 * 64
    assert out.outputs[0].token_ids == cold
    conn.store.close()
