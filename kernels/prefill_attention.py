"""DeepSeek-V4 prefill attention of a step's chunks: the banded sliding window plus the compressed entries.

Module op `"prefill_attention"` (`register_op(..., in_op_table=False)`; the `triton` attention backend
picks it per device):

    prefill_attention(q [T, NH, D], kv [T, D], ring [S, W, D], spans: PrefillSpans, comp [C, D] | None,
                      entries [Tp, K] | None, sink [NH] float32, out=None) -> out [T, NH, D]

`q` / `kv` are the step's flat rows; `spans` lists its prefill chunks (host ints, plus the per-token table
the kernel reads): chunk `j` has `n_j` new tokens at flat rows `start_j ..` and positions `p0_j ..` of one
request, ring slot `slot_j`, state valid from `state_start_j`. Only those `Tp = sum n_j` rows of `out`
are written (`out` None: a new tensor; the other rows are then undefined). Query `i` of a chunk (position
`p = p0 + i`) attends to what `TorchAttentionBackend._attend_one` gives it (engine/attention/torch_backend.py):

* the window: the keys at positions `p - W + 1 .. p` that are `>= state_start` (a key at position
  `< 0` never is); positions before `p0` come from the ring (`ring[slot, position % W]`, which must
  still hold the history: the caller writes the chunks' tails into the ring *after* this op), the others
  from `kv` (flat row `start + position - p0`);
* compressed entries: `comp` holds each chunk's request's entries `0 .. C_j - 1` (`C_j = (p0_j + n_j) //
  rate`, `spans.rate`) one chunk after the other (the caller's gathers of the pool rows, in chunk order);
  with `entries` None (HCA) the query sees every visible one, `c < (p + 1) // rate` (causal visibility);
  with `entries` (CSA; row `k` for the k-th prefill token in chunk order) the indexer's selection of the
  query, entry indices of its request, -1 for none, in any order (the selection is of visible entries
  only: `kernels.indexer`);
* the per-head sink: `exp(sink[h])` joins the softmax denominator and adds no value.

Logits are `q . k * D**-0.5`; softmax and sums in float32; the output has q's dtype.

The Triton kernel, flash-attention style: V4 attention is MQA with K = V (one shared head), so a program
takes one query token and `BLOCK_H` of its heads (the M dim of `tl.dot`), walks its window in key tiles
(the ring's rows and the chunk's rows picked per key by position), then its entries (gathered through
`entries`, or the contiguous visible prefix of `comp`), with the online softmax, and adds the sink at
the end. The same key tile is the V operand. Neighbouring programs are the token's other head groups
and the neighbouring tokens, whose windows overlap in all but one key: their tiles come from L2. Every
query has at most `W + K` (CSA) or `W + C` (HCA) keys, so no split over keys is needed: the `Tp * NH / BLOCK_H`
programs fill the device. Every chunk of the step runs in the same launch (one per layer): a program reads
its token's row, position, chunk and slot from `spans.table`. A query's result depends on its own inputs
only, not on the other chunks or tokens of the step.

NOTE: compiled for sm_90a (triton 3.9, ptxas 13.4 with triton's flags, pointers 16-byte aligned as launches
specialize them; `benchmarks.kernel_registers`) at 64 heads x 512 with the defaults (32 heads per program, 32-key
tiles, 8 warps) the kernel uses 168 (sliding), 188 (HCA) and 196 (CSA) registers a thread and spills nothing. Its
dots are Ampere-style `mma.sync` (M = 32 is below a warpgroup MMA's 64 rows), which keeps q in registers, and its
window tiles are read 2 bytes a load, not pipelined: the select between the ring's and the chunk's row pointers loses
their alignment in Triton's analysis (the entries' tiles are 16-byte cp.async copies). Measured on an H100
(2026-12-05): ~84 TFLOP/s over an 8,192-token prefill's four layers.

Variants (`VARIANT`, DEEPINFER_PREFILL_ATTN_VARIANT): "m64" (`_prefill_attn_m64_kernel`, the default since
2026-12-05), the same result with all 64 heads of a token per program: both dots warpgroup MMAs, aligned loads, the
accumulator rescaled in place (see its docstring for what it still leaves on the table); "legacy", the kernel above,
and "legacy_aligned", that kernel with the window's loads made 16-byte cp.async copies (an alignment hint). `benchmarks/prefill_attention.py --kernels ...`
times them side by side. The compressors and the indexer's selection (`kernels.indexer`) run per chunk before
any of them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from deepinfer.kernels.registry import register_default_impl, register_op

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None


M64_BLOCK_N = 64
"""Keys per tile of the "m64" kernel by default (16-bit dtypes). NOTE: compiled for sm_90a (triton 3.9, ptxas 13.4
with triton's flags; `benchmarks.kernel_registers`), 16 spills nothing; 32 spills 64-124 B a thread in the HCA and
CSA kernels (none in the sliding one), stored before the loops and reloaded after them; 64 spills 100-600 B inside
the loops, and still wins: larger tiles re-read q from shared memory fewer times per FLOP (see
`_prefill_attn_m64_kernel`). Measured on an H100 (2026-12-05, `benchmarks/prefill_attention.py --kernels`, 8,192
query tokens at V4-Flash widths): per layer 16 / 32 / 64 keys = 1.38 / 1.00 / 0.86 ms sliding, 5.72 / 3.65 / 2.85 ms
CSA, 1.66 / 1.22 / 1.13 ms HCA (legacy: 1.90 / 7.98 / 2.37 ms)."""
_OFF64_MIN_NUMEL = 2**31
"""The "m64" kernel computes key offsets in int64 when kv, ring or comp has this many elements (a module constant
so a test can force the int64 path on tiny shapes)."""
VARIANT_ENV = "DEEPINFER_PREFILL_ATTN_VARIANT"
"""Environment knob picking the Triton kernel (`VARIANT`, read once at import)."""
VARIANTS = ("legacy", "legacy_aligned", "m64")
VARIANT = os.environ.get(VARIANT_ENV, "m64")
"""Which kernel `prefill_attention_triton` launches when not told (`variant=`); a module-level switch (assign it,
or set DEEPINFER_PREFILL_ATTN_VARIANT before import). "m64" is the default since it was timed on a GPU (2.1-2.8x
the legacy kernel per layer, `M64_BLOCK_N`). "legacy": `_prefill_attn_kernel`, 32 heads of one token per program. "legacy_aligned": the same kernel with the window's
row pointers marked 16-byte aligned (16-byte cp.async copies, pipelined, instead of 2-byte loads; fewer
registers), where the wrapper finds them so. "m64": `_prefill_attn_m64_kernel`, all 64 heads of one token per
program (M = 64 rows per `tl.dot`, the smallest a Hopper warpgroup MMA takes), aligned loads, the accumulator
rescaled in place (see its docstring). All three compute the same result (to float32 rounding)."""


# --------------------------------------------------------------------------- the chunks


TABLE_COLUMNS = ("pos", "p0", "kv_off", "slot", "state_start", "comp_off")
"""Columns of `PrefillSpans.table`, one row per prefill token in chunk order: its position, its chunk's first
position, `start - p0` (key position `kp >= p0` is flat row `kp + kv_off`; the token's own row is `pos +
kv_off`), the ring slot, the state start and the row of its request's entry 0 in `comp`."""


@dataclass(frozen=True)
class PrefillSpans:
    """A step's prefill chunks as `prefill_attention` reads them: host ints per chunk (the reference, the
    wrapper's checks) and the per-token table on the device (the kernel). Build with `PrefillSpans.build`."""

    starts: tuple[int, ...]
    """Flat row of each chunk's first token."""
    lengths: tuple[int, ...]
    p0s: tuple[int, ...]
    """Position of each chunk's first token."""
    slots: tuple[int, ...]
    state_starts: tuple[int, ...]
    rate: int
    """Tokens per compressed entry (0: no entries, sliding layers)."""
    table: torch.Tensor
    """[Tp, len(TABLE_COLUMNS)] int64 on the device."""

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def comp_counts(self) -> tuple[int, ...]:
        """Entries of each chunk's request up to the chunk's end (`(p0 + n) // rate`)."""
        return tuple((p + n) // self.rate if self.rate else 0 for p, n in zip(self.p0s, self.lengths))

    @classmethod
    def build(cls, starts, lengths, p0s, slots, state_starts, rate: int, device) -> PrefillSpans:
        """The spans of chunks given by their host ints; the table is made on the host and copied once
        (pinned, non-blocking on CUDA: no synchronisation)."""
        starts, lengths, p0s = tuple(map(int, starts)), tuple(map(int, lengths)), tuple(map(int, p0s))
        slots, state_starts = tuple(map(int, slots)), tuple(map(int, state_starts))
        if not len(starts) == len(lengths) == len(p0s) == len(slots) == len(state_starts):
            raise ValueError("PrefillSpans: one start, length, p0, slot and state start per chunk")
        counts = [(p + n) // rate if rate else 0 for p, n in zip(p0s, lengths)]
        comp_off = [sum(counts[:j]) for j in range(len(counts))]
        per_chunk = torch.tensor([[p, a - p, s, ss, c] for a, p, s, ss, c in zip(starts, p0s, slots, state_starts,
                                                                                 comp_off)],
                                 dtype=torch.int64).reshape(-1, 5)  # p0, kv_off, slot, state_start, comp_off
        n = torch.tensor(lengths, dtype=torch.int64)
        chunk = torch.repeat_interleave(torch.arange(len(lengths)), n)  # [Tp] chunk of each token
        first = torch.cumsum(n, 0) - n  # [chunks] index of each chunk's first token
        cols = per_chunk[chunk]
        pos = cols[:, 0] + torch.arange(int(n.sum())) - first[chunk]
        table = torch.cat([pos[:, None], cols], dim=1).contiguous()
        device = torch.device(device)
        table = table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table.to(device)
        return cls(starts, lengths, p0s, slots, state_starts, rate, table)

    @classmethod
    def single(cls, n: int, p0: int, slot: int, state_start: int, rate: int, device, start: int = 0) -> PrefillSpans:
        """One chunk of `n` tokens at flat rows `start ..`."""
        return cls.build([start], [n], [p0], [slot], [state_start], rate, device)


# --------------------------------------------------------------------------- torch reference


def compressed_mask(n: int, p0: int, C: int, rate: int, entries: torch.Tensor | None,
                    device: torch.device) -> torch.Tensor:
    """[n, C] bool: the entries each query attends to (all visible ones, or the listed ones)."""
    if entries is None:
        pos = p0 + torch.arange(n, device=device)
        return torch.arange(C, device=device)[None, :] < ((pos + 1) // rate)[:, None]
    cols = torch.where(entries >= 0, entries, torch.full_like(entries, C))
    return torch.zeros(n, C + 1, dtype=torch.bool, device=device).scatter_(1, cols, True)[:, :C]


def chunk_attention_torch(q, kv, ring, slot: int, p0: int, state_start: int, comp, entries, rate: int,
                          sink) -> torch.Tensor:
    """One chunk (q [n, NH, D], kv [n, D], comp [C, D] its request's entries, entries [n, K]) -> [n, NH, D]:
    the window through an `unfold` view per query (n * W per head, not n * (n + W)); float32 arithmetic."""
    n, NH, D = q.shape
    W = ring.shape[1]
    hist_pos = torch.arange(p0 - W + 1, p0, device=q.device)  # [W - 1] positions before the chunk
    hist = ring[slot, hist_pos % W]
    keys = torch.cat([hist.float(), kv.float()], dim=0)  # [W - 1 + n, D]: positions p0 - W + 1 ..
    key_ok = torch.arange(p0 - W + 1, p0 + n, device=q.device) >= max(state_start, 0)
    windows = keys.unfold(0, W, 1)  # [n, D, W]: query i's W keys
    win_ok = key_ok.unfold(0, W, 1)  # [n, W]
    qf = q.float()
    scale = D**-0.5
    logits = torch.einsum("nhd,ndw->nhw", qf, windows) * scale
    parts = [logits.masked_fill(~win_ok[:, None, :], float("-inf"))]
    if comp is not None and comp.shape[0] > 0:
        mask = compressed_mask(n, p0, comp.shape[0], rate, entries, q.device)
        cl = torch.einsum("nhd,cd->nhc", qf, comp.float()) * scale
        parts.append(cl.masked_fill(~mask[:, None, :], float("-inf")))
    else:
        comp = None
    parts.append(sink.float().view(1, NH, 1).expand(n, -1, 1))
    probs = torch.cat(parts, dim=-1).softmax(dim=-1)  # the sink keeps every row finite
    o = torch.einsum("nhw,ndw->nhd", probs[..., :W], windows)
    if comp is not None:
        o = o + torch.einsum("nhc,cd->nhd", probs[..., W:-1], comp.float())
    return o.to(q.dtype)


@register_op("prefill_attention", "torch", in_op_table=False)
def prefill_attention_torch(q, kv, ring, spans: PrefillSpans, comp, entries, sink, out=None) -> torch.Tensor:
    """Reference prefill attention of the step's chunks (see the module docstring), one chunk at a time."""
    out = torch.empty_like(q) if out is None else out
    c0 = k0 = 0
    for a, n, p0, slot, ss, C in zip(spans.starts, spans.lengths, spans.p0s, spans.slots, spans.state_starts,
                                     spans.comp_counts):
        sl = slice(a, a + n)
        cc = comp[c0:c0 + C] if comp is not None and C else None
        ee = entries[k0:k0 + n] if entries is not None else None
        out[sl] = chunk_attention_torch(q[sl], kv[sl], ring, slot, p0, ss, cc, ee, spans.rate, sink).to(out.dtype)
        c0, k0 = c0 + C, k0 + n
    return out


@register_default_impl("prefill_attention")
def _pick(device: torch.device) -> str:
    return "triton" if device.type == "cuda" and triton is not None else "torch"


def prefill_flops(n: int, p0: int, NH: int, D: int, W: int, state_start: int, num_entries) -> int:
    """FLOPs of one chunk's attention core: `4 * D` per head per (query, key) pair it attends to (QK and
    PV), over the valid window keys plus `num_entries(i)` entries of query i (a callable)."""
    keys = 0
    for i in range(n):
        p = p0 + i
        keys += p - max(p - W + 1, state_start, 0) + 1 + num_entries(i)
    return 4 * D * NH * keys


# --------------------------------------------------------------------------- Triton


if triton is not None:
    from deepinfer.kernels.decode_attention import online_softmax_step

    @triton.jit
    def _prefill_attn_kernel(
        q_ptr, kv_ptr, ring_ptr, comp_ptr, idx_ptr, sink_ptr, out_ptr, tab_ptr, NH, K, scale,
        D: tl.constexpr, W: tl.constexpr, RATE: tl.constexpr, HAS_COMP: tl.constexpr, SPARSE: tl.constexpr,
        NCOL: tl.constexpr, NUM_HG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr, IEEE: tl.constexpr, ALIGNED: tl.constexpr = False,
    ):
        # a 1-D grid (CUDA caps the 2nd and 3rd grid dims at 65535): a token's head groups are neighbours, so
        # its key tiles come from L2 for all but the first
        pid = tl.program_id(0).to(tl.int64)
        hg = pid % NUM_HG
        i = pid // NUM_HG  # the i-th prefill token of the step
        pos = tl.load(tab_ptr + i * NCOL + 0)
        p0 = tl.load(tab_ptr + i * NCOL + 1)
        kv_off = tl.load(tab_ptr + i * NCOL + 2)
        slot = tl.load(tab_ptr + i * NCOL + 3)
        lo = tl.maximum(tl.load(tab_ptr + i * NCOL + 4), 0)
        row = pos + kv_off  # the token's flat row
        h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        h_ok = h < NH
        d_ok = d < D
        q = tl.load(q_ptr + (row * NH + h[:, None]) * D + d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                    other=0.0)  # [BLOCK_H, BLOCK_D]
        m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)  # finite: an all-masked tile gives p = 0, not NaN
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        # the window: keys at positions pos - W + 1 .. pos
        for t0 in range(0, W, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            kp = pos - W + 1 + t  # key positions
            valid = (t < W) & (kp >= lo)
            in_chunk = kp >= p0
            ring_row = tl.where(kp >= 0, kp, 0) % W
            ptrs = tl.where(in_chunk, kv_ptr + (kp + kv_off) * D, ring_ptr + (slot * W + ring_row) * D)
            if ALIGNED:  # the "legacy_aligned" variant: 16-byte loads of the window (see `_prefill_attn_m64_kernel`)
                ptrs = tl.multiple_of(ptrs, [16])
            k = tl.load(ptrs[:, None] + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
            m_i, l_i, acc = online_softmax_step(q, k, valid, m_i, l_i, acc, scale, IEEE)
        if HAS_COMP:
            comp_off = tl.load(tab_ptr + i * NCOL + 5)
            if SPARSE:
                n_ent = K + 0 * pos
            else:
                n_ent = (pos + 1) // RATE
            for c0 in range(0, n_ent, BLOCK_N):
                ci = c0 + tl.arange(0, BLOCK_N)
                ok = ci < n_ent
                if SPARSE:
                    c = tl.load(idx_ptr + i * K + ci, mask=ok, other=-1)
                    ok = ok & (c >= 0)
                else:
                    c = ci
                k = tl.load(comp_ptr + (comp_off + c)[:, None] * D + d[None, :], mask=ok[:, None] & d_ok[None, :],
                            other=0.0)
                m_i, l_i, acc = online_softmax_step(q, k, ok, m_i, l_i, acc, scale, IEEE)
        sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
        m = tl.maximum(m_i, sink)
        a = tl.exp(m_i - m)
        tot = l_i * a + tl.exp(sink - m)
        o = acc * (a / tot)[:, None]
        tl.store(out_ptr + (row * NH + h[:, None]) * D + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=h_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _prefill_attn_m64_kernel(
        q_ptr, kv_ptr, ring_ptr, comp_ptr, idx_ptr, sink_ptr, out_ptr, tab_ptr, NH, K, scale,
        D: tl.constexpr, W: tl.constexpr, RATE: tl.constexpr, HAS_COMP: tl.constexpr, SPARSE: tl.constexpr,
        NCOL: tl.constexpr, NUM_HG: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr, IEEE: tl.constexpr, ALIGNED: tl.constexpr, OFF64: tl.constexpr,
    ):
        """The "m64" variant: the same queries per program (one token; all its heads when NH <= BLOCK_H) and the
        same result as `_prefill_attn_kernel`, laid out for Hopper's warpgroup MMA (wgmma).

        * `BLOCK_H` = 64 heads of one token are the M dim of both dots: a wgmma takes 64 rows per warpgroup (at 32
          Triton emits Ampere's mma.sync). With 8 warps the P @ V dot is split over the two warpgroups by output
          column, 256 of the 512 each (FlashMLA's sparse prefill splits its value dim between two warpgroups the
          same way, with 64 heads of one token per block); q stays in shared memory as the A operand, so the 64 x
          512 float32 accumulator (128 registers a thread) is the main register use. Each key tile (BLOCK_N x D,
          K = V) is read from L2 once for all 64 heads: twice the legacy kernel's reuse.
        * The accumulator is rescaled, then handed to the P @ V dot as its accumulator (`online_softmax_step`'s ACC_IN_DOT): no second 64 x
          512 float32 tile (a fresh dot result) is live beside it.
        * Row pointers: the window's rows come from the chunk (`kv`) or the ring, picked per row; Triton's
          alignment analysis loses the 16 bytes of both bases through that select, and the tile is then read 2
          bytes a load, outside the software pipeline (the legacy kernel's window loop). `ALIGNED` (the wrapper
          checks the bases and that a row is a multiple of 16 bytes) restores it with `tl.multiple_of`: 16-byte
          cp.async copies, `num_stages` deep. Key-side index math is int32 unless a tensor reaches 2**31 elements
          (`OFF64`); the q / out addresses are a scalar row base plus small offsets, not a tensor of 64-bit
          addresses that would stay live across the loops.
        NOTE: what is left (sm_90a PTX/SASS, triton 3.9): Triton gives a dot whose result feeds another dot (Q K^T
        here) all warps along M, so with M = 64 both warpgroups compute the same Q K^T tile, and it picks that dot's
        instruction N as BLOCK_N / 2 (m64n16k16 at 32-key tiles), re-reading q's 64 x 16 slice from shared memory
        for each one: by a count of bytes (~5 KiB of shared memory a warpgroup per 16-wide k step at 32-key tiles,
        against 128 B a cycle), the Q K^T half of the work is bound by shared-memory bandwidth, not the tensor
        cores; larger tiles help (`M64_BLOCK_N`) until the registers run out.
        FlashMLA avoids both with explicit warpgroup roles; in Triton that takes Gluon (or M = 128 rows and the
        value dim split over programs, which re-reads every key tile twice from L2).
        """
        pid = tl.program_id(0).to(tl.int64)
        hg = pid % NUM_HG
        i = pid // NUM_HG  # the i-th prefill token of the step
        # NOTE: key-side index math in int32 (fewer registers a row); the element offsets into kv, ring and
        # comp are int32 unless one of them has 2**31 elements or more (OFF64)
        pos = tl.load(tab_ptr + i * NCOL + 0).to(tl.int32)
        p0 = tl.load(tab_ptr + i * NCOL + 1).to(tl.int32)
        kv_off = tl.load(tab_ptr + i * NCOL + 2).to(tl.int32)
        slot = tl.load(tab_ptr + i * NCOL + 3).to(tl.int32)
        lo = tl.maximum(tl.load(tab_ptr + i * NCOL + 4), 0).to(tl.int32)
        row = (pos + kv_off).to(tl.int64)  # the token's flat row
        h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        h_ok = h < NH
        d_ok = d < D
        # NOTE: q / out addresses: a scalar row base plus small int32 offsets, built apart for the load and the store
        # (fewest spills of the forms tried); a [BLOCK_H, BLOCK_D] tensor of 64-bit addresses shared by the q load and
        # the out store (the legacy kernel's) stays live across the loops and spills
        hd = (h - hg * BLOCK_H)[:, None] * D + d[None, :]  # [BLOCK_H, BLOCK_D]
        q = tl.load(q_ptr + (row * NH + hg * BLOCK_H) * D + hd, mask=h_ok[:, None] & d_ok[None, :],
                    other=0.0)  # [BLOCK_H, BLOCK_D]
        WT: tl.constexpr = (W + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # window keys, padded to whole tiles
        n_ent = 0 * pos
        comp_off = 0 * pos
        if HAS_COMP:
            comp_off += tl.load(tab_ptr + i * NCOL + 5).to(tl.int32)  # the request's entry 0
            if SPARSE:
                n_ent += K
            else:
                n_ent += (pos + 1) // RATE
        m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)  # finite: an all-masked tile gives p = 0, not NaN
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for j0 in range(0, WT, BLOCK_N):
            # the window: key positions pos - W + 1 + j, from the chunk's rows or the ring
            j = j0 + tl.arange(0, BLOCK_N)
            kp = pos - W + 1 + j
            valid = (j < W) & (kp >= lo)
            ring_row = slot * W + tl.where(kp >= 0, kp, 0) % W
            if OFF64:
                ptrs = tl.where(kp >= p0, kv_ptr + (kp + kv_off).to(tl.int64) * D, ring_ptr + ring_row.to(tl.int64) * D)
            else:
                ptrs = tl.where(kp >= p0, kv_ptr + (kp + kv_off) * D, ring_ptr + ring_row * D)
            if ALIGNED:
                # NOTE: a per-row select between two base pointers loses their alignment in Triton's analysis,
                # and the tile is then read 2 bytes a load, not pipelined; every row start is 16-byte aligned
                # here (the wrapper checks the bases and D's bytes % 16), which restores 16-byte loads and cp.async
                ptrs = tl.multiple_of(ptrs, [16])
            k = tl.load(ptrs[:, None] + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)  # K = V
            m_i, l_i, acc = online_softmax_step(q, k, valid, m_i, l_i, acc, scale, IEEE, True)
        if HAS_COMP:
            for c0 in range(0, n_ent, BLOCK_N):
                # the entries: the listed ones (CSA) or the visible prefix (HCA)
                ci = c0 + tl.arange(0, BLOCK_N)
                ok = ci < n_ent
                if SPARSE:
                    c = tl.load(idx_ptr + i * K + ci, mask=ok, other=-1).to(tl.int32)
                    ok = ok & (c >= 0)
                else:
                    c = ci
                row_c = comp_off + c
                if OFF64:
                    row_c = row_c.to(tl.int64)
                k = tl.load(comp_ptr + row_c[:, None] * D + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
                m_i, l_i, acc = online_softmax_step(q, k, ok, m_i, l_i, acc, scale, IEEE, True)
        sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
        m = tl.maximum(m_i, sink)
        a = tl.exp(m_i - m)
        tot = l_i * a + tl.exp(sink - m)
        o = acc * (a / tot)[:, None]
        hs = tl.arange(0, BLOCK_H)
        tl.store(out_ptr + (row * NH + hg * BLOCK_H) * D + hs[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=(hg * BLOCK_H + hs < NH)[:, None] & d_ok[None, :])

    @register_op("prefill_attention", "triton", in_op_table=False)
    def prefill_attention_triton(q, kv, ring, spans: PrefillSpans, comp, entries, sink, out=None,
                                 block_h: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                                 num_stages: int | None = None, variant: str | None = None) -> torch.Tensor:
        """Triton prefill attention of the step's chunks, one launch (see the module docstring) -> out.

        q [T, NH, D], kv [T, D], ring [S, W, D] and comp [C, D] share q's dtype and are contiguous; entries
        [Tp, K] int64 (-1 padded; None: every visible entry); sink [NH] float32; out (if given) like q.
        `variant`: one of `VARIANTS` (None: the module's `VARIANT`); `block_h`: heads per program, the dot's M
        dim (None: 32; 64 for "m64" in 16-bit dtypes); `block_n`: keys per tile, a power of two >= 16 (None: 32;
        for "m64" `M64_BLOCK_N`, 16 in float32); `num_warps` /
        `num_stages`: None for the variant's defaults (legacy: 8 warps at 32 x 512 and up, else 4, 2 stages;
        m64: 8 warps, 2 stages).
        """
        variant = VARIANT if variant is None else variant
        if variant not in VARIANTS:
            raise ValueError(f"prefill_attention: variant must be one of {VARIANTS} (${VARIANT_ENV}), got {variant!r}")
        if variant == "m64" and q.element_size() <= 2:
            block_h, block_n = block_h or 64, block_n or M64_BLOCK_N
        elif variant == "m64":  # float32: FMA dots (no warpgroup MMA); smaller tiles fit in shared memory
            block_h, block_n = block_h or 32, block_n or 16
        else:
            block_h, block_n = block_h or 32, block_n or 32
        if q.dim() != 3 or kv.dim() != 2 or ring.dim() != 3 or kv.shape != (q.shape[0], q.shape[2]) \
                or ring.shape[2] != q.shape[2]:
            raise ValueError(f"prefill_attention: q [T, NH, D], kv [T, D] and ring [S, W, D] expected, got "
                             f"{list(q.shape)}, {list(kv.shape)} and {list(ring.shape)}")
        T, NH, D = q.shape
        S = ring.shape[0]
        named = [("q", q), ("kv", kv), ("ring", ring)] + ([("comp", comp)] if comp is not None else []) \
            + ([("out", out)] if out is not None else [])
        for name, t in named:
            if not t.is_contiguous():
                raise ValueError(f"prefill_attention: {name} must be contiguous (call .contiguous())")
            if t.dtype != q.dtype:
                raise ValueError(f"prefill_attention: {name} is {t.dtype}, q is {q.dtype} (one dtype)")
        if out is not None and out.shape != q.shape:
            raise ValueError(f"prefill_attention: out must be shaped like q {list(q.shape)}, got {list(out.shape)}")
        Tp, C = spans.num_tokens, sum(spans.comp_counts)
        if tuple(spans.table.shape) != (Tp, len(TABLE_COLUMNS)) or spans.table.dtype != torch.int64 \
                or not spans.table.is_contiguous():
            raise ValueError(f"prefill_attention: spans.table must be a contiguous int64 [{Tp}, {len(TABLE_COLUMNS)}] "
                             f"tensor, got {spans.table.dtype} {list(spans.table.shape)}")
        if any(a < 0 or a + n > T for a, n in zip(spans.starts, spans.lengths)):
            raise ValueError(f"prefill_attention: a chunk's rows run past the {T} rows of q")
        if any(not 0 <= slot < S for slot in spans.slots):
            raise ValueError(f"prefill_attention: a chunk's slot is not a ring slot (0 .. {S - 1})")
        if comp is not None and (comp.dim() != 2 or comp.shape[1] != D or comp.shape[0] != C):
            raise ValueError(f"prefill_attention: comp must be [{C}, {D}] (every chunk's entries), got "
                             f"{list(comp.shape)}")
        if sink.shape != (NH,) or sink.dtype != torch.float32:
            raise ValueError(f"prefill_attention: sink must be float32 [{NH}], got {sink.dtype} {list(sink.shape)}")
        if entries is not None:
            if comp is None:
                raise ValueError("prefill_attention: entries without comp")
            if entries.dtype != torch.int64 or entries.dim() != 2 or entries.shape[0] != Tp \
                    or not entries.is_contiguous():
                raise ValueError(f"prefill_attention: entries must be a contiguous int64 [{Tp}, K] tensor, got "
                                 f"{entries.dtype} {list(entries.shape)}")
        for name, v in (("block_h", block_h), ("block_n", block_n)):
            if v < 16 or v & (v - 1):
                raise ValueError(f"prefill_attention: {name} must be a power of two >= 16, got {v}")
        if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"prefill_attention needs CUDA tensors (or TRITON_INTERPRET=1), got {q.device}")
        out = torch.empty_like(q) if out is None else out
        if Tp == 0:
            return out
        has_comp = comp is not None and C > 0
        sparse = has_comp and entries is not None
        K = entries.shape[1] if sparse else 0
        BLOCK_H = max(16, min(block_h, triton.next_power_of_2(NH)))
        BLOCK_D = max(16, triton.next_power_of_2(D))
        warps = num_warps or (8 if BLOCK_H * BLOCK_D >= 32 * 512 else 4)
        num_hg = triton.cdiv(NH, BLOCK_H)
        kernel, extra = _prefill_attn_kernel, {}
        keys = [kv, ring] + ([comp] if has_comp else [])
        aligned = (D * q.element_size()) % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in keys)
        if variant == "m64":
            kernel = _prefill_attn_m64_kernel
            extra = dict(ALIGNED=aligned, OFF64=max(t.numel() for t in keys) >= _OFF64_MIN_NUMEL)
        elif variant == "legacy_aligned":
            extra = dict(ALIGNED=aligned)
        kernel[(num_hg * Tp,)](
            q, kv, ring, comp if has_comp else ring, entries if sparse else spans.table, sink, out, spans.table,
            NH, K, D**-0.5,
            D=D, W=ring.shape[1], RATE=max(spans.rate, 1), HAS_COMP=has_comp, SPARSE=sparse, NCOL=len(TABLE_COLUMNS),
            NUM_HG=num_hg,
            BLOCK_N=block_n, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, IEEE=q.dtype == torch.float32, num_warps=warps,
            num_stages=num_stages or 2, **extra,
        )
        return out
