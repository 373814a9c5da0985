"""The RMSNorm op (`kernels.rmsnorm`): the reference is the model's `rms_norm` bit for bit; the Triton kernel (one
program a row) agrees with it to float32 rounding and gives a row the same bits alone or in any batch, under
`TRITON_INTERPRET=1` in a subprocess (the variable must be set before triton is imported) and on CUDA.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from deepinfer.kernels import OpTable, default_impl
from deepinfer.kernels.rmsnorm import rms_norm_torch
from tests.kernels._interp import prefetch_interpreted, run_interpreted


def norm_case(rows, D, dtype=torch.float32, seed=0, device="cpu", weight=True):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, D, generator=g) * 4 + 1).to(dtype)
    w = (torch.rand(D, generator=g) + 0.5) if weight else None
    return x.to(device), (w.to(device) if w is not None else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_models_rms_norm(dtype):
    pytest.importorskip("pydantic")
    from deepinfer.engine.models.deepseek_v4 import RMSNorm, rms_norm

    x, w = norm_case(9, 48, dtype)
    assert torch.equal(rms_norm_torch(x, w, 1e-6), rms_norm(x, w, 1e-6))
    norm = RMSNorm(48, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(w)
    assert torch.equal(rms_norm_torch(x, norm.weight, norm.eps), norm(x))


def test_op_table_defaults():
    assert default_impl("rms_norm", "cpu") == "torch" and OpTable("cpu").rms_norm is rms_norm_torch
    pytest.importorskip("triton")
    assert default_impl("rms_norm", "cuda") == "triton"


_INTERPRETED = textwrap.dedent("""
    import torch
    from tests.kernels.test_rmsnorm import norm_case
    from deepinfer.kernels.rmsnorm import rms_norm_torch, rms_norm_triton
    for dtype, tol in ((torch.float32, 2e-6), (torch.bfloat16, 8e-3), (torch.float16, 1e-3)):
        for seed, (rows, D, weight) in enumerate([(1, 64, True), (7, 300, True), (5, 1024, False), (0, 32, True),
                                                  (3, 7, True)]):
            x, w = norm_case(rows, D, dtype, seed, weight=weight)
            got, want = rms_norm_triton(x, w, 1e-6), rms_norm_torch(x, w, 1e-6)
            assert got.dtype == x.dtype and got.shape == x.shape
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
            # batch invariance: each row alone, and inside batches of other sizes, gives the same bits
            for r in range(rows):
                assert torch.equal(rms_norm_triton(x[r:r + 1].contiguous(), w, 1e-6), got[r:r + 1]), (dtype, r)
            if rows > 1:
                assert torch.equal(rms_norm_triton(torch.cat([x, x.flip(0)]), w, 1e-6)[:rows], got)
        x, w = norm_case(6, 40, dtype, 9)
        # [T, NH, D] rows; a bfloat16 weight is used in float32 (as torch promotes it)
        torch.testing.assert_close(rms_norm_triton(x.view(2, 3, 40), w, 1e-6),
                                   rms_norm_torch(x.view(2, 3, 40), w, 1e-6), atol=tol, rtol=tol)
        torch.testing.assert_close(rms_norm_triton(x, w.bfloat16(), 1e-6), rms_norm_torch(x, w.bfloat16(), 1e-6),
                                   atol=tol, rtol=tol)
        # [T, D] rows of a wider buffer (a column slice): read in place
        wide, w = norm_case(5, 96, dtype, 10)
        torch.testing.assert_close(rms_norm_triton(wide[:, 16:64], w[:48], 1e-6),
                                   rms_norm_torch(wide[:, 16:64], w[:48], 1e-6), atol=tol, rtol=tol)
    x, w = norm_case(4, 16)
    for args, msg in [((x.t(), w[:4]), "contiguous"), ((x.view(2, 2, 16)[:, :1], w), "contiguous"), ((x.double(), w), "float32, bfloat16"),
                      ((x, w[:8]), "weight must be"), ((x, w.double()), "weight must be")]:
        try:
            rms_norm_triton(args[0], args[1], 1e-6)
        except ValueError as e:
            assert msg in str(e), (msg, str(e))
        else:
            raise AssertionError(msg)
    print("ok")
""")


def test_triton_kernel_under_interpreter():
    pytest.importorskip("triton")
    assert run_interpreted(_INTERPRETED).strip() == "ok"


@pytest.mark.parametrize("D,warps", [(4096, 8), (7168, 16), (1024, 2), (512, 1)])
def test_kernel_compiles_for_sm90_without_spills(D, warps):
    """V4-Flash / V4's hidden sizes, q_lora_rank and head_dim at the wrapper's launch configuration."""
    pytest.importorskip("triton")
    from deepinfer.benchmarks.kernel_registers import _ptxas, compile_report
    from deepinfer.kernels.rmsnorm import _rms_norm_kernel

    if _ptxas() is None:
        pytest.skip("no ptxas bundled with triton")
    r = compile_report(_rms_norm_kernel, {"x_ptr": "*bf16", "w_ptr": "*fp32", "y_ptr": "*bf16", "x_stride": "i32",
                                          "eps": "fp32"},
                       {"D": D, "HAS_W": True, "BF16": True, "BLOCK_D": 1 << (D - 1).bit_length()}, warps)
    assert r["spill_stores"] == 0 and 0 < r["registers"] <= 255, r


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [4096, 1024, 512, 7168])
def test_triton_kernel_on_cuda(dtype, D):
    """Against the CUDA reference to float32 rounding (rounded to the dtype), and batch invariant: a row's bits
    alone equal its bits in batches of 2 .. 512 rows."""
    from deepinfer.kernels.rmsnorm import rms_norm_triton

    x, w = norm_case(512, D, dtype, seed=D, device="cuda")
    got = rms_norm_triton(x, w, 1e-6)
    tol = 2e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got, rms_norm_torch(x, w, 1e-6), atol=tol, rtol=tol)
    torch.testing.assert_close(got.cpu(), rms_norm_torch(x.cpu(), w.cpu(), 1e-6), atol=tol, rtol=tol)
    alone = torch.cat([rms_norm_triton(x[r:r + 1].contiguous(), w, 1e-6) for r in (0, 1, 255, 511)])
    assert torch.equal(alone, got[[0, 1, 255, 511]])
    for n in (2, 3, 64, 100):
        assert torch.equal(rms_norm_triton(x[:n].contiguous(), w, 1e-6), got[:n])


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRETED, tests=("test_triton_kernel_under_interpreter",), timeout=300)
