"""V4.1's dense 32x32-block FP8 linears kept quantized (`deepseek_v41.keep_fp8_linears`, `load_published(keep_fp8=True)`,
the engine's `load_for_engine`): `engine.quant.Fp8Linear` with block (32, 32) and UE8M0 scales over the `"fp8_gemm"` op
(the per-block dequantizing torch reference on the CPU, Triton on CUDA).

On the tiny published checkpoint: logits equal the dequantized float model's; the kept linears hold exactly the
checkpoint's FP8 bytes (weights and scales, as stored); the engine's model and its memory plan (`engine.fit`) agree
on the bytes; the Triton kernel with 32x32 blocks under the interpreter; on CUDA the kept model equals the CPU's.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from safetensors import safe_open

from deepinfer.engine.models.deepseek_v41 import (
    PUBLISHED_FP8_BLOCK,
    dequantized_at_load,
    engram_token_map_for,
    load_published,
    published_storage,
    published_tensors,
)
from deepinfer.engine.quant.linear import Fp8Linear
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from tests.kernels._interp import prefetch_interpreted, run_interpreted


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("v41fp8") / "ck", format="published-v41", seed=5)


def _stored(path):
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for file in sorted(set(weight_map.values())):
        with safe_open(str(path / file), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _pair(ckpt):
    ref, kept = load_published(ckpt), load_published(ckpt, keep_fp8=True)
    for m in (ref, kept):
        m.set_engram_token_map(engram_token_map_for(ckpt, m.config))
    return ref, kept


def test_kept_fp8_logits_equal_the_dequantized_model(ckpt):
    ref, kept = _pair(ckpt)
    ids = torch.randint(3, 64, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(kept.forward_full(ids), ref.forward_full(ids), rtol=1e-5, atol=1e-5)
    # the dense FP8 linears are exactly the checkpoint's, the float model holds their dequantized weights
    fp8 = {n: m for n, m in kept.named_modules() if isinstance(m, Fp8Linear)}
    assert sorted(n + ".weight" for n in fp8) == sorted(n for n in ref.state_dict() if published_storage(n) == "fp8")
    for name, m in fp8.items():
        assert m.block == PUBLISHED_FP8_BLOCK and m.weight.dtype == torch.float8_e4m3fn
        assert m.scale.dtype == torch.float8_e8m0fnu
        assert torch.equal(m.dequantized(), ref.get_submodule(name).weight.float())


def test_kept_bytes_are_the_checkpoints_fp8_bytes(ckpt):
    """The kept linears hold the stored FP8 weights and UE8M0 scales, byte for byte (no float copy), and write
    them back unchanged (`published_tensors`)."""
    _, kept = _pair(ckpt)
    stored = _stored(ckpt)
    fp8_names = [n for n in stored if published_storage(n[: -len(".scale")] + ".weight" if n.endswith(".scale") else n)
                 == "fp8"]
    held = {n: t for n, t in kept.state_dict().items() if n in set(fp8_names)}
    assert sorted(held) == sorted(fp8_names) and len(held) > 0
    for n, t in held.items():
        assert t.dtype == stored[n].dtype and torch.equal(t.view(torch.uint8), stored[n].view(torch.uint8)), n
    fp8_bytes = sum(stored[n].numel() * stored[n].element_size() for n in fp8_names)
    resident = sum(m.resident_nbytes() for m in kept.modules() if isinstance(m, Fp8Linear))
    assert resident == fp8_bytes
    out = published_tensors(kept)
    for n in fp8_names:
        assert torch.equal(out[n].view(torch.uint8), stored[n].view(torch.uint8)), n


def test_engine_keeps_fp8_and_its_memory_plan_counts_it(ckpt):
    """`LLM` loads the kept linears (bf16 engine: activations bf16, FP8 weights untouched by the dtype cast), and
    `checkpoint_weight_bytes(..., dequantized_at_load, kept_float32)` (the plan) equals the bytes the engine's model holds."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.engine.fit import checkpoint_weight_bytes
    from deepinfer.engine.models.deepseek_v41 import kept_float32

    for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        llm = LLM(str(ckpt), max_model_len=64, max_num_seqs=2, block_size=4, dtype=dtype)
        model = llm.engine.model
        fp8 = [m for m in model.modules() if isinstance(m, Fp8Linear)]
        assert fp8 and all(m.weight.dtype == torch.float8_e4m3fn for m in fp8)
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        wb = checkpoint_weight_bytes(ckpt, torch_dtype, dequantized_at_load, kept_float32)
        assert wb.expert_bytes + wb.other_bytes == held
        (o,) = llm.generate([[5, 9, 11, 3, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)
        assert len(o.outputs[0].token_ids) == 3
        llm.shutdown()


_INTERPRET_SCRIPT = textwrap.dedent("""
    import torch
    from deepinfer.engine.quant.formats import quantize_fp8_block
    from deepinfer.kernels.fp8_gemm import fp8_gemm_candidates, fp8_gemm_torch, fp8_gemm_triton

    g = torch.Generator().manual_seed(0)
    for m, n, k in [(1, 96, 64), (5, 70, 160), (33, 64, 96)]:
        w8, s = quantize_fp8_block(torch.randn(n, k, generator=g), (32, 32))
        x = torch.randn(m, k, generator=g)
        want = fp8_gemm_torch(x, w8, s, (32, 32))
        for cfg in fp8_gemm_candidates(m)[:2]:
            got = fp8_gemm_triton(x, w8, s, (32, 32), config=cfg)
            assert ((got - want).abs() / (1 + want.abs())).max().item() < 5e-5, (m, n, k, cfg)
    print("OK")
""")


def test_fp8_gemm_triton_with_32x32_blocks_under_the_interpreter():
    """The Triton FP8 GEMM with V4.1's 32x32 scale blocks (BLOCK_K capped at 32, one scale row per 32 outputs)."""
    pytest.importorskip("triton")
    out = run_interpreted(_INTERPRET_SCRIPT)
    assert "OK" in out, out


@pytest.mark.gpu
def test_kept_fp8_on_cuda_matches_the_cpu(ckpt):
    _, kept = _pair(ckpt)
    ids = torch.randint(3, 64, (40,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = kept.forward_full(ids)
        got = kept.to("cuda").forward_full(ids.cuda()).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_dequantized_at_load_names():
    assert not dequantized_at_load("layers.0.attn.wq_a.weight") and not dequantized_at_load("layers.0.attn.wq_a.scale")
    # the FP4 experts and the Engram tables are kept too (tests/engine/v41/test_quant_kept.py)
    assert not dequantized_at_load("layers.0.ffn.experts.1.w1.scale")
    assert not dequantized_at_load("layers.1.engram.embed.weight")
    assert not dequantized_at_load("layers.0.attn.wo_a.weight")


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRET_SCRIPT,
                     tests=("test_fp8_gemm_triton_with_32x32_blocks_under_the_interpreter",), timeout=300)
