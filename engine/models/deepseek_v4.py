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

Causality is exact by construction: nothing a position computes depends on later tokens or on
how tokens are chunked into steps or batched with other requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from engine.cache.kv_cache import V4KVCache
from engine.config import ModelConfig, RopeConfig
from engine.forward_batch import ForwardBatch, SeqChunk

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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive channel pairs of the trailing `2 * cos.shape[-1]` channels of `x`.

    x: [n, ..., d]; cos/sin: [n, rope_dim/2] (broadcast over the middle dims).
    """
    rd = cos.shape[-1] * 2
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    rope = x[..., -rd:].float()
    x1, x2 = rope[..., 0::2], rope[..., 1::2]
    out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-rd], out], dim=-1)


@dataclass
class DecodeMeta:
    """Requests of a step with exactly one new token, handled as one batch in every layer."""

    seq_idx: list[int]
    other_idx: list[int]
    """Sequences handled one by one (prefill chunks)."""
    rows: torch.Tensor  # [B] flat token index of each decode row
    pos: torch.Tensor  # [B] its position
    slots: torch.Tensor  # [B]
    state_start: torch.Tensor  # [B]
    frozen: torch.Tensor  # [B] num_frozen_tokens
    block_tables: torch.Tensor  # [B, max_blocks] (padded with 0)
    memo: dict = field(default_factory=dict)
    """Per-step masks and gather indices shared by every layer of the same window / compress rate."""

    def window_valid(self, W: int) -> torch.Tensor:
        """[B, W] whether ring row j holds a key of this row's live window (after this step's write)."""
        key = ("window", W)
        if key not in self.memo:
            j = torch.arange(W, device=self.pos.device)
            key_pos = self.pos[:, None] - ((self.pos[:, None] - j[None, :]) % W)  # position held by ring row j
            self.memo[key] = key_pos >= self.state_start[:, None]
        return self.memo[key]

    def compressed_index(self, rate: int, epb: int):
        """(flat pool rows [B, C], visible [B, C]) of the compressed entries each row's query sees, or
        None when no row has one yet."""
        key = ("compressed", rate, epb)
        if key not in self.memo:
            num_entries = (self.pos + 1) // rate  # [B]
            c_max = int(num_entries.max())
            if c_max == 0:
                self.memo[key] = None
            else:
                c = torch.arange(c_max, device=self.pos.device)
                visible = c[None, :] < num_entries[:, None]  # [B, C]
                cols = (c // epb).clamp(max=self.block_tables.shape[1] - 1)[None].expand(len(self.rows), -1)
                blk = self.block_tables.gather(1, cols)
                flat = torch.where(visible, blk * epb + c % epb, torch.zeros_like(blk))
                self.memo[key] = (flat, visible)
        return self.memo[key]

    @classmethod
    def build(cls, batch: ForwardBatch) -> DecodeMeta | None:
        seq_idx = [i for i, s in enumerate(batch.seqs) if s.num_new_tokens == 1]
        if not seq_idx:
            return None
        dev = batch.input_ids.device
        seqs = [batch.seqs[i] for i in seq_idx]
        max_blocks = max(len(s.block_table) for s in seqs)

        def t(values):
            return torch.tensor(values, dtype=torch.long, device=dev)

        return cls(
            seq_idx=seq_idx,
            other_idx=[i for i, s in enumerate(batch.seqs) if s.num_new_tokens != 1],
            rows=t([batch.starts[i] for i in seq_idx]),
            pos=t([s.num_computed_tokens for s in seqs]),
            slots=t([s.slot for s in seqs]),
            state_start=t([s.state_start for s in seqs]),
            frozen=t([s.num_frozen_tokens for s in seqs]),
            block_tables=t([s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs]),
        )


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

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token kv and gate projections. x: [n, H] -> ([n, width], [n, width])."""
        return self.wkv(x), self.wgate(x)

    def compress(
        self,
        kv: torch.Tensor,  # [m, width] tokens at positions first_pos .. first_pos+m-1
        gate: torch.Tensor,  # [m, width]
        first_pos: int,
        windows: torch.Tensor,  # [nw] window ids to emit; all their tokens lie in the span
        rotary: Rotary,
    ) -> torch.Tensor:
        """Emit the entries of `windows` -> [nw, dim] (normed and rotated at `w * rate`)."""
        r = self.rate
        ar = torch.arange(r, device=kv.device)
        cur = (windows * r - first_pos)[:, None] + ar[None, :]  # [nw, r] rows of window w
        prev = (cur - r).clamp(min=0)
        return self.compress_gathered(kv[cur], gate[cur], kv[prev], gate[prev], windows, rotary)

    def compress_gathered(
        self,
        cur_kv: torch.Tensor,  # [nw, r, width] tokens of window w
        cur_gate: torch.Tensor,  # [nw, r, width]
        prev_kv: torch.Tensor,  # [nw, r, width] tokens of window w-1 (ignored where w == 0 or no overlap)
        prev_gate: torch.Tensor,
        windows: torch.Tensor,  # [nw]
        rotary: Rotary,
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
        cos, sin = rotary(windows * self.rate)
        return apply_rope(entries, cos, sin)


def topk_mask(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the `k` best visible entries per row; ties go to the lower entry index.

    NOTE: ties are frequent (an entry whose every head has ReLU(q.k) = 0 scores exactly 0) and
    torch.topk breaks them in an order that depends on the tensor's shape, which is why HF's
    logits at a position change with the total forward length. Breaking ties by entry index (a
    stable descending sort) makes the choice depend only on the entries the query can see, so
    it is causal and invariant to chunking, batching and decoding.
    """
    if scores.shape[-1] <= k:
        return visible
    scores = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.zeros_like(visible).scatter_(-1, order, True) & visible


# --------------------------------------------------------------------------- attention


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer: scores compressed index keys per query, keeps top-k."""

    def __init__(self, config: ModelConfig, rate: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.topk = config.index_topk
        self.compressor = Compressor(config.hidden_size, self.head_dim, rate, True, config.rms_norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)

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
        n = x.shape[0]
        q = self.wq_b(q_res).view(n, self.num_heads, self.head_dim)
        q = apply_rope(q, cos, sin)
        scores = torch.einsum("nhd,cd->nhc", q.float(), keys.float())
        scores = F.relu(scores) * (self.head_dim**-0.5)
        weights = self.weights_proj(x).float() * (self.num_heads**-0.5)  # [n, heads]
        scores = (scores * weights[:, :, None]).sum(dim=1)  # [n, C]
        return topk_mask(scores, visible, self.topk)

    def score_batched(self, q_res, x, keys, cos, sin) -> torch.Tensor:
        """Decode rows, each with its own keys: keys [B, C, index_head_dim] -> scores [B, C]."""
        B = x.shape[0]
        q = apply_rope(self.wq_b(q_res).view(B, self.num_heads, self.head_dim), cos, sin)
        scores = F.relu(torch.einsum("bhd,bcd->bhc", q.float(), keys.float())) * (self.head_dim**-0.5)
        weights = self.weights_proj(x).float() * (self.num_heads**-0.5)  # [B, heads]
        return (scores * weights[:, :, None]).sum(dim=1)


class Attention(nn.Module):
    """V4 attention of one layer (sliding window, plus CSA or HCA compressed branch)."""

    def __init__(self, config: ModelConfig, layer_idx: int, kind: str, kind_index: int) -> None:
        super().__init__()
        H, D, NH = config.hidden_size, config.head_dim, config.num_attention_heads
        self.kind, self.kind_index, self.layer_idx = kind, kind_index, layer_idx
        self.num_heads, self.head_dim, self.window = NH, D, config.sliding_window
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
        self.rate = 0
        if kind == "csa":
            self.rate = config.compress_rates["compressed_sparse_attention"]
            self.compressor = Compressor(H, D, self.rate, True, config.rms_norm_eps)
            self.indexer = Indexer(config, self.rate)
        elif kind == "hca":
            self.rate = config.compress_rates["heavily_compressed_attention"]
            self.compressor = Compressor(H, D, self.rate, False, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: V4KVCache, rope: dict) -> torch.Tensor:
        """x: [T, H] (after attn_norm) -> [T, H]."""
        T = x.shape[0]
        NH, D = self.num_heads, self.head_dim
        cos, sin = rope["cos"], rope["sin"]  # [T, rd/2] of this layer's flavour
        q_res = self.q_norm(self.wq_a(x))  # [T, q_lora_rank]
        q = self.wq_b(q_res).view(T, NH, D)
        q = apply_rope(rms_norm(q, None, self.eps), cos, sin)
        kv = apply_rope(self.norm(self.wkv(x)), cos, sin)  # [T, D]
        if self.kind != "sliding":
            ckv, cgate = self.compressor.project(x)
            if self.kind == "csa":
                ikv, igate = self.indexer.compressor.project(x)
        dm: DecodeMeta | None = rope.get("decode")
        out = torch.empty_like(q) if dm is None or dm.other_idx else None  # a pure decode step fills none
        if dm is not None:
            # a pure decode step (every row is a decode row, in order): no gather / scatter copies
            r = slice(None) if not dm.other_idx else dm.rows
            proj = None
            if self.kind == "csa":
                proj = (ckv[r], cgate[r], ikv[r], igate[r])
            elif self.kind == "hca":
                proj = (ckv[r], cgate[r], None, None)
            o = self._decode_batched(dm, q[r], kv[r], x[r], q_res[r], proj, cache, rope)
            if dm.other_idx:
                out[r] = o
            else:
                out = o
        for i in (dm.other_idx if dm is not None else range(len(batch.seqs))):
            s = batch.seqs[i]
            a, b = batch.starts[i], batch.starts[i] + s.num_new_tokens
            sl = slice(a, b)
            extra = None
            if self.kind != "sliding":
                extra = self._compressed(s, x[sl], q_res[sl], ckv[sl], cgate[sl],
                                         (ikv[sl], igate[sl]) if self.kind == "csa" else None,
                                         cache, rope, sl, batch.positions[sl])
            out[sl] = self._attend_one(s, q[sl], kv[sl], batch.positions[sl], cache, extra)
        # rotate the rope channels of the output back by the query position
        out = apply_rope(out, cos, -sin)
        grouped = out.reshape(T, self.o_groups, -1).transpose(0, 1)  # [G, T, NH*D/G]
        w = self.wo_a.weight.view(self.o_groups, -1, grouped.shape[-1])  # [G, R, NH*D/G]
        y = torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(T, -1)  # [T, G*R]
        return self.wo_b(y)

    # -- decode rows, batched ------------------------------------------------------------------

    def _decode_batched(self, dm: DecodeMeta, q, kv, x, q_res, proj, cache: V4KVCache, rope) -> torch.Tensor:
        """One new token for each of B requests in one go. q [B, NH, D], kv [B, D] -> [B, NH, D]."""
        W = self.window
        ring = cache.window_kv[self.layer_idx]  # [slots, W, D]
        ring[dm.slots, dm.pos % W] = kv.to(ring.dtype)
        keys = ring[dm.slots]  # [B, W, D]
        valid = dm.window_valid(W)
        scale = self.head_dim**-0.5
        logits = torch.einsum("bhd,bwd->bhw", q, keys) * scale
        parts = [logits.masked_fill(~valid[:, None, :], float("-inf"))]
        entries = None
        if proj is not None:
            entries, mask = self._decode_compressed(dm, x, q_res, proj, cache, rope)
            if entries is not None:
                cl = torch.einsum("bhd,bcd->bhc", q, entries) * scale
                parts.append(cl.masked_fill(~mask[:, None, :], float("-inf")))
        parts.append(self.attn_sink.to(logits.dtype).view(1, -1, 1).expand(q.shape[0], -1, 1))
        probs = torch.cat(parts, dim=-1).softmax(dim=-1)  # the sink keeps every row finite
        o = torch.einsum("bhw,bwd->bhd", probs[..., :W].to(keys.dtype), keys)
        if entries is not None:
            C = entries.shape[1]
            o = o + torch.einsum("bhc,bcd->bhd", probs[..., W:W + C].to(entries.dtype), entries)
        return o

    def _decode_compressed(self, dm: DecodeMeta, x, q_res, proj, cache: V4KVCache, rope):
        """Advance the compressors by one token per row; return (entries [B, C, D], mask [B, C])."""
        r, j = self.rate, self.kind_index
        ckv, cgate, ikv, igate = proj
        rotary = rope["compress_rotary"]
        if self.kind == "csa":
            pool, epb = cache.csa_entries[j], cache.csa_entries_per_block
            self._decode_compressor(self.compressor, ckv, cgate, cache.csa_buf_kv[j], cache.csa_buf_gate[j],
                                    dm, pool, epb, rotary)
            ipool = cache.index_entries[j]
            self._decode_compressor(self.indexer.compressor, ikv, igate, cache.index_buf_kv[j],
                                    cache.index_buf_gate[j], dm, ipool, epb, rotary)
        else:
            pool, epb = cache.hca_entries[j], cache.hca_entries_per_block
            self._decode_compressor(self.compressor, ckv, cgate, cache.hca_buf_kv[j], cache.hca_buf_gate[j],
                                    dm, pool, epb, rotary)
        index = dm.compressed_index(r, epb)
        if index is None:
            return None, None
        flat, visible = index
        entries = pool.view(-1, pool.shape[-1])[flat]  # [B, C, D]
        if self.kind == "hca":
            return entries, visible
        keys = ipool.view(-1, ipool.shape[-1])[flat]  # [B, C, ID]
        scores = self.indexer.score_batched(q_res, x, keys, rope["dec_cos"], rope["dec_sin"])
        return entries, topk_mask(scores, visible, self.indexer.topk)

    @staticmethod
    def _decode_compressor(comp: Compressor, kv, gate, buf_kv, buf_gate, dm: DecodeMeta, pool, epb, rotary) -> None:
        """Write each row's new token into its ring; emit the entry of every window that just ended."""
        r, ring_len = comp.rate, buf_kv.shape[1]
        buf_kv[dm.slots, dm.pos % ring_len] = kv.to(buf_kv.dtype)
        buf_gate[dm.slots, dm.pos % ring_len] = gate.to(buf_gate.dtype)
        w_all = (dm.pos + 1) // r - 1
        done = ((dm.pos + 1) % r == 0) & (w_all >= dm.frozen // r)
        sel = done.nonzero().squeeze(1)
        if sel.numel() == 0:
            return
        w = w_all[sel]
        slots = dm.slots[sel][:, None]
        cur = w[:, None] * r + torch.arange(r, device=kv.device)[None, :]  # [b, r] positions
        prev = (cur - r).clamp(min=0)
        new = comp.compress_gathered(buf_kv[slots, cur % ring_len], buf_gate[slots, cur % ring_len],
                                     buf_kv[slots, prev % ring_len], buf_gate[slots, prev % ring_len], w, rotary)
        flat = dm.block_tables[sel, w // epb] * epb + w % epb
        pool.view(-1, pool.shape[-1])[flat] = new.to(pool.dtype)

    # -- per request ------------------------------------------------------------------------

    def _attend_one(self, s: SeqChunk, q, kv, pos, cache: V4KVCache, extra) -> torch.Tensor:
        """Attention of one request's new tokens over window + (selected) compressed entries.

        Query i (position p0 + i) sees exactly the W keys at positions p0 + i - W + 1 .. p0 + i: the
        ring's history (positions before p0, from `h0` on) followed by this chunk's keys, padded in
        front to W - 1 history rows; `unfold` gives every query its W-row window as a view, so the
        cost is n * W per head instead of n * (n + W).
        """
        W, p0, n = self.window, s.num_computed_tokens, s.num_new_tokens
        ring = cache.window_kv[self.layer_idx, s.slot]  # [W, D]
        h0 = max(s.state_start, p0 - W + 1)
        hist_pos = torch.arange(p0 - W + 1, p0, device=kv.device)  # [W - 1] positions before the chunk
        hist = ring[hist_pos % W].to(kv.dtype)
        if h0 > p0 - W + 1:  # rows before h0 hold no key of this request: zero them (masked below)
            hist[: h0 - (p0 - W + 1)] = 0
        keys = torch.cat([hist, kv], dim=0)  # [W - 1 + n, D]
        windows = keys.unfold(0, W, 1)  # [n, D, W]: row i = positions p0 + i - W + 1 .. p0 + i
        allowed = (pos[:, None] - (W - 1) + torch.arange(W, device=kv.device)[None, :]) >= h0  # [n, W]
        scale = self.head_dim**-0.5
        logits = torch.einsum("nhd,ndw->nhw", q, windows) * scale  # [n, NH, W]
        logits = logits.masked_fill(~allowed[:, None, :], float("-inf"))
        parts = [logits]
        if extra is not None:
            entries, mask = extra  # [C, D], [n, C]
            cl = torch.einsum("nhd,cd->nhc", q, entries) * scale
            parts.append(cl.masked_fill(~mask[:, None, :], float("-inf")))
        sink = self.attn_sink.to(logits.dtype).view(1, -1, 1).expand(n, -1, 1)
        parts.append(sink)
        probs = torch.cat(parts, dim=-1).softmax(dim=-1)  # the sink keeps every row finite
        o = torch.einsum("nhw,ndw->nhd", probs[..., :W].to(keys.dtype), windows)
        if extra is not None:
            C = entries.shape[0]
            o = o + torch.einsum("nhc,cd->nhd", probs[..., W:W + C].to(entries.dtype), entries)
        # write the new tokens' K=V into the ring (only the last W matter)
        keep = min(n, W)
        ring[pos[-keep:] % W] = kv[-keep:]
        return o

    def _compressed(self, s: SeqChunk, x, q_res, ckv, cgate, index_proj, cache: V4KVCache, rope, sl, pos):
        """Run this request's compressors, store new entries, return (entries [C, D], mask [n, C])."""
        r, p0, n = self.rate, s.num_computed_tokens, s.num_new_tokens
        j = self.kind_index
        device = x.device
        C0, C1 = p0 // r, (p0 + n) // r
        windows = torch.arange(min(max(C0, s.num_frozen_tokens // r), C1), C1, device=device)
        bt = torch.tensor(s.block_table, dtype=torch.long, device=device)
        if self.kind == "csa":
            pool, epb = cache.csa_entries[j], cache.csa_entries_per_block
            buf_kv, buf_gate = cache.csa_buf_kv[j, s.slot], cache.csa_buf_gate[j, s.slot]
        else:
            pool, epb = cache.hca_entries[j], cache.hca_entries_per_block
            buf_kv, buf_gate = cache.hca_buf_kv[j, s.slot], cache.hca_buf_gate[j, s.slot]
        rotary = rope["compress_rotary"]
        entries = self._run_compressor(self.compressor, ckv, cgate, buf_kv, buf_gate, p0, windows, rotary, pool, bt, epb, C1)
        # causal visibility: entry w is visible to the query at t once (w + 1) * r <= t + 1
        visible = torch.arange(C1, device=device)[None, :] < ((pos + 1) // r)[:, None]  # [n, C1]
        if self.kind == "hca":
            return entries, visible
        ikv, igate = index_proj
        ipool = cache.index_entries[j]
        keys = self._run_compressor(self.indexer.compressor, ikv, igate, cache.index_buf_kv[j, s.slot],
                                    cache.index_buf_gate[j, s.slot], p0, windows, rotary, ipool, bt, epb, C1)
        mask = self.indexer.select(q_res, x, keys, visible, rope["cos"][sl], rope["sin"][sl])
        return entries, mask

    @staticmethod
    def _run_compressor(comp: Compressor, kv, gate, buf_kv, buf_gate, p0, windows, rotary, pool, bt, epb, C1):
        """Compress the windows this chunk completes, write them to the pool, return all C1 entries."""
        r = comp.rate
        ring_len = buf_kv.shape[0]
        n = kv.shape[0]
        if windows.numel() > 0:
            h0 = max(0, (p0 // r - (1 if comp.overlap else 0)) * r)
            if p0 > h0:
                hp = torch.arange(h0, p0, device=kv.device) % ring_len
                span_kv = torch.cat([buf_kv[hp], kv], dim=0)
                span_gate = torch.cat([buf_gate[hp], gate], dim=0)
            else:
                span_kv, span_gate = kv, gate
            new = comp.compress(span_kv, span_gate, h0, windows, rotary)
            flat = bt[windows // epb] * epb + windows % epb
            pool.view(-1, pool.shape[-1])[flat] = new.to(pool.dtype)
        keep = min(n, ring_len)
        tail = torch.arange(p0 + n - keep, p0 + n, device=kv.device) % ring_len
        buf_kv[tail] = kv[-keep:].to(buf_kv.dtype)
        buf_gate[tail] = gate[-keep:].to(buf_gate.dtype)
        if C1 == 0:
            return pool.new_zeros((0, pool.shape[-1]))
        allw = torch.arange(C1, device=kv.device)
        return pool.view(-1, pool.shape[-1])[bt[allw // epb] * epb + allw % epb]


# --------------------------------------------------------------------------- MoE


class Expert(nn.Module):
    """SwiGLU FFN with clamped pre-activations (w1 = gate, w3 = up, w2 = down)."""

    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: F.linear on the weights skips three nn.Module calls per expert (decode steps are op-bound)
        g = F.linear(x, self.w1.weight).clamp(max=self.limit)
        u = F.linear(x, self.w3.weight).clamp(min=-self.limit, max=self.limit)
        return F.linear(F.silu(g) * u, self.w2.weight)


class Gate(nn.Module):
    """Router: learned top-k (with a selection-only correction bias) or hash table routing."""

    def __init__(self, config: ModelConfig, is_hash: bool) -> None:
        super().__init__()
        self.is_hash = is_hash
        self.topk = config.num_experts_per_tok
        self.scoring = config.scoring_func
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.topk, dtype=torch.long))
        else:
            self.register_buffer("bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (weights [T, k], expert ids [T, k])."""
        logits = F.linear(x, self.weight)
        if self.scoring == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.scoring == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        if self.is_hash:
            idx = self.tid2eid[input_ids].long()
        else:
            idx = torch.topk(scores + self.bias, self.topk, dim=-1, sorted=False).indices
        w = scores.gather(1, idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * self.scaling, idx


class MoE(nn.Module):
    """Routed experts + one shared expert."""

    def __init__(self, config: ModelConfig, is_hash: bool) -> None:
        super().__init__()
        H, inter, lim = config.hidden_size, config.moe_intermediate_size, config.swiglu_limit
        self.gate = Gate(config, is_hash)
        self.experts = nn.ModuleList(Expert(H, inter, lim) for _ in range(config.n_routed_experts))
        self.shared_experts = Expert(H, inter, lim)
        self.inter, self.limit = inter, lim
        self._packed: tuple[torch.Tensor, torch.Tensor] | None = None

    def packed_experts(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The routed experts' weights stacked for one grouped matmul per projection:
        (w13 [E, H, 2*inter] = [w1 | w3] transposed, w2 [E, inter, H]); None where not used.

        Packed on first use (inference on the CPU only): the stacks become the only storage and
        every expert's `w1/w2/w3.weight` a view into them, so memory does not grow and the
        checkpoint names stay. Re-packed if the expert parameters were replaced (e.g. reloaded).

        NOTE: CUDA keeps the per-expert loop until the grouped path is validated there.
        """
        first = self.experts[0].w1.weight
        if first.device.type != "cpu" or first.requires_grad and torch.is_grad_enabled():
            return None
        if self._packed is not None and self._packed[0].data_ptr() == first.data_ptr():
            return self._packed
        n = self.inter
        w13 = torch.stack([torch.cat([ex.w1.weight.detach(), ex.w3.weight.detach()], 0) for ex in self.experts])
        w2 = torch.stack([ex.w2.weight.detach() for ex in self.experts])  # [E, H, I]
        for e, ex in enumerate(self.experts):
            rg = ex.w1.weight.requires_grad
            ex.w1.weight = nn.Parameter(w13[e, :n], requires_grad=rg)
            ex.w3.weight = nn.Parameter(w13[e, n:], requires_grad=rg)
            ex.w2.weight = nn.Parameter(w2[e], requires_grad=rg)
        self._packed = (w13.transpose(1, 2), w2.transpose(1, 2))
        return self._packed

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, idx = self.gate(x, input_ids)
        if x.shape[0] == 1:
            # A single token: no sort/scatter. Same additions in the same order (ascending expert id,
            # then the shared expert) as the general path, so both give bit-identical sums.
            ids = idx[0].tolist()
            w = weights.to(x.dtype)
            out = None
            for k in sorted(range(len(ids)), key=ids.__getitem__):
                y = self.experts[ids[k]](x) * w[:, k:k + 1]
                out = y if out is None else out + y
            return out + self.shared_experts(x)
        out = torch.zeros_like(x)
        flat_e = idx.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        tok = order // idx.shape[1]
        wsorted = weights.reshape(-1)[order]
        packed = self.packed_experts()
        if packed is not None:
            # every (token, expert) pair in expert order: two grouped matmuls instead of a loop
            w13, w2 = packed
            offs = torch.bincount(flat_e, minlength=len(self.experts)).cumsum(0).to(torch.int32)
            h = torch._grouped_mm(x[tok], w13, offs=offs)  # [T*k, 2*inter]
            g = h[:, :self.inter].clamp(max=self.limit)
            u = h[:, self.inter:].clamp(min=-self.limit, max=self.limit)
            y = torch._grouped_mm(F.silu(g) * u, w2, offs=offs) * wsorted[:, None].to(x.dtype)  # [T*k, H]
            out.index_add_(0, tok, y)
            return out + self.shared_experts(x)
        counts = torch.bincount(flat_e, minlength=len(self.experts)).tolist()
        off = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            t = tok[off:off + c]
            y = self.experts[e](x[t]) * wsorted[off:off + c, None].to(x.dtype)
            out.index_add_(0, t, y)
            off += c
        return out + self.shared_experts(x)


# --------------------------------------------------------------------------- hyper-connections


def hc_weights(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               hc: int, iters: int, eps: float, norm_eps: float):
    """mHC mixing weights from the streams [T, hc, H] -> pre [T, hc], post [T, hc], comb [T, hc, hc]."""
    T = streams.shape[0]
    flat = rms_norm(streams.reshape(T, -1).float(), None, norm_eps)
    mix = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mix.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(T, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + eps
    return pre, post, sinkhorn(comb, iters, eps)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn-Knopp of [T, hc, hc] towards a doubly-stochastic matrix: normalise columns, then
    `iters - 1` rounds of rows then columns, each sum plus `eps`.

    NOTE: on the CPU without autograd the same float32 arithmetic runs in numpy (bit-identical
    results): the matrices are tiny, so the cost is per-op dispatch, which numpy does in about half
    torch's time; at decode batch sizes this loop is the largest single cost of a CPU step.
    """
    if comb.device.type == "cpu" and not comb.requires_grad and comb.shape[0] <= 64:
        a = comb.numpy(force=True)
        a = a / (a.sum(-2, keepdims=True) + eps)
        for _ in range(iters - 1):
            a /= a.sum(-1, keepdims=True) + eps
            a /= a.sum(-2, keepdims=True) + eps
        return torch.from_numpy(a)
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class DecoderLayer(nn.Module):
    """One V4 block with hyper-connection residual streams."""

    def __init__(self, config: ModelConfig, layer_idx: int, kind: str, kind_index: int) -> None:
        super().__init__()
        H, hc = config.hidden_size, config.hc_mult
        self.hc, self.iters, self.hc_eps, self.eps = hc, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        self.attn = Attention(config, layer_idx, kind, kind_index)
        self.ffn = MoE(config, config.mlp_layer_types[layer_idx] == "hash_moe")
        self.attn_norm = RMSNorm(H, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(H, config.rms_norm_eps)
        n = (2 + hc) * hc
        for which in ("attn", "ffn"):
            self.register_parameter(f"hc_{which}_fn", nn.Parameter(torch.zeros(n, hc * H, dtype=torch.float32)))
            self.register_parameter(f"hc_{which}_base", nn.Parameter(torch.zeros(n, dtype=torch.float32)))
            self.register_parameter(f"hc_{which}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))

    def _mix(self, which: str, streams: torch.Tensor, block) -> torch.Tensor:
        dtype = streams.dtype
        pre, post, comb = hc_weights(streams, getattr(self, f"hc_{which}_fn"), getattr(self, f"hc_{which}_base"),
                                     getattr(self, f"hc_{which}_scale"), self.hc, self.iters, self.hc_eps, self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(dtype)  # [T, H]
        y = block(collapsed)
        # new stream k = post_k * y + sum_j comb[j, k] * stream_j
        return post.to(dtype).unsqueeze(-1) * y.unsqueeze(1) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)

    def forward(self, streams, batch: ForwardBatch, cache: V4KVCache, rope: dict) -> torch.Tensor:
        streams = self._mix("attn", streams, lambda h: self.attn(self.attn_norm(h), batch, cache, rope))
        return self._mix("ffn", streams, lambda h: self.ffn(self.ffn_norm(h), batch.input_ids))


class HyperHead(nn.Module):
    """Final collapse of the hc streams into one hidden vector."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hc, H = config.hc_mult, config.hidden_size
        self.hc_fn = nn.Parameter(torch.zeros(hc, hc * H, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.eps, self.norm_eps = config.hc_eps, config.rms_norm_eps

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        T = streams.shape[0]
        flat = rms_norm(streams.reshape(T, -1).float(), None, self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn.float()) * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


# --------------------------------------------------------------------------- the model


class DeepseekV4Model(nn.Module):
    """Embedding, decoder layers, hyper head and final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        from engine.cache.kv_cache import CacheLayout

        lay = CacheLayout.from_config(config)
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, lay.layer_kinds[i], lay.kind_index[i]) for i in range(config.num_hidden_layers)
        )
        self.hc_head = HyperHead(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        rd = config.rope_head_dim
        self.rotary_main = Rotary(config.rope_main, rd)
        self.rotary_compress = Rotary(config.rope_compress, rd)

    def forward(self, batch: ForwardBatch, cache: V4KVCache) -> torch.Tensor:
        """Run the flat batch through every layer, updating `cache`; returns final hidden [T, H]."""
        h = self.embed_tokens(batch.input_ids)
        if batch.input_embeds is not None:
            h = torch.where(batch.embeds_mask[:, None], batch.input_embeds.to(h.dtype), h)
        streams = h.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()  # [T, hc, H]
        cm, sm = self.rotary_main(batch.positions)
        cc, sc = self.rotary_compress(batch.positions)
        dm = DecodeMeta.build(batch)
        rope_main = {"cos": cm, "sin": sm, "compress_rotary": self.rotary_compress, "decode": dm}
        rope_comp = {"cos": cc, "sin": sc, "compress_rotary": self.rotary_compress, "decode": dm}
        if dm is not None:
            rope_comp["dec_cos"], rope_comp["dec_sin"] = cc[dm.rows], sc[dm.rows]
        for layer in self.layers:
            rope = rope_main if layer.attn.kind == "sliding" else rope_comp
            streams = layer(streams, batch, cache, rope)
        return self.norm(self.hc_head(streams))


class DeepseekV4ForCausalLM(nn.Module):
    """The causal LM: `model` + `head`. `state_dict()` keys equal the checkpoint's keys."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV4Model(config)
        if not config.tie_word_embeddings:
            self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.vision = None
        """The `VisionTower` of a checkpoint with a `vision_config` (image -> input embeddings), else None."""
        if config.vision is not None:
            from engine.models.vision import VisionTower

            tower = VisionTower(config.vision, config.hidden_size)
            # NOTE: its two children are registered here under their checkpoint names, so state_dict()
            # stays the checkpoint format; `self.vision` is a plain attribute sharing those modules.
            self.vision_tower, self.vision_projector = tower.vision_tower, tower.vision_projector
            self.__dict__["vision"] = tower

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.head.weight

    def forward(self, batch: ForwardBatch, cache: V4KVCache) -> torch.Tensor:
        """Hidden states [T, H] for the flat batch (cache updated in place)."""
        return self.model(batch, cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] -> float32 logits [n, vocab]."""
        return F.linear(hidden, self.head_weight()).float()

    @torch.inference_mode()
    def step(self, batch: ForwardBatch, cache: V4KVCache) -> torch.Tensor:
        """Forward + logits at `batch.logits_indices` (float32 [num_logits, vocab])."""
        hidden = self.forward(batch, cache)
        if batch.logits_indices is not None:
            hidden = hidden[batch.logits_indices]
        return self.compute_logits(hidden)
