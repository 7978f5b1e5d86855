"""One QLoRA SFT run at the ranks torchrun starts: trl's SFTTrainer on a 4-bit base with LoRA on
every linear, either through ``ls.hf.sharded(SFTTrainer)`` (``ls``) or with accelerate's FSDP
recipe for QLoRA (``fsdp``: ``bnb_4bit_quant_storage`` = the compute dtype so that FSDP can
flatten the packed weights, ``use_orig_params``, the decoder layers wrapped). Same script, same
data, same seed otherwise. Rank 0 appends one JSON line to OUT: the step times after WARMUP steps
(wall, from a callback) and every rank's peak RSS.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/qlora/sft_step.py ls BASE OUT
"""

from __future__ import annotations

import json
import os
import random
import resource
import sys
import time

import torch
import torch.distributed as dist
import transformers as T
from datasets import Dataset
from peft import LoraConfig
from tokenizers import Tokenizer, models, pre_tokenizers
from trl import SFTConfig, SFTTrainer

STEPS, WARMUP, SEQ, BATCH = 8, 2, 256, 2
WORDS = [f"w{i}" for i in range(500)]


def tokenizer():
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", *WORDS, "<unk>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return T.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def data(n: int) -> Dataset:
    r = random.Random(0)
    rows = [
        {
            "prompt": " ".join(r.choices(WORDS, k=64)),
            "completion": " ".join(r.choices(WORDS, k=190)),
        }
        for _ in range(n)
    ]
    return Dataset.from_list(rows)


def save_base(folder: str) -> None:
    cfg = T.LlamaConfig(
        vocab_size=len(WORDS) + 3, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
        pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    T.LlamaForCausalLM(cfg).save_pretrained(folder)


class StepTimes(T.TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.t0 = 0.0

    def on_step_begin(self, args, state, control, **kw):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self.t0)


def main() -> None:
    impl, base, out = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.manual_seed(0)
    fsdp = impl == "fsdp"
    kw = {}
    if fsdp:
        kw = dict(
            fsdp="full_shard auto_wrap",
            fsdp_config={"use_orig_params": True, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        )  # fmt: skip
    args = SFTConfig(
        output_dir=f"{out}.{impl}.d", use_cpu=True, ddp_backend="gloo", report_to=[],
        per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=1e-3, logging_steps=1,
        save_strategy="no", bf16=False, gradient_checkpointing=False, max_length=SEQ,
        disable_tqdm=True, completion_only_loss=True, seed=0, log_level="error", **kw,
    )  # fmt: skip
    bnb = T.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,  # this CPU has no fast bf16 matmul
        # the FSDP recipe: packed bytes stored in the compute dtype so FSDP can flatten them
        bnb_4bit_quant_storage=torch.float32 if fsdp else torch.uint8,
    )  # fmt: skip
    model = T.AutoModelForCausalLM.from_pretrained(
        base, quantization_config=bnb, device_map="cpu", dtype=torch.float32
    )
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
    if impl == "ls":
        import layershard as ls

        cls = ls.hf.sharded(SFTTrainer)
    else:
        cls = SFTTrainer
    timer = StepTimes()
    trainer = cls(
        model=model, args=args, train_dataset=data(256), processing_class=tokenizer(),
        peft_config=lora, callbacks=[timer],
    )  # fmt: skip
    trainer.train()
    rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0])
    every = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(every, rss)
    if dist.get_rank() == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        line = {
            "impl": impl, "step_s": timer.times[WARMUP:], "peak_rss_mib": [t.item() for t in every],
            "losses": losses, "load": os.getloadavg(),
        }  # fmt: skip
        with open(out, "a") as f:
            f.write(json.dumps(line) + "\n")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo's static destructors (see tests/_dist.py)


if __name__ == "__main__":
    if sys.argv[1] == "base":
        save_base(sys.argv[2])
    else:
        main()
