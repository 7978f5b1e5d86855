"""QLoRA supervised fine-tuning with trl's SFTTrainer, sharded by layershard: the base loaded in
4 bits (bitsandbytes NF4, double quantization), LoRA adapters on every linear, the loss on the
completions. Written as for one GPU; ``ls.hf.sharded(SFTTrainer)`` is the one layershard line
(each rank then holds 1/N of the packed 4-bit base).

    # 2 CPU ranks, a small Llama saved on first use to OUT/base, generated prompt/completion pairs
    torchrun --nproc-per-node 2 examples/qlora_sft.py --output_dir runs/qlora --use_cpu

    # a local model folder on GPUs, bf16 compute, the merged model exported as well
    torchrun --nproc-per-node 2 examples/qlora_sft.py --output_dir runs/qlora \\
        --model_name_or_path /path/to/Llama-3-8B --bf16 --merged

Writes OUT/adapter (PEFT format: ``PeftModel.from_pretrained(base, OUT/adapter)``) and with
``--merged`` OUT/merged (a plain bf16 model: ``AutoModelForCausalLM.from_pretrained``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, HfArgumentParser
from trl import SFTConfig, SFTTrainer

import layershard as ls

DIGITS = [str(i) for i in range(10)] + ["+", "="]


@dataclass
class ScriptArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "a local Hugging Face model (default: a small Llama)"}
    )
    merged: bool = field(default=False, metadata={"help": "also export the merged bf16 model"})
    lora_rank: int = 16


DEFAULTS = dict(
    max_steps=60,
    learning_rate=2e-3,
    lr_scheduler_type="cosine",
    warmup_steps=3,
    per_device_train_batch_size=8,
    logging_steps=10,
    save_strategy="no",
    report_to="none",
    completion_only_loss=True,
    max_length=64,
    bf16=False,  # SFTConfig defaults to bf16 and gradient checkpointing: pass --bf16 on GPUs
    gradient_checkpointing=False,
)


def tokenizer():
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", *DIGITS, "<unk>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def additions(n: int) -> Dataset:
    """'1 2 + 3 4 =' -> '4 6': sums of two-digit numbers, digit by digit."""
    r = random.Random(0)
    rows = []
    for _ in range(n):
        a, b = r.randint(10, 99), r.randint(10, 99)
        prompt = f"{' '.join(str(a))} + {' '.join(str(b))} ="
        rows.append({"prompt": prompt, "completion": " ".join(str(a + b))})
    return Dataset.from_list(rows)


def small_base(folder: Path, vocab: int) -> str:
    """A small Llama saved once (rank 0 writes; the others wait): from_pretrained quantizes it."""
    if not (folder / "config.json").exists() and torch.distributed.get_rank() == 0:
        cfg = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
            pad_token_id=0, eos_token_id=1,
        )  # fmt: skip
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    torch.distributed.barrier()
    return str(folder)


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, SFTConfig))
    parser.set_defaults(**DEFAULTS)
    script, args = parser.parse_args_into_dataclasses()
    out = Path(args.output_dir)
    tok = tokenizer()
    path = script.model_name_or_path or small_base(out / "base", len(tok))
    compute = torch.bfloat16 if args.bf16 else torch.float32
    # as on one GPU: the base in 4 bits, LoRA on every linear
    model = AutoModelForCausalLM.from_pretrained(
        path,
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute,
        ),
        dtype=torch.float32,  # what is not quantized: layershard keeps fp32 master weights
        device_map={"": torch.cuda.current_device()} if torch.cuda.is_available() else "cpu",
    )
    lora = LoraConfig(
        r=script.lora_rank, lora_alpha=2 * script.lora_rank, target_modules="all-linear"
    )
    trainer = ls.hf.sharded(SFTTrainer)(
        model=model,
        args=args,
        train_dataset=additions(2000),
        processing_class=tok,
        peft_config=lora,
    )
    trainer.train()
    trainer.save_model(str(out / "adapter"))  # the adapters only (PEFT format); every rank
    if script.merged:
        ls.hf.export_merged(trainer.model_wrapped, out / "merged")  # dequantized + merged, bf16
    if trainer.is_world_process_zero():
        print(
            f"adapter in {out / 'adapter'}"
            + (f", merged model in {out / 'merged'}" if script.merged else "")
        )


if __name__ == "__main__":
    main()
