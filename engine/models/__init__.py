"""Model families by `model_type` (config.json). A new family arrives by registering here."""

from __future__ import annotations


def model_class(model_type: str):
    """The nn.Module class implementing `model_type`; the error lists what is supported.

    NOTE: "deepseek_v41" is DeepSeek-V4.1's own model (`engine.models.deepseek_v41`, built from a
    `V41Config`): its text backbone, full-sequence (`forward_full`) and as the paged engine's step over
    `engine.cache.v41.V41KVCache`; `engine.loader.load_checkpoint` builds it for a V4.1 checkpoint.
    """
    if model_type == "deepseek_v4":
        from deepinfer.engine.models.deepseek_v4 import DeepseekV4ForCausalLM

        return DeepseekV4ForCausalLM
    if model_type == "deepseek_v41":
        from deepinfer.engine.models.deepseek_v41 import DeepseekV41ForCausalLM

        return DeepseekV41ForCausalLM
    raise ValueError(f"model_type {model_type!r} is not supported; supported: ['deepseek_v4', 'deepseek_v41']")
