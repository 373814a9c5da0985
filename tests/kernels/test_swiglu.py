"""The clamped SwiGLU op (`kernels.swiglu`): the reference is the model's `Expert` arithmetic bit for bit; the Triton
kernel (one launch for clamp, clamp, silu, product) equals the reference bit for bit on CUDA (`gpu` tests); under
`TRITON_INTERPRET=1` (a subprocess: the variable must be set before triton is imported) it equals bit for bit a
numpy transcription of its steps, and the torch reference within an ulp (numpy's `exp` is not torch's CPU `exp`).
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from deepinfer.kernels import OpTable, default_impl
from deepinfer.kernels.swiglu import swiglu_torch
from tests.kernels._interp import prefetch_interpreted, run_interpreted


def act_case(shape, dtype=torch.float32, seed=0, device="cpu", scale=6.0):
    """Pre-activations spread past the clamp bounds."""
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(*shape, generator=g) * scale).to(dtype).to(device) for _ in range(2))


def numpy_swiglu(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    """The kernel's steps in numpy float32 (numpy's `exp`, the interpreter's), each result rounded to the dtype as
    torch rounds (to nearest even)."""
    dt = g.dtype

    def rnd(a: np.ndarray) -> np.ndarray:
        return torch.from_numpy(a).to(dt).float().numpy()

    lim = np.float32(torch.tensor(limit, dtype=dt).item())
    gf, uf = g.float().numpy(), u.float().numpy()
    gc = np.where(gf > lim, lim, gf)
    uc = np.where(uf > lim, lim, np.where(uf < -lim, -lim, uf))
    s = rnd(gc / (np.float32(1) + np.exp(-gc)))
    return torch.from_numpy(rnd(s * uc)).to(dt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_experts_arithmetic(dtype):
    pytest.importorskip("pydantic")
    from deepinfer.engine.models.deepseek_v4 import Expert

    g, u = act_case((9, 40), dtype)
    lim = 7.0
    want = F.silu(g.clamp(max=lim)) * u.clamp(min=-lim, max=lim)  # the model's Expert before the op existed
    assert torch.equal(swiglu_torch(g, u, lim), want)
    torch.manual_seed(0)
    ex = Expert(16, 40, lim).to(dtype)
    x = torch.randn(9, 16).to(dtype)
    with torch.no_grad():
        g, u = F.linear(x, ex.w1.weight), F.linear(x, ex.w3.weight)
        want = F.linear(F.silu(g.clamp(max=lim)) * u.clamp(min=-lim, max=lim), ex.w2.weight)
        assert torch.equal(ex(x), want) and torch.equal(ex(x, swiglu_torch), want)


def test_op_table_defaults():
    assert default_impl("swiglu", "cpu") == "torch" and OpTable("cpu").swiglu is swiglu_torch
    pytest.importorskip("triton")
    assert default_impl("swiglu", "cuda") == "triton"


_INTERPRETED = textwrap.dedent("""
    import torch
    from tests.kernels.test_swiglu import act_case, numpy_swiglu
    from deepinfer.kernels.swiglu import swiglu_torch, swiglu_triton
    for dtype, ulp in ((torch.float32, 2**-23), (torch.bfloat16, 2**-7), (torch.float16, 2**-10)):
        for seed, (shape, lim) in enumerate([((3, 64), 7.0), ((5, 700), 10.0), ((1, 2048), 7.01), ((0, 8), 7.0),
                                             ((4, 3, 33), 0.0), ((2, 1500), 6e4)]):
            g, u = act_case(shape, dtype, seed)
            got, want = swiglu_triton(g, u, lim), swiglu_torch(g, u, lim)
            assert got.dtype == dtype and got.shape == g.shape
            assert torch.equal(got, numpy_swiglu(g, u, lim)), (dtype, shape, lim)  # the kernel's own steps
            # the reference within an ulp of the result (numpy's exp vs torch's)
            bound = want.float().abs() * ulp * 4 + 1e-30
            assert ((got.float() - want.float()).abs() <= bound).all(), (dtype, shape, lim)
            assert (got != want).sum() <= got.numel() * (0.5 if dtype == torch.float32 else 0.01)
        # NaN passes through, as through torch.clamp
        g, u = act_case((2, 8), dtype, 5)
        g[0, 1] = float("nan")
        u[1, 2] = float("nan")
        got = swiglu_triton(g, u, 7.0)
        assert torch.equal(got.isnan(), swiglu_torch(g, u, 7.0).isnan())
    g, u = act_case((4, 16))
    for args, msg in [((g, u[:2]), "must match"), ((g.double(), u.double()), "float32, bfloat16"),
                      ((g.t(), u.t()), "contiguous"), ((g, u.bfloat16()), "must match")]:
        try:
            swiglu_triton(*args, 7.0)
        except ValueError as e:
            assert msg in str(e), (msg, str(e))
        else:
            raise AssertionError(msg)
    print("ok")
""")


def test_triton_kernel_under_interpreter():
    pytest.importorskip("triton")
    assert run_interpreted(_INTERPRETED).strip() == "ok"


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernel_compiles_for_sm90_with_cuda_expf_and_no_fma(dtype):
    """Lowered for the H200: libdevice's expf (its own FMAs, `fma.rn.ftz`), an IEEE division, and no product of ours
    contracted into an FMA (`fma.rn.f32`)."""
    pytest.importorskip("triton")
    from deepinfer.kernels.swiglu import _swiglu_kernel
    from tests.kernels.test_rope import compiled_ptx

    ptr = f"*{dtype}"
    ptx = compiled_ptx(_swiglu_kernel, {"g_ptr": ptr, "u_ptr": ptr, "y_ptr": ptr, "n": "i32", "limit": "fp32"},
                       {"BF16": dtype == "bf16", "FP16": False, "CUDA_EXP": True, "BLOCK": 1024}, num_warps=4,
                       enable_fp_fusion=False)
    assert "div.rn.f32" in ptx and "ex2.approx" in ptx and "fma.rn.f32" not in ptx


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 128, 1000])
def test_triton_kernel_on_cuda_is_bit_identical(dtype, rows):
    """V4-Flash's shared expert (width 2048), pre-activations spread past the bound 10: torch's CUDA ops' bits.
    NOTE: this pins the claim that libdevice's expf is the one torch's CUDA `silu` calls; if it fails by an ulp,
    make `_default_swiglu` return "torch" until the kernel's exp matches."""
    from deepinfer.kernels.swiglu import swiglu_triton

    g, u = act_case((rows, 2048), dtype, seed=rows, device="cuda", scale=8.0)
    got, want = swiglu_triton(g, u, 10.0), swiglu_torch(g, u, 10.0)
    assert torch.equal(got, want), ((got != want).sum().item(), (got.float() - want.float()).abs().max().item())


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRETED, tests=("test_triton_kernel_under_interpreter",), timeout=300)
