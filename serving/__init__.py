"""serving: what every worker process shell shares (a library; no `__main__`).

A worker folder (`prefill_worker/`, `decode_worker/`, `vision_worker/`) is a pure core plus a thin
process shell. The shell's generic part lives here, so the stages need not import each other
(DESIGN.md §2):

* `serving.loop` — `EngineLoop`, the one thread that owns a worker's core and NIXL agents; gRPC
  handlers hand work over with `post` / `call`.
* `serving.membership` — `LoadReporter`: registration with the stage's balancer and heartbeats.
* `serving.errors` — the ONE mapping of refusals (bad input, no room, aborted, draining, a stuck
  loop) to the wire's in-band `Error` and from there to gRPC status codes.
* `serving.shell` — `WorkerShell`, the base of every worker shell: bind / start / drain / stop /
  health and the shared `Abort` / `Health` / `Drain` RPCs (`ShellServicer`); `EngineShell`, its
  subclass for the LM stages (an `Engine`, its KV transfer agent, the image-embedding buffer);
  `run_worker_process`, the `python -m <stage>_worker` entry.
* `serving.config_cli` — command lines generated from a frozen pydantic config model.
* `serving.worker_config` — the fields every stage's worker config shares: `WorkerConfig` (every
  stage) and `EngineWorkerConfig` (prefill, decode: the engine's settings, the drafter, the KV store).
* `serving.auth` — the cluster secret: server interceptors that refuse internal calls without it,
  channels that attach it.
* `serving.logs` — `configure_logging(level, text | json)` and the request id on every log line.

Where a new stage goes: a core (testable in-process, `step()`), then a `WorkerShell` subclass that
fills the hooks (`_step`, `_mode`, `_abort`, `_num_unfinished`, `_load_and_hashes`, `_stats`,
`_registration_fields`, `_close`) and a servicer deriving from `ShellServicer` and its generated
`*Servicer`. The gRPC metadata keys are in `protos.metadata`.
"""
