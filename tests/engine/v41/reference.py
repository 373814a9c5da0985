"""Test-only reference of DeepSeek-V4.1's prefill forward, written by us from reading DeepSeek's official
`inference/model.py` and `inference/engram.py` (huggingface.co/deepseek-ai/DeepSeek-V4.1-Flash, revision
dba1be0a40aa45a94ad051997016db3960a90277; docs/V4_1.md cites them), following their structure step by
step: batch-major tensors [B, L, ...], complex-number RoPE tables, one shared runtime that sources write
and later layers read, index lists (-1 = nothing) into a window-then-compressed KV concatenation, a
Gumbel-free greedy path, and the hash state's latching look-back. Float32, no FP8/FP4 simulation (the
reference's `act_quant` / `fp4_act_quant` calls are skipped). Top-k ties go to the lower entry index
(what CUDA's topk does; see `engine.models.deepseek_v4.topk_mask`).

It reads the weights of an `engine.models.deepseek_v41` model by their checkpoint names, so the two can
be compared on the same random parameters. Nothing here imports engine code but the config.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

# ------------------------------------------------------------------ pieces


def rmsnorm(x, w, eps):
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + eps)
    return y * w.float() if w is not None else y


def freqs_cis(dim, seqlen, original_seq_len, base, factor, beta_fast, beta_slow):
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_seq_len > 0:
        def corr(rot):
            return dim * math.log(original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(base))
        low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        freqs = freqs / factor * ramp + freqs * (1 - ramp)
    return torch.polar(torch.ones(seqlen, dim // 2), torch.outer(torch.arange(seqlen).float(), freqs))


def rotate(x, fc, inverse=False):
    """Rotate the last 2*fc.shape[-1] channels of x [B, S, (H,) d] by fc [S, rd/2] (complex)."""
    rd = fc.shape[-1] * 2
    z = torch.view_as_complex(x[..., -rd:].float().reshape(*x.shape[:-1], -1, 2).contiguous())
    f = fc.conj() if inverse else fc
    f = f.view(1, x.shape[1], *([1] * (x.dim() - 3)), -1)
    out = x.clone()
    out[..., -rd:] = torch.view_as_real(z * f).flatten(-2)
    return out


def sinkhorn_split(mixes, scale, base, hc, iters, eps):
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = comb.softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def sparse_attn(q, kv, sink, idxs, scale):
    """q [B, S, H, D], kv [B, N, D], idxs [B, S, K] (-1: skip) -> [B, S, H, D]."""
    B, S, H, D = q.shape
    out = torch.zeros_like(q)
    for b in range(B):
        for s in range(S):
            sel = idxs[b, s][idxs[b, s] >= 0].long()
            k = kv[b, sel]  # [K, D]
            logit = (q[b, s] @ k.T) * scale  # [H, K]
            full = torch.cat([logit, sink[:, None]], dim=-1).softmax(-1)[:, :-1]
            out[b, s] = full @ k
    return out


# ------------------------------------------------------------------ engram hashing (engram.py)


def hash_rows(cfg, token_map, input_ids, token_mask=None):
    """[B, L, n_layers, cols] as python ints, position by position (the NgramHashState walk)."""
    layers, mx, heads = cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads
    primes = cfg.engram_primes
    bound = max(1, (np.iinfo(np.int64).max // cfg.engram_compressed_vocab_size) // 2)
    mults = [[int(v) * 2 + 1 for v in np.random.default_rng(10007 * lid).integers(0, bound, size=(mx,), dtype=np.int64)]
             for lid in layers]
    pad = int(token_map[cfg.engram_pad_token_id])
    B, L = input_ids.shape
    out = torch.zeros(B, L, len(layers), (mx - 1) * heads, dtype=torch.int64)
    for b in range(B):
        comp = [int(token_map[int(t)]) for t in input_ids[b]]
        if token_mask is not None:
            comp = [c if bool(m) else -1 for c, m in zip(comp, token_mask[b])]
        for t in range(L):
            toks, dead = [], False
            for s in range(mx):
                if t - s < 0 or comp[t - s] < 0:
                    dead = True
                toks.append(pad if dead else comp[t - s])
            for li in range(len(layers)):
                offset, col, rolling = 0, 0, toks[0] * mults[li][0]
                for order in range(mx - 1):
                    rolling ^= toks[order + 1] * mults[li][order + 1]
                    for h in range(heads):
                        out[b, t, li, col] = rolling % primes[li][order][h] + offset
                        offset += primes[li][order][h]
                        col += 1
    return out


# ------------------------------------------------------------------ the model


class Reference:
    """The forward of `inference/model.py`'s `Transformer` for a prefill from position 0."""

    def __init__(self, cfg, state_dict, token_map=None):
        self.cfg, self.w, self.token_map = cfg, {k: v.float() for k, v in state_dict.items()}, token_map
        self.eps, self.hc = cfg.rms_norm_eps, cfg.hc_mult

    def linear(self, x, name):
        return x.float() @ self.w[name].T

    # -- attention pieces

    def compressor(self, p, x, ratio):
        if ratio == 1:
            return rmsnorm(self.linear(x, p + "compressor.wkv.weight"), self.w[p + "compressor.norm.weight"], self.eps)
        B, S, _ = x.shape
        cut = S - S % ratio
        kv = self.linear(x, p + "compressor.wkv.weight")[:, :cut].unflatten(1, (-1, ratio))
        score = self.linear(x, p + "compressor.wgate.weight")[:, :cut].unflatten(1, (-1, ratio))
        return rmsnorm((kv * score.softmax(dim=2)).sum(dim=2), self.w[p + "compressor.norm.weight"], self.eps)

    def candidates(self, logits, lens, topk_blocks, block):
        width = logits.size(-1)
        scores = F.pad(logits, (0, -width % block), value=-torch.inf).unflatten(-1, (-1, block)).amax(-1)
        nb = scores.size(-1)
        last = torch.div(lens - 1, block, rounding_mode="floor")
        scores = scores.masked_fill(torch.arange(nb) == last, torch.inf)
        k = min(topk_blocks, nb)
        top = torch.sort(scores, dim=-1, descending=True, stable=True)  # ties: the lower block (CUDA's topk)
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top.indices[..., :k], top.values[..., :k] > -torch.inf)
        return keep.repeat_interleave(block, dim=-1)[..., :width]

    def indexer(self, layer, x, qr, latent, fc, offset, rt):
        cfg, p = self.cfg, f"layers.{layer}.attn.indexer."
        ratio = cfg.compress_ratios[layer]
        B, S, _ = x.shape
        if layer in cfg.kv_source_layer_ids:
            k = rmsnorm(self.linear(latent, p + "wk.weight"), self.w[p + "k_norm.weight"], self.eps)
            rt["index_k"] = rotate(k, fc[: S - S % ratio: ratio])
        q = self.linear(qr, p + "wq_b.weight").unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim))
        q = rotate(q, fc[:S])
        weights = self.linear(x, p + "weights_proj.weight") * (cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5)
        score = torch.einsum("bshd,btd->bsht", q, rt["index_k"]).relu()
        score = (score * weights.unsqueeze(-1)).sum(dim=2)
        lens = (torch.arange(1, S + 1) // ratio).unsqueeze(-1)
        score = score.masked_fill(torch.arange(S // ratio) >= lens, -torch.inf)
        if layer == cfg.candidate_source_layer_id:
            rt["cand"] = self.candidates(score, lens, cfg.candidate_topk_blocks, cfg.candidate_block_size)
        elif 0 <= cfg.candidate_source_layer_id < layer:
            score = score.masked_fill(~rt["cand"], -torch.inf)
        k = min(cfg.index_topk, S // ratio)
        idxs = torch.sort(score, dim=-1, descending=True, stable=True).indices[..., :k]
        return torch.where(idxs < lens, idxs + offset, -1)

    def attention(self, layer, x, rt):
        cfg, p = self.cfg, f"layers.{layer}.attn."
        ratio, rd, win = cfg.compress_ratios[layer], cfg.qk_rope_head_dim, cfg.sliding_window
        B, S, _ = x.shape
        if ratio:
            rs = cfg.rope_compress
            fc = freqs_cis(rd, S, rs.original_max_position_embeddings if rs.rope_type == "yarn" else 0, rs.rope_theta,
                           rs.factor, rs.beta_fast, rs.beta_slow)
        else:
            fc = freqs_cis(rd, S, 0, cfg.rope_main.rope_theta, 1.0, 32, 1)
        qr = rmsnorm(self.linear(x, p + "wq_a.weight"), self.w[p + "q_norm.weight"], self.eps)
        q = rotate(self.linear(qr, p + "wq_b.weight").unflatten(-1, (cfg.num_attention_heads, cfg.head_dim)), fc)
        kv = rotate(rmsnorm(self.linear(x, p + "wkv.weight"), self.w[p + "kv_norm.weight"], self.eps), fc)
        end = torch.arange(S).unsqueeze(1)
        widx = (end - win + 1).clamp(0) + torch.arange(min(S, win))
        idxs = torch.where(widx > end, -1, widx).unsqueeze(0).expand(B, -1, -1)
        if ratio:
            latent = self.compressor(p, x, ratio) if layer in cfg.kv_source_layer_ids else None
            if layer in cfg.index_source_layer_ids:
                rt["topk"] = self.indexer(layer, x, qr, latent, fc, S, rt)
            if latent is not None:
                rt["kv"] = rotate(latent, fc[: S - S % ratio: ratio])
            kv = torch.cat([kv, rt["kv"][:, : S // ratio]], dim=1)
            idxs = torch.cat([idxs, rt["topk"]], dim=-1)
        o = sparse_attn(q, kv, self.w[p + "attn_sink"], idxs, cfg.head_dim**-0.5)
        o = rotate(o, fc, inverse=True)
        G = cfg.o_groups
        o = o.reshape(B, S, G, -1)
        wo_a = self.w[p + "wo_a.weight"].view(G, cfg.o_lora_rank, -1)
        return self.linear(torch.einsum("bsgd,grd->bsgr", o, wo_a).flatten(2), p + "wo_b.weight")

    # -- moe, engram, blocks

    def expert(self, p, x, weights=None):
        lim = self.cfg.swiglu_limit
        gate, up = self.linear(x, p + "w1.weight"), self.linear(x, p + "w3.weight")
        if lim > 0:
            up, gate = up.clamp(-lim, lim), gate.clamp(max=lim)
        h = F.silu(gate) * up
        return self.linear(h if weights is None else weights * h, p + "w2.weight")

    def moe(self, layer, x, image_mask):
        cfg, p = self.cfg, f"layers.{layer}.ffn."
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.linear(x, p + "gate.weight")
        scores = {"softmax": lambda s: s.softmax(-1), "sigmoid": torch.sigmoid,
                  "sqrtsoftplus": lambda s: F.softplus(s).sqrt()}[cfg.scoring_func](logits)
        bias = self.w[p + "gate.bias"]
        if image_mask is not None and (p + "gate.bias_vl") in self.w:
            bias = torch.where(image_mask.reshape(-1, 1), self.w[p + "gate.bias_vl"], bias)
        idx = (scores + bias).topk(cfg.num_experts_per_tok, dim=-1)[1]
        wts = scores.gather(1, idx)
        if cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        wts = wts * cfg.routed_scaling_factor
        y = torch.zeros_like(x)
        for e in range(cfg.n_routed_experts):
            rows, slot = torch.where(idx == e)
            if len(rows):
                y[rows] += self.expert(f"{p}experts.{e}.", x[rows], wts[rows, slot, None])
        return (y + self.expert(p + "shared_experts.", x)).view(shape)

    def engram(self, layer, h, rows, mask):
        cfg, p = self.cfg, f"layers.{layer}.engram."
        H, hc = cfg.hidden_size, self.hc
        kv = self.linear(F.embedding(rows, self.w[p + "embed.weight"]).flatten(-2), p + "wkv.weight")
        key, value = kv.split([hc * H, H], dim=-1)
        key = key.unflatten(-1, (hc, H))
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * self.w[p + "q_weight"] * self.w[p + "k_weight"] * key).sum(-1) * rstd * H**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        if mask is not None:
            gate = gate.masked_fill(~mask.unsqueeze(-1), 0)
        return h + gate.unsqueeze(-1) * value.unsqueeze(-2)

    def mixes(self, layer, which, x):
        p = f"layers.{layer}.hc_{which}_"
        flat = x.flatten(2)
        rs = torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.eps)
        return sinkhorn_split(F.linear(flat, self.w[p + "fn"]) * rs, self.w[p + "scale"], self.w[p + "base"], self.hc,
                              self.cfg.hc_sinkhorn_iters, self.cfg.hc_eps)

    def block(self, layer, x, pre_mix, image_mask, rt):
        def pre(x, mix):
            return (mix.unsqueeze(-1) * x).sum(dim=2)

        def post(y, res, post_w, comb):
            return post_w.unsqueeze(-1) * y.unsqueeze(-2) + (comb.unsqueeze(-1) * res.unsqueeze(-2)).sum(dim=2)

        res = x
        a_pre, a_post, a_comb = self.mixes(layer, "attn", x)
        h = rmsnorm(pre(x, pre_mix), self.w[f"layers.{layer}.attn_norm.weight"], self.eps)
        x = post(self.attention(layer, h, rt), res, a_post, a_comb)
        res = x
        f_pre, f_post, f_comb = self.mixes(layer, "ffn", x)
        h = rmsnorm(pre(x, a_pre), self.w[f"layers.{layer}.ffn_norm.weight"], self.eps)
        x = post(self.moe(layer, h, image_mask), res, f_post, f_comb)
        return x, f_pre

    def forward(self, input_ids, image_mask=None):
        """input_ids [B, S] -> logits [B, S, vocab] (float32)."""
        cfg = self.cfg
        engram_mask = None if image_mask is None else ~image_mask
        rows = hash_rows(cfg, self.token_map, input_ids, engram_mask) if cfg.engram_layer_ids else None
        h = F.embedding(input_ids, self.w["embed.weight"]).unsqueeze(2).repeat(1, 1, self.hc, 1)
        pre_mix = torch.zeros(*input_ids.shape, self.hc)
        pre_mix[..., 0] = 1.0
        rt = {}
        for layer in range(cfg.num_hidden_layers):
            if layer in cfg.engram_layer_ids:
                slot = cfg.engram_layer_ids.index(layer)
                h = self.engram(layer, h, rows[:, :, slot], engram_mask)
            h, pre_mix = self.block(layer, h, pre_mix, image_mask, rt)
        h = (pre_mix.unsqueeze(-1) * h).sum(dim=2)
        return rmsnorm(h, self.w["norm.weight"], self.eps) @ self.w["head.weight"].T
