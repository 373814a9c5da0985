"""The fused small ops (`kernels.rmsnorm`, `kernels.rope`, `kernels.swiglu`, "attn_out_proj" = "rope_bmm") inside the
V4 model, picked through its `OpTable` as on CUDA: with the elementwise ones (RoPE, the output's inverse RoPE, the
shared expert's activation but for its `exp`) the logits are the torch ops' bit for bit; with all of them (RMSNorm
adds float32 rounding) the greedy tokens are the same and the logits within rounding. Under `TRITON_INTERPRET=1`
in a subprocess, and on CUDA (`gpu`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("pydantic")  # the model config needs it

ROOT = Path(__file__).resolve().parents[2]

EXACT = {"rope": "triton", "attn_out_proj": "rope_bmm"}
"""The elementwise kernels whose results are the references' bits on any device."""
ALL = {**EXACT, "swiglu": "triton", "rms_norm": "triton"}
"""Every op this file covers, at its CUDA choice."""


def model_logits(ckpt, device="cpu", dtype="float32", overrides=None, attention_backend="torch") -> list:
    """Every token's logits of the tiny model over a chunked prefill, a mixed step and decode steps, with the op
    implementations `overrides` (else the device's defaults) picked through the model's `OpTable`."""
    from deepinfer.engine.loader import load_checkpoint
    from deepinfer.engine.testing.model_runner import ModelRunnerForTests

    model = load_checkpoint(ckpt, dtype=dtype, device=device, attention_backend=attention_backend)[0]
    ops = model.model.ops
    ops.overrides.update(overrides or {})
    ops.select(device)
    for layer in model.model.layers:  # one table, shared by every module that calls an op
        assert layer.attn.ops is ops and layer.ffn.ops is ops
        assert getattr(layer.attn, "indexer", None) is None or layer.attn.indexer.ops is ops
    runner = ModelRunnerForTests(model, max_seqs=3, max_len=96)
    ids = torch.randint(2, 500, (60,), generator=torch.Generator().manual_seed(5)).tolist()
    plan = [[(0, ids[:23]), (1, ids[:9])], [(0, ids[23:40]), (1, [7])], [(0, [3]), (1, [4]), (2, ids[:12])]]
    plan += [[(0, [5 + k]), (1, [6 + k]), (2, [7 + k])] for k in range(4)]
    return [runner.run(work, logits="all") for work in plan]


def torch_ops(device: str) -> dict:
    return {op: "torch" for op in ALL} if device == "cuda" else {}


def check(ckpt, device="cpu", dtype="float32", attention_backend="torch") -> float:
    """Exact with the elementwise kernels; the same greedy tokens with all; returns the worst |logit difference|."""
    ref = model_logits(ckpt, device, dtype, torch_ops(device), attention_backend)
    exact = model_logits(ckpt, device, dtype, {**torch_ops(device), **EXACT}, attention_backend)
    assert all(torch.equal(a, b) for a, b in zip(ref, exact))
    fused = model_logits(ckpt, device, dtype, ALL, attention_backend)
    for a, b in zip(ref, fused):
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
    return max((a - b).abs().max().item() for a, b in zip(ref, fused))


_INTERPRETED = textwrap.dedent("""
    import sys
    from tests.kernels.test_small_ops_in_model import check
    print("ok", check(sys.argv[1]))
""")


def test_fused_ops_in_the_model_under_interpreter(tmp_path):
    pytest.importorskip("triton")
    from deepinfer.engine.testing.make_checkpoint import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "tiny", preset="tiny", seed=6)
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT.parent), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", _INTERPRETED, str(ckpt)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stdout + run.stderr
    assert float(run.stdout.split()[1]) < 1e-4


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
