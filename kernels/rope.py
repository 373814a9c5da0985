"""Interleaved partial RoPE: op `"rope"`, `(x [n, ..., D], cos [n, rd/2], sin [n, rd/2], inverse=False) -> y`.

The model's `apply_rope` (`apply_rope_torch` below, engine/models/deepseek_v4.py's `apply_rope`): the trailing
`rd = 2 * cos.shape[-1]` channels of each row of x, taken in float32 as consecutive pairs (x1, x2) = (even, odd),
become (x1 c - x2 s, x2 c + x1 s) at the row's token (cos/sin broadcast over the middle dims), rounded to x's dtype;
the leading `D - rd` channels pass unchanged. `inverse=True` rotates back (`apply_rope(x, cos, -sin)`: the attention
output's de-rotation).

Implementations:
  * `"torch"`: the reference, the model's code op for op (on a GPU about ten launches: a cast, four products, a
    difference, a sum, a stack, a cast, a concatenation; one more for `-sin`). The default off CUDA.
  * `"triton"`: one kernel; each program takes `BLOCK_R` rows of D channels, every rope channel's partner
    (`d ^ 1`) loaded a second time rather than shuffled. The CUDA default.

NOTE: the kernel is elementwise and compiled with `enable_fp_fusion=False`, so no product is contracted into an
FMA: each product, difference and sum is rounded once in float32, as torch's separate ops do, and `-sin` is an
exact negation; a bfloat16 result is rounded to nearest-even by hand (`rtne_bf16`: the interpreter's cast
truncates). Its result equals the reference bit for bit (tests/kernels/test_rope.py checks `torch.equal`
under the interpreter, float32 and bfloat16, both directions; the `gpu` tests on CUDA). It is batch invariant
(elementwise); the batch-invariant mode pins it to the reference anyway, as every `OpTable` op.
"""

from __future__ import annotations

import os

import torch

from deepinfer.kernels.registry import register_default_impl, register_op

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)

ROPE_IN_PLACE = os.environ.get("DEEPINFER_ROPE_IN_PLACE", "0") == "1"
"""Whether the model rotates the tensors it owns in place (`inplace=True`: the attention output before `wo_a`, the
indexer's queries), so that the Triton kernel reads and writes only the rope channels. Opt-in: its first form ran
0.61 ms against 0.36 ms out of place on an H100 (8,192 x 64 x 512 bf16, 2026-12-06: its channel offsets were not
provably contiguous, so no vector loads); the form here (contiguous offsets) is not timed yet."""


def apply_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The interleaved partial RoPE, x [n, ..., D], cos/sin [n, rd/2] (module docstring). The one torch copy: the
    model's `apply_rope` (engine/models/deepseek_v4.py), the references of `kernels.attn_proj` and
    `kernels.compressor` call it."""
    return torch.cat([x[..., :-2 * cos.shape[-1]], _rotated_channels(x, cos, sin)], dim=-1)


def _rotated_channels(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The trailing `rd` channels of x rotated (`apply_rope_torch`'s arithmetic), in x's dtype `[n, ..., rd]`."""
    rd = cos.shape[-1] * 2
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    rope = x[..., -rd:].float()
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)


@register_op("rope", "torch")
def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
               inplace: bool = False) -> torch.Tensor:
    """Reference RoPE (module docstring); `inverse` rotates back by the same angles (`-sin`); `inplace` writes the
    rope channels into x and returns it (the same values)."""
    sin = -sin if inverse else sin
    if not inplace:
        return apply_rope_torch(x, cos, sin)
    x[..., -2 * cos.shape[-1]:] = _rotated_channels(x, cos, sin)  # no copy of the other channels
    return x


@register_default_impl("rope")
def _default_rope(device: torch.device) -> str:
    # bit-identical to the reference, one launch instead of ~10 (module docstring)
    return "triton" if device.type == "cuda" and triton is not None else "torch"


if triton is not None:

    @triton.jit
    def rtne_bf16(x):
        """float32 `x` rounded to the nearest bfloat16 (ties to even), still float32, NaN kept: its `.to(tl.bfloat16)`
        is then exact. NOTE: a GPU's `.to(tl.bfloat16)` rounds so already, but the interpreter truncates; rounding
        by hand gives the same bits on both (torch's float -> bfloat16 cast does the same integer rounding)."""
        b = x.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        return tl.where(x != x, x, b.to(tl.float32, bitcast=True))

    @triton.jit
    def round_like(x, like):
        """float32 `x` rounded to the element type of pointer `like` and back to float32: where a torch op in that
        dtype rounds its result. bfloat16 goes through `rtne_bf16`: integer ops the compiler cannot fold away, so a
        product rounded here is never fused into a following add (an FMA would skip the rounding), and the
        interpreter gives the GPU's bits."""
        if like.dtype.element_ty == tl.bfloat16:
            return rtne_bf16(x)
        return x.to(like.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, R, M, cs_stride, D: tl.constexpr, HALF: tl.constexpr,
                     INVERSE: tl.constexpr, BF16: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                     ROPE_ONLY: tl.constexpr):
        # ROPE_ONLY: the program's channels are the rope channels only (in place: y_ptr is x_ptr; every load of a
        # row's channels comes before its stores, and a row belongs to one program)
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)  # rows of x viewed [R, D]
        if ROPE_ONLY:
            d = (D - 2 * HALF) + tl.arange(0, BLOCK_D)  # channels past D masked off below (contiguous: vector loads)
        else:
            d = tl.arange(0, BLOCK_D)
        r_ok = r < R
        d_ok = d < D
        m = r_ok[:, None] & d_ok[None, :]
        x = tl.load(x_ptr + r[:, None] * D + d[None, :], mask=m, other=0.0)
        is_rope = d >= D - 2 * HALF
        rm = m & is_rope[None, :]
        # NOTE: D - rd is even (checked), so a rope channel's pair partner d ^ 1 is a rope channel too
        xp = tl.load(x_ptr + r[:, None] * D + (d ^ 1)[None, :], mask=rm, other=0.0).to(tl.float32)
        t = r // M  # the row's token
        j = tl.where(is_rope, (d - (D - 2 * HALF)) // 2, 0)
        c = tl.load(cos_ptr + t[:, None] * cs_stride + j[None, :], mask=rm, other=1.0)
        s = tl.load(sin_ptr + t[:, None] * cs_stride + j[None, :], mask=rm, other=0.0)
        if INVERSE:
            s = -s
        xf = x.to(tl.float32)
        even = (d % 2 == 0)[None, :]
        rot = tl.where(even, xf * c - xp * s, xf * c + xp * s)  # (x1 c - x2 s, x2 c + x1 s)
        if BF16:
            rot = rtne_bf16(rot)
        y = tl.where(is_rope[None, :], rot.to(y_ptr.dtype.element_ty), x)
        tl.store(y_ptr + r[:, None] * D + d[None, :], y, mask=m)

    @register_op("rope", "triton")
    def rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
                    inplace: bool = False, block_r: int | None = None) -> torch.Tensor:
        """Triton RoPE (module docstring), bit-identical to `rope_torch`: x contiguous [n, ..., D] float32 /
        bfloat16 / float16 (2-D or more); cos/sin float32 [n, rd/2] with contiguous rows (1 <= rd/2, D - rd
        even). Returns a new tensor like x, or x itself with `inplace` (then only the rope channels are read and
        written: rd / D of the traffic). No autograd. On CUDA, or on the CPU under `TRITON_INTERPRET=1`.
        `block_r`: rows a program (a power of two; default: as many as make ~2048 elements)."""
        if x.dim() < 2 or not x.is_contiguous():
            raise ValueError(f"rope_triton: x must be a contiguous [n, ..., D] tensor, got {list(x.shape)} with "
                             f"strides {list(x.stride())} (call .contiguous())")
        if x.dtype not in _FLOATS:
            raise ValueError(f"rope_triton: x must be float32, bfloat16 or float16, got {x.dtype}")
        n, D = x.shape[0], x.shape[-1]
        if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != n:
            raise ValueError(f"rope_triton: cos and sin must be [{n}, rd/2], got {list(cos.shape)} and "
                             f"{list(sin.shape)}")
        if cos.dtype != torch.float32 or sin.dtype != torch.float32:
            raise ValueError(f"rope_triton: cos and sin must be float32, got {cos.dtype} and {sin.dtype}")
        half = cos.shape[1]
        if cos.stride(1) != 1 or sin.stride(1) != 1 or (n > 1 and cos.stride(0) != sin.stride(0)):
            raise ValueError("rope_triton: cos and sin need contiguous rows with one row stride (call .contiguous())")
        if half < 1 or 2 * half > D or (D - 2 * half) % 2:
            raise ValueError(f"rope_triton: width {D} must hold the {2 * half} rope channels after an even number "
                             "of others (rd/2 >= 1)")
        if cos.device != x.device or sin.device != x.device:
            raise ValueError(f"rope_triton: x, cos and sin must be on one device, got {x.device}, {cos.device}, "
                             f"{sin.device}")
        if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"rope_triton needs a CUDA tensor (or TRITON_INTERPRET=1), got {x.device}")
        if x.requires_grad and torch.is_grad_enabled():
            raise ValueError("rope_triton has no backward; use the 'torch' implementation for training")
        block_d = triton.next_power_of_2(2 * half if inplace else D)
        if block_r is None:
            block_r = max(1, 2048 // block_d)
        if block_r < 1 or block_r & (block_r - 1):
            raise ValueError(f"rope_triton: block_r must be a power of two, got {block_r}")
        y = x if inplace else torch.empty_like(x)
        R = x.numel() // D
        if R:
            # NOTE: enable_fp_fusion=False: no FMA contraction, so every op rounds as torch's (bit-identical)
            _rope_kernel[(triton.cdiv(R, block_r),)](
                x, cos, sin, y, R, R // n if n else 1, cos.stride(0), D=D, HALF=half, INVERSE=bool(inverse),
                BF16=x.dtype == torch.bfloat16, BLOCK_R=block_r, BLOCK_D=block_d, ROPE_ONLY=bool(inplace), num_warps=4,
                enable_fp_fusion=False,
            )
        return y
