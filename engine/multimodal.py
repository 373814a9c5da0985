"""Images inside a request's prompt ids: `ImageSpan` and the placeholder expansion.

The engine runs prompt ids in which every image occupies `num_tokens` consecutive positions holding
`IMAGE_TOKEN_ID` (129264); an `ImageSpan` says where, which image (its content hash) and, once
encoded, the input embeddings of those positions (see engine/models/vision.py for the layout).

Who fills what:
* a prompt holds one placeholder (129279) per image (the chat fronts map V4.1's `<｜deepseek_image｜>` to it: see
  engine.images); `expand_image_placeholders`
  turns a prompt with placeholders plus recipe's preprocessed images (`ImageInfo`) into engine
  prompt ids and spans carrying the images (`embeds=None`).
* `Engine.add_request(..., images=spans)` takes spans with `embeds` (computed elsewhere, e.g. by
  the vision stage, as the prefill worker receives them) or with `image` (the engine's own
  `VisionTower` encodes it before the request is queued).
* The scheduler keys the prefix hash of every cache block that overlaps a span with the span's
  `content_hash` (`Request.extra_keys_for_block`), so equal text with another image never shares
  cache; the model runner replaces the input embeddings of the positions a step computes (any
  part of a span: chunked prefill and bounded replay cut spans anywhere).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deepinfer.engine.config import IMAGE_TOKEN_ID
from deepinfer.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

IMAGE_PLACEHOLDER_ID = 129279
"""`<｜image｜>`: the one token an engine prompt holds per image (same as engine.images, whose docstring says how
V4.1's `<｜deepseek_image｜>` maps to it)."""


@dataclass(frozen=True, eq=False)
class ImageSpan:
    """One image's positions `[offset, offset + num_tokens)` in a request's prompt ids."""

    offset: int
    """Position of the image's first token (its `image_begin` row) in the prompt ids."""
    num_tokens: int
    """Positions the image occupies: `image_token_count(width, height)`."""
    content_hash: str
    """Hex SHA-256 of recipe's preprocessed `ImageInfo.data`; part of the prefix hash of every cache
    block the span overlaps."""
    embeds: torch.Tensor | None = None  # [num_tokens, lm_hidden]
    """The LM input embeddings of the span's positions, in order; None until encoded."""
    image: Any = None
    """The preprocessed image to encode when `embeds` is None: recipe's `ImageInfo` (WEBP bytes,
    width, height) or anything with `data`, `width` and `height`."""

    @property
    def end(self) -> int:
        """One past the span's last position."""
        return self.offset + self.num_tokens


def image_content_hash(data: bytes) -> str:
    """The content hash of a preprocessed image: hex SHA-256 of its encoded bytes."""
    return hashlib.sha256(bytes(data)).hexdigest()


def expand_image_placeholders(
    prompt_ids: Sequence[int],
    infos: Sequence[Any],
    *,
    image_token_id: int = IMAGE_TOKEN_ID,
    placeholder_id: int = IMAGE_PLACEHOLDER_ID,
    token_count: Callable[[int, int], int] | None = None,
) -> tuple[list[int], list[ImageSpan]]:
    """Replace the i-th placeholder (129279) of `prompt_ids` by `image_token_count(infos[i])` copies of
    `image_token_id` (129264) -> (engine prompt ids, one `ImageSpan` per image carrying its `ImageInfo`).

    `token_count(width, height)`: the model's own count when its tower has one (V4.1's resize plan,
    `V41VisionTower.image_token_count`); else V4's layout (`engine.models.vision.image_token_count`).

    Raises `InvalidRequestError` (field "multi_modal_data") when the number of placeholders is not
    the number of images.
    """
    from deepinfer.engine.models.vision import image_token_count

    count = token_count or image_token_count

    num_placeholders = sum(1 for t in prompt_ids if t == placeholder_id)
    if num_placeholders != len(infos):
        raise InvalidRequestError(
            f"the prompt has {num_placeholders} image placeholder(s) (token {placeholder_id}) but {len(infos)} "
            "image(s) were given; give one image per placeholder, in order",
            field="multi_modal_data",
        )
    ids: list[int] = []
    spans: list[ImageSpan] = []
    images = iter(infos)
    for t in prompt_ids:
        if t != placeholder_id:
            ids.append(t)
            continue
        info = next(images)
        n = count(int(info.width), int(info.height))
        spans.append(ImageSpan(len(ids), n, image_content_hash(info.data), image=info))
        ids.extend([image_token_id] * n)
    return ids, spans
