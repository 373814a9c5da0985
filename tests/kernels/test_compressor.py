"""The compressors' one-token decode update (`kernels.compressor`): the torch reference against the model's
`Compressor.compress_gathered`, which rows emit (window ends, frozen windows, padding rows), and the
Triton kernel against the reference (CPU under `TRITON_INTERPRET=1` in a subprocess; CUDA in float32
and bf16).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from deepinfer.engine.config import RopeConfig
from deepinfer.engine.models.deepseek_v4 import Compressor, Rotary
from deepinfer.kernels.compressor import compress_rows_torch, compressor_decode_torch
from tests.kernels._interp import prefetch_interpreted, run_interpreted


def make_case(overlap=True, rate=4, dim=32, half_rd=4, S=6, N=10, epb=4, MB=3, seed=0, dtype=torch.float32,
              device="cpu"):
    """Random rings and one new token per row: rows ending windows 0 and 1, one mid-window, one whose
    window is frozen, and a padding row (slot S, blocks N, position 0)."""
    g = torch.Generator().manual_seed(seed)
    width = 2 * dim if overlap else dim
    ring_len = (2 if overlap else 1) * rate
    B = 5
    f = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    pos = torch.tensor([rate - 1, 2 * rate - 1, 3 * rate - 2, 3 * rate - 1, 0])
    return dict(
        kv=f(B, width).to(dtype=dtype, device=device), gate=f(B, width).to(dtype=dtype, device=device),
        buf_kv=f(S, ring_len, width).to(dtype=dtype, device=device),
        buf_gate=f(S, ring_len, width).to(dtype=dtype, device=device),
        ape=f(rate, width).to(device), norm_weight=(torch.rand(dim, generator=g) + 0.5).to(device), eps=1e-6,
        cos=f(B, half_rd).to(device), sin=f(B, half_rd).to(device), slots=torch.tensor([0, 1, 2, 3, S], device=device),
        pos=pos.to(device), frozen=torch.tensor([0, 0, 0, 3 * rate, 0], device=device),
        block_tables=torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [0, 1, 2], [N, N, N]], device=device)[:, :MB],
        pool=f(N, epb, dim).to(dtype=dtype, device=device), rate=rate, overlap=overlap,
    )


@pytest.mark.parametrize("overlap", [True, False])
def test_entries_are_the_models(overlap):
    rate, dim = 4, 32
    comp = Compressor(64, dim, rate, overlap, 1e-6)
    with torch.no_grad():
        comp.ape.normal_()
        comp.norm.weight.uniform_(0.5, 1.5)
    c = make_case(overlap=overlap, rate=rate, dim=dim)
    rot = Rotary(RopeConfig(rope_theta=160000.0), 8)
    w = (c["pos"] + 1) // rate - 1
    cos, sin = rot(w.clamp(min=0) * rate)
    buf_kv, buf_gate, slots = c["buf_kv"], c["buf_gate"], c["slots"][:2]
    got = compress_rows_torch(buf_kv, buf_gate, comp.ape, comp.norm.weight, 1e-6, cos[:2], sin[:2], slots, w[:2],
                              rate, overlap)
    ring_len = buf_kv.shape[1]
    cur = w[:2, None] * rate + torch.arange(rate)[None, :]
    prev = (cur - rate).clamp(min=0)
    s = slots[:, None]
    want = comp.compress_gathered(buf_kv[s, cur % ring_len], buf_gate[s, cur % ring_len], buf_kv[s, prev % ring_len],
                                  buf_gate[s, prev % ring_len], w[:2], (cos[:2], sin[:2]))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("overlap", [True, False])
def test_which_rows_emit(overlap):
    c = make_case(overlap=overlap)
    before = {k: v.clone() for k, v in c.items() if isinstance(v, torch.Tensor)}
    done = compressor_decode_torch(**c)
    assert done.tolist() == [True, True, False, False, False]  # row 3's window is frozen; row 4 is padding
    pool, epb = c["pool"], c["pool"].shape[1]
    changed = (pool != before["pool"]).any(-1).reshape(-1).nonzero()[:, 0].tolist()
    assert changed == [1 * epb + 0, 4 * epb + 1]  # entry 0 of row 0 (block 1), entry 1 of row 1 (block 4)
    ring_len = c["buf_kv"].shape[1]
    for b in range(4):  # every real row wrote its token; the padding row wrote nothing
        assert torch.equal(c["buf_kv"][b, int(c["pos"][b]) % ring_len], c["kv"][b])
    rest = torch.ones(c["buf_kv"].shape[:2], dtype=torch.bool)
    rest[torch.arange(4), c["pos"][:4] % ring_len] = False
    assert torch.equal(c["buf_kv"][rest], before["buf_kv"][rest])


_INTERPRETED = textwrap.dedent("""
    import torch
    from tests.kernels._kernel_checks import assert_refused
    from tests.kernels.test_compressor import make_case
    from deepinfer.kernels.compressor import (compressor_decode_torch, compressor_decode_triton, write_entries_op_torch,
                                              write_entries_triton)
    for seed, kw in [(0, {}), (1, dict(overlap=False, rate=8, epb=2)), (2, dict(dim=16, half_rd=8)),
                     (3, dict(overlap=False, rate=16, dim=64, epb=1, MB=3))]:
        for dtype in (torch.float32, torch.float16):
            c = make_case(seed=seed, dtype=dtype, **kw)
            a = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in c.items()}
            b = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in c.items()}
            da, db = compressor_decode_torch(**a), compressor_decode_triton(**b)
            assert torch.equal(da, db)
            assert torch.equal(a["buf_kv"], b["buf_kv"]) and torch.equal(a["buf_gate"], b["buf_gate"])
            tol = 3e-6 if dtype == torch.float32 else 3e-3
            d = (a["pool"].float() - b["pool"].float()).abs().max().item()
            assert d <= tol, (seed, dtype, d)
            dim = c["pool"].shape[-1]
            outs = [torch.zeros(5, dim, dtype=dtype), torch.zeros(5, dim, dtype=dtype)]
            compressor_decode_torch(**{**c, "buf_kv": c["buf_kv"].clone(), "buf_gate": c["buf_gate"].clone()},
                                    entries_out=outs[0])
            compressor_decode_triton(**{**c, "buf_kv": c["buf_kv"].clone(), "buf_gate": c["buf_gate"].clone()},
                                     entries_out=outs[1])
            assert ((outs[0][:2].float() - outs[1][:2].float()).abs().max().item()) <= tol
            p1, p2 = c["pool"].clone(), c["pool"].clone()
            write_entries_op_torch(p1, outs[0], da, c["pos"], c["block_tables"], c["rate"])
            write_entries_triton(p2, outs[0], da, c["pos"], c["block_tables"], c["rate"])
            assert torch.equal(p1, p2)
    c = make_case()
    for bad, msg in [(dict(ape=c["ape"][:2]), "ape"), (dict(pool=c["pool"][..., :8].contiguous()), "pool must be"),
                     (dict(pos=c["pos"].int()), "int64"), (dict(kv=c["kv"].t().contiguous().t()), "contiguous")]:
        assert_refused(lambda: compressor_decode_triton(**{**c, **bad}), msg)
    print("ok")
""")


def test_triton_kernel_under_interpreter():
    pytest.importorskip("triton")
    out = run_interpreted(_INTERPRETED, timeout=600)
    assert out.strip() == "ok", out


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("geometry", ["csa", "index", "hca"])
def test_triton_kernel_on_cuda(dtype, geometry):
    """V4-Flash compressor shapes: CSA main (rate 4, 2 x 512), CSA indexer (rate 4, 2 x 128), HCA (rate 128, 512)."""
    from deepinfer.kernels.compressor import compressor_decode_triton

    kw = {"csa": dict(rate=4, dim=512, epb=32), "index": dict(rate=4, dim=128, epb=32),
          "hca": dict(overlap=False, rate=128, dim=512, epb=1)}[geometry]
    c = make_case(half_rd=32, dtype=dtype, device="cuda", seed=5, **kw)
    a = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in c.items()}
    b = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in c.items()}
    assert torch.equal(compressor_decode_torch(**a), compressor_decode_triton(**b))
    assert torch.equal(a["buf_kv"], b["buf_kv"]) and torch.equal(a["buf_gate"], b["buf_gate"])
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(b["pool"].float(), a["pool"].float(), atol=tol, rtol=tol)


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRETED, tests=("test_triton_kernel_under_interpreter",), timeout=600)
