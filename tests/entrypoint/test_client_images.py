"""The gRPC client's image placeholders: one image per placeholder or a ValueError before anything is sent; a prompt
rendered with V4.1's spelling (`<｜deepseek_image｜>`, 129264) goes out with the token API's 129279 at the same
offsets (the demo and any client that renders with `RecipeChatEncoding` on a V4.1 tokenizer)."""

from __future__ import annotations

import pytest

from deepinfer.engine.images import IMAGE_PLACEHOLDER_ID
from deepinfer.entrypoint.client import Client

V41_IMAGE = 129264


class _Captured(Exception):
    pass


def _sent(client: Client, prompt: list[int], **kwargs):
    """The GenerateRequest `stream` would send (captured at the stub, no server)."""
    seen = []

    def generate(request, timeout=None):
        seen.append(request)
        raise _Captured

    client._stub.Generate = generate
    with pytest.raises(_Captured):
        list(client.stream(prompt, **kwargs))
    return seen[0]


def test_a_v41_placeholder_is_sent_as_the_token_apis_with_its_offsets():
    with Client("127.0.0.1:1") as client:
        request = _sent(client, [5, V41_IMAGE, 6, V41_IMAGE], images=[b"a", b"b"], image_placeholder_id=V41_IMAGE)
    assert list(request.prompt_token_ids) == [5, IMAGE_PLACEHOLDER_ID, 6, IMAGE_PLACEHOLDER_ID]
    assert [(i.offset, i.descriptor) for i in request.images] == [(1, b"a"), (3, b"b")]


def test_images_and_placeholders_must_pair_up_before_anything_is_sent():
    with Client("127.0.0.1:1") as client:
        client._stub.Generate = lambda *a, **k: pytest.fail("sent")
        with pytest.raises(ValueError, match="1 image placeholders .* for 2 images"):
            list(client.stream([5, IMAGE_PLACEHOLDER_ID, 6], images=[b"a", b"b"]))
        with pytest.raises(ValueError, match="0 image placeholders"):  # V4.1's id without saying so: not dropped
            list(client.stream([5, V41_IMAGE, 6], images=[b"a"]))
