"""One stored block: a fixed header, then the payload (the block's compressed entries, every pool and layer).

Header (little-endian, `HEADER_NBYTES`): magic `DKVB`, format version (u16), reserved (u16), payload length
(u64), CRC32 of the payload (u32), reserved (u32), the block's key (16 bytes) and its predecessor's key
(16 bytes; zeros for a prompt's first block). `decode` refuses (returns None with a reason) anything that
is not exactly the block asked for: wrong magic or version, a truncated or padded-short blob, a checksum
that does not match, another key, another predecessor. A refused block is a miss, never served.
"""

from __future__ import annotations

import struct
import zlib

from deepinfer.kvstore.keys import KEY_NBYTES

MAGIC = b"DKVB"
VERSION = 1
_HEADER = struct.Struct(f"<4sHHQII{KEY_NBYTES}s{KEY_NBYTES}s")
HEADER_NBYTES = _HEADER.size
NO_PARENT = bytes(KEY_NBYTES)


def encode(key: bytes, parent_key: bytes | None, payload: bytes | memoryview) -> bytes:
    """Header + payload as one bytes object."""
    payload = memoryview(payload).cast("B")
    header = _HEADER.pack(MAGIC, VERSION, 0, payload.nbytes, zlib.crc32(payload), 0, key, parent_key or NO_PARENT)
    return header + payload.tobytes()


def decode(blob: bytes | memoryview, key: bytes, parent_key: bytes | None) -> tuple[memoryview | None, str]:
    """`(payload, "")` when `blob` is exactly the block `key` after `parent_key`, else `(None, why)`.

    Trailing bytes past the payload (direct-I/O padding) are ignored."""
    mv = memoryview(blob).cast("B")
    if mv.nbytes < HEADER_NBYTES:
        return None, f"truncated: {mv.nbytes} bytes, shorter than the header"
    magic, version, _, length, crc, _, got_key, got_parent = _HEADER.unpack_from(mv, 0)
    if magic != MAGIC or version != VERSION:
        return None, f"not a block of format {VERSION} (magic {magic!r}, version {version})"
    if got_key != key:
        return None, "the block names another key"
    if got_parent != (parent_key or NO_PARENT):
        return None, "the block's predecessor key does not match the prefix chain"
    if mv.nbytes < HEADER_NBYTES + length:
        return None, f"truncated: payload of {length} bytes, {mv.nbytes - HEADER_NBYTES} present"
    payload = mv[HEADER_NBYTES:HEADER_NBYTES + length]
    if zlib.crc32(payload) != crc:
        return None, "checksum mismatch"
    return payload, ""
