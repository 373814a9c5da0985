"""RMSNorm: op `"rms_norm"`, `(x [..., D], weight [D] | None, eps) -> y` like x.

The model's RMSNorm (engine/models/deepseek_v4.py `rms_norm`): the row in float32, divided by its root mean
square (`rsqrt(mean(x^2) + eps)`), times the float32 weight, rounded back to x's dtype.

Implementations:
  * `"torch"`: the reference, the model's code as it stands: `F.rms_norm(x.float(), (D,), weight, eps).to(x.dtype)`
    (three kernels on a GPU for a bfloat16 x: the cast up, the norm, the cast down). The default off CUDA.
  * `"triton"`: one kernel, one program per row (the whole row in registers, `BLOCK_D` = the next power of two
    of D): x loaded in its dtype, float32 math, the result stored in x's dtype. The CUDA default.

NOTE: the kernel's sum of squares adds in another order than torch's reduction, so its results differ from the
reference by float32 rounding (then rounded to x's dtype: mostly equal in bfloat16, an ulp apart now and then);
`op_impls={"rms_norm": "torch"}` restores the reference. A row's bits do not depend on how many rows the call
has (one program a row, its tiling fixed by D alone): the kernel is batch invariant. The batch-invariant mode
(engine/batch_invariant.py) pins every `OpTable` op to its torch reference all the same, as for the other ops.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from deepinfer.kernels.registry import register_default_impl, register_op

try:
    import triton
    import triton.language as tl

    from deepinfer.kernels.rope import rtne_bf16
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@register_op("rms_norm", "torch")
def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Reference RMSNorm over the last dim in float32, rounded to x's dtype (the model's `rms_norm`)."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)


@register_default_impl("rms_norm")
def _default_rms_norm(device: torch.device) -> str:
    # one launch instead of three on CUDA (results within float32 rounding of the reference, batch invariant)
    return "triton" if device.type == "cuda" and triton is not None else "torch"


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, x_stride, eps, D: tl.constexpr, HAS_W: tl.constexpr,
                         BF16: tl.constexpr, BLOCK_D: tl.constexpr):
        # NOTE: one row a program: its reduction tree is fixed by BLOCK_D alone, so a row's bits are the same
        # whatever the number of rows (batch invariance)
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        ok = d < D
        xf = tl.load(x_ptr + row * x_stride + d, mask=ok, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
        y = xf * inv
        if HAS_W:
            y = y * tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
        if BF16:
            y = rtne_bf16(y)  # the GPU's cast rounds so too; the interpreter's truncates
        tl.store(y_ptr + row * D + d, y.to(y_ptr.dtype.element_ty), mask=ok)

    @register_op("rms_norm", "triton")
    def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """Triton RMSNorm (module docstring): x [..., D] float32 / bfloat16 / float16, contiguous (or 2-D with
        contiguous rows: a column slice); weight contiguous [D] (any of those dtypes, used in float32) or None.
        Returns a new contiguous tensor of x's shape and dtype. No autograd. On CUDA, or on the CPU under
        `TRITON_INTERPRET=1`."""
        if x.is_contiguous() and x.dim() >= 1:
            x_stride = x.shape[-1]
        elif x.dim() == 2 and x.stride(1) == 1:
            x_stride = x.stride(0)
        else:
            raise ValueError(f"rms_norm_triton: x must be a contiguous [..., D] tensor (or [T, D] with contiguous "
                             f"rows), got {list(x.shape)} with strides {list(x.stride())} (call .contiguous())")
        if x.dtype not in _FLOATS:
            raise ValueError(f"rms_norm_triton: x must be float32, bfloat16 or float16, got {x.dtype}")
        D = x.shape[-1]
        if weight is not None and (weight.shape != (D,) or weight.dtype not in _FLOATS or not weight.is_contiguous()
                                   or weight.device != x.device):
            raise ValueError(f"rms_norm_triton: weight must be a contiguous float [{D}] tensor on {x.device}, got "
                             f"{weight.dtype} {list(weight.shape)} on {weight.device}")
        if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"rms_norm_triton needs a CUDA tensor (or TRITON_INTERPRET=1), got {x.device}")
        if torch.is_grad_enabled() and (x.requires_grad or (weight is not None and weight.requires_grad)):
            raise ValueError("rms_norm_triton has no backward; use the 'torch' implementation for training")
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        num_rows = x.numel() // D if D else 0
        if num_rows:
            block_d = triton.next_power_of_2(D)
            _rms_norm_kernel[(num_rows,)](x, weight if weight is not None else x, y, x_stride, eps, D=D,
                                          HAS_W=weight is not None, BF16=x.dtype == torch.bfloat16, BLOCK_D=block_d,
                                          num_warps=max(1, min(16, block_d // 512)))
        return y
