"""A rank of an instance: its model, its cache, and the commands rank 0 sends it (SPMD).

Every rank, rank 0 included (in the engine's process), runs the same `RankState.run` on the same
command per step; ranks 1..N-1 run `rank_main` in their own process, a loop over commands received
from rank 0 on the control group until `stop`. Commands (`Command.kind`):

  * `step`: run this rank's `RankPlan` (an empty plan: the MoE collectives with zero rows) and sample its
    rows (`engine.distributed.sampling`): returns `(token_ids, logprobs)` of its sampling rows, or None; a
    `SpecRankPlan` (speculative decoding, `engine.distributed.spec`) runs the rank's `SpecDecoding.run_local`
    instead and returns its `LocalSpecResult` (None for an empty plan); one with `tokens_first` (async
    scheduling) hands rank 0 its tokens in a round of their own after the verification (`RankState.tokens_round`,
    a gather on the control group inside the step, every rank, an empty plan's included) and then drafts;
  * `rebalance`: EPLB over the loads measured since the last one (a collective; experts a rank gains are
    sent to it by a rank holding them, `engine.distributed.expert_parallel.move_experts`);
  * `loads`: this rank's per-layer `LayerLoad`s (`payload=True` also resets them);
  * `memory`: what the rank holds (`RankMemory`: its routed experts and their bytes, its KV blocks);
  * `attach`: build the rank's endpoint (`payload = (factory, kwargs)`: `factory(rank, cache, **kwargs)`, a
    picklable callable named by the caller) and return its `describe()`; rank 0's endpoint is set in-process
    by the executor (`payload=None`);
  * `endpoint`: hand `payload` to the rank's endpoint (`endpoint.handle(payload)`) and return its answer (a
    `step` may carry an endpoint payload too, `Command.endpoint`: handled after the forward, in the same round);
  * `stop`: close the endpoint, leave the group and exit.

A rank endpoint is what a layer above the engine runs on every rank over the rank's own cache, driven from
rank 0 through these commands: the KV transfer agents of a multi-rank prefill or decode instance
(`kv_transfer.ranked`, one NIXL agent per rank over the rank's pools). The engine never imports it: the
factory travels pickled by reference and is resolved on the rank. Its contract: `describe()` and
`handle(payload)` return picklable values and never block for long; `close()` releases it.

A failure on a rank is returned as a `RankError` (rank 0 raises it); the rank then exits, since the
group's collectives can no longer line up: the instance fails as a whole.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.engine.distributed.expert_parallel import (
    apply_rebalance,
    held_expert_bytes,
    held_experts_of,
    idle_step,
    install_expert_parallel,
    layer_loads,
    rank_load_kwargs,
)
from deepinfer.engine.distributed.group import GroupAddress, join_group, leave_group, rank_device
from deepinfer.engine.distributed.sampling import to_device
from deepinfer.engine.sampling.sampler import Sampler


@dataclass
class Command:
    """What every rank does next (one per rank, scattered from rank 0)."""

    kind: str
    """step | rebalance | loads | memory | attach | endpoint | stop."""
    payload: Any = None
    """`step`: the rank's `RankPlan`; `loads`: whether to reset the counters; `attach`: `(factory, kwargs)`;
    `endpoint`: what the rank's endpoint handles."""
    endpoint: Any = None
    """`step` only: a payload the rank's endpoint handles right after the step (the step then returns
    `(step result, endpoint answer)`), so endpoint traffic rides the step's round instead of one of its own."""


@dataclass
class RankError:
    """A rank's failure, returned to rank 0 in place of its result."""

    rank: int
    message: str


@dataclass
class RankMemory:
    """What a rank holds (the `memory` command): which routed experts, their bytes, its KV blocks."""

    expert_ids: list[list[int]]
    """Per MoE layer: the routed experts whose weights this rank holds."""
    expert_bytes: int
    num_blocks: int


@dataclass
class RankSpec:
    """How a rank process builds its share of the instance (picklable)."""

    address: GroupAddress
    model_path: str
    load_kwargs: dict
    """`engine.loader.load_checkpoint` keyword arguments (dtype, attention and MoE backends, numerics); the
    device is the rank's own (`rank_device`)."""
    device: str
    """Rank 0's device (`rank_device` derives the others')."""
    batch_invariant: bool
    num_blocks: int
    block_size: int
    num_slots: int
    max_blocks_per_seq: int | None = None
    """The cache's `max_blocks_per_seq` (rank 0's), so every rank's cache has the same geometry."""
    num_redundant_experts: int = 0
    num_threads: int = 1
    """torch intra-op threads of a rank process (the CPU ranks of one host share its cores)."""
    speculative: SpecRankConfig | None = None
    """Speculative decoding on the ranks (they then load the MTP layer and hold a drafter), or None: off."""
    local_ranks: tuple[int, ...] | None = None
    """The ranks rank 0's process starts itself (its node slice, rank 0 excluded); the others are started on their
    nodes (`RankSlice`, by `deploy.rank_slice`) and join at `address`. None = ranks 1..N-1 (one node)."""
    first_local_rank: int = 0
    """The lowest rank of the node slice a rank process runs in (`rank_device`: rank r uses the node's GPU
    r - first_local_rank)."""

    @property
    def spawned_ranks(self) -> tuple[int, ...]:
        """The ranks rank 0's process starts (see `local_ranks`)."""
        return tuple(range(1, self.address.world_size)) if self.local_ranks is None else tuple(self.local_ranks)


@dataclass
class SpecRankConfig:
    """What a rank's `SpecDecoding` needs (rank 0's choices, so every rank computes the same way)."""

    num_draft_tokens: int
    batched_verify: bool
    keep_features: bool
    """Return the drafts' confidence features (rank 0 holds a confidence head)."""
    method: str = "mtp"
    """The drafter (`EngineConfig.speculative`)."""


class RankState:
    """One rank's model, cache and EP backends; runs commands (the same code on every rank)."""

    def __init__(self, rank: int, model, cache, num_redundant_experts: int) -> None:
        """`model` is normally loaded with `rank_load_kwargs` (its experts only, EP backends installed); a model
        loaded whole is wrapped here (each rank then computes only its experts but holds all)."""
        self.rank = rank
        self.model = model
        self.cache = cache
        self.device = cache.device
        self.backends = install_expert_parallel(model, num_redundant_experts)
        self.sampler = Sampler()  # NOTE: draws nothing of its own: rank 0 resolves every row's seed
        self.endpoint = None
        """What a layer above the engine runs on this rank (`attach`), or None."""
        self.spec = None
        """The rank's `engine.spec_decode.SpecDecoding` (drafter, rollback over its own cache) with speculative
        decoding on (rank 0's is the engine's), or None."""
        self.tokens_round = None
        """`tokens_round(obj)`: hands rank 0 this rank's tokens of a `tokens_first` speculative step (its
        `LocalSpecResult` without drafts, None for an empty plan, or a `RankError`) and blocks until every rank has
        (a gather on the control group; rank 0's executor sets its own per step), or None: not set."""

    def make_spec(self, config: SpecRankConfig) -> None:
        """Give this rank its speculative-decoding state (ranks 1..N-1; rank 0 shares the engine's)."""
        from deepinfer.engine.spec_decode import SpecDecoding

        self.spec = SpecDecoding(self.model, self.cache, self.sampler, self.cache.num_slots, config.num_draft_tokens,
                                 config.method, batched_verify=config.batched_verify)
        if config.keep_features:
            self.spec.drafter.keep_features = True

    @torch.inference_mode()
    def run(self, cmd: Command):
        """Blocks while this rank runs `cmd` (collectives with the other ranks); its result."""
        if cmd.kind == "step":
            result = self._step(cmd.payload)
            if cmd.endpoint is None:
                return result
            return result, self.endpoint.handle(cmd.endpoint)  # NOTE: after the forward, as one round
        if cmd.kind == "rebalance":
            return [p.phy2log for p in apply_rebalance(self.model, self.backends)]
        if cmd.kind == "loads":
            return layer_loads(self.backends, reset=bool(cmd.payload))
        if cmd.kind == "memory":
            return RankMemory(held_experts_of(self.model), held_expert_bytes(self.model), self.cache.num_blocks)
        if cmd.kind == "attach":
            if cmd.payload is not None:
                if self.endpoint is not None:
                    raise RuntimeError(f"rank {self.rank} already has an endpoint")
                factory, kwargs = cmd.payload
                self.endpoint = factory(self.rank, self.cache, **kwargs)
            if self.endpoint is None:
                raise RuntimeError(f"rank {self.rank} has no endpoint to describe")
            return self.endpoint.describe()
        if cmd.kind == "endpoint":
            if self.endpoint is None:
                raise RuntimeError(f"rank {self.rank} has no endpoint (attach one first)")
            return self.endpoint.handle(cmd.payload)
        raise ValueError(f"unknown rank command {cmd.kind!r}")

    def _step(self, plan):
        if getattr(plan, "tokens_first", False):
            return self._spec_step_tokens_first(plan)
        if plan.is_empty:
            idle_step(self.model)
            return None
        if hasattr(plan, "verify"):  # a `SpecRankPlan`: verify and draft this rank's requests
            from deepinfer.engine.distributed.spec import to_host

            if self.spec is None:
                raise RuntimeError(f"rank {self.rank} got a speculative step but has no speculative decoding state")
            return to_host(self.spec.run_local(plan.build_step(self.model, self.cache, self.device)))
        logits = self.model.step(plan.build(self.model, self.cache, self.device), self.cache)
        if plan.sampling is None:
            return None
        sampled = self.sampler.sample(logits, to_device(plan.sampling, logits.device))
        return sampled.sampled_token_ids.tolist(), sampled.request_logprobs()

    def _spec_step_tokens_first(self, plan):
        """A speculative step under async scheduling: verify (or, without requests, join the MoE collectives),
        hand rank 0 the tokens (`tokens_round`), then draft; returns the rank's full `LocalSpecResult` (None for an
        empty plan). Rank 0 postprocesses the tokens while the ranks draft, as `SpecExecutor(overlap_drafting)`
        does in one process.

        NOTE: every rank joins the tokens round whatever happened before it (a failure is sent as a `RankError`,
        then raised, so the step's final round carries it too): the rounds of the group must line up."""
        from deepinfer.engine.distributed.spec import to_host, tokens_only

        step = verified = None
        try:
            if plan.is_empty:
                idle_step(self.model)
                early = None
            else:
                if self.spec is None:
                    raise RuntimeError(f"rank {self.rank} got a speculative step but has no speculative decoding "
                                       "state")
                step = plan.build_step(self.model, self.cache, self.device)
                verified = self.spec.verify_local(step)
                early = tokens_only(verified, len(plan.verify))
        except Exception:
            self.tokens_round(RankError(self.rank, traceback.format_exc()))
            raise
        self.tokens_round(early)
        if verified is None:
            return None
        return to_host(self.spec.draft_local(step, verified))


def _load_rank(spec: RankSpec, rank: int) -> RankState:
    from deepinfer.engine.cache.kv_cache import V4KVCache
    from deepinfer.engine.loader import load_checkpoint, read_checkpoint_config

    device = rank_device(spec.device, rank, spec.first_local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mc, _ = read_checkpoint_config(spec.model_path)
    model, mc = load_checkpoint(spec.model_path, device=str(device), **spec.load_kwargs,
                                **rank_load_kwargs(mc, spec.address.world_size, rank, spec.num_redundant_experts,
                                                   spec.batch_invariant, load_mtp=spec.speculative is not None))
    if spec.batch_invariant:
        from deepinfer.engine.batch_invariant import enable_batch_invariant

        enable_batch_invariant(model)
    dtype = model.model.embed_tokens.weight.dtype
    max_len = spec.max_blocks_per_seq * spec.block_size if spec.max_blocks_per_seq else None
    cache = V4KVCache(mc, spec.num_blocks, spec.block_size, spec.num_slots, dtype=dtype, device=device,
                      max_model_len=max_len)
    return model, cache


def _exit_with_parent(parent_pid: int, interval_s: float = 1.0) -> None:
    """Ends this rank process once rank 0's process is gone (killed: it could not stop us), instead of leaving it
    blocked in a collective until the group's timeout; its NIXL registrations go with it."""
    while True:
        time.sleep(interval_s)
        if os.getppid() != parent_pid:
            os._exit(1)


def rank_main(rank: int, spec: RankSpec, ready=None) -> None:
    """Blocks for the life of rank `rank` (>= 1) of an instance: load, join the group, run commands until
    `stop` or a failure. The entry point of a rank process.

    `ready` (a multiprocessing queue) gets `(rank, None)` once the rank has loaded, or `(rank, traceback)`
    when loading failed, so rank 0 never waits for a rank that will not come.
    """
    torch.set_num_threads(spec.num_threads)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="parent-watch", daemon=True).start()
    try:
        model, cache = _load_rank(spec, rank)
    except BaseException:
        if ready is not None:
            ready.put((rank, traceback.format_exc()))
        raise
    if ready is not None:
        ready.put((rank, None))
    ctrl = join_group(spec.address, rank)
    state = None
    try:
        state = RankState(rank, model, cache, spec.num_redundant_experts)
        if spec.speculative is not None:
            state.make_spec(spec.speculative)
            state.tokens_round = lambda obj: dist.gather_object(obj, None, dst=0, group=ctrl)
        while True:
            box = [None]
            dist.scatter_object_list(box, None, src=0, group=ctrl)
            cmd: Command = box[0]
            if cmd.kind == "stop":
                break
            try:
                result = state.run(cmd)
            except Exception:
                result = RankError(rank, traceback.format_exc())
            dist.gather_object(result, None, dst=0, group=ctrl)
            if isinstance(result, RankError):
                break
    finally:
        if state is not None and state.endpoint is not None:
            try:
                state.endpoint.close()
            except Exception:  # the process exits anyway: its registrations go with it
                traceback.print_exc()
        leave_group()


def wait_ranks_loaded(ready, ranks, procs, timeout_s: float | None = None) -> None:
    """Blocks until every rank of `ranks` has reported on `ready` (what `rank_main` puts there once loaded:
    `(rank, None)`, or `(rank, traceback)`); raises RuntimeError with the traceback when a rank failed, when one of
    `procs` died first, or (`timeout_s`, None: no limit) when the ranks took longer."""
    import queue

    pending = set(ranks)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        if deadline is not None and time.monotonic() > deadline:
            raise RuntimeError(f"ranks {sorted(pending)} did not load within {timeout_s:.0f} s")
        try:
            rank, error = ready.get(timeout=1.0)
        except queue.Empty:
            dead = [p.name for p in procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"rank process(es) {', '.join(dead)} exited while loading") from None
            continue
        if error is not None:
            raise RuntimeError(f"rank {rank} failed to load:\n{error}")
        pending.discard(rank)


class RankSlice:
    """The rank processes of one node slice of a group spanning nodes (not rank 0's: the engine starts those):
    spawned here, each running `rank_main`, joining the group at `spec.address` (rank 0's node).

    NOTE: the processes die with this one (`_exit_with_parent`), so killing a node slice's actor kills its ranks;
    the group's collectives then fail on every other rank and the instance fails as a whole."""

    def __init__(self, spec: RankSpec, ranks: range | list[int]) -> None:
        import dataclasses

        import torch.multiprocessing as mp

        ranks = list(ranks)
        if not ranks or min(ranks) < 1 or max(ranks) >= spec.address.world_size:
            raise ValueError(f"a node slice holds ranks within 1..{spec.address.world_size - 1}, got {ranks}")
        spec = dataclasses.replace(spec, first_local_rank=min(ranks))
        self.ranks = ranks
        ctx = mp.get_context("spawn")
        self._ready = ctx.Queue()
        self.procs = [ctx.Process(target=rank_main, args=(r, spec, self._ready), name=f"deepinfer-rank{r}",
                                  daemon=True) for r in ranks]
        for p in self.procs:
            p.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait_loaded(self, timeout_s: float = 600.0) -> None:
        """Blocks until every rank of the slice has loaded (they then wait in the group's rendezvous); raises
        RuntimeError with a rank's traceback if one failed or died first."""
        wait_ranks_loaded(self._ready, self.ranks, self.procs, timeout_s)

    def alive(self) -> list[bool]:
        return [p.is_alive() for p in self.procs]

    def kill(self) -> None:
        """Ends the slice's rank processes (SIGKILL: a rank stuck in a collective ignores nothing less)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)
