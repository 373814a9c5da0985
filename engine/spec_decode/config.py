"""Speculative decoding's configuration names: the canonical fields, their older aliases, and the checks.

Canonical (`EngineConfig`, `LLM(...)`, `DecodeWorkerConfig`, the cluster YAML's decode worker settings):

* `speculative`: None (off), "mtp" (the checkpoint's MTP layer drafts, chained: DeepSeek-V4) or "dspark"
  (DeepSeek-V4.1's DSpark stages draft a block: `dspark_drafter`);
* `num_draft_tokens`: drafts proposed per request per step (default `DEFAULT_NUM_DRAFT_TOKENS`);
* `verify_floor`: drafts every request verifies at least under the "confidence" schedule, 1 or 0.

Aliases, kept because existing cluster YAML files, scripts and other modules' tests spell them:
`speculative_tokens=K` (K > 0 means `speculative="mtp", num_draft_tokens=K`; 0 means off) and
`speculative_method` (the drafter used when `speculative_tokens` turns speculation on). Both spellings
may be given only when they agree; disagreeing values are refused with a message naming both.

NOTE: "not given" is None for every name, because the worker CLI (`serving.config_cli`) passes every
field, its default included: a default of 3 for `num_draft_tokens` there would disagree with any
`--speculative-tokens K`. The configs therefore declare None and this module resolves it.
"""

from __future__ import annotations

from typing import Any

SPECULATIVE_METHODS = ("mtp", "dspark")
"""Drafters `speculative` may name: the MTP layer (DeepSeek-V4) or the DSpark stages (DeepSeek-V4.1)."""
DEFAULT_NUM_DRAFT_TOKENS = 3
"""Drafts per request per step when `num_draft_tokens` is not given (one MTP layer, chained)."""
VERIFY_FLOORS = (0, 1)
"""`verify_floor` values: every request verifies at least one draft, or may verify none when unlikely to pay."""


def _as_count(name: str, value: Any) -> int:
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def resolve_speculative_fields(data: Any, *, keep_aliases: bool = False, fill_default: bool = True) -> Any:
    """A config's raw input (a dict of field values) with the aliases turned into the canonical fields.

    Returns a new dict; anything else (a model instance) unchanged. Raises ValueError when the two
    spellings disagree. `keep_aliases`: also write `speculative_tokens` / `speculative_method` back as
    mirrors of the resolved setting (a config whose CLI flags are generated from its fields keeps them as
    fields, so they must stay consistent when the config is dumped and loaded again). `fill_default=False`:
    leave `num_draft_tokens` out when nothing gives it (to overlay one partial setting on another).
    """
    if not isinstance(data, dict):
        return data
    data = dict(data)
    tokens = data.pop("speculative_tokens", None)
    method = data.pop("speculative_method", None)
    spec = data.get("speculative")
    k = data.get("num_draft_tokens")
    if method is not None and method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_method={method!r} is not a drafter; known: {', '.join(SPECULATIVE_METHODS)}")
    if method is not None and spec is not None and spec != method:
        raise ValueError(f"speculative={spec!r} and its alias speculative_method={method!r} disagree; give "
                         "speculative alone (canonical)")
    if tokens is not None:
        tokens = _as_count("speculative_tokens", tokens)
        if tokens == 0 and spec is not None:
            raise ValueError(f"speculative={spec!r} turns speculative decoding on but its alias speculative_tokens=0 "
                             "turns it off; give speculative and num_draft_tokens alone (canonical)")
        if tokens and k is not None and k != tokens:
            raise ValueError(f"num_draft_tokens={k} and its alias speculative_tokens={tokens} disagree; give "
                             "num_draft_tokens alone (canonical)")
        data["speculative"] = (spec if spec is not None else (method or SPECULATIVE_METHODS[0])) if tokens else None
        if tokens:
            data["num_draft_tokens"] = tokens
    if data.get("num_draft_tokens") is None:
        if fill_default or keep_aliases:
            data["num_draft_tokens"] = DEFAULT_NUM_DRAFT_TOKENS
        else:
            data.pop("num_draft_tokens", None)
    if keep_aliases:
        on = data.get("speculative") is not None
        data["speculative_tokens"] = data["num_draft_tokens"] if on else 0
        data["speculative_method"] = data.get("speculative")
    return data


def check_verify_floor(verify_floor: int, verify_schedule: str) -> None:
    """`verify_floor` 0 only means something to the "confidence" schedule ("full" verifies every draft)."""
    if verify_floor not in VERIFY_FLOORS:
        raise ValueError(f"verify_floor must be 0 or 1 (drafts every request verifies at least), got {verify_floor}")
    if verify_floor == 0 and verify_schedule != "confidence":
        raise ValueError("verify_floor=0 lets the 'confidence' verify schedule verify no draft of a request; with "
                         f"verify_schedule={verify_schedule!r} every draft is verified: set "
                         "verify_schedule='confidence' or leave verify_floor at 1")


def check_drafter_for_model(speculative: str | None, model_config) -> None:
    """Refuse a drafter the checkpoint does not have: "dspark" needs DeepSeek-V4.1 (a `V41Config`, its DSpark
    stages), "mtp" DeepSeek-V4 (its MTP layer). The engine calls it at start, before anything loads; the worker
    configs call it when they are built (`serving.model_checks`), so a bad pairing fails before a process starts."""
    is_v41 = hasattr(model_config, "kv_source_layer_ids")
    if speculative == "dspark" and not is_v41:
        raise ValueError("speculative='dspark': DSpark stages are DeepSeek-V4.1's; this DeepSeek-V4 checkpoint "
                         "drafts with its MTP layer: set speculative='mtp' (or None)")
    if speculative == "mtp" and is_v41:
        raise ValueError("speculative='mtp': DeepSeek-V4.1 has no MTP layer; its drafter is its DSpark stages: "
                         "set speculative='dspark' (or None)")
