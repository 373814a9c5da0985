"""The swap-AB FP8 GEMM experiment (benchmarks/fp8_swap_ab.py) against the exact reference, on the CPU
under TRITON_INTERPRET=1 (float32 activations: the interpreter's bf16 dot is not a reference)."""

import textwrap

import pytest

from tests.kernels._interp import run_interpreted

pytest.importorskip("triton")

_SCRIPT = textwrap.dedent("""
    import torch
    from deepinfer.benchmarks.fp8_swap_ab import swap_gemm
    from deepinfer.kernels.fp8_gemm import fp8_gemm_torch

    torch.manual_seed(0)
    n, k = 320, 640  # N and K off the 128 grid of the blocks and tiles
    w8 = (torch.randn(n, k) * 0.5).to(torch.float8_e4m3fn)
    scale = torch.randint(118, 132, (3, 5), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    for m, cfg in ((1, (16, 64, 128, 4, 3, 2)), (5, (16, 128, 64, 4, 3, 8)), (17, (32, 64, 128, 4, 3, 2))):
        x = torch.randn(m, k)
        ref = fp8_gemm_torch(x, w8, scale, (128, 128))
        got = swap_gemm(x, w8, scale, cfg)
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, (m, cfg, err)
    print("ok")
""")


def test_swap_ab_matches_reference_under_interpreter():
    out = run_interpreted(_SCRIPT)
    assert "ok" in out, out
