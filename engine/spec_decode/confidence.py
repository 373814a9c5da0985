"""The confidence head: P(draft i is accepted | drafts before it were) from the drafter's own state.

The verify scheduler (`verify_schedule`) needs a per-draft conditional acceptance probability
`c(r, i)`. The MTP layer's softmax at its argmax is a free estimate, but it is the drafter's belief
about *its* distribution, not about the target's choice, and it says nothing about chain drift (the
chained drafts 2 .. k run on the block's own streams in place of the target's). A small head trained
on the drafter's features against what verification actually accepted calibrates it.

Features of one draft (`confidence_features`, `num_features = hidden_size + 3 + MAX_POSITIONS`):

* the MTP hidden state the draft was read from (`MTPLayer.forward`'s output after `norm`, the
  shared head's input) [H];
* the draft's probability under the MTP, the runner-up's probability, the entropy of the MTP's
  softmax (nats) [3];
* the draft position one-hot (0 = the draft read off the committed pass, 1.. = chained) [MAX_POSITIONS].

The head: `sigmoid(fc2(gelu(fc1(features))))`. Its file, `confidence_head.safetensors` in the checkpoint
directory (beside `model.safetensors`), holds float32 tensors

    fc1.weight [hidden, num_features]   fc1.bias [hidden]   fc2.weight [1, hidden]   fc2.bias [1]

and metadata `{"format": "deepinfer-confidence-head", "version": "1", "hidden_size": H,
"max_positions": MAX_POSITIONS}`; the features above, in that order, are its input contract.
`load_confidence_head(model_dir, hidden_size)` returns None when the file is absent: the scheduler
then uses the drafts' MTP probabilities (today's fallback). The head is trained by
`tools/demo_model/train_confidence.py`; it never changes which tokens come out (the acceptance
rule is unchanged), only how many drafts are verified.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

CONFIDENCE_HEAD_FILE = "confidence_head.safetensors"
"""The head's file name inside a checkpoint directory."""
FORMAT = "deepinfer-confidence-head"
MAX_POSITIONS = 8
"""Draft positions the one-hot feature covers (`rollback.max_draft_tokens` is at most 7 for V4)."""


def num_features(hidden_size: int) -> int:
    """Width of one draft's feature vector for an MTP hidden size."""
    return hidden_size + 3 + MAX_POSITIONS


def confidence_features(hidden: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor, position: int) -> torch.Tensor:
    """Features of B drafts read at one draft position (see the module docstring).

    hidden [B, H]: the MTP hidden states; logits / probs [B, V]: the MTP logits and their softmax
    (float32) -> [B, num_features]."""
    if hidden.dim() != 2 or probs.dim() != 2 or hidden.shape[0] != probs.shape[0] or logits.shape != probs.shape:
        raise ValueError(f"hidden [B, H], logits and probs [B, V] expected, got {tuple(hidden.shape)}, "
                         f"{tuple(logits.shape)}, {tuple(probs.shape)}")
    if not 0 <= position < MAX_POSITIONS:
        raise ValueError(f"draft position {position} outside the head's 0 .. {MAX_POSITIONS - 1}")
    top2, arg = probs.topk(2, dim=-1)  # [B, 2]
    # NOTE: entropy = logsumexp(l) - sum(p * l), with logsumexp(l) = l_max - log(p_max): one pass over the
    # vocabulary instead of a log per entry (nansum: a -inf logit has p = 0 and contributes nothing)
    lmax = logits.gather(-1, arg[:, :1])  # [B, 1]
    entropy = lmax - top2[:, :1].log() - (probs * logits).nansum(dim=-1, keepdim=True)  # [B, 1]
    onehot = torch.zeros(hidden.shape[0], MAX_POSITIONS, dtype=torch.float32, device=hidden.device)
    onehot[:, position] = 1.0
    return torch.cat([hidden.float(), top2.float(), entropy.float(), onehot], dim=-1)


class ConfidenceHead(nn.Module):
    """A 2-layer MLP over `confidence_features` -> P(accepted | the drafts before it were) in [0, 1]."""

    def __init__(self, hidden_size: int, width: int = 64) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.fc1 = nn.Linear(num_features(hidden_size), width)
        self.fc2 = nn.Linear(width, 1)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """features [B, num_features] -> acceptance logits [B] (training uses these)."""
        if features.dim() != 2 or features.shape[1] != self.fc1.in_features:
            raise ValueError(f"features [B, {self.fc1.in_features}] expected, got {tuple(features.shape)} (a head "
                             f"for MTP hidden size {self.hidden_size})")
        return self.fc2(nn.functional.gelu(self.fc1(features.to(self.fc1.weight.dtype)))).squeeze(-1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.logits(features))

    def save(self, path: str | Path) -> None:
        """Write the head in the file format of the module docstring."""
        from safetensors.torch import save_file

        tensors = {k: v.detach().float().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(tensors, str(path), metadata={"format": FORMAT, "version": "1", "hidden_size": str(self.hidden_size),
                                                "max_positions": str(MAX_POSITIONS)})


def load_confidence_head(model_dir: str | Path | None, hidden_size: int,
                         device: torch.device | str = "cpu") -> ConfidenceHead | None:
    """The checkpoint's confidence head (`confidence_head.safetensors`), or None when it has none.

    Raises ValueError for a file that is not a head for this model (wrong format, hidden size or
    position count): a stale head must not silently steer verification."""
    if model_dir is None:
        return None
    path = Path(model_dir) / CONFIDENCE_HEAD_FILE
    if not path.is_file():
        return None
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("format") != FORMAT or meta.get("max_positions") != str(MAX_POSITIONS):
        raise ValueError(f"{path} is not a deepinfer confidence head (metadata {meta}); retrain it with "
                         "tools/demo_model/train_confidence.py or remove it")
    if meta.get("hidden_size") != str(hidden_size):
        raise ValueError(f"{path} was trained for MTP hidden size {meta.get('hidden_size')}, this model has "
                         f"{hidden_size}; retrain it or remove it")
    tensors = load_file(str(path))
    head = ConfidenceHead(hidden_size, width=tensors["fc1.weight"].shape[0])
    head.load_state_dict(tensors)
    return head.to(device).eval()
