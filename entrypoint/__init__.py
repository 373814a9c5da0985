"""entrypoint: the HTTP front (deepseek-recipe), the token-level gRPC API, the P/D handshake,
streaming and abort.

`server.serve_entrypoint` runs the token-level `deepinfer.v1.Entrypoint` service (validation, the P/D
handshake, streaming, abort); `client.Client` is its Python client; `python -m deepinfer.entrypoint` runs it
as a process. `entrypoint.http` is the HTTP front (OpenAI / Anthropic APIs through deepseek-recipe) on
top of the token API; `python -m deepinfer.entrypoint.http` runs it."""
