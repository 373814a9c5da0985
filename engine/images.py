"""Image sources of multimodal prompts, resolved the V4.1 way through deepseek-recipe: one place for the
URL allow-list, the per-request limits, the wire descriptor of a source and the image token count.

Shared by the HTTP front (early URL checks, placeholder lookup), the vision worker (fetch, decode,
preprocess, limits) and the offline path, so every stage applies the same rules.

* `ImageUrlPolicy` — which URLs may be fetched (data: URLs always; http(s) only to allowed hosts);
  its `fetcher()` is recipe's `ReqwestImageFetcher` with a destination filter, so nothing else is
  ever connected to (redirects included).
* `ImageLimits` — per-request limits: images, encoded bytes per image and in total, pixels.
* `ImageResolver` — sources -> `ResolvedImage`s (recipe's `ImageResolver` + `OpenCvImagePreprocessor`
  + `ImageQuota`); every failure is an `InvalidImageError` (HTTP 400) with a message saying what to fix.
* `image_descriptor` / `image_source` — the `ImageRef.descriptor` bytes of a source and back.

Token layout (vision contract): an engine prompt holds one placeholder (`IMAGE_PLACEHOLDER_ID`, `<｜image｜>`)
per image, whichever the model (recipe's encodings render it with V4's tokenizer; with V4.1's, which spells its
image token `<｜deepseek_image｜>`, `engine.tokenizer.RecipeChatEncoding` renders that id and the chat fronts map it
back); the inference input replaces it with `num_tokens` x `IMAGE_TOKEN_ID`.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

import deepseek_recipe as recipe

from deepinfer.engine.errors import InvalidRequestError

IMAGE_TOKEN_ID: int = recipe.IMAGE_SPECIAL_TOKEN_ID
"""`<｜image2｜>` (129264): the id every image token position holds in the prompt the engine runs."""
IMAGE_PLACEHOLDER_ID = 129279
"""`<｜image｜>` (V4's tokenizer): the one token an engine prompt holds per image (module docstring)."""
MAX_DIMENSION_PX = 2048
"""Recipe's preprocessing bound of a high-detail image's longer side."""
LOW_DETAIL_MAX_DIMENSION_PX = 512
"""Recipe's preprocessing bound of a low-detail image's longer side."""


class InvalidImageError(InvalidRequestError):
    """An image of the request cannot be used (bad bytes, over a limit, a URL that may not be fetched).

    `code` is a short machine-readable reason for API error bodies (e.g. "image_url_not_allowed").
    """

    status = 400
    """HTTP status at the edge."""

    def __init__(self, message: str, *, code: str = "invalid_image", field: str | None = "image") -> None:
        super().__init__(message, field=field)
        self.code = code

    def __reduce__(self):
        return (_rebuild_invalid_image_error, (str(self), self.code, self.field))


def _rebuild_invalid_image_error(message: str, code: str, field: str | None) -> InvalidImageError:
    return InvalidImageError(message, code=code, field=field)


class ImageUrlPolicy:
    """Which image URLs may be fetched: data: URLs (no fetch) and http(s) URLs of allowed hosts."""

    def __init__(self, allowed_hosts: list[str] | tuple[str, ...] = ()) -> None:
        self.allowed_hosts = frozenset(h.strip().lower() for h in allowed_hosts if h.strip())

    def check(self, url: str) -> None:
        """Raises `InvalidImageError` (code "image_url_not_allowed") unless `url` may be fetched."""
        if url.startswith("data:"):
            return
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or (parts.hostname or "").lower() not in self.allowed_hosts:
            raise InvalidImageError(
                f"image URL {url[:200]!r} is not allowed: send the image inline as a data: URL"
                + (f" or use a host of {sorted(self.allowed_hosts)}" if self.allowed_hosts else ""),
                code="image_url_not_allowed", field="image_url")

    def destination_filter(self, host: str, address: str) -> bool:
        """recipe's `with_destination_filter` hook: connect only to allowed hosts."""
        return host.lower() in self.allowed_hosts

    def fetcher(self, max_bytes: int) -> recipe.ReqwestImageFetcher:
        """A recipe image fetcher restricted to the allowed hosts."""
        return recipe.ReqwestImageFetcher.with_max_bytes(max_bytes).with_destination_filter(self.destination_filter)


@dataclass(frozen=True)
class ImageLimits:
    """Per-request image limits (checked before anything is decoded where possible)."""

    max_images: int = 8
    """Images per request."""
    max_image_bytes: int = 8 << 20
    """Encoded bytes of one image (inline data or the fetched body)."""
    max_total_bytes: int = 32 << 20
    """Encoded bytes of all images of a request."""
    max_image_pixels: int = 40_000_000
    """Width x height of one decoded image."""


@dataclass(frozen=True)
class ResolvedImage:
    """One preprocessed image: recipe's `ImageInfo` plus what every stage needs to know about it."""

    info: recipe.ImageInfo
    """The preprocessed image (WEBP bytes, width, height)."""
    content_hash: str
    """Hex SHA-256 of `info.data` (prefix-cache key and embedding-cache key)."""
    num_tokens: int
    """Image tokens: `MultiModalData([info]).image_token_adjustment() + 1` (the V4.1 specification)."""


def image_token_count(info: recipe.ImageInfo) -> int:
    """Image tokens of one preprocessed image, by recipe's V4.1 specification."""
    return recipe.MultiModalData([info]).image_token_adjustment() + 1


def image_descriptor(source: recipe.ImageSource) -> bytes:
    """The `ImageRef.descriptor` of a recipe image source (JSON: url or data_url or base64 bytes, detail)."""
    detail = str(source.detail or "high")
    if source.url:
        return json.dumps({"url": source.url, "detail": detail}).encode()
    if source.data_url:
        return json.dumps({"data_url": source.data_url, "detail": detail}).encode()
    return json.dumps({"data_b64": base64.b64encode(source.data or b"").decode(), "detail": detail}).encode()


def image_source(descriptor: bytes) -> recipe.ImageSource:
    """The recipe image source of an `ImageRef.descriptor`; raises `InvalidImageError` if malformed.

    Besides `image_descriptor`'s JSON, a bare URL (http(s) or data:) is accepted, and anything
    else is taken as the image's encoded bytes.
    """
    raw = bytes(descriptor)
    if not raw:
        raise InvalidImageError("an image has an empty descriptor", code="invalid_image")
    if raw.startswith(b"{"):
        try:
            d = json.loads(raw)
            detail = d.get("detail") or "high"
            if "url" in d:
                return _url_source(d["url"], detail)
            if "data_url" in d:
                return recipe.DataUrlImageSource(d["data_url"], detail)
            return recipe.BytesImageSource(base64.b64decode(d["data_b64"]), detail)
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidImageError(f"malformed image descriptor: {e}") from None
    if raw.startswith(b"data:"):
        return recipe.DataUrlImageSource(raw.decode(errors="replace"))
    if _URL_SCHEME.match(raw[:64]):  # any scheme: the resolver's policy refuses all but http(s)
        return _url_source(raw.decode(errors="replace"), "high")
    return recipe.BytesImageSource(raw)


_URL_SCHEME = re.compile(rb"[A-Za-z][A-Za-z0-9+.-]{0,31}://")
"""A descriptor starting like `scheme://` is a URL, never image bytes (no image format starts so)."""


def _url_source(url: str, detail: str) -> recipe.ImageSource:
    if url.startswith("data:"):
        return recipe.DataUrlImageSource(url, detail)
    return recipe.UrlImageSource(url, detail)


_RECIPE_ERROR_CODES = {
    "UnsupportedMediaType": ("invalid_image", "is not a supported image (send a valid PNG, JPEG, WEBP or GIF)"),
    "Decode": ("invalid_image", "is not a supported image (its bytes do not decode; send a valid PNG, JPEG, WEBP or GIF)"),
    "EmptyImage": ("invalid_image", "is empty or truncated (send a valid PNG, JPEG, WEBP or GIF)"),
    "ImageTooLarge": ("image_too_large", "is larger than recipe's byte limit"),
    "ImageDimensionsTooLarge": ("image_too_large", "has dimensions over recipe's limit"),
    "InvalidUrl": ("image_url_not_allowed", "has an unsupported URL: use a data: URL or an allowed http(s) host"),
    "DestinationRejected": ("image_url_not_allowed", "has a URL whose host may not be fetched"),
}


class ImageResolver:
    """Resolves the image sources of one request: fetch (allow-listed), decode, preprocess, count.

    Thread-safe for concurrent `resolve` calls (recipe's resolver is); each call gets its own quota.
    """

    def __init__(self, policy: ImageUrlPolicy, limits: ImageLimits | None = None) -> None:
        self.policy = policy
        self.limits = limits or ImageLimits()
        self._resolver = recipe.ImageResolver(policy.fetcher(self.limits.max_image_bytes),
                                              recipe.OpenCvImagePreprocessor())

    def resolve(self, sources: list[recipe.ImageSource]) -> list[ResolvedImage]:
        """Blocks while fetching and preprocessing; raises `InvalidImageError` on the first bad image."""
        limits = self.limits
        if len(sources) > limits.max_images:
            raise InvalidImageError(f"the request has {len(sources)} images; at most {limits.max_images} are allowed "
                                    "per request", code="too_many_images")
        total = 0
        for i, source in enumerate(sources):
            if source.url and not source.url.startswith("data:"):
                self.policy.check(source.url)
                continue  # fetched bytes are bounded by the fetcher (max_image_bytes)
            data = _inline_bytes(source, i)
            if len(data) > limits.max_image_bytes:
                raise InvalidImageError(f"image {i} is {len(data)} bytes; at most {limits.max_image_bytes} are allowed",
                                        code="image_too_large")
            total += len(data)
            if total > limits.max_total_bytes:
                raise InvalidImageError(f"the request's images exceed {limits.max_total_bytes} bytes in total",
                                        code="image_too_large")
            _check_pixels(data, i, limits.max_image_pixels)
        quota = recipe.ImageQuota()
        try:
            data = self._resolver.resolve(sources, quota)
        except recipe.ImageError as e:
            code, what = _RECIPE_ERROR_CODES.get(e.kind, ("invalid_image", "cannot be used"))
            if e.kind == "Fetch":
                code, what = "image_fetch_failed", "could not be downloaded"
            where = str(e).split(":", 1)[0].replace("[", " ").rstrip("]") if str(e).startswith("image[") else "an image"
            raise InvalidImageError(f"{where} {what} ({e.kind}: {e})", code=code) from None
        if quota.byte_size() > limits.max_total_bytes:
            raise InvalidImageError(f"the request's images exceed {limits.max_total_bytes} bytes in total",
                                    code="image_too_large")
        out = []
        for i, info in enumerate(data.images):
            try:
                num_tokens = image_token_count(info)
            except (recipe.CalcResizeError, ValueError) as e:
                raise InvalidImageError(f"image {i} has a size recipe cannot fit ({info.width}x{info.height}): {e}",
                                        code="invalid_image") from None
            out.append(ResolvedImage(info, hashlib.sha256(info.data).hexdigest(), num_tokens))
        return out


def _inline_bytes(source: recipe.ImageSource, index: int) -> bytes:
    if source.data is not None:
        return bytes(source.data)
    url = source.data_url or source.url or ""
    head, _, body = url.partition(",")
    if not body and not head.startswith("data:"):
        raise InvalidImageError(f"image {index} has no data", code="invalid_image")
    try:
        if head.endswith(";base64"):
            return base64.b64decode(body, validate=False)
        from urllib.parse import unquote_to_bytes

        return unquote_to_bytes(body)
    except ValueError as e:
        raise InvalidImageError(f"image {index} has a malformed data URL: {e}", code="invalid_image") from None


def _check_pixels(data: bytes, index: int, max_pixels: int) -> None:
    """Refuse an image whose header declares more than `max_pixels` (reads the header only)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            width, height = im.size
    except Exception:
        return  # not decodable here: recipe refuses it with its own message
    if width * height > max_pixels:
        raise InvalidImageError(f"image {index} is {width}x{height} = {width * height} pixels; at most {max_pixels} "
                                "are allowed", code="image_too_large")
