"""The token-level entrypoint seen from the HTTP front: an asyncio gRPC client (grpc.aio).

One `TokenCall` per request. Cancelling it (client gone, recipe's stop sequence matched) cancels the
Generate call, which the entrypoint turns into an abort on every stage.
"""

from __future__ import annotations

import json

import grpc
from grpc import aio

from deepinfer.entrypoint.http.errors import ApiError, from_grpc
from deepinfer.protos import (
    common_pb2,
    decode_pb2_grpc,
    entrypoint_pb2,
    entrypoint_pb2_grpc,
    loadbalancer_pb2,
    loadbalancer_pb2_grpc,
    prefill_pb2_grpc,
    vision_pb2_grpc,
)
from deepinfer.protos.metadata import ERROR_FIELD_METADATA_KEY, STATS_METADATA_KEY
from deepinfer.serving.auth import secure_aio_channel
from deepinfer.serving.membership import BALANCER_CHANNEL_OPTIONS


class TokenCall:
    """One streamed Generate call; `read()` maps failures to `ApiError`."""

    def __init__(self, call: aio.UnaryStreamCall, request_id: str, retry_after_s: int) -> None:
        self._call = call
        self.request_id = request_id
        self._retry_after_s = retry_after_s

    async def read(self) -> entrypoint_pb2.GenerateResponse | None:
        """Blocks until the next delta; None once the stream ended. Raises `ApiError` on failure."""
        try:
            msg = await self._call.read()
        except aio.AioRpcError as e:
            raise self._error(e) from None
        if msg is aio.EOF:
            return None
        if msg.finish_reason in (common_pb2.FINISH_REASON_ABORT, common_pb2.FINISH_REASON_ERROR):
            raise ApiError(500 if msg.finish_reason == common_pb2.FINISH_REASON_ERROR else 503,
                           f"the request was aborted by the service (request {self.request_id})",
                           code="aborted", retry_after_s=self._retry_after_s)
        return msg

    def cancel(self) -> None:
        """Cancel the call (the entrypoint aborts the request everywhere); no-op once it ended."""
        self._call.cancel()

    def _error(self, e: aio.AioRpcError) -> ApiError:
        field = dict(e.trailing_metadata() or ()).get(ERROR_FIELD_METADATA_KEY)
        return from_grpc(e.code(), e.details() or "", field, self.request_id, self._retry_after_s)


class TokenBackend:
    """The asyncio channel to one entrypoint; create and close it on the server's event loop."""

    def __init__(self, address: str, retry_after_s: int = 1, request_timeout_s: float = 600.0) -> None:
        self.address = address
        self.retry_after_s = retry_after_s
        self.request_timeout_s = request_timeout_s
        self._channel = secure_aio_channel(address)  # carries the cluster secret (serving.auth)
        self._stub = entrypoint_pb2_grpc.EntrypointStub(self._channel)
        self._stage_channels: dict[str, aio.Channel] = {}

    def generate(self, request: entrypoint_pb2.GenerateRequest) -> TokenCall:
        # NOTE: always with a deadline; the entrypoint turns the call's time left into stage deadlines
        call = self._stub.Generate(request, timeout=self.request_timeout_s)
        return TokenCall(call, request.request_id, self.retry_after_s)

    async def health(self, timeout_s: float = 5.0) -> tuple[bool, str, dict]:
        """Blocks for the entrypoint's Health: (is_healthy, message, stats); unreachable = unhealthy."""
        try:
            call = self._stub.Health(common_pb2.HealthRequest(), timeout=timeout_s)
            reply = await call
            trailing = dict(await call.trailing_metadata() or ())
        except grpc.RpcError as e:
            return False, f"entrypoint unreachable: {e.code().name}", {}
        stats = json.loads(trailing.get(STATS_METADATA_KEY, "{}"))
        return reply.is_healthy, reply.message, stats

    async def close(self) -> None:
        await self._channel.close()
        for channel in self._stage_channels.values():
            await channel.close()

    async def stage_stats(self, lb_addresses: dict[str, str], timeout_s: float = 2.0) -> dict[tuple[str, str], dict]:
        """Blocks for `{(stage, instance_id): Health stats}` of every instance the balancers list
        (`{stage: balancer address}`); instances or balancers that do not answer are left out."""
        out: dict[tuple[str, str], dict] = {}
        for stage, lb_address in lb_addresses.items():
            try:
                lb = loadbalancer_pb2_grpc.LoadBalancerStub(self._stage_channel(lb_address, BALANCER_CHANNEL_OPTIONS))
                listed = await lb.ListInstances(loadbalancer_pb2.ListInstancesRequest(), timeout=timeout_s)
            except grpc.RpcError:
                continue
            stub_cls = {"vision": vision_pb2_grpc.VisionStub, "prefill": prefill_pb2_grpc.PrefillStub,
                        "decode": decode_pb2_grpc.DecodeStub}[stage]
            for instance in listed.instances:
                try:
                    call = stub_cls(self._stage_channel(instance.address)).Health(common_pb2.HealthRequest(),
                                                                                   timeout=timeout_s)
                    await call
                    trailing = dict(await call.trailing_metadata() or ())
                    out[(stage, instance.instance_id)] = json.loads(trailing.get(STATS_METADATA_KEY, "{}"))
                except grpc.RpcError:
                    continue
        return out

    def _stage_channel(self, address: str, options=None) -> aio.Channel:
        """The cached channel to a stage instance or balancer (`options`: a balancer's
        `BALANCER_CHANNEL_OPTIONS`, so its stats come back within a second of a balancer restart)."""
        if address not in self._stage_channels:
            self._stage_channels[address] = secure_aio_channel(address, options=options)
        return self._stage_channels[address]
