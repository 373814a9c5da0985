"""DeepSeek-V4 in plain PyTorch, for a flat varlen batch over a paged cache.

Written from the V4 paper's description and the semantics of Hugging Face transformers'
`DeepseekV4ForCausalLM` (the test oracle), not copied from either. Parameter names are the
checkpoint's names (the official DeepSeek naming that `save_pretrained` writes), so
`state_dict()` of this module *is* the checkpoint format.

One layer:

```
streams [T, hc, H] ──attn_hc──► collapsed [T, H] ─attn_norm─► attention ─► post/comb mix ─► streams
streams            ──ffn_hc───► collapsed        ─ffn_norm──► MoE       ─► post/comb mix ─► streams
```

Attention: a low-rank query (wq_a → q_norm → wq_b, per-head unweighted RMSNorm), one shared K=V
head (wkv → norm), partial interleaved RoPE on the trailing `rope_head_dim` channels, a
per-head sink logit, and:
  * every layer: the sliding window (a query sees the last `sliding_window` tokens, itself included);
  * CSA layers: a compressor emitting one entry per `rate` tokens from overlapping windows
    (the previous window's first half + this window's second half, softmax-gated with a
    learned position bias), and a lightning indexer that keeps the top `index_topk` entries
    per query;
  * HCA layers: a non-overlapping compressor with one entry per `rate` tokens, all attended.
An entry is visible to query `t` once its window has ended at or before `t`.
The output's rope channels are rotated back by the query position, then the grouped low-rank
output projection (wo_a per group, wo_b) maps heads to the hidden size.

MoE: hash-routed (token id → experts table) or learned top-k (sqrtsoftplus / sigmoid / softmax
scores, a correction bias for selection only), normalised routed weights times
`routed_scaling_factor`, SwiGLU experts with clamped pre-activations, plus a shared expert.
The router is `engine.moe.router.Gate`; the routed experts run on an `engine.moe` backend named at
construction (`moe_backend=`) and prepared once after loading (`prepare_for_inference`).

Small fused ops (the mHC pre/post mixing and Sinkhorn, the layers' RMSNorms, RoPE, the shared expert's activation) come
from the `kernels` op registry: an `OpTable` picks each op's implementation once, for the weights' device; the forward
never tests the device. The functions and modules here (`rms_norm`, `RMSNorm`, `apply_rope`, `Expert`) stay the
references those ops are checked against (and what DeepSeek-V4.1's modules call).

Causality is exact by construction: nothing a position computes depends on later tokens or on
how tokens are chunked into steps or batched with other requests.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.engine.attention import (
    AttentionBackend,
    AttentionInputs,
    AttentionMetadata,
    LayerSpec,
    get_attention_backend,
    layer_specs,
)
from deepinfer.engine.attention.indexer_quant import rotate_and_quant
from deepinfer.engine.cache.kv_cache import V4KVCache
from deepinfer.engine.config import ModelConfig, RopeConfig
from deepinfer.engine.forward_batch import ForwardBatch
from deepinfer.engine.moe import Gate, MoEBackend, get_moe_backend
from deepinfer.engine.quant.linear import Fp8Linear
from deepinfer.kernels import OpTable
from deepinfer.kernels import rope as _rope
from deepinfer.kernels.mhc import hc_collapse_torch, hc_weights_torch
from deepinfer.kernels.rope import apply_rope_torch
from deepinfer.kernels.swiglu import swiglu_torch

# --------------------------------------------------------------------------- small pieces


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in float32; the weight (kept in float32) multiplies before the cast back."""
    # NOTE: torch's fused rms_norm gives bit-identical results to the spelled-out float32 formula
    # (x * rsqrt(mean(x^2) + eps) * weight) in one op instead of six; op count dominates small decode steps.
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)


class RMSNorm(nn.Module):
    """Weighted RMSNorm with a float32 weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(rope: RopeConfig, rope_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (one per channel pair) and the cos/sin multiplier for a RoPE flavour."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    pos_freqs = rope.rope_theta**exponents
    inv = 1.0 / pos_freqs
    if rope.rope_type == "default":
        return inv, 1.0
    # YaRN ("NTK-by-parts"): interpolate low frequencies, keep high ones, linear ramp between.
    def correction_dim(num_rotations: float) -> float:
        return rope_dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (
            2 * math.log(rope.rope_theta)
        )

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (inv / rope.factor) * (1 - extrapolation) + inv * extrapolation
    return inv, rope.attention_factor


class Rotary(nn.Module):
    """cos/sin for the interleaved partial RoPE of one flavour (`main` or `compress`)."""

    def __init__(self, rope: RopeConfig, rope_dim: int) -> None:
        super().__init__()
        inv, self.scale = rope_inv_freq(rope, rope_dim)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]  # [n, rope_dim/2]
        return freqs.cos() * self.scale, freqs.sin() * self.scale


apply_rope = apply_rope_torch
"""Rotate consecutive channel pairs of the trailing `2 * cos.shape[-1]` channels of `x` [n, ..., d] by cos/sin
[n, rope_dim/2] (broadcast over the middle dims): `kernels.rope.apply_rope_torch`, the "rope" op's reference, kept
under the model's name (V4.1, DSpark and the batch-invariant mode import it from here)."""


# --------------------------------------------------------------------------- compressor


class Compressor(nn.Module):
    """Softmax-gated token compressor: one entry per `rate` tokens.

    With `overlap`, projections are `2 * dim` wide: the first half of window `w-1` and the
    second half of window `w` together (2·rate slots) make entry `w`.
    """

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap, self.width = dim, rate, overlap, width
        self.wkv = nn.Linear(hidden, width, bias=False)
        self.wgate = nn.Linear(hidden, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.norm = RMSNorm(dim, eps)
        self.rotate_quant = False
        """The official reference's Hadamard rotation + FP4 simulation of each emitted entry (the indexer's
        compressor under `indexer_numerics="reference"`, `engine.attention.indexer_quant`); False: transformers'."""

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token kv and gate projections. x: [n, H] -> ([n, width], [n, width])."""
        return self.wkv(x), self.wgate(x)

    def compress(
        self,
        kv: torch.Tensor,  # [m, width] tokens at positions first_pos .. first_pos+m-1
        gate: torch.Tensor,  # [m, width]
        first_pos: int,
        windows: torch.Tensor,  # [nw] window ids to emit; all their tokens lie in the span
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [nw, rope_dim/2] at positions windows * rate
    ) -> torch.Tensor:
        """Emit the entries of `windows` -> [nw, dim] (normed and rotated at `w * rate`)."""
        r = self.rate
        ar = torch.arange(r, device=kv.device)
        cur = (windows * r - first_pos)[:, None] + ar[None, :]  # [nw, r] rows of window w
        prev = (cur - r).clamp(min=0)
        return self.compress_gathered(kv[cur], gate[cur], kv[prev], gate[prev], windows, rope)

    def compress_gathered(
        self,
        cur_kv: torch.Tensor,  # [nw, r, width] tokens of window w
        cur_gate: torch.Tensor,  # [nw, r, width]
        prev_kv: torch.Tensor,  # [nw, r, width] tokens of window w-1 (ignored where w == 0 or no overlap)
        prev_gate: torch.Tensor,
        windows: torch.Tensor,  # [nw]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [nw, rope_dim/2] at positions windows * rate
    ) -> torch.Tensor:
        """Entries of `windows` from their gathered tokens -> [nw, dim]."""
        d = self.dim
        bias = self.ape  # [r, width]
        g_cur = cur_gate.float() + bias
        if self.overlap:
            valid = (windows > 0)[:, None, None]
            kv_all = torch.cat([prev_kv[..., :d], cur_kv[..., d:]], dim=1)  # [nw, 2r, d]
            g_prev = (prev_gate.float() + bias)[..., :d]
            g_prev = torch.where(valid, g_prev, torch.full_like(g_prev, float("-inf")))
            g_all = torch.cat([g_prev, g_cur[..., d:]], dim=1)
        else:
            kv_all, g_all = cur_kv, g_cur
        w = g_all.softmax(dim=1).to(kv_all.dtype)
        entries = self.norm((kv_all * w).sum(dim=1))  # [nw, d]
        entries = apply_rope(entries, *rope)
        if self.rotate_quant:  # after the norm and the RoPE, as the reference's Compressor.forward(rotate=True)
            entries = rotate_and_quant(entries)
        return entries


def topk_mask(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the `k` best visible entries per row; ties go to the lower entry index.

    NOTE: the tie rule (issue 21 item 3; pinned by tests/engine/attention/test_indexer_ties.py).
    Ties are frequent with few indexer heads: an entry whose every head has ReLU(q.k) = 0 scores
    exactly 0 (the sum of those zero terms is +0.0, on the CPU and on CUDA). DeepSeek's reference
    inference code (`Indexer.forward` in its inference/model.py) adds nothing to the scores, sets
    the entries a prefill query cannot see to -inf, takes `index_score.topk(min(index_topk,
    end_pos // ratio))` and then drops the picks past the query's visible count (-1); decode rows
    see every entry. It runs on CUDA, whose torch.topk keeps the lowest indices among the values
    tied at the k-th place (measured on an H200, torch 2.11: single- and multi-block paths,
    2^3..2e5 entries, sorted or not), i.e. this rule: larger score first, then lower entry index.
    That depends only on the entries the query can see, so it is causal and the same under any
    chunking, batching or decoding, and a stable descending sort gives the same set on the CPU
    and on CUDA. (CUDA's topk ranks +0.0 above -0.0 by their bits, a value sort keeps them equal;
    no indexer row mixes them: its all-zero entries compute one and the same sum.) transformers
    runs torch.topk on the CPU, whose tie order depends on the tensor's shape (partial sort /
    nth_element), so its logits at a position change with the length of the forward that holds
    them: we cannot match that, and do not try.
    """
    if scores.shape[-1] <= k:
        return visible
    scores = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.zeros_like(visible).scatter_(-1, order, True) & visible


# --------------------------------------------------------------------------- attention


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: scores compressed index keys per query, keeps top-k."""

    def __init__(self, config: ModelConfig, rate: int, ops: OpTable | None = None) -> None:
        super().__init__()
        self.ops = ops if ops is not None else OpTable(torch.get_default_device())
        """The model's small-op implementations ("rope" for the queries), shared with its attention layer."""
        self.num_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.topk = config.index_topk
        self.compressor = Compressor(config.hidden_size, self.head_dim, rate, True, config.rms_norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)
        self.numerics = "transformers"
        """"transformers" or "reference": the latter rotates and FP4-simulates the queries after their RoPE
        (and the compressor its keys), as DeepSeek's `Indexer.forward`; see `engine.attention.indexer_quant`."""

    def _queries(self, q_res: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Index queries [n, heads, index_head_dim]: wq_b, RoPE, then (reference numerics) rotation + FP4."""
        q = self.ops.rope(self.wq_b(q_res).view(q_res.shape[0], self.num_heads, self.head_dim), cos, sin,
                          inplace=_rope.ROPE_IN_PLACE)
        return rotate_and_quant(q) if self.numerics == "reference" else q

    def select(
        self,
        q_res: torch.Tensor,  # [n, q_lora_rank]
        x: torch.Tensor,  # [n, H]
        keys: torch.Tensor,  # [C, index_head_dim]
        visible: torch.Tensor,  # [n, C] causal visibility
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Boolean [n, C]: the entries each query attends to."""
        q = self._queries(q_res, cos, sin)
        scores = torch.einsum("nhd,cd->nhc", q.float(), keys.float())
        scores = F.relu(scores) * (self.head_dim**-0.5)
        weights = self.weights_proj(x).float() * (self.num_heads**-0.5)  # [n, heads]
        scores = (scores * weights[:, :, None]).sum(dim=1)  # [n, C]
        return topk_mask(scores, visible, self.topk)

    def score_batched(self, q_res, x, keys, cos, sin) -> torch.Tensor:
        """Decode rows, each with its own keys: keys [B, C, index_head_dim] -> scores [B, C]."""
        q = self._queries(q_res, cos, sin)
        scores = F.relu(torch.einsum("bhd,bcd->bhc", q.float(), keys.float())) * (self.head_dim**-0.5)
        weights = self.weights_proj(x).float() * (self.num_heads**-0.5)  # [B, heads]
        return (scores * weights[:, :, None]).sum(dim=1)

    def select_topk(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Boolean [n, C]: the `index_topk` best visible entries per row (see `topk_mask`)."""
        return topk_mask(scores, visible, self.topk)


class Attention(nn.Module):
    """V4 attention of one layer (sliding window, plus CSA or HCA compressed branch).

    The module owns the weights and the projections; the cache I/O and the attention core are its
    `backend`'s (an `engine.attention` backend chosen once at model construction).
    """

    def __init__(self, config: ModelConfig, spec: LayerSpec, backend: AttentionBackend,
                 ops: OpTable | None = None) -> None:
        super().__init__()
        H, D, NH = config.hidden_size, config.head_dim, config.num_attention_heads
        self.spec = spec
        self.ops = ops if ops is not None else OpTable(torch.get_default_device())
        """The model's small-op implementations ("attn_norm_rope", "attn_out_proj": `kernels.attn_proj`; "rms_norm",
        "rope")."""
        self.backend = backend
        self.layer_idx = spec.layer_idx
        self.num_heads, self.head_dim = NH, D
        self.eps = config.rms_norm_eps
        self.o_groups = config.o_groups
        self.wq_a = nn.Linear(H, config.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, NH * D, bias=False)
        self.wkv = nn.Linear(H, D, bias=False)
        self.norm = RMSNorm(D, config.rms_norm_eps)
        self.attn_sink = nn.Parameter(torch.zeros(NH, dtype=torch.float32))
        self.wo_a = nn.Linear(NH * D // config.o_groups, config.o_groups * config.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(config.o_groups * config.o_lora_rank, H, bias=False)
        if spec.is_compressed:
            self.compressor = Compressor(H, D, spec.compress_rate, spec.is_overlap, config.rms_norm_eps)
        if spec.has_indexer:
            self.indexer = Indexer(config, spec.compress_rate, self.ops)

    def forward(self, x: torch.Tensor, cache: V4KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """x: [T, H] (after attn_norm) -> [T, H]."""
        T = x.shape[0]
        NH, D = self.num_heads, self.head_dim
        spec = self.spec
        cos, sin = meta.rope[spec.rope]  # [T, rd/2] of this layer's flavour
        q_res = self.ops.rms_norm(self.wq_a(x), self.q_norm.weight, self.q_norm.eps)  # [T, q_lora_rank]: q_norm
        q = self.wq_b(q_res).view(T, NH, D)
        q = self.ops.attn_norm_rope(q, None, self.eps, cos, sin)  # [T, NH, D]: apply_rope(rms_norm(q))
        kv = self.ops.attn_norm_rope(self.wkv(x), self.norm.weight, self.norm.eps, cos, sin)  # [T, D]
        inputs = AttentionInputs(q=q, kv=kv, x=x, q_res=q_res, sink=self.attn_sink)
        if spec.is_compressed:
            inputs.compressor = self.compressor
            inputs.compressor_kv, inputs.compressor_gate = self.compressor.project(x)
        if spec.has_indexer:
            inputs.indexer = self.indexer
            inputs.index_kv, inputs.index_gate = self.indexer.compressor.project(x)
        out = self.backend.forward(spec, inputs, cache, meta)  # [T, NH, D]
        if type(self.wo_a) is nn.Linear:
            # the rope channels rotated back by the query position, then the grouped wo_a (one op)
            # (inplace: `out` is not read again, so its rope channels may be rotated where they are)
            return self.wo_b(self.ops.attn_out_proj(out.contiguous(), cos, sin, self.wo_a.weight, self.o_groups,
                                                    inplace=_rope.ROPE_IN_PLACE))
        # wo_a kept quantized (engine.quant, chosen by the loader): rotate back, then per group
        out = self.ops.rope(out.contiguous(), cos, sin, inverse=True, inplace=_rope.ROPE_IN_PLACE)  # apply_rope(out, cos, -sin)
        if type(self.wo_a) is Fp8Linear and self.wo_a.row_groups_usable(self.o_groups):
            # the groups in one FP8 GEMM launch (each N block reads its group's columns of out)
            return self.wo_b(self.wo_a.forward_row_groups(out.reshape(T, -1), self.o_groups))  # [T, H]
        # NOTE: groups that do not start on a scale-block row (tiny test models): the whole module per group,
        # keeping the group's own R outputs: exact, G times the work
        grouped = out.reshape(T, self.o_groups, -1).transpose(0, 1)  # [G, T, NH*D/G]
        R = self.wo_a.out_features // self.o_groups
        y = torch.cat([self.wo_a(grouped[g])[:, g * R:(g + 1) * R] for g in range(self.o_groups)], dim=-1)
        return self.wo_b(y)  # [T, H]


# --------------------------------------------------------------------------- MoE


class Expert(nn.Module):
    """SwiGLU FFN with clamped pre-activations (w1 = gate, w3 = up, w2 = down)."""

    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor, swiglu: Callable[..., torch.Tensor] = swiglu_torch) -> torch.Tensor:
        """x [n, H] -> [n, H]; `swiglu(g, u, limit)`: the clamped activation, the reference unless the caller
        passes its `OpTable`'s ("swiglu": one kernel on CUDA, `kernels.swiglu`)."""
        if type(self.w1) is not nn.Linear:  # kept-quantized linears (engine.quant): only the modules compute
            return self.w2(swiglu(self.w1(x).contiguous(), self.w3(x).contiguous(), self.limit))
        # NOTE: F.linear on the weights skips three nn.Module calls per expert (decode steps are op-bound)
        return F.linear(swiglu(F.linear(x, self.w1.weight), F.linear(x, self.w3.weight), self.limit), self.w2.weight)


class MoE(nn.Module):
    """Routed experts + one shared expert: the router picks experts, the backend computes them.

    `moe_backend` names an `engine.moe` backend ("torch": grouped matmuls where supported). The
    backend is prepared once after loading (`prepare`, called by `prepare_for_inference`); a forward
    prepares it first if that did not happen or the expert weights were replaced since (reloaded,
    moved to another device), which a data pointer tells.
    """

    def __init__(self, config: ModelConfig, is_hash: bool, moe_backend: str = "torch",
                 ops: OpTable | None = None) -> None:
        super().__init__()
        self.ops = ops if ops is not None else OpTable(torch.get_default_device())
        """The model's small-op implementations ("swiglu" for the shared expert), shared with the layers."""
        H, inter, lim = config.hidden_size, config.moe_intermediate_size, config.swiglu_limit
        self.gate = Gate(config, is_hash)
        self.experts = nn.ModuleList(Expert(H, inter, lim) for _ in range(config.n_routed_experts))
        self.shared_experts = Expert(H, inter, lim)
        self.backend: MoEBackend = get_moe_backend(moe_backend)()
        self._prepared_ptr: int | None = None

    def prepare(self) -> None:
        """Hand the loaded routed experts to the backend (packing, layouts)."""
        self.backend.prepare(self.experts)
        self.gate.set_routing_impl(self.backend.routing_impl)  # the kernel the backend asks for ("torch" mostly)
        self._prepared_ptr = self.experts[0].w1.weight.data_ptr()

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x: [num_tokens, H], input_ids: [num_tokens] -> [num_tokens, H]."""
        if self.experts[0].w1.weight.data_ptr() != self._prepared_ptr:
            self.prepare()
        topk_weights, topk_ids = self.gate(x, input_ids)  # [num_tokens, k] each
        return self.backend(x, topk_weights, topk_ids) + self.shared_experts(x, self.ops.swiglu)


# --------------------------------------------------------------------------- hyper-connections


hc_weights = hc_weights_torch
"""mHC mixing weights (streams [T, hc, H] -> pre, post, comb): the reference in `kernels.mhc`, which the
layers reach through the `OpTable` ops "mhc_pre" / "mhc_post" (fused Triton kernels on CUDA)."""

hc_collapse = hc_collapse_torch
"""Collapse hc streams [T, hc, H] into [T, H] (a hyper head's math; the MTP layer's `hc_head_*` use it):
the reference in `kernels.mhc` ("mhc_head" in the `OpTable`)."""


class DecoderLayer(nn.Module):
    """One V4 block with hyper-connection residual streams."""

    def __init__(self, config: ModelConfig, spec: LayerSpec, *, attention_backend: AttentionBackend,
                 moe_backend: str = "torch", ops: OpTable | None = None) -> None:
        super().__init__()
        H, hc, layer_idx = config.hidden_size, config.hc_mult, spec.layer_idx
        self.ops = ops if ops is not None else OpTable(torch.get_default_device())
        """The model's small-op implementations (`kernels`), shared by every layer; picked once."""
        self.hc, self.iters, self.hc_eps, self.eps = hc, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        self.attn = Attention(config, spec, attention_backend, self.ops)
        self.ffn = MoE(config, config.mlp_layer_types[layer_idx] == "hash_moe", moe_backend, self.ops)
        self.attn_norm = RMSNorm(H, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(H, config.rms_norm_eps)
        n = (2 + hc) * hc
        for which in ("attn", "ffn"):
            self.register_parameter(f"hc_{which}_fn", nn.Parameter(torch.zeros(n, hc * H, dtype=torch.float32)))
            self.register_parameter(f"hc_{which}_base", nn.Parameter(torch.zeros(n, dtype=torch.float32)))
            self.register_parameter(f"hc_{which}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))

    def _mix(self, which: str, streams: torch.Tensor, block) -> torch.Tensor:
        # pre-mix: mixing weights and the collapsed block input [T, H] (`kernels.mhc`; fused on CUDA)
        collapsed, post, comb = self.ops.mhc_pre(streams, getattr(self, f"hc_{which}_fn"),
                                                 getattr(self, f"hc_{which}_base"), getattr(self, f"hc_{which}_scale"),
                                                 self.hc, self.iters, self.hc_eps, self.eps, self.ops.sinkhorn)
        y = block(collapsed)
        # post-mix: new stream k = post_k * y + sum_j comb[j, k] * stream_j
        return self.ops.mhc_post(y, streams, post, comb)

    def forward(self, streams, batch: ForwardBatch, cache: V4KVCache, meta: AttentionMetadata) -> torch.Tensor:
        # the norms through the op table ("rms_norm": one kernel on CUDA); `attn_norm` / `ffn_norm` hold the weights
        norm = self.ops.rms_norm
        an, fn = self.attn_norm, self.ffn_norm
        streams = self._mix("attn", streams, lambda h: self.attn(norm(h, an.weight, an.eps), cache, meta))
        return self._mix("ffn", streams, lambda h: self.ffn(norm(h, fn.weight, fn.eps), batch.input_ids))


class HyperHead(nn.Module):
    """Final collapse of the hc streams into one hidden vector."""

    def __init__(self, config: ModelConfig, ops: OpTable | None = None) -> None:
        super().__init__()
        hc, H = config.hc_mult, config.hidden_size
        self.ops = ops if ops is not None else OpTable(torch.get_default_device())
        """The model's small-op implementations ("mhc_head"), shared with the layers."""
        self.hc_fn = nn.Parameter(torch.zeros(hc, hc * H, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.eps, self.norm_eps = config.hc_eps, config.rms_norm_eps

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        return self.ops.mhc_head(streams, self.hc_fn, self.hc_base, self.hc_scale, self.eps, self.norm_eps)


# --------------------------------------------------------------------------- the model


class DeepseekV4Model(nn.Module):
    """Embedding, decoder layers, hyper head and final norm."""

    def __init__(self, config: ModelConfig, *, attention_backend: str = "torch", moe_backend: str = "torch",
                 op_impls: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.config = config
        self.layer_specs = layer_specs(config)
        """Per layer: its frozen `LayerSpec` (kind, compress rate, window), from the cache layout."""
        self.attention_backend = get_attention_backend(attention_backend)()
        """The `engine.attention` backend every layer's attention delegates to (chosen here, once)."""
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.ops = OpTable(torch.get_default_device(), op_impls)
        """The small-op implementations (`kernels`) every layer uses: picked here for the default device,
        re-picked for the weights' device by `prepare_for_inference`."""
        self.layers = nn.ModuleList(
            DecoderLayer(config, spec, attention_backend=self.attention_backend, moe_backend=moe_backend, ops=self.ops)
            for spec in self.layer_specs
        )
        self.hc_head = HyperHead(config, self.ops)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        rd = config.rope_head_dim
        self.rotary_main = Rotary(config.rope_main, rd)
        self.rotary_compress = Rotary(config.rope_compress, rd)

    def prepare_for_inference(self) -> None:
        """Once after loading: pick the small ops for the weights' device and prepare every MoE backend."""
        self.ops.select(self.embed_tokens.weight.device)
        for layer in self.layers:
            layer.ffn.prepare()

    def build_attention_metadata(self, batch: ForwardBatch, cache: V4KVCache) -> AttentionMetadata:
        """The step's `AttentionMetadata` for `batch` over `cache` (the model runner builds it once per step),
        in the form the attention backend reads (its `build_metadata` hook)."""
        rope_fns = {"main": self.rotary_main, "compress": self.rotary_compress}
        return self.attention_backend.build_metadata(batch, self.layer_specs, rope_fns, cache)

    def forward(self, batch: ForwardBatch, cache: V4KVCache, meta: AttentionMetadata | None = None,
                return_streams: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Run the flat batch through every layer, updating `cache`; returns final hidden [T, H], and with
        `return_streams` also the last layer's hc streams before `hc_head` [T, hc, H] (the MTP layer's input).

        `meta`: the step's attention metadata; else `batch.attn_metadata`, else built here from `batch`.
        """
        if meta is None:
            meta = batch.attn_metadata if batch.attn_metadata is not None else self.build_attention_metadata(batch, cache)
        h = self.embed_tokens(batch.input_ids)
        if batch.input_embeds is not None:
            h = torch.where(batch.embeds_mask[:, None], batch.input_embeds.to(h.dtype), h)
        streams = h.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()  # [T, hc, H]
        for layer in self.layers:
            streams = layer(streams, batch, cache, meta)
        hidden = self.ops.rms_norm(self.hc_head(streams), self.norm.weight, self.norm.eps)  # `norm`
        return (hidden, streams) if return_streams else hidden


class DeepseekV4ForCausalLM(nn.Module):
    """The causal LM: `model` + `head`. `state_dict()` keys equal the checkpoint's keys."""

    def __init__(self, config: ModelConfig, *, attention_backend: str = "torch", moe_backend: str = "torch",
                 op_impls: Mapping[str, str] | None = None, num_mtp_layers: int | None = None) -> None:
        """`attention_backend`: an `engine.attention` backend name; `moe_backend`: an `engine.moe` backend
        name; `op_impls`: `kernels` op name -> implementation, overriding the device's default
        (e.g. {"sinkhorn": "triton"}); `num_mtp_layers`: MTP layers to build (`mtp.{k}`), None for
        config.num_nextn_predict_layers (the loader passes 0 for a checkpoint that ships none)."""
        super().__init__()
        self.config = config
        self.model = DeepseekV4Model(config, attention_backend=attention_backend, moe_backend=moe_backend,
                                     op_impls=op_impls)
        if not config.tie_word_embeddings:
            self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.numerics: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
        """Context entered around every forward and logits computation: `nullcontext`, or the batch-invariant
        mode's `TorchFunctionMode` (`engine.batch_invariant.enable_batch_invariant` sets it, once)."""
        self.is_batch_invariant = False
        """Whether `enable_batch_invariant` switched this model to batch-invariant numerics."""
        self.vision = None
        """The `VisionTower` of a checkpoint with a `vision_config` (image -> input embeddings), else None."""
        if config.vision is not None:
            from deepinfer.engine.models.vision import VisionTower

            tower = VisionTower(config.vision, config.hidden_size)
            # NOTE: its two children are registered here under their checkpoint names, so state_dict()
            # stays the checkpoint format; `self.vision` is a plain attribute sharing those modules.
            self.vision_tower, self.vision_projector = tower.vision_tower, tower.vision_projector
            self.__dict__["vision"] = tower
        n_mtp = config.num_nextn_predict_layers if num_mtp_layers is None else num_mtp_layers
        self.mtp: nn.ModuleList | None = None
        """The multi-token-prediction layers `mtp.{k}` (`engine.models.mtp.MTPLayer`), or None without any."""
        if n_mtp > 0:
            from deepinfer.engine.models.mtp import MTPLayer

            self.mtp = nn.ModuleList(
                MTPLayer(config, attention_backend=self.model.attention_backend, moe_backend=moe_backend,
                         ops=self.model.ops)
                for _ in range(n_mtp)
            )

    def prepare_for_inference(self) -> None:
        """Once after the weights are loaded (`engine.loader.load_checkpoint` calls it): pick the small-op
        implementations for the weights' device and prepare the MoE backends (expert packing)."""
        self.model.prepare_for_inference()
        for layer in self.mtp or ():
            layer.ffn.prepare()

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.head.weight

    def build_attention_metadata(self, batch: ForwardBatch, cache: V4KVCache) -> AttentionMetadata:
        """The step's `AttentionMetadata` (see `DeepseekV4Model.build_attention_metadata`)."""
        return self.model.build_attention_metadata(batch, cache)

    def forward(self, batch: ForwardBatch, cache: V4KVCache, meta: AttentionMetadata | None = None,
                return_streams: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Hidden states [T, H] for the flat batch (cache updated in place); with `return_streams`, also
        the pre-`hc_head` streams [T, hc, H] the MTP layer reads (`mtp_forward`)."""
        with self.numerics():
            return self.model(batch, cache, meta, return_streams)

    def mtp_forward(self, streams: torch.Tensor, batch: ForwardBatch, cache: V4KVCache,
                    meta: AttentionMetadata | None = None, k: int = 0) -> torch.Tensor:
        """MTP layer `k`: hidden [T, H] (before the shared head) predicting the token after the next.

        `streams` [T, hc, H]: the main model's pre-`hc_head` streams at the batch's positions
        (`forward(..., return_streams=True)`); `batch.input_ids`: the next token at each of those
        positions; `cache`: the MTP layer's own window cache (`self.mtp[k].make_cache`); `meta`: as in
        `forward`, over that cache (`self.mtp[k].build_attention_metadata`)."""
        if self.mtp is None:
            raise ValueError("this model has no MTP layer (the checkpoint ships no `mtp.*` weights)")
        layer = self.mtp[k]
        if meta is None:
            meta = layer.build_attention_metadata(batch, cache, self.model.rotary_main, self.model.rotary_compress)
        with self.numerics():
            return layer(streams, batch, cache, meta, self.model.embed_tokens)

    @torch.inference_mode()
    def mtp_step(self, streams: torch.Tensor, batch: ForwardBatch, cache: V4KVCache,
                 meta: AttentionMetadata | None = None, k: int = 0) -> torch.Tensor:
        """`mtp_forward` + the shared head's logits at `batch.logits_indices` (float32 [num_logits, vocab])."""
        hidden = self.mtp_forward(streams, batch, cache, meta, k)
        if batch.logits_indices is not None:
            hidden = hidden[batch.logits_indices]
        return self.compute_logits(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] -> float32 logits [n, vocab]."""
        with self.numerics():
            return F.linear(hidden, self.head_weight()).float()

    @torch.inference_mode()
    def step(self, batch: ForwardBatch, cache: V4KVCache, meta: AttentionMetadata | None = None) -> torch.Tensor:
        """Forward + logits at `batch.logits_indices` (float32 [num_logits, vocab]); `meta` as in `forward`."""
        hidden = self.forward(batch, cache, meta)
        if batch.logits_indices is not None:
            hidden = hidden[batch.logits_indices]
        return self.compute_logits(hidden)
