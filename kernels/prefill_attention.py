"""DeepSeek-V4 prefill attention of one chunk: the banded sliding window plus the compressed entries.

Module op `"prefill_attention"` (`register_op(..., in_op_table=False)`; the `triton` attention backend
picks it per device):

    prefill_attention(q [n, NH, D], kv [n, D], ring [S, W, D], slot, p0, state_start, comp [C, D] | None,
                      entries [n, K] | None, rate, sink [NH] float32) -> [n, NH, D]

The chunk's `n` new tokens sit at positions `p0 .. p0 + n - 1` of one request (ring slot `slot`). Query
`i` (position `p = p0 + i`) attends to what `TorchAttentionBackend._attend_one` gives it
(engine/attention/torch_backend.py):

* the window: the keys at positions `p - W + 1 .. p` that are `>= state_start` (a key at position
  `< 0` never is); positions before `p0` come from the ring (`ring[slot, position % W]`, which must
  still hold the history: the caller writes the chunk's tail into the ring *after* this op), the others
  from `kv` (row `position - p0`);
* compressed entries, `comp[c]` is entry `c` of the request (the caller's gather of the pool rows):
  with `entries` None (HCA) every visible one, `c < (p + 1) // rate` (causal visibility); with
  `entries` (CSA) the indexer's selection of the query, entry indices, -1 for none, in any order (the
  caller's selection is of visible entries only: `kernels.indexer`);
* the per-head sink: `exp(sink[h])` joins the softmax denominator and adds no value.

Logits are `q . k * D**-0.5`; softmax and sums in float32; the output has q's dtype.

The Triton kernel, flash-attention style: V4 attention is MQA with K = V (one shared head), so a program
takes one query token and `BLOCK_H` of its heads (the M dim of `tl.dot`), walks its window in key tiles
(the ring's rows and the chunk's rows picked per key by position), then its entries (gathered through
`entries`, or the contiguous visible prefix of `comp`), with the online softmax, and adds the sink at
the end. The same key tile is the V operand. Neighbouring programs are the token's other head groups
and the neighbouring tokens, whose windows overlap in all but one key: their tiles come from L2. Every
query has at most `W + K` (CSA) or `W + C` (HCA) keys, so no split over keys is needed: the `n * NH / BLOCK_H`
programs fill the device. A query's result does not depend on the chunk it is in beyond its own inputs.
"""

from __future__ import annotations

import os

import torch

from deepinfer.kernels.registry import register_default_impl, register_op

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU-only installs
    triton = None


# --------------------------------------------------------------------------- torch reference


def compressed_mask(n: int, p0: int, C: int, rate: int, entries: torch.Tensor | None,
                    device: torch.device) -> torch.Tensor:
    """[n, C] bool: the entries each query attends to (all visible ones, or the listed ones)."""
    if entries is None:
        pos = p0 + torch.arange(n, device=device)
        return torch.arange(C, device=device)[None, :] < ((pos + 1) // rate)[:, None]
    cols = torch.where(entries >= 0, entries, torch.full_like(entries, C))
    return torch.zeros(n, C + 1, dtype=torch.bool, device=device).scatter_(1, cols, True)[:, :C]


@register_op("prefill_attention", "torch", in_op_table=False)
def prefill_attention_torch(q, kv, ring, slot: int, p0: int, state_start: int, comp, entries, rate: int,
                            sink) -> torch.Tensor:
    """Reference prefill attention of one chunk (see the module docstring); float32 arithmetic, any device."""
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

    @triton.jit
    def _online_step(q, k, valid, m_i, l_i, acc, scale, IEEE: tl.constexpr):
        """One key tile of the online softmax: k [BLOCK_N, BLOCK_D] is both K and V."""
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(valid[None, :], qk * scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            pv = tl.dot(p.to(k.dtype), k, input_precision="ieee")
        else:
            pv = tl.dot(p.to(k.dtype), k)
        return m_new, l_i, acc * alpha[:, None] + pv

    @triton.jit
    def _prefill_attn_kernel(
        q_ptr, kv_ptr, ring_ptr, comp_ptr, idx_ptr, sink_ptr, out_ptr,
        slot, p0, state_start, NH, K, scale,
        D: tl.constexpr, W: tl.constexpr, RATE: tl.constexpr, HAS_COMP: tl.constexpr, SPARSE: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    ):
        hg = tl.program_id(0)  # a token's head groups are neighbours: its key tiles come from L2 for the others
        i = tl.program_id(1).to(tl.int64)
        pos = p0 + i
        h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        h_ok = h < NH
        d_ok = d < D
        q = tl.load(q_ptr + (i * NH + h[:, None]) * D + d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                    other=0.0)  # [BLOCK_H, BLOCK_D]
        m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)  # finite: an all-masked tile gives p = 0, not NaN
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        lo = tl.maximum(state_start, 0)
        # the window: keys at positions pos - W + 1 .. pos
        for t0 in range(0, W, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            kp = pos - W + 1 + t  # key positions
            valid = (t < W) & (kp >= lo)
            in_chunk = kp >= p0
            ring_row = tl.where(kp >= 0, kp, 0) % W
            ptrs = tl.where(in_chunk, kv_ptr + (kp - p0) * D, ring_ptr + (slot * W + ring_row) * D)
            k = tl.load(ptrs[:, None] + d[None, :], mask=valid[:, None] & d_ok[None, :], other=0.0)
            m_i, l_i, acc = _online_step(q, k, valid, m_i, l_i, acc, scale, IEEE)
        if HAS_COMP:
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
                k = tl.load(comp_ptr + c[:, None] * D + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
                m_i, l_i, acc = _online_step(q, k, ok, m_i, l_i, acc, scale, IEEE)
        sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
        m = tl.maximum(m_i, sink)
        a = tl.exp(m_i - m)
        tot = l_i * a + tl.exp(sink - m)
        o = acc * (a / tot)[:, None]
        tl.store(out_ptr + (i * NH + h[:, None]) * D + d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=h_ok[:, None] & d_ok[None, :])

    @register_op("prefill_attention", "triton", in_op_table=False)
    def prefill_attention_triton(q, kv, ring, slot: int, p0: int, state_start: int, comp, entries, rate: int,
                                 sink, block_h: int = 32, block_n: int = 32,
                                 num_warps: int | None = None) -> torch.Tensor:
        """Triton prefill attention of one chunk (see the module docstring) -> [n, NH, D] in q's dtype.

        q [n, NH, D], kv [n, D], ring [S, W, D] and comp [C, D] share q's dtype and are contiguous;
        entries [n, K] int64 (-1 padded; None: every visible entry); sink [NH] float32; slot, p0 and
        state_start host ints. `block_h`: heads per program (the dot's M dim); `block_n`: keys per tile
        (powers of two >= 16).
        """
        if q.dim() != 3 or kv.dim() != 2 or ring.dim() != 3 or kv.shape != (q.shape[0], q.shape[2]) \
                or ring.shape[2] != q.shape[2]:
            raise ValueError(f"prefill_attention: q [n, NH, D], kv [n, D] and ring [S, W, D] expected, got "
                             f"{list(q.shape)}, {list(kv.shape)} and {list(ring.shape)}")
        n, NH, D = q.shape
        S, W = ring.shape[0], ring.shape[1]
        named = [("q", q), ("kv", kv), ("ring", ring)] + ([("comp", comp)] if comp is not None else [])
        for name, t in named:
            if not t.is_contiguous():
                raise ValueError(f"prefill_attention: {name} must be contiguous (call .contiguous())")
            if t.dtype != q.dtype:
                raise ValueError(f"prefill_attention: {name} is {t.dtype}, q is {q.dtype} (one dtype)")
        if comp is not None and (comp.dim() != 2 or comp.shape[1] != D):
            raise ValueError(f"prefill_attention: comp must be [C, {D}], got {list(comp.shape)}")
        if sink.shape != (NH,) or sink.dtype != torch.float32:
            raise ValueError(f"prefill_attention: sink must be float32 [{NH}], got {sink.dtype} {list(sink.shape)}")
        if entries is not None:
            if comp is None:
                raise ValueError("prefill_attention: entries without comp")
            if entries.dtype != torch.int64 or entries.dim() != 2 or entries.shape[0] != n \
                    or not entries.is_contiguous():
                raise ValueError(f"prefill_attention: entries must be a contiguous int64 [{n}, K] tensor, got "
                                 f"{entries.dtype} {list(entries.shape)}")
        if not 0 <= slot < S:
            raise ValueError(f"prefill_attention: slot {slot} is not a ring slot (0 .. {S - 1})")
        for name, v in (("block_h", block_h), ("block_n", block_n)):
            if v < 16 or v & (v - 1):
                raise ValueError(f"prefill_attention: {name} must be a power of two >= 16, got {v}")
        if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"prefill_attention needs CUDA tensors (or TRITON_INTERPRET=1), got {q.device}")
        out = torch.empty_like(q)
        if n == 0:
            return out
        has_comp = comp is not None and comp.shape[0] > 0
        sparse = has_comp and entries is not None
        K = entries.shape[1] if sparse else 0
        BLOCK_H = max(16, min(block_h, triton.next_power_of_2(NH)))
        BLOCK_D = max(16, triton.next_power_of_2(D))
        warps = num_warps or (8 if BLOCK_H * BLOCK_D >= 32 * 512 else 4)
        _prefill_attn_kernel[(triton.cdiv(NH, BLOCK_H), n)](
            q, kv, ring, comp if has_comp else ring, entries if sparse else q, sink, out,
            slot, p0, state_start, NH, K, D**-0.5,
            D=D, W=W, RATE=rate if has_comp else 1, HAS_COMP=has_comp, SPARSE=sparse, BLOCK_N=block_n,
            BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=2,
        )
        return out
