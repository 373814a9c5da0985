"""The RoPE op (`kernels.rope`): the reference is the model's `apply_rope` bit for bit; the Triton kernel equals it bit
for bit (float32, bfloat16, float16; forwards and inverse) under `TRITON_INTERPRET=1` in a subprocess (the variable
must be set before triton is imported) and on CUDA; "rope_bmm", the output projection with that kernel as its
inverse RoPE, equals the `attn_out_proj` reference; the kernels compile for sm_90a without FMA contraction.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from deepinfer.kernels import OpTable, default_impl, op_impl_names
from deepinfer.kernels.attn_proj import attn_out_proj_torch
from deepinfer.kernels.rope import apply_rope_torch, rope_torch
from tests.kernels._interp import prefetch_interpreted, run_interpreted

CASES = [  # (x shape, rd/2)
    ((5, 32), 16), ((3, 4, 64), 8), ((2, 3, 2, 10), 3), ((4, 8), 4), ((1, 64, 128), 32), ((0, 4, 16), 4),
]


def rope_case(shape, half, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    ang = torch.randn(shape[0], half, generator=g) * 10
    return x.to(device), ang.cos().to(device), ang.sin().to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_the_models_apply_rope(dtype):
    pytest.importorskip("pydantic")
    from deepinfer.engine.models.deepseek_v4 import apply_rope

    for shape, half in CASES:
        x, cos, sin = rope_case(shape, half, dtype)
        assert torch.equal(rope_torch(x, cos, sin), apply_rope(x, cos, sin))
        # against the rotation written as a complex product (float32, rounded once per product: close, not equal)
        rd = 2 * half
        z = torch.view_as_complex(x[..., -rd:].float().reshape(*x.shape[:-1], half, 2).contiguous())
        w = torch.complex(cos, sin).view(cos.shape[0], *(1,) * (x.dim() - 2), half)
        rot = torch.view_as_real(z * w).flatten(-2).to(dtype)
        torch.testing.assert_close(rope_torch(x, cos, sin)[..., -rd:], rot)
        assert torch.equal(rope_torch(x, cos, sin)[..., :-rd], x[..., :-rd])
        assert torch.equal(rope_torch(x, cos, sin, inverse=True), apply_rope(x, cos, -sin))
    assert apply_rope is apply_rope_torch  # one copy: the model's name for the op's reference


def test_op_table_defaults():
    assert default_impl("rope", "cpu") == "torch" and OpTable("cpu").rope is rope_torch
    assert default_impl("attn_out_proj", "cpu") == "torch"
    pytest.importorskip("triton")
    assert default_impl("rope", "cuda") == "triton"
    assert default_impl("attn_out_proj", "cuda") == "rope_bmm"  # cuBLAS bmm, the inverse RoPE one launch
    assert {"torch", "triton"} <= set(op_impl_names("rope"))


_INTERPRETED = textwrap.dedent("""
    import torch
    from tests.kernels.test_rope import CASES, rope_case
    from deepinfer.kernels.rope import rope_torch, rope_triton
    from deepinfer.kernels.attn_proj import attn_out_proj_rope_bmm, attn_out_proj_torch
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for seed, (shape, half) in enumerate(CASES):
            x, cos, sin = rope_case(shape, half, dtype, seed)
            for inverse in (False, True):
                want = rope_torch(x, cos, sin, inverse)
                for block_r in (None, 1, 8):
                    got = rope_triton(x, cos, sin, inverse, block_r=block_r)
                    assert got.dtype == x.dtype and torch.equal(got, want), (dtype, shape, inverse, block_r)
                    # in place: x itself comes back with the same bits (only its rope channels read and written)
                    y = x.clone()
                    assert rope_triton(y, cos, sin, inverse, inplace=True, block_r=block_r) is y
                    assert torch.equal(y, want), (dtype, shape, inverse, block_r, "inplace")
                y = x.clone()
                assert rope_torch(y, cos, sin, inverse, inplace=True) is y and torch.equal(y, want)
            # a row alone is the same (elementwise: batch invariant)
            if shape[0] > 1:
                assert torch.equal(rope_triton(x[1:2].contiguous(), cos[1:2], sin[1:2]), rope_torch(x, cos, sin)[1:2])
        # cos / sin rows of a wider buffer (row stride != rd/2), as a slice of a table
        x, cos, sin = rope_case((6, 2, 24), 12, dtype, 9)
        wide_c, wide_s = torch.cat([cos, cos], 1), torch.cat([sin, sin], 1)
        assert torch.equal(rope_triton(x, wide_c[:, :12], wide_s[:, :12]), rope_torch(x, cos, sin))
        # the output projection with the kernel as its inverse RoPE: the reference's bits
        o, c, s = rope_case((3, 4, 16), 4, dtype, 11)
        w = (torch.randn(2 * 5, 32, generator=torch.Generator().manual_seed(1)) * 0.2).to(dtype)
        assert torch.equal(attn_out_proj_rope_bmm(o, c, s, w, 2), attn_out_proj_torch(o, c, s, w, 2)), dtype
        assert torch.equal(attn_out_proj_rope_bmm(o.clone(), c, s, w, 2, inplace=True), attn_out_proj_torch(o, c, s, w, 2))
    x, cos, sin = rope_case((3, 4, 16), 4)
    for args, msg in [((x.transpose(0, 1), cos, sin), "contiguous"), ((x.double(), cos, sin), "float32, bfloat16"),
                      ((x, cos[:2], sin[:2]), "must be [3, rd/2]"), ((x, cos.double(), sin.double()), "float32"),
                      ((x[..., :7].contiguous(), cos, sin), "rope channels"), ((x[0], cos, sin), "must be [4, rd/2]"),
                      ((x, cos.t().contiguous().t(), sin), "contiguous rows")]:
        try:
            rope_triton(*args)
        except ValueError as e:
            assert msg in str(e), (msg, str(e))
        else:
            raise AssertionError(msg)
    print("ok")
""")


def test_triton_kernel_under_interpreter_is_bit_identical():
    pytest.importorskip("triton")
    assert run_interpreted(_INTERPRETED).strip() == "ok"


def compiled_ptx(fn, signature: dict, constexprs: dict, **options) -> str:
    """`fn` compiled ahead of time for sm_90 on the CPU (the interpreter never lowers a kernel): its PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constexprs}}, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_kernel_compiles_for_sm90_without_fma(dtype):
    """V4-Flash's output de-rotation (64 heads x 512, 64 rope channels): lowered for the H200, no product
    contracted into an FMA (that is what makes it the reference's bits on the GPU)."""
    pytest.importorskip("triton")
    from deepinfer.kernels.rope import _rope_kernel

    ptr = f"*{dtype}"
    for rope_only, block_d in ((False, 512), (True, 64)):  # the whole rows, or the rope channels in place
        ptx = compiled_ptx(_rope_kernel, {"x_ptr": ptr, "cos_ptr": "*fp32", "sin_ptr": "*fp32", "y_ptr": ptr,
                                          "R": "i32", "M": "i32", "cs_stride": "i32"},
                           {"D": 512, "HALF": 32, "INVERSE": True, "BF16": dtype == "bf16", "BLOCK_R": 4,
                            "BLOCK_D": block_d, "ROPE_ONLY": rope_only}, num_warps=4, enable_fp_fusion=False)
        assert "mul.rn.f32" in ptx and "fma.rn" not in ptx, rope_only


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,half", [((1, 64, 512), 32), ((128, 64, 512), 32), ((7, 64, 128), 32),
                                        ((300, 512), 32), ((5, 3, 24), 12)])
def test_triton_kernel_on_cuda_is_bit_identical(dtype, shape, half):
    """V4-Flash: the queries / the output (64 heads x 512), the indexer's queries (64 x 128), a K=V row."""
    from deepinfer.kernels.rope import rope_triton

    x, cos, sin = rope_case(shape, half, dtype, seed=shape[0], device="cuda")
    for inverse in (False, True):
        want = rope_torch(x, cos, sin, inverse)
        assert torch.equal(rope_triton(x, cos, sin, inverse), want), (rope_triton(x, cos, sin, inverse).float()
                                                                     - want.float()).abs().max()
        y = x.clone()
        assert rope_triton(y, cos, sin, inverse, inplace=True) is y and torch.equal(y, want)
        assert torch.equal(want.cpu(), rope_torch(x.cpu(), cos.cpu(), sin.cpu(), inverse))  # CUDA == CPU too


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 64])
def test_rope_bmm_on_cuda_is_the_reference(dtype, T):
    """V4-Flash: 64 heads x 512 in 8 groups, o_lora_rank 1024."""
    from deepinfer.kernels.attn_proj import attn_out_proj_rope_bmm

    o, cos, sin = rope_case((T, 64, 512), 32, dtype, seed=T, device="cuda")
    w = (torch.randn(8 * 1024, 4096, device="cuda") * 0.02).to(dtype)
    assert torch.equal(attn_out_proj_rope_bmm(o, cos, sin, w, 8), attn_out_proj_torch(o, cos, sin, w, 8))
    assert torch.equal(attn_out_proj_rope_bmm(o.clone(), cos, sin, w, 8, inplace=True),
                       attn_out_proj_torch(o, cos, sin, w, 8))


# the background run of the interpreter script (tests/kernels/_interp.py: CI time)
prefetch_interpreted(_INTERPRETED, tests=("test_triton_kernel_under_interpreter_is_bit_identical",), timeout=300)
