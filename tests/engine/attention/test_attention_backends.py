"""The attention seam: registry, per-layer specs, the step metadata, and the torch backend's invariants."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.engine.attention import (
    AttentionBackend,
    attention_backend_names,
    get_attention_backend,
    layer_specs,
    register_attention_backend,
)
from deepinfer.engine.attention.torch_backend import TorchAttentionBackend
from deepinfer.engine.cache.kv_cache import CacheLayout, V4KVCache
from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk
from deepinfer.engine.loader import load_checkpoint
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.engine.testing.model_runner import ModelRunnerForTests


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("tiny"), preset="tiny", seed=1)
    model, config = load_checkpoint(path, dtype="float32")
    return model, config


def _ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()


# --------------------------------------------------------------------------- registry


def test_registry_knows_torch_and_lists_names_on_unknown():
    assert "torch" in attention_backend_names()
    assert get_attention_backend("torch") is TorchAttentionBackend
    with pytest.raises(ValueError, match="unknown attention backend 'flash-nope'.*known: .*torch"):
        get_attention_backend("flash-nope")


def test_registry_refuses_a_second_class_under_a_taken_name():
    with pytest.raises(ValueError, match="already registered"):
        @register_attention_backend("torch")
        class Other(AttentionBackend):
            def forward(self, spec, inputs, cache, meta):
                raise NotImplementedError


def test_model_construction_rejects_unknown_backend(tiny):
    from deepinfer.engine.models.deepseek_v4 import DeepseekV4ForCausalLM

    _, config = tiny
    with pytest.raises(ValueError, match="known: .*torch"):
        DeepseekV4ForCausalLM(config, attention_backend="flash-nope")


# --------------------------------------------------------------------------- specs


def test_layer_specs_follow_the_cache_layout(tiny):
    model, config = tiny
    lay = CacheLayout.from_config(config)
    specs = layer_specs(config)
    assert [s.kind for s in specs] == list(lay.layer_kinds)
    assert [s.kind_index for s in specs] == list(lay.kind_index)
    for s in specs:
        assert s.window == config.sliding_window
        rate = {"sliding": 0, "csa": lay.csa_rate, "hca": lay.hca_rate}[s.kind]
        assert s.compress_rate == rate and s.is_compressed == (rate > 0)
        assert s.is_overlap == s.has_indexer == (s.kind == "csa")
        assert s.rope == ("main" if s.kind == "sliding" else "compress")
        if rate:
            assert s.entries_per_block(4 * rate) == 4
    # every layer's attention holds its spec and the one backend chosen at construction
    for layer, s in zip(model.model.layers, specs):
        assert layer.attn.spec == s
        assert layer.attn.backend is model.model.attention_backend
        assert hasattr(layer.attn, "compressor") == s.is_compressed
        assert hasattr(layer.attn, "indexer") == s.has_indexer
    with pytest.raises(AttributeError):
        specs[0].window = 3  # frozen


# --------------------------------------------------------------------------- metadata


def test_metadata_of_a_mixed_prefill_and_decode_batch(tiny):
    model, config = tiny
    lay = CacheLayout.from_config(config)
    rc, rh, W = lay.csa_rate, lay.hca_rate, config.sliding_window
    bs = math.lcm(rc, rh)
    cache = V4KVCache(config, 16, bs, 4)
    seqs = [
        SeqChunk(slot=2, block_table=[3, 4], num_computed_tokens=2 * rc - 1, num_new_tokens=1),  # ends a CSA window
        SeqChunk(slot=0, block_table=[0, 1, 2], num_computed_tokens=bs, num_new_tokens=5),  # prefill chunk
        SeqChunk(slot=1, block_table=[5], num_computed_tokens=2, num_new_tokens=1, state_start=1),
        # ends CSA window 0, which is frozen (shared): not rewritten
        SeqChunk(slot=3, block_table=[6], num_computed_tokens=rc - 1, num_new_tokens=1, num_frozen_tokens=bs),
    ]
    batch = ForwardBatch.build([[5], [6, 7, 8, 9, 10], [11], [12]], seqs)
    meta = model.build_attention_metadata(batch, cache)

    assert meta.num_tokens == 8 and not meta.is_pure_decode and meta.block_size == bs
    assert meta.positions.tolist() == [2 * rc - 1, bs, bs + 1, bs + 2, bs + 3, bs + 4, 2, rc - 1]
    for cos, sin in meta.rope.values():
        assert cos.shape == sin.shape == (8, config.rope_head_dim // 2)

    dm = meta.decode
    assert dm.seq_ids == [0, 2, 3]
    assert dm.rows.tolist() == [0, 6, 7]
    assert dm.pos.tolist() == [2 * rc - 1, 2, rc - 1]
    assert dm.slots.tolist() == [2, 1, 3]
    assert dm.block_tables.tolist() == [[3, 4], [5, 0], [6, 0]]  # padded with 0
    valid = dm.window_valid[W]
    assert valid.shape == (3, W)
    assert valid[1].sum().item() == 2  # positions 1, 2 are live (state_start = 1)
    assert dm.window_rows[W].tolist() == [(2 * rc - 1) % W, 2, (rc - 1) % W]
    csa = dm.compressors[(rc, True)]
    assert csa.num_done == 1 and csa.done_rows.tolist() == [0] and csa.windows.tolist() == [1]
    assert csa.cur_rows.shape == csa.prev_rows.shape == (1, rc)
    epb = bs // rc
    assert csa.pool_rows.tolist() == [3 * epb + 1]  # entry 1 of block 3
    hca = dm.compressors[(rh, False)]
    assert hca.num_done == (1 if (2 * rc) % rh == 0 else 0)
    idx = dm.compressed[rc]
    assert idx.visible.tolist() == [[True, True], [False, False], [True, False]]
    assert idx.pool_rows[0].tolist() == [3 * epb, 3 * epb + 1]
    assert dm.rope["compress"][0].shape == (3, config.rope_head_dim // 2)

    (chunk,) = meta.prefill
    assert (chunk.seq_id, chunk.start, chunk.num_tokens, chunk.rows) == (1, 1, 5, slice(1, 6))
    assert chunk.num_computed_tokens == bs and chunk.slot == 0
    win = chunk.windows[W]
    assert win.allowed.shape == (5, W) and win.num_dead_hist == 0 and win.hist_rows.shape == (W - 1,)
    cc = chunk.compressors[(rc, True)]
    num_entries = (bs + 5) // rc
    assert cc.visible.shape == (5, num_entries) and cc.entry_rows.shape == (num_entries,)
    assert cc.windows.tolist() == list(range(bs // rc, num_entries))


def test_pure_decode_metadata_and_no_host_sync_in_attention(tiny, monkeypatch):
    """A step of decode rows only: the attention backend reads no device value on the host."""
    model, config = tiny
    runner = ModelRunnerForTests(model, max_seqs=3, max_len=64)
    prompts = [_ids(n, config.vocab_size, seed=n) for n in (9, 16, 3)]
    runner.run([(i, p) for i, p in enumerate(prompts)])
    batch = runner.batch([(i, [7]) for i in range(3)])
    assert batch.attn_metadata.is_pure_decode and not batch.attn_metadata.prefill

    def forbidden(*args, **kwargs):
        raise AssertionError("host synchronisation inside the attention backend")

    real_forward = TorchAttentionBackend.forward

    def guarded(self, spec, inputs, cache, meta):
        with monkeypatch.context() as m:
            for name in ("item", "tolist", "nonzero", "__bool__", "__int__", "__index__", "cpu", "numpy"):
                m.setattr(torch.Tensor, name, forbidden)
            return real_forward(self, spec, inputs, cache, meta)

    monkeypatch.setattr(TorchAttentionBackend, "forward", guarded)
    for _ in range(2 * config.compress_rates["heavily_compressed_attention"]):  # windows end on the way
        batch = runner.batch([(i, [7]) for i in range(3)])
        runner.run_batch(batch)


# --------------------------------------------------------------------------- torch backend invariants


def test_prefill_equals_token_by_token_and_mixed_steps(tiny):
    model, config = tiny
    ids = _ids(60, config.vocab_size, seed=4)
    ref = ModelRunnerForTests(model, max_seqs=1, max_len=64).run([(0, ids)], logits="all")  # [60, vocab]
    r = ModelRunnerForTests(model, max_seqs=2, max_len=64)
    other = _ids(60, config.vocab_size, seed=5)
    rows = [r.run([(0, ids[:1]), (1, other[:30])], logits="all")[:1]]
    for k in range(1, len(ids)):  # token by token, beside another request's prefill / decode rows
        work = [(0, ids[k:k + 1])] + ([(1, other[30 + k - 1:30 + k])] if k < 31 else [])
        rows.append(r.run(work, logits="all")[:1])
    got = torch.cat(rows)
    diff = (got - ref).abs().max().item()
    assert diff <= 1e-5 * max(ref.abs().max().item(), 1.0), diff


def test_explicit_metadata_equals_metadata_built_in_the_forward(tiny):
    model, config = tiny
    ids = _ids(20, config.vocab_size, seed=6)
    a = ModelRunnerForTests(model, max_seqs=1, max_len=32)
    b = ModelRunnerForTests(model, max_seqs=1, max_len=32)
    with_meta = a.run_batch(a.batch([(0, ids)]))
    plain = ForwardBatch.build([ids], [SeqChunk(0, b.tables[0], 0, len(ids))])
    assert plain.attn_metadata is None
    without = model.step(plain, b.cache)
    assert torch.equal(with_meta, without)
    for name, t in a.cache.state_tensors().items():
        assert torch.equal(t, b.cache.state_tensors()[name]), name


def test_long_chunks_attend_in_query_blocks_with_the_same_logits(tiny, monkeypatch):
    """A chunk whose logits would pass `LOGITS_BLOCK_BYTES` is attended a block of queries at a time (bounded memory
    for long contexts); the prompt's logits are those of one block."""
    from deepinfer.engine.attention import torch_backend

    model, config = tiny
    ids = _ids(60, config.vocab_size, seed=7)
    ref = ModelRunnerForTests(model, max_seqs=1, max_len=64).run([(0, ids)], logits="all")
    monkeypatch.setattr(torch_backend, "LOGITS_BLOCK_BYTES", 4 * 7 * 64)  # a few queries a block at the tiny widths
    calls = []
    real = torch.einsum
    monkeypatch.setattr(torch, "einsum", lambda eq, *a: calls.append(eq) or real(eq, *a))
    got = ModelRunnerForTests(model, max_seqs=1, max_len=64).run([(0, ids)], logits="all")
    assert calls.count("nhd,ndw->nhw") > 2 * config.num_hidden_layers  # several blocks a layer
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
