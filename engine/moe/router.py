"""The MoE router: which experts each token goes to, and with what weight.

`Gate` covers both V4 routings: learned top-k over scores (`sqrtsoftplus`, `sigmoid` or `softmax`, with
a correction bias used for selection only) and hash routing (a token id -> experts table). Either way
the chosen experts' scores are normalised to sum to one and multiplied by `routed_scaling_factor`.
Parameter names are the checkpoint's: `ffn.gate.weight`, `ffn.gate.bias` (learned), `ffn.gate.tid2eid`
(hash).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.engine.config import ModelConfig


def _sqrtsoftplus(logits: torch.Tensor) -> torch.Tensor:
    return F.softplus(logits).sqrt()


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.softmax(dim=-1)


SCORING_FUNCS = {"sqrtsoftplus": _sqrtsoftplus, "sigmoid": torch.sigmoid, "softmax": _softmax}
"""`config.scoring_func` -> logits [num_tokens, num_experts] -> scores; picked once at construction."""


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

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [num_tokens, H], input_ids: [num_tokens] -> (topk_weights [num_tokens, k], topk_ids [num_tokens, k])."""
        scores = self.score(F.linear(x, self.weight))  # [num_tokens, num_experts]
        if self.is_hash:
            idx = self.tid2eid[input_ids].long()
        else:
            idx = torch.topk(scores + self.bias, self.topk, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.scaling, idx
