"""`speculative="dspark"`: DeepSeek-V4.1's DSpark stages draft a block per request; V4.1's state rollback.

**The drafter** (`DSparkDrafter`, the MTP drafter's interface: `propose(features, seqs)`). After the target's
verify forward (which returned each row's DSpark features, `DeepseekV41ForCausalLM.forward(return_streams=True)`)
and acceptance, per request of the step:

1. **Committed pass**: the positions whose next token is now known (a prefill chunk: all of them; a verify chunk:
   the last known token and the accepted drafts) go into every stage's window ring (`DSparkStage.ring_keys` of
   stage 0's `main_x`; position `p` in row `p % sliding_window`, the last `sliding_window` of them). Only
   verified positions enter the rings, so a rejected draft never reaches them: the drafter needs no rollback.
2. **One block**: `engine.models.dspark.dspark_draft` from the last committed position `p` with the token after it
   (the one just sampled) as the anchor proposes `dspark_block_size` greedy drafts in one pass of the stages
   (positions `p + 2 ..`); the first `num_draft_tokens` (capped at the block size) are handed on. Each draft's
   confidence is the sigmoid of the confidence head's logit, what the "confidence" verify schedule reads (in
   place of the MTP drafter's probabilities: `SpecDecoding` loads no `confidence_head.safetensors` for DSpark).

NOTE: the confidence is read as the conditional acceptance c(r, i) of draft i given drafts before it were
accepted (`verify_schedule.survival` multiplies them), which is how the speculative-decoding issue describes the
head; [M] only computes the logit (nothing in it consumes it).

**Disaggregated decode.** The rings are per-slot state: given the engine's cache (`SpecDecoding` passes it), the
drafter adds them to it as the state pool `dspark_keys` (`V41KVCache.add_state`), so a transfer agent registers them
and moves them with a request's slot like the window rings (`DecodeWorkerConfig.bounded_state` "send"; the prefill
runs `--speculative dspark` too). Per request that is `stages x sliding_window x head_dim` elements (3 x 128 x 512
in bf16, 384 KiB, for DeepSeek-V4.1-Flash: about 7% of its 40 layers' window rings). The prefill's committed pass
wrote the prompt's last `sliding_window` positions there, so with `is_state_in_slot` the decode instance's drafter
takes them as valid from the imported state's start (`NewRequestData.state_start`) and its first block after the
first verification is the one an offline engine drafts. With "replay" the tail's replay rewrites them instead.

Rows a decoder-side bounded replay left out (prompt positions before `P - sliding_window`) carry zero features;
their keys are written too and overwritten by the tail's positions before any draft reads them (a prompt's
last `sliding_window` positions are always computed).

**V4.1's rollback** (`V41Rollback`, `RingRollback`'s interface plus the step's batch). A verify chunk of `1 + L`
positions writes V4.1's bounded state: the window rings (`sliding_window` rows: `RingRollback` restores the rows of
rejected positions, exact for `L + 1 <= sliding_window`), and two rings shorter than a verify chunk, which the
row-restore argument does not cover: each KV source's compressor buffer (`comp_kv_r{r}` / `comp_gate_r{r}`, `r`
rows) and the Engram token history (`engram_tokens`, `max_ngram - 1` rows). After a rejection they are rebuilt
as the non-speculative run leaves them: each row holds the newest position `<= p + m` (the last accepted) of its
residue, taken from the snapshot when that position precedes the chunk, else recomputed: the token id itself
(Engram), or the compressor's projection of that position's `attn_norm` output, captured by a forward hook on
each KV source's `attn_norm` during the verify forward (armed between `snapshot` and `restore` only).
The compressed entries rejected positions completed are rewritten before any query can read them (the argument
of `engine.spec_decode.rollback`'s package docstring holds for V4.1's pools too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.engine.models.dspark import DSparkBlockOutput, dspark_draft, dspark_main_x
from deepinfer.engine.spec_decode.mtp_drafter import DraftSeq
from deepinfer.engine.spec_decode.rollback import RingRollback, RingSnapshot


class DSparkDrafter:
    """Drafts with `model.mtp` (a `DeepseekV41ForCausalLM`'s DSpark stages) over its own window rings."""

    STATE_NAME = "dspark_keys"
    """The rings' name as a cache state pool (a transfer region on the wire)."""

    def __init__(self, model, num_slots: int, num_draft_tokens: int, cache=None) -> None:
        if getattr(model, "mtp", None) is None or not hasattr(model, "dspark_targets"):
            raise ValueError("speculative='dspark' needs a DeepSeek-V4.1 checkpoint with DSpark stages (`mtp.*`, "
                             "num_nextn_predict_layers > 0 and dspark_block_size > 0); set speculative=None")
        if num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        cfg = model.config
        self.model = model
        self.block_size = cfg.dspark_block_size
        self.num_draft_tokens = min(num_draft_tokens, self.block_size)
        """Drafts handed on per request: `num_draft_tokens`, capped at the block a DSpark pass proposes."""
        self.window = cfg.sliding_window
        weight = model.embed.weight
        # NOTE: one more slot than the engine's: the cache's dummy slot id is `num_slots`
        self.rings = torch.zeros(len(model.mtp), num_slots + 1, self.window, cfg.head_dim, dtype=weight.dtype,
                                 device=weight.device)
        """Per stage and slot, the window ring of its keys: [num_stages, num_slots + 1, sliding_window, head_dim]."""
        self.is_state_in_slot = cache is not None and hasattr(cache, "add_state")
        """The rings are part of the cache's per-slot state (module docstring): an imported slot brings them."""
        if self.is_state_in_slot:
            cache.add_state(self.STATE_NAME, self.rings)
        self.keep_features = False
        """The MTP drafter's flag; DSpark's confidences come from its own head (always returned as the probs)."""

    @torch.inference_mode()
    def commit(self, features: torch.Tensor, seqs: list[DraftSeq]) -> None:
        """The committed pass: write each seq's last `sliding_window` committed positions into every stage's ring.
        features [T, n_targets * H]: the target step's DSpark features."""
        W, rows, slots, pos = self.window, [], [], []
        for s in seqs:
            n = len(s.stream_rows)
            k = min(n, W)  # older positions would be overwritten in the same ring rows
            rows += s.stream_rows[n - k:]
            slots += [s.slot] * k
            pos += range(s.first_pos + n - k, s.first_pos + n)
        if not rows:
            return
        device = features.device
        p = torch.tensor(pos, dtype=torch.long, device=device)
        sl = torch.tensor(slots, dtype=torch.long, device=device)
        main_x = dspark_main_x(self.model, features[torch.tensor(rows, dtype=torch.long, device=device)])
        cos, sin = self.model._rope("main", p)
        for i, stage in enumerate(self.model.mtp):
            self.rings[i, sl, p % W] = stage.ring_keys(main_x, cos, sin).to(self.rings.dtype)

    @torch.inference_mode()
    def propose(self, features: torch.Tensor, seqs: list[DraftSeq]
                ) -> tuple[list[list[int]], list[list[float]], list[torch.Tensor | None]]:
        """Blocks while drafting: per seq, its drafts, their confidences (the confidence head's sigmoid; empty lists
        for seqs that want none) and None (no MTP features). `features` [T, n_targets * H] of the step's rows."""
        if not seqs:
            return [], [], []
        self.commit(features, seqs)
        drafts: list[list[int]] = [[] for _ in seqs]
        confs: list[list[float]] = [[] for _ in seqs]
        drafting = [i for i, s in enumerate(seqs) if s.wants_drafts and s.stream_rows]
        if drafting:
            out = self.draft([seqs[i] for i in drafting], features.device)
            k = self.num_draft_tokens
            ids = out.draft_ids[:, :k].tolist()
            conf = torch.sigmoid(out.confidence_logits[:, :k]).tolist()
            for b, i in enumerate(drafting):
                drafts[i], confs[i] = ids[b], conf[b]
        return drafts, confs, [None] * len(seqs)


    @torch.inference_mode()
    def draft(self, seqs: list[DraftSeq], device) -> DSparkBlockOutput:
        """One block per seq (already committed) from its last committed position and the token after it."""
        last = torch.tensor([s.first_pos + len(s.stream_rows) - 1 for s in seqs], device=device)
        anchors = torch.tensor([s.next_token_ids[-1] for s in seqs], dtype=torch.long, device=device)
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=device)
        starts = torch.tensor([max(s.state_start, 0) for s in seqs], device=device)
        w = torch.arange(self.window, device=device)
        held = last[:, None] - (last[:, None] - w[None]) % self.window  # [B, W] the position each ring row holds
        valid = held >= starts[:, None]  # positions before this life's state (or before 0) hold nothing
        return dspark_draft(self.model, anchors, last, [self.rings[i, slots] for i in range(len(self.model.mtp))],
                            valid)


class _WindowOnly:
    """The window rings of a `V41KVCache` as `RingRollback` reads a cache (`state_tensors`, `device`)."""

    def __init__(self, cache) -> None:
        self.device = cache.device
        self._t = {"window_kv": cache.tensors["window_kv"]}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self._t


@dataclass
class _SlotState:
    """One verifying request's saved short rings and where its chunk sits in the batch."""

    slot: int
    p0: int
    """Position of the chunk's first row (the last known token)."""
    first_row: int
    """Its flat row in the batch."""
    num_drafts: int
    token_ids: list[int]
    """Tokens at positions p0 .. p0 + num_drafts."""
    comp: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per compressor ring: its [sources, ratio, D] rows of this slot before the forward."""
    engram: torch.Tensor | None = None


@dataclass
class V41Snapshot:
    window: RingSnapshot
    slots: list[_SlotState]


class V41Rollback:
    """Snapshot / restore of V4.1's bounded state around a verify forward (module docstring)."""

    def __init__(self, cache, model) -> None:
        self.cache, self.model = cache, model
        self.window = RingRollback(_WindowOnly(cache))
        self.max_positions_per_slot = self.window.max_positions_per_slot
        """At most this many drafts per verification (`sliding_window - 1`: the window rings' rows)."""
        lay = cache.layout
        self.sources = [(layer, lay.ratios[layer], lay.source_row[layer]) for layer in model.config.kv_source_layer_ids]
        self._comp_names = [n for n in cache.tensors if n.startswith("comp_")]
        self._captured: dict[int, torch.Tensor] = {}
        self._armed = False
        for layer, _, _ in self.sources:
            model.layers[layer].attn_norm.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def capture(_module, _inputs, output):
            if self._armed:
                self._captured[layer] = output  # [T, H]: the KV source's attention input over the whole batch
        return capture

    def snapshot(self, slots: list[int], positions: list[int], batch=None) -> V41Snapshot:
        """Save what the `(slots[i], positions[i])` draft positions may overwrite (pairs grouped per request, in
        order, as the executor builds them) and arm the capture; `batch`: the step's `ForwardBatch`."""
        win = self.window.snapshot(slots, positions)
        states: list[_SlotState] = []
        if slots:
            if batch is None:
                raise ValueError("V41Rollback.snapshot needs the step's batch (where each verify chunk sits)")
            seq_of = {s.slot: i for i, s in enumerate(batch.seqs)}
            for slot in dict.fromkeys(slots):
                i = seq_of[slot]
                s, a = batch.seqs[i], batch.starts[i]
                L = sum(1 for x in slots if x == slot)
                st = _SlotState(slot, s.num_computed_tokens, a, L, batch.input_ids[a:a + 1 + L].tolist())
                st.comp = {n: self.cache.tensors[n][:, slot].clone() for n in self._comp_names}
                if "engram_tokens" in self.cache.tensors:
                    st.engram = self.cache.tensors["engram_tokens"][0, slot].clone()
                states.append(st)
        self._captured = {}
        self._armed = True
        return V41Snapshot(win, states)

    def restore(self, snap: V41Snapshot, is_rejected: list[bool]) -> None:
        """Undo what rejected positions wrote (one flag per snapshot pair), disarming the capture."""
        self._armed = False
        captured, self._captured = self._captured, {}
        self.window.restore(snap.window, is_rejected)
        n = 0
        for st in snap.slots:
            flags = is_rejected[n:n + st.num_drafts]
            n += st.num_drafts
            if not any(flags):
                continue
            last = st.p0 + flags.index(True)  # the last accepted position
            if st.engram is not None:
                ring = self.cache.tensors["engram_tokens"][0]
                m1 = ring.shape[-1]
                ring[st.slot] = st.engram
                for q in range(max(st.p0, last - m1 + 1), last + 1):
                    ring[st.slot, q % m1] = st.token_ids[q - st.p0]
            for layer, r, row in self.sources:
                self._restore_compressor(st, layer, r, row, last, captured.get(layer))

    def _restore_compressor(self, st: _SlotState, layer: int, r: int, row: int, last: int,
                            x: torch.Tensor | None) -> None:
        """Rows of one source's compressor buffer: the newest position `<= last` of each residue."""
        kv_name, gate_name = f"comp_kv_r{r}", f"comp_gate_r{r}"
        kv_ring = self.cache.tensors[kv_name][row, st.slot]  # [r, D]
        gate_ring = self.cache.tensors[gate_name][row, st.slot] if gate_name in self.cache.tensors else None
        held = [last - (last - k) % r for k in range(r)]
        fresh = [k for k in range(r) if held[k] >= st.p0]
        old = [k for k in range(r) if held[k] < st.p0]
        if old:
            kv_ring[old] = st.comp[kv_name][row, old]
            if gate_ring is not None:
                gate_ring[old] = st.comp[gate_name][row, old]
        if fresh:
            if x is None:
                raise RuntimeError(f"KV source {layer}'s attention input was not captured during the verify forward")
            rows = torch.tensor([st.first_row + held[k] - st.p0 for k in fresh], dtype=torch.long, device=x.device)
            # NOTE: in the model's numerics, as the forward projected them (batch-invariant mode: these few rows get
            # the bits a plain decode step gives them)
            with self.model.numerics():
                kvp, gp = self.model.layers[layer].attn.compressor.project(x[rows])
            kv_ring[fresh] = kvp.to(kv_ring.dtype)
            if gate_ring is not None and gp is not None:
                gate_ring[fresh] = gp.to(gate_ring.dtype)
