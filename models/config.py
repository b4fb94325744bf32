"""Model configs parsed from Hugging Face `config.json` dicts (transformers 4.x and 5.x layouts)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def rope_parameters(hf: dict) -> dict:
    """transformers 5 `rope_parameters`, or the older `rope_theta` + `rope_scaling`, as one dict."""
    if hf.get("rope_parameters"):
        rope = dict(hf["rope_parameters"])
    else:
        rope = dict(hf.get("rope_scaling") or {})
        rope["rope_theta"] = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    rope["rope_type"] = rope.get("rope_type", rope.pop("type", "default"))
    return rope


def hf_dtype(hf: dict) -> torch.dtype:
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if name not in _DTYPES:
        raise ValueError(f"config dtype {name!r} not supported; accepted: {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclass
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: dict = field(default_factory=lambda: {"rope_theta": 10000.0, "rope_type": "default"})
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    dtype: torch.dtype = torch.float32
    model_type: str = "qwen3"

    @classmethod
    def from_hf(cls, hf: dict) -> "Qwen3Config":
        if hf.get("use_sliding_window"):
            raise ValueError("use_sliding_window=True is not supported for qwen3")
        if hf.get("hidden_act", "silu") != "silu":  # the MLPs are SwiGLU: another activation would run as silu
            raise ValueError(f"{hf.get('model_type', 'qwen3')} supports hidden_act 'silu', got {hf['hidden_act']!r}")
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads", heads),
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope=rope_parameters(hf),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", False),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            initializer_range=hf.get("initializer_range", 0.02), dtype=hf_dtype(hf))

    def to_hf(self) -> dict:
        d = asdict(self)
        rope, dtype = d.pop("rope"), d.pop("dtype")
        d.update(architectures=["Qwen3ForCausalLM"], rope_parameters=rope, rope_theta=rope["rope_theta"],
                 dtype=str(dtype).removeprefix("torch."), hidden_act="silu", use_sliding_window=False)
        return d
