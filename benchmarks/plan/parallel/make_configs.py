"""Write the config.json files of the README's TP/EP plans from transformers' config classes and
the models' published hyperparameters (no download): Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B's
config.json) and Llama-3-70B (meta-llama/Meta-Llama-3-70B's).

    python benchmarks/plan/parallel/make_configs.py   # -> benchmarks/plan/parallel/*/config.json
"""

from __future__ import annotations

from pathlib import Path

from transformers import LlamaConfig, Qwen3MoeConfig

HERE = Path(__file__).resolve().parent

CONFIGS = {
    "qwen3-30b-a3b": Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, intermediate_size=6144, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1000000.0,
        tie_word_embeddings=False, norm_topk_prob=True,
    ),
    "llama-3-70b": LlamaConfig(
        vocab_size=128256, hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
        num_key_value_heads=8, intermediate_size=28672, max_position_embeddings=8192,
        rope_theta=500000.0, tie_word_embeddings=False,
    ),
}  # fmt: skip


def main() -> None:
    for name, cfg in CONFIGS.items():
        out = HERE / name
        out.mkdir(exist_ok=True)
        cfg.to_json_file(out / "config.json", use_diff=False)
        print(f"wrote {out / 'config.json'}")


if __name__ == "__main__":
    main()
