"""protos: every cross-process contract as a .proto file, one file per receiving service, plus the
generated Python stubs.

| file | service | called by |
|---|---|---|
| `entrypoint.proto` | `Entrypoint` (Generate, Abort, Health) | the HTTP front, token-level clients |
| `prefill.proto` | `Prefill` (Prefill, Abort, Health, Drain) | the entrypoint |
| `decode.proto` | `Decode` (Reserve, Start, Abort, Health, Drain) | the entrypoint |
| `loadbalancer.proto` | `LoadBalancer` (Register, Heartbeat, Pick, Deregister, ListInstances) | workers, the entrypoint |
| `common.proto` | shared messages: SamplingParams, Usage, Error, TokenLogprobs, Health, Abort, Drain | — |

Use them as `from protos import decode_pb2, decode_pb2_grpc`. The `*_pb2*.py(i)` files are generated
by `python -m deepinfer.protos.generate` (never edit them); `protos.convert` maps engine dataclasses to messages;
`protos.metadata` names the gRPC metadata keys (trailing stats, the offending field of an error).
"""
