"""Structured outputs: constrained decoding with xgrammar.

Contract (who calls what, when):

- `GrammarCompiler(tokenizer, vocab_size, eos_token_ids)` is built once per engine. It turns the
  tokenizer into xgrammar's `TokenizerInfo` on first use (so engines that never see a constraint
  pay nothing), and `compile(StructuredOutputParams)` compiles a constraint against it. Compiled
  grammars are cached by constraint (an LRU of `max_cached` entries on top of xgrammar's own cache),
  so a schema sent again costs a dict lookup. A constraint that does not compile raises
  `InvalidRequestError(field="structured_output")` before the request costs compute.
- `GrammarState` is one sequence's matcher. The engine creates it when the request is added, and,
  once per step that samples the sequence, first `advance_to(output_token_ids)` (idempotent: it
  feeds only the tokens the matcher has not seen, so a token sampled elsewhere, e.g. the prefill
  instance's first token, is replayed the same way) and then `fill_bitmask(bitmask, row)`. The
  sampler sets the logits of every token the bitmask excludes to -inf after penalties and bias
  (`Sampler.process_logits`). `is_terminated` turns True once the constraint is complete and EOS
  was accepted: the engine then ends the request.

NOTE: special tokens of the tokenizer (added tokens marked special, EOS aside) are never allowed
inside a constraint: they would not appear in the detokenized text, so the text would not match
what the matcher accepted. Non-special added tokens (`</think>`, `｜DSML｜`, ...) count as the
text they spell. The bitmask is as wide as the model's `vocab_size`: model ids the tokenizer has no
token for (a padded vocabulary) are never allowed, tokenizer tokens past it (a smaller one) never
exist.

With `reasoning_end`, the constraint is wrapped in an xgrammar structural tag: free text that may
not contain `reasoning_end`, then `reasoning_end`, then the constraint.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from deepinfer.engine.errors import InvalidRequestError
from deepinfer.engine.sampling.params import StructuredOutputParams

if TYPE_CHECKING:
    import xgrammar
    from tokenizers import Tokenizer

MAX_WHITESPACE = 16
"""Most whitespace characters a JSON constraint allows between two elements. Bounded so a weak or
degenerate model cannot loop on whitespace forever; generous enough for indented output."""


def _xgrammar():
    """The xgrammar module (imported on first use: engines without constraints never load it)."""
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - xgrammar is a dependency
        raise InvalidRequestError(
            "structured_output needs the xgrammar package on the serving instance (`pip install xgrammar`)",
            field="structured_output",
        ) from e
    return xgrammar


class GrammarCompiler:
    """Compiles `StructuredOutputParams` against one model's tokenizer, with a cache (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int], *,
                 max_cached: int = 256, max_threads: int = 2) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        """Width of the token bitmask: the model's vocabulary (logits columns)."""
        self.eos_token_ids = list(eos_token_ids)
        self._max_cached = max_cached
        self._max_threads = max_threads
        self._compiler = None
        self._cache: OrderedDict[StructuredOutputParams, object] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0
        """Constraints compiled so far (cache misses)."""

    def _get_compiler(self):
        if self._compiler is None:
            xgr = _xgrammar()
            vocab = self._tokenizer.get_vocab(with_added_tokens=True)
            encoded = [""] * self.vocab_size
            for token, token_id in vocab.items():
                if token_id < self.vocab_size:
                    encoded[token_id] = token
            eos = set(self.eos_token_ids)
            for token_id, added in self._tokenizer.get_added_tokens_decoder().items():
                if added.special and token_id < self.vocab_size and token_id not in eos:
                    encoded[token_id] = ""  # xgrammar treats empty tokens as special: never allowed
            info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=self.vocab_size,
                                     stop_token_ids=self.eos_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads)
        return self._compiler

    def compile(self, params: StructuredOutputParams):
        """The compiled grammar of `params` (cached); raises `InvalidRequestError` if it does not compile."""
        with self._lock:
            compiled = self._cache.get(params)
            if compiled is not None:
                self._cache.move_to_end(params)
                return compiled
            try:
                compiled = self._compile(params)
            except InvalidRequestError:
                raise
            except Exception as e:  # xgrammar raises RuntimeError / ValueError subclasses on bad input
                raise InvalidRequestError(
                    f"structured_output {params.kind} does not compile: {_clean_error(e)}", field="structured_output"
                ) from None
            self.num_compiled += 1
            self._cache[params] = compiled
            if len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, params: StructuredOutputParams):
        xgr = _xgrammar()
        compiler = self._get_compiler()
        if params.reasoning_end is not None:
            return compiler.compile_structural_tag(_with_reasoning(params))
        kind = params.kind
        if kind in ("json_schema", "any_json"):
            schema = params.json_schema if kind == "json_schema" else "{}"
            if params.disable_any_whitespace:
                return compiler.compile_json_schema(schema, any_whitespace=False)
            return compiler.compile_json_schema(schema, max_whitespace_cnt=MAX_WHITESPACE)
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "grammar":
            return compiler.compile_grammar(xgr.Grammar.from_ebnf(params.grammar))
        return compiler.compile_structural_tag(_structural_tag(params.structural_tag))

    def new_state(self, params: StructuredOutputParams) -> GrammarState:
        """A fresh matcher for one sequence under `params` (compiles on a cache miss)."""
        return GrammarState(self.compile(params), self.vocab_size)


def _clean_error(e: Exception) -> str:
    """xgrammar's message without its native log prefix (`[HH:MM:SS] /path/file.cc:LINE: `), at most 500 chars."""
    return re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", str(e).strip())[:500]


def _structural_tag(text: str) -> xgrammar.StructuralTag:
    xgr = _xgrammar()
    try:
        return xgr.StructuralTag.model_validate_json(text)
    except ValueError as e:
        raise InvalidRequestError(f"structured_output.structural_tag is not a valid xgrammar structural tag: "
                                  f"{str(e)[:500]}", field="structured_output") from None


def _with_reasoning(params: StructuredOutputParams) -> xgrammar.StructuralTag:
    """Free text up to `reasoning_end`, then the constraint, as one structural tag."""
    from xgrammar import structural_tag as st

    kind = params.kind
    if kind in ("json_schema", "any_json"):
        schema = json.loads(params.json_schema) if kind == "json_schema" else True
        whitespace = 0 if params.disable_any_whitespace else MAX_WHITESPACE
        inner = st.JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=whitespace)
    elif kind == "regex":
        inner = st.RegexFormat(pattern=params.regex)
    elif kind == "grammar":
        inner = st.GrammarFormat(grammar=params.grammar)
    else:
        inner = _structural_tag(params.structural_tag).format
    reasoning = st.TagFormat(begin="", content=st.AnyTextFormat(excludes=[params.reasoning_end]),
                             end=params.reasoning_end)
    return st.StructuralTag(format=st.SequenceFormat(elements=[reasoning, inner]))


class GrammarState:
    """One sequence's xgrammar matcher: which tokens may come next, advanced by the accepted tokens."""

    def __init__(self, compiled, vocab_size: int) -> None:
        xgr = _xgrammar()
        self._matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.num_accepted_tokens = 0
        """Output tokens the matcher has accepted."""
        self.rejected_token_id: int | None = None
        """Set when an output token violated the constraint (e.g. one sampled elsewhere without it)."""

    @property
    def is_terminated(self) -> bool:
        """True once the constraint is complete and its stop token (EOS) was accepted."""
        return self._matcher.is_terminated()

    @property
    def is_completed(self) -> bool:
        """True when the output so far already satisfies the constraint (only EOS, or more text, may follow)."""
        return self._matcher.is_completed()

    def advance_to(self, output_token_ids: Sequence[int]) -> bool:
        """Feed the tokens of `output_token_ids` the matcher has not seen yet; False if one is rejected.

        After a rejection (or termination) further calls change nothing.
        """
        while self.num_accepted_tokens < len(output_token_ids):
            if self.rejected_token_id is not None or self._matcher.is_terminated():
                return self.rejected_token_id is None
            token_id = int(output_token_ids[self.num_accepted_tokens])
            if not self._matcher.accept_token(token_id):
                self.rejected_token_id = token_id
                return False
            self.num_accepted_tokens += 1
        return self.rejected_token_id is None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of `bitmask` `[num_rows, ceil(vocab / 32)]` int32."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def count_acceptable(self, token_ids: Sequence[int]) -> tuple[int, bool]:
        """How many of `token_ids`, fed after the tokens accepted so far, the constraint takes, and whether the
        last of those terminates it: up to the first one it rejects, or through the one that terminates it
        (nothing may follow). Tentative: the matcher is rolled back to where it was.

        Speculative decoding trims a constrained request's drafts with it (a draft the constraint rejects
        could never be accepted) and cuts a verified block after the token that completes the constraint.
        """
        if self.rejected_token_id is not None or self._matcher.is_terminated():
            return 0, self._matcher.is_terminated()
        n = 0
        try:
            for token_id in token_ids:
                if not self._matcher.accept_token(int(token_id)):
                    break
                n += 1
                if self._matcher.is_terminated():
                    return n, True
            return n, False
        finally:
            if n:
                self._matcher.rollback(n)

    def fill_verify_bitmask(self, bitmask: torch.Tensor, first_row: int, draft_token_ids: Sequence[int]) -> list[int]:
        """Speculative decoding: the masks of a request's verify rows; returns the rows it constrained.

        Row `first_row + j` gets the tokens allowed after the accepted outputs followed by drafts
        `d_1 .. d_j`, which are accepted tentatively and rolled back afterwards: the matcher only ever
        advances over accepted tokens (`advance_to`, after acceptance). Rows past a draft the constraint
        rejects, or past the one that terminates it, stay unconstrained: the row before is masked, so its
        token differs from that draft (or ends the request) and acceptance never keeps them.
        """
        if self.rejected_token_id is not None or self._matcher.is_terminated():
            return []
        self.fill_bitmask(bitmask, first_row)
        rows, n = [first_row], 0
        try:
            for j, token_id in enumerate(draft_token_ids, start=1):
                if not self._matcher.accept_token(int(token_id)):
                    break
                n += 1
                if self._matcher.is_terminated():
                    break
                self.fill_bitmask(bitmask, first_row + j)
                rows.append(first_row + j)
        finally:
            if n:
                self._matcher.rollback(n)
        return rows


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed token bitmask `[num_rows, ceil(vocab_size / 32)]` int32 (rows without a constraint stay so)."""
    return _xgrammar().allocate_token_bitmask(num_rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, row_ids: list[int] | None = None) -> None:
    """Set `logits` `[num_rows, vocab]` to -inf in place wherever `bitmask` (same rows) excludes the token.

    `row_ids` limits the work to those rows (the constrained ones; about 0.7 ms per row of a 129k
    vocabulary on one CPU core); None applies every row.
    """
    _xgrammar().apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=logits.shape[-1],
                                            indices=row_ids)
