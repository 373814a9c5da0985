"""Speculative verify rows through the `triton` attention backend's decode kernels (`TritonAttentionBackend.
_verify_batched`: each verify query a decode row; `kernels.decode_attention.verify_attention`, `indexer_topk`)
against the `torch` backend's batched verify path (the oracle).

* CPU, the kernels' torch references (what the backend runs off CUDA): the verify forward of both backends over
  ragged and static (`static_verify_metadata`, CUDA-graph padded) steps: hidden states, streams and every cache
  tensor, steps in which windows wrap, compressor windows end inside chunks and the indexer selects fewer entries
  than are visible; the op's reference against a per-row brute force;
* the Triton kernels under `TRITON_INTERPRET=1` in a subprocess: the op against its reference (one split and
  several), the same forward comparison (float32; the verify steps through `verify_attention` and `indexer_topk`,
  the prefill through the references), and speculative greedy decoding of the built-in model (MTP drafts, the
  confidence schedule) with `verify_attention` interpreted == plain decoding;
* `gpu`: the verify forward on CUDA against the torch backend (float32), and speculative greedy decoding with
  verify CUDA graphs and the triton backend == plain decoding over 64 steps.
"""

from __future__ import annotations

import dataclasses
import random
import textwrap
from pathlib import Path

import pytest
import torch

from deepinfer.engine.config import ModelConfig
from deepinfer.engine.cuda_graph import VerifyGraphRunner
from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk
from deepinfer.engine.loader import load_checkpoint
from deepinfer.engine.spec_decode.verify_rows import batch_verify_chunks
from deepinfer.engine.testing.make_checkpoint import _write_ours, random_weights
from deepinfer.engine.testing.presets import PRESETS
from deepinfer.kernels.decode_attention import decode_attention_torch, verify_attention_torch
from tests.kernels._interp import prefetch_interpreted, run_interpreted

SPLIT = 16
"""Keys per flash-decoding split: tiny rows (window 8 + up to 12 selected or ~20 HCA entries) span several."""


def write_tiny(out: Path) -> str:
    """The `tiny` preset (window 8, CSA rate 4 with the indexer, HCA rate 8) with index_topk 12 (requests past 48
    tokens select fewer entries than are visible), random float32 weights."""
    hf = {**PRESETS["tiny"].hf_config(), "index_topk": 12}
    _write_ours(out, hf, random_weights(ModelConfig.from_hf_dict(hf), torch.float32, seed=5), torch.float32, 1 << 40)
    return str(out)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("tiny_vk"))


def use_impl(backend, impl: str | None, device: str) -> None:
    """Set the triton backend's op choice: None (each op's default on the device), "triton" (every kernel),
    "verify" (the verify path's kernels, `verify_attention` and `indexer_topk`, the other ops' defaults) or
    "attention" (`verify_attention` alone): the last two keep the interpreted runs short (the indexer's top-k kernel
    sorts `index_topk` = 128 picks per row in the built-in model, seconds a step under the interpreter)."""
    from deepinfer.kernels.registry import get_op

    backend._ops.clear()
    backend.impl = "triton" if impl == "triton" else None
    if impl in ("verify", "attention"):
        dev = torch.device(device)
        ops = {"verify_attention": get_op("verify_attention", "triton")}
        if impl == "verify":
            ops["indexer_topk"] = get_op("indexer_topk", "triton")
        backend._ops[dev] = dataclasses.replace(backend.ops_for(dev), **ops)


def _state(cache) -> dict[str, torch.Tensor]:
    return {**{k: v.clone() for k, v in cache.state_tensors().items()},
            **{k: v.clone() for k, v in cache.compressed_pools().items()}}


def verify_forward_diff(path: str, impl: str | None, static: bool | tuple[bool, ...], num_steps: int,
                        lens=(61, 9, 30, 3, 2), device: str = "cpu", dtype: str = "float32") -> float:
    """Prefill `lens`, then `num_steps` verify steps of random `1 + L_r` (one request a plain decode row) through
    the torch and the triton backend (`impl`: the triton backend's op choice for the verify steps; the prefill runs
    the device's defaults: under the interpreter the indexer kernel's prefill rows would cost seconds), ragged or
    padded to the static form (`VerifyGraphRunner.key`: 5 requests -> 8; the last one's state starts at position
    16); `static` is every step's form or a tuple cycled over the steps (an engine mixes graph and eager steps).
    Asserts the cache tensors agree and returns the worst difference of the real rows' hidden states and streams."""
    from deepinfer.engine.cache.kv_cache import V4KVCache

    models = [load_checkpoint(path, dtype=dtype, device=device, attention_backend=ab)[0] for ab in ("torch", "triton")]
    backend = models[1].model.attention_backend
    backend.split_size = SPLIT
    cfg = models[0].config
    caches = [V4KVCache(cfg, 100, 8, 8, getattr(torch, dtype), device, max_model_len=160) for _ in models]
    per = caches[0].max_blocks_per_seq
    tables = [list(range(per * s, per * s + per)) for s in range(len(lens))]
    runners = [VerifyGraphRunner(m, c, (1, 2, 4, 8), max_queries=6) for m, c in zip(models, caches)]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in lens]
    chunks = [SeqChunk(s, tables[s], 0, n) for s, n in enumerate(lens)]
    # the last request's state starts at 16 (a prefix-cache hit): window keys before it are masked
    chunks[-1] = SeqChunk(len(lens) - 1, tables[-1], 16, lens[-1], state_start=16, num_frozen_tokens=16)
    with torch.inference_mode():
        for m, c in zip(models, caches):
            m(ForwardBatch.build(prompts, chunks, device=device), c)
    use_impl(backend, impl, device)  # the verify steps' ops (the prefill: the device's defaults)
    rng, worst = random.Random(0), 0.0
    lens = [n for n in lens[:-1]] + [16 + lens[-1]]
    for step in range(num_steps):
        widths = [1] + [rng.randint(1, 5) for _ in lens[1:]]
        ids = [torch.randint(2, 512, (w,), generator=g).tolist() for w in widths]
        outs = []
        for m, c, r in zip(models, caches, runners):
            seqs = [SeqChunk(s, tables[s], lens[s], w) for s, w in enumerate(widths)]
            seqs[-1] = SeqChunk(len(lens) - 1, tables[-1], lens[-1], widths[-1], state_start=16, num_frozen_tokens=16)
            batch = ForwardBatch.build(ids, seqs, device=device)
            with torch.inference_mode():
                if (static if isinstance(static, bool) else static[step % len(static)]):
                    padded, rows = r.pad_verify(batch, r.key(batch))
                    h, s = m(padded, c, padded.attn_metadata, return_streams=True)
                    h, s = h[rows], s[rows]
                else:
                    meta = m.build_attention_metadata(batch, c)
                    batch_verify_chunks(meta, {i for i, w in enumerate(widths) if w > 1})
                    assert meta.verify is not None
                    h, s = m(batch, c, meta, return_streams=True)
            outs.append((h.float(), s.float()))
        for a, b in zip(*outs):
            worst = max(worst, (a - b).abs().max().item())
        ref, got = _state(caches[0]), _state(caches[1])
        tol = 2e-5 if dtype == "float32" else 2e-2
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=tol, atol=tol,
                                       msg=lambda msg, k=k, st=step: f"{k} step {st}: {msg}")
        lens = [n + rng.randint(1, w) for n, w in zip(lens, widths)]  # the same accepted lengths in both
    return worst


# --------------------------------------------------------------------------- CPU (the ops' torch references)


def op_inputs(D: int = 16):
    """Three requests of up to Q = 4 verify queries as rows (the last request's state starting at 7, one request
    with 2 real queries, padding queries as padding rows), a ring, a pool, block tables and a CSA-like selection;
    returns (args before `entries`, selection, rate, sink, new_kv, Q, valid, i, b, p)."""
    g = torch.Generator().manual_seed(0)
    S, W, NH, Q, rate, epb = 3, 8, 4, 4, 4, 2
    ring = torch.randn(S, W, D, generator=g)
    pool = torch.randn(12, epb, D, generator=g)
    p = torch.tensor([5, 13, 2])  # request b's first query position
    n = torch.tensor([4, 3, 2])
    starts = torch.tensor([0, 7, 0])
    tables = torch.tensor([[3, 1, 4, 0, 0, 0, 0, 0, 0], [5, 9, 2, 6, 7, 0, 0, 0, 0], [8, 0, 0, 0, 0, 0, 0, 0, 0]])
    B = 3 * Q
    b, i = torch.arange(B) // Q, torch.arange(B) % Q
    valid = i < n[b]
    pos = torch.where(valid, p[b] + i, 0)
    slots = torch.where(valid, b, S)
    new_kv = torch.randn(B, D, generator=g)
    q = torch.randn(B, NH, D, generator=g)
    sink = torch.randn(NH, generator=g)
    vis = (pos + 1) // rate  # a row's selection is among its visible entries (the indexer's -1 past them)
    selected = torch.tensor([[c for c in (0, 2, 1) if c < v] + [-1] * (3 - min(v, 3)) for v in vis.tolist()])
    args = (q, ring, pool, slots, pos, starts[b].contiguous(), tables[b].contiguous())
    return args, selected, rate, sink, new_kv, Q, valid, i, b, p


def test_verify_attention_reference_is_decode_attention_per_row():
    """`verify_attention_torch` == `decode_attention_torch` per row over a ring in which each row's own window is
    written (the step's keys of positions <= the row's own, the older keys as they were) — what each verify query
    would see as a decode step of its own. Padding queries (dummy slot, position 0) give 0."""
    (q, ring, pool, slots, pos, starts, bt), selected, rate, sink, new_kv, Q, valid, i, b, p = op_inputs()
    W = ring.shape[1]
    for entries in (None, selected):
        got = verify_attention_torch(q, ring, pool, slots, pos, starts, bt, entries, rate, sink, new_kv, Q)
        for r in range(q.shape[0]):
            if not valid[r]:
                assert got[r].abs().max() == 0
                continue
            own = ring.clone()
            for t in range(int(i[r]) + 1):
                own[b[r], (p[b[r]] + t) % W] = new_kv[r - int(i[r]) + t]
            e = None if entries is None else entries[r:r + 1]
            want = decode_attention_torch(q[r:r + 1], own, pool, slots[r:r + 1], pos[r:r + 1], starts[r:r + 1],
                                          bt[r:r + 1], e, rate, sink)
            torch.testing.assert_close(got[r:r + 1], want, rtol=1e-6, atol=1e-6)


def kernel_matches_reference() -> None:
    """The Triton op against the reference on `op_inputs` (float32), one split and several (16-key splits: 8 window
    keys + up to 18 entries). NOTE: float32 only under TRITON_INTERPRET=1: the interpreter's bf16 `tl.dot` gives
    garbage for the decode kernel too (numpy has no bf16); bf16 is for the `gpu` tests."""
    from deepinfer.kernels.decode_attention import verify_attention_triton

    (q, ring, pool, *rest), selected, rate, sink, new_kv, Q, *_ = op_inputs()
    for entries in (None, selected):
        for split in (16, 64):
            want = verify_attention_torch(q, ring, pool, *rest, entries, rate, sink, new_kv, Q)
            got = verify_attention_triton(q, ring, pool, *rest, entries, rate, sink, new_kv, Q, split)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("static", [False, True])
def test_verify_forward_matches_the_torch_backend(tiny, static):
    assert verify_forward_diff(tiny, None, static, num_steps=6) < 1e-4


_INTERPRETED = textwrap.dedent("""
    import sys
    from tests.engine.spec_decode.test_verify_kernels import (kernel_matches_reference, spec_greedy_equals_plain,
                                                               verify_forward_diff, write_tiny)
    from pathlib import Path
    kernel_matches_reference()
    path = write_tiny(Path(sys.argv[1]))
    # one ragged step, then one padded (graph form) step over the same prefill (the CPU test: six of each); greedy
    # with one schedule (the CPU test has both)
    worst = verify_forward_diff(path, "verify", (False, True), num_steps=2, lens=(61, 30, 2))
    spec_greedy_equals_plain("attention", schedules=("confidence",), max_tokens=6, lens=(6, 21))
    print("ok", worst)
""")


def spec_greedy_equals_plain(impl: str | None, schedules=("full", "confidence"), max_tokens: int = 12,
                             lens=(6, 30, 13)) -> None:
    """The built-in model, MTP drafts (k = 3): speculative greedy tokens with the triton backend (`impl`) == plain
    decoding with the torch backend, for each verify schedule; the verify rows took the triton backend's path."""
    from deepinfer.engine import SamplingParams
    from deepinfer.engine.attention.triton_backend import TritonAttentionBackend
    from deepinfer.engine.engine import Engine, EngineConfig
    from tests.engine.spec_decode.test_verify_graph import _run

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 1000, (n,), generator=g).tolist() for n in lens]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ref = _run(Engine(EngineConfig(max_num_seqs=4)), prompts, params)
    calls = []
    verify = TritonAttentionBackend._verify_batched

    def counted(self, *args, **kw):
        calls.append(1)
        return verify(self, *args, **kw)

    TritonAttentionBackend._verify_batched = counted
    try:
        for schedule in schedules:
            eng = Engine(EngineConfig(max_num_seqs=4, attention_backend="triton", speculative="mtp",
                                      num_draft_tokens=3, verify_schedule=schedule))
            backend = eng.model.model.attention_backend
            assert isinstance(backend, TritonAttentionBackend) and eng.spec.batched_verify
            backend.split_size = 128
            use_impl(backend, impl, "cpu")
            before = len(calls)
            assert _run(eng, prompts, params) == ref, schedule
            assert len(calls) > before and eng.spec.metrics.num_accepted_drafts > 0, schedule
            eng.shutdown()
    finally:
        TritonAttentionBackend._verify_batched = verify


def test_speculative_greedy_with_the_triton_backend_equals_plain_decoding():
    spec_greedy_equals_plain(None, max_tokens=10, lens=(6, 21))


def test_triton_verify_kernels_under_interpreter(tmp_path):
    pytest.importorskip("triton")
    out = run_interpreted(_INTERPRETED, str(tmp_path / "tiny"), timeout=900)
    assert out.startswith("ok") and float(out.split()[1]) < 1e-4, out


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_gpu_verify_attention_kernel_matches_the_reference():
    """The compiled kernel against the reference on `op_inputs` (head_dim 64), float32 and bf16 (the bf16 bar as
    tests/kernels/test_decode_attention.py's: the kernel rounds p to bf16 before the PV dot)."""
    from deepinfer.kernels.decode_attention import verify_attention_triton

    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        (q, ring, pool, *rest), selected, rate, sink, new_kv, Q, *_ = op_inputs(D=64)
        q, ring, pool, new_kv = (x.to("cuda", dtype) for x in (q, ring, pool, new_kv))
        rest, selected, sink = [x.cuda() for x in rest], selected.cuda(), sink.cuda()
        for entries in (None, selected):
            for split in (16, 64):
                want = verify_attention_torch(q, ring, pool, *rest, entries, rate, sink, new_kv, Q)
                got = verify_attention_triton(q, ring, pool, *rest, entries, rate, sink, new_kv, Q, split)
                torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.gpu
def test_gpu_verify_forward_matches_the_torch_backend(tiny):
    for static in (False, True):
        assert verify_forward_diff(tiny, None, static, num_steps=12, device="cuda") < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("schedule", ["full", "confidence"])
def test_gpu_speculative_greedy_with_verify_graphs_and_triton_equals_plain_over_64_steps(schedule):
    """The built-in model in bf16 on CUDA, triton attention (its verify rows through the decode kernels, inside the
    verify CUDA graphs), MTP drafts: the same greedy tokens as plain decoding, with graphs replayed."""
    from tests.engine.spec_decode.test_verify_graph import _engine_plain, _spec_engine
    from tests.engine.test_cuda_graph import _generate, _prompts, declared_safe, graph_cases

    moe = dict(graph_cases())["triton"]
    prompts = _prompts((5, 37, 64, 130, 9))
    with declared_safe("triton"):
        plain = _generate(_engine_plain("triton", moe), prompts, 64)
        eng = _spec_engine("triton", moe, True, verify_schedule=schedule)
        got = _generate(eng, prompts, 64)
    assert got == plain
    st = eng.spec.graphs.stats
    assert st["replays"] >= 10 and st["eager_fallbacks"] == 0, st


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRETED, tests=("test_triton_verify_kernels_under_interpreter",), timeout=900,
                     make_args=lambda d: (str(d / "tiny"),))
