"""The MTP drafter: the checkpoint's MTP layer proposes `k` draft tokens per request, chained.

Per engine step, after the target forward (which returned its pre-`hc_head` streams) and acceptance:

1. **Committed pass.** For every request of the step, the MTP layer runs over the positions whose
   next token is now known (a prefill chunk: all of them; a decode / verify chunk: the last known
   token and the accepted drafts, the next token of the last one being the token just sampled),
   with the target's streams at those positions. This keeps the layer's own window ring (its KV
   cache, one slot per request, the main cache's slot id) exact, and its logits at a request's last
   committed position give draft 1.
2. **Chained drafts 2 .. k.** The block's output streams at the previous position stand in for the
   target's streams (which do not exist yet), the previous draft is the next token; one decode row
   per request. These positions are speculative: the ring rows they write are snapshotted before and
   restored after (`RingRollback`), so the next committed pass sees only committed keys.

Drafts are greedy (the argmax of the MTP logits): a one-hot draft distribution, which makes the
engine's acceptance rule standard rejection sampling (`engine.spec_decode.acceptance`). The
drafter also reports each draft's probability under the MTP (its softmax at the argmax): the
fallback confidence of a verify scheduler for checkpoints without a confidence head. With
`keep_features` set (a confidence head is loaded, or a training script records), it also returns
each draft's `confidence.confidence_features` (the MTP hidden state it was read from, its softmax
statistics and its position), the head's input.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk, host_to_device
from deepinfer.engine.spec_decode.confidence import confidence_features
from deepinfer.engine.spec_decode.rollback import RingRollback


@dataclass
class DraftSeq:
    """One request's share of the committed pass (flat rows of the target's batch)."""

    slot: int
    first_pos: int
    """Position of the first committed row."""
    stream_rows: list[int]
    """Flat rows of the target batch whose streams feed the layer (consecutive positions)."""
    next_token_ids: list[int]
    """The token after each of those positions (same length)."""
    state_start: int
    """First position whose MTP key this slot holds in the request's current life."""
    wants_drafts: bool


def drafter_replay_tokens(config) -> int:
    """Tokens of bounded replay after which the MTP drafter's window comes out exactly as cold.

    After a prefix hit, or on a decode instance after a transfer, the engine replays the prompt's
    tail (`engine.cache.layout.exact_replay_tokens`); the committed pass runs over those positions
    as over any chunk, so the replay also rebuilds the drafter's window ring. The drafter's first
    query (at the position after the replay) reads its keys at the `sliding_window - 1` positions
    before it; each is a function of the target's final streams at that position (and the next
    token), which are exact once `num_layers * (window - 1)` replayed tokens precede them. Hence
    `(num_layers + 1) * (window - 1)`: the MTP block counts as one more sliding-window layer. Keys of
    earlier replayed positions may be inexact, but no later query reads them (they left the window).
    """
    return (config.num_hidden_layers + 1) * (config.sliding_window - 1)


class MTPDrafter:
    """Drafts with MTP layer `layer_idx` of `model` over its own window cache (`num_slots` slots)."""

    def __init__(self, model, num_slots: int, num_draft_tokens: int, layer_idx: int = 0) -> None:
        if model.mtp is None or len(model.mtp) <= layer_idx:
            raise ValueError("speculative='mtp' needs a checkpoint with an MTP layer (mtp.* weights); this "
                             "model has none: set speculative=None")
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        self.model = model
        self.layer = model.mtp[layer_idx]
        weight = model.model.embed_tokens.weight
        self.cache = self.layer.make_cache(num_slots, dtype=weight.dtype, device=weight.device)
        """The layer's window rings, one slot per request (the main cache's slot ids)."""
        self.num_draft_tokens = num_draft_tokens
        self.numerics = getattr(model, "numerics", contextlib.nullcontext)
        self.rollback = RingRollback(self.cache)
        self.keep_features = False
        """Also return each draft's confidence features from `propose` (costs a top-2 and an entropy per draft)."""
        self.graphs = None
        """CUDA graphs of whole draftings (`draft_graph.DraftGraphRunner`), set by `SpecDecoding.make_executor` with
        the verify graphs; None: every drafting runs eagerly."""
        if num_draft_tokens - 1 > self.rollback.max_positions_per_slot:
            raise ValueError(f"num_draft_tokens={num_draft_tokens} exceeds the MTP window "
                             f"({self.rollback.max_positions_per_slot + 1})")

    def _run(self, streams: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model.model
        meta = self.layer.build_attention_metadata(batch, self.cache, m.rotary_main, m.rotary_compress)
        with self.numerics():  # the model's numerics mode (batch-invariant or not), as its own forwards
            return self.layer(streams, batch, self.cache, meta, m.embed_tokens, return_streams=True)

    @torch.inference_mode()
    def propose(self, streams: torch.Tensor, seqs: list[DraftSeq]
                ) -> tuple[list[list[int]], list[list[float]], list[torch.Tensor | None]]:
        """Blocks while drafting: per seq, its `num_draft_tokens` drafts, their MTP probabilities (empty
        lists for seqs that want none) and, with `keep_features`, their confidence features
        [num_draft_tokens, num_features] (else None). `streams` [T, hc, H]: the target's streams of the step.

        NOTE: the drafts stay on the device until all `k` are drafted (each chained step reads the previous
        one's argmax there): one device-to-host read per step, at the end. A step whose committed pass is
        one short chunk per request, all of them drafting, replays a CUDA graph of the whole drafting when
        `graphs` is set (`draft_graph.DraftGraphRunner`); others run eagerly."""
        if not seqs:
            return [], [], []
        drafting = [i for i, s in enumerate(seqs) if s.wants_drafts]
        out = self.graphs.run(streams, seqs) if self.graphs is not None and len(drafting) == len(seqs) else None
        if out is None:
            out = self._draft_eager(streams, seqs, drafting)
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[float]] = [[] for _ in seqs]
        feats: list[torch.Tensor | None] = [None] * len(seqs)
        if out is None:
            return drafts, probs, feats
        tok, prob, feat = out  # [D, k], [D, k], [D, k, F] or None
        for b, (t, p) in enumerate(zip(tok.tolist(), prob.tolist())):
            drafts[drafting[b]], probs[drafting[b]] = t, p
            if feat is not None:
                feats[drafting[b]] = feat[b]
        return drafts, probs, feats

    def _draft_eager(self, streams: torch.Tensor, seqs: list[DraftSeq], drafting: list[int]
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """The committed pass and chained drafts, eagerly: device tensors `(tokens [D, k], probabilities [D, k],
        features [D, k, F] or None)` of the `drafting` seqs (D of them, in that order), or None when none drafts."""
        device = streams.device
        chunks = [SeqChunk(s.slot, [], s.first_pos, len(s.stream_rows), s.state_start) for s in seqs]
        ends, n = [], 0
        for s in seqs:
            n += len(s.stream_rows)
            ends.append(n)
        rows = host_to_device(torch.tensor([r for s in seqs for r in s.stream_rows], dtype=torch.long), device)
        batch = ForwardBatch.build([s.next_token_ids for s in seqs], chunks, device=device,
                                   logits=[ends[i] - 1 for i in drafting])
        hidden, x = self._run(streams[rows], batch)  # [T', H], [T', hc, H]
        if not drafting:
            return None
        last = batch.logits_indices
        tok, prob, feat = self._greedy(hidden[last], 0)
        toks, probs, feats = [tok], [prob], [feat]
        cur_streams = x[last]  # [D, hc, H]
        k = self.num_draft_tokens
        if k > 1:
            last_pos = [seqs[i].first_pos + len(seqs[i].stream_rows) - 1 for i in drafting]
            snap = self.rollback.snapshot([seqs[i].slot for i in drafting for _ in range(k - 1)],
                                          [p + j for p in last_pos for j in range(1, k)])
            for j in range(1, k):
                step = [SeqChunk(seqs[i].slot, [], p + j, 1, seqs[i].state_start) for i, p in zip(drafting, last_pos)]
                hidden, cur_streams = self._run(cur_streams, ForwardBatch(input_ids=toks[-1], seqs=step))
                tok, prob, feat = self._greedy(hidden, j)
                toks.append(tok)
                probs.append(prob)
                feats.append(feat)
            self.rollback.restore(snap, [True] * len(snap.slots))
        return (torch.stack(toks, dim=1), torch.stack(probs, dim=1),
                torch.stack(feats, dim=1) if self.keep_features else None)

    def _greedy(self, hidden: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Argmax tokens [B] of the shared head's logits, their softmax probabilities [B] and (with `keep_features`)
        their confidence features [B, num_features] at draft `position`, all on the device (no host read)."""
        logits = self.model.compute_logits(hidden)  # [B, vocab] float32
        softmax = logits.softmax(dim=-1)
        prob, tok = softmax.max(dim=-1)
        feat = confidence_features(hidden, logits, softmax, position) if self.keep_features else None
        return tok, prob, feat
