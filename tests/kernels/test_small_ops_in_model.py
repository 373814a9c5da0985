"""The fused small ops (`kernels.rmsnorm`, `kernels.rope`, `kernels.swiglu`, "attn_out_proj" = "rope_bmm") inside the
V4 model, picked through its `OpTable` as on CUDA: with the elementwise ones (RoPE, the output's inverse RoPE, the
shared expert's activation but for its `exp`) the logits are the torch ops' bit for bit; with all of them (RMSNorm
adds float32 rounding) the greedy tokens are the same and the logits within rounding. Under `TRITON_INTERPRET=1`
in a subprocess, and on CUDA (`gpu`).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.kernels._kernel_checks import run_on_tiny_model, worst_diff_same_tokens
from tests.kernels._kernel_checks import tiny_model_logits as model_logits  # (ckpt, device, dtype, overrides, backend)

pytest.importorskip("pydantic")  # the model config needs it

EXACT = {"rope": "triton", "attn_out_proj": "rope_bmm"}
"""The elementwise kernels whose results are the references' bits on any device."""
ALL = {**EXACT, "swiglu": "triton", "rms_norm": "triton"}
"""Every op this file covers, at its CUDA choice."""


def torch_ops(device: str) -> dict:
    return {op: "torch" for op in ALL} if device == "cuda" else {}


def check(ckpt, device="cpu", dtype="float32", attention_backend="torch") -> float:
    """Exact with the elementwise kernels; the same greedy tokens with all; returns the worst |logit difference|."""
    from deepinfer.kernels import rope

    ref = model_logits(ckpt, device, dtype, torch_ops(device), attention_backend)
    exact = model_logits(ckpt, device, dtype, {**torch_ops(device), **EXACT}, attention_backend)
    assert all(torch.equal(a, b) for a, b in zip(ref, exact))
    was, rope.ROPE_IN_PLACE = rope.ROPE_IN_PLACE, True  # the opt-in in-place RoPE (the output's and the indexer queries'): the same bits
    try:
        for ops in ({**torch_ops(device), **EXACT}, torch_ops(device)):
            assert all(torch.equal(a, b) for a, b in zip(ref, model_logits(ckpt, device, dtype, ops, attention_backend)))
    finally:
        rope.ROPE_IN_PLACE = was
    return worst_diff_same_tokens(ref, model_logits(ckpt, device, dtype, ALL, attention_backend))


_INTERPRETED = textwrap.dedent("""
    import sys
    from tests.kernels.test_small_ops_in_model import check
    print("ok", check(sys.argv[1]))
""")


def test_fused_ops_in_the_model_under_interpreter(tmp_path):
    assert run_on_tiny_model(tmp_path, _INTERPRETED) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("attention_backend", ["torch", "triton"])
def test_fused_ops_in_the_model_on_cuda(tmp_path, dtype, attention_backend):
    """The elementwise kernels, the shared expert's with them (on CUDA its exp is torch's: libdevice's expf), give
    the torch ops' logits bit for bit in float32 and bfloat16; with RMSNorm too, float32 keeps the greedy tokens."""
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "tiny", preset="tiny", seed=6)
    ref = model_logits(ckpt, "cuda", dtype, torch_ops("cuda"), attention_backend)
    exact = model_logits(ckpt, "cuda", dtype, {**torch_ops("cuda"), **EXACT, "swiglu": "triton"}, attention_backend)
    assert all(torch.equal(a, b) for a, b in zip(ref, exact))
    if dtype == "float32":
        assert check(ckpt, "cuda", dtype, attention_backend) < 1e-3
