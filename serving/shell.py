"""The worker-shell base: what every model-running stage's process shell shares (prefill, decode and
vision workers), so each stage's `server.py` keeps only its protocol.

A `WorkerShell` owns an `EngineLoop` (the one thread touching the core and the NIXL agents), a gRPC
server, and (with `lb_address`) a `LoadReporter`. Its life:

    __init__ (subclass builds its core, then `_bind`) -> start -> serving -> drain -> stop

* **bind / start**: `_bind` binds the gRPC server (RuntimeError when the port cannot be bound);
  `start` starts the loop and the server, then registers with the stage's balancer.
* **serving**: handlers call `check_accepting()` first (draining or unhealthy: an in-band
  UNAVAILABLE, which the entrypoint retries elsewhere), then post work to the loop; refusals map to
  the wire through `serving.errors` alone.
* **drain**: stop taking requests, report at once, let those in flight finish (after the timeout:
  `_on_drain_timeout`, by default abort them all), keep the port open `drain_linger_s`, then stop.
* **stop**: deregister, stop the server (grace), the loop, then `_close()` (agents). Idempotent.
* **failure**: a loop that died fails the waiting handlers in-band and reports unhealthy; a multi-rank
  instance (`EngineShell` with `expert_parallel_size > 1`) instead exits its process when the loop dies or a
  rank process dies (`exit_failed`): the instance fails as a whole and its supervisor restarts the group.
* **health**: healthy while the loop answers a `_stats()` call within `LOOP_CALL_TIMEOUT_S`; the stats
  travel as trailing metadata (`protos.metadata.STATS_METADATA_KEY`).

A subclass sets `stage_name`, `stage` and fills the hooks below (loop-thread hooks run on the loop).
`ShellServicer` answers the shared `Abort`, `Health` and `Drain` RPCs of every stage service.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, ClassVar

import grpc

from deepinfer.kv_transfer import loopback_ucx_env
from deepinfer.kv_transfer.embeddings import EmbeddingAgent
from deepinfer.kv_transfer.ranked import open_instance_agent
from deepinfer.protos import common_pb2, loadbalancer_pb2
from deepinfer.protos.metadata import STATS_METADATA_KEY
from deepinfer.serving.auth import add_port, server_interceptors
from deepinfer.serving.errors import Refused, errors_by_cause
from deepinfer.serving.loop import EngineLoop, LoopMode
from deepinfer.serving.membership import LoadReporter

LOOP_CALL_TIMEOUT_S = 5.0
"""How long Health, Abort, Drain and heartbeats wait for the engine loop before calling it stuck."""
INSTANCE_FAILED_EXIT_CODE = 75
"""Exit code of a worker process whose instance failed as a whole (a multi-rank instance's rank group broke)."""
EXIT_DEREGISTER_TIMEOUT_S = 2.0
"""How long a failed instance tries to deregister from its balancer before it exits anyway."""


class WorkerShell:
    """Base of a running worker instance: engine loop, gRPC server, balancer membership, drain, health.

    `config` has `instance_id`, `agent_name`, `host`, `port`, `advertise_host`, `lb_address`,
    `datacenter`, `heartbeat_interval_s` and `max_rpc_threads` (every worker config does).
    """

    stage_name: ClassVar[str]
    """"prefill", "decode" or "vision": instance-id prefix, logger `<stage>_worker`, thread names."""
    stage: ClassVar[int]
    """The `common_pb2.Stage` value reported to the balancer and in `Health`."""
    loop_name: ClassVar[str] = "engine loop"
    """What messages call the loop ("encode loop" on the vision stage)."""
    drain_linger_s: ClassVar[float] = 0.0
    """A draining instance keeps its port open at least this long after the drain began, refusing new
    requests in-band (UNAVAILABLE, which the entrypoint retries on another instance).

    NOTE: a Pick the balancer answered just before the draining heartbeat reached it must not meet a
    closed port where the entrypoint does not retry a call that failed at the transport."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.name = f"{self.stage_name}_worker"
        self.logger = logging.getLogger(self.name)
        self.instance_id = config.instance_id or f"{self.stage_name}-{uuid.uuid4().hex[:8]}"
        self.agent_name = config.agent_name or self.instance_id
        self.loop = EngineLoop(f"{self.name}-loop", self._step, self._mode, on_fatal=self._loop_died)
        self.exits_on_failure = False
        self._exit_lock = threading.Lock()
        """Set once at construction (a multi-rank instance, `EngineShell`): a dead loop ends the process
        (`exit_failed`) instead of failing the waiting handlers in-band and staying up unhealthy."""
        self.is_draining = False
        self.reporter: LoadReporter | None = None
        self.server: grpc.Server | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._is_stopping = False

    @property
    def ucx_env(self) -> dict | None:
        """The UCX environment of this instance's NIXL agents (loopback-only in tests: with CUDA transports when the
        engine runs on a GPU, its pools being VRAM, `kv_transfer.loopback_ucx_env`), None = UCX defaults."""
        return loopback_ucx_env(self.config.device) if self.config.loopback_ucx else None

    def _image_embedding_agent(self, engine: Any) -> EmbeddingAgent | None:
        """An LM stage's buffer that image embeddings are READ into from vision instances (NIXL), sized
        `config.embedding_rows`; None when the model has no vision tower."""
        if engine.model_config.vision is None:
            return None
        return EmbeddingAgent(f"{self.agent_name}-emb", self.config.embedding_rows, engine.model_config.hidden_size,
                              engine.cache.dtype, self.config.device, ucx_env=self.ucx_env)

    def _bind(self, add_servicer: Callable[[Any, grpc.Server], None], servicer: Any) -> None:
        """Create the gRPC server with `servicer` and bind it; raises RuntimeError when the port cannot be bound."""
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(
            max_workers=self.config.max_rpc_threads, thread_name_prefix=f"{self.name}-rpc"),
            interceptors=server_interceptors())  # the cluster secret (serving.auth)
        add_servicer(servicer, self.server)
        self.port = add_port(self.server, f"{self.config.host}:{self.config.port}")  # TLS when set (serving.auth)
        if self.port == 0:
            raise RuntimeError(f"cannot bind the {self.stage_name} server to {self.config.host}:{self.config.port}")
        self.address = f"{self.config.advertise_host or self.config.host}:{self.port}"

    # ------------------------------------------------------------------ hooks

    def _step(self) -> None:
        """Loop thread: one step of the core; hand finished work to its waiting handlers."""
        raise NotImplementedError

    def _mode(self) -> LoopMode:
        """Loop thread: how long to sleep after this step."""
        raise NotImplementedError

    def _abort(self, request_id: str, reason: str) -> bool:
        """Loop thread: abort one request everywhere on this instance; True when it was found."""
        raise NotImplementedError

    def _abort_rpc(self, request_id: str, reason: str, writer_gone: bool) -> bool:
        """Loop thread: an `Abort` call (`AbortRequest.writer_gone`: the KV writer of the request's reservation
        is known dead; only a stage holding reservations uses it)."""
        del writer_gone
        return self._abort(request_id, reason)

    def _abort_all(self) -> None:
        """Loop thread: abort every request (the drain timed out)."""
        raise NotImplementedError

    def _num_unfinished(self) -> int:
        """Loop thread: requests still in flight (a drain waits for 0)."""
        raise NotImplementedError

    def _on_fatal(self, exc: BaseException) -> None:
        """Loop thread, once: the loop died of `exc`; fail every waiting handler."""
        raise NotImplementedError

    def _loop_died(self, exc: BaseException) -> None:
        if self.exits_on_failure:
            self.exit_failed(exc)
        self._on_fatal(exc)

    def exit_failed(self, exc: BaseException) -> None:
        """Ends this process at once (exit code `INSTANCE_FAILED_EXIT_CODE`) after deregistering from the balancer
        (best effort, bounded): the instance failed as a whole and only a restart brings it back.

        Why exit rather than stay up unhealthy: a multi-rank instance whose rank group broke cannot recover in
        process (the group's collectives cannot line up again); ending the process ends its rank processes (they
        exit with it), so the supervisor (Ray's actor restart) starts a whole new group, and the streams it
        served break with UNAVAILABLE, which the entrypoint migrates (an in-band INTERNAL error would not be)."""
        import os

        self._exit_lock.acquire()  # NOTE: never released: a second caller waits here for the exit, not returning
        self.logger.critical("the instance failed as a whole (%s); exiting so that it restarts", exc)
        if self.reporter is not None:
            t = threading.Thread(target=self.reporter.stop, kwargs={"deregister": True}, daemon=True)
            t.start()
            t.join(EXIT_DEREGISTER_TIMEOUT_S)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(INSTANCE_FAILED_EXIT_CODE)

    def _load_and_hashes(self) -> tuple[loadbalancer_pb2.LoadReport, frozenset[int] | None]:
        """Loop thread: the load report and the cached keys for affinity (None: no cache to report)."""
        raise NotImplementedError

    def _stats(self) -> dict:
        """Loop thread: the counters `Health` returns as JSON."""
        raise NotImplementedError

    def _registration_fields(self) -> dict:
        """`RegisterRequest` fields besides instance_id, stage, address and datacenter."""
        return {}

    def _describe(self) -> str:
        """What the serving log line says about this instance (agent, capacity)."""
        return f"agent {self.agent_name}"

    def _close(self) -> None:
        """Release the instance's own resources (NIXL agents) after the loop stopped."""

    def _on_drain_timeout(self) -> bool:
        """The drain's timeout ran out: abort everything and keep waiting (True) or stop now (False)."""
        self.loop.call(self._abort_all, LOOP_CALL_TIMEOUT_S)
        return True

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Blocks until serving and registered with the balancer (when `lb_address` is set)."""
        self.loop.start()
        self.server.start()
        if self.config.lb_address:
            registration = loadbalancer_pb2.RegisterRequest(
                instance_id=self.instance_id, stage=self.stage, address=self.address,
                datacenter=self.config.datacenter, **self._registration_fields())
            self.reporter = LoadReporter(self.config.lb_address, registration, self._collect_load,
                                         interval_s=self.config.heartbeat_interval_s, logger_name=self.name)
            self.reporter.start()
        self.logger.info("%s instance %s serving on %s (%s)", self.stage_name, self.instance_id, self.address,
                         self._describe())

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the instance stopped (drained or `stop()`); False on timeout."""
        return self._stopped.wait(timeout)

    def check_accepting(self) -> None:
        """Raises `Refused(UNAVAILABLE)` when this instance takes no new requests (draining, loop dead)."""
        if self.is_draining:
            raise Refused(common_pb2.ERROR_CODE_UNAVAILABLE, f"{self.stage_name} instance {self.instance_id} is draining")
        if not self.loop.is_alive:
            raise Refused(common_pb2.ERROR_CODE_UNAVAILABLE, f"{self.stage_name} instance {self.instance_id} is "
                          f"unhealthy: {self.loop.error or 'stopped'}")

    def drain(self, timeout_s: float | None = None) -> int:
        """Stop taking requests; finish those in flight (after `timeout_s`: `_on_drain_timeout`), then stop.

        Returns at once with the number of unfinished requests; `wait()` for the end.
        """
        with self._lock:
            was_draining, self.is_draining = self.is_draining, True
        num_unfinished = self.loop.call(self._num_unfinished, LOOP_CALL_TIMEOUT_S)
        if not was_draining:
            self.logger.info("draining (%d unfinished requests)", num_unfinished)
            if self.reporter is not None:
                self.reporter.report_now()
            threading.Thread(target=self._finish_drain, args=(timeout_s,), name=f"{self.name}-drain",
                             daemon=True).start()
        return num_unfinished

    def stop(self, grace_s: float = 1.0) -> None:
        """Blocks until stopped: deregisters, stops the server (answering in-flight calls for `grace_s`),
        the loop and the NIXL agents. Idempotent."""
        with self._lock:
            if self._is_stopping:
                return
            self._is_stopping = True
        if self.reporter is not None:
            self.reporter.stop(deregister=True)
        if self.server is not None:
            self.server.stop(grace_s).wait()
        self.loop.stop()
        self._close()
        self.logger.info("%s instance %s stopped", self.stage_name, self.instance_id)
        self._stopped.set()

    def _finish_drain(self, timeout_s: float | None) -> None:
        linger_until = time.monotonic() + self.drain_linger_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.loop.is_alive:
            try:
                left = self.loop.call(self._num_unfinished, LOOP_CALL_TIMEOUT_S)
            except Exception:
                break
            if not left:
                break
            if deadline is not None and time.monotonic() >= deadline:
                if not self._on_drain_timeout():
                    break
                deadline = None
            time.sleep(0.02)
        time.sleep(max(0.0, linger_until - time.monotonic()))
        self.stop()

    # ------------------------------------------------------------------ other threads

    def _collect_load(self) -> tuple[loadbalancer_pb2.LoadReport, frozenset[int] | None]:
        """Heartbeat thread: the load (unhealthy once the loop is gone)."""
        if not self.loop.is_alive:
            return loadbalancer_pb2.LoadReport(is_healthy=False, is_draining=self.is_draining), None
        return self.loop.call(self._load_and_hashes, LOOP_CALL_TIMEOUT_S)

    def health(self, context: grpc.ServicerContext) -> common_pb2.HealthResponse:
        """The `Health` answer: healthy when the loop answers a `_stats()` call within LOOP_CALL_TIMEOUT_S;
        the stats JSON travels as trailing metadata (`STATS_METADATA_KEY`)."""
        message = ""
        try:
            stats = self.loop.call(self._stats, LOOP_CALL_TIMEOUT_S)
            stats.setdefault("errors_by_cause", errors_by_cause())  # every stage: in-band errors answered, by cause
            context.set_trailing_metadata(((STATS_METADATA_KEY, json.dumps(stats)),))
        except concurrent.futures.TimeoutError:
            message = f"the {self.loop_name} did not answer within {LOOP_CALL_TIMEOUT_S} s"
        except Exception as e:
            message = f"the {self.loop_name} is not running: {self.loop.error or e}"
        return common_pb2.HealthResponse(is_healthy=not message, is_draining=self.is_draining,
                                         instance_id=self.instance_id, stage=self.stage, message=message)

    def abort_request(self, request_id: str, reason: str, context: grpc.ServicerContext,
                      writer_gone: bool = False) -> common_pb2.AbortResponse:
        """The `Abort` answer: aborts on the loop thread; a stuck loop ends the call with UNAVAILABLE."""
        try:
            was_found = self.loop.call(partial(self._abort_rpc, request_id, reason, writer_gone), LOOP_CALL_TIMEOUT_S)
        except Exception as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the {self.stage_name} {self.loop_name} did not answer: {e}")
        return common_pb2.AbortResponse(was_found=was_found)


class EngineShell(WorkerShell):
    """Base of the LM stages' shells (prefill, decode): an `Engine`, its KV transfer agent and, for a model
    with a vision tower, the buffer image embeddings are READ into.

    `config` also has `engine_config()`, `loopback_ucx`, `embedding_rows` and `device`. The agents'
    metadata is read once here, before the loop owns the agents.
    """

    def __init__(self, config: Any, *, send_state: bool) -> None:
        from deepinfer.engine.engine import Engine

        super().__init__(config)
        self.engine = Engine(config.engine_config())
        if self.engine.config.expert_parallel_size > 1:  # a rank group fails as a whole: see `exit_failed`
            self.exits_on_failure = True
            self.engine.executor.watch_ranks(self.exit_failed)  # a rank's death between steps too
        # one agent over the engine's cache, or one per rank of a multi-rank instance (`kv_transfer.ranked`)
        self.agent = open_instance_agent(self.engine, self.agent_name, send_state=send_state, ucx_env=self.ucx_env)
        self.agent_metadata = self.agent.metadata()
        self.emb_agent = self._image_embedding_agent(self.engine)
        self.block_size = self.engine.kv_block_size
        self.num_blocks = self.engine.num_kv_blocks

    def _registration_fields(self) -> dict:
        return dict(kv_agent_name=self.agent_name, kv_agent_metadata=self.agent_metadata, block_size=self.block_size)

    def _describe(self) -> str:
        return f"agent {self.agent_name}, {self.num_blocks} blocks of {self.block_size} tokens"

    def _close(self) -> None:
        self.agent.close()
        if self.emb_agent is not None:
            self.emb_agent.close()

    def _kv_load(self, **fields: int) -> loadbalancer_pb2.LoadReport:
        """Loop thread: a load report with the KV pool's occupancy and the health flags, plus `fields`."""
        engine = self.engine
        ranks = []
        if engine.config.expert_parallel_size > 1:  # each rank's own pools and requests (balancers pick a rank)
            ranks = [loadbalancer_pb2.RankLoad(rank=r.rank, num_running_requests=r.num_running_requests,
                                               num_waiting_requests=r.num_waiting_requests,
                                               num_kv_blocks_used=r.num_kv_blocks_used,
                                               num_kv_blocks_total=r.num_kv_blocks_total)
                     for r in engine.kv_rank_loads()]
        return loadbalancer_pb2.LoadReport(
            num_running_requests=engine.num_running_requests,
            num_kv_blocks_used=engine.num_kv_blocks - engine.num_free_kv_blocks, num_kv_blocks_total=engine.num_kv_blocks,
            is_healthy=self.loop.error is None, is_draining=self.is_draining, ranks=ranks, **fields)

    def _transfer_stats(self) -> dict:
        """Loop thread: the kv_transfer counters of both agents (list-valued ones left out)."""
        stats = {k: v for k, v in self.agent.stats().items() if not isinstance(v, list)}
        if self.emb_agent is not None:
            stats.update(self.emb_agent.stats())
        timings = self.engine.timings  # engine steps and their time, preemptions: the HTTP front's /metrics
        stats.update(engine_steps_total=timings["steps"],
                     engine_step_seconds_total=timings["schedule"] + timings["model"] + timings["sample"],
                     num_preemptions_total=self.engine.scheduler.num_preemptions)
        stats.update(self._latency_stats())
        return stats

    def _latency_stats(self) -> dict:
        """Loop thread: the latency histograms (`latency_seconds`: the engine's queue, prefill and step times and
        the KV sends' transfer time, `engine.latency`) and the prefix cache's token counts and hit rate."""
        latency = self.engine.latency.as_dict()
        agent = getattr(self.agent, "local", self.agent)  # a multi-rank instance's agents: rank 0's sends
        if getattr(agent, "latency", None) is not None:
            latency.update(agent.latency.as_dict())
        cache = self.engine.prefix_cache_tokens
        return {"latency_seconds": latency, "prefix_cache_queried_tokens_total": cache["queried"],
                "prefix_cache_hit_tokens_total": cache["hit"],
                "prefix_cache_hit_rate": cache["hit"] / cache["queried"] if cache["queried"] else 0.0}


def queue_items(items: queue.SimpleQueue, context: grpc.ServicerContext, poll_s: float = 0.5) -> Iterator[Any]:
    """Blocks: yields what a loop thread puts into `items`, until the gRPC call is no longer active
    (checked every `poll_s` while nothing arrives). The caller stops at its own last item."""
    while True:
        try:
            yield items.get(timeout=poll_s)
        except queue.Empty:
            if not context.is_active():
                return


class ShellServicer:
    """The RPCs every stage service shares (`Abort`, `Health`, `Drain`), over a `WorkerShell`.

    Put it first among the bases (`class PrefillServicer(ShellServicer, prefill_pb2_grpc.PrefillServicer)`)
    so these methods replace the generated UNIMPLEMENTED ones. Handlers never touch the core themselves.
    """

    def __init__(self, worker: WorkerShell) -> None:
        self.worker = worker

    def Abort(self, request, context):
        return self.worker.abort_request(request.request_id, request.reason or "Abort RPC", context,
                                         writer_gone=request.writer_gone)

    def Health(self, request, context):
        return self.worker.health(context)

    def Drain(self, request, context):
        num_unfinished = self.worker.drain(request.timeout_ms / 1000 if request.timeout_ms else None)
        return common_pb2.DrainResponse(num_unfinished_requests=num_unfinished)


def serve_worker(worker_cls: type[WorkerShell], config: Any) -> WorkerShell:
    """Blocks until a `worker_cls` instance serves and is registered; returns its handle.

    Raises RuntimeError if the port cannot be bound or the balancer cannot be reached (the instance
    is stopped first).
    """
    worker = worker_cls(config)
    try:
        worker.start()
    except BaseException:
        worker.stop(grace_s=0)
        raise
    return worker


def run_worker_process(config_cls: type, prog: str, doc: str, argv: list[str] | None, serve: Callable) -> int:
    """Blocks for a worker process's life (the `python -m <stage>_worker` entry of every stage).

    Parses `config_cls` from `argv` (CLI generated from the config), sends every log line to stderr,
    starts `serve(config)` (imported lazily by the caller's `serve`), makes SIGTERM / SIGINT stop it,
    prints one JSON line `{"address", "instance_id", "agent"}` on stdout once it serves, and returns 0
    when it stopped (a signal or a drain).
    """
    import signal
    import sys

    from deepinfer.serving.config_cli import config_from_args, make_parser
    from deepinfer.serving.logs import LOGGING_HELP, configure_logging, logging_args

    level, fmt, argv = logging_args(argv)
    parser = make_parser(config_cls, prog, doc.splitlines()[0])
    parser.epilog = LOGGING_HELP
    config = config_from_args(config_cls, parser, argv)
    configure_logging(level, fmt)
    import nixl._api  # noqa: F401

    # NOTE: importing NIXL installs a handler that writes NIXL's logs to stdout; stdout carries only
    # the address line, so it is moved to stderr
    for handler in logging.getLogger("nixl").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    worker = serve(config)
    name = prog.split()[-1]
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: threading.Thread(target=worker.stop, name=f"{name}-stop").start())
    print(json.dumps({"address": worker.address, "instance_id": worker.instance_id, "agent": worker.agent_name}),
          flush=True)
    while not worker.wait(0.5):
        pass
    return 0
