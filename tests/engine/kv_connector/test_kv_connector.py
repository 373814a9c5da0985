"""The KV connector seam in-process (no NIXL): the engine's one path for KV from / to outside.

A `CopyConnector` pair stands in for a transport: the save side copies a prompt's blocks (and
state slot) out of the prefill engine's pools into a "wire" dict, the load side copies them into
the decode engine's reserved blocks, both through the cache layout's descriptors. The tests drive
the state machine (reserve/allocate -> load -> commit, save -> pin -> saved, failures, aborts,
quarantines) and check that no block or slot leaks; and that the layout descriptors equal the
byte arithmetic they replaced.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.engine import LLM, SamplingParams
from deepinfer.engine.cache.block_pool import NoFreeBlocksError
from deepinfer.engine.cache.kv_cache import V4KVCache
from deepinfer.engine.cache.layout import CacheLayout, PoolLayout, exact_replay_tokens
from deepinfer.engine.engine import Engine, EngineConfig
from deepinfer.engine.kv_connector import KVConnector, KVConnectorEvents, KVLoadSpec, KVSaveSpec
from deepinfer.engine.model_runner import exact_replay_tokens as runner_exact_replay_tokens
from deepinfer.engine.testing.make_checkpoint import make_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=7))


@pytest.fixture(scope="module")
def engines(ckpt):
    return Engine(EngineConfig(model=ckpt, max_num_seqs=4)), Engine(EngineConfig(model=ckpt, max_num_seqs=4))


class CopyConnector(KVConnector):
    """Both roles over plain tensor copies; events are queued by the test (or by a finished copy)."""

    def __init__(self, cache: V4KVCache) -> None:
        self.cache = cache
        self.loads: dict[str, KVLoadSpec] = {}
        self.saves: dict[str, KVSaveSpec] = {}
        self.started_loads: dict[str, tuple[list[int], int | None]] = {}
        self.started_saves: dict[str, tuple[list[int], int | None, list[int]]] = {}
        self.wire: dict[str, dict] = {}
        self.events = KVConnectorEvents()
        self.quarantine_on_abort = False
        self.keep_pin_on_abort = False
        self.aborted_loads: list[str] = []

    # scheduler side
    def get_load(self, req_id, prompt_token_ids):
        return self.loads.get(req_id)

    def get_save(self, req_id):
        return self.saves.get(req_id)

    def abort_load(self, req_id):
        self.aborted_loads.append(req_id)
        self.started_loads.pop(req_id, None)
        return f"q-{req_id}" if self.quarantine_on_abort else None

    def abort_save(self, req_id):
        return self.keep_pin_on_abort and req_id in self.started_saves

    # worker side
    def start_load(self, req_id, block_ids, state_slot):
        self.started_loads[req_id] = (list(block_ids), state_slot)

    def start_save(self, req_id, block_ids, state_slot, output_token_ids):
        self.started_saves[req_id] = (list(block_ids), state_slot, list(output_token_ids))

    def poll(self):
        ev, self.events = self.events, KVConnectorEvents()
        return ev

    # the "transport"
    def read_out(self, req_id: str, num_blocks: int) -> dict:
        """Copy a started save's blocks (and slot) out of the pools, as bytes, by the layout's descriptors."""
        block_ids, slot, tokens = self.started_saves[req_id]
        out = {"tokens": tokens, "pools": {}}
        for name, pool in self.cache.pool_layouts.items():
            raw = getattr(self.cache, name).view(-1).view(torch.uint8)
            units = [slot] if pool.is_state else block_ids[:num_blocks]
            if pool.is_empty or units == [None]:
                continue
            out["pools"][name] = [raw[off:off + n].clone() for (_, off, n) in pool.byte_ranges(units)]
        return out

    def write_in(self, req_id: str, data: dict) -> None:
        block_ids, slot = self.started_loads[req_id]
        for name, chunks in data["pools"].items():
            pool = self.cache.pool_layouts[name]
            if pool.is_state and slot is None:
                continue
            raw = getattr(self.cache, name).view(-1).view(torch.uint8)
            units = [slot] if pool.is_state else block_ids
            for (_, off, n), chunk in zip(pool.byte_ranges(units), chunks):
                raw[off:off + n] = chunk


def _fresh(engine: Engine) -> CopyConnector:
    conn = CopyConnector(engine.cache)
    engine.set_kv_connector(conn)
    return conn


def _all_free(engine: Engine) -> bool:
    return (engine.num_free_kv_blocks == engine.num_kv_blocks
            and engine.slots.num_free_slots == engine.config.max_num_seqs and engine.num_kv_holds == 0)


def _drain(engine: Engine) -> dict:
    outs = {}
    while engine.has_runnable_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


@pytest.mark.parametrize("with_state", [False, True])
def test_save_then_load_equals_offline(engines, ckpt, with_state):
    """allocate -> load -> commit on D, compute -> pin -> save on P: the same tokens as one engine."""
    p_eng, d_eng = engines
    p_conn, d_conn = _fresh(p_eng), _fresh(d_eng)
    prompt = list(range(5, 5 + 150))
    ref = LLM(ckpt).generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    rid = f"r-{with_state}"

    d_conn.loads[rid] = KVLoadSpec(len(prompt), with_state=with_state)
    d_eng.add_request(rid, {"prompt_token_ids": prompt}, GREEDY)
    block_ids, slot = d_conn.started_loads[rid]
    assert len(block_ids) == d_eng.num_kv_blocks_for(len(prompt)) and (slot is not None) == with_state
    assert d_eng.num_loading_kv == 1 and not d_eng.has_runnable_requests()
    assert d_eng.num_free_kv_blocks == d_eng.num_kv_blocks - len(block_ids)

    p_conn.saves[rid] = KVSaveSpec(with_state=with_state)
    p_eng.add_request(rid, {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=1))
    outs = _drain(p_eng)
    assert outs[rid].finished and rid in p_conn.started_saves
    pinned, p_slot, tokens = p_conn.started_saves[rid]
    assert tokens == ref[:1] and (p_slot is not None) == with_state
    assert p_eng.num_kv_holds == 1 and p_eng.num_free_kv_blocks < p_eng.num_kv_blocks  # pinned past the request
    data = p_conn.read_out(rid, len(block_ids))
    p_conn.events.saved.append(rid)
    assert p_eng.poll_kv_connector().saved == [rid]
    assert _all_free(p_eng)

    d_conn.write_in(rid, data)
    tokens_before = d_eng.timings["tokens"]
    d_conn.events.loaded[rid] = data["tokens"]
    res = d_eng.poll_kv_connector()
    assert res.outputs == [] and d_eng.num_loading_kv == 0
    out = _drain(d_eng)[rid]
    assert out.outputs[0].token_ids == ref
    computed = d_eng.timings["tokens"] - tokens_before
    assert (computed == len(ref) - 1) == with_state  # with the state: no bounded replay
    assert _all_free(d_eng)


def test_load_failure_frees_blocks_and_slot(engines):
    _, d_eng = engines
    conn = _fresh(d_eng)
    conn.loads["f"] = KVLoadSpec(40, with_state=True)
    d_eng.add_request("f", {"prompt_token_ids": list(range(3, 43))}, GREEDY)
    assert not _all_free(d_eng)
    conn.events.load_failed["f"] = "peer gone"
    res = d_eng.poll_kv_connector()
    assert res.load_failed == {"f": "peer gone"} and conn.aborted_loads == ["f"]
    assert not d_eng.has_unfinished_requests() and _all_free(d_eng)
    # a late "loaded" for the dead request is ignored
    conn.events.loaded["f"] = [1]
    assert d_eng.poll_kv_connector().outputs == [] and _all_free(d_eng)


def test_abort_during_load_quarantines_until_released(engines):
    _, d_eng = engines
    conn = _fresh(d_eng)
    conn.quarantine_on_abort = True
    conn.loads["a"] = KVLoadSpec(70, with_state=True)
    d_eng.add_request("a", {"prompt_token_ids": list(range(3, 73))}, GREEDY)
    num_blocks = len(conn.started_loads["a"][0])
    assert d_eng.abort_request("a")
    # the blocks and the slot stay out of circulation (a WRITE may still land) ...
    assert d_eng.num_free_kv_blocks == d_eng.num_kv_blocks - num_blocks and d_eng.num_kv_holds == 1
    assert d_eng.slots.num_free_slots == d_eng.config.max_num_seqs - 1
    assert not d_eng.has_unfinished_requests()
    d_eng.poll_kv_connector()
    assert d_eng.num_kv_holds == 1
    # ... until the connector releases the key
    conn.events.released.append("q-a")
    d_eng.poll_kv_connector()
    assert _all_free(d_eng)


def test_abort_during_load_without_quarantine_frees_at_once(engines):
    _, d_eng = engines
    conn = _fresh(d_eng)
    conn.loads["b"] = KVLoadSpec(10)
    d_eng.add_request("b", {"prompt_token_ids": list(range(3, 13))}, GREEDY)
    assert d_eng.abort_request("b") and _all_free(d_eng)


def test_refused_load_reserves_nothing(ckpt):
    small = Engine(EngineConfig(model=ckpt, max_num_seqs=2, num_blocks=3, block_size=64))
    conn = _fresh(small)
    prompt = list(range(2, 2 + 4 * 64))  # 4 blocks: more than the pool has
    conn.loads["big"] = KVLoadSpec(len(prompt))
    with pytest.raises(NoFreeBlocksError):
        small.add_request("big", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1))
    assert not small.has_unfinished_requests() and _all_free(small) and "big" not in conn.started_loads


def test_imported_first_token_can_finish_the_request(engines):
    _, d_eng = engines
    conn = _fresh(d_eng)
    conn.loads["one"] = KVLoadSpec(20)
    d_eng.add_request("one", {"prompt_token_ids": list(range(3, 23))},
                      SamplingParams(temperature=0.0, max_tokens=1))
    conn.events.loaded["one"] = [42]
    [out] = d_eng.poll_kv_connector().outputs
    assert out.finished and out.outputs[0].token_ids == [42] and out.outputs[0].finish_reason == "length"
    assert _all_free(d_eng)


def test_save_pin_outlives_abort_until_the_connector_reports(engines):
    p_eng, _ = engines
    conn = _fresh(p_eng)
    conn.keep_pin_on_abort = True
    for rid, event in (("s-ok", "saved"), ("s-bad", "save_failed")):
        conn.saves[rid] = KVSaveSpec(with_state=True)
        p_eng.add_request(rid, {"prompt_token_ids": list(range(9, 60))}, SamplingParams(temperature=0.0, max_tokens=1))
        _drain(p_eng)
        assert rid in conn.started_saves and p_eng.num_kv_holds == 1
        p_eng.abort_request(rid)  # the save is "in flight": the pin stays
        assert p_eng.num_kv_holds == 1 and p_eng.slots.num_free_slots == p_eng.config.max_num_seqs - 1
        if event == "saved":
            conn.events.saved.append(rid)
            assert p_eng.poll_kv_connector().saved == [rid]
        else:
            conn.events.save_failed[rid] = "link down"
            assert p_eng.poll_kv_connector().save_failed == {rid: "link down"}
        assert _all_free(p_eng)
    # a save that never started (aborted before its prompt ran) leaves nothing behind
    conn.saves["s-early"] = KVSaveSpec()
    p_eng.add_request("s-early", {"prompt_token_ids": [4, 5, 6]}, SamplingParams(max_tokens=1))
    p_eng.abort_request("s-early")
    assert "s-early" not in conn.started_saves and _all_free(p_eng)


def test_by_hand_reserve_and_hold_share_the_path(engines):
    """`reserve_kv` / `commit_kv` and `hold_kv` / `release_kv` without a connector use the same holds."""
    p_eng, d_eng = engines
    d_eng.set_kv_connector(None)
    p_eng.set_kv_connector(None)
    d_eng.reserve_kv("h", list(range(3, 40)), GREEDY, 37, with_state=True)
    assert d_eng.kv_state_slot("h") is not None and d_eng.num_loading_kv == 1
    d_eng.abort_request("h")
    assert _all_free(d_eng)
    p_eng.add_request("h", {"prompt_token_ids": list(range(3, 40))}, SamplingParams(max_tokens=1),
                      hold_kv=True, hold_state=True)
    [out] = [o for o in _drain(p_eng).values()]
    assert out.kv_block_ids and out.kv_state_slot is not None and p_eng.num_kv_holds == 1
    p_eng.release_kv("h")
    assert _all_free(p_eng)


# ---------------------------------------------------------------------------------------- the layout


def _old_block_byte_ranges(cache: V4KVCache, block_ids):
    """The byte arithmetic `V4KVCache.block_byte_ranges` did before the layout owned it."""
    out = []
    for name, pool in cache.compressed_pools().items():
        if pool.numel() == 0:
            continue
        per_block = pool[0, 0].numel() * pool.element_size()
        per_layer = pool.shape[1] * per_block
        for layer in range(pool.shape[0]):
            for b in block_ids:
                out.append((name, b, layer * per_layer + b * per_block, per_block))
    return out


def _old_region_descs(tensor: torch.Tensor, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The byte arithmetic `kv_transfer.RegionLayout` did before it consumed the layout's descriptors."""
    unit = tensor[0, 0].numel() * tensor.element_size()
    layers = np.arange(tensor.shape[0], dtype=np.int64)
    addr = tensor.data_ptr() + layers[:, None] * tensor.shape[1] * unit + starts[None, :] * unit
    out = np.empty((addr.size, 3), dtype=np.uint64)
    out[:, 0] = addr.ravel()
    out[:, 1] = np.broadcast_to(lengths[None, :] * unit, addr.shape).ravel()
    out[:, 2] = 0
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layout_descriptors_equal_the_old_arithmetic(engines, dtype):
    config = engines[0].model_config
    cache = V4KVCache(config, num_blocks=9, block_size=64, num_slots=3, dtype=dtype)
    lay = CacheLayout.from_config(config)
    assert exact_replay_tokens(config) == runner_exact_replay_tokens(config) == engines[0].replay_tokens
    D, ID, W, rc, rh = config.head_dim, config.index_head_dim, config.sliding_window, lay.csa_rate, lay.hca_rate
    old_shapes = {
        "csa_entries": (lay.num_csa_layers, 9, 64 // rc, D), "index_entries": (lay.num_csa_layers, 9, 64 // rc, ID),
        "hca_entries": (lay.num_hca_layers, 9, 64 // rh, D), "window_kv": (config.num_hidden_layers, 3, W, D),
        "csa_buf_kv": (lay.num_csa_layers, 3, 2 * rc, 2 * D), "csa_buf_gate": (lay.num_csa_layers, 3, 2 * rc, 2 * D),
        "index_buf_kv": (lay.num_csa_layers, 3, 2 * rc, 2 * ID),
        "index_buf_gate": (lay.num_csa_layers, 3, 2 * rc, 2 * ID),
        "hca_buf_kv": (lay.num_hca_layers, 3, rh, D), "hca_buf_gate": (lay.num_hca_layers, 3, rh, D),
    }
    tensors = {**cache.compressed_pools(), **cache.state_tensors()}
    assert {n: tuple(t.shape) for n, t in tensors.items()} == old_shapes
    assert {n: p.shape for n, p in cache.pool_layouts.items()} == old_shapes
    for ids in ([0], [3, 4, 5, 8], list(range(9))):
        assert cache.block_byte_ranges(ids) == _old_block_byte_ranges(cache, ids)
    from deepinfer.kv_transfer.agent import RegionLayout, layout_from_wire

    starts, lengths = np.array([0, 4, 7]), np.array([2, 1, 2])
    for name, pool in cache.pool_layouts.items():
        tensor = tensors[name]
        if pool.is_empty:
            continue
        region = RegionLayout.of(tensor, pool)
        assert (region.unit_nbytes, region.layer_nbytes, region.nbytes) == (
            tensor[0, 0].numel() * tensor.element_size(), tensor[0].numel() * tensor.element_size(),
            tensor.numel() * tensor.element_size())
        s, n = (starts, lengths) if not pool.is_state else (np.array([1]), np.array([2]))
        assert np.array_equal(region.descs(s, n), _old_region_descs(tensor, s, n)), name
        # the wire message round-trips
        wire = layout_from_wire({name: region.__dict__})
        assert wire[name] == region
        from deepinfer.protos import kv_transfer_pb2

        msg = kv_transfer_pb2.KVLayout(regions=[region.to_proto(name)]).SerializeToString()
        assert layout_from_wire(msg) == {name: region}
    assert lay.compressed_bytes_per_token(cache.dtype.itemsize) * 64 == sum(
        p.unit_nbytes * p.num_layers for p in cache.pool_layouts.values() if not p.is_state)
    with pytest.raises(ValueError, match="multiple of every compress rate"):
        V4KVCache(config, num_blocks=2, block_size=rc * rh + 1, num_slots=1)
    assert isinstance(next(iter(cache.pool_layouts.values())), PoolLayout)


def test_transfer_notice_round_trips():
    from deepinfer.kv_transfer.pd_connector import decode_notice, encode_notice

    assert decode_notice(encode_notice([7])) == [7]
    assert decode_notice(b"") == []
