"""V4.1 Engram hashing: bucket primes and multipliers of the published config, the hasher bit-exact
against the reference's position-by-position walk (dead tokens included), and the normalised compressed
vocabulary."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.config import V41Config
from deepinfer.engine.models.deepseek_v41 import NgramHasher, compressed_token_map, engram_multipliers
from tests.engine.v41.configs import flash_config, tiny_config
from tests.engine.v41.reference import hash_rows


@pytest.fixture(scope="module")
def flash():
    return V41Config.from_hf_dict(flash_config())


def test_flash_buckets_sum_to_the_published_tables(flash):
    primes = flash.engram_primes  # [layer][order][head]
    assert [sum(sum(o) for o in layer) for layer in primes] == [384006168, 384016682]
    flat = [p for layer in primes for order in layer for p in order]
    assert len(flat) == len(set(flat)) == 48
    assert flat[:3] == [16000057, 16000079, 16000081] and flat[-3:] == [16000877, 16000879, 16000889]


def test_flash_multipliers(flash):
    m = engram_multipliers(flash.engram_layer_ids, 4, flash.engram_compressed_vocab_size)
    assert m.dtype == torch.int64 and m.shape == (2, 4)
    assert m[0].tolist() == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert m[1].tolist() == [67716810739261, 51510806800915, 30921347202721, 82619226485591]


@pytest.mark.parametrize("which", ["tiny", "flash"])
def test_hasher_is_bit_exact(which, flash):
    cfg = flash if which == "flash" else V41Config.from_hf_dict(tiny_config())
    g = torch.Generator().manual_seed(7)
    token_map = torch.randint(0, cfg.engram_compressed_vocab_size, (cfg.vocab_size,), generator=g)
    hasher = NgramHasher(cfg, token_map)
    ids = torch.randint(0, cfg.vocab_size, (37,), generator=g)
    live = torch.ones(37, dtype=torch.bool)
    live[[0, 9, 10, 11, 30]] = False  # dead tokens (image spans) block the look-back through them
    for mask in (None, live):
        got = hasher(ids, mask)
        want = hash_rows(cfg, token_map, ids[None], None if mask is None else mask[None])[0]
        assert got.dtype == torch.int64 and torch.equal(got, want)
    rows = hasher(ids, live)
    tables = torch.tensor(cfg.engram_num_embeddings)
    assert bool((rows >= 0).all()) and bool((rows < tables[None, :, None]).all())


def test_hasher_refuses_a_bad_token_map():
    cfg = V41Config.from_hf_dict(tiny_config())
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        NgramHasher(cfg, torch.full((cfg.vocab_size,), cfg.engram_compressed_vocab_size))
    with pytest.raises(RuntimeError, match="token map is not set"):
        NgramHasher(cfg)(torch.zeros(3, dtype=torch.long))


def test_compressed_vocabulary_normalisation():
    tokenizers = pytest.importorskip("tokenizers")
    words = ["<pad>", " The", "the", "THE", " cat", "Cat", "ｃａｔ", "\n", "  ", "é", "e", "A\ufffd", "a\ufffd", "x"]
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))

    class Tok:  # the two things the map reads of a fast tokenizer
        backend_tokenizer = backend

        def __len__(self):
            return len(words)

    lookup, size = compressed_token_map(Tok())
    by = dict(zip(words, lookup))
    assert by[" The"] == by["the"] == by["THE"]
    assert by[" cat"] == by["Cat"] == by["ｃａｔ"] != by["the"]
    assert by["\n"] == by["  "]  # whitespace runs collapse to one space, which survives the strip
    assert by["é"] == by["e"]
    assert by["A\ufffd"] != by["a\ufffd"]  # partial UTF-8 tokens are keyed raw, not normalised
    assert lookup[0] == 0 and size == len(set(lookup)) == max(lookup) + 1
