"""decode_worker: the decode-only engine instance (a wide EP group) that reserves cache space, receives
KV and decodes with continuous batching.

`core.DecodeCore` is the pure core (`reserve` / `step` / `abort`, no sockets); `server.serve_decode`
is the process shell (the `deepinfer.v1.Decode` gRPC service, engine-loop thread, balancer
membership); `python -m deepinfer.decode_worker` runs it as a process."""
