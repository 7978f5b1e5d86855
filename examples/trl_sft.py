"""Supervised fine-tuning on a local chat JSONL with trl's SFTTrainer, sharded by layershard;
the loss is on the assistant's tokens only.

    # 2 CPU ranks, a tiny Llama, a generated arithmetic chat set (written to OUT/chat.jsonl)
    torchrun --nproc-per-node 2 examples/trl_sft.py --output_dir runs/sft --use_cpu

    # your conversations and a local base model (e.g. the output of hf_trainer_clm.py), on GPUs
    torchrun --nproc-per-node 8 examples/trl_sft.py --output_dir runs/sft \\
        --data chat.jsonl --model_name_or_path runs/clm --bf16

Each line of the JSONL is ``{"messages": [{"role": "user", "content": ...}, {"role":
"assistant", "content": ...}, ...]}``. Every ``SFTConfig`` flag works. The one line that makes it
layershard is ``ls.hf.sharded(SFTTrainer)``; ``--no_layershard`` runs the stock one (DDP).
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

import transformers
from transformers import HfArgumentParser
from trl import SFTConfig, SFTTrainer

import layershard as ls

SPECIAL = ["<|endoftext|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|end|>"]
# {% generation %} marks the assistant's tokens: trl's assistant_only_loss trains on those only.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}{{ m['content'] }}<|end|>"
    "{% endgeneration %}{% else %}<|user|>{{ m['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

DEFAULTS = dict(
    max_steps=150,
    learning_rate=3e-3,
    lr_scheduler_type="cosine",
    warmup_steps=5,
    per_device_train_batch_size=8,
    logging_steps=10,
    save_strategy="no",
    report_to="none",
    assistant_only_loss=True,
    max_length=128,
    bf16=False,  # SFTConfig defaults to bf16 and gradient checkpointing: pass --bf16 on GPUs
    gradient_checkpointing=False,
)


@dataclass
class ScriptArguments:
    data: str | None = field(default=None, metadata={"help": "chat JSONL (default: generated)"})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "a local Hugging Face model (default: a tiny Llama)"}
    )
    layershard: bool = field(default=True, metadata={"help": "--no_layershard: stock SFTTrainer"})


def demo_chats(path: Path, n: int = 2000, seed: int = 0) -> None:
    """Arithmetic conversations: small enough to learn on a CPU in a minute."""
    r = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            a, b = r.randint(0, 99), r.randint(0, 99)
            messages = [
                {"role": "user", "content": f"What is {a} plus {b}?"},
                {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")


def train_tokenizer(path: Path, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        for line in path.open():
            for m in json.loads(line)["messages"]:
                yield m["content"]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts(), trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return fast


def build(script: ScriptArguments, args: SFTConfig):
    out = Path(args.output_dir)
    with args.main_process_first(desc="data and tokenizer"):
        out.mkdir(parents=True, exist_ok=True)
        data = Path(script.data) if script.data else out / "chat.jsonl"
        if not data.is_file():
            demo_chats(data)
        if script.model_name_or_path:
            tokenizer = transformers.AutoTokenizer.from_pretrained(script.model_name_or_path)
            tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL[2:]})
            tokenizer.chat_template = CHAT_TEMPLATE
        elif (out / "tokenizer" / "tokenizer.json").is_file():
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(out / "tokenizer"))
        else:
            tokenizer = train_tokenizer(data, out / "tokenizer")

        from datasets import load_dataset

        dataset = load_dataset("json", data_files=str(data), split="train")

    if script.model_name_or_path:
        model = transformers.AutoModelForCausalLM.from_pretrained(script.model_name_or_path)
        model.resize_token_embeddings(len(tokenizer))  # the chat tokens, before sharding
    else:
        transformers.set_seed(args.seed)
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=len(tokenizer),
                hidden_size=64,
                intermediate_size=176,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=args.max_length,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        )
    return tokenizer, dataset, model


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((ScriptArguments, SFTConfig))
    parser.set_defaults(**DEFAULTS)
    script, args = parser.parse_args_into_dataclasses(args=argv)
    tokenizer, dataset, model = build(script, args)

    # The one-line change: ls.hf.sharded(SFTTrainer) in place of SFTTrainer.
    Trainer = ls.hf.sharded(SFTTrainer) if script.layershard else SFTTrainer
    trainer = Trainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()  # every rank; rank 0 writes the HF model (or the adapters of a PEFT one)
    return result.metrics


if __name__ == "__main__":
    main(sys.argv[1:])
