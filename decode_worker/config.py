"""The decode instance's configuration (frozen, validated) and the CLI generated from it (`serving.config_cli`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from deepinfer.engine.engine import EngineConfig
from deepinfer.serving.worker_config import EngineWorkerConfig


class DecodeWorkerConfig(EngineWorkerConfig):
    """Everything a decode instance (rank 0 of its group) needs to start (the fields every LM stage shares:
    `serving.worker_config`)."""

    bounded_state: Literal["send", "replay"] | None = None
    """How a request's bounded state (sliding-window ring, compressor buffers) gets here: "send" =
    the prefill writes it into a reserved slot with the KV; "replay" = recomputed here by bounded
    replay of the prompt's tail; None = "send", or "replay" with speculative="mtp" (the replay also
    rebuilds the MTP drafter's window). With "dspark" the DSpark stages' window rings are part of the slot
    (`dspark_keys`), so "send" moves them too (the prefill runs `--speculative dspark` as well). Outputs are
    identical; BENCHMARKS.md compares the two."""
    embedding_rows: int = Field(8192, gt=0)
    """Rows of the buffer image embeddings are READ into during Reserve (models with a vision tower)."""
    kv_lease_s: float = Field(30.0, gt=0)
    """How long a reservation waits for its KV when Reserve leaves lease_ms at 0."""
    start_grace_s: float = Field(10.0, ge=0)
    """A reservation whose Start has not come this long after its lease ended is aborted."""
    max_rpc_threads: int = Field(256, gt=0)
    """gRPC handler threads (each Start stream holds one until its request finishes)."""

    speculative: Literal["mtp", "dspark"] | None = None
    """Speculative decoding (`engine.spec_decode`; lossless): None = off, "mtp" = DeepSeek-V4's MTP layer drafts
    `num_draft_tokens` per request per step (`--speculative mtp --num-draft-tokens 3`; needs `bounded_state`
    "replay", the default then), "dspark" = DeepSeek-V4.1's DSpark stages draft a block (`--speculative dspark`;
    its window rings come with the sent state, or are rebuilt by "replay"). Checked against the checkpoint."""
    speculative_tokens: int | None = Field(None, ge=0)
    """Alias of `speculative` + `num_draft_tokens` kept for existing YAML and scripts: K > 0 = "mtp" with K drafts,
    0 = off; refused when it disagrees with them. Once validated it mirrors them (0 when off)."""
    speculative_method: Literal["mtp", "dspark"] | None = None
    """Alias of `speculative` (the drafter `speculative_tokens` turns on); once validated it mirrors it."""
    verify_schedule: Literal["full", "confidence"] = "full"
    """Drafts verified per request: "full" all of them, "confidence" a prefix chosen over the batch from the
    drafts' confidences (`engine.spec_decode.verify_schedule`)."""
    verify_floor: int = Field(1, ge=0, le=1)
    """Drafts every request verifies at least under the "confidence" schedule: 1, or 0 (none when its drafts are
    unlikely to be accepted); 0 needs verify_schedule "confidence"."""
    verify_cost_table: str | None = None
    """Step-cost table (JSON, `benchmarks/speculative.py --profile-cost --json FILE`) of the "confidence" schedule,
    checked when the config is built (a host that validates it, e.g. `deepinfer up`'s, must read it too); None = the
    shipped CPU table on a CPU device, the linear stand-in elsewhere; "linear" = the linear stand-in."""

    kv_store: Literal["off", "embedded", "mooncake"] = "off"
    """Persistent compressed-KV store (`kvstore`) finished conversation turns are written to (requests reserved with
    `is_conversation`: their prompt's and answer's full blocks, so the next turn's prefill loads the whole
    conversation): off, embedded or mooncake. Give it the prefill stage's store (`deepinfer up` does)."""

    @model_validator(mode="before")
    @classmethod
    def _speculative_aliases(cls, data):
        from deepinfer.engine.spec_decode.config import resolve_speculative_fields

        return resolve_speculative_fields(data, keep_aliases=True)  # raises when the two spellings disagree

    def _check_stage(self) -> None:
        """The verify floor, the cost table and the MTP drafter's replay (run before the checkpoint is read)."""
        from deepinfer.engine.spec_decode.config import check_verify_floor

        check_verify_floor(self.verify_floor, self.verify_schedule)
        self._check_cost_table()
        self._check_speculation_replays()

    def _check_cost_table(self) -> None:
        # NOTE: the engine loads the table only after the weights; a bad path or file fails here, before anything loads
        if self.verify_cost_table is None:
            return
        if self.speculative is None or self.verify_schedule != "confidence":
            raise ValueError("verify_cost_table prices the 'confidence' verify schedule of speculative decoding: set "
                             "speculative ('mtp', or 'dspark' for V4.1) and verify_schedule='confidence' (--speculative "
                             "mtp --verify-schedule confidence) or leave it unset")
        from deepinfer.engine.spec_decode.step_cost import load_cost_table

        load_cost_table(self.verify_cost_table, self.device)  # ValueError naming the file and how to write one

    def _check_speculation_replays(self) -> None:
        # NOTE: the MTP drafter's window (its keys at the prompt's last positions) is rebuilt by the same
        # bounded replay that rebuilds the target's state; a sent state would leave it empty
        # (`engine.spec_decode`'s docstring, "Disaggregated decode"). DSpark's rings are slot state: they are sent.
        if self.speculative == "mtp" and self.bounded_state == "send":
            raise ValueError("speculative='mtp' on a decode instance rebuilds the MTP drafter's window by bounded "
                             "replay: set bounded_state='replay' (--bounded-state replay) or leave it unset")

    @property
    def is_state_sent(self) -> bool:
        """The prefill writes the bounded state with the KV (`bounded_state`, resolved: see its docstring)."""
        return self.bounded_state == "send" or (self.bounded_state is None and self.speculative != "mtp")

    def engine_config(self) -> EngineConfig:
        """The engine part of this config."""
        return super().engine_config(verify_schedule=self.verify_schedule, verify_floor=self.verify_floor,
                                     verify_cost_table=self.verify_cost_table)
