"""A stand-in for the HTTP front's token backend (`entrypoint.http.backend`): no cluster, fixed answers.

`FakeBackend` answers every Generate with the tokens 5, 6 then `EOS` (two chunks, usage on both) and
records the requests it got; a subclass gives the chunks logprobs by overriding `logprobs`.
"""

from __future__ import annotations

from deepinfer.protos import common_pb2, entrypoint_pb2

EOS = 1
"""The fake answers' last token (id 1, the end of sequence in the tests' tokenizers)."""


class FakeCall:
    """A Generate call: `read` hands out the prepared chunks, then None."""

    def __init__(self, request_id: str, deltas: list[entrypoint_pb2.GenerateResponse]) -> None:
        self.request_id, self._deltas = request_id, list(deltas)

    async def read(self):
        return self._deltas.pop(0) if self._deltas else None

    def cancel(self) -> None:
        pass


class FakeBackend:
    """Answers every Generate with tokens 5, 6 then EOS, and records the requests."""

    def __init__(self) -> None:
        self.requests: list[entrypoint_pb2.GenerateRequest] = []

    def logprobs(self, request: entrypoint_pb2.GenerateRequest, token_ids: list[int]) -> list:
        """The chunk's `TokenLogprobs` for `token_ids` (none here)."""
        return []

    def generate(self, request: entrypoint_pb2.GenerateRequest) -> FakeCall:
        self.requests.append(request)
        n = len(request.prompt_token_ids)
        first = entrypoint_pb2.GenerateResponse(request_id=request.request_id, token_ids=[5, 6],
                                                logprobs=self.logprobs(request, [5, 6]),
                                                usage=common_pb2.Usage(prompt_tokens=n))
        last = entrypoint_pb2.GenerateResponse(request_id=request.request_id, token_ids=[EOS],
                                               logprobs=self.logprobs(request, [EOS]),
                                               finish_reason=common_pb2.FINISH_REASON_STOP,
                                               usage=common_pb2.Usage(prompt_tokens=n, completion_tokens=3))
        return FakeCall(request.request_id, [first, last])

    async def health(self, timeout_s: float = 5.0):
        return True, "", {}

    async def close(self) -> None:
        pass
