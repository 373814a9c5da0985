"""V4.1's KV outside one engine (CPU, no NIXL): what the disaggregated path and the KV store move.

* prefill → decode by hand: engine A computes a prompt and holds its blocks (`hold_kv`) and, with
  `hold_state`, its slot; the KV sources' paged pools are copied block by block into engine B's reserved
  blocks (`reserve_kv`), and with the state every bounded-state tensor of the slot (window rings, unfinished
  groups, Engram token history). B continues from A's first token and must give one engine's greedy tokens:
  with the state moved (no replay) and without it (B replays, `exact_replay_tokens`).
* the cache presents its pools as the transfer agent and the store address them (`getattr(cache, name)`,
  `pool_layouts`, `block_byte_ranges` covering exactly the paged pools).
* the KV store: a prompt saved by one engine is loaded by a fresh one (bounded replay after the loaded blocks)
  with the cold run's greedy tokens.
The cluster over real NIXL agents is tests/e2e/test_disaggregated_v41.py.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.testing.make_checkpoint import make_checkpoint

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("v41"), preset="tiny", seed=3, format="published-v41"))


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(ckpt: str) -> Engine:
    return Engine(EngineConfig(model=ckpt, block_size=BLOCK, num_blocks=64, max_num_seqs=4))


def _drain(engine: Engine, rid: str):
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid:
                out = o
    return out


def test_cache_presents_its_pools_to_transfer_and_store(ckpt):
    cache = _engine(ckpt).cache
    paged = {n for n, p in cache.pool_layouts.items() if not p.is_state}
    state = {n for n, p in cache.pool_layouts.items() if p.is_state}
    assert paged == {"entries_r2", "index_keys_r2", "entries_r1", "index_keys_r1"}
    assert state == {"window_kv", "comp_kv_r2", "comp_gate_r2", "comp_kv_r1", "engram_tokens"}
    for name, pool in cache.pool_layouts.items():
        t = getattr(cache, name)
        assert t is cache.tensors[name] and tuple(t.shape) == pool.shape and t.is_contiguous()
        assert t.element_size() == pool.itemsize
    ranges = cache.block_byte_ranges([3, 4])
    assert {r[0] for r in ranges} == paged
    assert sum(r[3] for r in ranges) == 2 * sum(p.num_layers * p.unit_nbytes for n, p in cache.pool_layouts.items()
                                                if n in paged)


@pytest.fixture(scope="module")
def narrow_ckpt(tmp_path_factory):
    """A window of 2 tokens under 3-grams: the Engram history (2 ids) reaches further back than the window rows
    (1) a decode step reads, so an imported slot's history must start where the Engram needs it."""
    from deepinfer.engine.testing.make_checkpoint import TINY_V41_TEXT_CONFIG, write_published_v41

    return str(write_published_v41(tmp_path_factory.mktemp("v41w2"), seed=4,
                                   text_config={**TINY_V41_TEXT_CONFIG, "sliding_window": 2}))


@pytest.mark.parametrize("with_state,narrow", [(True, False), (False, False), (True, True)],
                         ids=["state-moved", "replay", "state-moved-window-2"])
def test_prefill_to_decode_by_hand_equals_one_engine(request, with_state, narrow):
    ckpt = request.getfixturevalue("narrow_ckpt" if narrow else "ckpt")
    prompts = [_prompt(n, seed=n) for n in (3, 13, 29)]
    ref = LLM(ckpt, block_size=BLOCK).generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    a, b = _engine(ckpt), _engine(ckpt)
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        a.add_request(rid, {"prompt_token_ids": prompt}, PARAMS, hold_kv=True, hold_state=with_state)
        first = None
        while first is None:
            first = next((o for o in a.step() if o.request_id == rid and o.kv_block_ids is not None), None)
        b.reserve_kv(rid, prompt, PARAMS, len(prompt), with_state=with_state)
        src, dst = first.kv_block_ids, b.kv_block_ids(rid)
        assert len(src) == len(dst) == -(-len(prompt) // BLOCK)
        for name, pool in a.cache.compressed_pools().items():
            b.cache.compressed_pools()[name][:, dst] = pool[:, src]
        if with_state:
            src_slot, dst_slot = first.kv_state_slot, b.kv_state_slot(rid)
            assert src_slot is not None and dst_slot is not None
            for name, t in a.cache.state_tensors().items():
                b.cache.state_tensors()[name][:, dst_slot] = t[:, src_slot]
        a.abort_request(rid)
        a.release_kv(rid)
        b.commit_kv(rid, first.outputs[0].token_ids)
        out = _drain(b, rid)
        assert out.outputs[0].token_ids == ref[i].outputs[0].token_ids, f"prompt {i} ({len(prompt)} tokens)"
    assert b.kv_manager.num_free_blocks == b.kv_manager.num_blocks


def test_store_hit_equals_cold_run(ckpt, tmp_path):
    from deepinfer.engine.kv_connector.store_connector import attach_store
    from deepinfer.kvstore import KVStore, KVStoreConfig

    prompt = _prompt(45, seed=9)  # 5 full blocks of 8 loadable, 5 tokens after them
    cold = LLM(ckpt, block_size=BLOCK).generate([{"prompt_token_ids": prompt}], PARAMS,
                                                use_tqdm=False)[0].outputs[0].token_ids

    def run(engine: Engine):
        rid = engine.add_request(None, {"prompt_token_ids": prompt}, PARAMS)
        out = None
        while out is None or engine.num_kv_holds:
            engine.poll_kv_connector()
            if engine.has_runnable_requests():
                out = next((o for o in engine.step() if o.request_id == rid and o.finished), out)
        return out

    a = _engine(ckpt)
    conn_a = attach_store(a, KVStore(KVStoreConfig(directories=(str(tmp_path),))))
    assert run(a).outputs[0].token_ids == cold
    assert conn_a.store.flush(20.0) and conn_a.store.stats()["blocks"] == len(prompt) // BLOCK
    conn_a.store.close()
    b = _engine(ckpt)
    conn_b = attach_store(b, KVStore(KVStoreConfig(directories=(str(tmp_path),))))
    out = run(b)
    assert conn_b.pop_loaded_tokens(out.request_id) == 5 * BLOCK and out.num_cached_tokens == 5 * BLOCK
    assert out.outputs[0].token_ids == cold
    conn_b.store.close()
