"""QLoRA through Hugging Face's trainers, as a user writes it for one GPU (``BitsAndBytesConfig`` +
``LoraConfig``), run twice by tests/hf/test_qlora_hf.py: on one process with the stock classes
(``transformers.Trainer``, trl's ``SFTTrainer``), and under torchrun at 2 ranks with
``ls.hf.Trainer`` / ``ls.hf.sharded(SFTTrainer)`` on the same global batch.

    python tests/_qlora_hf_script.py OUT                                  # reference
    python -m torch.distributed.run --nproc-per-node 2 tests/_qlora_hf_script.py OUT

Rank 0 writes ``OUT/<impl>.json`` (impl: ``single`` or ``ls``) and the saved adapters under
``OUT/<impl>-*``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from _dist import listing
from _hf_script import args, chat_tokenizer, completions, logged, run_sections, sequences
from _qlora import bnb_config, lora_config, save_base

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
IMPL = "ls" if WORLD > 1 else "single"
STEPS = 8


def _base(folder: Path):
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=bnb_config(), device_map="cpu", dtype=torch.float32
    )
    for m in model.modules():  # the reference computes as ls.shard does (tests/_qlora.py)
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    return model


def trainer(out: Path) -> dict:
    """PEFT's get_peft_model on the 4-bit model, then Trainer; save_model writes the adapter."""
    import peft
    import transformers as T

    import layershard as ls

    d = out / f"{IMPL}-trainer"
    # a checkpoint halfway (starts the process group under torchrun)
    a = args(d, max_steps=STEPS, save_strategy="steps", save_steps=STEPS // 2)
    folder = out / "base"
    if RANK == 0 and not (folder / "config.json").exists():
        save_base(str(folder))
    if dist.is_initialized():
        dist.barrier()

    def model():
        torch.manual_seed(0)
        return peft.get_peft_model(_base(folder), lora_config())

    cls = ls.hf.Trainer if IMPL == "ls" else T.Trainer
    t = cls(model=model(), args=a, train_dataset=sequences(64))
    t.train()
    resumed, ran = None, []

    class Steps(T.TrainerCallback):  # which steps this trainer ran (a resume runs the 2nd half)
        def on_step_end(self, args, state, control, **kw):
            ran.append(state.global_step)

    if IMPL == "ls":  # a fresh model resumed from the checkpoint (adapters, optimizer, RNG)
        again = cls(model=model(), args=args(out / "ls-resumed", max_steps=STEPS),
                    train_dataset=sequences(64), callbacks=[Steps()])  # fmt: skip
        again.train(resume_from_checkpoint=str(d / f"checkpoint-{STEPS // 2}"))
        resumed = logged(again)
    t.save_model(str(d / "final"))
    res = {"logged": logged(t), "files": listing(d / "final")}
    res.update(resumed=resumed, resumed_steps=ran)
    x = torch.tensor([r["input_ids"].tolist() for r in sequences(2, seed=9)])
    t.model.eval()
    with torch.no_grad():
        live = t.model(input_ids=x).logits
    if RANK == 0:
        loaded = peft.PeftModel.from_pretrained(_base(folder), str(d / "final"))
        with torch.no_grad():
            res["logits_diff"] = (loaded(input_ids=x).logits - live).abs().max().item()
        res["logits_scale"] = live.abs().max().item()
    return res


def sft(out: Path) -> dict:
    """trl's SFTTrainer given the 4-bit model and peft_config=LoraConfig (it wraps the model)."""
    from trl import SFTConfig, SFTTrainer

    import layershard as ls

    tok = chat_tokenizer()
    import transformers as T

    cfg = args(
        out / f"{IMPL}-sft", cls=SFTConfig, max_steps=STEPS, lr_scheduler_type="linear",
        bf16=False, gradient_checkpointing=False, max_length=64, completion_only_loss=True,
    )  # fmt: skip
    folder = out / "sft-base"
    if RANK == 0 and not (folder / "config.json").exists():
        model_cfg = T.LlamaConfig(
            vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            pad_token_id=0, eos_token_id=1,
        )  # fmt: skip
        torch.manual_seed(0)
        T.LlamaForCausalLM(model_cfg).save_pretrained(folder)
    if dist.is_initialized():
        dist.barrier()
    torch.manual_seed(0)  # the adapters' initialization
    cls = ls.hf.sharded(SFTTrainer) if IMPL == "ls" else SFTTrainer
    t = cls(
        model=_base(folder), args=cfg, train_dataset=completions(64), processing_class=tok,
        peft_config=lora_config(),
    )  # fmt: skip
    if IMPL == "single":  # what ls.hf trains: trl's bf16 cast of the adapters undone
        for p in t.model.parameters():
            if p.requires_grad:
                assert p.dtype == torch.bfloat16  # trl's QLoRA cast, which ls.hf undoes
                p.data = p.data.float()
    t.train()
    t.save_model(str(out / f"{IMPL}-sft" / "final"))
    return {"logged": logged(t)}


def main() -> None:
    out = Path(sys.argv[1])
    run_sections((trainer, sft), out, out / f"{IMPL}.json")


if __name__ == "__main__":
    main()
