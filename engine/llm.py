"""The offline API, in vLLM's shape: `LLM(model=...).generate(prompts, SamplingParams(...))`.

Images (models with a vision tower): a prompt dict may carry `"multi_modal_data": {"image": [...]}`
with one image per placeholder token (129279, what recipe's chat encodings render per image) in
its `prompt_token_ids` (or `prompt` text), in order. An image is encoded bytes (PNG, JPEG, WEBP,
GIF) or a `PIL.Image`, preprocessed by recipe's `OpenCvImagePreprocessor` (detail "high", longer
side at most 2048, low detail 512, as the HTTP front does), or an already preprocessed recipe
`ImageInfo`. Each placeholder becomes the image's tokens (`engine.multimodal.expand_image_placeholders`).
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm

from deepinfer.engine.engine import Engine, EngineConfig, RequestOutput
from deepinfer.engine.errors import InvalidRequestError
from deepinfer.engine.multimodal import ImageSpan, expand_image_placeholders
from deepinfer.engine.sampling import SamplingParams


class LLM:
    """Offline batched generation over an in-process `Engine`."""

    def __init__(self, model: str | None = None, dtype: str = "float32", device: str = "cpu", **engine_kwargs) -> None:
        self.engine = Engine(EngineConfig(model=model, dtype=dtype, device=device, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer

    def shutdown(self) -> None:
        """Blocks until the engine's executor has stopped (its worker thread with `async_scheduling`); idempotent.
        The `LLM` generates nothing afterwards."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Blocks until every prompt finished; returns one `RequestOutput` per prompt, in order.

        A prompt is a string, a list of token ids, or a dict with `prompt` or `prompt_token_ids`
        (and optionally `multi_modal_data`, see the module docstring). Every prompt is validated
        before any runs: one bad prompt raises `InvalidRequestError` and nothing is queued. The
        images of all prompts are encoded together (equal sizes share a forward).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]  # a single list of token ids
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        prepared = [self._with_images(p) for p in prompts]
        flat = [s for _, spans in prepared for s in spans]
        if flat:  # NOTE: one encode call for every image of the batch
            encoded = iter(self.engine.encode_images(flat))
            prepared = [(p, [next(encoded) for _ in spans]) for p, spans in prepared]
        ids = []
        try:
            for (p, spans), sp in zip(prepared, params_list):
                ids.append(self.engine.add_request(None, p, sp, images=spans or None))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        while len(results) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[r] for r in ids]

    def chat(
        self,
        conversations: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Blocks until done; generates for one or more deepseek-recipe `Conversation`s (images
        included), rendered with the checkpoint's own chat encoding (`config.json`'s
        `deepinfer.chat_encoding`) exactly as the HTTP front renders them.

        Images come from the conversation's image sources (`DataUrlImageSource`,
        `BytesImageSource`), preprocessed by recipe as served images are. External image URLs are
        refused (`InvalidImageError`): this offline API fetches nothing; pass the bytes instead.
        """
        import deepseek_recipe as recipe

        from deepinfer.engine.images import IMAGE_PLACEHOLDER_ID, InvalidImageError
        from deepinfer.engine.tokenizer import load_chat_encoding

        if isinstance(conversations, recipe.Conversation):
            conversations = [conversations]
        encoding = load_chat_encoding(self.engine.model_path)
        prompts = []
        for conv in conversations:
            if not isinstance(conv, recipe.Conversation):
                raise InvalidRequestError(f"chat() takes deepseek_recipe.Conversation objects, got {type(conv).__name__}",
                                          field="conversation")
            sources = [s for m in conv.messages for s in m.image_sources]
            if any(s.kind == "url" for s in sources):
                raise InvalidImageError("the offline chat() fetches no image URLs; give the image bytes "
                                        "(BytesImageSource) or a data: URL", field="image")
            prompt: dict = {"prompt_token_ids": encoding.encode(conv)}
            placeholder = getattr(encoding, "image_placeholder_id", None)
            if sources and placeholder not in (None, IMAGE_PLACEHOLDER_ID):
                # NOTE: V4.1's tokenizer spells an image `<｜deepseek_image｜>` (129264); the engine's prompts
                # mark images with `<｜image｜>` (129279), whichever the model (`expand_image_placeholders`)
                prompt["prompt_token_ids"] = [IMAGE_PLACEHOLDER_ID if t == placeholder else t
                                              for t in prompt["prompt_token_ids"]]
            if sources:
                resolver = recipe.ImageResolver(
                    recipe.ReqwestImageFetcher().with_destination_filter(lambda host, address: False),
                    recipe.OpenCvImagePreprocessor())
                try:
                    infos = resolver.resolve(sources, recipe.ImageQuota()).images
                except recipe.ImageError as e:
                    raise InvalidImageError(f"a conversation image cannot be used ({e.kind}): {e}",
                                            field="image") from None
                prompt["multi_modal_data"] = {"image": infos}
            prompts.append(prompt)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompt: str | dict | list[int], sampling_params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield incremental outputs (`new_token_ids` / `new_text` deltas) of one request as they come."""
        prompt, spans = self._with_images(prompt)
        rid = self.engine.add_request(None, prompt, sampling_params, images=spans or None)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(rid)

    # ------------------------------------------------------------------ images

    def _with_images(self, prompt: Any) -> tuple[Any, list[ImageSpan]]:
        """A prompt without `multi_modal_data` and its image spans (placeholders expanded, not encoded)."""
        if not isinstance(prompt, dict) or "multi_modal_data" not in prompt:
            return prompt, []
        mm = prompt["multi_modal_data"]
        if not isinstance(mm, dict) or set(mm) - {"image"}:
            raise InvalidRequestError("multi_modal_data must be a dict with the key 'image' (the only modality)",
                                      field="multi_modal_data")
        if self.engine.vision is None:
            raise InvalidRequestError("this model has no vision tower (its config.json has no vision_config); "
                                      "send text only", field="multi_modal_data")
        images = mm.get("image") or []
        if not isinstance(images, (list, tuple)):
            images = [images]
        infos = [_preprocessed_image(im, i) for i, im in enumerate(images)]
        rest = {k: v for k, v in prompt.items() if k != "multi_modal_data"}
        if "prompt_token_ids" in rest:
            ids = rest["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)):
                raise InvalidRequestError("prompt_token_ids must be a list of ints", field="prompt_token_ids")
        elif isinstance(rest.get("prompt"), str):
            ids = self.tokenizer.encode(rest["prompt"], add_special_tokens=False).ids
        else:
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", field="prompt")
        ids, spans = expand_image_placeholders(list(ids), infos, image_token_id=self.engine.model_config.image_token_id,
                                               token_count=getattr(self.engine.vision, "image_token_count", None))
        return {"prompt_token_ids": ids, "prompt": rest.get("prompt")}, spans


def _preprocessed_image(image: Any, index: int):
    """recipe's preprocessed `ImageInfo` of one `multi_modal_data` image (bytes, PIL image or ImageInfo)."""
    import deepseek_recipe as recipe

    from deepinfer.engine.images import LOW_DETAIL_MAX_DIMENSION_PX, MAX_DIMENSION_PX, InvalidImageError

    if all(hasattr(image, a) for a in ("data", "width", "height")):
        return image  # already preprocessed (recipe ImageInfo)
    if isinstance(image, (bytes, bytearray, memoryview)):
        data = bytes(image)
    elif hasattr(image, "save") and hasattr(image, "mode"):  # a PIL image
        if image.mode not in ("RGB", "RGBA", "L"):
            image = image.convert("RGBA" if "A" in image.mode else "RGB")
        buf = io.BytesIO()
        image.save(buf, "PNG")
        data = buf.getvalue()
    else:
        raise InvalidRequestError(
            f"multi_modal_data image {index} is a {type(image).__name__}; give encoded bytes, a PIL image or a "
            "recipe ImageInfo", field="multi_modal_data")
    options = recipe.PreprocessOptions("high", MAX_DIMENSION_PX, LOW_DETAIL_MAX_DIMENSION_PX)
    try:
        return recipe.OpenCvImagePreprocessor().preprocess(data, options)
    except recipe.ImageError as e:
        raise InvalidImageError(f"multi_modal_data image {index} cannot be used ({e.kind}): {e}",
                                field="multi_modal_data") from None
