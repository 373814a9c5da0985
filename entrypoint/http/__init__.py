"""entrypoint.http: the HTTP front (OpenAI Chat Completions / Responses / completions, Anthropic
Messages, token-level /v1/generate) in front of the token-level gRPC entrypoint, through deepseek-recipe.

```bash
python -m deepinfer.entrypoint.http --entrypoint 127.0.0.1:50051 --host 127.0.0.1 --port 8000 --model CKPT \
    [--served-model-name NAME] [--api-key KEY]
```
```python
from deepinfer.entrypoint.http import HttpConfig, create_app, serve
```

- `conversion`: recipe's request -> conversation -> prompt token ids, and the image URL allow-list.
- `backend`: the asyncio gRPC client of the token entrypoint (cancel = abort everywhere).
- `app`: routes, API keys, body / in-flight limits, SSE, client disconnects.
- `completions`: `/v1/completions` and `/v1/generate`, which bypass recipe.
- `errors`: OpenAI- and Anthropic-shaped errors, the gRPC status -> HTTP status map.
- `metrics`: Prometheus metrics (`/metrics`).
"""

from deepinfer.entrypoint.http.app import create_app, serve
from deepinfer.entrypoint.http.config import HttpConfig

__all__ = ["HttpConfig", "create_app", "serve"]
