"""Reference models: a readable Llama-style causal LM."""

from layershard.models.llama import (
    PRESETS,
    Attention,
    Block,
    CausalLMOutput,
    LlamaConfig,
    LlamaForCausalLM,
    RMSNorm,
    Rotary,
    build_config,
    causal_lm_loss,
    from_hf_name,
    hf_llama_config,
    to_hf_name,
)

__all__ = [
    "PRESETS",
    "Attention",
    "Block",
    "CausalLMOutput",
    "LlamaConfig",
    "LlamaForCausalLM",
    "RMSNorm",
    "Rotary",
    "build_config",
    "causal_lm_loss",
    "from_hf_name",
    "hf_llama_config",
    "to_hf_name",
]
