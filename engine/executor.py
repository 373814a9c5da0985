"""The executor seam: where a prepared step runs (model forward + sampling), between `Engine` and the model runner.

`Engine` owns everything around the model: scheduling (`Scheduler.schedule`), preparing a step
(`PreparedStep`: the flat model batch and the sampling batch, snapshotted on the engine's thread),
and postprocessing (stop checks, detokenization, `Scheduler.update_from_output`). An `Executor`
owns the part in between: it runs a `PreparedStep` and returns a `StepResult` (one sampled token
id per sampling request, their logprobs, timings). The engine picks one executor once, at
construction (`make_executor`, from `EngineConfig.executor` / `EngineConfig.async_scheduling`);
`Engine.step` then drives every executor with the same code:

    schedule -> (wait for the sampled tokens of the steps in flight) -> prepare -> submit
    -> while max_inflight steps are in flight (or there is nothing new to run): collect the oldest
       step's result and postprocess it

Implementations (`EXECUTORS`, the registry; its names feed configuration choices):

- `inprocess` (`InProcessExecutor`): runs the step inline in `submit`; `max_inflight = 1`, so
  every `step()` returns the outputs of the step it ran.
- `threaded` (`ThreadedExecutor`, async scheduling): runs steps on one worker thread;
  `max_inflight = 2`, so step N+1 is scheduled while step N runs, and step N is postprocessed while
  step N+1 runs. `Engine.step` then returns outputs one step behind the device. The default on CUDA
  devices (`EngineConfig.async_scheduling=None`); on the CPU the default stays `inprocess`.

- `multirank` (`engine.distributed.executor.MultiRankExecutor`): an instance as a group of ranks
  (attention data-parallel, experts expert-parallel); built by `make_executor` when
  `EngineConfig.expert_parallel_size > 1` (it needs the config, not only the runner and sampler).

A new executor (the multi-rank one for expert parallelism: an instance as a group of ranks,
attention data-parallel, experts expert-parallel, torch.distributed with gloo on CPUs and NCCL on
GPUs) subclasses `Executor`, is registered in `EXECUTORS`, and implements:

- `max_inflight`: how many submitted steps may be uncollected at once (>= 1); the engine reads it
  on the instance. A class attribute, or an instance attribute set in `__init__` where it depends on
  the configuration (`MultiRankExecutor`: 2 with async scheduling, 1 with speculation or without);
  `executor_name` reads a registered executor's class attribute. With more than 1, the engine
  prepares step N+1 with the tokens step N sampled (it waits for them with `future.result()`), so
  ranks must return step N's tokens before running step N+1.
- `submit(step) -> concurrent.futures.Future[StepResult]`: start running `step`; must not block on
  the model when `max_inflight > 1`. Steps run in submission order (one device stream: the
  scheduler's block reuse relies on it). A failure in the run is set on the future
  (`set_exception`), so that it is raised out of `Engine.step`. A multi-rank executor ships the
  `PreparedStep` to every rank, runs the forward there, and samples once (rank 0 or every rank with
  the same generator state) so that all ranks agree on the tokens.
- `close()`: idempotent; blocks until the step running (if any) has finished, then frees threads /
  process groups. Steps queued behind it are cancelled (their futures' `result()` raises
  `CancelledError`). `submit` after `close` raises RuntimeError.

NOTE: an executor never touches the scheduler, requests or outputs; everything it needs arrives
in the `PreparedStep`, and everything it produces leaves in the `StepResult`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepinfer.engine.engine import EngineConfig
    from deepinfer.engine.forward_batch import ForwardBatch
    from deepinfer.engine.model_runner import ModelRunner
    from deepinfer.engine.sampling import Sampler, SamplingBatch, TokenLogprobs


@dataclass
class PreparedStep:
    """Everything a step's run needs, snapshotted by the engine (safe to run on another thread)."""

    batch: ForwardBatch
    """The flat model batch (`ModelRunner.prepare`)."""
    sampling_batch: SamplingBatch | None
    """The sampling batch, one row per sampling request; None when the step samples nothing."""


@dataclass
class StepResult:
    """What a step's run produced, in the order of the step's `sampling_req_ids`."""

    token_ids: list[int]
    """One sampled token id per sampling request."""
    logprobs: list[TokenLogprobs | None]
    """Per sampling request: the sampled token's logprobs, or None when the request asked for none."""
    model_s: float
    """Seconds in the model forward."""
    sample_s: float
    """Seconds sampling."""


def run_step(runner: ModelRunner, sampler: Sampler, step: PreparedStep) -> StepResult:
    """Blocks while the model runs `step` and the sampler samples its logits (the executors' common body).

    NOTE: the copy of the sampled ids to the host (`tolist`) is the step's one host synchronisation; the
    forward and the sampler only queue device work (tests/engine/test_cuda_graph.py checks this under
    `torch.cuda.set_sync_debug_mode("error")`), so `model_s` is the host's time to queue the forward.
    """
    t0 = time.perf_counter()
    logits = runner.run(step.batch)  # [num_sampling_reqs, vocab]
    t1 = time.perf_counter()
    if step.sampling_batch is None:
        return StepResult([], [], t1 - t0, 0.0)
    sampled = sampler.sample(logits, step.sampling_batch)
    token_ids, logprobs = sampled.sampled_token_ids.tolist(), sampled.request_logprobs()
    return StepResult(token_ids, logprobs, t1 - t0, time.perf_counter() - t1)


class Executor(ABC):
    """Runs prepared steps (model forward + sampling) for an `Engine`; see the module docstring for the contract."""

    max_inflight: int = 1
    """Most submitted steps whose results the engine has not collected yet (>= 1). A subclass may set it per
    instance (the module docstring)."""

    def __init__(self, runner: ModelRunner, sampler: Sampler) -> None:
        self.runner = runner
        self.sampler = sampler

    @abstractmethod
    def submit(self, step: PreparedStep) -> Future[StepResult]:
        """Start running `step`; its future holds the `StepResult` or the run's exception."""

    def execute(self, step: PreparedStep) -> StepResult:
        """Blocks until `step` has run; its `StepResult` (raises the run's exception)."""
        return self.submit(step).result()

    @abstractmethod
    def close(self) -> None:
        """Blocks until the step running (if any) has finished, cancelling the steps queued behind it, then frees
        the executor's resources; idempotent."""


class InProcessExecutor(Executor):
    """Runs each step inline, on the caller's thread, when it is submitted (no overlap)."""

    max_inflight = 1

    def __init__(self, runner: ModelRunner, sampler: Sampler) -> None:
        super().__init__(runner, sampler)
        self._is_closed = False

    def submit(self, step: PreparedStep) -> Future[StepResult]:
        """Blocks while the step runs; returns a future that is already done."""
        if self._is_closed:
            raise RuntimeError("the executor is closed; create a new Engine")
        fut: Future[StepResult] = Future()
        try:
            fut.set_result(run_step(self.runner, self.sampler, step))
        except Exception as e:  # delivered by fut.result(), as the threaded executor does
            fut.set_exception(e)
        return fut

    def close(self) -> None:
        self._is_closed = True


class ThreadedExecutor(Executor):
    """Runs steps on one worker thread, so the engine schedules and postprocesses while the model runs.

    NOTE: one thread, so steps run one at a time in submission order (one device stream).
    """

    max_inflight = 2

    def __init__(self, runner: ModelRunner, sampler: Sampler) -> None:
        super().__init__(runner, sampler)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-model")

    def submit(self, step: PreparedStep) -> Future[StepResult]:
        """Queue `step` on the worker thread; returns at once."""
        return self._pool.submit(run_step, self.runner, self.sampler, step)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


EXECUTORS: dict[str, type[Executor]] = {"inprocess": InProcessExecutor, "threaded": ThreadedExecutor}
"""The executor registry by name (`EngineConfig.executor`)."""


def resolve_async_scheduling(async_scheduling: bool | None, device: str = "cpu") -> bool:
    """`async_scheduling` with None resolved for `device`: on for CUDA (the host prepares the next step while
    the GPU runs this one), off elsewhere (on CPU cores the model and the scheduler compete for the same cores)."""
    if async_scheduling is None:
        return str(device).startswith("cuda")
    return async_scheduling


def executor_name(executor: str | None, async_scheduling: bool | None, device: str = "cpu") -> str:
    """The registry name an engine config selects; raises ValueError (saying how to fix it) for a bad choice.

    `async_scheduling=None` means the device's default (`resolve_async_scheduling`). `executor=None` picks
    `threaded` with async scheduling, else `inprocess`. An explicit name must agree with async scheduling:
    overlapping executors (`max_inflight > 1`) need it on, the others off.
    """
    async_scheduling = resolve_async_scheduling(async_scheduling, device)
    if executor is None:
        return "threaded" if async_scheduling else "inprocess"
    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}; known executors: {', '.join(sorted(EXECUTORS))}")
    is_overlapping = EXECUTORS[executor].max_inflight > 1
    if is_overlapping != async_scheduling:
        raise ValueError(
            f"executor {executor!r} {'overlaps' if is_overlapping else 'does not overlap'} steps but async_scheduling "
            f"is {async_scheduling}; set async_scheduling={is_overlapping} or leave executor unset"
        )
    return executor


def make_executor(config: EngineConfig, runner: ModelRunner, sampler: Sampler) -> Executor:
    """The executor `config` selects (`executor_name`), running `runner` and `sampler`.

    With `expert_parallel_size > 1` it is `engine.distributed.executor.MultiRankExecutor` ("multirank"): the
    engine's process becomes rank 0 of a group and starts the other ranks (imported here, lazily: it needs
    torch.distributed and process spawning only then).
    """
    if getattr(config, "expert_parallel_size", 1) > 1:
        from deepinfer.engine.distributed.executor import MultiRankExecutor

        return MultiRankExecutor.from_config(config, runner, sampler)
    return EXECUTORS[executor_name(config.executor, config.async_scheduling, config.device)](runner, sampler)
