"""vision_worker: the vision stage instance that resolves a request's images the V4.1 way (recipe's
allow-listed fetcher, `OpenCvImagePreprocessor`, limits: `engine.images`), encodes them with the
vision tower + projector in batches across requests, and holds the embeddings in NIXL-registered
rows (a content-hash LRU cache) from where the decode and prefill instances READ them
(`kv_transfer.embeddings`).

`core.VisionCore` is the pure core (`submit` / `step` / `release`, no sockets); `server.serve_vision`
is the process shell (the `deepinfer.v1.Vision` gRPC service, encode-loop thread, balancer
membership); `python -m deepinfer.vision_worker` runs it as a process."""
