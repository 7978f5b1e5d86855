"""The Hugging Face workflows of tests/test_hf_*.py, run under torchrun: each section trains the
same script once with the stock class (``transformers.Trainer`` / trl's ``SFTTrainer`` under DDP,
``accelerate.Accelerator``) and once with layershard's (``ls.hf.Trainer``, ``ls.hf.sharded(...)``,
``ls.hf.Accelerator``), and records what the tests compare.

    python -m torch.distributed.run --nproc-per-node 2 tests/_hf_script.py main OUT
    python -m torch.distributed.run --nproc-per-node 4 tests/_hf_script.py save4 OUT
    python tests/_hf_script.py single OUT && python tests/_hf_script.py calibrate OUT

The last line is how the tolerances of test_hf_trainer.py were calibrated: the parity runs on one
process (same global batch), against the DDP runs of ``main`` in the same OUT.

Rank 0 writes ``OUT/<job>.json``: one entry per section, or ``{"error": traceback}`` when the
section raised (the others still run). Several trainings share one launch because importing
transformers and trl costs ~6 s of CPU per rank. ``ddp_timeout`` turns a hang into an error.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import transformers as T
from _dist import die_with_launcher, listing

import layershard as ls
from layershard.engine import dtensor

V, SEQ = 96, 16
RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
GLOBAL_BATCH = 8  # sequences per optimizer step: per-device batch x ranks x accumulation 2
TIMEOUT_S = 90


# ---- models and data ---------------------------------------------------------------------------


def llama(**kw) -> T.PreTrainedModel:
    torch.manual_seed(0)
    cfg = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
    cfg.update(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **kw)
    return T.LlamaForCausalLM(T.LlamaConfig(**cfg))


def gpt2() -> T.PreTrainedModel:  # tied embeddings, LayerNorm + biases (no-decay by type and name)
    torch.manual_seed(0)
    cfg = T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    return T.GPT2LMHeadModel(cfg)


def sequences(n: int, seed: int = 1) -> list[dict]:
    """Learnable sequences (an affine recurrence mod V from a random start), so that the loss
    falls fast and a wrong gradient, clip or decay shows in the losses within a few steps."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(1, V, (n, 1), generator=g)
    mult = torch.randint(1, 4, (n, 1), generator=g)
    steps = torch.arange(SEQ).unsqueeze(0)
    x = (start + mult * steps * 7) % (V - 1) + 1
    return [{"input_ids": r, "labels": r.clone()} for r in x]


def args(out: str | Path, cls=T.TrainingArguments, **kw):
    base = dict(
        output_dir=str(out),
        use_cpu=True,
        ddp_backend="gloo" if WORLD > 1 else None,
        ddp_timeout=TIMEOUT_S,
        report_to=[],
        per_device_train_batch_size=GLOBAL_BATCH // (2 * WORLD),
        gradient_accumulation_steps=2,
        max_steps=20,
        learning_rate=1e-2,
        lr_scheduler_type="cosine",
        warmup_steps=3,
        weight_decay=0.1,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        data_seed=0,
        disable_tqdm=True,
        log_level="error",
        dataloader_num_workers=0,
    )
    base.update(kw)
    return cls(**base)


def trainer_class(impl: str, base=T.Trainer):
    return base if impl == "ddp" else ls.hf.sharded(base)


def logged(trainer) -> list[list[float]]:
    return [
        [h["step"], h["loss"], h["grad_norm"]] for h in trainer.state.log_history if "loss" in h
    ]


def state_of(trainer) -> dict[str, torch.Tensor]:
    """Full fp32 weights on every rank (collective for the sharded model)."""
    sharded = ls.hf.sharded_of(trainer.model_wrapped) or ls.hf.sharded_of(trainer.model)
    if sharded is None:
        return {k: v.detach().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model_wrapped).state_dict().items()}  # fmt: skip
    return sharded.full_state_dict(rank0_only=False)


def max_param_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))[:5]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


class Recorder(T.TrainerCallback):
    """Which callbacks fired, and the model state bytes at the first optimizer step."""

    def __init__(self):
        self.events: dict[str, int] = {}
        self.state_bytes: dict[str, int] | None = None

    def _count(self, name):
        self.events[name] = self.events.get(name, 0) + 1

    def on_step_end(self, args, state, control, **kw):
        self._count("step_end")

    def on_log(self, args, state, control, **kw):
        self._count("log")

    def on_evaluate(self, args, state, control, **kw):
        self._count("evaluate")

    def on_save(self, args, state, control, **kw):
        self._count("save")

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
        self._count("pre_optimizer_step")
        if self.state_bytes is not None:
            return
        sharded = ls.hf.sharded_of(model)
        if sharded is not None:  # gradient slices exist now, before the step clears them
            r = sharded.memory_report(optimizer.optimizer)
            self.state_bytes = {"params": r["params"], "grads": r["grads"]}
        else:
            params = list(model.parameters())
            self.state_bytes = {
                "params": sum(p.numel() * p.element_size() for p in params),
                "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
            }  # fmt: skip


def optimizer_bytes(optimizer) -> int:
    opt = getattr(optimizer, "optimizer", optimizer)
    return sum(
        v.numel() * v.element_size()
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )


# ---- sections ----------------------------------------------------------------------------------


def parity(out: Path) -> dict:
    """transformers.Trainer (DDP) against ls.hf.Trainer, the same script: Llama with accumulation,
    clipping, weight decay, cosine warmup, evaluation, checkpoints (save_total_limit, best model
    at end), a callback and tensorboard; Llama with gradient checkpointing; GPT-2 (tied)."""
    res: dict = {}
    finals: dict = {}
    for name, make, extra in (
        ("llama", llama, "full"),
        ("llama-gc", llama, "gc"),
        ("gpt2", gpt2, "plain"),
    ):
        for impl in ("ddp", "ls") if WORLD > 1 else ("ddp",):
            d = out / f"parity-{name}-{impl}"
            kw: dict = {}
            rec = Recorder()
            if extra == "full":
                kw = dict(
                    eval_strategy="steps",
                    eval_steps=5,
                    save_strategy="steps",
                    save_steps=5,
                    save_total_limit=2,
                    load_best_model_at_end=True,
                    metric_for_best_model="eval_loss",
                    report_to=["tensorboard"],  # into output_dir/runs/
                )
            elif extra == "gc":
                kw = dict(gradient_checkpointing=True)
            trainer = trainer_class(impl)(
                model=make(),
                args=args(d, **kw),
                train_dataset=sequences(200),
                eval_dataset=sequences(12, seed=5),
                callbacks=[rec],
            )
            trainer.train()
            r = {"logged": logged(trainer), "events": rec.events}
            finals[impl] = state_of(trainer)
            if extra == "full":
                r["best"] = Path(trainer.state.best_model_checkpoint).name
                r["checkpoints"] = [n for n in listing(d) if n.startswith("checkpoint-")]
                r["checkpoint_files"] = sorted(os.listdir(d / r["checkpoints"][-1]))
                r["eval"] = trainer.evaluate()["eval_loss"]
                pred = trainer.predict(sequences(6, seed=7))
                r["predict"] = [list(pred.predictions.shape), float(pred.predictions.sum())]
                r["predict_loss"] = pred.metrics["test_loss"]
                r["tensorboard"] = sum(1 for _ in (d / "runs").rglob("events.out.tfevents*"))
                r["state_bytes"] = dict(rec.state_bytes or {})
                r["state_bytes"]["optimizer"] = optimizer_bytes(trainer.optimizer)
                if impl == "ls":
                    r["saved_model"] = saved_model_check(trainer, out / "saved-llama")
            res[f"{name}/{impl}"] = r
            if impl == "ddp" and RANK == 0:  # for `calibrate`
                torch.save(finals[impl], out / f"final-{name}-ws{WORLD}.pt")
        if WORLD > 1:
            res[f"{name}/param_diff"] = max_param_diff(finals["ls"], finals["ddp"])
    return res


def qwen3_moe() -> T.PreTrainedModel:
    torch.manual_seed(0)
    cfg = T.Qwen3MoeConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1,
        output_router_logits=True, max_position_embeddings=64,
    )  # fmt: skip
    return T.Qwen3MoeForCausalLM(cfg)


def expert_parallel(out: Path) -> dict:
    """transformers.Trainer (DDP) against ls.hf.Trainer with ShardingPlugin(ep=2) on Qwen3-MoE:
    each layer's 4 experts split over the 2 ranks (tokens by all-to-all), the rest sharded."""
    res: dict = {}
    finals: dict = {}
    for impl in ("ddp", "ls"):
        kw = {"layershard": ls.hf.ShardingPlugin(ep=2)} if impl == "ls" else {}
        trainer = trainer_class(impl)(
            model=qwen3_moe(), args=args(out / f"ep-{impl}"), train_dataset=sequences(200), **kw
        )
        trainer.train()
        res[impl] = {"logged": logged(trainer)}
        finals[impl] = state_of(trainer)
        if impl == "ls":
            model = trainer.model_wrapped
            res[impl]["expert_flats"] = [
                f.world_size for f in model.flat_params if f.over == "expert"
            ]
    res["param_diff"] = max_param_diff(finals["ls"], finals["ddp"])
    return res


def tensor_parallel(out: Path) -> dict:
    """transformers.Trainer (DDP) against ls.hf.Trainer with ShardingPlugin(tp=WORLD) on Llama:
    every block split over the ranks by its base_model_tp_plan. The ranks of a TP group share
    each batch (the data loaders split the data over world / tp = 1 rank), so the TP run's
    per-device batch is DDP's times WORLD: both train on the same sequences at each step. The TP
    run saves checkpoint-10, from which a fresh Trainer resumes to step 20."""
    res: dict = {}
    finals: dict = {}
    for impl in ("ddp", "ls"):
        kw: dict = {"layershard": ls.hf.ShardingPlugin(tp=WORLD)} if impl == "ls" else {}
        batch = GLOBAL_BATCH // (2 * WORLD) * (WORLD if impl == "ls" else 1)
        saves = {"save_strategy": "steps", "save_steps": 10} if impl == "ls" else {}
        a = args(out / f"tp-{impl}", per_device_train_batch_size=batch, **saves)
        trainer = trainer_class(impl)(model=llama(), args=a, train_dataset=sequences(200), **kw)
        trainer.train()
        res[impl] = {"logged": logged(trainer)}
        finals[impl] = state_of(trainer)
        if impl == "ls":  # the weights layershard holds as TP shards (DTensor parameters)
            model = trainer.model_wrapped
            tps = [dtensor.tp_of(s) for f in model.flat_params for s in f.slots]
            res[impl]["tp_sharded"] = sum(tp.sharded for tp in tps if tp is not None)
            trainer.save_model(str(out / "tp-saved"))  # whole tensors (full_state_dict)
            if RANK == 0:
                loaded = T.LlamaForCausalLM.from_pretrained(str(out / "tp-saved")).state_dict()
                res[impl]["saved_diff"] = max_param_diff(loaded, finals[impl])
            # accelerate's save_state / load_state (Trainer's checkpoints): the TP shards
            # written through ls.save_checkpoint and read back over weights moved since
            trainer.accelerator.save_state(str(out / "tp-state"))
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)
            trainer.accelerator.load_state(str(out / "tp-state"))
            res[impl]["state_diff"] = max_param_diff(state_of(trainer), finals[impl])
            a = args(out / "tp-resumed", per_device_train_batch_size=batch)
            again = ls.hf.Trainer(model=llama(), args=a, train_dataset=sequences(200), **kw)
            again.train(resume_from_checkpoint=str(out / "tp-ls" / "checkpoint-10"))
            res["resumed"] = {"logged": logged(again)}
            res["resumed"]["param_diff"] = max_param_diff(state_of(again), finals[impl])
    res["param_diff"] = max_param_diff(finals["ls"], finals["ddp"])
    return res


def saved_model_check(trainer, path: Path) -> dict:
    """trainer.save_model() output, loaded by from_pretrained, against the sharded model."""
    trainer.save_model(str(path))
    x = torch.tensor([r["input_ids"].tolist() for r in sequences(2, seed=9)])
    trainer.model.eval()
    with torch.no_grad():
        live = trainer.model(input_ids=x).logits
    res = {"files": listing(path)}
    if RANK == 0:
        loaded = T.AutoModelForCausalLM.from_pretrained(str(path))
        with torch.no_grad():
            res["logits_diff"] = (loaded(input_ids=x).logits - live).abs().max().item()
    return res


def lora(out: Path) -> dict:
    """A PEFT LoRA model: only the adapters train and are saved; PEFT loads them back."""
    import peft

    def model():
        m = peft.get_peft_model(llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))  # fmt: skip
        return m

    res: dict = {}
    adapters = {}
    x = torch.tensor([r["input_ids"].tolist() for r in sequences(2, seed=9)])
    for impl in ("ddp", "ls"):
        d = out / f"lora-{impl}"
        trainer = trainer_class(impl)(
            model=model(), args=args(d, max_steps=10), train_dataset=sequences(100)
        )
        trainer.train()
        trainer.save_model(str(d / "final"))
        trainer.model.eval()
        with torch.no_grad():
            live = trainer.model(input_ids=x).logits
        r = {"logged": logged(trainer), "files": listing(d / "final")}
        if RANK == 0:
            from safetensors.torch import load_file

            adapters[impl] = load_file(str(d / "final" / "adapter_model.safetensors"))
            loaded = peft.PeftModel.from_pretrained(llama(), str(d / "final"))
            with torch.no_grad():
                r["logits_diff"] = (loaded(input_ids=x).logits - live).abs().max().item()
            r["adapter_keys"] = sorted(adapters[impl])
            r["lora_B_norm"] = sum(v.norm().item() for k, v in adapters[impl].items() if "lora_B" in k)  # fmt: skip
        res[impl] = r
    if RANK == 0:
        res["adapter_diff"] = max_param_diff(adapters["ls"], adapters["ddp"])
    return res


WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|> {{ m['content'] }} <|end|> "
    "{% else %}<|assistant|> {% generation %}{{ m['content'] }} <|end|>{% endgeneration %} "
    "{% endif %}{% endfor %}"
)


def chat_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS + ["<unk>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t = T.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    t.chat_template = CHAT_TEMPLATE
    return t


def chats(n: int, seed: int = 0):
    from datasets import Dataset

    r = random.Random(seed)
    rows = []
    for _ in range(n):
        msgs = []
        for _ in range(2):
            for role in ("user", "assistant"):
                k = r.randint(2, 5)
                msgs.append({"role": role, "content": " ".join(r.choice(WORDS) for _ in range(k))})
        rows.append({"messages": msgs})
    return Dataset.from_list(rows)


def completions(n: int, seed: int = 0):
    from datasets import Dataset

    r = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt, completion = (
            " ".join(r.choice(WORDS) for _ in range(r.randint(2, 6))) for _ in "pc"
        )
        rows.append({"prompt": prompt, "completion": completion})
    return Dataset.from_list(rows)


def sft(out: Path) -> dict:
    """trl's SFTTrainer (its fused LM head) under DDP and sharded: on chats with the loss on
    assistant tokens only, and on prompt/completion pairs with the loss on completions only;
    and under DDP on every token, to show that each mask changes the losses."""
    from trl import SFTConfig, SFTTrainer

    tok = chat_tokenizer()
    res: dict = {}
    runs = (
        ("ddp", "assistant", chats, dict(assistant_only_loss=True)),
        ("ls", "assistant", chats, dict(assistant_only_loss=True)),
        ("ddp", "all", chats, dict(assistant_only_loss=False)),
        ("ddp", "completion", completions, dict(completion_only_loss=True)),
        ("ls", "completion", completions, dict(completion_only_loss=True)),
        ("ddp", "prompt+completion", completions, dict(completion_only_loss=False)),
    )
    for impl, mask, dataset, kw in runs:
        cfg = args(
            out / f"sft-{impl}-{mask}",
            cls=SFTConfig,
            max_steps=10,
            lr_scheduler_type="linear",
            bf16=False,
            gradient_checkpointing=False,
            max_length=64,
            **kw,
        )
        model = llama(vocab_size=len(tok), pad_token_id=0, eos_token_id=1)
        trainer = trainer_class(impl, SFTTrainer)(
            model=model, args=cfg, train_dataset=dataset(100), processing_class=tok
        )
        trainer.train()
        res[f"{impl}/{mask}"] = {"logged": logged(trainer)}
    return res


def dpo(out: Path) -> dict:
    """trl's DPOTrainer with a reference model: accelerate prepares it for evaluation only, so
    layershard shards it too (its fused LM head as well), beside the policy."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    tok = chat_tokenizer()
    r = random.Random(0)

    def words(k):
        return " ".join(r.choice(WORDS) for _ in range(k))

    rows = [{"prompt": words(4), "chosen": words(3), "rejected": words(3)} for _ in range(64)]
    res = {}
    for impl in ("ddp", "ls"):
        cfg = args(
            out / f"dpo-{impl}",
            cls=DPOConfig,
            max_steps=6,
            lr_scheduler_type="linear",
            bf16=False,
            gradient_checkpointing=False,
            max_length=32,
        )
        models = [llama(vocab_size=len(tok), pad_token_id=0, eos_token_id=1) for _ in range(2)]
        trainer = trainer_class(impl, DPOTrainer)(
            model=models[0],
            ref_model=models[1],
            args=cfg,
            train_dataset=Dataset.from_list(rows),
            processing_class=tok,
        )
        trainer.train()
        res[impl] = {"logged": logged(trainer)}
        if impl == "ls":
            res[impl]["ref_sharded"] = ls.hf.sharded_of(trainer.ref_model) is not None
    return res


def generate(out: Path) -> dict:
    """Seq2SeqTrainer.predict(predict_with_generate=True) with ranks that finish at different
    steps (the end-of-sequence token is the first one rank 0's prompt generates), against one
    process's greedy generate."""
    model = llama(pad_token_id=0)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(11)
    prompts = torch.randint(1, V, (2 * WORLD, 8), generator=g)
    with torch.no_grad():
        eos = int(ref(prompts[:1]).logits[0, -1].argmax())
        for m in (model, ref):
            m.generation_config.eos_token_id = eos
        want = ref.generate(prompts, max_new_tokens=6, do_sample=False, pad_token_id=0)
    cfg = args(
        out / "generate",
        cls=T.Seq2SeqTrainingArguments,
        per_device_eval_batch_size=1,
        predict_with_generate=True,
        generation_max_length=8 + 6,
    )
    trainer = trainer_class("ls", T.Seq2SeqTrainer)(model=model, args=cfg)
    got = trainer.predict([{"input_ids": p} for p in prompts]).predictions
    got = torch.as_tensor(got)[:, : want.shape[1]]
    lengths = [int((w != 0).sum()) - 8 for w in want]  # new tokens per prompt (pad 0 after eos)
    return {"equal": bool(torch.equal(got, want)), "new_tokens": lengths}


def accelerate_loop(out: Path) -> dict:
    """A user's own loop on accelerate.Accelerator (DDP) and on ls.hf.Accelerator: accumulate(),
    clip_grad_norm_, a scheduler, weight-decay groups built before prepare; save_state at step
    k, then load_state and replay the remaining steps; save_model loaded by from_pretrained."""
    import accelerate

    res: dict = {}
    finals = {}
    for impl in ("ddp", "ls"):
        cls = accelerate.Accelerator if impl == "ddp" else ls.hf.Accelerator
        acc = cls(cpu=True, gradient_accumulation_steps=2)
        model = llama()
        data = torch.stack([r["input_ids"] for r in sequences(64)])
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(data),
            batch_size=GLOBAL_BATCH // (2 * WORLD),  # in order: the replay sees the same batches
        )
        decay = [p for n, p in model.named_parameters() if "norm" not in n]
        no_decay = [p for n, p in model.named_parameters() if "norm" in n]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
            lr=1e-2,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
        state_dir = out / f"accel-state-{impl}"

        loop = (acc, model, opt, sched, state_dir)
        first: list = []
        _accelerate_steps(*loop, enumerate(loader), first)
        finals[impl] = {k: v.clone() for k, v in _acc_state(acc, model).items()}
        acc.load_state(str(state_dir))
        replay: list = []
        rest = ((i + 8, b) for i, b in enumerate(acc.skip_first_batches(loader, 8)))
        _accelerate_steps(*loop, rest, replay)
        again = _acc_state(acc, model)
        acc.save_model(model, str(out / f"accel-model-{impl}"))
        r = {"losses": first, "replay": replay}
        r["replay_param_diff"] = max_param_diff(again, finals[impl])
        r["state_files"] = listing(state_dir)
        r["model_files"] = listing(out / f"accel-model-{impl}")
        if RANK == 0 and impl == "ls":
            loaded = T.AutoModelForCausalLM.from_pretrained(str(out / f"accel-model-{impl}"))
            r["saved_diff"] = max_param_diff(
                {k: v for k, v in loaded.state_dict().items() if k in finals[impl]}, finals[impl]
            )
        res[impl] = r
        acc.free_memory()
    res["param_diff"] = max_param_diff(finals["ls"], finals["ddp"])
    return res


def _accelerate_steps(acc, model, opt, sched, state_dir, batches, losses) -> None:
    """The user's loop: micro-batches under accumulate(), a step on every second one; the
    state is saved after micro-batch 7."""
    for i, (x,) in batches:
        with acc.accumulate(model):
            loss = model(input_ids=x, labels=x).loss
            acc.backward(loss)
            if acc.sync_gradients:
                norm = acc.clip_grad_norm_(model.parameters(), 0.5)
                losses.append([acc.gather(loss.detach()).mean().item(), float(norm)])
            opt.step()
            sched.step()
            opt.zero_grad()
        if i == 7:
            acc.save_state(str(state_dir))


def _acc_state(acc, model) -> dict:
    sharded = ls.hf.sharded_of(model)
    if sharded is not None:
        return sharded.full_state_dict(rank0_only=False)
    return {k: v.detach().clone() for k, v in acc.unwrap_model(model).state_dict().items()}


def precision(out: Path) -> dict:
    """TrainingArguments(bf16=True) becomes layershard's bf16 compute (no autocast): the plugin's
    dtype, and losses near the fp32 run's."""
    res = {}
    for bf16 in (False, True):
        trainer = ls.hf.Trainer(
            model=llama(), args=args(out / f"bf16-{bf16}", max_steps=4, bf16=bf16),
            train_dataset=sequences(64),
        )  # fmt: skip
        trainer.train()
        mp = trainer.accelerator.layershard.mixed_precision
        x = torch.stack([r["input_ids"] for r in sequences(2, seed=9)])
        with torch.no_grad():
            logits = trainer.model(input_ids=x).logits
        res[str(bf16)] = {
            "logged": logged(trainer),
            "logits_dtype": str(logits.dtype),
            "param_dtype": None if mp is None else str(mp.param_dtype),
            "reduce_dtype": None if mp is None else str(mp.reduce_dtype),
        }
    return res


def flows(out: Path) -> dict:
    """Other ways into the sharded Trainer: evaluate() before train() (the evaluation shards the
    model, the optimizer is then built from its slices) and a second train() on the same
    trainer; and a model the user sharded (ls.shard) passed to ls.hf.Trainer. The reference is
    DDP without the evaluate() first: under DDP that call leaves the model unwrapped for the
    training that follows (accelerate marks it prepared), so each rank would train alone."""
    res: dict = {}
    for impl in ("ddp", "ls"):
        trainer = trainer_class(impl)(
            model=llama(),
            args=args(out / f"flows-{impl}", max_steps=4),
            train_dataset=sequences(64),
            eval_dataset=sequences(8, seed=5),
        )
        if impl == "ls":
            res["eval_first"] = trainer.evaluate()["eval_loss"]
        trainer.train()
        first = logged(trainer)
        trainer.args.max_steps = 8
        trainer.train()
        res[impl] = {"first": first, "second": logged(trainer)}
    trainer = ls.hf.Trainer(
        model=ls.shard(llama()),
        args=args(out / "flows-presharded", max_steps=4),
        train_dataset=sequences(64),
    )
    trainer.train()
    res["presharded"] = logged(trainer)
    return res


def save4(out: Path) -> dict:
    """4 ranks: ls.hf.Trainer writes checkpoint-4 and trains on, uninterrupted, to step 8."""
    d = out / "resume"
    trainer = ls.hf.Trainer(
        model=llama(),
        args=args(d, max_steps=8, warmup_steps=2, save_strategy="steps", save_steps=4),
        train_dataset=sequences(200),
    )
    trainer.train()
    dist.barrier()
    if RANK == 0:  # resume_from_checkpoint=True must pick checkpoint-4
        shutil.rmtree(d / "checkpoint-8")
    return {"logged": logged(trainer), "world": WORLD}


def resume(out: Path) -> dict:
    """2 ranks: resume_from_checkpoint=True from the 4-rank run's checkpoint-4."""
    d = out / "resume"
    files = sorted(os.listdir(d / "checkpoint-4"))
    trainer = ls.hf.Trainer(
        model=llama(),
        args=args(d, max_steps=8, warmup_steps=2, save_strategy="steps", save_steps=4),
        train_dataset=sequences(200),
    )
    trainer.train(resume_from_checkpoint=True)
    return {"logged": logged(trainer), "world": WORLD, "checkpoint_files": files}


def misuse(out: Path) -> dict:
    """Each refusal: its exception type and message (one line), before anything trains."""
    import accelerate
    from accelerate.utils import FullyShardedDataParallelPlugin

    cases = {
        "fsdp": lambda: ls.hf.Trainer(model=llama(), args=args(out / "m", fsdp="full_shard")),
        "deepspeed": lambda: ls.hf.Trainer(
            model=llama(),
            args=_with(args(out / "m"), deepspeed={"zero_optimization": {"stage": 3}}),
        ),  # fmt: skip
        "ddp_wrapped": lambda: ls.hf.Trainer(
            model=torch.nn.parallel.DistributedDataParallel(llama()), args=args(out / "m")
        ),  # fmt: skip
        "fsdp2_wrapped": lambda: ls.hf.Trainer(model=_fully_shard(llama()), args=args(out / "m")),
        "optim": lambda: ls.hf.Trainer(model=llama(), args=args(out / "m", optim="adafactor")),
        "accelerator_fsdp": lambda: ls.hf.Accelerator(
            cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin()
        ),  # fmt: skip
        "precision": lambda: ls.hf.Trainer(
            model=llama(),
            args=args(out / "m", bf16=True),
            layershard=ls.hf.ShardingPlugin(mixed_precision=ls.MixedPrecision(torch.float16)),
        ),  # fmt: skip
        "checkpointing": lambda: ls.hf.Trainer(
            model=llama(),
            args=args(out / "m", gradient_checkpointing=True),
            layershard=ls.hf.ShardingPlugin(activation_checkpointing=1),
        ),  # fmt: skip
        "tp_world": lambda: ls.hf.Trainer(  # 3 does not divide the 2 ranks
            model=llama(), args=args(out / "m"), layershard=ls.hf.ShardingPlugin(tp=3)
        ),  # fmt: skip
        "prepare_ddp": lambda: ls.hf.Accelerator(cpu=True).prepare(
            torch.nn.parallel.DistributedDataParallel(llama())
        ),  # fmt: skip
    }
    res = {}
    for name, make in cases.items():
        try:
            make()
            res[name] = None
        except Exception as e:  # noqa: BLE001 - the message is what the test checks
            res[name] = [type(e).__name__, str(e)]
    del accelerate
    return res


def _with(a, **kw):
    for k, v in kw.items():  # TrainingArguments(deepspeed=...) would import deepspeed first
        setattr(a, k, v)
    return a


def _fully_shard(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def calibrate(out: Path) -> dict:
    """How far DDP (``main``) lands from one process (``single``) in the parity runs."""
    main, single = (
        json.loads((out / f"{j}.json").read_text())["parity"] for j in ("main", "single")
    )
    res = {}
    for name in ("llama", "llama-gc", "gpt2"):
        a, b = main[f"{name}/ddp"]["logged"], single[f"{name}/ddp"]["logged"]
        res[name] = {
            "loss_rel": max(abs(x[1] - y[1]) / abs(y[1]) for x, y in zip(a, b)),
            "grad_norm_rel": max(abs(x[2] - y[2]) / abs(y[2]) for x, y in zip(a, b)),
            "param_abs": max_param_diff(
                torch.load(out / f"final-{name}-ws2.pt"), torch.load(out / f"final-{name}-ws1.pt")
            ),
        }
    print(json.dumps(res, indent=1))
    return res


JOBS = {
    "main": [
        parity,
        lora,
        sft,
        dpo,
        generate,
        accelerate_loop,
        resume,
        precision,
        flows,
        misuse,
        expert_parallel,
        tensor_parallel,
    ],  # fmt: skip
    "save4": [save4],
    "single": [parity],
    "calibrate": [calibrate],
}


def run_sections(sections, out: Path, result: Path | None) -> None:
    """Run each section (a function of ``out``) on this rank, an error reported in its place;
    rank 0 writes the results to ``result`` (if any); then leave as our spawned ranks do."""
    torch.set_num_threads(1)
    die_with_launcher()
    res: dict = {}
    for section in sections:
        try:
            res[section.__name__] = section(out)
        except Exception:  # noqa: BLE001 - reported to the test that reads this section
            res[section.__name__] = {"error": traceback.format_exc()}
            print(res[section.__name__]["error"], file=sys.stderr)
    if RANK == 0 and result is not None:
        result.write_text(json.dumps(res, indent=1, default=str))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's static destructors have aborted finished ranks (see tests/_dist.py)


def main() -> None:
    job, out = sys.argv[1], Path(sys.argv[2])
    only = set(sys.argv[3].split(",")) if len(sys.argv) > 3 else None
    sections = [s for s in JOBS[job] if not only or s.__name__ in only]
    run_sections(sections, out, None if job == "calibrate" else out / f"{job}.json")


if __name__ == "__main__":
    main()
