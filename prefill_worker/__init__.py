"""prefill_worker: the prefill-only engine instance (a small EP group) that prefills, samples the first
token and pushes compressed KV to the decode instance.

`core.PrefillCore` is the pure core (`submit` / `step` / `abort`, no sockets); `server.serve_prefill`
is the process shell (the `deepinfer.v1.Prefill` gRPC service, engine-loop thread, balancer
membership); `python -m deepinfer.prefill_worker` runs it as a process."""
