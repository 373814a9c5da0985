"""A minimal driver of the model over a cache, for tests and benchmarks (no scheduler).

Each sequence gets its own slot and a contiguous run of blocks; `run` takes a list of
`(seq_index, new_token_ids)` and executes them as one flat batch (`ScratchModelRunner`), and
`greedy` continues a prompt.
"""

from __future__ import annotations

from deepinfer.engine.model_runner import ScratchModelRunner


class ModelRunnerForTests(ScratchModelRunner):
    """Drives `DeepseekV4ForCausalLM` for up to `max_seqs` sequences of up to `max_len` tokens."""

    def greedy(self, seq: int, prompt: list[int], num_tokens: int) -> list[int]:
        """Greedy continuation of `prompt` for `num_tokens` tokens."""
        logits = self.prefill(seq, prompt)
        out = []
        for _ in range(num_tokens):
            t = int(logits.argmax())
            out.append(t)
            logits = self.run([(seq, [t])])[0]
        return out
