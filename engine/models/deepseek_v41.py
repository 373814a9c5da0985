"""DeepSeek-V4.1 in plain PyTorch: the full-sequence forward of one sequence, and the paged engine's step.

Written from the description of DeepSeek's official reference (`inference/model.py`, `inference/engram.py`
of the DeepSeek-V4.1-Flash release) in docs/V4_1.md, not copied from it. Module paths are the published
checkpoint's tensor names (`embed`, `layers.{L}.attn.compressor.wkv`, `layers.{L}.engram.wkv`, ...), so
`state_dict()` keys are the checkpoint's for everything this module builds. Weights are float, except that the
engine's loader keeps the checkpoint's quantized tensors as published: the dense 32x32-block FP8 linears
(`keep_fp8_linears`: `engine.quant.Fp8Linear`), the MXFP4 routed experts (`engine.quant.v41.keep_fp4_experts`:
`Fp4Linear`) and the FP8 Engram tables, mapped from the shards and gathered row by row (`keep_engram_tables`:
`engine.quant.engram.Fp8EngramTable`). The reference's FP8/FP4 activations and KV are not simulated.

What V4.1 changes against `deepseek_v4` (whose pieces are reused where the math is the same: RMSNorm,
the interleaved partial RoPE and its YaRN, the clamped SwiGLU expert, the mHC mixing weights and
Sinkhorn, the top-k tie rule, the MoE backends):

* layer roles (`V41Config`): KV sources compute the compressed entries (ratio 2: softmax-pooled groups
  without overlap; ratio 1: one entry per token, a plain projection); every later layer of the same ratio
  attends over them. Index sources run an indexer whose keys come from the KV source's latent; other
  compressed layers reuse the latest index source's selection. The candidate source publishes a block
  mask that later index sources apply (the two-level top-k).
* no per-head RMSNorm of the queries; no hash-routed layers (a router with an image-token bias `bias_vl`);
  RMSNorm eps 1e-20.
* mHC with the pre weights delayed by one sublayer and no `hc_head` (the final collapse uses the last
  FFN's pre weights).
* Engram: n-gram hashes of a normalised compressed vocabulary index two large tables; the rows, mixed by
  `wkv`, enter the residual streams through a per-stream sigmoid gate before the layer's block.

`forward_full` runs the layers in order over the whole sequence and passes what sources publish in a
`SharedState` (no module globals). Causality is exact: a position's output depends only on tokens at or
before it.

The paged engine (`engine.engine.Engine`) runs `step(batch, cache)` over `engine.cache.v41.V41KVCache`: V4's
step metadata (`build_attention_metadata` over `v41_layer_specs`), chunked prefill and batched decode rows in
`PagedAttention` (KV sources write their ratio's pools, later layers read them, index sources publish their
selections within the step), Engram hashes from a per-slot history ring, and decoder-side bounded replay
(`decoder_replay`: the layers after the last KV source compute a request's tokens from `prompt - sliding_window`
on only; `_decoder_tail`). Image spans (the vision tower's rows, `engine.models.vision_v41`) replace their
positions' input rows, route with `bias_vl` and are dead tokens for Engram. The DSpark draft stages (`mtp`) are
`engine.models.dspark`; the step hands the drafter its features (`forward(return_streams=True)`).

With `static_decode` (set by the engine's `ModelRunner` when it runs graphs) the step's decode rows are V4's static
form (`engine.models.deepseek_v41_static`): shapes from the batch size and the cache geometry,
every decision on the device, padding rows masked, so `engine.cuda_graph.CudaGraphRunner` captures and replays
pure-decode steps (docs/V4_1.md §16).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.engine.config import V41Config
from deepinfer.engine.models.deepseek_v4 import Expert, RMSNorm, apply_rope, rope_inv_freq, topk_mask
from deepinfer.engine.models.deepseek_v41_static import StaticDecodeMixin, attend_decode_rows, engram_grams_static
from deepinfer.engine.moe import get_moe_backend
from deepinfer.engine.moe.router import SCORING_FUNCS
from deepinfer.kernels.mhc import hc_weights_torch, mhc_post_torch

# --------------------------------------------------------------------------- Engram hashing


def compressed_token_map(tokenizer) -> tuple[list[int], int]:
    """Token id -> compressed id over V4.1's normalised vocabulary, and the number of compressed ids.

    `tokenizer`: a transformers fast tokenizer or a `tokenizers.Tokenizer` (decoded one id at a time,
    special tokens kept, no clean-up). Keys: NFKC, NFD, accents stripped, lower case, whitespace runs to
    one space, a lone space protected from the final strip; an empty result keeps the decoded text, and a
    decode with U+FFFD (a partial UTF-8 byte token) is keyed by the raw token string. Ids are numbered in
    first-seen order (docs/V4_1.md §6). The count must equal `engram_compressed_vocab_size`: every hash
    multiplier derives from it.
    """
    from tokenizers import Regex, normalizers

    guard = "\ue000"
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), guard),
        normalizers.Strip(), normalizers.Replace(guard, " "),
    ])
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)  # a `tokenizers.Tokenizer` (the engine's) too
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.get_vocab_size(with_added_tokens=True)
    ids: dict[str, int] = {}
    out = []
    for tid in range(size):
        text = backend.decode([tid], skip_special_tokens=False)
        key = backend.id_to_token(tid) if "\ufffd" in text else (norm.normalize_str(text) or text)
        out.append(ids.setdefault(key, len(ids)))
    return out, len(ids)


def engram_multipliers(layer_ids: tuple[int, ...], max_ngram_size: int, compressed_vocab_size: int) -> torch.Tensor:
    """Odd hash multipliers [n_layers, max_ngram_size] (int64): numpy's PCG64 stream seeded with
    10007 * layer id, drawn below (int64 max // compressed_vocab_size) // 2, times 2 plus 1."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram_size,), dtype=np.int64) * 2 + 1
            for layer in layer_ids]
    return torch.from_numpy(np.stack(rows))


class NgramHasher(nn.Module):
    """Token ids -> Engram row ids [T, n_engram_layers, (max_ngram_size - 1) * n_heads] (int64, bit exact).

    Position t hashes the compressed ids at t, t-1, .., t-max+1: a slot before the sequence or at a dead
    token (image span), and every slot after it, holds the pad token's compressed id. The running XOR of
    id * multiplier after k+1 slots is the (k+1)-gram's hash, taken modulo each head's prime and shifted by
    that bucket's offset in the layer's table. Buffers are not part of the checkpoint.
    """

    def __init__(self, config: V41Config, token_map: torch.Tensor | None = None) -> None:
        super().__init__()
        primes = torch.tensor(config.engram_primes, dtype=torch.int64)  # [L, max-1, heads]
        flat = primes.flatten(1)
        self.max_ngram = config.engram_max_ngram_size
        self.pad_token_id = config.engram_pad_token_id
        self.compressed_vocab_size = config.engram_compressed_vocab_size
        self.register_buffer("primes", primes, persistent=False)
        self.register_buffer("offsets", flat.cumsum(-1) - flat, persistent=False)  # [L, cols]
        # NOTE: `torch.from_numpy` ignores a `with torch.device(...)` construction context; the buffers share a device.
        mult = engram_multipliers(config.engram_layer_ids, self.max_ngram, self.compressed_vocab_size).to(primes.device)
        self.register_buffer("multipliers", mult, persistent=False)  # [L, max]
        self.register_buffer("token_map", torch.zeros(0, dtype=torch.int64), persistent=False)
        if token_map is not None:
            self.set_token_map(token_map)

    def set_token_map(self, token_map: torch.Tensor | list[int]) -> None:
        """Install the tokenizer's compressed-id map (`compressed_token_map`), checking its range."""
        tm = torch.as_tensor(token_map, dtype=torch.int64)
        if tm.dim() != 1 or tm.numel() <= self.pad_token_id:
            raise ValueError(f"the Engram token map must be 1-D and cover engram_pad_token_id={self.pad_token_id}.")
        if int(tm.min()) < 0 or int(tm.max()) >= self.compressed_vocab_size:
            raise ValueError(f"Engram token map values must lie in [0, engram_compressed_vocab_size="
                             f"{self.compressed_vocab_size}); the multipliers assume it.")
        self.token_map = tm.to(self.primes.device)

    def forward(self, input_ids: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T]; live [T] bool (False: dead, an image-span token) -> row ids [T, L, cols]."""
        if self.token_map.numel() == 0:
            raise RuntimeError("the Engram token map is not set (NgramHasher.set_token_map)")
        T = input_ids.shape[0]
        ids = input_ids if live is None else input_ids.masked_fill(~live, -1)
        pos = torch.arange(T, device=input_ids.device)
        grams = torch.stack([torch.where(pos >= s, ids[(pos - s).clamp(min=0)], -1) for s in range(self.max_ngram)],
                            dim=-1)  # [T, max]: the token at t - s, -1 where there is none
        return self.hash_grams(grams)

    def hash_grams(self, grams: torch.Tensor) -> torch.Tensor:
        """grams [T, max_ngram] raw token ids at t, t-1, .. (-1: none, before the sequence or dead) -> row ids
        [T, L, cols]. From the first -1 on, every slot holds the pad's compressed id (the block latches).
        The paged engine calls this with each request's history from its cache slot (`engram_tokens`)."""
        if self.token_map.numel() == 0:
            raise RuntimeError("the Engram token map is not set (NgramHasher.set_token_map)")
        blocked = (grams < 0).to(torch.int32).cummax(dim=-1).values.bool()
        comp = self.token_map[grams.clamp(min=0)]
        grams = torch.where(blocked, self.token_map[self.pad_token_id], comp)  # [T, max]
        prod = grams[:, None, :] * self.multipliers  # [T, L, max] (no overflow: the multipliers' bound)
        rolling, out = prod[..., 0], []
        for s in range(1, self.max_ngram):
            rolling = rolling ^ prod[..., s]
            out.append(rolling[..., None] % self.primes[:, s - 1])  # [T, L, heads]
        return torch.cat(out, dim=-1) + self.offsets


class EngramTable(nn.Module):
    """One Engram layer's table `[rows, head_dim]` (published as FP8 with a UE8M0 scale per 32 values; held
    dequantized here: the reference reader. The engine's loader replaces it by `engine.quant.engram.Fp8EngramTable`)."""

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Engram(nn.Module):
    """Adds an n-gram lookup to the residual streams, gated per stream by how well it matches it."""

    def __init__(self, config: V41Config, slot: int) -> None:
        super().__init__()
        H, hc = config.hidden_size, config.hc_mult
        cols = (config.engram_max_ngram_size - 1) * config.engram_n_heads
        self.slot, self.hc, self.dim, self.eps = slot, hc, H, config.rms_norm_eps
        self.embed = EngramTable(config.engram_num_embeddings[slot], config.engram_head_dim)
        self.wkv = nn.Linear(cols * config.engram_head_dim, H * (hc + 1), bias=False)
        self.q_weight = nn.Parameter(torch.ones(hc, H))
        self.k_weight = nn.Parameter(torch.ones(hc, H))

    def forward(self, streams: torch.Tensor, row_ids: torch.Tensor, live: torch.Tensor | None) -> torch.Tensor:
        """streams [T, hc, H]; row_ids [T, cols]; live [T] (False closes the gate) -> streams."""
        kv = self.wkv(self.embed(row_ids).flatten(1))  # [T, (hc+1)*H]
        key = kv[:, : self.hc * self.dim].float().view(-1, self.hc, self.dim)
        value = kv[:, self.hc * self.dim:].float()
        h = streams.float()
        # NOTE: normalised per (token, stream) over H, not over the streams jointly
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * (self.q_weight.float() * self.k_weight.float()) * key).sum(-1) * rstd * self.dim**-0.5
        gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp(min=1e-6).sqrt())  # signed sqrt, as trained
        if live is not None:
            gate = gate * live[:, None].to(gate.dtype)
        return (h + gate[..., None] * value[:, None, :]).to(streams.dtype)


# --------------------------------------------------------------------------- attention


@dataclass
class SharedState:
    """What source layers publish to later layers during one forward (docs/V4_1.md §2)."""

    compressed_kv: torch.Tensor | None = None  # [C, D] the latest KV source's entries (rotated)
    index_keys: torch.Tensor | None = None  # [C, index_head_dim] its index keys
    selection: torch.Tensor | None = None  # [T, C] bool: the latest index source's picks
    candidates: torch.Tensor | None = None  # [T, C] bool: the candidate source's block mask


@dataclass
class RopeTables:
    """cos/sin of one flavour at the computed tokens' positions [Tq, rd/2] and at each ratio's entry
    positions; `positions` [Tq] are those tokens' absolute positions (a tail under bounded replay)."""

    tokens: tuple[torch.Tensor, torch.Tensor]
    entries: dict[int, tuple[torch.Tensor, torch.Tensor]]
    positions: torch.Tensor


class Compressor(nn.Module):
    """A KV source's compressor: one latent per `ratio` tokens (before RoPE)."""

    def __init__(self, hidden: int, dim: int, ratio: int, eps: float) -> None:
        super().__init__()
        self.ratio = ratio
        self.wkv = nn.Linear(hidden, dim, bias=False)
        if ratio > 1:
            self.wgate = nn.Linear(hidden, dim, bias=False)
        self.norm = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> latents [T // ratio, dim] of the complete groups."""
        r = self.ratio
        if r == 1:  # a plain projection: nothing to pool
            return self.norm(self.wkv(x))
        n = x.shape[0] // r * r
        kv = self.wkv(x[:n].float()).view(n // r, r, -1)
        score = self.wgate(x[:n].float()).view(n // r, r, -1)
        return self.pool(kv, score).to(x.dtype)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token projections (kv, gate) [T, dim] in float32 (gate None at ratio 1): what a paged step
        buffers per slot until a group completes."""
        return self.wkv(x.float()), (self.wgate(x.float()) if self.ratio > 1 else None)

    def pool(self, kv: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """Groups' projections kv, gate [n, ratio, dim] -> latents [n, dim]: normed softmax-weighted sums
        (ratio 1: the normed projection itself)."""
        if self.ratio == 1:
            # NOTE: float32 as for ratio > 1, whatever dtype the caller holds the projections in (a decode row's come
            # from the cache's buffer, a prefill chunk's as computed): the entry then does not depend on the path
            return self.norm(kv[:, 0].float())
        return self.norm((kv.float() * gate.float().softmax(dim=1)).sum(dim=1))


def candidate_blocks(scores: torch.Tensor, counts: torch.Tensor, num_blocks: int, block: int) -> torch.Tensor:
    """The candidate source's mask [T, C]: per query the `num_blocks` blocks of `block` entries with the best
    maximum score, the block of the newest visible entry always in, blocks with nothing visible out.

    scores [T, C] with invisible entries at -inf; counts [T] visible entries per query.
    """
    T, C = scores.shape
    nb = -(-C // block)
    best = F.pad(scores, (0, nb * block - C), value=float("-inf")).view(T, nb, block).amax(-1)  # [T, nb]
    newest = torch.div(counts - 1, block, rounding_mode="floor")  # -1: nothing visible
    best = best.masked_fill(torch.arange(nb, device=scores.device)[None] == newest[:, None], float("inf"))
    # NOTE: ties go to the lower block (a stable sort, as `topk_mask`): CUDA's topk order, and independent of
    # how many (invisible) columns follow, so a paged step that sees fewer columns keeps the same blocks
    top = torch.sort(best, dim=-1, descending=True, stable=True)
    k = min(num_blocks, nb)
    keep = torch.zeros_like(best, dtype=torch.bool).scatter_(-1, top.indices[:, :k], top.values[:, :k] > float("-inf"))
    # NOTE: an expand, not `repeat_interleave`, whose CUDA kernel may size its output from a device read
    return keep[:, :, None].expand(T, nb, block).reshape(T, nb * block)[:, :C]


class Indexer(nn.Module):
    """An index source's indexer; `owns_k` (a KV source) also derives the index keys from its latent."""

    def __init__(self, config: V41Config, layer: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.topk, self.ratio = config.index_topk, config.compress_ratios[layer]
        self.owns_k = layer in config.kv_source_layer_ids
        self.is_candidate_source = layer == config.candidate_source_layer_id
        self.uses_candidates = config.uses_candidates(layer)
        self.num_blocks, self.block = config.candidate_topk_blocks, config.candidate_block_size
        self.wq_b = nn.Linear(config.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.num_heads, bias=False)
        if self.owns_k:
            self.wk = nn.Linear(config.head_dim, self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, latent: torch.Tensor | None, rope: RopeTables,
                shared: SharedState) -> torch.Tensor:
        """The selection [T, C] bool of this layer (published for the layers that reuse it)."""
        if self.owns_k:
            shared.index_keys = self.index_keys(latent, *rope.entries[self.ratio])
        keys = shared.index_keys  # [C, index_head_dim]
        scores = self.scores(x, qr, keys, *rope.tokens)
        counts = torch.div(rope.positions + 1, self.ratio, rounding_mode="floor")  # visible entries per query
        visible = torch.arange(keys.shape[0], device=x.device)[None] < counts[:, None]
        selection, candidates = self.select(scores, visible, counts, shared.candidates)
        if self.is_candidate_source:
            shared.candidates = candidates
        return selection

    def index_keys(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """A KV source's index keys [C, index_head_dim] from its latents [C, head_dim] (rotated at the entries)."""
        return apply_rope(self.k_norm(self.wk(latent)), cos, sin)

    def scores(self, x: torch.Tensor, qr: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """Index scores [T, C] of the queries of x [T, H] / qr [T, q_lora_rank] over keys [C, d] (shared) or
        [T, C, d] (each query its own: the paged engine's decode rows)."""
        T = x.shape[0]
        q = apply_rope(self.wq_b(qr).view(T, self.num_heads, self.head_dim), cos, sin)
        eq = "thd,cd->thc" if keys.dim() == 2 else "thd,tcd->thc"
        scores = F.relu(torch.einsum(eq, q.float(), keys.float()))
        weights = self.weights_proj(x).float() * (self.head_dim**-0.5 * self.num_heads**-0.5)
        return (scores * weights[:, :, None]).sum(dim=1)  # [T, C]

    def select(self, scores: torch.Tensor, visible: torch.Tensor, counts: torch.Tensor,
               candidates: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(selection [T, C] bool, the candidate mask this layer publishes or None) from the scores, the causal
        visibility [T, C], the visible counts [T] and the candidate source's mask (used by later index sources)."""
        if self.is_candidate_source:
            candidates = candidate_blocks(scores.masked_fill(~visible, float("-inf")), counts, self.num_blocks,
                                          self.block)
            published = candidates
        else:
            published = None
            if self.uses_candidates:
                visible = visible & candidates
        # NOTE: ties go to the lower entry (topk_mask); masked entries are never picked (docs/V4_1.md §5)
        return topk_mask(scores, visible, self.topk), published


class Attention(nn.Module):
    """V4.1 attention of one layer: the window, plus the shared compressed KV when compress_ratio > 0."""

    def __init__(self, config: V41Config, layer: int) -> None:
        super().__init__()
        H, D, NH, G = config.hidden_size, config.head_dim, config.num_attention_heads, config.o_groups
        self.num_heads, self.head_dim, self.groups, self.window = NH, D, G, config.sliding_window
        self.ratio = config.compress_ratios[layer]
        self.wq_a = nn.Linear(H, config.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, NH * D, bias=False)
        self.wkv = nn.Linear(H, D, bias=False)
        self.kv_norm = RMSNorm(D, config.rms_norm_eps)
        self.attn_sink = nn.Parameter(torch.zeros(NH, dtype=torch.float32))
        self.wo_a = nn.Linear(NH * D // G, G * config.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(G * config.o_lora_rank, H, bias=False)
        self.compressor = (Compressor(H, D, self.ratio, config.rms_norm_eps)
                           if layer in config.kv_source_layer_ids else None)
        self.indexer = Indexer(config, layer) if layer in config.index_source_layer_ids else None

    def forward(self, x: torch.Tensor, rope: RopeTables, shared: SharedState) -> torch.Tensor:
        """x [T, H] (after attn_norm) -> [T, H]."""
        T, NH, D = x.shape[0], self.num_heads, self.head_dim
        qr, q, kv = self.project(x, *rope.tokens)
        pos = rope.positions  # the window's keys are the computed tokens themselves
        ok = (pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - self.window)  # [T, T] window
        logits = torch.einsum("thd,sd->ths", q, kv).masked_fill(~ok[:, None], float("-inf"))
        values = kv
        if self.ratio:
            latent = self.compressor(x) if self.compressor is not None else None
            if self.indexer is not None:
                shared.selection = self.indexer(x, qr, latent, rope, shared)
            if latent is not None:
                shared.compressed_kv = apply_rope(latent, *rope.entries[self.ratio])
            entries = shared.compressed_kv.float()  # [C, D]
            comp = torch.einsum("thd,cd->thc", q, entries).masked_fill(~shared.selection[:, None], float("-inf"))
            logits, values = torch.cat([logits, comp], dim=-1), torch.cat([kv, entries], dim=0)
        logits = logits * D**-0.5
        sink = self.attn_sink.float()[None, :, None].expand(T, NH, 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]  # the sink joins the denominator
        out = torch.einsum("ths,sd->thd", probs, values).to(x.dtype)
        return self.output(out, *rope.tokens)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(qr [T, q_lora_rank], q [T, NH, D] float32, kv [T, D] float32): the low-rank query, the rotated queries
        (NOTE: no per-head norm in V4.1) and the rotated shared K=V of x [T, H]."""
        T = x.shape[0]
        qr = self.q_norm(self.wq_a(x))
        q = apply_rope(self.wq_b(qr).view(T, self.num_heads, self.head_dim), cos, sin).float()
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin).float()
        return qr, q, kv

    def output(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention output [T, NH, D] -> [T, H]: rotated back by the query position, then the grouped `wo_a`
        (block-diagonal over `o_groups`) and `wo_b`."""
        T = out.shape[0]
        out = apply_rope(out, cos, -sin)
        grouped = out.reshape(T, self.groups, -1)
        w = self.wo_a.weight.view(self.groups, -1, grouped.shape[-1])  # [G, R, NH*D/G]: block-diagonal
        return self.wo_b(torch.einsum("tgd,grd->tgr", grouped, w).reshape(T, -1))


# --------------------------------------------------------------------------- MoE


class Gate(nn.Module):
    """V4.1's router: learned top-k with a selection-only bias; image-span tokens use `bias_vl`."""

    def __init__(self, config: V41Config, num_experts: int, topk: int, has_vl_bias: bool) -> None:
        super().__init__()
        self.topk, self.score = topk, SCORING_FUNCS[config.scoring_func]
        self.normalize, self.scaling = config.norm_topk_prob and topk > 1, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(num_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32)) if has_vl_bias else None

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, expert ids [T, k])."""
        scores = self.score(F.linear(x.float(), self.weight.float()))
        bias = self.bias[None]
        if image_mask is not None and self.bias_vl is not None:
            bias = torch.where(image_mask[:, None], self.bias_vl[None], bias)
        ids = (scores + bias).topk(self.topk, dim=-1).indices  # the bias picks, it does not weigh
        weights = scores.gather(1, ids)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class MoE(nn.Module):
    """Routed experts on an `engine.moe` backend plus one shared expert."""

    def __init__(self, config: V41Config, num_experts: int, topk: int, moe_backend: str = "torch") -> None:
        super().__init__()
        H, inter, lim = config.hidden_size, config.moe_intermediate_size, config.swiglu_limit
        self.gate = Gate(config, num_experts, topk, config.vision_config is not None)
        self.experts = nn.ModuleList(Expert(H, inter, lim) for _ in range(num_experts))
        self.shared_experts = Expert(H, inter, lim)
        self.backend = get_moe_backend(moe_backend)()
        self._prepared_ptr: int | None = None

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None) -> torch.Tensor:
        if self.experts[0].w1.weight.data_ptr() != self._prepared_ptr:
            self.backend.prepare(self.experts)
            self._prepared_ptr = self.experts[0].w1.weight.data_ptr()
        weights, ids = self.gate(x, image_mask)
        return self.backend(x, weights.to(x.dtype), ids) + self.shared_experts(x)


# --------------------------------------------------------------------------- the paged engine's step


class PagedAttention(StaticDecodeMixin):
    """V4.1 attention of one layer over the paged cache (`engine.cache.v41.V41KVCache`) for one engine step.

    The step's `AttentionMetadata` is V4's (`engine.attention.base.build_attention_metadata` over V4.1's layer
    specs: non-overlapping compressors of each ratio, no V4 indexer): decode rows run as one batch, each
    prefill chunk alone, exactly as the `torch` attention backend does; the window part of a prefill chunk is
    that backend's `_attend_one`. What V4.1 adds is the ownership: only a KV source runs its compressor and
    writes entries and index keys (into its row of the ratio's pools); every compressed layer reads its latest
    source's row; an index source scores those keys and publishes its selection (and the candidate source its
    block mask) for the same requests in later layers of the step (`selection` / `candidates`, per group:
    "decode" or a prefill chunk's index).

    Not a registered `AttentionBackend`: the seam's `AttentionInputs` / `LayerSpec` carry V4's per-layer
    compressor and indexer, not V4.1's cross-layer reuse.

    **Static decode rows** (`DecodeRows.is_static`: what the model builds with `DeepseekV41ForCausalLM.static_decode`)
    run `_decode_static` (`engine.models.deepseek_v41_static.StaticDecodeMixin`): shapes from the batch size and the
    cache geometry only, every decision on the device, so a pure-decode step is captured and replayed as a CUDA graph
    (`engine.cuda_graph.CudaGraphRunner`; `cuda_graph_safe = True`). The host-decided rows (the default: today's
    bits) keep the path above. A subclass (the batch-invariant mode's) is graph-safe only if it says so itself
    (`__init_subclass__`): the model then builds host-decided rows for it.
    """

    name = "v41-torch"
    cuda_graph_safe = True

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        # NOTE: a subclass overriding the hooks (`engine.batch_invariant.BatchInvariantPagedAttention`) has not been
        # checked for the static path: not graph-safe unless it declares so
        cls.cuda_graph_safe = cls.__dict__.get("cuda_graph_safe", False)

    def __init__(self) -> None:
        self.selection: dict[object, torch.Tensor | None] = {}
        self.candidates: dict[object, torch.Tensor | None] = {}
        self.selection_topk = 0
        """`index_topk` of the index sources (the most entries a selection holds; set by the first that publishes)."""
        # the static rows' per-step caches (`StaticDecodeMixin`): a step's index rows per ratio, a selection's entries
        self._static_rows: dict[tuple[int, int], tuple] = {}
        self._picked: dict[int, tuple] = {}

    def reset(self) -> None:
        """Forget the previous step's selections (each step starts with its own sources)."""
        self.selection.clear()
        self.candidates.clear()
        self._static_rows.clear()
        self._picked.clear()

    def __call__(self, attn: Attention, layer: int, x: torch.Tensor, meta, cache) -> torch.Tensor:
        """x [T, H] (after attn_norm) of the flat batch -> [T, H]; reads and writes `cache`."""
        lay, r = cache.layout, attn.ratio
        cos, sin = meta.rope["compress" if r else "main"]
        qr, q, kv = attn.project(x, cos, sin)
        out = torch.empty_like(q)
        sink = attn.attn_sink.float()
        pools = None
        if r:
            row = lay.source_row[layer]
            pools = (cache.entries(r)[row], cache.index_keys(r)[row], row)
        spec, dt = _PagedSpec(layer, attn.window), cache.window_kv.dtype
        dm = meta.decode
        if dm is not None and dm.is_static:
            rr, (dcos, dsin) = dm.rows, dm.rope["compress" if r else "main"]
            out[rr] = self._decode_static(attn, layer, r, x[rr], qr[rr], q[rr], kv[rr], dcos, dsin, sink, dm, cache,
                                          pools)
        elif dm is not None:
            rr = dm.rows
            extra = self._decode_compressed(attn, r, x[rr], qr[rr], cos[rr], sin[rr], dm, cache, pools) if r else None
            out[rr] = self._decode_attend(q[rr], kv[rr], sink, cache.window_kv[layer], dm, attn.window, extra)
        for ci, chunk in enumerate(meta.prefill):
            sl = chunk.rows
            extra = self._chunk_compressed(attn, r, ci, chunk, x[sl], qr[sl], cos[sl], sin[sl], cache,
                                           pools) if r else None
            if extra is not None:
                extra = (extra[0].to(dt), extra[1])
            # NOTE: in the cache's dtype, as V4's layers hand it over (a no-op in float32)
            out[sl] = self._attend_chunk(spec, chunk, q[sl].to(dt), kv[sl].to(dt), sink, cache, extra)
        return self._output(attn, out.to(x.dtype), cos, sin)

    # -- what the batch-invariant mode replaces (`engine.batch_invariant.BatchInvariantPagedAttention`) ----------

    @staticmethod
    def _attend_chunk(spec, chunk, q, kv, sink, cache, extra) -> torch.Tensor:
        """One prefill chunk's attention over its window (+ selected entries): the `torch` backend's `_attend_one`."""
        from deepinfer.engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend._attend_one(spec, chunk, q, kv, sink, cache, extra)

    @staticmethod
    def _output(attn: Attention, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The attention output [T, NH, D] -> [T, H] (`Attention.output`)."""
        return attn.output(out, cos, sin)

    @staticmethod
    def _index_scores(indexer: Indexer, x, qr, keys, cos, sin) -> torch.Tensor:
        """An index source's scores [n, C] over keys [C, d] (a chunk's) or [n, C, d] (decode rows'): `Indexer.scores`."""
        return indexer.scores(x, qr, keys, cos, sin)

    @staticmethod
    def _chunk_projections(kvp: torch.Tensor, gp: torch.Tensor | None, dtype: torch.dtype):
        """A prefill chunk's compressor projections as its groups pool them (float32, as computed; the buffer's
        `dtype` is what decode rows pool)."""
        del dtype
        return kvp, gp

    # -- the compressed branch ------------------------------------------------------------------

    @staticmethod
    def _emit(attn: Attention, latent: torch.Tensor, rope, rows: torch.Tensor, pools) -> None:
        """Write the entries (rotated latents) and index keys of new groups at flat pool rows `rows`."""
        entries, keys_pool, _ = pools
        cos, sin = rope
        entries.view(-1, entries.shape[-1])[rows] = apply_rope(latent, cos, sin).to(entries.dtype)
        keys = attn.indexer.index_keys(latent.to(attn.indexer.wk.weight.dtype), cos, sin)
        keys_pool.view(-1, keys_pool.shape[-1])[rows] = keys.to(keys_pool.dtype)

    def _select(self, attn: Attention, group, x, qr, keys, visible, counts, cos, sin) -> None:
        """An index source's selection for `group` (and the candidate source's mask), published for later layers."""
        if attn.indexer is None:
            return
        scores = self._index_scores(attn.indexer, x, qr, keys, cos, sin)
        sel, cand = attn.indexer.select(scores, visible, counts, self.candidates.get(group))
        self.selection[group] = sel
        if attn.indexer.is_candidate_source:
            self.candidates[group] = cand

    def _decode_compressed(self, attn, r, x, qr, cos, sin, dm, cache, pools):
        """Decode rows: advance the source's compressor, emit completed groups; (entries [B, C, D], mask) or None."""
        entries, keys_pool, row = pools
        if attn.compressor is not None:
            geo = dm.compressors[(r, False)]
            ring_kv = cache.tensors[f"comp_kv_r{r}"][row]  # [slots, r, D]
            kvp, gp = attn.compressor.project(x)
            ring_kv[dm.slots, geo.ring_rows] = kvp.to(ring_kv.dtype)
            ring_gate = cache.tensors.get(f"comp_gate_r{r}")
            if gp is not None:
                ring_gate = ring_gate[row]
                ring_gate[dm.slots, geo.ring_rows] = gp.to(ring_gate.dtype)
            if geo.num_done:  # a host int from the metadata
                slots = geo.slots[:, None]
                latent = attn.compressor.pool(ring_kv[slots, geo.cur_rows],
                                              None if gp is None else ring_gate[slots, geo.cur_rows])
                self._emit(attn, latent, geo.entry_rope, geo.pool_rows, pools)
        index = dm.compressed[r]
        if index is None:  # no row sees an entry yet
            if attn.indexer is not None:
                self.selection["decode"] = None
            return None
        ent = entries.view(-1, entries.shape[-1])[index.pool_rows]  # [B, C, D]
        keys = keys_pool.view(-1, keys_pool.shape[-1])[index.pool_rows]  # [B, C, ID]
        self._select(attn, "decode", x, qr, keys, index.visible, (dm.pos + 1) // r, cos, sin)
        return ent, self.selection["decode"]

    def _chunk_compressed(self, attn, r, ci, chunk, x, qr, cos, sin, cache, pools):
        """One prefill chunk: run the source's compressor over buffered + new tokens, emit the groups the chunk
        completes, keep its tail buffered; (entries [C, D], mask [n, C]) or None while no entry exists."""
        entries, keys_pool, row = pools
        geo = chunk.compressors[(r, False)]
        if attn.compressor is not None:
            ring_kv = cache.tensors[f"comp_kv_r{r}"][row, chunk.slot]  # [r, D]
            ring_gate = cache.tensors[f"comp_gate_r{r}"][row, chunk.slot] if r > 1 else None
            kvp, gp = self._chunk_projections(*attn.compressor.project(x), ring_kv.dtype)
            if geo.windows.numel() > 0:
                span_kv, span_gate = kvp, gp
                if geo.hist_rows is not None:
                    span_kv = torch.cat([ring_kv[geo.hist_rows].float(), kvp], dim=0)
                    span_gate = None if gp is None else torch.cat([ring_gate[geo.hist_rows].float(), gp], dim=0)
                latent = attn.compressor.pool(span_kv[geo.cur_rows], None if gp is None else span_gate[geo.cur_rows])
                self._emit(attn, latent, geo.entry_rope, geo.write_rows, pools)
            keep = geo.tail_rows.shape[0]
            ring_kv[geo.tail_rows] = kvp[-keep:].to(ring_kv.dtype)
            if gp is not None:
                ring_gate[geo.tail_rows] = gp[-keep:].to(ring_gate.dtype)
        if geo.entry_rows is None:
            if attn.indexer is not None:
                self.selection[ci] = None
            return None
        ent = entries.view(-1, entries.shape[-1])[geo.entry_rows]  # [C, D]
        keys = keys_pool.view(-1, keys_pool.shape[-1])[geo.entry_rows]  # [C, ID]
        pos = torch.arange(chunk.num_computed_tokens, chunk.num_computed_tokens + chunk.num_tokens, device=x.device)
        self._select(attn, ci, x, qr, keys, geo.visible, (pos + 1) // r, cos, sin)
        return ent.float(), self.selection[ci]

    @staticmethod
    def _decode_attend(q, kv, sink, ring, dm, W: int, extra) -> torch.Tensor:
        """Decode rows: write each row's key into its ring, attend over the ring + selected entries + the sink
        (`deepseek_v41_static.attend_decode_rows`, the static rows' math too)."""
        ring[dm.slots, dm.window_rows[W]] = kv.to(ring.dtype)
        return attend_decode_rows(q, ring[dm.slots], dm.window_valid[W], sink, extra)


@dataclass(frozen=True)
class _PagedSpec:
    """What the `torch` backend's `_attend_one` reads of a layer (its ring's layer and the window)."""

    layer_idx: int
    window: int


def v41_layer_specs(config: V41Config):
    """V4's `LayerSpec`s that make `build_attention_metadata` describe V4.1's geometry: window-only layers, and
    compressed layers as non-overlapping compressors of their ratio without V4's indexer (one block table; the
    pools' rows are the KV sources', `engine.cache.v41`)."""
    from deepinfer.engine.attention.base import LayerSpec

    return tuple(
        LayerSpec(layer_idx=i, kind="hca" if r else "sliding", kind_index=-1, compress_rate=r,
                  window=config.sliding_window, is_overlap=False, has_indexer=False,
                  rope="compress" if r else "main")
        for i, r in enumerate(config.compress_ratios[: config.num_hidden_layers])
    )


# --------------------------------------------------------------------------- the model


class Block(nn.Module):
    """One V4.1 layer: (Engram), attention and MoE between hyper-connection mixes."""

    def __init__(self, config: V41Config, layer: int, moe_backend: str = "torch") -> None:
        super().__init__()
        H, hc = config.hidden_size, config.hc_mult
        self.hc, self.iters, self.hc_eps, self.eps = hc, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        self.attn = Attention(config, layer)
        self.ffn = MoE(config, config.n_routed_experts, config.num_experts_per_tok, moe_backend)
        self.engram = (Engram(config, config.engram_layer_ids.index(layer))
                       if layer in config.engram_layer_ids else None)
        self.attn_norm = RMSNorm(H, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(H, config.rms_norm_eps)
        n = (2 + hc) * hc
        for which in ("attn", "ffn"):
            self.register_parameter(f"hc_{which}_fn", nn.Parameter(torch.zeros(n, hc * H, dtype=torch.float32)))
            self.register_parameter(f"hc_{which}_base", nn.Parameter(torch.zeros(n, dtype=torch.float32)))
            self.register_parameter(f"hc_{which}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))

    def _weights(self, which: str, streams: torch.Tensor):
        return hc_weights_torch(streams, getattr(self, f"hc_{which}_fn"), getattr(self, f"hc_{which}_base"),
                                getattr(self, f"hc_{which}_scale"), self.hc, self.iters, self.hc_eps, self.eps)

    def forward(self, streams: torch.Tensor, pre: torch.Tensor, rope: RopeTables, shared: SharedState,
                image_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [T, hc, H], pre [T, hc] (the previous sublayer's) -> (streams, this FFN's pre for the next).

        NOTE: each sublayer's mixes come from the streams entering it; its post/comb update its own residual,
        its pre collapses the *next* sublayer's input (docs/V4_1.md §8).
        """
        return self.mix(streams, pre, lambda x: self.attn(x, rope, shared), image_mask)

    def mix(self, streams: torch.Tensor, pre: torch.Tensor, attend, image_mask: torch.Tensor | None):
        """`forward` with the attention given as `attend(x [T, H] after attn_norm) -> [T, H]` (the full-sequence
        forward or the paged engine's step)."""
        attn_pre, post, comb = self._weights("attn", streams)
        x = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
        streams = mhc_post_torch(attend(self.attn_norm(x)), streams, post, comb)
        ffn_pre, post, comb = self._weights("ffn", streams)
        x = (attn_pre[..., None] * streams).sum(dim=1).to(streams.dtype)
        streams = mhc_post_torch(self.ffn(self.ffn_norm(x), image_mask), streams, post, comb)
        return streams, ffn_pre


def _in_numerics(fn):
    """Run a model method inside its `numerics` context (`nullcontext`, or the batch-invariant mode's
    `TorchFunctionMode`, which `engine.batch_invariant.enable_batch_invariant` sets once)."""
    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        with self.numerics():
            return fn(self, *args, **kwargs)
    return run


class DeepseekV41ForCausalLM(nn.Module):
    """DeepSeek-V4.1's backbone: embed -> hc streams -> layers -> collapse -> norm -> head.

    `forward_full(input_ids)` is the full-sequence forward of one sequence (float32 logits at every
    position). The Engram layers need the tokenizer's compressed-id map (`set_engram_token_map`).
    """

    def __init__(self, config: V41Config, *, moe_backend: str = "torch") -> None:
        super().__init__()
        if not isinstance(config, V41Config):
            raise TypeError(f"DeepseekV41ForCausalLM needs a V41Config, got {type(config).__name__}")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i, moe_backend) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.engram_hash = NgramHasher(config) if config.engram_layer_ids else None
        rd = config.rope_head_dim
        for name, rope in (("main", config.rope_main), ("compress", config.rope_compress)):
            inv, scale = rope_inv_freq(rope, rd)
            self.register_buffer(f"inv_freq_{name}", inv, persistent=False)
            setattr(self, f"rope_scale_{name}", scale)
        self.layer_specs = v41_layer_specs(config)
        """V4's `LayerSpec`s describing V4.1's geometry to the step metadata builder (`v41_layer_specs`)."""
        self.backend = PagedAttention()
        """The paged attention of every layer (and the step's published selections); not CUDA-graph safe."""
        self.vision = None
        """The ViT (`vision_v41.ViT`, checkpoint prefix `vision.`) of a checkpoint with a `vision_config`, else None."""
        object.__setattr__(self, "_image_encoder", None)
        if config.vision is not None:
            from deepinfer.engine.models.vision_v41 import V41VisionTower

            tower = V41VisionTower(config.vision, config.hidden_size)
            self.vision, self.aligner = tower.vision, tower.aligner
            self.image_start, self.image_end, self.image_newline = tower.image_start, tower.image_end, tower.image_newline
            object.__setattr__(self, "_image_encoder", tower)
        self.mtp = None
        """DSpark draft stages (`engine.models.dspark`, checkpoint `mtp.*`), None without them: the drafter of
        `speculative="dspark"` (`engine.spec_decode.dspark_drafter`). They share `embed` and `head`."""
        if config.num_nextn_predict_layers and config.dspark_block_size:
            from deepinfer.engine.models.dspark import build_dspark_stages

            self.mtp = build_dspark_stages(config, moe_backend)
        self.dspark_targets = {t: i for i, t in enumerate(config.dspark_target_layer_ids)} if self.mtp else {}
        """Target layer -> its slot in the DSpark features (`forward(return_streams=True)`)."""
        self.last_kv_source = max(config.kv_source_layer_ids, default=-1)
        """The last layer that computes compressed KV: decoder-side bounded replay cuts after it."""
        self.decoder_replay = False
        """The paged step's decoder-side bounded replay (`_decoder_tail`): the layers after `last_kv_source` compute
        a request's tokens from `num_prompt_tokens - sliding_window` on only. The engine sets it from
        `EngineConfig.v41_decoder_replay` (on by default); off here, so a bare model computes every token."""
        self.numerics = contextlib.nullcontext
        """Context entered around the paged `forward` and `compute_logits`: `nullcontext`, or the batch-invariant
        mode's (`engine.batch_invariant.enable_batch_invariant`, once; it also swaps `backend` and the MoE backends)."""
        self.is_batch_invariant = False
        """Whether `enable_batch_invariant` switched this model to batch-invariant numerics."""
        self.static_decode = False
        """Whether the step metadata has static decode rows (`DecodeRows.is_static`: `PagedAttention._decode_static`,
        what a CUDA graph captures). The engine's `ModelRunner` turns it on when it runs decode steps as CUDA graphs
        (every step then reads the static rows, eager ones included); only while `backend` is `cuda_graph_safe` (not
        under the batch-invariant mode, whose paged attention keeps the host-decided rows). Off, the host-decided
        rows: bit for bit what they were; the static rows give the same tokens with other float rounding (e.g. a KV
        source pools every row's group under a mask, attention reads only the selected entries)."""

    @property
    def image_encoder(self):
        """The vision tower (`engine.models.vision_v41.V41VisionTower`: preprocess, encode) of a checkpoint with a
        `vision_config`, else None. Its modules and rows are registered on this model under their checkpoint names
        (`vision`, `aligner`, `image_start`, `image_end`, `image_newline`), so `state_dict()` stays the
        checkpoint's; the tower object is a plain attribute sharing them (the engine encodes through it).
        NOTE: re-linked on every access: a load with `assign=True` replaces this model's parameters."""
        tower = self._image_encoder
        if tower is not None:
            tower._modules.update(vision=self.vision, aligner=self.aligner)
            tower._parameters.update({n: getattr(self, n) for n in ("image_start", "image_end", "image_newline")})
        return tower

    def set_engram_token_map(self, token_map) -> None:
        """Install the compressed-id map (`compressed_token_map(tokenizer)[0]`) the Engram hashes read."""
        if self.engram_hash is None:
            raise ValueError("this config has no Engram layers (`engram_layer_ids` is empty)")
        self.engram_hash.set_token_map(token_map)

    def _rope(self, flavour: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * getattr(self, f"inv_freq_{flavour}")[None]
        scale = getattr(self, f"rope_scale_{flavour}")
        return freqs.cos() * scale, freqs.sin() * scale

    def _rope_tables(self, T: int, device) -> dict[str, RopeTables]:
        pos = torch.arange(T, device=device)
        ratios = sorted({r for r in self.config.compress_ratios[: self.config.num_hidden_layers] if r})
        return {
            "main": RopeTables(self._rope("main", pos), {}, pos),
            # NOTE: an entry stands for its group's first token: entry j at position j * ratio
            "compress": RopeTables(self._rope("compress", pos),
                                   {r: self._rope("compress", torch.arange(T // r, device=device) * r) for r in ratios},
                                   pos),
        }

    def forward_full(self, input_ids: torch.Tensor, image_mask: torch.Tensor | None = None, *,
                     image_embeds: torch.Tensor | None = None, bounded_replay: bool = False,
                     replay_from: int | None = None) -> torch.Tensor:
        """input_ids [T] of one sequence from position 0; image_mask [T] bool (True inside image spans:
        the router's `bias_vl`, no Engram) -> float32 logits [T, vocab]. `image_embeds` [T, H]: the input rows of
        the image positions (the vision tower's spans; rows outside `image_mask` are ignored).

        `bounded_replay` (decoder-side bounded replay): the layers after the last KV source, which own no
        compressed KV, run only over the last `sliding_window` tokens; the logits of those tokens come back
        [min(T, window), vocab]. Not exact: the first tail tokens see a window cut at the tail's start in
        those layers (the compressed entries they attend are complete); exact when T <= sliding_window.
        `replay_from`: the same with the tail starting at that position (logits [T - replay_from, vocab]): a
        prompt of P tokens followed by generated ones, `replay_from = P - sliding_window`, is what the paged
        engine computes with decoder replay on (`decoder_replay`).
        """
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be [T], got shape {tuple(input_ids.shape)}")
        T, hc = input_ids.shape[0], self.config.hc_mult
        if replay_from is not None and (bounded_replay or not 0 <= replay_from < T):
            raise ValueError(f"replay_from={replay_from} must lie in [0, T={T}) and excludes bounded_replay=True")
        tail_start = max(0, T - self.config.sliding_window) if bounded_replay else (replay_from or 0)
        live = None if image_mask is None else ~image_mask
        rows = self.engram_hash(input_ids, live) if self.engram_hash is not None else None
        ropes = self._rope_tables(T, input_ids.device)
        x = self.embed(input_ids)
        if image_embeds is not None:
            if image_mask is None or tuple(image_embeds.shape) != tuple(x.shape):
                raise ValueError(f"image_embeds must be [T, H] = {tuple(x.shape)} and come with an image_mask")
            x = torch.where(image_mask[:, None], image_embeds.to(x.dtype), x)
        streams = x[:, None, :].expand(T, hc, -1).contiguous()  # [T, hc, H]
        pre = torch.zeros(T, hc, dtype=torch.float32, device=input_ids.device)
        pre[:, 0] = 1.0  # the first attention reads stream 0
        shared = SharedState()
        cut = self.last_kv_source if tail_start else None
        for i, layer in enumerate(self.layers):
            if i - 1 == cut:  # from here on only the tail is computed
                tail = slice(tail_start, T)
                streams, pre = streams[tail], pre[tail]
                image_mask = None if image_mask is None else image_mask[tail]
                live = None if live is None else live[tail]
                rows = None if rows is None else rows[tail]
                ropes = {k: RopeTables((r.tokens[0][tail], r.tokens[1][tail]), r.entries, r.positions[tail])
                         for k, r in ropes.items()}
                shared.selection = None if shared.selection is None else shared.selection[tail]
                shared.candidates = None if shared.candidates is None else shared.candidates[tail]
            if layer.engram is not None:
                streams = layer.engram(streams, rows[:, layer.engram.slot], live)
            flavour = "compress" if self.config.compress_ratios[i] else "main"
            streams, pre = layer(streams, pre, ropes[flavour], shared, image_mask)
        hidden = self.norm((pre[..., None] * streams).sum(dim=1).to(streams.dtype))
        return F.linear(hidden, self.head.weight).float()

    # ------------------------------------------------------------------ the paged engine (engine.engine.Engine)

    def prepare_for_inference(self) -> None:
        """Once after loading: hand each MoE's experts to its backend."""
        for layer in list(self.layers) + list(self.mtp or []):
            layer.ffn.backend.prepare(layer.ffn.experts)
            layer.ffn._prepared_ptr = layer.ffn.experts[0].w1.weight.data_ptr()

    def build_attention_metadata(self, batch, cache):
        """The step's `AttentionMetadata` (V4's builder over `layer_specs`; the model runner builds it once)."""
        from deepinfer.engine.attention.base import build_attention_metadata

        rope_fns = {"main": lambda p: self._rope("main", p), "compress": lambda p: self._rope("compress", p)}
        static = (cache.max_blocks_per_seq, cache.dummy_block) if self.uses_static_decode(cache) else None
        return build_attention_metadata(batch, self.layer_specs, rope_fns, cache.block_size, static_decode=static)

    def uses_static_decode(self, cache) -> bool:
        """Whether this model's steps over `cache` get static decode rows (`static_decode`)."""
        return (self.static_decode and getattr(self.backend, "cuda_graph_safe", False)
                and getattr(cache, "dummy_block", None) is not None)

    def _engram_rows_paged(self, batch, cache, image_mask: torch.Tensor | None = None, meta=None) -> torch.Tensor:
        """Engram row ids [T, L, cols] of the step's new tokens, each request's history read from (and its newest
        tokens written to) its slot's `engram_tokens` ring. History before the slot's `state_start` (or before
        position 0) counts as no token: exact for positions whose `max_ngram - 1` predecessors were computed in
        this life (a replay covers them: `exact_replay_tokens`). Image positions (`image_mask` [T]) are dead tokens
        (-1 in the ring: the n-grams through them latch to the pad). Static decode rows of `meta`
        (`DecodeRows.is_static`) read and write the ring on the device (`deepseek_v41_static.engram_grams_static`)."""
        ring = cache.tensors["engram_tokens"][0]  # [slots, m1]
        m1 = ring.shape[-1]
        ids = batch.input_ids if image_mask is None else batch.input_ids.masked_fill(image_mask, -1)
        dm = None if meta is None else meta.decode
        if dm is not None and dm.is_static:
            dgrams = engram_grams_static(dm, ids[dm.rows], ring)
            if meta.is_pure_decode:  # every row a decode row, in order
                return self.engram_hash.hash_grams(dgrams)
            grams_t = dgrams.new_empty(batch.num_tokens, m1 + 1)
            grams_t[dm.rows] = dgrams
            decode_ids = set(dm.seq_ids)
            for i, s in enumerate(batch.seqs):
                if i not in decode_ids:
                    a, n = batch.starts[i], s.num_new_tokens
                    grams_t[a:a + n] = self._engram_grams_chunk(s, ids[a:a + n], ring)
            return self.engram_hash.hash_grams(grams_t)
        grams = [self._engram_grams_chunk(s, ids[a:a + s.num_new_tokens], ring) for a, s in zip(batch.starts,
                                                                                                   batch.seqs)]
        return self.engram_hash.hash_grams(torch.cat(grams))

    @staticmethod
    def _engram_grams_chunk(s, ids: torch.Tensor, ring: torch.Tensor) -> torch.Tensor:
        """One request's grams [n, m1 + 1] (tokens at t, t-1, .., t-m1) of its new tokens ids [n], from its host ints
        (`SeqChunk` s); its ring updated (the host-decided path, and a prefill chunk beside static decode rows)."""
        m1, n, p0 = ring.shape[-1], s.num_new_tokens, s.num_computed_tokens
        hp = torch.arange(p0 - m1, p0, device=ids.device)
        hist = torch.where(hp >= s.state_start, ring[s.slot, hp % m1], -1)
        ext = torch.cat([hist, ids])  # positions p0 - m1 .. p0 + n - 1
        ring[s.slot, torch.arange(p0 + n - m1, p0 + n, device=ids.device) % m1] = ext[-m1:]
        return torch.stack([ext[m1 - k:m1 - k + n] for k in range(m1 + 1)], dim=-1)  # [n, m1 + 1]

    @_in_numerics
    def forward(self, batch, cache, meta=None, return_streams: bool = False):
        """The paged step: hidden [T, H] of the flat batch (`engine.forward_batch.ForwardBatch`) over `cache`
        (`engine.cache.v41.V41KVCache`), updated in place. `meta`: the step's metadata (else the batch's, else
        built here). Image positions (`batch.input_embeds` / `embeds_mask`, the model runner's rows of the vision
        tower's spans) take those rows as input, route with `bias_vl` and get no Engram n-gram.

        `return_streams` (speculative decoding's interface; needs DSpark stages): `(hidden, features)`, features
        [T, n_targets * H] the DSpark drafter's input: each `dspark_target_layer_ids` layer's input streams (after
        its Engram) averaged over `hc`, concatenated; zeros in rows decoder replay left out."""
        if meta is None:
            meta = batch.attn_metadata if batch.attn_metadata is not None else self.build_attention_metadata(batch,
                                                                                                             cache)
        T, hc = batch.num_tokens, self.config.hc_mult
        if (meta.decode is not None and not meta.decode.is_static and batch.input_ids.is_cuda
                and torch.cuda.is_current_stream_capturing()):
            raise RuntimeError("host-decided decode rows cannot be captured in a CUDA graph (their host ints would be "
                               "baked in): set `static_decode` (the ModelRunner does when it runs graphs)")
        image_mask = batch.embeds_mask if batch.input_embeds is not None else None  # [T] bool
        live = None if image_mask is None else ~image_mask
        tail = self._decoder_tail(batch, cache) if self.decoder_replay else None
        rows = self._engram_rows_paged(batch, cache, image_mask, meta) if self.engram_hash is not None else None
        x = self.embed(batch.input_ids)
        if image_mask is not None:
            x = torch.where(image_mask[:, None], batch.input_embeds.to(x.dtype), x)
        streams = x[:, None, :].expand(T, hc, -1).contiguous()  # [T, hc, H]
        pre = torch.zeros(T, hc, dtype=torch.float32, device=streams.device)
        pre[:, 0] = 1.0  # the first attention reads stream 0
        self.backend.reset()
        if return_streams and not self.dspark_targets:
            raise ValueError("return_streams: the DSpark drafter's features need DSpark stages (`mtp.*`)")
        features = [None] * len(self.dspark_targets)
        for i, layer in enumerate(self.layers):
            if tail is not None and i == self.last_kv_source + 1:  # decoder-side bounded replay: the tail only
                keep, tail_batch, tail_meta = tail
                if tail_batch is None:  # no row of the step reaches a prompt's tail: no logits are asked of it
                    zeros = streams.new_zeros(T, streams.shape[-1])
                    if not return_streams:
                        return zeros
                    return zeros, torch.cat([zeros if f is None else f for f in features], dim=-1)
                self._remap_published(meta, tail_batch, tail_meta, keep, T)
                streams, pre, meta = streams[keep], pre[keep], tail_meta
                rows = None if rows is None else rows[keep]
                image_mask = None if image_mask is None else image_mask[keep]
                live = None if live is None else live[keep]
            if layer.engram is not None:
                streams = layer.engram(streams, rows[:, layer.engram.slot], live)
            if return_streams and i in self.dspark_targets:  # DSpark reads the target layers' input streams
                f = streams.mean(dim=1)  # [T or the tail's T', H]
                if f.shape[0] != T:  # after the decoder-replay cut: rows left out stay zero
                    f = f.new_zeros(T, f.shape[-1]).index_copy_(0, tail[0], f)
                features[self.dspark_targets[i]] = f
            streams, pre = layer.mix(streams, pre, lambda x, i=i, layer=layer, meta=meta: self.backend(
                layer.attn, i, x, meta, cache), image_mask)
        hidden = self.norm((pre[..., None] * streams).sum(dim=1).to(streams.dtype))
        if tail is not None:
            out = hidden.new_zeros(T, hidden.shape[-1])  # rows the tail left out: zeros (no logits are asked of them)
            out[tail[0]] = hidden
            hidden = out
        return (hidden, torch.cat(features, dim=-1)) if return_streams else hidden

    def decoder_tail_start(self, num_prompt_tokens: int | None) -> int:
        """First position the layers after `last_kv_source` compute for a prompt of `num_prompt_tokens` with
        decoder-side bounded replay on: the prompt's last `sliding_window` tokens and everything after them
        (0: every position; also for an unknown prompt, None). A continuation (prompt + k generated tokens after
        a migration or a decode restart) passes its original prompt's length (`Request.num_original_prompt_tokens`
        -> `SeqChunk.num_prompt_tokens`), so its tail starts where the uninterrupted request's did."""
        if num_prompt_tokens is None:
            return 0
        return max(0, num_prompt_tokens - self.config.sliding_window)

    def _decoder_tail(self, batch, cache):
        """The step's rows for the layers after the last KV source under decoder-side bounded replay: None when
        they are every row with unchanged metadata, else `(keep, tail_batch, tail_meta)`: flat rows [T'] kept,
        the `ForwardBatch` of those rows and its `AttentionMetadata` (`tail_batch` None: no row kept).

        A request's tokens before `decoder_tail_start(num_prompt_tokens)` leave; its window history there counts as
        none (`state_start` raised to the tail's start: those layers' rings never held those positions). Rows from
        the tail's start on are computed in every layer, whatever the chunking (a chunk straddling the start is
        cut), prefix hits, preemption or a continuation (the start depends on the original prompt only), and the
        rings of these layers hold the last `sliding_window` positions a decode reads.
        NOTE: the layers after the last KV source run no compressor, so the kept rows need nothing of the left-out
        ones but the selections already published (`_remap_published`)."""
        if self.last_kv_source < 0 or self.last_kv_source == len(self.layers) - 1:
            return None
        from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk

        W = self.config.sliding_window
        changed, keep, seqs = False, [], []
        for a, s in zip(batch.starts, batch.seqs):
            ts = self.decoder_tail_start(s.num_prompt_tokens)
            p0, n = s.num_computed_tokens, s.num_new_tokens
            # NOTE: a row at p0 whose window reaches before ts (p0 - W + 1 < ts) reads ring rows never written
            if ts > s.state_start and p0 - W + 1 < ts:
                changed = True
            b = max(p0, ts)
            if b >= p0 + n:
                continue
            keep.extend(range(a + b - p0, a + n))
            seqs.append(SeqChunk(s.slot, s.block_table, b, p0 + n - b, max(s.state_start, ts), s.num_frozen_tokens,
                                 s.num_prompt_tokens))
        if not changed:
            return None
        keep_t = torch.tensor(keep, dtype=torch.long, device=batch.input_ids.device)
        if not seqs:
            return keep_t, None, None
        tail_batch = ForwardBatch(input_ids=batch.input_ids[keep_t], seqs=seqs)
        return keep_t, tail_batch, self.build_attention_metadata(tail_batch, cache)

    def _remap_published(self, meta, tail_batch, tail_meta, keep: torch.Tensor, T: int) -> None:
        """Re-key the selections (and candidate masks) published before the cut from `meta`'s groups to
        `tail_meta`'s: row by row (a query's mask over entries 0.. does not depend on its group), each group's
        width that of its own entries (decode rows: the most visible to any of them; a chunk: up to its end)."""
        cfg = self.config
        cut = self.last_kv_source
        sources = [i for i in cfg.index_source_layer_ids if i <= cut]
        ratios = {"selection": cfg.compress_ratios[max(sources)] if sources else 0,
                  "candidates": cfg.compress_ratios[cfg.candidate_source_layer_id]
                  if 0 <= cfg.candidate_source_layer_id <= cut else 0}
        for which, store in (("selection", self.backend.selection), ("candidates", self.backend.candidates)):
            r = ratios[which]
            live = {k: v for k, v in store.items() if v is not None}
            store.clear()
            if not r:
                continue
            groups = []
            if tail_meta.decode is not None:
                groups.append(("decode", tail_meta.decode.rows,
                               max((tail_batch.seqs[i].num_computed_tokens + 1) // r for i in tail_meta.decode.seq_ids)))
            groups += [(ci, ch.rows, (ch.num_computed_tokens + ch.num_tokens) // r)
                       for ci, ch in enumerate(tail_meta.prefill)]
            width = max([v.shape[1] for v in live.values()] + [c for _, _, c in groups] + [0])
            flat = torch.zeros(T, width, dtype=torch.bool, device=keep.device)
            for k, v in live.items():
                flat[meta.decode.rows if k == "decode" else meta.prefill[k].rows, : v.shape[1]] = v
            flat = flat[keep]
            for key, rows, c in groups:
                store[key] = flat[rows, :c] if c else None

    @_in_numerics
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] -> float32 logits [n, vocab]."""
        return F.linear(hidden, self.head.weight).float()

    @torch.inference_mode()
    def step(self, batch, cache, meta=None) -> torch.Tensor:
        """`forward` + logits at `batch.logits_indices` (float32 [num_logits, vocab])."""
        hidden = self.forward(batch, cache, meta)
        if batch.logits_indices is not None:
            hidden = hidden[batch.logits_indices]
        return self.compute_logits(hidden)



# --------------------------------------------------------------------------- the published layout

PUBLISHED_FP8_BLOCK = (32, 32)
"""V4.1's FP8 scale block (rows, columns): one UE8M0 scale per 32 x 32 weights."""

_FP8_MODULES = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "attn.indexer.wq_b", "engram.wkv",
                "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3", "mtp.0.main_proj")


def published_storage(name: str) -> str:
    """How the published checkpoint stores parameter `name` (docs/V4_1.md §7, §10).

    "fp8": e4m3 + UE8M0 per 32x32 block; "fp8_rows": the Engram table, e4m3 + UE8M0 per 1x32 run of a row;
    "fp4": routed experts, e2m1 packed two per byte + UE8M0 per 1x32; "fp32": mHC, sinks, router biases;
    "bf16": the rest (norms, compressors, indexer `wk` / `weights_proj`, `wo_a`, embed, head, router weight).
    NOTE: `attn.wo_a` is BF16 as the reference holds it at run time; whether the release stores it as FP8
    that `convert.py` dequantizes is unverified.
    """
    module = name.removesuffix(".weight")
    if name.endswith("engram.embed.weight"):
        return "fp8_rows"
    if ".ffn.experts." in name:
        return "fp4"
    if name.endswith(".weight") and module.endswith(_FP8_MODULES):
        return "fp8"
    if ".hc_" in name or name.endswith(("attn_sink", "gate.bias", "gate.bias_vl")):
        return "fp32"
    return "bf16"


def published_tensors(model: DeepseekV41ForCausalLM) -> dict[str, torch.Tensor]:
    """The model's parameters in V4.1's published layout (`published_storage`; scales as `<module>.scale`)."""
    from deepinfer.engine.quant.formats import quantize_fp4, quantize_fp8_block

    out: dict[str, torch.Tensor] = {}
    state = model.state_dict()
    for name, p in state.items():
        kind, scale_name = published_storage(name), name.removesuffix(".weight") + ".scale"
        if name.endswith(".scale"):
            continue  # a kept FP8 linear's scale: written with its weight
        if kind in ("fp8", "fp8_rows", "fp4") and scale_name in state:  # kept quantized (FP8 linear, table, expert)
            out[name], out[scale_name] = p.detach().clone(), state[scale_name].detach().clone()
            continue
        w = p.detach().float()
        if kind == "fp8":
            out[name], out[scale_name] = quantize_fp8_block(w, PUBLISHED_FP8_BLOCK)
        elif kind == "fp8_rows":
            out[name], out[scale_name] = quantize_fp8_block(w, (1, 32))
        elif kind == "fp4":
            out[name], out[scale_name] = quantize_fp4(w, 32)
        else:
            out[name] = w if kind == "fp32" else w.to(torch.bfloat16)
    return out


def dequantized_at_load(name: str) -> bool:
    """Whether the engine's loader (`load_for_engine`) holds checkpoint tensor `name` dequantized: none now (the
    dense FP8 linears, the FP4 routed experts and the FP8 Engram tables are held as stored, scales included). What
    `engine.fit` counts; `load_published()` without the `keep_*` flags is the dequantizing reader (tests)."""
    del name
    return False


def kept_float32(name: str) -> bool:
    """Whether the engine's loader keeps float parameter `name` in float32 whatever the engine dtype: the published
    FP32 set (mHC, sinks, router biases), the norms and the compressors (`load_for_engine`; `engine.fit` counts it)."""
    return (published_storage(name) == "fp32" or name.endswith("norm.weight") or ".compressor." in name
            or (name.startswith("vision.") and ".norm" in name))


def cast_for_engine(model: nn.Module, dtype: torch.dtype, device: torch.device | str | None = None,
                    skip: set[int] | frozenset[int] = frozenset()) -> nn.Module:
    """Cast `model`'s float parameters to `dtype` as the engine's loader does: those `kept_float32` stay float32
    (the compressors compute in float32 and need their weights so); parameters whose id is in `skip` are left."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in skip or not p.is_floating_point():
                continue
            p.data = p.data.to(device=device, dtype=torch.float32 if kept_float32(name) else dtype)
    return model


def keep_fp8_linears(model: DeepseekV41ForCausalLM, scale_dtype: torch.dtype = torch.float8_e8m0fnu) -> list[str]:
    """Replace every linear the checkpoint stores as 32x32-block FP8 (`published_storage` "fp8": `wq_a`, `wq_b`,
    `wkv`, `wo_b`, the indexer's `wq_b`, Engram's `wkv`, the shared experts) by an `engine.quant.Fp8Linear`
    (block `PUBLISHED_FP8_BLOCK`, zero weights until loaded): the same `.weight` / `.scale` names as the
    checkpoint, kept FP8 in memory, computed by the `"fp8_gemm"` op (the exact per-block dequantizing torch
    reference on the CPU, the Triton kernel on CUDA). Returns the replaced modules' names."""
    from deepinfer.engine.quant.linear import Fp8Linear

    done = []
    for name, mod in list(model.named_modules()):
        if type(mod) is not nn.Linear or published_storage(name + ".weight") != "fp8":
            continue
        parent, _, child = name.rpartition(".")
        fp8 = Fp8Linear(mod.in_features, mod.out_features, PUBLISHED_FP8_BLOCK, scale_dtype, device=mod.weight.device)
        setattr(model.get_submodule(parent), child, fp8)
        done.append(name)
    return done


def load_published(path, moe_backend: str = "torch", *, keep_fp8: bool = False, keep_fp4: bool = False,
                   keep_engram: bool = False) -> DeepseekV41ForCausalLM:
    """A V4.1 checkpoint in the published layout -> the float32 model (quantized tensors dequantized exactly),
    except what the `keep_*` flags keep as stored (what the engine loads: all three):

    * `keep_fp8`: the dense FP8 linears stay FP8 with their 32x32 UE8M0 scales (`keep_fp8_linears`);
    * `keep_fp4`: the routed experts stay MXFP4 (`engine.quant.v41.keep_fp4_experts`: `Fp4Linear`);
    * `keep_engram`: the Engram tables stay FP8 with their 1x32 scales as lazy memory maps of the shards, never read
      here (`keep_engram_tables`: `Fp8EngramTable`, placed later by `load_for_engine`).

    Every other tensor is read on the CPU. Refuses, naming them, tensors the model does not have and parameters the
    checkpoint lacks. The vision tower's tensors (`vision.*`, `aligner.*`, `image_*`: BF16) load with a
    `vision_config`; the DSpark stages' (`mtp.*`, `engine.models.dspark`) with DSpark stages in the config.
    """
    import json
    from pathlib import Path

    from safetensors import safe_open

    from deepinfer.engine.quant.formats import dequant_fp4, dequant_fp8_block
    from deepinfer.engine.quant.v41 import is_engram_table_tensor, keep_engram_tables, keep_fp4_experts, mapped_tensors

    path = Path(path)
    model = DeepseekV41ForCausalLM(V41Config.from_json_file(path), moe_backend=moe_backend)
    index = path / "model.safetensors.index.json"
    files = (sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()}) if index.is_file()
             else [path / "model.safetensors"])
    stored: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            # NOTE: kept Engram tables (~94 GiB a layer in Flash) are mapped below, never read here
            stored.update({k: f.get_tensor(k) for k in f.keys() if not (keep_engram and is_engram_table_tensor(k))})
    kept: set[str] = set()
    if keep_fp8:
        scale_dtypes = {t.dtype for n, t in stored.items()
                        if n.endswith(".scale") and published_storage(n.removesuffix(".scale") + ".weight") == "fp8"}
        if len(scale_dtypes) > 1:
            raise ValueError(f"{path}: the FP8 linears' scales mix dtypes {sorted(map(str, scale_dtypes))}")
        kept |= {f"{m}.{t}" for m in keep_fp8_linears(model, *scale_dtypes) for t in ("weight", "scale")}
    if keep_fp4:
        kept |= {f"{m}.{t}" for m in keep_fp4_experts(model) for t in ("weight", "scale")}
    if keep_engram:
        tables = {f"{m}.{t}" for m in keep_engram_tables(model) for t in ("weight", "scale")}
        stored.update(mapped_tensors(files, tables))
        kept |= tables
    state = model.state_dict()
    scales = {n.removesuffix(".weight") + ".scale" for n in state}
    unexpected = sorted(n for n in stored if n not in state and n not in scales)
    missing = sorted(n for n in state if n not in stored)
    if unexpected or missing:
        raise ValueError(f"{path}: not a checkpoint of this V4.1 config: unexpected {unexpected[:8]}, missing "
                         f"{missing[:8]}")
    loaded = {}
    for name in state:
        if name in kept:  # a kept FP8 linear's, FP4 expert's or FP8 Engram table's weight or scale: as stored
            if stored[name].shape != state[name].shape or stored[name].dtype != state[name].dtype:
                raise ValueError(f"{path}: {name} is {stored[name].dtype} {list(stored[name].shape)}, the kept "
                                 f"quantized module holds {state[name].dtype} {list(state[name].shape)}")
            loaded[name] = stored[name]
            continue
        t, kind = stored[name], published_storage(name)
        scale = stored.get(name.removesuffix(".weight") + ".scale")
        if kind in ("fp8", "fp8_rows", "fp4") and scale is None:
            raise ValueError(f"{path}: {name} is stored {kind} but has no scale tensor")
        if kind == "fp8":
            t = dequant_fp8_block(t, scale, PUBLISHED_FP8_BLOCK)
        elif kind == "fp8_rows":
            t = dequant_fp8_block(t, scale, (1, 32))
        elif kind == "fp4":
            t = dequant_fp4(t, scale, 32)
        if tuple(t.shape) != tuple(state[name].shape):
            raise ValueError(f"{path}: {name} has shape {list(t.shape)}, the config gives {list(state[name].shape)}")
        loaded[name] = t.float()
    # NOTE: assign: kept tensors are installed as they are (a mapped table stays a mapping; meta placeholders go)
    model.load_state_dict(loaded, assign=True)
    return model


ENGRAM_TOKEN_MAP_FILE = "engram_token_map.json"
"""An optional file beside config.json: the Engram compressed-id map as a JSON list (one int per token id). Tiny
test checkpoints ship their random map in it; without it the map is built from the checkpoint's tokenizer."""


def engram_token_map_for(path, config: V41Config) -> list[int]:
    """The Engram compressed-id map of checkpoint `path`: `ENGRAM_TOKEN_MAP_FILE` when present, else
    `compressed_token_map` of its tokenizer (whose count must equal `engram_compressed_vocab_size`). Ids past
    the tokenizer's vocabulary (the model's padding rows) map to the pad token's compressed id."""
    import json
    from pathlib import Path

    file = Path(path) / ENGRAM_TOKEN_MAP_FILE
    if file.is_file():
        token_map = [int(v) for v in json.loads(file.read_text())]
    else:
        from deepinfer.engine.tokenizer import load_tokenizer

        token_map, count = compressed_token_map(load_tokenizer(path))
        if count != config.engram_compressed_vocab_size:
            raise ValueError(f"{path}: the tokenizer's normalised vocabulary has {count} ids, config.json's "
                             f"`engram_compressed_vocab_size` is {config.engram_compressed_vocab_size}: the Engram hashes "
                             f"need the checkpoint's own tokenizer (or an {ENGRAM_TOKEN_MAP_FILE}).")
    if len(token_map) < config.vocab_size:
        token_map = token_map + [token_map[config.engram_pad_token_id]] * (config.vocab_size - len(token_map))
    return token_map[: config.vocab_size]


def load_for_engine(path, config: V41Config, dtype: torch.dtype, device, moe_backend: str = "torch",
                    engram_placement: str = "device"):
    """The paged engine's V4.1 model (`engine.loader.load_checkpoint`): `load_published` with every quantized tensor
    kept as stored (the dense FP8 linears with their 32x32 scales, the MXFP4 routed experts, the FP8 Engram tables
    as lazy maps of the shards), the Engram token map (`engram_token_map_for`), float weights cast to `dtype`
    except the float32-kept ones (mHC, sinks, router biases, norms, the compressors), moved to `device`, the Engram
    tables placed by `engram_placement` ("device" or "pinned_host": `Fp8EngramTable.place`; `engine.fit` decides it)
    with their rows dequantized to `dtype`, MoE backends prepared."""
    from deepinfer.engine.quant.engram import Fp8EngramTable
    from deepinfer.engine.quant.linear import Fp4Linear, Fp8Linear

    if engram_placement not in ("device", "pinned_host"):
        raise ValueError(f"engram_placement must be 'device' or 'pinned_host' here (engine.fit resolves 'auto'), got "
                         f"{engram_placement!r}")
    model = load_published(path, moe_backend=moe_backend, keep_fp8=True, keep_fp4=True, keep_engram=True)
    if config.engram_layer_ids:
        model.set_engram_token_map(engram_token_map_for(path, config))
    quantized = {id(p) for m in model.modules() if isinstance(m, (Fp8Linear, Fp4Linear, Fp8EngramTable))
                 for p in m.parameters()}
    cast_for_engine(model, dtype, device, skip=quantized)  # quantized: stay as stored (`place` moves the tables)
    model.to(device)
    for table in (m for m in model.modules() if isinstance(m, Fp8EngramTable)):
        table.out_dtype = dtype
        table.place(engram_placement, device)
    model.eval().requires_grad_(False)
    model.prepare_for_inference()
    return model


def compressed_kv_bytes_per_token(config: V41Config) -> float:
    """Bytes per token of V4.1's compressed KV as the reference stores it (docs/V4_1.md §4): only KV sources
    own entries, one per `ratio` tokens, each an FP4 latent with an E4M3 scale per 16 values plus an FP4
    index key with a UE8M0 scale per 32 values. DeepSeek-V4.1-Flash: 890 bytes per token.
    NOTE: inferred from the reference's quantization calls, not from a cache layout of ours: the paged engine's
    pools (`engine.cache.v41`) hold entries and index keys unquantized, in the cache dtype
    (`V41CacheLayout.compressed_bytes_per_token`: 3200 B/token for Flash in BF16)."""
    entry = config.head_dim // 2 + config.head_dim // 16 + config.index_head_dim // 2 + config.index_head_dim // 32
    return sum(entry / config.compress_ratios[s] for s in config.kv_source_layer_ids)
