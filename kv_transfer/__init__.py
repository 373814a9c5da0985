"""kv_transfer: the data plane that moves a request's compressed KV from a prefill process into
the blocks a decode process reserved for it, with NIXL (UCX backend). This docstring is the spec.

Pieces
------
One `KVTransferAgent` per process (per rank of an instance) wraps one NIXL agent over that
process's `V4KVCache`; a multi-rank instance (expert parallelism) holds one per rank, each over its
rank's own pools, which `kv_transfer.ranked.RankedAgents` drives from rank 0 as one agent in the
instance's global block ids (a decode reservation names the agent of the rank holding the KV, and a
prefill sends from the rank that computed it: `ranked.py`'s docstring). At construction it registers every non-empty compressed pool
(`csa_entries`, `index_entries`, `hca_entries`; and the bounded-state tensors with
`send_state=True`) as NIXL memory, `DRAM` for CPU tensors and `VRAM` for CUDA ones. The tensors
stay registered for the agent's life: the engine never reallocates them.

The regions are the cache layout's descriptors (`engine.cache.layout.PoolLayout`, via
`V4KVCache.pool_layouts`): this package derives no byte arithmetic of its own. Only descriptors
travel on the control plane (gRPC, `protos/`): an agent's `metadata()` (opaque NIXL bytes) and
`layout()` (a `deepinfer.v1.KVLayout`, `protos/kv_transfer.proto`: per region address, size,
memory type, device, layers, units, bytes per unit, is_state; `pool_layout()` is the same as a
plain dict), and per request the block ids, the transfer id and the lease. Bytes move only
through NIXL, by WRITE from the prefill side (the initiator) into the decode side's memory.

Who calls what, and when
------------------------
Handshake, once per pair (membership): a decode agent publishes `metadata()` and `layout()`;
every prefill agent that may send to it calls `add_peer(name, metadata, layout)`, which refuses a
peer whose blocks differ from ours (model, dtype or block size). The decode side needs nothing
from the prefill side: NIXL delivers notifications over the connection the initiator opened.

Per request (transfer id: the request id, plus an attempt number when retried; never reused):

The engine drives all of this through its KV connector (`engine/kv_connector/base.py`):
`PDConnector` (`pd_connector.py`) is the NIXL-driving half that turns the engine's load / save
calls into the agent calls below.

1. Decode D: the engine reserves the destination blocks for a load and `PDConnector.start_load`
   calls `expect(transfer_id, dst_block_ids, lease_s)`; D answers the entrypoint with its agent
   name, the block ids and the lease time left.
2. Prefill P: prefills the request and keeps it (and its blocks) alive; then
   `send_blocks(transfer_id, peer, src_block_ids, dst_block_ids, notify, lease_s=...)` posts one
   WRITE for all pools x layers x blocks (consecutive ids coalesced) whose completion carries a
   notification with the transfer id and `notify` (`PDConnector`: a serialized
   `deepinfer.v1.KVTransferNotice` with the first sampled token, the only channel that carries it to
   D). It returns at
   once; it raises `ValueError` only for bad arguments (unknown peer, ids out of range).
3. Both sides call `poll()` once per loop iteration; it never blocks and returns
   `KVTransferEvents`, where each transfer id appears exactly once, in exactly one list. The
   receiver must poll while it expects anything, not only to see notifications: UCX needs the
   receiver's progress to wire up a new connection (first transfer) and, over TCP, to complete
   the WRITE itself.

   - P `sent_ids`: finished. NIXL reports the WRITE DONE: the bytes are at the destination and
     the source blocks may be freed (finish/abort the request on P; report success).
   - P `send_failed_ids`: failed (peer gone, transport error) or still running at the end of its
     lease (the handle is released, which cancels it where the backend can). Free the source
     blocks and tell the entrypoint, which aborts the request on D and retries or fails it.
   - D `received_ids` (+ `payloads`): finished. The notification arrived, and NIXL sends it only
     after the transfer's data, so the bytes are in the reserved blocks: the connector reports the
     load and the engine commits the request (`Engine.commit_kv`).
     The bounded state is then rebuilt by bounded replay (DESIGN.md §4).
   - D `expired_ids`: no notification within the lease. Free the blocks (`abort_request`) and
     tell the entrypoint.

A notification that arrives before its `expect` (the two can cross on the control plane) waits
`unmatched_notif_ttl_s`; `cancel_expect` drops a reservation when D aborts the request itself.

Leases, timeouts and dead peers
-------------------------------
- Prefill dies (or never sends): no notification comes; D's lease expires, D frees the blocks.
  Nothing stays stranded on D.
- Decode dies: P's WRITE fails. With UCX on one host, `transfer` raises
  `NIXL_ERR_REMOTE_DISCONNECT` at once, or the transfer state turns ERR; either way the id comes
  out in `send_failed_ids`. Where the WRITE hangs instead (a hung receiver that cannot finish
  the connection wire-up, RDMA to a silent host), P's lease bounds it. Nothing stays stranded on P.
- NOTE (lease order): a posted WRITE cannot be recalled, so D must not hand its blocks to another
  request while P may still write into them. P's lease must therefore end before D's: the
  entrypoint passes D's remaining lease minus a margin (network latency plus the time to cancel)
  as P's `lease_s`, and D's lease covers the queueing and prefill time before the send too.
  Freeing P's *source* blocks early is harmless by comparison: they stay registered, so a late
  read can only spoil a destination that is already failed.

Bounded state
-------------
Not moved by default: D rebuilds it by bounded replay. `KVTransferAgent(..., send_state=True)` on
both sides also registers the per-slot tensors (`V4KVCache.state_tensors()`, slot = dim 1, so one
contiguous range per tensor and layer), and `send_blocks(..., src_slot=, dst_slot=)` moves one
request's slot with its blocks in the same WRITE (`expect(..., dst_slot=)` counts its bytes); a
load with `KVLoadSpec(with_state=True)` then skips the bounded replay. A drafter with per-slot state (DeepSeek-V4.1's
DSpark rings, `dspark_keys`) adds it to the cache's state tensors, so it moves too; `add_peer` refuses a peer that
keeps state this side lacks (its slot would be left stale), and a send leaves out state the peer does not keep.

Progress, threads and UCX
-------------------------
An agent is not thread-safe: one thread (the engine loop) calls it. NIXL's progress thread is off
by default (the Python wrapper runs it with zero delay, so it spins one CPU core); all progress
happens in `poll()`. UCX reads its settings from the environment when the agent starts; pass them
as `ucx_env`. `LOOPBACK_UCX_ENV` (`UCX_TLS=cma,tcp,self`, `UCX_NET_DEVICES=lo`) keeps processes
on one host on loopback: tcp carries wire-up and notifications (NIXL needs a transport with peer
failure handling, which UCX's shared-memory transports lack), cma carries the data. Clusters
leave UCX_TLS unset so UCX picks RDMA (and GPU memory) where present. Caches on a GPU (pools registered
as VRAM) need CUDA transports instead: `LOOPBACK_CUDA_UCX_ENV` (`UCX_TLS=cuda_copy,cuda_ipc,tcp,self`);
`loopback_ucx_env(device)` picks one of the two by the engine's device (what `--loopback-ucx` workers use).
With cuda_ipc the receiver must keep calling `poll()` until the notification arrives (UCX needs its
progress for the wire-up): a decode instance's loop polls every millisecond while it expects a transfer.

Image embeddings
----------------
`kv_transfer.embeddings` (`EmbeddingAgent`) moves a vision instance's image embeddings into a
prefill instance by NIXL READ (the prefill is the initiator), with the same rules: descriptors on
the control plane (`deepinfer.v1.ImageEmbeddings`), bytes only over NIXL; its docstring is the
contract.

Metrics
-------
`stats()` returns Prometheus-style names: `kv_transfer_{sent,received}_{bytes,blocks}_total`,
`kv_transfer_sends_{done,failed}_total`, `kv_transfer_recvs_{done,expired}_total`,
`kv_transfer_notifs_unmatched_total`, `kv_transfer_send_seconds_{sum,count}` (post to DONE on the
sender), `kv_transfer_sent_bytes_{dram,vram}_to_{dram,vram}_total` (completed sends by source and
destination memory type: a GPU pair moves VRAM -> VRAM), gauges `kv_transfer_inflight_sends`,
`kv_transfer_pending_recvs` and `kv_transfer_registered_{dram,vram}_bytes`, and
`kv_transfer_send_seconds_recent` (the last 256 durations).
"""

from deepinfer.kv_transfer.agent import (
    LOOPBACK_CUDA_UCX_ENV,
    LOOPBACK_UCX_ENV,
    KVTransferAgent,
    KVTransferEvents,
    RegionLayout,
    block_runs,
    decode_notif,
    encode_notif,
    layout_from_wire,
    loopback_ucx_env,
)
from deepinfer.kv_transfer.pd_connector import KVDestination, PDConnector, decode_notice, encode_notice

__all__ = [
    "LOOPBACK_CUDA_UCX_ENV",
    "LOOPBACK_UCX_ENV",
    "KVDestination",
    "KVTransferAgent",
    "KVTransferEvents",
    "PDConnector",
    "RegionLayout",
    "block_runs",
    "decode_notice",
    "decode_notif",
    "encode_notice",
    "encode_notif",
    "layout_from_wire",
    "loopback_ucx_env",
]
