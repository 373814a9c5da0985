"""The cluster secret on internal gRPC services (issue 31), with real processes on loopback: a
balancer and the entrypoint started with `DEEPINFER_CLUSTER_SECRET` refuse `Generate`, `Abort`,
`Register`, `Deregister` and `Pick` from a caller without it (UNAUTHENTICATED), accept the callers
that carry it (`serving.auth.secure_channel`, the entrypoint `Client`), keep `Health` open, and never
write the secret to their logs."""

from __future__ import annotations

import os

import grpc
import pytest

from deepinfer.deploy.processes import ServiceProcesses
from deepinfer.engine.builtin_model import builtin_model_path
from deepinfer.entrypoint.client import Client, GenerateError
from deepinfer.protos import common_pb2, entrypoint_pb2, entrypoint_pb2_grpc, loadbalancer_pb2, loadbalancer_pb2_grpc
from deepinfer.serving.auth import SECRET_ENV, secure_channel

SECRET = "s3cret-for-the-test-0123456789"


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", SECRET_ENV: SECRET}
    logdir = tmp_path_factory.mktemp("secret-logs")
    procs = ServiceProcesses(logdir, env)
    try:
        for stage in ("prefill", "decode"):
            procs.spawn(f"{stage}_lb", ["loadbalancer", "--stage", stage, "--policy", "round_robin"])
        info = procs.wait_ready(60)
        procs.spawn("entrypoint", ["entrypoint", "--model", str(builtin_model_path()),
                                   "--prefill-lb-address", info["prefill_lb"]["address"],
                                   "--decode-lb-address", info["decode_lb"]["address"]])
        procs.wait_ready(60)
        yield procs.info, logdir
    finally:
        procs.stop(5)


def _code(fn) -> grpc.StatusCode | None:
    try:
        fn()
    except grpc.RpcError as e:
        return e.code()
    return None


def test_balancer_refuses_callers_without_the_secret(services):
    info, _ = services
    address = info["decode_lb"]["address"]
    register = loadbalancer_pb2.RegisterRequest(instance_id="intruder-0", address="127.0.0.1:1",
                                               stage=common_pb2.STAGE_DECODE)
    with grpc.insecure_channel(address) as plain, secure_channel(address, "wrong-secret") as wrong:
        for channel in (plain, wrong):
            stub = loadbalancer_pb2_grpc.LoadBalancerStub(channel)
            calls = (lambda s=stub: s.Register(register, timeout=5),
                     lambda s=stub: s.Deregister(loadbalancer_pb2.DeregisterRequest(instance_id="decode-0"), timeout=5),
                     lambda s=stub: s.Pick(loadbalancer_pb2.PickRequest(request_id="r"), timeout=5))
            assert [_code(call) for call in calls] == [grpc.StatusCode.UNAUTHENTICATED] * 3
        stub = loadbalancer_pb2_grpc.LoadBalancerStub(plain)
        try:
            stub.ListInstances(loadbalancer_pb2.ListInstancesRequest(), timeout=5)
            raise AssertionError("ListInstances answered without the secret")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAUTHENTICATED and SECRET not in (e.details() or "")
    with secure_channel(address, SECRET) as channel:
        stub = loadbalancer_pb2_grpc.LoadBalancerStub(channel)
        assert stub.Register(register, timeout=5) is not None
        assert list(stub.ListInstances(loadbalancer_pb2.ListInstancesRequest(), timeout=5).instances)
        stub.Deregister(loadbalancer_pb2.DeregisterRequest(instance_id="intruder-0"), timeout=5)


def test_entrypoint_refuses_generate_and_abort_without_the_secret(services):
    info, _ = services
    address = info["entrypoint"]["address"]
    with grpc.insecure_channel(address) as plain:
        stub = entrypoint_pb2_grpc.EntrypointStub(plain)
        request = entrypoint_pb2.GenerateRequest(prompt_token_ids=[5, 6, 7])
        assert _code(lambda: list(stub.Generate(request, timeout=5))) == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: stub.Abort(common_pb2.AbortRequest(request_id="x"),
                                        timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Health(common_pb2.HealthRequest(), timeout=5) is not None  # liveness stays open
    with Client(address, timeout_s=10, secret="wrong") as client:
        with pytest.raises(GenerateError) as e:
            client.generate([5, 6, 7], max_tokens=2)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    # with the secret the call gets through to the cluster (which has no workers: UNAVAILABLE, not refused)
    with Client(address, timeout_s=10, secret=SECRET) as client:
        with pytest.raises(GenerateError) as e:
            client.generate([5, 6, 7], max_tokens=2)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_the_secret_is_never_logged(services):
    _, logdir = services
    for path in logdir.iterdir():
        assert SECRET not in path.read_text(errors="replace"), path.name


def test_http_front_backend_carries_the_secret(services, monkeypatch):
    """The HTTP front's asyncio channel (grpc.aio interceptors) attaches the secret to its streamed calls."""
    import asyncio

    from deepinfer.entrypoint.http.backend import TokenBackend
    from deepinfer.entrypoint.http.errors import ApiError

    info, _ = services

    async def status_with(secret: str | None) -> int:
        if secret is None:
            monkeypatch.delenv(SECRET_ENV, raising=False)
        else:
            monkeypatch.setenv(SECRET_ENV, secret)
        backend = TokenBackend(info["entrypoint"]["address"], request_timeout_s=10)
        try:
            assert (await backend.health())[0] is not None
            call = backend.generate(entrypoint_pb2.GenerateRequest(request_id="h-1", prompt_token_ids=[5, 6]))
            try:
                await call.read()
            except ApiError as e:
                return e.status
            return 200
        finally:
            await backend.close()

    assert asyncio.run(status_with(SECRET)) == 503  # through to the cluster: no workers
    assert asyncio.run(status_with(None)) == 500  # refused (UNAUTHENTICATED is an internal error to a client)
