"""Test-only reference of DeepSeek-V4.1's DSpark draft stages, written by us from reading DeepSeek's official
`inference/model.py` (huggingface.co/deepseek-ai/DeepSeek-V4.1-Flash, revision
dba1be0a40aa45a94ad051997016db3960a90277: `DSparkAttention`, `DSparkMarkovHead`, `DSparkConfidenceHead`,
`DSparkBlock`, `Transformer.forward` / `forward_spec`; docs/V4_1.md §9 cites it), following its structure step by
step: batch-major tensors [B, L, ...], complex RoPE, a per-stage window ring of `sliding_window` slots filled by
the prefill (`start_pos == 0`: seeding only, no drafts) and one slot per decode step, the ring + block index list
into `sparse_attn`, the sequential Markov-biased greedy sampling of the block. Float32, no FP8 simulation.

The backbone part (`forward_hidden`) is `reference.Reference.forward` with the target layers' input streams
averaged over `hc` (after their Engram) collected, as the official `Transformer.forward` returns `main_hidden`.
It reads the weights of an `engine.models.deepseek_v41` model by their checkpoint names (`mtp.{s}.*`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.engine.v41.reference import Reference, freqs_cis, hash_rows, rmsnorm, rotate, sparse_attn


class DSparkReference(Reference):
    """`Reference` plus the DSpark stages of `inference/model.py` (one request batch, its own window rings)."""

    def __init__(self, cfg, state_dict, token_map=None, max_seq_len: int = 256):
        super().__init__(cfg, state_dict, token_map)
        self.S = cfg.num_nextn_predict_layers
        self.fc = freqs_cis(cfg.qk_rope_head_dim, max_seq_len, 0, cfg.rope_main.rope_theta, 1.0, 32, 1)
        self.rings: list[torch.Tensor] | None = None

    # -- the backbone with main_hidden

    def forward_hidden(self, input_ids):
        """input_ids [B, S] -> (logits [B, S, V], main_hidden [B, S, n_targets * H])."""
        cfg = self.cfg
        rows = hash_rows(cfg, self.token_map, input_ids) if cfg.engram_layer_ids else None
        h = F.embedding(input_ids, self.w["embed.weight"]).unsqueeze(2).repeat(1, 1, self.hc, 1)
        pre_mix = torch.zeros(*input_ids.shape, self.hc)
        pre_mix[..., 0] = 1.0
        rt, hiddens = {}, []
        for layer in range(cfg.num_hidden_layers):
            if layer in cfg.engram_layer_ids:
                h = self.engram(layer, h, rows[:, :, cfg.engram_layer_ids.index(layer)], None)
            if layer in cfg.dspark_target_layer_ids:  # the attention input of the target layers, not their output
                hiddens.append(h.mean(dim=2))
            h, pre_mix = self.block(layer, h, pre_mix, None, rt)
        h = (pre_mix.unsqueeze(-1) * h).sum(dim=2)
        logits = rmsnorm(h, self.w["norm.weight"], self.eps) @ self.w["head.weight"].T
        return logits, torch.cat(hiddens, dim=-1)

    # -- one stage

    def stage_attention(self, s, x, start_pos, main_x):
        cfg, p = self.cfg, f"mtp.{s}.attn."
        win, NH, D = cfg.sliding_window, cfg.num_attention_heads, cfg.head_dim
        bsz, seqlen, _ = main_x.shape
        main_kv = rmsnorm(self.linear(main_x, p + "wkv.weight"), self.w[p + "kv_norm.weight"], self.eps)
        main_kv = rotate(main_kv, self.fc[start_pos:start_pos + seqlen])
        ring = self.rings[s]
        if start_pos == 0:  # prefill only seeds the ring
            if seqlen <= win:
                ring[:, :seqlen] = main_kv
            else:
                cut = seqlen % win
                ring[:, cut:win], ring[:, :cut] = main_kv[:, -win:].split([win - cut, cut], dim=1)
            return x
        blk = x.shape[1]
        fcb = self.fc[start_pos + seqlen:start_pos + seqlen + blk]
        qr = rmsnorm(self.linear(x, p + "wq_a.weight"), self.w[p + "q_norm.weight"], self.eps)
        q = rotate(self.linear(qr, p + "wq_b.weight").unflatten(-1, (NH, D)), fcb)
        kv = rotate(rmsnorm(self.linear(x, p + "wkv.weight"), self.w[p + "kv_norm.weight"], self.eps), fcb)
        idxs = torch.cat([torch.arange(min(win, start_pos + 1)), win + torch.arange(blk)])
        idxs = idxs.view(1, 1, -1).expand(bsz, blk, -1)
        ring[:, start_pos % win] = main_kv.squeeze(1)
        o = sparse_attn(q, torch.cat([ring, kv], dim=1), self.w[p + "attn_sink"], idxs, D**-0.5)
        o = rotate(o, fcb, inverse=True)
        G = cfg.o_groups
        o = o.reshape(bsz, blk, G, -1)
        wo_a = self.w[p + "wo_a.weight"].view(G, cfg.o_lora_rank, -1)
        return self.linear(torch.einsum("bsgd,grd->bsgr", o, wo_a).flatten(2), p + "wo_b.weight")

    def stage_moe(self, s, x):
        cfg, p = self.cfg, f"mtp.{s}.ffn."
        E = cfg.dspark_n_routed_experts or cfg.n_routed_experts
        k = cfg.dspark_num_experts_per_tok or cfg.num_experts_per_tok
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores = {"softmax": lambda t: t.softmax(-1), "sigmoid": torch.sigmoid,
                  "sqrtsoftplus": lambda t: F.softplus(t).sqrt()}[cfg.scoring_func](self.linear(x, p + "gate.weight"))
        idx = (scores + self.w[p + "gate.bias"]).topk(k, dim=-1)[1]
        wts = scores.gather(1, idx)
        if cfg.norm_topk_prob and k > 1:
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        wts = wts * cfg.routed_scaling_factor
        y = torch.zeros_like(x)
        for e in range(E):
            rows, slot = torch.where(idx == e)
            if len(rows):
                y[rows] += self.expert(f"{p}experts.{e}.", x[rows], wts[rows, slot, None])
        return (y + self.expert(p + "shared_experts.", x)).view(shape)

    def stage_mixes(self, s, which, x):
        from tests.engine.v41.reference import sinkhorn_split

        p = f"mtp.{s}.hc_{which}_"
        flat = x.flatten(2)
        rs = torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.eps)
        return sinkhorn_split(F.linear(flat, self.w[p + "fn"]) * rs, self.w[p + "scale"], self.w[p + "base"], self.hc,
                              self.cfg.hc_sinkhorn_iters, self.cfg.hc_eps)

    def stage_block(self, s, x, start_pos, pre_mix, main_x):
        if start_pos == 0:
            self.stage_attention(s, x, start_pos, main_x)
            return x, pre_mix

        def pre(x, mix):
            return (mix.unsqueeze(-1) * x).sum(dim=2)

        def post(y, res, post_w, comb):
            return post_w.unsqueeze(-1) * y.unsqueeze(-2) + (comb.unsqueeze(-1) * res.unsqueeze(-2)).sum(dim=2)

        q = f"mtp.{s}."
        res = x
        a_pre, a_post, a_comb = self.stage_mixes(s, "attn", x)
        h = rmsnorm(pre(x, pre_mix), self.w[q + "attn_norm.weight"], self.eps)
        x = post(self.stage_attention(s, h, start_pos, main_x), res, a_post, a_comb)
        res = x
        f_pre, f_post, f_comb = self.stage_mixes(s, "ffn", x)
        h = rmsnorm(pre(x, a_pre), self.w[q + "ffn_norm.weight"], self.eps)
        x = post(self.stage_moe(s, h), res, f_post, f_comb)
        return x, f_pre

    # -- forward_spec

    def forward_spec(self, input_ids, main_hidden, start_pos):
        """input_ids [B] (the token after main_hidden's last position), main_hidden [B, L, n_targets * H] (L = the
        prompt at start_pos 0, else 1) -> None at start_pos 0, else (output_ids [B, blk + 1], logits [B, blk, V],
        confidence logits [B, blk])."""
        cfg = self.cfg
        B, blk, last = input_ids.shape[0], cfg.dspark_block_size, f"mtp.{self.S - 1}."
        if self.rings is None:
            self.rings = [torch.zeros(B, cfg.sliding_window, cfg.head_dim) for _ in range(self.S)]
        main_x = rmsnorm(self.linear(main_hidden, "mtp.0.main_proj.weight"), self.w["mtp.0.main_norm.weight"], self.eps)
        ids = torch.full((B, blk), cfg.dspark_noise_token_id, dtype=torch.long)
        ids[:, 0] = input_ids
        h = F.embedding(ids, self.w["embed.weight"]).unsqueeze(2).repeat(1, 1, self.hc, 1)
        pre_mix = torch.zeros(B, blk, self.hc)
        pre_mix[..., 0] = 1.0
        for s in range(self.S):
            h, pre_mix = self.stage_block(s, h, start_pos, pre_mix, main_x)
        if start_pos == 0:
            return None
        x = (pre_mix.unsqueeze(-1) * h).sum(dim=2)
        logits = rmsnorm(x, self.w[last + "norm.weight"], self.eps) @ self.w["head.weight"].T
        out = torch.zeros(B, blk + 1, dtype=torch.long)
        out[:, 0] = input_ids
        embeds = []
        for i in range(blk):
            e = F.embedding(out[:, i], self.w[last + "markov_head.embed.weight"])
            logits[:, i] += e @ self.w[last + "markov_head.head.weight"].T
            embeds.append(e)
            out[:, i + 1] = logits[:, i].argmax(dim=-1)
        conf = torch.cat([x, torch.stack(embeds, dim=1)], dim=-1) @ self.w[last + "confidence_head.proj.weight"].T
        return out, logits, conf.squeeze(-1)
