"""engine.distributed: an instance as a group of ranks (attention data parallelism, MoE expert parallelism).

  * `group`: joining the rank group (torch.distributed: gloo on CPU ranks, NCCL on GPUs; control on gloo).
  * `plan`: cutting the engine's step into one `RankPlan` per rank (a request runs on the rank owning
    its state slot; each rank owns its requests' KV, in rank-local block and slot ids).
  * `kv_pools`: the per-rank KV pools behind rank 0's one scheduler (block ids carry their rank; a new
    request goes to the rank holding its prefix when it has room; prefix caching works with EP > 1).
  * `expert_parallel`: the rank side of EP: loading only a rank's routed experts (`rank_load_kwargs`),
    wrapping each MoE layer in `engine.moe.ep_backend`'s `ExpertParallelMoEBackend`, the zero-row dummy
    step of a rank without work, EPLB re-placement (moving expert weights between ranks) and the measured
    loads (`engine.moe.eplb`).
  * `worker`: a rank's state and the command loop of ranks 1..N-1 (SPMD).
  * `spec`: speculative decoding over the ranks (`SpecRankPlan`s, rank 0 merges and schedules the verifies).
  * `executor`: `MultiRankExecutor`, the `engine.executor` seam's multi-rank executor ("multirank"),
    picked when `EngineConfig.expert_parallel_size > 1`.

The stages see ranks: a prefill or decode worker with `expert_parallel_size > 1` gives every rank its own
KV transfer agent over the rank's pools (`kv_transfer.ranked`, attached as rank endpoints of the executor:
`worker`'s `attach` / `endpoint` commands), its KV connector maps the scheduler's global block ids to a rank
(`kv_pools.locate_blocks`), and its load report carries each rank's load (`kv_pools.rank_loads`), by which
the decode balancer picks an (instance, rank) (`RankedKVCacheManager.prefer_rank`).

Speculative decoding runs over the ranks too (`spec`: each rank verifies and drafts its own requests, rank 0
decides the verify schedule for the whole batch).

Async scheduling (`async_scheduling`, the default on CUDA) overlaps rank 0's scheduling and output processing
with the ranks' steps (`executor`: the command rounds run on one worker thread of rank 0, in submission order;
with speculative decoding the tokens come back before the drafts, as in one process).

`check_config` holds the configuration rules of a multi-rank instance (called by `EngineConfig`). Not
supported yet with EP > 1 (refused with a message): prompt logprobs, KV loads / holds by hand (`reserve_kv`,
`hold_kv`: they name one pool's bytes) and connectors that do not serve ranks (`KVConnector.serves_ranks`: the
KV store's today).
"""

from __future__ import annotations


def check_config(config) -> None:
    """Raise ValueError (saying how to fix it) when `config` (an `EngineConfig` with
    `expert_parallel_size > 1`) asks for something a multi-rank instance does not support yet."""
    if config.local_ranks is not None and config.local_ranks > config.expert_parallel_size:
        raise ValueError(f"local_ranks ({config.local_ranks}) is the ranks on rank 0's node, at most "
                         f"expert_parallel_size ({config.expert_parallel_size})")
    if config.rank_group_address:
        from deepinfer.engine.distributed.group import parse_address

        parse_address(config.rank_group_address)
    if config.executor not in (None, "multirank"):
        raise ValueError(f"expert_parallel_size > 1 runs on the 'multirank' executor, not {config.executor!r}; "
                         "leave executor unset")
