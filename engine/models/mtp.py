"""The DeepSeek-V4 multi-token-prediction (MTP) layer: a drafter that predicts the token after next.

A checkpoint's `mtp.{k}.*` tensors (V4 ships one, `mtp.0`) hold one full decoder block with
sliding-window attention only (no compressor, learned top-k routing) plus its own input and output
pieces; it shares the main model's embedding and output head (names and shapes:
`engine.models.deepseek_v4_weights.mtp_checkpoint_spec`). At position `i`, with the main model's
last hyper-connection streams `s_i` [hc, H] (before the main `hc_head`) and the next token `t_{i+1}`:

```
e = e_proj(enorm(embed(t_{i+1})))            [H]      embed: the main model's
x = e (broadcast over streams) + h_proj(hnorm(s_i))   [hc, H]   (hnorm / h_proj per stream)
x = decoder block at position i (sliding window over the MTP layer's own earlier keys)
logits(t_{i+2}) = head(norm(hc_head(x)))              head: the main model's; hc_head: hc_head_{fn,base,scale}
```

This is the order of DeepSeek's reference `MTPBlock.forward` (embed -> enorm, hnorm on the streams,
e_proj(e) + h_proj(h), the block, then the head's hc collapse with the MTP's own `hc_head_*` and
its `norm`) and of deepinfer's demo-model training (tools/demo_model/train.py `mtp_hidden`).

The block's attention keeps its keys in a window ring of its own: `MTPLayer.make_cache` builds a
one-layer `V4KVCache` (sliding only, so it has no paged pools) whose slots the caller manages
(`engine.spec_decode.mtp_drafter.MTPDrafter` uses the main cache's slot ids; tests drive it directly).

Chained drafting (k drafts from one layer): the block's output streams at position i (before the
MTP's `hc_head`) stand in for the main model's streams at position i + 1, so the layer runs again at
i + 1 with its own draft as the next token (`forward(..., return_streams=True)`).
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.engine.attention import AttentionBackend, AttentionMetadata, build_attention_metadata, layer_specs
from deepinfer.engine.cache.kv_cache import V4KVCache
from deepinfer.engine.cache.layout import default_block_size
from deepinfer.engine.config import ModelConfig
from deepinfer.engine.forward_batch import ForwardBatch
from deepinfer.engine.models.deepseek_v4 import DecoderLayer, RMSNorm, Rotary, hc_collapse
from deepinfer.kernels import OpTable


def mtp_layer_config(config: ModelConfig) -> ModelConfig:
    """`config` narrowed to the MTP block: one sliding-window layer with learned (not hash) routing.

    NOTE: V4's `compress_ratios` gives the MTP layer ratio 0 (sliding only), and its router has a
    `gate.bias` (learned top-k), whatever the main model's first layers are."""
    return config.model_copy(update={
        "num_hidden_layers": 1,
        "layer_types": ("sliding_attention",),
        "mlp_layer_types": ("moe",),
        "num_nextn_predict_layers": 0,
        "vision": None,
    })


class MTPLayer(DecoderLayer):
    """One MTP layer `mtp.{k}`: a sliding-window `DecoderLayer` (its tensors sit directly under
    `mtp.{k}.`, as in the checkpoint) plus `e_proj`, `h_proj`, `enorm`, `hnorm`, `norm` and
    `hc_head_{fn,base,scale}`. The embedding and the output head are the main model's, passed per call.
    """

    def __init__(self, config: ModelConfig, *, attention_backend: AttentionBackend, moe_backend: str = "torch",
                 ops: OpTable | None = None) -> None:
        layer_config = mtp_layer_config(config)
        super().__init__(layer_config, layer_specs(layer_config)[0], attention_backend=attention_backend,
                         moe_backend=moe_backend, ops=ops)
        self.layer_config = layer_config
        """The one-layer config of the block (and of its window cache)."""
        H, hc, eps = config.hidden_size, config.hc_mult, config.rms_norm_eps
        self.e_proj = nn.Linear(H, H, bias=False)
        self.h_proj = nn.Linear(H, H, bias=False)
        self.enorm = RMSNorm(H, eps)
        self.hnorm = RMSNorm(H, eps)
        self.norm = RMSNorm(H, eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * H, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def make_cache(self, num_slots: int, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu") -> V4KVCache:
        """The layer's own window state: a one-layer cache with `num_slots` slots of `sliding_window`
        rows (no paged pools: a `SeqChunk` for it takes an empty block table)."""
        cfg = self.layer_config
        return V4KVCache(cfg, 1, default_block_size(cfg.compress_rates.values()), num_slots, dtype=dtype, device=device)

    def build_attention_metadata(self, batch: ForwardBatch, cache: V4KVCache, rotary_main: Rotary,
                                 rotary_compress: Rotary) -> AttentionMetadata:
        """The step's metadata over the layer's own cache (`rotary_*`: the main model's RoPE flavours)."""
        rope_fns = {"main": rotary_main, "compress": rotary_compress}
        return build_attention_metadata(batch, (self.attn.spec,), rope_fns, cache.block_size)

    def forward(self, streams: torch.Tensor, batch: ForwardBatch, cache: V4KVCache, meta: AttentionMetadata,
                embed: nn.Embedding, return_streams: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """streams [T, hc, H] (the main model's, before its hc_head), `batch.input_ids` [T] the next
        tokens -> hidden [T, H] after `norm` (the shared head's input); writes the layer's window ring.

        With `return_streams`, also the block's output streams [T, hc, H] (before `hc_head`): chained
        drafting feeds them back as the streams of the next position (`engine.spec_decode.mtp_drafter`),
        in place of the main model's streams there, which do not exist yet."""
        e = self.e_proj(self.enorm(embed(batch.input_ids)))  # [T, H]
        x = e.unsqueeze(1) + self.h_proj(self.hnorm(streams.to(e.dtype)))  # [T, hc, H]
        x = super().forward(x, batch, cache, meta)  # [T, hc, H]
        hidden = self.norm(hc_collapse(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.hc_eps,
                                       self.eps))
        return (hidden, x) if return_streams else hidden
