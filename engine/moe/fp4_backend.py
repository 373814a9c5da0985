"""The `"fp4"` MoE backend: routed experts kept as published FP4 (E2M1 + UE8M0 scales), run grouped.

`prepare(experts)` takes experts whose w1/w2/w3 are `engine.quant.Fp4Linear` modules and stacks their
packed weights and scales (`pack_fp4_experts`): w13 [E, 2*inter, H/2] (w1 rows then w3 rows) with
scales [E, 2*inter, H/32], and w2 [E, H, inter/2] with scales [E, H, inter/32]. `forward` sorts the
(token, expert) pairs by expert and runs the two projections as two grouped FP4 GEMMs (the kernel op
`"fp4_grouped_gemm"`: the exact torch reference on the CPU, one Triton launch on CUDA, picked in
`prepare` from the weights' device), then scatters the weighted results back with `index_add_`.

Arithmetic per linear is that of `Fp4Linear` (float32 dot products, rounded to x's dtype after each
projection), so this backend agrees with `"torch_loop"` over the same Fp4Linear experts up to float32
summation order.

NOTE: the stacks become the only storage: every expert's `w1/w2/w3.weight` and `.scale` is replaced by a
parameter viewing into them, so memory does not grow and `state_dict()` keeps the checkpoint names.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.engine.moe.base import MoEBackend, register_moe_backend
from deepinfer.engine.moe.torch_backend import _route
from deepinfer.engine.quant.linear import Fp4Linear, register_gemm_ops
from deepinfer.kernels.registry import default_impl, get_op


def pack_fp4_experts(experts: Sequence[nn.Module]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stack FP4 experts: (w13 int8 [E, 2I, H/2], s13 e8m0 [E, 2I, H/32], w2 int8 [E, H, I/2], s2 e8m0 [E, H, I/32]).

    The experts' parameters are replaced by views into the stacks (see the module NOTE).
    """
    for e, ex in enumerate(experts):
        for name in ("w1", "w2", "w3"):
            mod = getattr(ex, name)
            if not isinstance(mod, Fp4Linear):
                raise ValueError(f"the 'fp4' MoE backend needs Fp4Linear experts; expert {e}.{name} is "
                                 f"{type(mod).__name__} (use moe_backend='torch' for float or FP8 experts)")
            if (mod.in_features, mod.out_features, mod.block) != (getattr(experts[0], name).in_features,
                                                                   getattr(experts[0], name).out_features,
                                                                   getattr(experts[0], name).block):
                raise ValueError(f"the 'fp4' MoE backend needs experts of one shape; expert {e}.{name} is "
                                 f"[{mod.out_features}, {mod.in_features}] block {mod.block}")
    inter = experts[0].w1.out_features
    w13 = torch.stack([torch.cat([ex.w1.weight.detach(), ex.w3.weight.detach()]) for ex in experts])  # [E, 2I, H/2]
    s13 = torch.stack([torch.cat([ex.w1.scale.detach(), ex.w3.scale.detach()]) for ex in experts])  # [E, 2I, H/32]
    w2 = torch.stack([ex.w2.weight.detach() for ex in experts])  # [E, H, I/2]
    s2 = torch.stack([ex.w2.scale.detach() for ex in experts])  # [E, H, I/32]
    for e, ex in enumerate(experts):
        ex.w1.weight = nn.Parameter(w13[e, :inter], requires_grad=False)
        ex.w3.weight = nn.Parameter(w13[e, inter:], requires_grad=False)
        ex.w1.scale = nn.Parameter(s13[e, :inter], requires_grad=False)
        ex.w3.scale = nn.Parameter(s13[e, inter:], requires_grad=False)
        ex.w2.weight = nn.Parameter(w2[e], requires_grad=False)
        ex.w2.scale = nn.Parameter(s2[e], requires_grad=False)
    return w13, s13, w2, s2


@register_moe_backend("fp4")
class Fp4MoEBackend(MoEBackend):
    """Grouped FP4 experts: two grouped GEMMs over the stacked packed weights (see the module docstring)."""

    def __init__(self) -> None:
        self.experts: Sequence[nn.Module] = ()
        self.packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        """(w13, s13, w2, s2) from `pack_fp4_experts`, set by `prepare`."""
        self.limit = 0.0
        self.block = 32
        self.impl_name = ""
        """The `"fp4_grouped_gemm"` implementation picked for the weights' device."""

    def prepare(self, experts: Sequence[nn.Module]) -> None:
        self.packed = pack_fp4_experts(experts)
        self.experts, self.limit, self.block = experts, experts[0].limit, experts[0].w1.block
        register_gemm_ops()
        self.impl_name = default_impl("fp4_grouped_gemm", self.packed[0].device)
        self._gemm = get_op("fp4_grouped_gemm", self.impl_name)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        w13, s13, w2, s2 = self.packed
        inter = w2.shape[2] * 2
        flat_e, tok, wsorted = _route(topk_weights, topk_ids)
        counts = torch.bincount(flat_e, minlength=w13.shape[0])  # [E]
        h = self._gemm(x[tok], w13, s13, counts, self.block)  # [T*k, 2*inter]
        g = h[:, :inter].clamp(max=self.limit)
        u = h[:, inter:].clamp(min=-self.limit, max=self.limit)
        y = self._gemm((F.silu(g) * u).contiguous(), w2, s2, counts, self.block)  # [T*k, H]
        out = torch.zeros_like(x)
        out.index_add_(0, tok, y * wsorted[:, None].to(x.dtype))
        return out
