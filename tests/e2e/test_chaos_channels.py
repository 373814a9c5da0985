"""Every balancer client reconnects within a second of a balancer restart (issue 26): the HTTP front's
and the deploy controller's balancer channels get `serving.membership.BALANCER_CHANNEL_OPTIONS`, as the
workers' and the entrypoint's do (gRPC's default reconnect backoff grows to two minutes)."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from deepinfer.serving.membership import BALANCER_CHANNEL_OPTIONS


class _Refused(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


class _FakeChannel:
    """Every call fails at once (the balancer is away); closes fine."""

    def unary_unary(self, *args, **kwargs):
        def call(*a, **k):
            raise _Refused()
        return call

    unary_stream = unary_unary

    async def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_http_front_asks_balancers_with_the_balancer_options(monkeypatch):
    from deepinfer.entrypoint.http import backend

    opened: dict[str, object] = {}

    def channel(address, secret=None, options=None):
        opened[address] = options
        return _FakeChannel()

    monkeypatch.setattr(backend, "secure_aio_channel", channel)

    async def run():
        b = backend.TokenBackend("127.0.0.1:1")
        try:
            return await b.stage_stats({"prefill": "127.0.0.1:2", "decode": "127.0.0.1:3"}, timeout_s=0.1)
        finally:
            await b.close()

    assert asyncio.run(run()) == {}
    assert opened["127.0.0.1:2"] == BALANCER_CHANNEL_OPTIONS and opened["127.0.0.1:3"] == BALANCER_CHANNEL_OPTIONS
    assert opened["127.0.0.1:1"] is None  # the entrypoint's channel: no balancer


def test_the_aio_channel_factory_passes_the_options_on(monkeypatch):
    from deepinfer.serving import auth

    monkeypatch.setattr(auth, "tls_settings", lambda: None)
    seen = {}
    monkeypatch.setattr(auth.aio, "insecure_channel",
                        lambda address, options=None, interceptors=None: seen.update(options=options) or "channel")
    assert auth.secure_aio_channel("127.0.0.1:1", secret="", options=BALANCER_CHANNEL_OPTIONS) == "channel"
    assert seen["options"] == BALANCER_CHANNEL_OPTIONS


def test_the_deploy_controller_asks_balancers_with_the_balancer_options(monkeypatch):
    pytest.importorskip("ray")
    from deepinfer.deploy import controller

    opened: dict[str, object] = {}

    def channel(address, secret=None, options=None):
        opened[address] = options
        return _FakeChannel()

    monkeypatch.setattr(controller, "secure_channel", channel)

    class Config:
        @staticmethod
        def active_stages():
            return ["prefill", "decode"]

    c = object.__new__(controller.ClusterController)  # no Ray cluster: only what `status` reads
    c._lock, c._instances, c.config = threading.Lock(), {}, Config()
    c.addresses = {"prefill_lb": "127.0.0.1:2", "decode_lb": "127.0.0.1:3"}
    monkeypatch.setattr(c, "_services", lambda: [])
    status = c.status()
    assert status["balance"] == {"prefill": None, "decode": None}  # both away: reported, not raised
    assert opened == {"127.0.0.1:2": BALANCER_CHANNEL_OPTIONS, "127.0.0.1:3": BALANCER_CHANNEL_OPTIONS}
