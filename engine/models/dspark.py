"""DeepSeek-V4.1's DSpark draft stages (`mtp.{0..S-1}`, docs/V4_1.md §9, §13): modules and the draft forward.

Written from reading DeepSeek's official `inference/model.py` of DeepSeek-V4.1-Flash (its `DSparkBlock`,
`DSparkAttention`, `DSparkMarkovHead`, `DSparkConfidenceHead` and `Transformer.forward_spec`), not copied.

A stage is a V4.1 block (`deepseek_v41.Block`: the delayed-pre mHC, `attn_norm` / `ffn_norm`, a window-only
`Attention` with compress ratio 0, a `MoE` of `dspark_n_routed_experts` top-`dspark_num_experts_per_tok`),
without Engram, sharing `embed` and `head` with the backbone. Stage 0 adds `main_proj` (n_targets * H -> H) and
`main_norm`; the last stage adds `norm`, the Markov head (`markov_head.embed` [V, R], `markov_head.head` [V, R])
and the confidence head (`confidence_head.proj` [1, H + R]).

What one draft computes (`dspark_draft`), per request with last verified position `p` and the token after it
(the anchor, position `p + 1`):

* the drafter's input (`main_x`): the backbone's streams averaged over `hc` at the input of each
  `dspark_target_layer_ids` layer (after its Engram, before its block), concatenated, through stage 0's
  `main_proj` and `main_norm`: one row per verified position;
* each stage's window ring holds `rope(kv_norm(wkv(main_x)))` of the verified positions (its own `wkv`,
  main RoPE flavour: the stages' ratio is 0), the last `sliding_window` of them (`ring_keys`);
* the block `[anchor, noise x (block - 1)]` at positions `p + 1 .. p + block`, embedded and copied to the `hc`
  streams with a one-hot (stream 0) first pre mix, runs through the stages; each stage's attention queries are
  the block's tokens, its keys the stage's ring (positions `p - W + 1 .. p`) and the block's own keys (the whole
  block visible to every block position), one shared K=V, the per-head sink in the denominator
  (`DSparkStage.attend`);
* the last stage collapses the streams with its pre mix (`x`), `logits_i = head(norm(x_i))` plus the Markov
  head's `head(embed(token_i))` for token_i = the anchor then each draft in turn; draft i+1 = argmax of
  `logits_i` (greedy drafts), so a block of `block` positions proposes `block` drafts (positions
  `p + 2 .. p + block + 1`); the confidence logit of draft i+1 is `proj([x_i, markov_embed_i])` (float32).

NOTE: the official prefill (`start_pos == 0`) only seeds the rings and drafts nothing; a decode step writes the
new position's key and drafts. `engine.spec_decode.dspark_drafter` does both in one committed pass (the rings
take every newly verified position, then the block drafts from the last one), which equals the official
decode loop position by position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.engine.config import V41Config
from deepinfer.engine.models.deepseek_v4 import RMSNorm, apply_rope
from deepinfer.engine.models.deepseek_v41 import Attention, Block, MoE


def has_dspark(config: V41Config) -> bool:
    """Whether `config` has DSpark stages to build (the reference builds them only with a block size)."""
    return config.num_nextn_predict_layers > 0 and config.dspark_block_size > 0


class MarkovHead(nn.Module):
    """`markov_head`: a rank-R bigram bias on the draft logits, conditioned on the previous token."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)
        self.head = nn.Linear(rank, vocab_size, bias=False)

    def forward(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids [B] -> (logit bias [B, V] float32, the tokens' embeddings [B, R])."""
        e = self.embed(token_ids)
        return F.linear(e.float(), self.head.weight.float()), e


class ConfidenceHead(nn.Module):
    """`confidence_head`: one acceptance logit per draft from [collapsed hidden, Markov embedding] (float32)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 1, bias=False)

    def forward(self, hidden: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], markov_embed [..., R] -> logits [...] (float32; sigmoid is the confidence)."""
        x = torch.cat([hidden.float(), markov_embed.float()], dim=-1)
        return F.linear(x, self.proj.weight.float()).squeeze(-1)


class DSparkStage(Block):
    """DSpark stage `stage` (checkpoint prefix `mtp.{stage}.`): a V4.1 block with a window-only attention over the
    drafter's ring plus the draft block, and its own MoE width. Stage 0 owns `main_proj` / `main_norm`, the last
    stage `norm`, `markov_head` and `confidence_head`.

    NOTE: builds `Block`'s modules itself (not `Block.__init__`, which would build a backbone-width MoE and an
    Engram lookup); `Block.mix` and `_weights` are reused as they are.
    """

    def __init__(self, config: V41Config, stage: int, moe_backend: str = "torch") -> None:
        nn.Module.__init__(self)
        n, S = config.num_hidden_layers, config.num_nextn_predict_layers
        if not 0 <= stage < S:
            raise ValueError(f"DSpark stage {stage} outside 0 .. {S - 1} (`num_nextn_predict_layers`)")
        if not config.dspark_target_layer_ids:
            raise ValueError("DSpark stages need `dspark_target_layer_ids` (the backbone layers that feed them)")
        H, hc = config.hidden_size, config.hc_mult
        self.stage = stage
        self.hc, self.iters, self.hc_eps, self.eps = hc, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        ratios = tuple(config.compress_ratios) + (0,) * (n + S - len(config.compress_ratios))
        # NOTE: the stages' `compress_ratios` entries are 0 (checked by V41Config) and they are no KV / index source:
        # `Attention` builds neither a compressor nor an indexer for them
        self.attn = Attention(config.model_copy(update={"compress_ratios": ratios}), n + stage)
        self.ffn = MoE(config, config.dspark_n_routed_experts or config.n_routed_experts,
                       config.dspark_num_experts_per_tok or config.num_experts_per_tok, moe_backend)
        self.engram = None
        self.attn_norm = RMSNorm(H, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(H, config.rms_norm_eps)
        m = (2 + hc) * hc
        for which in ("attn", "ffn"):
            self.register_parameter(f"hc_{which}_fn", nn.Parameter(torch.zeros(m, hc * H, dtype=torch.float32)))
            self.register_parameter(f"hc_{which}_base", nn.Parameter(torch.zeros(m, dtype=torch.float32)))
            self.register_parameter(f"hc_{which}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))
        if stage == 0:
            self.main_proj = nn.Linear(H * len(config.dspark_target_layer_ids), H, bias=False)
            self.main_norm = RMSNorm(H, config.rms_norm_eps)
        if stage == S - 1:
            self.norm = RMSNorm(H, config.rms_norm_eps)
            self.markov_head = MarkovHead(config.vocab_size, config.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(H + config.dspark_markov_rank)

    def ring_keys(self, main_x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """This stage's window keys [N, D] of the verified positions' `main_x` [N, H] (rotated at those positions)."""
        return apply_rope(self.attn.kv_norm(self.attn.wkv(main_x)), cos, sin)

    def attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ring: torch.Tensor,
               ring_valid: torch.Tensor) -> torch.Tensor:
        """The block's attention: x [B * blk, H] (after `attn_norm`, block-major), cos/sin [B * blk, rd/2] at the
        block positions, ring [B, W, D] this stage's keys, ring_valid [B, W] -> [B * blk, H]."""
        B, W, D = ring.shape
        if x.shape[0] % max(B, 1) or ring_valid.shape != (B, W):
            raise ValueError(f"x {tuple(x.shape)} is not B={B} blocks, or ring_valid {tuple(ring_valid.shape)} != "
                             f"{(B, W)}")
        blk, NH = x.shape[0] // B, self.attn.num_heads
        _, q, kv = self.attn.project(x, cos, sin)  # [B*blk, NH, D], [B*blk, D] float32
        q = q.view(B, blk, NH, D)
        keys = torch.cat([ring.float(), kv.view(B, blk, D)], dim=1)  # [B, W + blk, D]: K = V
        valid = torch.cat([ring_valid, ring_valid.new_ones(B, blk)], dim=1)
        logits = torch.einsum("bqhd,bkd->bqhk", q, keys) * D**-0.5
        logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
        sink = self.attn.attn_sink.float().view(1, 1, NH, 1).expand(B, blk, NH, 1)
        probs = torch.cat([logits, sink], dim=-1).softmax(dim=-1)[..., :-1]  # the sink joins the denominator
        out = torch.einsum("bqhk,bkd->bqhd", probs, keys).reshape(B * blk, NH, D)
        return self.attn.output(out.to(x.dtype), cos, sin)


def build_dspark_stages(config: V41Config, moe_backend: str = "torch") -> nn.ModuleList:
    """The model's `mtp` module list (`num_nextn_predict_layers` stages)."""
    return nn.ModuleList(DSparkStage(config, s, moe_backend) for s in range(config.num_nextn_predict_layers))


def dspark_main_x(model, features: torch.Tensor) -> torch.Tensor:
    """Stage 0's `main_norm(main_proj(features))`: features [N, n_targets * H] (the backbone's target-layer stream
    means, `DeepseekV41ForCausalLM.forward(return_streams=True)`) -> main_x [N, H]."""
    stage0 = model.mtp[0]
    return stage0.main_norm(stage0.main_proj(features.to(model.embed.weight.dtype)))


@dataclass
class DSparkBlockOutput:
    """One draft block per request."""

    draft_ids: torch.Tensor
    """[B, blk] greedy drafts for positions p + 2 .. p + blk + 1."""
    logits: torch.Tensor
    """[B, blk, V] float32 draft logits (the Markov bias included)."""
    confidence_logits: torch.Tensor
    """[B, blk] float32; `sigmoid` is each draft's confidence."""


def dspark_draft(model, anchors: torch.Tensor, positions: torch.Tensor, rings: list[torch.Tensor],
                 ring_valid: torch.Tensor) -> DSparkBlockOutput:
    """Draft one block per request (module docstring): anchors [B] (the token at p + 1), positions [B] (p, the last
    verified position), rings: per stage [B, W, D] its window keys, ring_valid [B, W] which ring rows hold a
    position in (p - W, p] of this request."""
    cfg = model.config
    stages = model.mtp
    if stages is None:
        raise ValueError("this DeepSeek-V4.1 model has no DSpark stages (`num_nextn_predict_layers` = 0)")
    if anchors.dim() != 1 or positions.shape != anchors.shape or len(rings) != len(stages):
        raise ValueError(f"anchors [B] and positions [B] with one ring per stage expected, got "
                         f"{tuple(anchors.shape)}, {tuple(positions.shape)}, {len(rings)} rings for {len(stages)} stages")
    B, blk, hc = anchors.shape[0], cfg.dspark_block_size, cfg.hc_mult
    ids = anchors.new_full((B, blk), cfg.dspark_noise_token_id)
    ids[:, 0] = anchors
    pos = (positions[:, None] + 1 + torch.arange(blk, device=anchors.device)[None]).flatten()  # [B * blk]
    cos, sin = model._rope("main", pos)
    streams = model.embed(ids.flatten())[:, None, :].expand(-1, hc, -1).contiguous()  # [B * blk, hc, H]
    pre = torch.zeros(B * blk, hc, dtype=torch.float32, device=anchors.device)
    pre[:, 0] = 1.0  # the first stage's attention reads stream 0
    for s, stage in enumerate(stages):
        streams, pre = stage.mix(streams, pre, lambda x, stage=stage, s=s: stage.attend(x, cos, sin, rings[s],
                                                                                       ring_valid), None)
    last = stages[-1]
    x = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)  # [B * blk, H]
    logits = F.linear(last.norm(x).float(), model.head.weight.float()).view(B, blk, -1)
    tok, drafts, embeds = anchors, [], []
    for i in range(blk):  # NOTE: sequential: draft i + 1's Markov bias reads draft i
        bias, e = last.markov_head(tok)
        logits[:, i] += bias
        embeds.append(e)
        tok = logits[:, i].argmax(dim=-1)
        drafts.append(tok)
    conf = last.confidence_head(x.view(B, blk, -1), torch.stack(embeds, dim=1))
    return DSparkBlockOutput(torch.stack(drafts, dim=1), logits, conf)
