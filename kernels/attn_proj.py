"""The attention layer's small ops around the backend: the query / key RMSNorm + RoPE (with the window ring's
one-token write fused) and the grouped output projection (with the inverse RoPE fused).

Model ops (the model's `OpTable`; `engine.models.deepseek_v4.Attention` calls them):

* `"attn_norm_rope"`: `(x [T, D] | [T, NH, D], weight [D] float32 | None, eps, cos [T, rd/2], sin [T, rd/2],
  ring=None, slots=None, pos=None) -> y` like x: `apply_rope(rms_norm(x, weight, eps), cos, sin)` of
  engine/models/deepseek_v4.py (RMSNorm over the last dim in float32, rounded to x's dtype, then the
  interleaved RoPE of the trailing `rd` channels at each token's cos/sin, rounded again). With `ring`
  [S, W, D] (x 2-D: the shared K=V head) each row is also written to `ring[slots[t], pos[t] % W]`
  where `slots[t] < S` (the decode step's window-ring write, `kernels.decode_attention.ring_write`).
* `"attn_out_proj"`: `(o [T, NH, D], cos, sin, weight [G * R, NH * D / G], groups) -> [T, G * R]`: the
  attention output rotated back by the query position (`apply_rope(o, cos, -sin)`), then the grouped
  low-rank projection `wo_a` (group g's `NH * D / G` channels times its `R` rows of the weight: a
  block-diagonal matmul, `torch.bmm` in the model). `wo_b` follows in the model. `inplace=True` (the model, whose
  attention output is not read again) lets an implementation rotate o's rope channels in place ("rope_bmm": only
  those channels are read and written, not a copy of all of o).

The torch implementations are the model's arithmetic, op for op (bit-identical on the CPU). The Triton
kernels: `attn_norm_rope` takes `BLOCK_R` rows of D channels per program, the sum of squares in float32,
each RoPE channel's partner (`d ^ 1`) loaded a second time rather than shuffled; `attn_out_proj` is one
grouped GEMM (grid `(T / BLOCK_M, R / BLOCK_R, G)`), the inverse RoPE applied to the A tile as it is
loaded (rounded to the weight's dtype, as the model's `apply_rope` rounds before the `bmm`), float32
accumulation. They differ from the references by float32 summation order and FMA contraction only.

`attn_norm_rope` defaults to "triton" on CUDA (the `gpu` tests passed on an H200, 2026-12-05) and "torch"
elsewhere; `attn_out_proj` keeps cuBLAS' `bmm` everywhere (the kernel is correct but slower than cuBLAS on the
H200: `_default_out_proj`), on CUDA with the inverse RoPE as one launch ("rope_bmm": `kernels.rope`'s kernel, the
reference's bits); `op_impls` picks any on CUDA.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from deepinfer.kernels.decode_attention import ring_write_torch
from deepinfer.kernels.registry import register_default_impl, register_op
from deepinfer.kernels.rope import apply_rope_torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None


# --------------------------------------------------------------------------- torch references


@register_op("attn_norm_rope", "torch")
def attn_norm_rope_torch(x, weight, eps: float, cos, sin, ring=None, slots=None, pos=None) -> torch.Tensor:
    """Reference RMSNorm + RoPE (+ the ring write), see the module docstring."""
    y = apply_rope_torch(F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype), cos, sin)
    if ring is not None:
        ring_write_torch(ring, slots, pos, y)
    return y


@register_op("attn_out_proj", "torch")
def attn_out_proj_torch(o, cos, sin, weight, groups: int, inplace: bool = False) -> torch.Tensor:
    """Reference inverse RoPE + grouped `wo_a` projection, see the module docstring (o is never changed here)."""
    T = o.shape[0]
    out = apply_rope_torch(o, cos, -sin)
    grouped = out.reshape(T, groups, -1).transpose(0, 1)  # [G, T, NH*D/G]
    w = weight.view(groups, -1, grouped.shape[-1])  # [G, R, NH*D/G]
    return torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(T, -1)  # [T, G*R]


if triton is not None:
    from deepinfer.kernels.rope import rope_triton

    @register_op("attn_out_proj", "rope_bmm")
    def attn_out_proj_rope_bmm(o, cos, sin, weight, groups: int, inplace: bool = False) -> torch.Tensor:
        """The reference with its inverse RoPE as one Triton launch (`kernels.rope`, bit-identical to
        `apply_rope_torch`; `inplace`: into o's rope channels), then the same `bmm`: equal to `attn_out_proj_torch`
        bit for bit, ~10 launches fewer. The CUDA default."""
        T = o.shape[0]
        out = rope_triton(o, cos, sin, inverse=True, inplace=inplace)
        grouped = out.reshape(T, groups, -1).transpose(0, 1)  # [G, T, NH*D/G]
        w = weight.view(groups, -1, grouped.shape[-1])  # [G, R, NH*D/G]
        return torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(T, -1)  # [T, G*R]


TRITON_OUT_PROJ_MAX_TOKENS = 16
"""Above this many tokens the "triton" `attn_out_proj` runs the torch reference (cuBLAS `bmm`): the kernel's
large-T tiling reached ~9 TFLOP/s on the H200 (2026-12-05: 243 ms of a 326 ms 8,192-token prefill for 4 layers;
+2.3 ms GPU time at decode batch 128), while its decode tiling (<= 16 tokens: the weight read once) pays.
`force_kernel=True` runs the kernel at any T (tests, benchmarks)."""


def _default(device: torch.device) -> str:
    # the Triton kernels on CUDA (they passed their `gpu` tests on an H200, 2026-12-05), "torch" elsewhere
    return "triton" if device.type == "cuda" and triton is not None else "torch"


def _default_out_proj(device: torch.device) -> str:
    # NOTE: cuBLAS bmm on every device: the Triton GEMM is correct on the H200 but slow there (2026-12-05: 134 us
    # a call at batch 1 for a 67 MB weight, ~0.5 TB/s; 870 us at batch 128); `op_impls={"attn_out_proj": "triton"}`
    # picks it. On CUDA the inverse RoPE before the bmm is one Triton launch ("rope_bmm", bit-identical to "torch").
    return "rope_bmm" if device.type == "cuda" and triton is not None else "torch"


register_default_impl("attn_norm_rope")(_default)
register_default_impl("attn_out_proj")(_default_out_proj)


def _check_device(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{name} needs CUDA tensors (or TRITON_INTERPRET=1), got {t.device}")


def _check_rope(name: str, cos: torch.Tensor, sin: torch.Tensor, T: int, D: int) -> int:
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != T:
        raise ValueError(f"{name}: cos and sin must be [{T}, rd/2], got {list(cos.shape)} and {list(sin.shape)}")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or not cos.is_contiguous() \
            or not sin.is_contiguous():
        raise ValueError(f"{name}: cos and sin must be contiguous float32")
    half = cos.shape[1]
    if D % 2 or 2 * half > D:
        raise ValueError(f"{name}: width {D} must be even and hold the {2 * half} rope channels")
    return half


# --------------------------------------------------------------------------- Triton


if triton is not None:

    @triton.jit
    def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, ring_ptr, slots_ptr, pos_ptr, R, NH, eps,
                          num_slots, W, D: tl.constexpr, HALF: tl.constexpr, HAS_W: tl.constexpr,
                          WRITE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_D)
        r_ok = r < R
        d_ok = d < D
        m = r_ok[:, None] & d_ok[None, :]
        dp = d ^ 1  # the RoPE partner channel (pairs are (even, odd); D - rd is even)
        x = tl.load(x_ptr + r[:, None] * D + d[None, :], mask=m, other=0.0)
        xp = tl.load(x_ptr + r[:, None] * D + dp[None, :], mask=m, other=0.0).to(tl.float32)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]
        yn = xf * inv
        yp = xp * inv
        if HAS_W:
            yn = yn * tl.load(w_ptr + d, mask=d_ok, other=0.0)[None, :]
            yp = yp * tl.load(w_ptr + dp, mask=d_ok, other=0.0)[None, :]
        yn = yn.to(x.dtype).to(tl.float32)  # the model rounds the normed row before the RoPE
        yp = yp.to(x.dtype).to(tl.float32)
        t = r // NH
        is_rope = d >= D - 2 * HALF
        j = tl.where(is_rope, (d - (D - 2 * HALF)) // 2, 0)
        rm = m & is_rope[None, :]
        c = tl.load(cos_ptr + t[:, None] * HALF + j[None, :], mask=rm, other=1.0)
        s = tl.load(sin_ptr + t[:, None] * HALF + j[None, :], mask=rm, other=0.0)
        even = (d % 2 == 0)[None, :]
        rot = tl.where(even, yn * c - yp * s, yn * c + yp * s)  # (x1 c - x2 s, x2 c + x1 s)
        y = tl.where(is_rope[None, :], rot, yn).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + r[:, None] * D + d[None, :], y, mask=m)
        if WRITE:
            slot = tl.load(slots_ptr + t, mask=r_ok, other=num_slots)
            row = tl.load(pos_ptr + t, mask=r_ok, other=0) % W
            ok = r_ok & (slot < num_slots)
            tl.store(ring_ptr + (slot * W + row)[:, None] * D + d[None, :], y.to(ring_ptr.dtype.element_ty),
                     mask=ok[:, None] & d_ok[None, :])

    @register_op("attn_norm_rope", "triton")
    def attn_norm_rope_triton(x, weight, eps: float, cos, sin, ring=None, slots=None, pos=None,
                              block_r: int = 4) -> torch.Tensor:
        """Triton RMSNorm + RoPE (+ the ring write), see the module docstring. x contiguous ([T, D] or
        [T, NH, D]), weight float32 [D] or None, cos/sin float32 [T, rd/2]; ring [S, W, D] of x's dtype with
        slots/pos int64 [T] (x 2-D only)."""
        if x.dim() not in (2, 3) or not x.is_contiguous():
            raise ValueError(f"attn_norm_rope: x must be a contiguous [T, D] or [T, NH, D] tensor, got "
                             f"{list(x.shape)}")
        T, D = x.shape[0], x.shape[-1]
        NH = x.shape[1] if x.dim() == 3 else 1
        half = _check_rope("attn_norm_rope", cos, sin, T, D)
        if weight is not None and (weight.shape != (D,) or weight.dtype != torch.float32
                                   or not weight.is_contiguous()):
            raise ValueError(f"attn_norm_rope: weight must be contiguous float32 [{D}], got {weight.dtype} "
                             f"{list(weight.shape)}")
        write = ring is not None
        if write:
            if x.dim() != 2 or ring.dim() != 3 or ring.shape[2] != D or not ring.is_contiguous() \
                    or ring.dtype != x.dtype:
                raise ValueError(f"attn_norm_rope: the ring write takes x [T, D] and a contiguous ring [S, W, {D}] "
                                 f"of x's dtype, got {list(x.shape)} and {ring.dtype} {list(ring.shape)}")
            for name, t in (("slots", slots), ("pos", pos)):
                if t is None or t.dtype != torch.int64 or t.shape != (T,) or not t.is_contiguous():
                    raise ValueError(f"attn_norm_rope: {name} must be a contiguous int64 [{T}] tensor")
        if block_r < 1 or block_r & (block_r - 1):
            raise ValueError(f"attn_norm_rope: block_r must be a power of two, got {block_r}")
        _check_device("attn_norm_rope", x)
        y = torch.empty_like(x)
        R = T * NH
        if R:
            _norm_rope_kernel[(triton.cdiv(R, block_r),)](
                x, weight if weight is not None else cos, cos, sin, y, ring if write else y,
                slots if write else cos, pos if write else cos, R, NH, eps,
                ring.shape[0] if write else 0, ring.shape[1] if write else 1,
                D=D, HALF=half, HAS_W=weight is not None, WRITE=write, BLOCK_R=block_r,
                BLOCK_D=triton.next_power_of_2(D), num_warps=4,
            )
        return y

    @triton.jit
    def _out_proj_kernel(o_ptr, cos_ptr, sin_ptr, w_ptr, y_ptr, T, R, KG, NHD, GR,
                         D: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        t = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        rr = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        g = tl.program_id(2)
        t_ok = t < T
        r_ok = rr < R
        acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for k0 in range(0, KG, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < KG
            col = g * KG + k  # column of o viewed [T, NH * D]
            ch = col % D  # channel within its head
            am = t_ok[:, None] & k_ok[None, :]
            a = tl.load(o_ptr + t[:, None] * NHD + col[None, :], mask=am, other=0.0)
            ap = tl.load(o_ptr + t[:, None] * NHD + (col ^ 1)[None, :], mask=am, other=0.0).to(tl.float32)
            is_rope = ch >= D - 2 * HALF
            j = tl.where(is_rope, (ch - (D - 2 * HALF)) // 2, 0)
            rm = am & is_rope[None, :]
            c = tl.load(cos_ptr + t[:, None] * HALF + j[None, :], mask=rm, other=1.0)
            s = -tl.load(sin_ptr + t[:, None] * HALF + j[None, :], mask=rm, other=0.0)  # rotated back: -sin
            af = a.to(tl.float32)
            even = (ch % 2 == 0)[None, :]
            rot = tl.where(even, af * c - ap * s, af * c + ap * s)
            a = tl.where(is_rope[None, :], rot, af).to(a.dtype)  # the model's apply_rope rounds here
            w = tl.load(w_ptr + (g * R + rr)[None, :] * KG + k[:, None], mask=k_ok[:, None] & r_ok[None, :],
                        other=0.0)  # [BLOCK_K, BLOCK_R]
            if IEEE:
                acc += tl.dot(a, w, input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        tl.store(y_ptr + t[:, None] * GR + (g * R + rr)[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=t_ok[:, None] & r_ok[None, :])

    @register_op("attn_out_proj", "triton")
    def attn_out_proj_triton(o, cos, sin, weight, groups: int, block_m: int | None = None,
                             block_r: int | None = None, block_k: int | None = None,
                             num_warps: int = 8, force_kernel: bool = False, inplace: bool = False) -> torch.Tensor:
        """Triton inverse RoPE + grouped `wo_a`, see the module docstring. o contiguous [T, NH, D], weight
        contiguous [G * R, NH * D / G] of o's dtype, cos/sin float32 [T, rd/2] (o is never changed: `inplace` is
        accepted and ignored, the kernel rotates as it loads); block sizes powers of two
        >= 16. Defaults (tiles M x R x K): 16 x 64 x 64 up to 16 tokens (decode: the weight read once, G * R / 64
        programs), else 64 x 128 x 32. NOTE: compiled for sm_90a (triton 3.9, ptxas 13.4, D 512, 8 warps) both
        spill nothing (153 and 231 registers a thread: `benchmarks.kernel_registers`); 64 x 64 x 64 with 4 warps spills ~0.9 KiB."""
        if o.dim() != 3 or not o.is_contiguous():
            raise ValueError(f"attn_out_proj: o must be a contiguous [T, NH, D] tensor, got {list(o.shape)}")
        T, NH, D = o.shape
        half = _check_rope("attn_out_proj", cos, sin, T, D)
        small = T <= 16
        block_m = block_m or (16 if small else 64)
        block_r = block_r or (64 if small else 128)
        block_k = block_k or (64 if small else 32)
        if groups < 1 or (NH * D) % groups:
            raise ValueError(f"attn_out_proj: {groups} groups do not split the {NH * D} channels")
        KG = NH * D // groups
        if weight.dim() != 2 or weight.shape[1] != KG or weight.shape[0] % groups or not weight.is_contiguous() \
                or weight.dtype != o.dtype:
            raise ValueError(f"attn_out_proj: weight must be a contiguous [G * R, {KG}] tensor of o's dtype "
                             f"({o.dtype}), got {weight.dtype} {list(weight.shape)}")
        for name, v in (("block_m", block_m), ("block_r", block_r), ("block_k", block_k)):
            if v < 16 or v & (v - 1):
                raise ValueError(f"attn_out_proj: {name} must be a power of two >= 16, got {v}")
        _check_device("attn_out_proj", o)
        if T > TRITON_OUT_PROJ_MAX_TOKENS and not force_kernel:
            return attn_out_proj_torch(o, cos, sin, weight, groups)
        R = weight.shape[0] // groups
        y = torch.empty((T, groups * R), dtype=o.dtype, device=o.device)
        if T:
            _out_proj_kernel[(triton.cdiv(T, block_m), triton.cdiv(R, block_r), groups)](
                o, cos, sin, weight, y, T, R, KG, NH * D, groups * R, D=D, HALF=half, BLOCK_M=block_m, BLOCK_R=block_r,
                BLOCK_K=block_k, IEEE=o.dtype == torch.float32, num_warps=num_warps,
            )
        return y
