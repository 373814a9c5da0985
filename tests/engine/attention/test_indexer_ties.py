"""The lightning indexer's top-k tie rule (issue 21 item 3): `topk_mask` in engine/models/deepseek_v4.py.

An entry whose every indexer head has ReLU(q.k) = 0 scores exactly 0, so with few indexer heads many
entries tie at the top-k boundary. The rule (see `topk_mask`'s NOTE): the larger score first, equal
scores by the lower entry index, entries the query cannot see never. These tests pin the selected
sets on constructed ties, its independence of entries the query cannot see, its invariance to
chunking on a model with one indexer head (where ties are common), and CPU == CUDA.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import deepinfer.engine.models.deepseek_v4 as deepseek_v4
from deepinfer.engine.loader import load_checkpoint
from deepinfer.engine.models.deepseek_v4 import topk_mask
from deepinfer.engine.testing.make_checkpoint import make_checkpoint
from deepinfer.engine.testing.model_runner import ModelRunnerForTests
from deepinfer.engine.testing.presets import get_preset


def _selected(mask: torch.Tensor) -> list[list[int]]:
    return [row.nonzero().flatten().tolist() for row in mask]


def _indexer_scores(q, keys, weights) -> torch.Tensor:
    """The indexer's score, sum_h w_h * ReLU(q_h . k) * d^-1/2, as Indexer.select computes it: [n, C]."""
    d = q.shape[-1]
    return (F.relu(torch.einsum("nhd,cd->nhc", q, keys)) * d**-0.5 * weights[:, :, None]).sum(dim=1)


def test_exact_ties_at_the_boundary_go_to_the_lower_entry_index():
    # 2 heads of dim 2; keys 0..7. Head 0 looks along +x, head 1 along +y; keys on the negative axes
    # or in the third quadrant make both ReLUs zero: their scores are exactly 0 and tie.
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # [n=1, heads=2, d=2]
    keys = torch.tensor([[-1.0, -2.0], [-1.0, 0.0], [0.0, -3.0], [2.0, 0.0],
                         [-2.0, -1.0], [0.0, 1.0], [-5.0, -5.0], [-1.0, -1.0]])  # [C=8, d]
    weights = torch.tensor([[1.0, 0.5]])
    scores = _indexer_scores(q, keys, weights)  # [1, 8]
    zero = [c for c in range(8) if scores[0, c] == 0]
    assert zero == [0, 1, 2, 4, 6, 7] and scores[0, 3] > scores[0, 5] > 0  # the constructed ties hold
    visible = torch.ones(1, 8, dtype=torch.bool)
    # k = 4: the two positive entries, then the two lowest-index zeros
    assert _selected(topk_mask(scores, visible, 4)) == [[0, 1, 3, 5]]
    # k = 5, entries 0 and 2 not visible: the positives, then zeros 1, 4, 6 (never an invisible one)
    visible[0, [0, 2]] = False
    assert _selected(topk_mask(scores, visible, 5)) == [[1, 3, 4, 5, 6]]
    # a negative head weight: positive-ReLU entries score below 0, so the zeros are the best and tie
    neg = _indexer_scores(q, keys, torch.tensor([[-1.0, -0.5]]))
    assert _selected(topk_mask(neg, torch.ones(1, 8, dtype=torch.bool), 4)) == [[0, 1, 2, 4]]
    # all scores equal: the k lowest visible indices, per row
    flat = torch.zeros(3, 6)
    vis = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 1, 1], [1, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert _selected(topk_mask(flat, vis, 3)) == [[0, 1, 2], [1, 3, 4], [0, 5]]
    # -0.0 and +0.0 are one value (the indexer's sum of zero terms is +0.0 anyway): index order
    signed = torch.tensor([[-0.0, 0.0, -0.0, 0.0, 1.0]])
    assert _selected(topk_mask(signed, torch.ones(1, 5, dtype=torch.bool), 3)) == [[0, 1, 4]]


def test_selection_ignores_entries_the_query_cannot_see():
    """Causal: appending entries (invisible to the row, whatever their scores) changes nothing."""
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        n, c, k = 4, int(torch.randint(2, 40, (), generator=g)), int(torch.randint(1, 12, (), generator=g))
        scores = torch.randn(n, c, generator=g).relu() * (torch.rand(n, 1, generator=g) - 0.3)  # many exact 0s
        visible = torch.arange(c)[None] < torch.randint(1, c + 1, (n, 1), generator=g)
        base = topk_mask(scores, visible, k)
        extra = int(torch.randint(1, 30, (), generator=g))
        more = torch.cat([scores, torch.randn(n, extra, generator=g).abs() + 5], dim=1)  # better, but unseen
        grown = topk_mask(more, torch.cat([visible, torch.zeros(n, extra, dtype=torch.bool)], dim=1), k)
        assert torch.equal(grown[:, :c], base) and not grown[:, c:].any()


@contextlib.contextmanager
def _record_selections():
    """Record every (visible, selected) pair the model's indexer produces, and the boundary ties."""
    calls, ties = [], [0]
    original = deepseek_v4.topk_mask

    def spy(scores, visible, k):
        out = original(scores, visible, k)
        masked = scores.masked_fill(~visible, float("-inf"))
        if masked.shape[-1] > k:
            top = masked.topk(k + 1, dim=-1).values  # [n, k+1]
            ties[0] += int(((top[:, k - 1] == top[:, k]) & torch.isfinite(top[:, k])).sum())
        calls.append((visible.clone(), out.clone()))
        return out

    deepseek_v4.topk_mask = spy
    try:
        yield calls, ties
    finally:
        deepseek_v4.topk_mask = original


@pytest.fixture(scope="module")
def one_index_head(tmp_path_factory):
    config = {**get_preset("tiny").hf_config(), "index_n_heads": 1}
    path = make_checkpoint(tmp_path_factory.mktemp("tiny-1-index-head"), preset=config, seed=1)
    model, _ = load_checkpoint(path, dtype="float32")
    return model.eval(), path


def test_selection_is_invariant_to_chunking_where_ties_occur(one_index_head):
    """One indexer head: ties are common. Prefill in one chunk, in chunks of 5, and token by token pick
    the same entries for every query of every CSA layer (rows compared over the entries each can see)."""
    model, _ = one_index_head
    ids = torch.randint(2, model.config.vocab_size, (41,), generator=torch.Generator().manual_seed(3)).tolist()

    def run(chunk: int) -> tuple[list[list[list[int]]], int]:
        runner = ModelRunnerForTests(model, max_seqs=1, max_len=len(ids) + 1)
        rows: list[list[list[int]]] = [[], []]  # [CSA layer][query with >= 1 visible entry] -> selected entries
        ties = 0
        with torch.no_grad():
            for start in range(0, len(ids), chunk):
                with _record_selections() as (calls, t):
                    if start == 0:
                        runner.prefill(0, ids[:chunk])
                    else:
                        runner.run([(0, ids[start:start + chunk])])
                ties += t[0]
                # NOTE: both CSA layers share the rate, so a forward selects in both (in layer order) or in
                # neither (no compressed entry yet); a query that sees no entry selects none, in any chunking.
                assert len(calls) in (0, 2)
                for layer, (visible, sel) in enumerate(calls):
                    assert not (sel & ~visible).any()
                    rows[layer] += [sel[i].nonzero().flatten().tolist() for i in range(len(sel)) if visible[i].any()]
        return rows, ties

    whole, ties = run(len(ids))
    assert ties > 0, "the configuration should produce boundary ties"
    assert len(whole[0]) == len(whole[1]) == len(ids) - 3  # rate 4: position p sees (p + 1) // 4 entries
    for chunk in (5, 1):
        got, _ = run(chunk)
        for layer in range(2):
            for pos, (x, y) in enumerate(zip(whole[layer], got[layer]), start=3):
                assert x == y, f"chunk {chunk}, CSA layer {layer}, position {pos}: {x} vs {y}"
            assert len(got[layer]) == len(whole[layer])


class _TiesToLowerIndex(torch.Tensor):
    """Indexer scores whose `topk` breaks ties by the lower index: what CUDA's torch.topk does in the
    official reference (topk_mask's NOTE); transformers' CPU torch.topk breaks them by tensor shape."""

    def topk(self, k, dim=-1, largest=True, sorted=True):
        plain = self.as_subclass(torch.Tensor)
        idx = torch.sort(plain, dim=dim, descending=True, stable=True).indices.narrow(dim, 0, k)
        return torch.return_types.topk((plain.gather(dim, idx), idx))


def test_matches_transformers_given_the_same_tie_rule(one_index_head, monkeypatch):
    """Where ties occur, our token-by-token logits equal transformers' one forward over the whole sequence
    once its indexer breaks ties as the official reference does on CUDA: the tie rule is all that differs."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4

    forward = hf_v4.DeepseekV4IndexerScorer.forward
    monkeypatch.setattr(hf_v4.DeepseekV4IndexerScorer, "forward",
                        lambda self, *a, **kw: forward(self, *a, **kw).as_subclass(_TiesToLowerIndex))
    model, path = one_index_head
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(2, model.config.vocab_size, (48,), generator=torch.Generator().manual_seed(4)).tolist()
    runner = ModelRunnerForTests(model, max_seqs=1, max_len=len(ids) + 1)
    with torch.no_grad(), _record_selections() as (_, ties):
        ours = [runner.prefill(0, ids[:1])] + [runner.run([(0, [t])])[0] for t in ids[1:]]
        theirs = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)  # [L, vocab]
    assert ties[0] > 0, "the configuration should produce boundary ties"
    worst = (torch.log_softmax(torch.stack(ours).float(), -1) - theirs).abs().max().item()
    assert worst <= 2e-3, f"max |d logprob| {worst:.2e}"


@pytest.mark.gpu
def test_cuda_selects_what_the_cpu_selects():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        n, c = int(torch.randint(1, 9, (), generator=g)), int(torch.randint(2, 6000, (), generator=g))
        k = int(torch.randint(1, 600, (), generator=g))
        scores = torch.randn(n, c, generator=g).relu() * torch.sign(torch.randn(n, 1, generator=g))  # many +-0
        visible = torch.arange(c)[None] < torch.randint(1, c + 1, (n, 1), generator=g)
        assert torch.equal(topk_mask(scores, visible, k), topk_mask(scores.cuda(), visible.cuda(), k).cpu())
