"""The cluster secret: every internal gRPC call carries it, every deepinfer gRPC server checks it.

```python
server = grpc.server(pool, interceptors=server_interceptors())    # refuses calls without the secret
channel = secure_channel("127.0.0.1:50051")                      # attaches it to every call
```

The secret comes from the environment of each process: `DEEPINFER_CLUSTER_SECRET` (the value) or
`DEEPINFER_CLUSTER_SECRET_FILE` (a file holding it). `deepinfer up` generates one per cluster (or
reads the YAML's `cluster_secret_file`) and hands it to every role through Ray's runtime environment;
the processes of `deploy.processes` inherit it from their parent. Unset = no check (a development
cluster on loopback, the tests).

A call without the right secret ends UNAUTHENTICATED before any handler runs, so a process that can
reach a balancer, a worker or the entrypoint cannot generate, register, deregister, drain or abort.
`Health` stays open (liveness probes; it changes nothing). The secret is compared in constant time
and never logged.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

import grpc
from grpc import aio

from deepinfer.serving.logs import REQUEST_ID

SECRET_ENV = "DEEPINFER_CLUSTER_SECRET"
SECRET_FILE_ENV = "DEEPINFER_CLUSTER_SECRET_FILE"
SECRET_METADATA_KEY = "deepinfer-cluster-secret"
"""gRPC metadata key of the secret on every internal call."""
OPEN_METHOD_SUFFIXES = ("/Health",)
"""Methods served without the secret (read-only liveness)."""


def cluster_secret() -> str | None:
    """This process's cluster secret (`SECRET_ENV`, else the file named by `SECRET_FILE_ENV`), or None."""
    value = os.environ.get(SECRET_ENV)
    if value:
        return value
    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        try:
            value = Path(path).read_text().strip()
        except OSError as e:
            raise RuntimeError(f"cannot read the cluster secret file {path} ({SECRET_FILE_ENV}): {e.strerror}") from None
        if not value:
            raise RuntimeError(f"the cluster secret file {path} ({SECRET_FILE_ENV}) is empty")
        return value
    return None


def _refuse(message: str):
    def handler(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return handler


class SecretCheck(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call but `Health` whose metadata lacks the cluster secret."""

    def __init__(self, secret: str) -> None:
        self._secret = secret.encode()

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.endswith(OPEN_METHOD_SUFFIXES):
            return continuation(handler_call_details)
        given = dict(handler_call_details.invocation_metadata or ()).get(SECRET_METADATA_KEY, "")
        if isinstance(given, str):
            given = given.encode()
        if given and hmac.compare_digest(given, self._secret):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        message = ("this deepinfer service takes calls from its own cluster only: the call carried no cluster "
                   "secret" if not given else "this deepinfer service refused the call: wrong cluster secret")
        if handler is None:
            return None
        if handler.response_streaming:
            if handler.request_streaming:
                return grpc.stream_stream_rpc_method_handler(_refuse(message))
            return grpc.unary_stream_rpc_method_handler(_refuse(message))
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(_refuse(message))
        return grpc.unary_unary_rpc_method_handler(_refuse(message))


class RequestIds(grpc.ServerInterceptor):
    """Every log line of a handler carries the id of the request it serves (`serving.logs.REQUEST_ID`): the
    `request_id` field of the call's request message, when it has one (Generate, Reserve, Prefill, Start,
    Encode, Pick, Abort, ...). Lines the engine loop thread logs are not covered (they name the id
    themselves)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        if handler.response_streaming:
            behavior = handler.unary_stream

            def stream(request, context):
                previous = REQUEST_ID.get()
                REQUEST_ID.set(getattr(request, "request_id", "") or "-")
                try:
                    yield from behavior(request, context)
                finally:
                    REQUEST_ID.set(previous)

            return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                        handler.response_serializer)
        behavior = handler.unary_unary

        def unary(request, context):
            previous = REQUEST_ID.get()
            REQUEST_ID.set(getattr(request, "request_id", "") or "-")
            try:
                return behavior(request, context)
            finally:
                REQUEST_ID.set(previous)

        return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer, handler.response_serializer)


def server_interceptors(secret: str | None = None) -> list[grpc.ServerInterceptor]:
    """The interceptors a deepinfer gRPC server runs: the secret check when a secret is set, then the request
    id of each call on its handler's log lines (`RequestIds`)."""
    secret = secret if secret is not None else cluster_secret()
    return [SecretCheck(secret), RequestIds()] if secret else [RequestIds()]


def _with_secret(metadata, secret: str):
    return [*(metadata or ()), (SECRET_METADATA_KEY, secret)]


class _AttachSecret(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, secret: str) -> None:
        self._secret = secret

    def _details(self, details):
        return details._replace(metadata=_with_secret(details.metadata, self._secret))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def secure_channel(address: str, secret: str | None = None, options=None) -> grpc.Channel:
    """A channel to a deepinfer server whose calls carry the cluster secret (when one is set).

    NOTE: the transport is plaintext gRPC; the secret authenticates, it does not encrypt. Keep
    internal addresses on a private network (see README, "What is exposed").
    """
    secret = secret if secret is not None else cluster_secret()
    channel = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(channel, _AttachSecret(secret)) if secret else channel


def _aio_details(details, secret: str):
    return aio.ClientCallDetails(details.method, details.timeout, _with_secret(details.metadata, secret),
                                 details.credentials, details.wait_for_ready)


class _AioUnaryUnarySecret(aio.UnaryUnaryClientInterceptor):
    def __init__(self, secret: str) -> None:
        self._secret = secret

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_aio_details(client_call_details, self._secret), request)


class _AioUnaryStreamSecret(aio.UnaryStreamClientInterceptor):
    # NOTE: a separate class per call kind: grpc.aio files each interceptor under the first kind it is
    def __init__(self, secret: str) -> None:
        self._secret = secret

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_aio_details(client_call_details, self._secret), request)


def secure_aio_channel(address: str, secret: str | None = None) -> aio.Channel:
    """`secure_channel` for grpc.aio clients (the HTTP front)."""
    secret = secret if secret is not None else cluster_secret()
    interceptors = [_AioUnaryUnarySecret(secret), _AioUnaryStreamSecret(secret)] if secret else None
    return aio.insecure_channel(address, interceptors=interceptors)
