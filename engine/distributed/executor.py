"""`MultiRankExecutor`: an instance as a group of ranks (attention data-parallel, experts expert-parallel).

The engine's process is rank 0: it holds the scheduler view (`Engine`), prepares each step as usual,
and this executor runs it over the group: `split_step` cuts the batch into one `RankPlan` per rank
(a request runs on the rank owning its state slot, `rank_of_slot`), rank 0 scatters the plans over
the control group, every rank runs its plan (the same `RankState.run`: SPMD; a rank without requests
joins the MoE collectives with zero rows), each rank samples its own rows (rank 0 resolves the
unseeded rows' seeds with its sampler first, `engine.distributed.sampling`, so every token is drawn
exactly as the single-process engine draws it), and rank 0 gathers the token ids and logprobs in the
step's sampling order. Ranks 1..N-1 are processes this executor starts (`spawn`) and stops; in a group spanning
nodes (`EngineConfig.local_ranks` < N) only its own node slice's, the others' being started on their nodes
(`deploy.rank_slice`) from the `RankSpec` this executor publishes in the group's store at `rank_group_address`.

Overlapped scheduling (`async_scheduling=True`, the default on CUDA, `engine.executor.resolve_async_scheduling`):
the same contract as the threaded executor. `max_inflight = 2` and `submit` only queues the step on one worker
thread of rank 0 (`engine-ranks`), which cuts it into plans, scatters them, runs rank 0's share and gathers the
tokens; the engine meanwhile schedules step N+1 and postprocesses step N (stop checks, detokenization, the
scheduler's update). Every command round (steps, EPLB, loads, memory, endpoints) runs on that thread, one at a
time in submission order, so every rank runs the same commands in the same order; a command called from another
thread (`rebalance_experts`, `expert_loads`, `call_endpoints`, ...) waits for the steps submitted before it and
runs before the later ones, when no step is in flight on any rank. No rank runs ahead: the engine builds step
N+1 from step N's tokens (it waits for them), so a plan never depends on results a rank has not produced.
Without it (`async_scheduling=False`, the CPU default), `max_inflight = 1` and the step runs inside `submit`.
The counters `num_submitted`, `num_finished` and `max_steps_in_flight` show the overlap.

Speculative decoding (`spec=` the engine's `SpecDecoding`): a `SpecPreparedStep` is split into `SpecRankPlan`s,
every rank verifies and drafts its own requests, and rank 0 merges their results and decides the verify schedule
(`engine.distributed.spec`). With async scheduling, as in one process (`SpecExecutor(overlap_drafting=True)`): the
step's future is done once every rank's tokens are in (a round of their own inside the step), the drafts follow
(`PendingSpecStepResult`), and `max_inflight` is 1 (the next step is scheduled from the drafts: one sync point a
step).

Memory: each rank holds its own routed experts only (loaded that way, `expert_parallel.rank_load_kwargs`)
and its own KV pool (`num_blocks` blocks and its share of the state slots, `kv_pools`); `rank_memory()`
reports what each rank holds.

EPLB: `rebalance_experts()` (or every `eplb_interval_steps` steps, right after the step's result is handed to the
engine) re-places each MoE layer's experts from the loads measured since the last rebalance, moving the weights a
rank gains from a rank that holds them, always between two steps' rounds; `expert_loads()` returns the measured
loads and the imbalance (max / mean rows per rank per MoE layer), the metric EPLB drives down.

Rank endpoints: `attach_endpoints(factory, kwargs, local)` gives every rank an endpoint over its own cache (rank
0's is `local`, built in this process; ranks 1..N-1 build theirs with `factory`, `worker` module docstring) and
`call_endpoints(payloads)` hands each rank's endpoint its payload, between steps, as one command round; with
`step_payloads` every step also carries a payload per rank (handled after the forward, in the step's own
round: no extra round while steps run), whose answers `take_endpoint_results` returns. The KV transfer agents
of a multi-rank prefill or decode instance run that way (`kv_transfer.ranked`): rank 0's KV connector
coordinates them through the step plan; the executor never looks inside the payloads.

Failures: an exception on any rank (or a rank process that died) fails the step's future and the
executor: the group's collectives cannot line up again, so the instance fails as a whole and must be
restarted (a new engine). `watch_ranks(callback)` finds a rank process's death between steps too (an idle
instance runs no collective that would fail): a daemon thread waits on the rank processes and, when one exits
while the executor is open, fails the executor and calls `callback(error)` (a serving shell exits its process
then, so its supervisor restarts the group as a whole, `serving.shell.EngineShell`).

NOTE: only token ids and per-row logprobs travel back to rank 0 (over the gloo control group), never
`[rows, vocab]` logits.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deepinfer.engine.distributed.expert_parallel import LayerLoad, imbalance_of
from deepinfer.engine.distributed.group import GroupAddress, backend_for, free_port, join_group, leave_group
from deepinfer.engine.distributed.plan import split_step
from deepinfer.engine.distributed.sampling import resolve_seeds, select_rows
from deepinfer.engine.distributed.spec import merge_spec_results, split_spec_step
from deepinfer.engine.distributed.worker import (
    Command,
    RankError,
    RankSpec,
    RankState,
    SpecRankConfig,
    rank_main,
    wait_ranks_loaded,
)
from deepinfer.engine.executor import Executor, PreparedStep, StepResult, resolve_async_scheduling

if TYPE_CHECKING:
    from deepinfer.engine.engine import EngineConfig
    from deepinfer.engine.model_runner import ModelRunner
    from deepinfer.engine.sampling import Sampler
    from deepinfer.engine.spec_decode import SpecDecoding

logger = logging.getLogger(__name__)


@dataclass
class ExpertLoads:
    """Measured MoE load of an instance since the counters last restarted."""

    per_rank: list[list[LayerLoad]]
    """`per_rank[rank][layer]`: that rank's counts."""
    imbalance: list[float]
    """Per MoE layer: max / mean rows computed per rank (1.0 is perfect balance)."""

    @property
    def mean_imbalance(self) -> float:
        return sum(self.imbalance) / len(self.imbalance)

    def expert_counts(self, layer: int) -> list[int]:
        """(token, expert) pairs per logical expert of `layer`, summed over the ranks."""
        return [sum(c) for c in zip(*(r[layer].expert_counts for r in self.per_rank))]


class MultiRankExecutor(Executor):
    """Runs each step over a group of `world_size` ranks (see the module docstring)."""

    max_inflight = 1

    @classmethod
    def from_config(cls, config: EngineConfig, runner: ModelRunner, sampler: Sampler,
                    spec: SpecDecoding | None = None) -> MultiRankExecutor:
        """The executor for `config.expert_parallel_size` ranks over the engine's model and cache (rank 0);
        `spec`: the engine's speculative decoding (rank 0's), or None."""
        from deepinfer.engine.hub import resolve_model

        cache = runner.cache
        load_kwargs = dict(dtype=config.dtype, attention_backend=config.attention_backend,
                           moe_backend=config.moe_backend, fp8_activations=config.fp8_activations,
                           indexer_numerics=config.indexer_numerics)
        world = config.expert_parallel_size
        spec_config = None if spec is None else SpecRankConfig(
            spec.num_draft_tokens, spec.batched_verify, getattr(spec.drafter, "keep_features", False),
            config.speculative)
        if config.rank_group_address:  # a group spanning nodes: rank 0's node IP and port, picked by the launcher
            from deepinfer.engine.distributed.group import parse_address

            host, port = parse_address(config.rank_group_address)
        else:
            host, port = "127.0.0.1", free_port()
        local = config.local_ranks or world
        rank_spec = RankSpec(
            address=GroupAddress(host, port, world, backend_for(config.device)),
            local_ranks=None if local >= world else tuple(range(1, local)),
            model_path=str(resolve_model(config.model, config.revision)), load_kwargs=load_kwargs,
            device=config.device, batch_invariant=config.batch_invariant, num_blocks=cache.num_blocks,
            block_size=cache.block_size, num_slots=cache.num_slots, max_blocks_per_seq=cache.max_blocks_per_seq,
            num_redundant_experts=config.num_redundant_experts,
            num_threads=max(1, (os.cpu_count() or 1) // local), speculative=spec_config,
        )
        return cls(runner, sampler, rank_spec, eplb_interval_steps=config.eplb_interval_steps, spec_decoding=spec,
                   async_scheduling=resolve_async_scheduling(config.async_scheduling, config.device))

    def __init__(self, runner: ModelRunner, sampler: Sampler, spec: RankSpec, eplb_interval_steps: int = 0,
                 spec_decoding: SpecDecoding | None = None, async_scheduling: bool = False) -> None:
        """Blocks until ranks 1..N-1 are started, loaded and joined with this process (rank 0).
        `spec_decoding`: rank 0's speculative decoding (with `spec.speculative` set), or None;
        `async_scheduling`: overlap the engine's host work with the ranks' steps (module docstring)."""
        if (spec_decoding is None) != (spec.speculative is None):
            raise ValueError("pass spec_decoding exactly when the rank spec has speculative set")
        super().__init__(runner, sampler)
        if runner.device.type == "cuda":
            torch.cuda.set_device(runner.device)  # NCCL binds rank 0's communicator to the current device
        self.spec = spec
        self.world_size = spec.address.world_size
        self.eplb_interval_steps = eplb_interval_steps
        self.async_scheduling = async_scheduling
        self.max_inflight = 2 if async_scheduling and spec_decoding is None else 1
        """2 with async scheduling (1 with speculative decoding: its drafts are the step's sync point), else 1."""
        self._pool = None
        self._pool_thread: threading.Thread | None = None
        if async_scheduling:  # NOTE: one thread runs every command round, so the ranks see them in one order
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-ranks",
                                            initializer=self._init_pool_thread, initargs=(runner.device,))
        self.num_submitted = 0
        """Steps submitted."""
        self.num_finished = 0
        """Steps whose run over the ranks has ended (tokens and drafts in, or failed)."""
        self.max_steps_in_flight = 0
        """The most steps submitted and not yet finished at once (2: a step was queued behind a running one)."""
        self._count_lock = threading.Lock()
        self._queued: set[Future] = set()
        """Futures `submit` handed out whose run has not started (under `_count_lock`): `close` cancels them."""
        self._num_steps = 0
        self._is_closed = False
        self._failure: BaseException | None = None
        self._step_payloads = None  # `attach_endpoints`: what each step carries to the rank endpoints
        self._endpoint_results: list[list] = []
        store = None
        if len(spec.spawned_ranks) < self.world_size - 1:  # a group spanning nodes: the other slices read the spec
            from deepinfer.engine.distributed.group import host_store, publish

            store = host_store(spec.address)
            publish(store, spec)
        ctx = mp.get_context("spawn")
        ready = ctx.Queue()
        self._procs = [ctx.Process(target=rank_main, args=(r, spec, ready), name=f"deepinfer-rank{r}", daemon=True)
                       for r in spec.spawned_ranks]  # NOTE: the other node slices' ranks start on their nodes
        for p in self._procs:
            p.start()
        try:
            self._wait_ready(ready)
            self._ctrl = join_group(spec.address, 0, store=store)
            self.state = RankState(0, runner.model, runner.cache, spec.num_redundant_experts)
            self.state.spec = spec_decoding
        except BaseException:
            self._kill()
            raise

    def watch_ranks(self, callback) -> None:
        """Call `callback(error)` once (from a daemon thread) when a rank process exits while this executor is
        open; the executor is failed first (every later step raises). See the module docstring."""
        from multiprocessing.connection import wait

        def run() -> None:
            ended = wait([p.sentinel for p in self._procs])
            if self._is_closed:
                return
            gone = [p for p in self._procs if p.sentinel in ended]
            for p in gone:
                p.join(timeout=1.0)  # reaps it, so its exit code is known
            dead = ", ".join(f"{p.name} (exit code {p.exitcode})" for p in gone)
            error = RuntimeError(f"rank process {dead} died; the instance fails as a whole")
            if self._failure is None:
                self._failure = error
            callback(error)

        if self._procs:
            threading.Thread(target=run, name="rank-watch", daemon=True).start()

    def _wait_ready(self, ready) -> None:
        """Blocks until every rank process has loaded; raises RuntimeError with a rank's traceback if it failed
        or died first."""
        wait_ranks_loaded(ready, self.spec.spawned_ranks, self._procs)

    # ------------------------------------------------------------------ SPMD commands

    def _run_all(self, commands: list[Command], on_tokens=None) -> list:
        """Blocks while every rank runs its command (rank 0 here); the ranks' results, by rank. Raises
        RuntimeError (and fails the executor) when a rank fails or has died. Runs on the thread of the command
        rounds (`_call`). `on_tokens(parts)`: a `tokens_first` speculative step's tokens round, by rank (a
        `RankError` where a rank failed), handed over while the ranks go on drafting."""
        if self._failure is not None:
            raise RuntimeError("the rank group failed earlier; create a new engine") from self._failure
        try:
            dead = [p.name for p in self._procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"rank process(es) {', '.join(dead)} died; the instance fails as a whole")
            box = [None]
            dist.scatter_object_list(box, commands, src=0, group=self._ctrl)
            if on_tokens is not None:
                self.state.tokens_round = lambda mine: self._tokens_round(mine, on_tokens)
            try:
                mine = self.state.run(box[0])
            except Exception as e:  # NOTE: still gather, so the other ranks are not left waiting
                mine = RankError(0, repr(e))
            finally:
                self.state.tokens_round = None
            results = [None] * self.world_size
            dist.gather_object(mine, results, dst=0, group=self._ctrl)
            errors = [r for r in results if isinstance(r, RankError)]
            if errors:
                raise RuntimeError(_failed(errors))
            return results
        except BaseException as e:
            self._failure = e
            raise

    def _tokens_round(self, mine, on_tokens) -> None:
        parts = [None] * self.world_size
        dist.gather_object(mine, parts, dst=0, group=self._ctrl)
        on_tokens(parts)

    def _init_pool_thread(self, device: torch.device) -> None:
        self._pool_thread = threading.current_thread()
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the current device is per thread; rank 0's NCCL collectives run here

    def _call(self, fn, *args):
        """`fn(*args)` on the thread of the command rounds (async scheduling: after the steps submitted before,
        so no step is in flight on any rank while it runs), blocking until it has run; its result."""
        if self._pool is None or threading.current_thread() is self._pool_thread:
            return fn(*args)
        if self._is_closed:
            raise RuntimeError("the executor is closed; create a new Engine")
        return self._pool.submit(fn, *args).result()

    def _broadcast(self, kind: str, payload=None) -> list:
        return self._call(self._run_all, [Command(kind, payload) for _ in range(self.world_size)])

    # ------------------------------------------------------------------ the executor contract

    @property
    def num_inflight(self) -> int:
        """Steps submitted whose run over the ranks has not ended yet."""
        return self.num_submitted - self.num_finished

    def submit(self, step: PreparedStep) -> Future[StepResult]:
        """Without async scheduling: blocks while every rank runs its share of `step`, and returns a future that
        is already done. With it: queues the step on the thread of the command rounds and returns at once; the
        future is done when the tokens are in (with speculative decoding, before the drafts)."""
        if self._is_closed:
            raise RuntimeError("the executor is closed; create a new Engine")
        fut: Future[StepResult] = Future()
        # NOTE: the endpoints' payloads are taken here, on the engine's thread, in submission order
        payloads = self._step_payloads() if self._step_payloads is not None else None
        with self._count_lock:
            self.num_submitted += 1
            self.max_steps_in_flight = max(self.max_steps_in_flight, self.num_inflight)
            self._queued.add(fut)
        if self._pool is None:
            self._execute(step, payloads, fut)
        else:
            self._pool.submit(self._execute, step, payloads, fut)
        return fut

    def _execute(self, step: PreparedStep, payloads, fut: Future) -> None:
        """Runs `step` over the ranks and sets `fut` (its result or exception). On the thread of the command
        rounds."""
        with self._count_lock:  # NOTE: claims the step against `close`, which cancels the steps not yet started
            if fut not in self._queued:
                return  # cancelled (and counted finished) by `close`
            self._queued.discard(fut)
        drafts: Future | None = None
        try:
            if not fut.set_running_or_notify_cancel():
                return
            if hasattr(step, "verify") and self._pool is not None:  # speculative: tokens first, drafts after
                drafts = Future()
                drafts.set_running_or_notify_cancel()
                result = self._run_step(step, payloads, fut, drafts)
                if not fut.done():  # NOTE: never leave the engine waiting on tokens that no round handed over
                    raise RuntimeError("a speculative step ended without its tokens round (no rank handed over "
                                       "its tokens before drafting)")
                drafts.set_result(result)
            else:
                fut.set_result(self._run_step(step, payloads))
        except Exception as e:
            if drafts is not None and not drafts.done():
                drafts.set_exception(e)
            if not fut.done():
                fut.set_exception(e)
            return
        finally:
            with self._count_lock:
                self.num_finished += 1
        if self.eplb_interval_steps and self._num_steps % self.eplb_interval_steps == 0:
            # NOTE: after the step's result is handed over (the engine prepares the next step meanwhile) and before
            # the next step's round (on this thread): no step is in flight on any rank. A failure fails the
            # executor, so the next step raises it (no future is left to carry it: this step's is already set).
            try:
                self.rebalance_experts()
            except Exception as e:
                logger.exception("automatic EPLB after step %d failed; the instance fails (the next step raises)",
                                 self._num_steps)
                if self._failure is None:
                    self._failure = e

    def _run_step(self, step: PreparedStep, payloads, tokens_fut: Future | None = None,
                  drafts: Future | None = None) -> StepResult:
        """Blocks while every rank runs its share of `step`; the step's result. `tokens_fut` (a speculative step
        under async scheduling): set with a `PendingSpecStepResult` over `drafts` once the tokens are in."""
        import time

        t0 = time.perf_counter()
        verify_at = None
        on_tokens = None
        if hasattr(step, "verify"):  # a `SpecPreparedStep` (speculative decoding, `engine.distributed.spec`)
            plans, rows_of_rank, verify_at = split_spec_step(step, self.world_size, self.spec.num_blocks)
            if tokens_fut is not None:
                for p in plans:
                    p.tokens_first = True
                on_tokens = self._tokens_setter(verify_at, tokens_fut, drafts)
        else:
            plans, rows_of_rank = split_step(step.batch, self.world_size, self.spec.num_blocks)
        if step.sampling_batch is not None:
            # NOTE: the engine's sampler draws the unseeded rows' seeds here, exactly as its `sample` would, so
            # the ranks sample bit-identically to one process (`engine.distributed.sampling`)
            sampling = resolve_seeds(step.sampling_batch, self.sampler._generator)
            for plan, rows in zip(plans, rows_of_rank):
                if rows:
                    plan.sampling = select_rows(sampling, rows)
        if payloads is None:
            results = self._run_all([Command("step", p) for p in plans], on_tokens)
        else:  # the rank endpoints' traffic rides the step (`attach_endpoints`)
            pairs = self._run_all([Command("step", p, e) for p, e in zip(plans, payloads)], on_tokens)
            results = [r for r, _ in pairs]
            with self._count_lock:
                self._endpoint_results.append([e for _, e in pairs])
        t1 = time.perf_counter()
        self._num_steps += 1  # NOTE: every `eplb_interval_steps` steps, `_execute` re-places the experts after it
        if verify_at is not None:  # rank 0 merges and decides the verify schedule for the whole batch
            return self.state.spec.finish(step.verify, merge_spec_results(results, verify_at))
        if step.sampling_batch is None:
            return StepResult([], [], t1 - t0, 0.0)
        num_rows = sum(len(r) for r in rows_of_rank)
        token_ids: list[int] = [0] * num_rows
        logprobs: list = [None] * num_rows
        for rows, part in zip(rows_of_rank, results):
            for row, token_id, lp in zip(rows, *part) if rows else ():
                token_ids[row], logprobs[row] = token_id, lp
        return StepResult(token_ids, logprobs, t1 - t0, time.perf_counter() - t1)

    @staticmethod
    def _tokens_setter(verify_at, tokens_fut: Future, drafts: Future):
        """The tokens round's handler of a speculative step under async scheduling: completes `tokens_fut`
        with the merged tokens (drafts pending on `drafts`), or fails it with the ranks' errors."""
        from deepinfer.engine.spec_decode.executor import PendingSpecStepResult

        def on_tokens(parts: list) -> None:
            errors = [p for p in parts if isinstance(p, RankError)]
            if errors:
                tokens_fut.set_exception(RuntimeError(_failed(errors)))
                return
            merged = merge_spec_results(parts, verify_at)
            tokens_fut.set_result(PendingSpecStepResult(merged.token_ids, merged.logprobs, merged.model_s,
                                                        merged.sample_s, drafts))

        return on_tokens

    def rebalance_experts(self) -> list[list[tuple[int, ...]]]:
        """Blocks while every rank re-places its experts (EPLB) from the loads measured since the last
        rebalance; returns per rank the new `phy2log` per MoE layer (the same on every rank)."""
        return self._broadcast("rebalance")

    def expert_loads(self, reset: bool = False) -> ExpertLoads:
        """Blocks while every rank reports its measured MoE loads (`reset`: the counters restart)."""
        per_rank = self._broadcast("loads", reset)
        return ExpertLoads(per_rank, imbalance_of(per_rank))

    def rank_memory(self) -> list:
        """Blocks while every rank reports what it holds (`worker.RankMemory`: routed experts, their bytes, KV
        blocks), by rank."""
        return self._broadcast("memory")

    def attach_endpoints(self, factory, kwargs: dict, local, step_payloads=None) -> list:
        """Blocks while every rank gets its endpoint: `local` (rank 0, already built here) and, on ranks 1..N-1,
        `factory(rank, cache, **kwargs)` (`factory` must pickle by reference: a module-level function or class);
        returns each endpoint's `describe()`, by rank. Raises RuntimeError (failing the instance) when a rank
        cannot build its endpoint.

        `step_payloads`: None, or a callable returning one payload per rank that every step then carries to the
        endpoints (handled after the forward, in the step's round); their answers wait, one list by rank per
        step, for `take_endpoint_results`."""
        if self.state.endpoint is not None:
            raise RuntimeError("the ranks already have endpoints")
        self.state.endpoint = local
        infos = self._call(self._run_all, [Command("attach", None)] + [Command("attach", (factory, kwargs))
                                                                       for _ in range(1, self.world_size)])
        self._step_payloads = step_payloads
        return infos

    def take_endpoint_results(self) -> list[list]:
        """The endpoints' answers carried by the steps since the last call (per step, a list by rank); clears them."""
        with self._count_lock:  # NOTE: steps append from the thread of the command rounds
            out, self._endpoint_results = self._endpoint_results, []
        return out

    def call_endpoints(self, payloads: list) -> list:
        """Blocks while each rank's endpoint handles its payload (`payloads[rank]`); their answers, by rank."""
        if len(payloads) != self.world_size:
            raise ValueError(f"need one payload per rank ({self.world_size}), got {len(payloads)}")
        return self._call(self._run_all, [Command("endpoint", p) for p in payloads])

    def close(self) -> None:
        """Blocks until the step running (if any) has ended and the rank processes have stopped; leaves the group.
        Idempotent. Steps queued behind the running one are cancelled at once, before the wait, as
        `ThreadedExecutor.close` does: their futures' `result()` raises `CancelledError` (and they count as
        finished); command rounds queued from other threads raise it too."""
        if self._is_closed:
            return
        self._is_closed = True
        if self._pool is not None:
            # NOTE: the pool cancels its own work items only, not the futures `submit` handed out: cancel those
            # here, or a caller waiting on one would hang (the lock decides each step against `_execute`)
            self._pool.shutdown(wait=False, cancel_futures=True)
            with self._count_lock:
                queued, self._queued = list(self._queued), set()
                self.num_finished += len(queued)
            for fut in queued:
                fut.cancel()
            self._pool.shutdown(wait=True)
        if self._failure is None:
            try:
                dist.scatter_object_list([None], [Command("stop") for _ in range(self.world_size)], src=0,
                                         group=self._ctrl)
            except Exception:  # a rank died meanwhile: it is stopped anyway
                pass
        for p in self._procs:
            p.join(timeout=30 if self._failure is None else 1)
        self._kill()
        leave_group()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)


def _failed(errors: list[RankError]) -> str:
    return "rank " + "; rank ".join(f"{e.rank} failed: {e.message}" for e in errors)
