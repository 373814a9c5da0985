"""The MoE router: which experts each token goes to, and with what weight.

`Gate` covers both V4 routings: learned top-k over scores (`sqrtsoftplus`, `sigmoid` or `softmax`, with
a correction bias used for selection only) and hash routing (a token id -> experts table). Either way
the chosen experts' scores are normalised to sum to one and multiplied by `routed_scaling_factor`.
Parameter names are the checkpoint's: `ffn.gate.weight`, `ffn.gate.bias` (learned), `ffn.gate.tid2eid`
(hash).

The logits are one `F.linear`; everything after it is the kernel op `"moe_routing"`
(`kernels.moe_routing`): the torch reference by default (the arithmetic this module always had), or the
one-launch Triton kernel when the MoE backend asks for it (`MoEBackend.routing_impl`, applied by the
model's `MoE.prepare` through `set_routing_impl`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.engine.config import ModelConfig
from deepinfer.kernels.moe_routing import SCORING_FUNCS, moe_routing_torch
from deepinfer.kernels.registry import get_op

__all__ = ["SCORING_FUNCS", "Gate"]


class Gate(nn.Module):
    """Router: learned top-k (with a selection-only correction bias) or hash table routing."""

    def __init__(self, config: ModelConfig, is_hash: bool) -> None:
        super().__init__()
        self.is_hash = is_hash
        self.topk = config.num_experts_per_tok
        self.scoring = config.scoring_func
        self.score = SCORING_FUNCS[config.scoring_func]
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.topk, dtype=torch.long))
        else:
            self.register_buffer("bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))
        self.routing_impl = "torch"
        """The `"moe_routing"` implementation in use (`set_routing_impl`)."""
        self._routing = moe_routing_torch

    def set_routing_impl(self, impl_name: str) -> None:
        """Route through implementation `impl_name` of the kernel op `"moe_routing"` ("torch", "triton")."""
        self._routing = get_op("moe_routing", impl_name)
        self.routing_impl = impl_name

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [num_tokens, H], input_ids: [num_tokens] -> (topk_weights [num_tokens, k], topk_ids [num_tokens, k])."""
        logits = F.linear(x, self.weight)  # [num_tokens, num_experts]
        if self.is_hash:
            return self._routing(logits, self.topk, self.scoring, self.scaling, tid2eid=self.tid2eid,
                                 input_ids=input_ids)
        return self._routing(logits, self.topk, self.scoring, self.scaling, bias=self.bias)
