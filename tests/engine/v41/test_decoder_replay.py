"""Decoder-side bounded replay in V4.1's paged prefill (`DeepseekV41ForCausalLM.decoder_replay`, the engine's
`v41_decoder_replay`): the layers after the last KV source compute a request's tokens from `prompt - window` on only.

Against `forward_full(bounded_replay=True)` (the prompt's last position) and `forward_full(replay_from=P - W)` (the
decode tokens that follow: the tail starts at the prompt's, not at each prefix's): chunked prefill with chunks
before, across and inside the tail, mixed with decode rows; a prefix hit with state replay; `LLM.generate` greedy
tokens with the switch on, and the switch off. Tiny random model (window 4, last KV source 5 of 8), float32, CPU.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from deepinfer.engine.cache.layout import exact_replay_tokens
from deepinfer.engine.cache.v41 import V41KVCache
from deepinfer.engine.config import V41Config
from deepinfer.engine.forward_batch import ForwardBatch, SeqChunk
from deepinfer.engine.models.deepseek_v41 import engram_token_map_for, load_published
from deepinfer.engine.testing.make_checkpoint import make_checkpoint, random_v41_model
from tests.engine.v41.configs import tiny_config

BLOCK, W = 4, 4


@pytest.fixture(scope="module")
def model():
    m = random_v41_model(V41Config.from_hf_dict(tiny_config()), seed=11).eval()
    m.decoder_replay = True
    return m


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Driver:
    """The paged step over a private `V41KVCache`, each sequence with its prompt length (`num_prompt_tokens`)."""

    def __init__(self, model, prompt_lens: list[int], max_len: int = 64) -> None:
        per = -(-max_len // BLOCK)
        n = len(prompt_lens)
        self.model, self.prompt_lens = model, prompt_lens
        self.cache = V41KVCache(model.config, per * n, BLOCK, n)
        self.tables = [list(range(i * per, (i + 1) * per)) for i in range(n)]
        self.lens, self.state_start, self.frozen = [0] * n, [0] * n, [0] * n

    def step(self, work: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """One step over `(seq, new ids)`; the last new token's logits of each."""
        seqs = [SeqChunk(i, self.tables[i], self.lens[i], len(ids), self.state_start[i], self.frozen[i],
                         self.prompt_lens[i]) for i, ids in work]
        batch = ForwardBatch.build([ids for _, ids in work], seqs, logits="last")
        batch.attn_metadata = self.model.build_attention_metadata(batch, self.cache)
        logits = self.model.step(batch, self.cache)
        for i, ids in work:
            self.lens[i] += len(ids)
        return list(logits)


@contextlib.contextmanager
def _rows_seen(model):
    """Rows entering the last layer's attention, per forward (hooked while the block runs)."""
    seen: list[int] = []
    handle = model.layers[-1].attn_norm.register_forward_hook(lambda m, a, out: seen.append(out.shape[0]))
    try:
        yield seen
    finally:
        handle.remove()


def test_paged_prefill_and_decode_match_forward_full_bounded(model):
    """Prompts of 3, 11 and 19 tokens (tail starts 0, 7, 15) in chunks before the tail (layers 6, 7 not run), across
    it (cut; one of them leaves a single tail token, a decode row of the tail's step), inside it, mixed with decode
    rows; then 5 greedy decode steps. The last prompt position equals `forward_full(bounded_replay=True)`, every
    decode token `forward_full(replay_from=P - W)`."""
    prompts = [_ids(3, 1), _ids(11, 2), _ids(19, 3)]
    d = Driver(model, [len(p) for p in prompts])
    plan = [[(1, prompts[1][:5]), (2, prompts[2][:9])],  # both wholly before their tails: layers 6, 7 see 0 rows
            [(0, prompts[0]), (1, prompts[1][5:]), (2, prompts[2][9:16])],  # whole / cut at 7 / one tail token
            [(2, prompts[2][16:])]]
    last = {}
    with _rows_seen(model) as seen:
        for work in plan:
            for (i, _), lg in zip(work, d.step(work)):
                last[i] = lg
    assert seen == [3 + 4 + 1, 3]  # the first step stopped after layer 5
    seqs = [list(p) for p in prompts]
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ref = model.forward_full(torch.tensor(p), bounded_replay=True)[-1]
            torch.testing.assert_close(last[i], ref, rtol=1e-4, atol=1e-4)
        for _ in range(5):
            toks = [int(last[i].argmax()) for i in range(3)]
            for i in range(3):
                seqs[i].append(toks[i])
            for i, lg in enumerate(d.step([(i, [toks[i]]) for i in range(3)])):
                last[i] = lg
                ref = model.forward_full(torch.tensor(seqs[i]), replay_from=max(0, len(prompts[i]) - W))[-1]
                torch.testing.assert_close(lg, ref, rtol=1e-4, atol=1e-4)


def test_prefix_hit_replay_with_decoder_replay(model):
    """A prefix hit (44 shared tokens, state replayed from position 14) of a 53-token prompt: layers 6, 7 compute
    only positions 49.. (tail) and the last logits equal `forward_full(bounded_replay=True)`'s."""
    a = _ids(50, 7)
    b = a[:44] + _ids(9, 8)
    d = Driver(model, [len(a), len(b)])
    d.step([(0, a)])
    hit = 44
    d.tables[1][: hit // BLOCK] = d.tables[0][: hit // BLOCK]
    start = hit - exact_replay_tokens(model.config)
    d.lens[1] = d.state_start[1] = start
    d.frozen[1] = hit
    with _rows_seen(model) as seen:
        (lg,) = d.step([(1, b[start:])])
    assert seen == [W]
    with torch.no_grad():
        torch.testing.assert_close(lg, model.forward_full(torch.tensor(b), bounded_replay=True)[-1], rtol=1e-4,
                                   atol=1e-4)


def test_off_and_unknown_prompt_compute_every_row(model):
    """With the switch off, or without a prompt length (side passes), every layer sees every row."""
    ids = _ids(12, 4)
    for replay, plen in ((False, 12), (True, None)):
        model.decoder_replay = replay
        try:
            d = Driver(model, [plen])
            with _rows_seen(model) as seen:
                (lg,) = d.step([(0, ids)])
        finally:
            model.decoder_replay = True
        assert seen == [12]
        with torch.no_grad():
            torch.testing.assert_close(lg, model.forward_full(torch.tensor(ids))[-1], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("v41replay") / "ck", format="published-v41", seed=5)


def test_llm_generate_with_decoder_replay(ckpt):
    """`LLM.generate` (on by default; chunked prefill of 16 tokens, a preemption-free batch of 4): each greedy token
    is the argmax of `forward_full(prefix, replay_from=P - W)`; the engine switch reaches the model. Off: the full
    computation (tests/engine/v41/test_paged.py)."""
    from deepinfer import LLM, SamplingParams

    ref = load_published(ckpt)
    ref.set_engram_token_map(engram_token_map_for(ckpt, ref.config))
    llm = LLM(str(ckpt), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, block_size=BLOCK)
    assert llm.engine.model.decoder_replay
    prompts = [_ids(n, 20 + n) for n in (2, 7, 23, 41)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            seq, tail = list(p), max(0, len(p) - W)
            for t in o.outputs[0].token_ids:
                assert t == int(ref.forward_full(torch.tensor(seq), replay_from=tail)[-1].argmax())
                seq.append(t)
    llm = LLM(str(ckpt), max_model_len=64, max_num_seqs=2, block_size=BLOCK, v41_decoder_replay=False)
    assert not llm.engine.model.decoder_replay
    llm.shutdown()


def test_worker_flag_reaches_the_engine_config():
    """`--no-v41-decoder-replay` on a prefill or decode worker (generated from its config) turns it off."""
    from deepinfer.decode_worker.config import DecodeWorkerConfig
    from deepinfer.prefill_worker.config import PrefillWorkerConfig
    from deepinfer.serving.config_cli import make_parser

    for cls in (PrefillWorkerConfig, DecodeWorkerConfig):
        assert cls().engine_config().v41_decoder_replay
        args = make_parser(cls, "w", "").parse_args(["--no-v41-decoder-replay"])
        assert args.v41_decoder_replay is False
        assert not cls(v41_decoder_replay=False).engine_config().v41_decoder_replay
