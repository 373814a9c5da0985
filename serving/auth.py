"""The cluster secret: every internal gRPC call carries it, every deepinfer gRPC server checks it.

```python
server = grpc.server(pool, interceptors=server_interceptors())    # refuses calls without the secret
port = add_port(server, "0.0.0.0:50051")                         # TLS when this process has a certificate
channel = secure_channel("127.0.0.1:50051")                      # attaches it to every call (TLS when set)
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

Optional TLS, also from the environment (`TLS_*_ENV`: set by `deepinfer up` from the YAML's `tls:`, or
by the `--tls-cert/--tls-key/--tls-ca/--tls-server-name` flags of every service, `serving.config_cli`):
`add_port` binds a server TLS-only when a certificate is set, and `secure_channel` /
`secure_aio_channel` (every deepinfer client channel is made by one of them) dial TLS checked
against the CA. Without it the transport is plaintext: the secret authenticates, it does not encrypt.
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
    """A channel to a deepinfer server whose calls carry the cluster secret (when one is set), over TLS
    when this process has TLS settings (`tls_settings`), else plaintext.

    Every deepinfer client channel is made here (or by `secure_aio_channel`), so one setting switches
    every internal call to TLS. NOTE: without TLS the secret authenticates, it does not encrypt: keep
    internal addresses on a private network (see README, "What is exposed").
    """
    secret = secret if secret is not None else cluster_secret()
    tls = tls_settings()
    if tls is not None and tls.is_client:
        channel = grpc.secure_channel(address, tls.channel_credentials(), options=tls.channel_options(options))
    else:
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


def secure_aio_channel(address: str, secret: str | None = None, options=None) -> aio.Channel:
    """`secure_channel` for grpc.aio clients (the HTTP front); `options`: gRPC channel arguments."""
    secret = secret if secret is not None else cluster_secret()
    interceptors = [_AioUnaryUnarySecret(secret), _AioUnaryStreamSecret(secret)] if secret else None
    tls = tls_settings()
    if tls is not None and tls.is_client:
        return aio.secure_channel(address, tls.channel_credentials(), options=tls.channel_options(options),
                                  interceptors=interceptors)
    return aio.insecure_channel(address, options=options, interceptors=interceptors)


# ---------------------------------------------------------------------------------------------- TLS

TLS_CERT_ENV = "DEEPINFER_TLS_CERT"
"""PEM certificate (chain) this process's gRPC servers present; with `TLS_KEY_ENV` they serve TLS only."""
TLS_KEY_ENV = "DEEPINFER_TLS_KEY"
"""PEM private key of `TLS_CERT_ENV`."""
TLS_CA_ENV = "DEEPINFER_TLS_CA"
"""PEM CA bundle this process's clients check servers against; unset = the system's roots."""
TLS_SERVER_NAME_ENV = "DEEPINFER_TLS_SERVER_NAME"
"""Name the clients expect in every server's certificate instead of the dialled host (one certificate
with one DNS name for a cluster reached by IP addresses); unset = the dialled host."""
TLS_ENVS = (TLS_CERT_ENV, TLS_KEY_ENV, TLS_CA_ENV, TLS_SERVER_NAME_ENV)
TLS_FLAGS = {"tls_cert": TLS_CERT_ENV, "tls_key": TLS_KEY_ENV, "tls_ca": TLS_CA_ENV,
             "tls_server_name": TLS_SERVER_NAME_ENV}
"""The `--tls-*` flag of every deepinfer process (`serving.config_cli`) -> the variable it sets."""


def _read_pem(path: str, env: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise RuntimeError(f"cannot read the TLS file {path} ({env}): {e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise RuntimeError(f"the TLS file {path} ({env}) is not PEM (no '-----BEGIN' line)")
    return data


class TlsSettings:
    """One process's TLS files, read once (`tls_settings`): a server side (certificate + key) and a
    client side (CA bundle, optional expected server name).

    Servers serve TLS exactly when a certificate and key are set (plaintext clients are refused at the
    handshake). Clients use TLS when a CA or a certificate is set: one cluster-wide switch, since a
    service that serves TLS calls peers that do too. Server certificates are not asked of clients (the
    cluster secret authenticates them; TLS adds confidentiality and server identity).
    """

    def __init__(self, cert: str | None, key: str | None, ca: str | None, server_name: str | None) -> None:
        if bool(cert) != bool(key):
            raise RuntimeError(f"TLS needs both a certificate and its key: got only the {'certificate' if cert else 'key'}"
                               f" ({TLS_CERT_ENV} / {TLS_KEY_ENV}, `--tls-cert` / `--tls-key`)")
        self.cert_path, self.key_path, self.ca_path, self.server_name = cert, key, ca, server_name or None
        self.cert = _read_pem(cert, TLS_CERT_ENV) if cert else None
        self.key = _read_pem(key, TLS_KEY_ENV) if key else None
        self.ca = _read_pem(ca, TLS_CA_ENV) if ca else None

    @property
    def is_server(self) -> bool:
        return self.cert is not None

    @property
    def is_client(self) -> bool:
        return self.ca is not None or self.cert is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca)

    def channel_options(self, options) -> list:
        options = list(options or ())
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return options


_tls_cache: dict[tuple, TlsSettings | None] = {}


def tls_settings() -> TlsSettings | None:
    """This process's TLS settings from its environment (`TLS_*_ENV`, set by `deepinfer up`, by the
    `--tls-*` flags of each service, or by hand), or None (plaintext). Read once per distinct setting;
    RuntimeError naming the variable when a file is missing or not PEM."""
    key = tuple(os.environ.get(env) or None for env in TLS_ENVS)
    if key not in _tls_cache:
        _tls_cache[key] = TlsSettings(*key) if any(key[:3]) else None
    return _tls_cache[key]


def set_tls(cert: str | None = None, key: str | None = None, ca: str | None = None,
            server_name: str | None = None) -> None:
    """Make these TLS files this process's (and its children's) settings: what the `--tls-*` flags do.
    Values left None keep what the environment had. Checked at once (`tls_settings`)."""
    for env, value in zip(TLS_ENVS, (cert, key, ca, server_name)):
        if value is not None:
            os.environ[env] = str(value)
    tls_settings()


def tls_env() -> dict[str, str]:
    """The TLS variables of this process's environment (what a launcher hands on to the roles it starts)."""
    return {env: os.environ[env] for env in TLS_ENVS if os.environ.get(env)}


def add_port(server, address: str) -> int:
    """Bind `server` (grpc or grpc.aio) to `address`: a TLS port when this process has a certificate
    (`tls_settings`), else a plaintext one. Returns the port (0 = could not bind, as grpc does)."""
    tls = tls_settings()
    if tls is not None and tls.is_server:
        return server.add_secure_port(address, tls.server_credentials())
    return server.add_insecure_port(address)
