"""Batch-invariant mode on the Triton fast path (`engine.batch_invariant.BatchInvariantTritonAttentionBackend`,
`BatchInvariantTritonMoEBackend`, the small ops of `TRITON_INVARIANT_OPS`; `kernels.bi_attention`).

A request's logits at every position are bit-identical (`torch.equal`) when it runs alone as one prefill chunk
(launched in row slices) and beside companions with its prompt chunked, then decoded in mixed steps (decode rows
beside prefill chunks; a decode row completing compressor windows whose entries later rows read). On the CPU the Triton kernels run under
`TRITON_INTERPRET=1` (a subprocess, tiny float32 model); on CUDA (`gpu`) the same in bf16, with the mode off as the
control (some position differs), and the engine end to end with CUDA graphs.

NOTE (the interpreter): its `tl.dot` is numpy's BLAS matmul of the tile, whose row bits depend on the row's place in
the tile and the tile's shape (a CPU BLAS kernel choice, measured: rows of M <= 8 and some of M = 16 differ), while
on the GPU each output element of an MMA is one reduction over K in a fixed order wherever its row sits (what the
mode relies on: a token's row in a MoE expert tile moves with its companions). The interpreted script therefore
replaces the interpreter's dot by one with that property (every element's K-sum in one order, `_ROW_DOT`), so the
CPU test checks the kernels' structure (tiles, splits, combine orders, one kernel path per position); the `gpu`
tests check the hardware.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from deepinfer.engine.batch_invariant import KEPT_OP_IMPLS, TRITON_INVARIANT_OPS, check_config
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.kernels.registry import op_impl_names
from tests.kernels._interp import prefetch_interpreted, run_interpreted

TARGET_PROMPT = 21
"""Prompt tokens of the target (tiny preset: window 8, CSA rate 4 with top-4 of up to 6 entries, HCA rate 8)."""
TARGET_DECODE = 5
"""Positions the target decodes after its prompt (fed tokens, not sampled: the logits are compared); position 23
completes a CSA and an HCA window in a decode row, whose entries positions 24 and 25 read."""

SCENARIOS = {
    # name -> (the target's slot, steps of (slot, new tokens)); the target's tokens are fixed, the others random.
    # The first is the reference: the target alone, every position a prefill row (one chunk, in launch slices).
    "alone, one chunk, launched in slices": (1, [[(1, TARGET_PROMPT + TARGET_DECODE)]]),
    "beside companions, chunked, then decoding in mixed steps": (2, [
        [(0, 13), (2, 5)], [(0, 1), (1, 20), (2, 16)], [(1, 9), (2, 1), (0, 1)], [(2, 1), (0, 1)], [(1, 1), (2, 1)],
        [(2, 1)], [(0, 1), (2, 1), (1, 1)]]),
}
SLICED_BUDGET = 2048
"""`ROWS_BUDGET_BYTES` in the sliced scenario: 4 rows a launch in CSA layers, 8 in the others (the test cache's block
tables are 32 blocks wide)."""


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("bi_triton"), preset="tiny", seed=2))


MHC_OPS = frozenset({"mhc_pre", "mhc_post", "mhc_head"})
"""Left on their torch references in the interpreted model test (their interpreted kernels cost most of its time);
`mhc_rows_invariance` checks their kernels alone."""


def scenario_logits(ckpt: str, name: str, batch_invariant: bool = True, device: str = "cpu", dtype: str = "float32",
                    op_impls=KEPT_OP_IMPLS) -> dict[int, torch.Tensor]:
    """The target's logits by position in scenario `name`, the model on the `triton` attention and MoE backends with
    the small ops on the implementations `op_impls` (the mode's kept ones; `batch_invariant`: the mode on)."""
    from deepinfer.engine import batch_invariant as bi
    from deepinfer.engine.loader import load_checkpoint

    model, _ = load_checkpoint(ckpt, dtype=dtype, device=device, attention_backend="triton", moe_backend="triton")
    model.model.attention_backend.impl = "triton"
    model.model.ops.overrides.update(op_impls)
    model.model.ops.select(device)
    if batch_invariant:
        bi.enable_batch_invariant(model)
    budget = bi.ROWS_BUDGET_BYTES
    bi.ROWS_BUDGET_BYTES = SLICED_BUDGET if "slices" in name else budget
    try:
        return _run_scenario(model, name)
    finally:
        bi.ROWS_BUDGET_BYTES = budget


def _run_scenario(model, name: str) -> dict[int, torch.Tensor]:
    from deepinfer.engine.testing.model_runner import ModelRunnerForTests

    target, steps = SCENARIOS[name]
    runner = ModelRunnerForTests(model, max_seqs=4, max_len=64)
    streams = {s: _ids(TARGET_PROMPT + TARGET_DECODE, 1) if s == target else _ids(60, 10 + s) for s in range(4)}
    got = {}
    for step in steps:
        work = [(s, streams[s][runner.lens[s]:runner.lens[s] + n]) for s, n in step]
        offsets, off = {}, 0
        for s, ids in work:
            offsets[s] = (off, runner.lens[s], len(ids))
            off += len(ids)
        logits = runner.run(work, logits="all")
        if target in offsets:
            a, p0, n = offsets[target]
            for i in range(n):
                got[p0 + i] = logits[a + i].cpu()
    assert len(got) == TARGET_PROMPT + TARGET_DECODE
    return got


def differing_positions(ckpt: str, batch_invariant: bool, **kw) -> dict[str, list[int]]:
    """Scenario -> the positions whose logits differ (bits) from the reference scenario's (the first)."""
    first = next(iter(SCENARIOS))
    ref = scenario_logits(ckpt, first, batch_invariant, **kw)
    out = {}
    for name in SCENARIOS:
        if name != first:
            got = scenario_logits(ckpt, name, batch_invariant, **kw)
            out[name] = [p for p in ref if not torch.equal(ref[p], got[p])]
    return out


_ROW_DOT = """
import numpy as np
from triton.runtime import interpreter as _it

def _row_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    # every output element's K-sum in one order, wherever its row sits (the GPU MMA's property; module docstring)
    ad, bd = a.data, b.data
    if any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b)):
        ad = _it._convert_float(ad, a.dtype, _it.tl.float16, None).view(np.float16)
        bd = _it._convert_float(bd, b.dtype, _it.tl.float16, None).view(np.float16)
    dt = d.data.dtype
    prod = (ad.astype(dt)[..., :, :, None] * bd.astype(dt)[..., None, :, :]).sum(axis=-2, dtype=dt)
    return _it.TensorHandle(prod + d.data, d.dtype.scalar)

_it.InterpreterBuilder.create_dot = _row_dot
"""

_INTERPRETED = _ROW_DOT + textwrap.dedent("""
    import sys
    import torch
    from deepinfer.engine.batch_invariant import KEPT_OP_IMPLS
    from tests.engine.test_batch_invariance_triton import (MHC_OPS, differing_positions, mhc_rows_invariance,
                                                           rows_kernel_parity)
    rows_kernel_parity()
    mhc_rows_invariance()
    impls = {op: impl for op, impl in KEPT_OP_IMPLS.items() if op not in MHC_OPS}
    bad = differing_positions(sys.argv[1], batch_invariant=True, op_impls=impls)
    assert not any(bad.values()), bad
    print("OK")
""")


def rows_kernel_parity(device: str = "cpu", dtype=torch.float32) -> None:
    """`bi_rows_attention`'s Triton kernel against its torch reference (CSA-style rows: window + selected entries),
    and a chunk's rows equal the same positions run as decode rows (their keys written to the ring first)."""
    from deepinfer.kernels.bi_attention import bi_rows_attention_torch, bi_rows_attention_triton

    g = torch.Generator().manual_seed(0)
    S, W, D, NH, N, epb, rate, K = 3, 8, 32, 4, 6, 4, 4, 4

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    ring, pool, sink = rnd(S, W, D), rnd(N, epb, D), torch.randn(NH, generator=g).to(device)
    n, p0 = 11, 9  # a chunk of 11 queries at positions 9..19 of slot 1 (the ring holds positions 2..8)
    q, kv = rnd(n, NH, D), rnd(n, D)
    pos = torch.arange(p0, p0 + n, device=device)
    slots, start = torch.full((n,), 1, device=device), torch.zeros(n, dtype=torch.long, device=device)
    tables = torch.tensor([[4, 1, 0, 5, 6, 6]], device=device).expand(n, -1).contiguous()
    vis = ((pos + 1) // rate).tolist()
    picks = [sorted(torch.randperm(v, generator=g)[:K].tolist()) for v in vis]  # valid first, ascending, -1 padded
    entries = torch.tensor([p + [-1] * (K - len(p)) for p in picks], device=device)
    args = (q, ring, pool, slots, pos, start, tables, entries, rate, sink, kv, torch.full((n,), p0, device=device))
    got = bi_rows_attention_triton(*args)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), bi_rows_attention_torch(*args).float(), rtol=tol, atol=tol)
    # the same rows in two launches (rows 0..4, then 5..10 with new_off 5: their older keys from earlier rows)
    halves = [bi_rows_attention_triton(q[a:b], ring, pool, slots[a:b], pos[a:b], start[a:b], tables[a:b], entries[a:b],
                                       rate, sink, kv, args[-1][a:b], new_off=a) for a, b in ((0, 5), (5, n))]
    assert torch.equal(torch.cat(halves), got)
    # decode rows: one position at a time, its key written to the ring first, its own key read from new_kv
    for i in range(n):
        ring[1, (p0 + i) % W] = kv[i]
        one = bi_rows_attention_triton(q[i:i + 1], ring, pool, slots[:1], pos[i:i + 1], start[:1], tables[:1],
                                       entries[i:i + 1], rate, sink, kv[i:i + 1], pos[i:i + 1])
        assert torch.equal(one[0], got[i]), i


def mhc_rows_invariance(device: str = "cpu", dtype=torch.float32) -> None:
    """The mHC kernels (`mhc_pre`, `mhc_head`, `mhc_post`): a token's outputs in a call of 1 or 3 rows at any offset
    equal its outputs in a call of 12 rows."""
    from deepinfer.kernels.mhc import mhc_head_triton, mhc_post_triton, mhc_pre_triton

    g = torch.Generator().manual_seed(2)
    T, hc, H = 12, 2, 64

    def rnd(*shape, dt=torch.float32):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dt)

    streams, y = rnd(T, hc, H, dt=dtype), rnd(T, H, dt=dtype)
    fn, base, scale = rnd((2 + hc) * hc, hc * H) * 0.1, rnd((2 + hc) * hc), rnd(3).abs()
    hfn, hbase, hscale = rnd(hc, hc * H) * 0.1, rnd(hc), rnd(1).abs()
    pre = mhc_pre_triton(streams, fn, base, scale, hc, 5, 1e-6, 1e-6)
    head = mhc_head_triton(streams, hfn, hbase, hscale, 1e-6, 1e-6)
    post = mhc_post_triton(y, streams, pre[1], pre[2])
    for a, m in ((0, 1), (7, 1), (9, 3)):
        part = mhc_pre_triton(streams[a:a + m].contiguous(), fn, base, scale, hc, 5, 1e-6, 1e-6)
        assert all(torch.equal(p, f[a:a + m]) for p, f in zip(part, pre)), ("mhc_pre", a, m)
        assert torch.equal(mhc_head_triton(streams[a:a + m].contiguous(), hfn, hbase, hscale, 1e-6, 1e-6),
                           head[a:a + m]), ("mhc_head", a, m)
        assert torch.equal(mhc_post_triton(y[a:a + m].contiguous(), streams[a:a + m].contiguous(),
                                           pre[1][a:a + m].contiguous(), pre[2][a:a + m].contiguous()),
                           post[a:a + m]), ("mhc_post", a, m)


def test_rows_and_model_bit_identical_under_the_interpreter(ckpt):
    """The rows kernel against its reference (and sliced / decode launches of the same rows equal), the mHC kernels'
    rows alone equal in a batch, then the target's logits alone as one chunk (launched in slices) equal those beside
    companions with its prompt chunked and then decoded in mixed steps: the mode on the Triton backends and the small
    ops it keeps (mHC on its torch reference there: `MHC_OPS`)."""
    pytest.importorskip("triton")
    out = run_interpreted(_INTERPRETED, ckpt, timeout=600)
    assert "OK" in out, out


def test_rows_reference_is_the_verify_and_decode_references():
    """`bi_rows_attention_torch` with `new_start = pos - b % Q` is `verify_attention_torch`; with `new_start = pos`
    over a ring that holds the row's key it is `decode_attention_torch`."""
    from deepinfer.kernels.bi_attention import bi_rows_attention_torch
    from deepinfer.kernels.decode_attention import decode_attention_torch, verify_attention_torch

    g = torch.Generator().manual_seed(1)
    S, W, D, NH, Q = 2, 8, 16, 2, 3
    ring, sink = torch.randn(S, W, D, generator=g), torch.randn(NH, generator=g)
    q, kv = torch.randn(2 * Q, NH, D, generator=g), torch.randn(2 * Q, D, generator=g)
    pos = torch.tensor([10, 11, 12, 4, 5, 6])
    slots, start = torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([2, 2, 2, 0, 0, 0])
    tables = torch.zeros(2 * Q, 1, dtype=torch.long)
    b = torch.arange(2 * Q)
    rows = bi_rows_attention_torch(q, ring, None, slots, pos, start, tables, None, 1, sink, kv, pos - b % Q)
    ver = verify_attention_torch(q, ring, None, slots, pos, start, tables, None, 1, sink, kv, Q)
    assert torch.equal(rows, ver)
    ring[slots, pos % W] = kv
    dec = decode_attention_torch(q, ring, None, slots, pos, start, tables, None, 1, sink)
    assert torch.equal(bi_rows_attention_torch(q, ring, None, slots, pos, start, tables, None, 1, sink, kv, pos), dec)


def test_mode_accepts_the_triton_backends_where_their_kernels_run(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    check_config("triton", "triton", "cuda")  # swapped for their invariant variants
    with pytest.raises(ValueError, match="attention backend 'triton' runs its invariant kernels on CUDA only"):
        check_config("triton", "torch", "cpu")
    with pytest.raises(ValueError, match="MoE backend 'triton' runs its invariant kernels on CUDA only"):
        check_config("torch", "triton", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_config("triton", "triton", "cpu")


def test_kept_small_op_implementations_exist():
    pytest.importorskip("triton")
    for op, impl in KEPT_OP_IMPLS.items():
        assert {impl, "torch"} <= set(op_impl_names(op)), op
    assert "attn_out_proj" not in TRITON_INVARIANT_OPS  # its kernel picks tiles by T


def test_swap_refuses_the_triton_moe_where_its_kernels_do_not_run(ckpt, monkeypatch):
    from deepinfer.engine import batch_invariant as bi
    from deepinfer.engine.loader import load_checkpoint

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model, _ = load_checkpoint(ckpt, moe_backend="triton")  # the CPU: the ops' torch references
    with pytest.raises(ValueError, match="'triton' MoE backend's kernels do not run on cpu"):
        bi.enable_batch_invariant(model)


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_rows_and_mhc_kernels_on_gpu():
    for dtype in (torch.float32, torch.bfloat16):
        rows_kernel_parity("cuda", dtype)
        mhc_rows_invariance("cuda", dtype)


@pytest.mark.gpu
def test_model_bit_identical_on_gpu_and_differs_with_the_mode_off(ckpt):
    """The interpreted test's scenarios on CUDA in bf16 (hardware MMA), and the control: with the mode off (the
    `triton` backends' prefill kernel, tuned MoE tiles) some position differs."""
    on = differing_positions(ckpt, batch_invariant=True, device="cuda", dtype="bfloat16")
    assert not any(on.values()), on
    off = differing_positions(ckpt, batch_invariant=False, device="cuda", dtype="bfloat16")
    assert any(off.values()), "with the mode off every scenario matched bit for bit: the test above cannot fail"


@pytest.mark.gpu
def test_engine_on_the_triton_path_with_cuda_graphs(ckpt):
    """`LLM(batch_invariant=True, attention_backend="triton", moe_backend="triton")` on CUDA runs the invariant
    variants of the `triton` backends, keeps CUDA-graph decode, and a request's logprobs alone equal those beside 31
    companions and chunked at 7 tokens; "auto" resolves to this path on CUDA."""
    from deepinfer.engine import LLM
    from tests.engine.test_batch_invariance import TARGET, _assert_alone_equals_beside_companions

    kw = dict(batch_invariant=True, device="cuda", dtype="bfloat16", block_size=16, max_model_len=160,
              attention_backend="triton", moe_backend="triton")
    llm = LLM(ckpt, **{**kw, "attention_backend": "auto", "moe_backend": "auto"})
    runner = llm.engine.runner
    assert llm.engine.config.attention_backend == "triton" and llm.engine.config.moe_backend == "triton"
    assert not runner.cuda_graph_blockers, runner.cuda_graph_blockers
    _assert_alone_equals_beside_companions(ckpt, kw, TARGET)


@pytest.mark.gpu
def test_engine_on_the_torch_backends_on_gpu(ckpt):
    """The mode's torch path on CUDA (explicit torch backends) keeps its guarantee."""
    from tests.engine.test_batch_invariance import TARGET, _assert_alone_equals_beside_companions

    _assert_alone_equals_beside_companions(ckpt, dict(batch_invariant=True, device="cuda", dtype="bfloat16",
                                                       attention_backend="torch", moe_backend="torch", block_size=16,
                                                       max_model_len=160), TARGET)


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRETED, tests=("test_rows_and_model_bit_identical_under_the_interpreter",), timeout=600,
                     make_args=lambda d: (str(make_checkpoint(d, preset="tiny", seed=2)),))  # the `ckpt` fixture's
