"""Model families by `model_type` (config.json). A new family arrives by registering here."""

from __future__ import annotations


def model_class(model_type: str):
    """The nn.Module class implementing `model_type`; the error lists what is supported."""
    if model_type in ("deepseek_v4", "deepseek_v41"):
        from deepinfer.engine.models.deepseek_v4 import DeepseekV4ForCausalLM

        return DeepseekV4ForCausalLM
    raise ValueError(f"model_type {model_type!r} is not supported; supported: ['deepseek_v4', 'deepseek_v41']")
