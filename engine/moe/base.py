"""The MoE backend contract and its registry.

A `MoEBackend` computes a MoE layer's *routed* experts for a flat batch: the router (`engine.moe.router`)
has already picked `topk_ids` and `topk_weights` per token; the shared expert, a plain dense FFN, stays
in the model (`MoE` adds it after the backend returns, so every backend shares its arithmetic).

Lifecycle:
  1. constructed with no arguments, once per MoE layer, when the model is built (`moe_backend=` name);
  2. `prepare(experts)` once after the weights are loaded (and again if they are replaced, e.g. reloaded
     or moved to another device): pack or re-layout the expert weights, decide the kernel path;
  3. `forward(x, topk_weights, topk_ids)` every step, without device or mode tests.

NOTE: `state_dict()` keeps the checkpoint names (`ffn.experts.{e}.w1.weight`, ...). A backend that packs
weights makes the per-expert parameters views into its packed storage (or keeps them), never renames them.

Where a new backend goes: a quantized-expert layout (FP8 block-scaled, FP4) or expert-parallel
dispatch/combine is a new `MoEBackend` subclass in its own module under `engine/moe/`, decorated with
`@register_moe_backend("<name>")` and imported in `engine/moe/__init__.py`; `torch` stays the reference.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch
from torch import nn

from deepinfer.engine.registry import Registry


class MoEBackend(ABC):
    """Routed-expert computation for one MoE layer. Subclasses register with `register_moe_backend`."""

    name: str = ""
    """The registry name (set by `register_moe_backend`)."""

    cuda_graph_safe: bool = False
    """Whether `forward` can be captured in a CUDA graph: no host synchronisation (`.item()`, `.tolist()`,
    `nonzero`, `bincount` on CUDA), no data-dependent shapes or Python branches on tensor values, the same
    launches for every routing of a given token count. A model runner captures decode steps only through
    backends that declare it."""

    routing_impl: str = "torch"
    """The `"moe_routing"` kernel implementation (`kernels.moe_routing`) the model's router uses with this
    backend; read by the model's `MoE.prepare` after `prepare` (so a backend may set it per device there)."""

    @abstractmethod
    def prepare(self, experts: Sequence[nn.Module]) -> None:
        """Adopt the loaded routed experts (packing, layouts). Called once after loading, before `forward`.

        `experts[e]` is a SwiGLU expert with `w1` (gate, [inter, H]), `w3` (up, [inter, H]) and `w2`
        (down, [H, inter]) linears, a `limit` (pre-activation clamp), and `expert(x) -> [n, H]`.
        """

    @abstractmethod
    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum per token.

        x: [num_tokens, H]; topk_weights: [num_tokens, k] float32 (already normalised and scaled);
        topk_ids: [num_tokens, k] int64 -> [num_tokens, H] in x's dtype (the shared expert excluded).
        """

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.forward(x, topk_weights, topk_ids)


MOE_BACKENDS: Registry[type[MoEBackend]] = Registry("MoE backend")
"""The MoE backends by name."""


def register_moe_backend(name: str) -> Callable[[type[MoEBackend]], type[MoEBackend]]:
    """Class decorator: register a `MoEBackend` subclass under `name`."""
    return MOE_BACKENDS.register(name)


def moe_backend_names() -> list[str]:
    """The registered backend names, sorted (CLI choices)."""
    return MOE_BACKENDS.names()


def get_moe_backend(name: str) -> type[MoEBackend]:
    """The backend class registered as `name`; a ValueError listing the known names otherwise."""
    return MOE_BACKENDS.get(name)
