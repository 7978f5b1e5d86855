"""Causal LM pre-training (or continued training) on local text files with the Hugging Face
Trainer, sharded by layershard: the run_clm recipe, offline.

    # 2 CPU ranks, a tiny Llama, the Python standard library's own sources as the corpus
    torchrun --nproc-per-node 2 examples/hf_trainer_clm.py --output_dir runs/clm --use_cpu

    # your files, continued training of a local Hugging Face model, on GPUs in bf16
    torchrun --nproc-per-node 8 examples/hf_trainer_clm.py --output_dir runs/clm \\
        --train_files data/*.txt --model_name_or_path path/to/model --bf16 --max_steps 1000

Every ``TrainingArguments`` flag works (``--per_device_train_batch_size``, ``--save_steps``,
``--resume_from_checkpoint``, ...). The one line that makes it layershard is the choice of the
Trainer class below; ``--no_layershard`` runs the stock ``transformers.Trainer`` (DDP).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import transformers
from transformers import HfArgumentParser, TrainingArguments

import layershard as ls

# Model sizes for training from scratch (Llama); --model_name_or_path loads a model instead.
SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4),
    "small": dict(
        hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6
    ),
}


# Defaults for a from-scratch run that learns something in a minute; every flag overrides them.
DEFAULTS = dict(
    max_steps=50,
    learning_rate=2e-3,
    lr_scheduler_type="cosine",
    warmup_steps=5,
    weight_decay=0.1,
    per_device_train_batch_size=8,
    per_device_eval_batch_size=8,
    logging_steps=10,
    save_strategy="no",
    report_to="none",
)


@dataclass
class ScriptArguments:
    train_files: list[str] = field(
        default_factory=list,
        metadata={"help": "text files to train on (default: Python standard library sources)"},
    )
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "a local Hugging Face model folder to continue training"}
    )
    model_size: str = field(default="tiny", metadata={"help": f"from scratch: {', '.join(SIZES)}"})
    tokenizer_name: str | None = field(
        default=None, metadata={"help": "a local tokenizer folder (default: train a BPE)"}
    )
    vocab_size: int = field(default=4096, metadata={"help": "of the BPE trained on the files"})
    block_size: int = field(default=128, metadata={"help": "tokens per training sequence"})
    validation_split_percentage: int = field(default=5)
    layershard: bool = field(default=True, metadata={"help": "--no_layershard: stock Trainer"})
    strategy: str = field(default="full", metadata={"help": "ls.shard strategy"})


def default_files() -> list[str]:
    """Offline on every machine with Python: modules of its standard library."""
    stdlib = Path(os.__file__).parent
    return [str(p) for p in sorted(stdlib.glob("*.py"))[:60]]


def train_tokenizer(files: list[str], vocab_size: int, out: Path):
    """A byte-level BPE trained on the corpus (what a from-scratch run needs), saved to ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train(files, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.save_pretrained(str(out))
    return fast


def build(script: ScriptArguments, args: TrainingArguments):
    files = script.train_files or default_files()
    # Rank 0 prepares (tokenizer, dataset cache), the others then read what it wrote.
    with args.main_process_first(desc="tokenizer and dataset"):
        tok_dir = Path(args.output_dir) / "tokenizer"
        if script.tokenizer_name or script.model_name_or_path:
            name = script.tokenizer_name or script.model_name_or_path
            tokenizer = transformers.AutoTokenizer.from_pretrained(name)
        elif (tok_dir / "tokenizer.json").is_file():
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
        else:
            tokenizer = train_tokenizer(files, script.vocab_size, tok_dir)

        from datasets import load_dataset

        raw = load_dataset("text", data_files={"train": files}, split="train")
        raw = raw.train_test_split(test_size=script.validation_split_percentage / 100, seed=0)
        eos = tokenizer.eos_token_id

        def tokenize(batch):
            ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
            return {"input_ids": [x + [eos] for x in ids]}

        def group(batch):  # concatenate, then cut into blocks (run_clm's group_texts)
            flat = [t for x in batch["input_ids"] for t in x]
            n = len(flat) // script.block_size * script.block_size
            blocks = [flat[i : i + script.block_size] for i in range(0, n, script.block_size)]
            return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

        data = raw.map(tokenize, batched=True, remove_columns=["text"])
        data = data.map(group, batched=True)

    if script.model_name_or_path:
        model = transformers.AutoModelForCausalLM.from_pretrained(script.model_name_or_path)
    else:
        config = transformers.LlamaConfig(
            vocab_size=len(tokenizer),
            max_position_embeddings=script.block_size,
            bos_token_id=eos,
            eos_token_id=eos,
            tie_word_embeddings=False,
            **SIZES[script.model_size],
        )
        transformers.set_seed(args.seed)
        model = transformers.LlamaForCausalLM(config)
    return tokenizer, data, model


def main(argv: list[str] | None = None, trainer_class=None, callbacks=()) -> dict:
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    parser.set_defaults(**DEFAULTS)
    script, args = parser.parse_args_into_dataclasses(args=argv)
    tokenizer, data, model = build(script, args)

    # The one-line change: ls.hf.Trainer in place of transformers.Trainer.
    Trainer = ls.hf.Trainer if script.layershard else transformers.Trainer
    extra = (
        {"layershard": ls.hf.ShardingPlugin(strategy=script.strategy)} if script.layershard else {}
    )
    trainer = (trainer_class or Trainer)(
        model=model,
        args=args,
        train_dataset=data["train"],
        eval_dataset=data["test"],
        processing_class=tokenizer,
        data_collator=transformers.default_data_collator,
        callbacks=list(callbacks),
        **extra,
    )
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = trainer.evaluate()
    metrics["perplexity"] = math.exp(min(metrics["eval_loss"], 50))
    trainer.log_metrics("eval", metrics)
    trainer.save_model()  # every rank: gathers the shards; rank 0 writes HF safetensors
    return {"train": result.metrics, "eval": metrics}


if __name__ == "__main__":
    main(sys.argv[1:])
