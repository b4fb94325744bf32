"""Embedded named configs (Hugging Face config.json contents) for `bb.models.build(name)`."""

_QWEN3 = {"model_type": "qwen3", "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False,
          "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "vocab_size": 151936,
          "max_position_embeddings": 40960, "head_dim": 128, "dtype": "bfloat16"}

_DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_act": "silu", "rms_norm_eps": 1e-6, "vocab_size": 129280,
                "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
                "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
                "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
                "first_k_dense_replace": 3, "num_nextn_predict_layers": 1, "rope_interleave": True,
                "attention_bias": False, "tie_word_embeddings": False, "max_position_embeddings": 163840,
                "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                    "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                                    "mscale": 1.0, "mscale_all_dim": 1.0},
                "dtype": "bfloat16"}

# Qwen3.5 text model (transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig fields).
_QWEN3_5 = {"model_type": "qwen3_5_text", "hidden_act": "silu", "rms_norm_eps": 1e-6, "attention_bias": False,
            "vocab_size": 248320, "head_dim": 256, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "full_attention_interval": 4, "max_position_embeddings": 262144, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
            "mtp_num_hidden_layers": 1, "dtype": "bfloat16"}
_QWEN3_5_TINY = {**_QWEN3_5, "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 160,
                 "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                 "linear_key_head_dim": 8, "linear_value_head_dim": 12, "linear_num_key_heads": 2,
                 "linear_num_value_heads": 4, "max_position_embeddings": 4096, "dtype": "float32",
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}
_QWEN3_5_MOE_TINY = {**_QWEN3_5_TINY, "model_type": "qwen3_5_moe_text", "moe_intermediate_size": 32,
                     "shared_expert_intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2,
                     "router_aux_loss_coef": 0.001}
_QWEN3_5_MOE_TINY.pop("intermediate_size")

NAMED = {
    # Runs on a CPU in seconds: the default of the pairing demo and of the tests.
    "qwen3-tiny": {**_QWEN3, "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 160,
                   "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                   "tie_word_embeddings": False, "dtype": "float32", "max_position_embeddings": 4096},
    "qwen3-0.6b": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-1.7b": {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-4b": {**_QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True},
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False},
    # Qwen3-MoE (model_type qwen3_moe): softmax top-k routing, no shared expert.
    "qwen3-moe-tiny": {**_QWEN3, "model_type": "qwen3_moe", "vocab_size": 1024, "hidden_size": 64,
                       "intermediate_size": 160, "moe_intermediate_size": 32, "num_experts": 8,
                       "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
                       "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                       "tie_word_embeddings": False, "dtype": "float32", "max_position_embeddings": 4096},
    "qwen3-30b-a3b": {**_QWEN3, "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                      "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                      "router_aux_loss_coef": 0.001, "num_hidden_layers": 48, "num_attention_heads": 32,
                      "num_key_value_heads": 4, "tie_word_embeddings": False},
    "qwen3-235b-a22b": {**_QWEN3, "model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288,
                        "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8,
                        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                        "router_aux_loss_coef": 0.001, "num_hidden_layers": 94, "num_attention_heads": 64,
                        "num_key_value_heads": 4, "tie_word_embeddings": False},
    # DeepSeek-V3 (model_type deepseek_v3): MLA, dense-then-MoE, auxiliary-loss-free routing, MTP.
    "deepseek-v3-tiny": {**_DEEPSEEK_V3, "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 160,
                         "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
                         "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                         "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "n_shared_experts": 1,
                         "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 1,
                         "max_position_embeddings": 4096, "dtype": "float32",
                         "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}},
    "deepseek-v3": _DEEPSEEK_V3,
    # Qwen3.5 (model_type qwen3_5_text / qwen3_5_moe_text): 3 gated-DeltaNet layers per gated-attention
    # layer, partial RoPE, MTP head; the "-hub-" names hold the same text model the way hub configs
    # do (model_type qwen3_5 / qwen3_5_moe, the text model under text_config).
    "qwen3.5-tiny": _QWEN3_5_TINY,
    "qwen3.5-moe-tiny": _QWEN3_5_MOE_TINY,
    "qwen3.5-hub-tiny": {"model_type": "qwen3_5", "tie_word_embeddings": False, "vocab_size": 1024,
                         "text_config": {**_QWEN3_5_TINY, "model_type": "qwen3_5_text"}},
    "qwen3.5-moe-hub-tiny": {"model_type": "qwen3_5_moe", "tie_word_embeddings": False, "vocab_size": 1024,
                             "text_config": {**_QWEN3_5_MOE_TINY, "model_type": "qwen3_5_moe_text"}},
    # Qwen3.5-35B-A3B's text model: transformers' Qwen3_5MoeTextConfig defaults (40 layers, 256 experts,
    # 8 routed + 1 shared, 16 key / 32 value DeltaNet heads, 16 query / 2 key-value attention heads).
    "qwen3.5-35b-a3b": {**_QWEN3_5, "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
                        "num_attention_heads": 16, "num_key_value_heads": 2, "moe_intermediate_size": 512,
                        "shared_expert_intermediate_size": 512, "num_experts": 256, "num_experts_per_tok": 8,
                        "router_aux_loss_coef": 0.001},
}
