"""The fused mHC ops (`kernels.mhc`): the torch references against the model's former arithmetic, the
Triton kernels against the references (CPU interpreter, tiny shapes; CUDA, `gpu` tests), and the op table.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from deepinfer.kernels import OpTable, default_impl
from deepinfer.kernels.mhc import hc_weights_torch, mhc_head_torch, mhc_post_torch, mhc_pre_torch
from deepinfer.kernels.sinkhorn import sinkhorn_numpy_cpu, sinkhorn_torch
from tests.kernels._interp import prefetch_interpreted, run_interpreted

ITERS, EPS = 20, 1e-6


def _params(T=5, hc=4, H=64, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    n = (2 + hc) * hc
    streams = torch.randn(T, hc, H, generator=g).to(device, dtype)
    fn = (torch.randn(n, hc * H, generator=g) * 0.05).to(device)
    base = (torch.randn(n, generator=g) * 0.5).to(device)
    scale = (torch.rand(3, generator=g) + 0.5).to(device)
    return streams, fn, base, scale


def test_pre_reference_is_the_mix_arithmetic():
    streams, fn, base, scale = _params()
    collapsed, post, comb = mhc_pre_torch(streams, fn, base, scale, 4, ITERS, EPS, 1e-6, sinkhorn_numpy_cpu)
    pre, post2, comb2 = hc_weights_torch(streams, fn, base, scale, 4, ITERS, EPS, 1e-6, sinkhorn_torch)
    assert torch.equal(collapsed, (pre.unsqueeze(-1) * streams).sum(1)) and torch.equal(post, post2)
    assert torch.equal(comb, comb2)  # the numpy Sinkhorn equals the torch one bit for bit on the CPU
    torch.testing.assert_close(comb.sum(-2), torch.ones(5, 4), atol=1e-5, rtol=0)
    y = torch.randn(5, 64)
    ref = post[:, :, None] * y[:, None, :] + torch.einsum("tjk,tjh->tkh", comb, streams)
    torch.testing.assert_close(mhc_post_torch(y, streams, post, comb), ref, atol=1e-5, rtol=1e-5)


def test_op_table_defaults():
    assert default_impl("mhc_pre", "cpu") == default_impl("mhc_post", "cpu") == default_impl("mhc_head", "cpu") == "torch"
    ops = OpTable("cpu")
    assert ops.mhc_pre is mhc_pre_torch and ops.mhc_head is mhc_head_torch
    pytest.importorskip("triton")
    assert default_impl("mhc_pre", "cuda") == default_impl("mhc_post", "cuda") == "triton"  # GPU-tested kernels
    assert OpTable("cuda").mhc_pre is not mhc_pre_torch
    assert OpTable("cuda", {"mhc_pre": "torch"}).mhc_pre is mhc_pre_torch


_INTERPRETED = textwrap.dedent("""
    import torch
    from deepinfer.kernels.mhc import (mhc_head_torch, mhc_head_triton, mhc_post_torch, mhc_post_triton,
                                       mhc_pre_torch, mhc_pre_triton, check_mhc_pre_args)
    g = torch.Generator().manual_seed(0)
    from tests.kernels._kernel_checks import RelativeErrors
    errors = RelativeErrors()
    check = errors.check
    # (T, hc, H): one token block and several, hc*H over one split (1024 columns), odd sizes
    for T, hc, H, dtype in ((1, 4, 64, torch.float32), (20, 4, 320, torch.float32), (3, 2, 48, torch.float32),
                            (5, 3, 40, torch.float16)):
        n = (2 + hc) * hc
        s = torch.randn(T, hc, H, generator=g).to(dtype)
        fn = torch.randn(n, hc * H, generator=g) * 0.05
        base = torch.randn(n, generator=g) * 0.5
        scale = torch.rand(3, generator=g) + 0.5
        tol = 2e-5 if dtype == torch.float32 else 2e-3
        ref = mhc_pre_torch(s, fn, base, scale, hc, 20, 1e-6, 1e-6)
        got = mhc_pre_triton(s, fn, base, scale, hc, 20, 1e-6, 1e-6)
        for a, b in zip(got, ref):
            assert a.dtype == b.dtype and a.shape == b.shape
            check(a, b, tol)
        y = torch.randn(T, H, generator=g).to(dtype)
        check(mhc_post_triton(y, s, ref[1], ref[2]), mhc_post_torch(y, s, ref[1], ref[2]), tol)
        hf, hb, hs = fn[:hc].contiguous(), base[:hc].contiguous(), scale[:1].contiguous()
        check(mhc_head_triton(s, hf, hb, hs, 1e-6, 1e-6), mhc_head_torch(s, hf, hb, hs, 1e-6, 1e-6), tol)
    try:
        check_mhc_pre_args("x", torch.zeros(2, 4, 8), torch.zeros(24, 32).double(), torch.zeros(24), torch.zeros(3), 24, 3)
        raise SystemExit("no error")
    except ValueError as e:
        assert "fn must be float32" in str(e)
    # a gradient takes the reference
    s = torch.randn(2, 2, 8, generator=g)
    fn = torch.randn(8, 16, generator=g).requires_grad_(True)
    out = mhc_pre_triton(s, fn, torch.zeros(8), torch.ones(3), 2, 5, 1e-6, 1e-6)[0]
    out.sum().backward()
    assert fn.grad is not None
    print("OK", errors.worst)
""")


def test_triton_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    out = run_interpreted(_INTERPRETED)
    assert "OK" in out, out


# ---------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("T, hc, H, dtype", [
    (1, 4, 4096, torch.bfloat16), (128, 4, 4096, torch.bfloat16), (4096, 4, 4096, torch.bfloat16),
    (128, 4, 4096, torch.float32), (33, 2, 128, torch.bfloat16), (7, 3, 200, torch.float32)])
def test_fused_matches_the_reference_on_cuda(T, hc, H, dtype):
    from deepinfer.kernels.mhc import mhc_head_triton, mhc_post_triton, mhc_pre_triton

    s, fn, base, scale = _params(T, hc, H, seed=T, dtype=dtype, device="cuda")
    fn = fn[: (2 + hc) * hc].contiguous()
    # the reference on the CPU in float32 (exact Sinkhorn order), the fused op on the GPU
    ref = mhc_pre_torch(s.cpu().float(), fn.cpu(), base.cpu(), scale.cpu(), hc, ITERS, EPS, 1e-6)
    got = mhc_pre_triton(s, fn, base, scale, hc, ITERS, EPS, 1e-6)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got[1].cpu(), ref[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[2].cpu(), ref[2], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[0].cpu().float(), ref[0], atol=tol, rtol=tol)
    y = torch.randn(T, H, device="cuda").to(dtype)
    post, comb = got[1], got[2]
    # post mixes hc bf16 streams of magnitude ~4 that can cancel to ~0.25: one rounding of a term (half a bf16
    # ulp at 4 = 0.0156) is the honest bound (H200, 2026-12-05: 2 of 67M elements differed by 0.0156 at T=4096)
    post_tol = tol if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(mhc_post_triton(y, s, post, comb).float(), mhc_post_torch(y, s, post, comb).float(),
                               atol=post_tol, rtol=post_tol)
    hf, hb, hs = fn[:hc].contiguous(), base[:hc].contiguous(), scale[:1].contiguous()
    torch.testing.assert_close(mhc_head_triton(s, hf, hb, hs, EPS, 1e-6).float(),
                               mhc_head_torch(s, hf, hb, hs, EPS, 1e-6).float(), atol=tol, rtol=tol)


@pytest.mark.gpu
def test_fused_is_batch_invariant_on_cuda():
    from deepinfer.kernels.mhc import mhc_pre_triton

    s, fn, base, scale = _params(64, 4, 1024, seed=3, dtype=torch.bfloat16, device="cuda")
    whole = mhc_pre_triton(s, fn, base, scale, 4, ITERS, EPS, 1e-6)
    one = mhc_pre_triton(s[5:6].contiguous(), fn, base, scale, 4, ITERS, EPS, 1e-6)
    for a, b in zip(whole, one):
        assert torch.equal(a[5:6], b)


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRETED, tests=("test_triton_kernels_under_the_interpreter",), timeout=300)
