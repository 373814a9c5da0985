"""V4.1 configs for the tests: the published Flash config.json (its values, docs/V4_1.md §1) and a tiny
random-model config that has every layer kind: window-only layers, ratio-2 and ratio-1 KV sources, a
consumer of each, an index source without index keys, the candidate source and a candidate user, two
Engram layers with tiny tables."""

from __future__ import annotations

import copy


def flash_config() -> dict:
    """DeepSeek-V4.1-Flash's config.json as published (top level + text_config + vision_config)."""
    text = {
        "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120, "moe_intermediate_size": 2304,
        "num_hidden_layers": 40, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_lora_rank": 1024, "o_groups": 8, "hidden_act": "silu",
        "swiglu_limit": 10.0, "rms_norm_eps": 1e-20, "attention_bias": False, "attention_dropout": 0.0,
        "initializer_range": 0.02, "use_cache": True, "tie_word_embeddings": False,
        "max_position_embeddings": 1048576, "rope_theta": 10000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
        "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "sliding_window": 128,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0], "compress_rope_theta": 160000,
        "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_source_layer_id": 20,
        "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-06, "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
        "engram_max_ngram_size": 4, "engram_vocab_size": 16000000, "engram_n_heads": 8, "engram_head_dim": 256,
        "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": 3,
        "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39],
        "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
    }
    return {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "image_token_id": 129264,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                                "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
        "text_config": text,
        "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 32, "hidden_size": 1024},
    }


def tiny_config(**text_overrides) -> dict:
    """A tiny V4.1 (8 layers) in the published layout, text-only and unquantized.

    Layers: 0, 1 window only; 2 ratio-2 KV source (+ index source); 3 reuses 2; 4 ratio-2 index source
    without index keys; 5 ratio-1 KV source and candidate source; 6 reuses 5; 7 index source using 5's
    candidates. Engram at 1 and 4 (primes from 13: 13+17+19+23 = 72 rows, 29+31+37+41 = 138 rows).
    """
    text = {
        "vocab_size": 64, "hidden_size": 32, "moe_intermediate_size": 16, "num_hidden_layers": 8,
        "num_attention_heads": 4, "head_dim": 16, "qk_rope_head_dim": 8, "q_lora_rank": 16, "o_lora_rank": 8,
        "o_groups": 2, "swiglu_limit": 10.0, "rms_norm_eps": 1e-20, "max_position_embeddings": 4096,
        "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 16},
        "n_routed_experts": 4, "num_experts_per_tok": 2, "scoring_func": "sqrtsoftplus", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "sliding_window": 4,
        "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1], "kv_source_layer_ids": [2, 5],
        "index_source_layer_ids": [2, 4, 5, 7], "index_n_heads": 2, "index_head_dim": 16, "index_topk": 3,
        "candidate_source_layer_id": 5, "candidate_topk_blocks": 2, "candidate_block_size": 2,
        "hc_mult": 2, "hc_sinkhorn_iters": 5, "hc_eps": 1e-6,
        "engram_layer_ids": [1, 4], "engram_num_embeddings": [72, 138], "engram_max_ngram_size": 3,
        "engram_vocab_size": 13, "engram_n_heads": 2, "engram_head_dim": 8, "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 20, "num_nextn_predict_layers": 0,
    }
    text.update(text_overrides)
    return {"model_type": "deepseek_v41", "bos_token_id": 0, "eos_token_id": 1, "text_config": copy.deepcopy(text)}
