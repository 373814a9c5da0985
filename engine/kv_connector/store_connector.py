"""`StoreConnector`: the persistent KV store tier as a `KVConnector` (the contract is `base.py`).

Loads (a prompt's prefix from the store)
----------------------------------------
`get_load(req_id, prompt)`: when the local prefix cache misses part of the prompt, the longest stored
prefix of its full blocks (at least one token is left to compute) is read and checked
(`KVStore.load_prefix_bounded`: bounded by the store's lookup timeout; a store that is down or slow is a
miss) and offered as `KVLoadSpec(num_tokens, with_state=False)`; a prefix no longer than the local hit is
not offered (the local cache serves it). `start_load` copies the payloads into the reserved blocks; the
next `poll()` reports `loaded[req_id] = []`; the engine then rebuilds the bounded state by bounded replay
over the last window of tokens before the loaded prefix and prefills the rest.

NOTE: the read happens inside `get_load`, on the engine's thread, bounded by `lookup_timeout_s`: what a
request's admission may cost is capped, and a corrupt block found on reading shortens the prefix before
the engine commits to its length (a corrupt block is a miss, never a failed request). The engine imports
the whole prefix into fresh blocks, so a prefix partly in the local cache is read in full from the store.

Saves (a computed prompt's full blocks into the store)
------------------------------------------------------
`get_save` pins every n = 1 request; `start_save` gathers the prompt's *full* blocks that the store does
not hold yet out of the pools (one copy, on the engine's thread) and queues them for the store's writer
thread (off the critical path: disk or network never delays the request); the next `poll()` reports the
save, dropping the pin. Prompts with image placeholders are neither loaded nor saved (their KV depends on
the images, which the connector's calls do not carry).

Conversations (a finished request's prompt and answer, from decode)
-------------------------------------------------------------------
`save_computed(token_ids, traffic_class)` writes the full blocks of a token sequence that this instance's
prefix cache holds, skipping what the store has: the decode instance calls it for a finished turn of a
conversation (`decode_worker.core`), so that the next turn (prompt = this prompt + this answer + a new
message) loads the whole conversation on prefill, not just the previous prompt. It needs no pin and no
connector call: a finished request's full blocks stay in the pool as cached blocks (their prefix hashes
registered as they were computed) until an allocation reuses them, and the caller runs right after the
engine step that finished the request, on the engine's thread, before any allocation. Such a connector
serves only this call; the decode engine's connector stays its `PDConnector`.

With a primary connector (`primary=`, e.g. the prefill's `PDConnector`) both run over one engine: the
primary's loads win, its saves run beside the store's (the store's part is done before `start_save`
returns, so the request's `saved` event is the primary's), and its events pass through.

Keys: `kvstore.keys.chain_keys` under `engine_fingerprint(engine)`: model config, weights identity, cache
layout, dtype and numerics options, so another model or configuration never reads these blocks.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from deepinfer.engine.cache.block_pool import BlockPool, hash_block_tokens
from deepinfer.engine.cache.kv_cache import V4KVCache
from deepinfer.engine.kv_connector.base import KVConnector, KVConnectorEvents, KVLoadSpec, KVSaveSpec
from deepinfer.kvstore.keys import chain_keys, store_fingerprint, weights_identity

if TYPE_CHECKING:
    from deepinfer.engine.engine import Engine
    from deepinfer.kvstore.store import KVStore

logger = logging.getLogger("deepinfer.kvstore")

_MAX_TRACKED = 2048
"""Per-request notes (prompt, class) kept at most: a request that ends before its save (an error, an abort
before the prompt was computed) is never reported to the connector, so the oldest notes are dropped here
(which at worst skips one prompt's store write)."""


def engine_fingerprint(engine: Engine) -> bytes:
    """The root of an engine's store keys (see `kvstore.keys.store_fingerprint`)."""
    cache = engine.cache
    pools = {name: (p.num_layers, *p.unit_shape) for name, p in cache.pool_layouts.items() if not p.is_state}
    cfg = engine.config
    numerics = {"attention_backend": cfg.attention_backend, "moe_backend": cfg.moe_backend,
                "fp8_activations": cfg.fp8_activations, "indexer_numerics": cfg.indexer_numerics,
                "batch_invariant": cfg.batch_invariant}
    return store_fingerprint(engine.model_config, block_size=cache.block_size, cache_dtype=str(cache.dtype),
                             pool_shapes=pools, weights_id=weights_identity(str(engine.model_path)), numerics=numerics)


class StoreConnector(KVConnector):
    """Loads stored prefixes on local misses and saves computed prompts' full blocks (module docstring)."""

    def __init__(self, store: KVStore, cache: V4KVCache, fingerprint: bytes, *, block_pool: BlockPool | None = None,
                 image_token_id: int | None = None, primary: KVConnector | None = None) -> None:
        """`block_pool`: the engine's (its prefix hashes tell the local hit; None: no local check).
        `image_token_id`: prompts holding it are skipped. `primary`: a connector this one runs beside."""
        self.store = store
        self.cache = cache
        self.fingerprint = fingerprint
        self.block_size = cache.block_size
        self.block_pool = block_pool
        self.image_token_id = image_token_id
        self.primary = primary
        self._pools = [(name, getattr(cache, name), p) for name, p in cache.pool_layouts.items()
                       if not p.is_state and not p.is_empty]
        self.block_nbytes = sum(p.num_layers * p.unit_nbytes for _, _, p in self._pools)
        """Bytes of one block's payload (every compressed pool and layer)."""
        self._classes: OrderedDict[str, str] = OrderedDict()  # req_id -> traffic class (set by the worker core)
        self._prompts: OrderedDict[str, list[int]] = OrderedDict()  # req_id -> prompt (from get_load), for the save
        self._primary_loads: set[str] = set()
        self._primary_saves: set[str] = set()
        self._store_loads: dict[str, list[memoryview]] = {}  # payloads read in get_load, copied in start_load
        self._loaded: list[str] = []
        self._saved: list[str] = []
        self.num_loaded_tokens: dict[str, int] = {}
        """req_id -> prompt tokens the store served (read by the worker core; popped by `pop_loaded_tokens`)."""

    @classmethod
    def for_engine(cls, engine: Engine, store: KVStore, primary: KVConnector | None = None) -> StoreConnector:
        """A connector over `engine`'s pools, prefix cache and fingerprint (hand it to `set_kv_connector`)."""
        return cls(store, engine.cache, engine_fingerprint(engine), block_pool=engine.kv_manager.block_pool,
                   image_token_id=engine.model_config.image_token_id, primary=primary)

    # ------------------------------------------------------------------ protocol glue (the cores)

    def set_traffic_class(self, req_id: str, traffic_class: str | None) -> None:
        """The traffic class (TTL) of the next `add_request(req_id)`; None: the store's default class."""
        if traffic_class:
            _bounded_set(self._classes, req_id, traffic_class)

    def pop_loaded_tokens(self, req_id: str) -> int:
        """Prompt tokens of `req_id` the store served (0 if none); forgets them."""
        return self.num_loaded_tokens.pop(req_id, 0)

    # ------------------------------------------------------------------ keys and bytes

    def _is_storable(self, prompt: list[int]) -> bool:
        return len(prompt) // self.block_size >= self.store.config.min_blocks and (
            self.image_token_id is None or self.image_token_id not in prompt)

    def _local_hit_blocks(self, prompt: list[int], max_blocks: int) -> int:
        if self.block_pool is None:
            return 0
        bs, h, n = self.block_size, None, 0
        for i in range(max_blocks):
            h = hash_block_tokens(h, prompt[i * bs:(i + 1) * bs])
            if self.block_pool.get_cached_block(h) is None:
                break
            n += 1
        return n

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The payloads of `block_ids`, `[num_blocks, block_nbytes]` uint8 on the CPU (pool by pool, layer-major)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.cache.device)
        parts = []
        for _, tensor, _ in self._pools:
            t = tensor.index_select(1, idx).transpose(0, 1).contiguous()  # [num_blocks, layers, *unit_shape]
            parts.append(t.cpu().view(len(block_ids), -1).view(torch.uint8))
        return torch.cat(parts, dim=1)

    def write_blocks(self, block_ids: list[int], payloads: list) -> None:
        """Copy payloads (`block_nbytes` each) into `block_ids` of every pool."""
        raw = torch.from_numpy(np.stack([np.frombuffer(p, dtype=np.uint8) for p in payloads]))  # [n, block_nbytes]
        if raw.shape[1] != self.block_nbytes:
            raise ValueError(f"stored payloads have {raw.shape[1]} bytes, this cache's blocks {self.block_nbytes}")
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.cache.device)
        off = 0
        for _, tensor, p in self._pools:
            n = p.num_layers * p.unit_nbytes
            part = raw[:, off:off + n].contiguous().view(tensor.dtype).view(len(block_ids), p.num_layers, *p.unit_shape)
            tensor.index_copy_(1, idx, part.transpose(0, 1).to(tensor.device))
            off += n

    # ------------------------------------------------------------------ scheduler side

    def get_load(self, req_id: str, prompt_token_ids: list[int]) -> KVLoadSpec | None:
        if self.primary is not None:
            spec = self.primary.get_load(req_id, prompt_token_ids)
            if spec is not None:
                self._primary_loads.add(req_id)
                return spec
        prompt = list(prompt_token_ids)
        if not self._is_storable(prompt):
            return None
        _bounded_set(self._prompts, req_id, prompt)
        max_blocks = (len(prompt) - 1) // self.block_size  # the engine computes at least the last token
        local = self._local_hit_blocks(prompt, max_blocks)
        if local >= max_blocks:
            return None
        keys = chain_keys(self.fingerprint, prompt, self.block_size, max_blocks)
        payloads = self.store.load_prefix_bounded(keys, self._classes.get(req_id))
        if len(payloads) <= local:
            return None
        self._store_loads[req_id] = payloads
        return KVLoadSpec(len(payloads) * self.block_size, with_state=False)

    def get_save(self, req_id: str) -> KVSaveSpec | None:
        spec = self.primary.get_save(req_id) if self.primary is not None else None
        if spec is not None:
            self._primary_saves.add(req_id)
            return spec
        return KVSaveSpec()

    def abort_load(self, req_id: str) -> str | None:
        if req_id in self._primary_loads:
            self._primary_loads.discard(req_id)
            return self.primary.abort_load(req_id)
        self._store_loads.pop(req_id, None)
        self._forget(req_id)
        return None  # the copy happens inside start_load: nothing can land later

    def abort_save(self, req_id: str) -> bool:
        self._forget(req_id)
        if req_id in self._primary_saves:
            keep = self.primary.abort_save(req_id)
            if not keep:
                self._primary_saves.discard(req_id)
            return keep
        return False

    def _forget(self, req_id: str) -> None:
        self._prompts.pop(req_id, None)
        self._classes.pop(req_id, None)

    # ------------------------------------------------------------------ worker side

    def start_load(self, req_id: str, block_ids: list[int], state_slot: int | None) -> None:
        if req_id in self._primary_loads:
            self.primary.start_load(req_id, block_ids, state_slot)
            return
        payloads = self._store_loads.pop(req_id)
        self.write_blocks(list(block_ids)[:len(payloads)], payloads)
        self.num_loaded_tokens[req_id] = len(payloads) * self.block_size
        self._loaded.append(req_id)

    def start_save(self, req_id: str, block_ids: list[int], state_slot: int | None,
                   output_token_ids: list[int], draft_token_ids: Sequence[int] = ()) -> None:
        if req_id in self._primary_saves:
            drafts = {"draft_token_ids": draft_token_ids} if draft_token_ids else {}
            self.primary.start_save(req_id, block_ids, state_slot, output_token_ids, **drafts)
        else:
            self._saved.append(req_id)
        prompt = self._prompts.pop(req_id, None)
        traffic_class = self._classes.pop(req_id, None)
        if prompt is None or not self._is_storable(prompt):
            return
        try:
            self._save_prompt(prompt, list(block_ids), traffic_class)
        except Exception:  # the store is best effort: a failed save never fails the request
            logger.exception("saving request %s's KV to the store failed", req_id)
            self.store.metrics.dropped()

    def _save_prompt(self, prompt: list[int], block_ids: list[int], traffic_class: str | None) -> int:
        n = min(len(prompt) // self.block_size, len(block_ids))
        keys = chain_keys(self.fingerprint, prompt, self.block_size, n)
        held = self.store.index.present([k.hex() for k in keys], self.store.clock())
        todo = [i for i, k in enumerate(keys) if k.hex() not in held]
        if not todo:
            return 0
        raw = self.read_blocks([block_ids[i] for i in todo])  # [len(todo), block_nbytes]
        blocks = [(keys[i], keys[i - 1] if i else None, raw[j].numpy().tobytes()) for j, i in enumerate(todo)]
        return self.store.put_async(blocks, traffic_class)

    def save_computed(self, token_ids: list[int], traffic_class: str | None = None) -> int:
        """Queue for the store the full blocks of `token_ids` that this instance's prefix cache holds (the
        longest cached prefix; blocks the store has are skipped); returns how many blocks were queued.

        Call on the engine's thread, between engine steps (the blocks of a request that finished in the
        last step are cached but free: the next step's allocations may reuse them). Never raises: a failed
        save is logged and counted as dropped."""
        tokens = list(token_ids)
        if self.block_pool is None or not self._is_storable(tokens):
            return 0
        try:
            bs, h, block_ids = self.block_size, None, []
            for i in range(len(tokens) // bs):
                h = hash_block_tokens(h, tokens[i * bs:(i + 1) * bs])
                block_id = self.block_pool.get_cached_block(h)
                if block_id is None:
                    break
                block_ids.append(block_id)
            if len(block_ids) < self.store.config.min_blocks:
                return 0
            return self._save_prompt(tokens[:len(block_ids) * bs], block_ids, traffic_class)
        except Exception:  # the store is best effort: a failed save never fails the instance
            logger.exception("saving a finished request's KV to the store failed")
            self.store.metrics.dropped()
            return 0

    def poll(self) -> KVConnectorEvents:
        ev = self.primary.poll() if self.primary is not None else KVConnectorEvents()
        for rid in ev.saved:
            self._primary_saves.discard(rid)
        for rid in ev.save_failed:
            self._primary_saves.discard(rid)
        for rid in list(ev.loaded) + list(ev.load_failed):
            self._primary_loads.discard(rid)
        for rid in self._loaded:
            ev.loaded[rid] = []
        for rid in self._saved:
            ev.saved.append(rid)
        self._loaded, self._saved = [], []
        return ev


def _bounded_set(d: OrderedDict, key: str, value) -> None:
    d[key] = value
    d.move_to_end(key)
    while len(d) > _MAX_TRACKED:
        d.popitem(last=False)


def attach_store(engine: Engine, store: KVStore, primary: KVConnector | None = None) -> StoreConnector:
    """Give `engine` a `StoreConnector` over `store` (beside `primary`, if any); returns it.

    NOTE: the engine's owner must call `engine.poll_kv_connector()` before each `step()` (the worker cores
    do; `LLM.generate` does not, so drive an offline engine by hand when a store is attached)."""
    conn = StoreConnector.for_engine(engine, store, primary)
    engine.set_kv_connector(conn)
    return conn
