"""Quantized linears that keep the checkpoint's tensors as published: `Fp8Linear` and `Fp4Linear`.

Each replaces an `nn.Linear(in, out, bias=False)`: its parameters are named `weight` and `scale`, so
`state_dict()` keys are the checkpoint's `<name>.weight` / `<name>.scale`, and they stay in their stored
dtypes (both are `nn.Parameter(requires_grad=False)`, so the loader's `meta_parameters()` builds them
without memory). `forward` calls the `"fp8_gemm"` / `"fp4_gemm"` kernel op, whose implementation is
picked once per device (`deepinfer.kernels.registry.default_impl`: the exact torch reference on the
CPU, Triton on CUDA) and again when the weights move to another device.

`Fp8Linear(act_quant=True)` (or `set_fp8_activations(model, "fp8")`) first rounds each token's activations
onto the FP8 grid the official reference uses (`engine.quant.act_quant`: per 128 channels, power-of-two
scales, E4M3) and then calls the same `"fp8_gemm"` op; the default keeps activations as they come (bf16 /
float32), which is what matches transformers (it dequantizes the weights and runs plain matmuls).

NOTE: `module.to(dtype)` / `.half()` / `.float()` leave these modules' tensors in their stored dtypes
(a dtype change would silently drop the scales); device moves apply as usual (`_apply`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deepinfer.engine.quant.act_quant import FP8_ACTIVATION_MODES, fp8_round_activations
from deepinfer.engine.quant.formats import (
    FP4_BLOCK,
    FP8_BLOCK,
    dequant_fp4,
    dequant_fp8_block,
    fp4_scale_shape,
    fp8_scale_shape,
    quantize_fp4,
    quantize_fp8_block,
)
from deepinfer.kernels.registry import default_impl, get_op


def register_gemm_ops() -> None:
    """Import the quantized-GEMM kernel modules, which register the "fp8_gemm", "fp4_gemm" and
    "fp4_grouped_gemm" ops (idempotent).

    NOTE: imported on first use, not at module level: the kernel modules import
    `engine.quant.formats`, whose package imports this module.
    """
    from deepinfer.kernels import fp4_gemm, fp8_gemm  # noqa: F401


class _QuantLinear(nn.Module):
    """Shared machinery: dtype-preserving `_apply`, the per-device kernel pick, the [..., in] reshape."""

    op_name = ""
    in_features: int
    out_features: int

    def _init_impl(self) -> None:
        self._impl_device: torch.device | None = None
        self._gemm: Callable[..., torch.Tensor] | None = None
        self.impl_name = ""
        """The kernel implementation picked for the weights' device ("" until the first forward)."""
        self._prepare_input: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Applied to the [M, in] activations before the GEMM (None: they go in as they are)."""

    def select_impl(self, impl_name: str | None = None) -> None:
        """Pick the GEMM implementation for the weights' device (`impl_name` overrides the device default)."""
        device = self.weight.device
        register_gemm_ops()
        self.impl_name = impl_name or default_impl(self.op_name, device)
        self._gemm = get_op(self.op_name, self.impl_name)
        self._impl_device = device

    def _apply(self, fn, recurse=True):
        # NOTE: keep the stored dtypes: a dtype conversion would drop the scales; only device moves apply.
        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            moved = fn(t)
            return moved if moved.dtype == t.dtype else t.to(moved.device)

        out = super()._apply(keep_dtype, recurse)
        self._impl_device = None  # re-pick on the next forward (the device may have changed)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features] in x's dtype."""
        if self._impl_device != self.weight.device:
            self.select_impl()
        x2 = x.reshape(-1, self.in_features).contiguous()  # [M, in]
        if self._prepare_input is not None:
            x2 = self._prepare_input(x2)
        y = self._gemm(x2, self.weight, self.scale, self.block).to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def resident_nbytes(self) -> int:
        """Bytes this layer holds in memory: weight + scale (the checkpoint's bytes for it)."""
        return self.weight.numel() * self.weight.element_size() + self.scale.numel() * self.scale.element_size()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}, "
                f"scale_dtype={self.scale.dtype}" + (", act_quant=True" if getattr(self, "act_quant", False) else ""))


class Fp8Linear(_QuantLinear):
    """A bias-free linear over an FP8 block-scaled weight, kept quantized.

    `weight` float8_e4m3fn [out, in]; `scale` [ceil(out/bn), ceil(in/bk)] float8_e8m0fnu (V4) or float32
    (`*-Base`); `W = weight * scale[n // bn, k // bk]`. Forward: `kernels.fp8_gemm` (exact block-wise
    torch reference on the CPU, Triton on CUDA), computing in float32 and returning x's dtype.

    `act_quant=True`: the activations are first rounded onto the official reference's FP8 grid (per token
    per 128 channels, power-of-two scales, E4M3; `engine.quant.act_quant`), so the GEMM's products are
    those of the official FP8 x FP8 GEMM with both scales. Off by default (bf16 activations match
    transformers).
    """

    op_name = "fp8_gemm"

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int] = FP8_BLOCK,
                 scale_dtype: torch.dtype = torch.float8_e8m0fnu, device: torch.device | str | None = None,
                 act_quant: bool = False) -> None:
        super().__init__()
        if scale_dtype not in (torch.float8_e8m0fnu, torch.float32):
            raise ValueError(f"Fp8Linear: scale_dtype must be float8_e8m0fnu or float32, got {scale_dtype}")
        self.in_features, self.out_features, self.block = in_features, out_features, tuple(block)
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)  # [out, in]
        self.scale = nn.Parameter(torch.ones(fp8_scale_shape(out_features, in_features, self.block), dtype=scale_dtype,
                                             device=device), requires_grad=False)  # [ceil(out/bn), ceil(in/bk)]
        self._init_impl()
        self.set_act_quant(act_quant)

    def set_act_quant(self, act_quant: bool) -> None:
        """FP8 activations as the official reference quantizes them (True) or activations as they come (False)."""
        self.act_quant = bool(act_quant)
        self._prepare_input = fp8_round_activations if self.act_quant else None

    @classmethod
    def from_float(cls, w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
                   scale_dtype: torch.dtype = torch.float8_e8m0fnu) -> Fp8Linear:
        """Quantize a float weight [out, in] (tests, test checkpoints)."""
        w8, scale = quantize_fp8_block(w, block, scale_dtype)
        mod = cls(w.shape[1], w.shape[0], block, scale_dtype, device=w.device)
        mod.weight.data, mod.scale.data = w8, scale
        return mod

    def dequantized(self) -> torch.Tensor:
        """The full float32 weight [out, in] (for references and tests only: the forward never builds it)."""
        return dequant_fp8_block(self.weight, self.scale, self.block)

    def row_groups_usable(self, groups: int) -> bool:
        """Whether `forward_row_groups` takes `groups`: the rows split into equal groups of whole scale blocks."""
        return groups >= 1 and self.out_features % groups == 0 and (self.out_features // groups) % self.block[0] == 0

    def forward_row_groups(self, x: torch.Tensor, groups: int) -> torch.Tensor:
        """x [M, groups * in] -> [M, out]: output group g (out / groups columns) is x's g-th `in` columns times
        the g-th group of W's rows (V4's grouped `wo_a`, a block-diagonal product) in ONE GEMM launch (the
        `fp8_gemm` op's `groups`). NOTE: the activations go in as they are, whatever `act_quant`: the official
        reference multiplies the grouped `wo_a` in bf16."""
        if self._impl_device != self.weight.device:
            self.select_impl()
        return self._gemm(x.contiguous(), self.weight, self.scale, self.block, groups=groups).to(x.dtype)


class Fp4Linear(_QuantLinear):
    """A bias-free linear over an FP4 (E2M1) weight with UE8M0 scales per 1 x `block` run, kept quantized.

    `weight` int8 [out, in/2] (two codes a byte, the low nibble the even k); `scale` float8_e8m0fnu
    [out, in/block]. Forward: `kernels.fp4_gemm` (exact torch reference on the CPU, Triton on CUDA).
    """

    op_name = "fp4_gemm"

    def __init__(self, in_features: int, out_features: int, block: int = FP4_BLOCK,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        if in_features % 2:
            raise ValueError(f"Fp4Linear: in_features must be even (two codes a byte), got {in_features}")
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.weight = nn.Parameter(torch.zeros(out_features, in_features // 2, dtype=torch.int8, device=device),
                                   requires_grad=False)  # [out, in/2]
        self.scale = nn.Parameter(torch.full(fp4_scale_shape(out_features, in_features, block), 127,
                                             dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu),
                                  requires_grad=False)  # [out, in/block]
        self._init_impl()

    @classmethod
    def from_float(cls, w: torch.Tensor, block: int = FP4_BLOCK) -> Fp4Linear:
        """Quantize a float weight [out, in] (tests, test checkpoints)."""
        packed, scale = quantize_fp4(w, block)
        mod = cls(w.shape[1], w.shape[0], block, device=w.device)
        mod.weight.data, mod.scale.data = packed, scale
        return mod

    def dequantized(self) -> torch.Tensor:
        """The full float32 weight [out, in] (for references and tests only: the forward never builds it)."""
        return dequant_fp4(self.weight, self.scale, self.block)


def set_fp8_activations(model: nn.Module, mode: str) -> int:
    """Set every `Fp8Linear` of `model` to `mode` ("bf16": activations as they come; "fp8": the official
    per-token-per-128 FP8 activations); returns how many modules were set."""
    if mode not in FP8_ACTIVATION_MODES:
        raise ValueError(f"fp8_activations must be one of {list(FP8_ACTIVATION_MODES)}, got {mode!r}")
    mods = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for m in mods:
        m.set_act_quant(mode == "fp8")
    return len(mods)
