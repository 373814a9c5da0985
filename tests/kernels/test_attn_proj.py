"""The attention layer's small ops (`kernels.attn_proj`): the torch references against the model's own
arithmetic (bit for bit), the Triton kernels against the references (CPU under `TRITON_INTERPRET=1` in a
subprocess; and on CUDA, float32 and bf16 at V4-Flash shapes).

Covered: RMSNorm + RoPE of the queries (per head, no weight) and of the K=V head (weighted) with the fused
window-ring write (a padding slot writes nothing), widths that are not powers of two, the grouped output
projection with the inverse RoPE (groups of whole heads and of parts of heads, R not a tile multiple, one
token and many), and the wrappers' checks.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from deepinfer.engine.models.deepseek_v4 import apply_rope, rms_norm
from deepinfer.kernels import OpTable
from deepinfer.kernels.attn_proj import attn_norm_rope_torch, attn_out_proj_torch
from tests.kernels._interp import prefetch_interpreted, run_interpreted
from tests.kernels._kernel_checks import (
    assert_compiles_for_sm90_without_spills,
    run_on_tiny_model,
    tiny_model_logits,
    worst_diff_same_tokens,
)


def rope_case(T=6, NH=3, D=32, half=4, S=4, W=8, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(T, half, generator=g) * 6
    pos = torch.randint(0, 50, (T,), generator=g)
    slots = torch.randperm(S, generator=g)[:T] if T <= S else torch.arange(T) % S
    slots[-1] = S  # a padding row
    return dict(q=(3 * torch.randn(T, NH, D, generator=g)).to(dtype=dtype, device=device),
                kv=(3 * torch.randn(T, D, generator=g)).to(dtype=dtype, device=device),
                weight=(1 + torch.randn(D, generator=g) / 4).to(device), cos=ang.cos().to(device),
                sin=ang.sin().to(device), ring=torch.randn(S, W, D, generator=g).to(dtype=dtype, device=device),
                slots=slots.to(device), pos=pos.to(device))


def proj_case(T=5, NH=4, D=32, half=4, G=2, R=16, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(T, half, generator=g) * 6
    return dict(o=torch.randn(T, NH, D, generator=g).to(dtype=dtype, device=device), cos=ang.cos().to(device),
                sin=ang.sin().to(device),
                weight=(torch.randn(G * R, NH * D // G, generator=g) / 8).to(dtype=dtype, device=device), groups=G)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_references_are_the_models_arithmetic(dtype):
    c = rope_case(dtype=dtype)
    eps = 1e-6
    assert torch.equal(attn_norm_rope_torch(c["q"], None, eps, c["cos"], c["sin"]),
                       apply_rope(rms_norm(c["q"], None, eps), c["cos"], c["sin"]))
    want = apply_rope(rms_norm(c["kv"], c["weight"], eps), c["cos"], c["sin"])
    ring = c["ring"].clone()
    assert torch.equal(attn_norm_rope_torch(c["kv"], c["weight"], eps, c["cos"], c["sin"], ring, c["slots"],
                                            c["pos"]), want)
    W = ring.shape[1]
    for t in range(len(c["slots"]) - 1):
        assert torch.equal(ring[c["slots"][t], c["pos"][t] % W], want[t])
    untouched = torch.ones(ring.shape[:2], dtype=torch.bool)
    untouched[c["slots"][:-1], c["pos"][:-1] % W] = False
    assert torch.equal(ring[untouched], c["ring"][untouched])  # the padding row wrote nothing
    p = proj_case(dtype=dtype)
    T, G = p["o"].shape[0], p["groups"]
    out = apply_rope(p["o"], p["cos"], -p["sin"])  # the model's Attention.forward, plain wo_a
    grouped = out.reshape(T, G, -1).transpose(0, 1)
    w = p["weight"].view(G, -1, grouped.shape[-1])
    assert torch.equal(attn_out_proj_torch(**p), torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(T, -1))


def test_in_the_model_op_table_defaults():
    ops = OpTable("cpu")
    assert ops.impl_names["attn_norm_rope"] == ops.impl_names["attn_out_proj"] == "torch"
    pytest.importorskip("triton")
    assert OpTable("cuda").impl_names["attn_norm_rope"] == "triton"
    # cuBLAS is faster on the H200 (kernels/attn_proj.py); the inverse RoPE before it is one launch (kernels/rope.py)
    assert OpTable("cuda").impl_names["attn_out_proj"] == "rope_bmm"
    assert OpTable("cuda", {"attn_out_proj": "triton"}).impl_names["attn_out_proj"] == "triton"


_INTERPRETED = textwrap.dedent("""
    import torch
    from tests.kernels._kernel_checks import assert_refused
    from tests.kernels.test_attn_proj import proj_case, rope_case
    from deepinfer.kernels.attn_proj import (attn_norm_rope_torch, attn_norm_rope_triton, attn_out_proj_torch,
                                             attn_out_proj_triton)
    worst = 0.0
    for seed, kw in [(0, {}), (1, dict(T=9, NH=5, D=24, half=6, S=12, W=4)), (2, dict(T=3, NH=1, D=16, half=8))]:
        for dtype in (torch.float32, torch.float16):
            c = rope_case(seed=seed, dtype=dtype, **kw)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            for block_r in (1, 4):
                got = attn_norm_rope_triton(c["q"], None, 1e-6, c["cos"], c["sin"], block_r=block_r)
                ref = attn_norm_rope_torch(c["q"], None, 1e-6, c["cos"], c["sin"])
                d = (got.float() - ref.float()).abs().max().item()
                assert d <= tol, (seed, dtype, "q", d)
                r1, r2 = c["ring"].clone(), c["ring"].clone()
                got = attn_norm_rope_triton(c["kv"], c["weight"], 1e-6, c["cos"], c["sin"], r1, c["slots"], c["pos"],
                                            block_r=block_r)
                ref = attn_norm_rope_torch(c["kv"], c["weight"], 1e-6, c["cos"], c["sin"], r2, c["slots"], c["pos"])
                d = max(d, (got.float() - ref.float()).abs().max().item(), (r1.float() - r2.float()).abs().max().item())
                assert d <= tol, (seed, dtype, "kv", d)
                if dtype == torch.float32:
                    worst = max(worst, d)
    for seed, kw in [(0, {}), (1, dict(T=37, NH=6, D=16, half=4, G=3, R=24)), (2, dict(T=1, NH=2, D=32, G=4, R=16))]:
        p = proj_case(seed=seed, **kw)
        ref = attn_out_proj_torch(**p)
        for bm, br, bk in ((None, 16, 16), (16, 32, 64)):
            d = (attn_out_proj_triton(**p, block_m=bm, block_r=br, block_k=bk, force_kernel=True) - ref).abs().max().item()
            assert d <= 1e-5, (seed, bm, br, bk, d)
            worst = max(worst, d)
    c, p = rope_case(), proj_case()
    checks = [(lambda: attn_norm_rope_triton(c["q"].transpose(0, 1), None, 1e-6, c["cos"], c["sin"]), "contiguous"),
              (lambda: attn_norm_rope_triton(c["q"], None, 1e-6, c["cos"].double(), c["sin"]), "float32"),
              (lambda: attn_norm_rope_triton(c["q"], None, 1e-6, c["cos"], c["sin"], c["ring"], c["slots"], c["pos"]),
               "ring write takes x [T, D]"),
              (lambda: attn_norm_rope_triton(c["kv"], c["weight"], 1e-6, c["cos"], c["sin"], c["ring"], c["slots"].int(),
                                             c["pos"]), "slots must be"),
              (lambda: attn_out_proj_triton(**{**p, "groups": 3}), "do not split"),
              (lambda: attn_out_proj_triton(**{**p, "weight": p["weight"].half()}), "weight must be")]
    for call, msg in checks:
        assert_refused(call, msg)
    print("ok", worst)
""")


def test_triton_kernels_under_interpreter():
    pytest.importorskip("triton")
    out = run_interpreted(_INTERPRETED, timeout=600)
    assert out.startswith("ok"), out


TRITON_OPS = {"attn_norm_rope": "triton", "attn_out_proj": "triton"}
"""This file's ops at their Triton implementations."""


def model_logits(ckpt, device="cpu", dtype="float32", attention_backend="torch", triton_ops=False) -> list:
    """Every token's logits of the tiny model over a chunked prefill, a mixed step and decode steps, with the
    torch ops or the Triton ones (picked through the model's `OpTable`)."""
    return tiny_model_logits(ckpt, device, dtype, TRITON_OPS if triton_ops else None, attention_backend)


def model_parity(ckpt, device="cpu", attention_backend="torch") -> float:
    """Worst |logit difference| (float32) between the torch ops and the Triton ones; equal greedy tokens."""
    return worst_diff_same_tokens(*(model_logits(ckpt, device, "float32", attention_backend, t) for t in (False, True)))


_MODEL_INTERPRETED = textwrap.dedent("""
    import sys
    from tests.kernels.test_attn_proj import model_parity
    print("ok", model_parity(sys.argv[1]))
""")


def test_triton_ops_in_the_model_under_interpreter(tmp_path):
    assert run_on_tiny_model(tmp_path, _MODEL_INTERPRETED) < 1e-4


def test_kernels_compile_for_sm90_without_spills():
    """The default launch configurations at V4-Flash widths (the norm + RoPE + ring write and both projection
    tilings), compiled ahead of time for sm_90a on the CPU: the interpreter never lowers a kernel."""
    assert_compiles_for_sm90_without_spills("attn_")


@pytest.mark.gpu
@pytest.mark.parametrize("attention_backend", ["torch", "triton"])
def test_triton_ops_in_the_model_on_cuda(tmp_path, attention_backend):
    """float32: the torch ops' tokens and logits; bf16: per-token errors against float32 (relative to the
    token's largest logit) no worse than the torch ops' (the decode backend test's bar)."""
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "tiny", preset="tiny", seed=6)
    assert model_parity(ckpt, "cuda", attention_backend) < 1e-3
    ref = torch.cat(model_logits(ckpt, "cuda", "float32", attention_backend))
    scale = ref.abs().amax(-1, keepdim=True)
    errs = [((torch.cat(model_logits(ckpt, "cuda", "bfloat16", attention_backend, t)) - ref).abs() / scale).amax(-1)
            for t in (False, True)]
    assert errs[1].median() <= 1.25 * errs[0].median() + 0.005, (errs[1].median(), errs[0].median())
    assert errs[1].mean() <= 2 * errs[0].mean() + 0.01, (errs[1].mean(), errs[0].mean())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_norm_rope_on_cuda(dtype):
    """V4-Flash: 64 query heads x 512 and the K=V head, 64 rope channels, a 128-row ring."""
    from deepinfer.kernels.attn_proj import attn_norm_rope_triton

    c = rope_case(T=130, NH=64, D=512, half=32, S=160, W=128, seed=3, dtype=dtype, device="cuda")
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(attn_norm_rope_triton(c["q"], None, 1e-6, c["cos"], c["sin"]),
                               attn_norm_rope_torch(c["q"], None, 1e-6, c["cos"], c["sin"]), atol=tol, rtol=tol)
    r1, r2 = c["ring"].clone(), c["ring"].clone()
    got = attn_norm_rope_triton(c["kv"], c["weight"], 1e-6, c["cos"], c["sin"], r1, c["slots"], c["pos"])
    want = attn_norm_rope_torch(c["kv"], c["weight"], 1e-6, c["cos"], c["sin"], r2, c["slots"], c["pos"])
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    torch.testing.assert_close(r1, r2, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 128, 1000])
def test_triton_out_proj_on_cuda(dtype, T):
    """V4-Flash: 64 heads x 512 in 8 groups of 4096 channels, o_lora_rank 1024."""
    from deepinfer.kernels.attn_proj import attn_out_proj_triton

    p = proj_case(T=T, NH=64, D=512, half=32, G=8, R=1024, seed=4, dtype=dtype, device="cuda")
    ref = attn_out_proj_torch(**{**p, "o": p["o"].float(), "weight": p["weight"].float()})
    got = attn_out_proj_triton(**p, force_kernel=True)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)
    # the op above TRITON_OUT_PROJ_MAX_TOKENS runs the cuBLAS reference (the kernel's large-T tiling is slow)
    from deepinfer.kernels.attn_proj import TRITON_OUT_PROJ_MAX_TOKENS

    if T > TRITON_OUT_PROJ_MAX_TOKENS:
        assert torch.equal(attn_out_proj_triton(**p), attn_out_proj_torch(**p))


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRETED, tests=("test_triton_kernels_under_interpreter",), timeout=600)
