"""The mHC Sinkhorn op: every implementation against the torch reference, and the op registry.

The Triton kernel runs on the CPU under `TRITON_INTERPRET=1` in a subprocess (the variable must be
set before triton is imported, and this process may have imported it already), and on CUDA where
there is one. On the CPU all implementations agree bit for bit for hc <= 4 (the model's hc is 4);
for wider matrices torch's CPU reduction no longer adds in index order, so they agree to float32
rounding.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from deepinfer.kernels import OpTable, default_impl, get_op, op_impl_names
from deepinfer.kernels.sinkhorn import sinkhorn_numpy_cpu, sinkhorn_torch
from tests.kernels._interp import prefetch_interpreted, run_interpreted

ITERS, EPS = 20, 1e-6


def _comb(num_rows: int, hc: int = 4, seed: int = 0) -> torch.Tensor:
    """Random mHC comb matrices as the model makes them: a row softmax plus eps. [num_rows, hc, hc]"""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(num_rows, hc, hc, generator=g) * 3, dim=-1) + EPS


def test_reference_is_doubly_stochastic():
    g = torch.Generator().manual_seed(0)
    out = sinkhorn_torch(torch.softmax(torch.randn(32, 4, 4, generator=g), dim=-1) + EPS, ITERS, EPS)
    torch.testing.assert_close(out.sum(-1), torch.ones(32, 4), atol=1e-4, rtol=0)
    torch.testing.assert_close(out.sum(-2), torch.ones(32, 4), atol=1e-5, rtol=0)


@pytest.mark.parametrize("num_rows", [0, 1, 7, 64, 65, 200])
def test_numpy_cpu_is_bit_identical(num_rows):
    comb = _comb(num_rows, seed=num_rows)
    assert torch.equal(sinkhorn_numpy_cpu(comb, ITERS, EPS), sinkhorn_torch(comb, ITERS, EPS))


def test_numpy_cpu_keeps_autograd():
    comb = _comb(4).requires_grad_(True)
    out = sinkhorn_numpy_cpu(comb, ITERS, EPS)
    out.sum().backward()
    assert comb.grad is not None


def test_registry_errors_list_the_known_names():
    with pytest.raises(ValueError, match="unknown op 'nope'; known ops: .*sinkhorn"):
        get_op("nope", "torch")
    with pytest.raises(ValueError, match="no implementation 'cuda_magic'; known: numpy_cpu, torch"):
        get_op("sinkhorn", "cuda_magic")
    with pytest.raises(ValueError, match="unknown op"):
        OpTable("cpu", {"nope": "torch"})
    assert {"torch", "numpy_cpu"} <= set(op_impl_names("sinkhorn"))


def test_op_table_picks_once_per_device():
    assert default_impl("sinkhorn", "cpu") == "numpy_cpu"
    # the Triton kernel (bit-identical to the CPU reference) wherever triton imports, else the torch loop
    assert default_impl("sinkhorn", "cuda") == ("triton" if "triton" in op_impl_names("sinkhorn") else "torch")
    assert default_impl("sinkhorn", "meta") == "torch"
    ops = OpTable("cpu")
    assert ops.sinkhorn is sinkhorn_numpy_cpu and ops.impl_names["sinkhorn"] == "numpy_cpu"
    ops.select("meta")
    assert ops.sinkhorn is sinkhorn_torch
    assert OpTable("cpu", {"sinkhorn": "torch"}).sinkhorn is sinkhorn_torch


_INTERPRETED = textwrap.dedent("""
    import torch
    from deepinfer.kernels.sinkhorn import sinkhorn_torch, sinkhorn_triton
    for num_rows, hc, seed in [(0, 4, 0), (1, 4, 1), (5, 4, 2), (64, 4, 3), (130, 4, 4), (9, 2, 5), (9, 8, 6), (70, 3, 7), (5, 1, 8)]:
        g = torch.Generator().manual_seed(seed)
        comb = torch.softmax(torch.randn(num_rows, hc, hc, generator=g) * 3, dim=-1) + 1e-6
        for iters in (1, 20):
            ref, out = sinkhorn_torch(comb, iters, 1e-6), sinkhorn_triton(comb, iters, 1e-6)
            if hc <= 4:  # torch's CPU sum adds up to 4 elements in index order, as the kernel does
                assert torch.equal(out, ref), (num_rows, hc, iters, (out - ref).abs().max().item())
            else:
                torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    for bad, msg in [(torch.ones(3, 4, 4, dtype=torch.float64), "float32"), (torch.ones(3, 4, 3), "[T, hc, hc]"),
                     (torch.ones(3, 0, 0), "hc must be >= 1"), (torch.ones(3, 4, 4).transpose(1, 2), "contiguous")]:
        try:
            sinkhorn_triton(bad, 20, 1e-6)
        except ValueError as e:
            assert msg in str(e), str(e)
        else:
            raise AssertionError(msg)
    print("ok")
""")


def test_triton_kernel_under_interpreter_is_bit_identical():
    pytest.importorskip("triton")
    assert run_interpreted(_INTERPRETED).strip() == "ok"


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows,hc", [(1, 4), (64, 4), (1000, 4), (8192, 4), (77, 3)])
def test_triton_kernel_on_cuda(num_rows, hc):
    pytest.importorskip("triton")
    if "triton" not in op_impl_names("sinkhorn"):
        pytest.skip("triton did not import")
    comb = _comb(num_rows, seed=num_rows, hc=hc)
    ref_cpu = sinkhorn_torch(comb, ITERS, EPS)
    comb = comb.cuda()
    out, ref = get_op("sinkhorn", "triton")(comb, ITERS, EPS), sinkhorn_torch(comb, ITERS, EPS)
    # NOTE: against the CPU reference the kernel is exact (same summation order, IEEE division);
    # torch's CUDA reduction may add in another order, so the CUDA reference gets a float32 tolerance.
    assert torch.equal(out.cpu(), ref_cpu)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRETED, tests=("test_triton_kernel_under_interpreter_is_bit_identical",), timeout=300)
