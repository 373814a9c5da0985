"""The entrypoint's image bookkeeping, pure: placeholder expansion, pick keys, and prompt block hashes
that equal the engine's (blocks over an image hash its content hash) so prefix-aware picks match."""

from __future__ import annotations

from deepinfer.engine.cache.block_pool import BlockPool, KVCacheManager
from deepinfer.engine.images import IMAGE_PLACEHOLDER_ID, IMAGE_TOKEN_ID
from deepinfer.entrypoint.server import expand_image_placeholders, image_pick_keys, prompt_block_hashes
from deepinfer.protos import common_pb2


class _Req:
    """A `CacheRequest` with images, hashing like the scheduler's `Request.extra_keys_for_block`."""

    def __init__(self, ids, spans):
        self.req_id, self.all_token_ids, self.spans = "r", ids, spans
        self.num_prompt_tokens = self.num_computed_tokens = len(ids)

    def extra_keys_for_block(self, start, end):
        return tuple(h for off, n, h in self.spans if off < end and off + n > start)


def test_expansion_and_hashes_match_the_engine():
    prompt = [5, 6, IMAGE_PLACEHOLDER_ID, 7, IMAGE_PLACEHOLDER_ID, 8]
    refs = [common_pb2.ImageRef(descriptor=b"a", offset=2, num_tokens=1),
            common_pb2.ImageRef(descriptor=b"b", offset=4, num_tokens=1)]
    ids, expanded = expand_image_placeholders(prompt, refs, [20, 9], ["aa" * 32, "bb" * 32])
    assert ids == [5, 6] + [IMAGE_TOKEN_ID] * 20 + [7] + [IMAGE_TOKEN_ID] * 9 + [8]
    assert [(r.offset, r.num_tokens, r.content_hash) for r in expanded] == [(2, 20, "aa" * 32), (23, 9, "bb" * 32)]
    manager = KVCacheManager(BlockPool(16, 8))
    engine_hashes = manager._block_hashes(_Req(ids, [(r.offset, r.num_tokens, r.content_hash) for r in expanded]), 4)
    assert prompt_block_hashes(ids, 8, expanded) == engine_hashes
    assert prompt_block_hashes(ids, 8) != engine_hashes  # without the images' hashes they would never match
    other, _ = expand_image_placeholders(prompt, refs, [20, 9], ["cc" * 32, "bb" * 32])
    assert prompt_block_hashes(other, 8, [common_pb2.ImageRef(content_hash="cc" * 32, offset=2, num_tokens=20)])[0] \
        != engine_hashes[0]  # same tokens, another image: another hash
    assert len(set(image_pick_keys(refs))) == 2
    assert image_pick_keys([common_pb2.ImageRef(content_hash="ab" * 32)]) == [int.from_bytes(b"\xab" * 8, "little")]
