"""``ls.hf.Trainer`` with ``ShardingPlugin(cp=2)`` (context parallelism) against the same Trainer
without it, at 2 gloo ranks, on the same global batches: a tiny transformers Llama (hidden 64, 4
heads, 2 kv heads, 2 layers), gradient accumulation 2, clipping, AdamW.

The reference is ``ShardingPlugin()`` (plain data-parallel sharding over the 2 ranks, each
reading half of each global batch: the DDP-equivalent run that tests/hf/test_hf_trainer.py holds
to DDP). The CP runs read each whole global batch on both ranks (the data loaders split over
world / cp = 1 data rank) and split every sequence over the two. Each sequence's first
``prompt`` labels are -100, a different number per sequence, so that the global mean over
targets differs from a mean of per-micro-batch or per-rank means: a wrong ``num_items_in_batch``
(the CP ranks' double count, or none) shows in the losses at once. Packed rows
(``DataCollatorWithFlattening``: each micro-batch's documents in one row, its length not a
multiple of 2 x cp, so that ``compute_loss`` pads it) are held to the reference that packs the
same way.

Tolerances, those of the CP tests (tests/parallel/test_context_parallel_hf.py) and of
test_hf_trainer.py, for the same reason: CP computes the same math in another order of its fp32
sums (softmaxes merged by log-sum-exp, the weights' gradients summed over the CP ranks). Measured
2026-11-29 (torch 2.13 CPU, transformers 5.24), every run here: logged losses within 1.04e-7
(relative), gradient norms within 1.15e-7, final weights within 1.19e-7 (absolute, AdamW eps
below): held to
_parity.LOSS_RTOL (1e-5), GRAD_NORM_RTOL and PARAM_TOL (test_hf_trainer.py's 1e-5 and 1e-4).
A normalization error is a factor (the world, cp, or the micro-batches' targets), 1e-2 or more.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _dist import run_ranks
from _parity import LOSS_RTOL

pytest.importorskip("transformers")

GRAD_NORM_RTOL = 1e-5
PARAM_TOL = 1e-4
V, SEQ, N_SEQ, STEPS = 96, 32, 32, 4
# AdamW's eps: Adam divides each gradient entry by its own magnitude, so an entry near zero whose
# last bits differ (CP sums in another order) moves by up to the learning rate either way; with
# the default 1e-8 three of layer 0's MLP entries ended 1.0e-4 apart (ring) while every loss
# and norm agreed to 1e-7. 1e-3 bounds that amplification to lr / eps per unit of gradient
# error and still normalizes the gradients here (their entries are 1e-3 to 1e-1).
ADAM_EPS = 1e-3


def _dataset(packed: bool) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(N_SEQ):
        n = SEQ - 2 * (i % 5) if packed else SEQ  # packed rows of any length, not a multiple of 4
        ids = torch.randint(1, V, (n,), generator=g)
        labels = ids.clone()
        labels[: int(torch.randint(1, n // 2, (1,), generator=g))] = -100  # a prompt
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def _train(world: int, out: Path, cp: int, mode: str, packed: bool, tp: int = 1) -> dict:
    import torch
    import transformers as T

    import layershard as ls

    torch.manual_seed(0)  # every rank builds the same model
    cfg = T.LlamaConfig(
        vocab_size=V, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, intermediate_size=128, max_position_embeddings=2 * SEQ,
    )  # fmt: skip
    model = T.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    data = _dataset(packed)
    collator = T.DataCollatorWithFlattening() if packed else T.default_data_collator
    per_rank = 8 // (2 * (world // (cp * tp)))  # 8 sequences per optimizer step: accumulation 2
    args = T.TrainingArguments(
        output_dir=str(out / f"cp{cp}-tp{tp}-{mode}-{packed}"), use_cpu=True, ddp_backend="gloo",
        report_to=[], per_device_train_batch_size=per_rank, gradient_accumulation_steps=2,
        max_steps=STEPS, learning_rate=1e-2, adam_epsilon=ADAM_EPS, lr_scheduler_type="constant", max_grad_norm=0.5,
        logging_steps=1, save_strategy="no", seed=0, data_seed=0, disable_tqdm=True,
        log_level="error", dataloader_num_workers=0, remove_unused_columns=False,
    )  # fmt: skip
    trainer = ls.hf.Trainer(
        model=model, args=args, train_dataset=data, data_collator=collator,
        eval_dataset=_eval_dataset(), layershard=ls.hf.ShardingPlugin(cp=cp, cp_mode=mode, tp=tp),
    )  # fmt: skip
    trainer.train()
    evaluated = trainer.evaluate()["eval_loss"]
    if (
        cp > 1 and not packed and mode == "ring" and tp == 1
    ):  # what evaluation under cp does not give
        with pytest.raises(ValueError, match=r"predict\(\) under ShardingPlugin\(cp=2\)"):
            trainer.predict(_eval_dataset())
        trainer.compute_metrics = lambda p: {}
        with pytest.raises(ValueError, match=r"compute_metrics with ShardingPlugin\(cp=2\)"):
            trainer.evaluate()
    sharded = ls.hf.sharded_of(trainer.model_wrapped) or ls.hf.sharded_of(trainer.model)
    assert sharded is not None
    if cp > 1:
        assert model.config._attn_implementation == "layershard_cp"
        assert trainer.get_cp_size() == cp
    logged = [
        [h["step"], h["loss"], h["grad_norm"]] for h in trainer.state.log_history if "loss" in h
    ]
    state = sharded.full_state_dict(rank0_only=False)
    return {"logged": logged, "state": state, "eval_loss": evaluated}


def _eval_dataset() -> list[dict]:
    """16 whole sequences, every label a target: each batch's mean over its targets weighs every
    token alike, so the mean over batches is the same whatever the batching (under cp a CP
    group reads what 2 data-parallel ranks read without it)."""
    import torch

    g = torch.Generator().manual_seed(2)
    rows = torch.randint(1, V, (16, SEQ), generator=g)
    return [{"input_ids": r.tolist(), "labels": r.tolist()} for r in rows]


def _rank(rank: int, world: int, out: str) -> None:
    """2 ranks: cp 2 in each mode, plain rows and packed (ring); 4 ranks: tp 2 x cp 2
    (all-to-all, the model's base_model_tp_plan), plain rows."""
    res: dict = {}
    cases = [(False, "ring"), (False, "all_to_all"), (True, "ring")]
    if world == 4:
        cases = [(False, "all_to_all")]
    refs = {packed: _train(world, Path(out), 1, "ring", packed) for packed in {p for p, _ in cases}}
    for packed, mode in cases:
        ref = refs[packed]
        run = _train(world, Path(out), 2, mode, packed, tp=world // 2)
        diff = max((run["state"][k] - ref["state"][k]).abs().max().item() for k in ref["state"])
        res[f"{mode}-{packed}"] = {
            "ref": ref["logged"],
            "cp": run["logged"],
            "param_diff": diff,
            "eval": [ref["eval_loss"], run["eval_loss"]],
        }
    if rank == 0:
        Path(out, "res.json").write_text(json.dumps(res))


@pytest.mark.slow
def test_trainer_with_context_parallelism_matches_plain_sharding(tmp_path: Path) -> None:
    """ShardingPlugin(cp=2), ring and all-to-all, plain rows and packed (ring), against
    ShardingPlugin() on the same global batches: each step's logged loss and gradient norm,
    the final weights, and evaluate()'s loss (predict() and compute_metrics refused)."""
    run_ranks(_rank, 2, str(tmp_path))
    res = json.loads((tmp_path / "res.json").read_text())
    assert sorted(res) == ["all_to_all-False", "ring-False", "ring-True"]
    _check(res)


@pytest.mark.slow
def test_trainer_with_tp_and_cp_matches_plain_sharding(tmp_path: Path) -> None:
    """ShardingPlugin(tp=2, cp=2, cp_mode="all_to_all") on 4 ranks (a block of 4 reads each
    batch; each rank attends with its TP rank's heads over the CP group of its TP coordinate)
    against ShardingPlugin() on the same 4 ranks and global batches."""
    run_ranks(_rank, 4, str(tmp_path))
    res = json.loads((tmp_path / "res.json").read_text())
    assert sorted(res) == ["all_to_all-False"]
    _check(res)


def _check(res: dict) -> None:
    for name, r in res.items():
        ref, cp = r["ref"], r["cp"]
        assert [x[0] for x in cp] == [x[0] for x in ref] == list(range(1, STEPS + 1)), name
        loss = max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(cp, ref))
        norm = max(abs(a[2] - b[2]) / abs(b[2]) for a, b in zip(cp, ref))
        print(f"{name}: loss {loss:.2e}, grad norm {norm:.2e}, weights {r['param_diff']:.2e}")
        assert loss < LOSS_RTOL, (name, cp, ref)
        assert norm < GRAD_NORM_RTOL, name
        assert r["param_diff"] < PARAM_TOL, name
        # evaluate(): the loss of the trained model on the evaluation set, as without cp
        ev = abs(r["eval"][1] - r["eval"][0]) / r["eval"][0]
        print(f"{name}: eval loss {ev:.2e} {r['eval']}")
        assert ev < LOSS_RTOL, (name, r["eval"])
        # the run exercises what it claims: the clip (max_grad_norm 0.5) is active; the data are
        # random tokens, whose loss does not fall in 4 steps, but each step's differs
        assert max(x[2] for x in ref) > 0.5, name
        assert len({round(x[1], 4) for x in ref}) == STEPS, name


def _sft(world: int, out: Path, cp: int, mode: str) -> dict:
    """TRL's SFTTrainer (its fused LM head, loss on completions only) sharded by layershard,
    with ``ShardingPlugin(cp=cp)``; the logged losses and gradient norms, the final weights."""
    import torch
    from _hf_script import chat_tokenizer, completions, llama
    from trl import SFTConfig, SFTTrainer

    import layershard as ls

    tok = chat_tokenizer()
    model = llama(vocab_size=len(tok), pad_token_id=0, eos_token_id=1)
    per_rank = 8 // (2 * (world // cp))  # 8 sequences per optimizer step: accumulation 2
    args = SFTConfig(
        output_dir=str(out / f"sft-cp{cp}-{mode}"), use_cpu=True, ddp_backend="gloo",
        report_to=[], per_device_train_batch_size=per_rank, gradient_accumulation_steps=2,
        max_steps=STEPS, learning_rate=1e-2, adam_epsilon=ADAM_EPS,
        lr_scheduler_type="constant", max_grad_norm=0.5, logging_steps=1, save_strategy="no",
        seed=0, data_seed=0, disable_tqdm=True, log_level="error", dataloader_num_workers=0,
        bf16=False, gradient_checkpointing=False, max_length=32, completion_only_loss=True,
    )  # fmt: skip
    trainer = ls.hf.sharded(SFTTrainer)(
        model=model, args=args, train_dataset=completions(64), processing_class=tok,
        layershard=ls.hf.ShardingPlugin(cp=cp, cp_mode=mode),
    )  # fmt: skip
    trainer.train()
    sharded = ls.hf.sharded_of(trainer.model_wrapped) or ls.hf.sharded_of(trainer.model)
    if cp > 1:  # the run is what it claims: attention over the CP group in this mode
        assert trainer.get_cp_size() == cp
        assert model.config._attn_implementation == "layershard_cp"
        ctx = sharded.module.context_parallel
        assert ctx.mode == mode and ctx.size == cp
    logged = [
        [h["step"], h["loss"], h["grad_norm"]] for h in trainer.state.log_history if "loss" in h
    ]
    torch.manual_seed(0)
    return {"logged": logged, "state": sharded.full_state_dict(rank0_only=False)}


def _sft_rank(rank: int, world: int, out: str) -> None:
    ref = _sft(world, Path(out), 1, "ring")
    res = {}
    for mode in ("ring", "all_to_all"):
        run = _sft(world, Path(out), 2, mode)
        diff = max((run["state"][k] - ref["state"][k]).abs().max().item() for k in ref["state"])
        res[mode] = {"ref": ref["logged"], "cp": run["logged"], "param_diff": diff}
    if rank == 0:
        Path(out, "sft.json").write_text(json.dumps(res))


@pytest.mark.slow
def test_trl_sft_trainer_with_context_parallelism_matches_plain_sharding(tmp_path: Path) -> None:
    """``ls.hf.sharded(trl.SFTTrainer)`` with ShardingPlugin(cp=2), ring and all-to-all, against
    ShardingPlugin() on the same global batches: TRL's fused LM head scores the pre-shifted
    labels of each rank's part of the sequences (completion-only loss, padded rows)."""
    pytest.importorskip("trl")
    run_ranks(_sft_rank, 2, str(tmp_path))
    res = json.loads((tmp_path / "sft.json").read_text())
    for name, r in res.items():
        ref, cp = r["ref"], r["cp"]
        assert [x[0] for x in cp] == [x[0] for x in ref] == list(range(1, STEPS + 1)), name
        loss = max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(cp, ref))
        norm = max(abs(a[2] - b[2]) / abs(b[2]) for a, b in zip(cp, ref))
        print(f"sft {name}: loss {loss:.2e}, grad norm {norm:.2e}, weights {r['param_diff']:.2e}")
        assert loss < LOSS_RTOL, (name, cp, ref)
        assert norm < GRAD_NORM_RTOL, name
        assert r["param_diff"] < PARAM_TOL, name


def test_what_trainer_does_not_run_under_cp_is_refused_at_construction(tmp_path: Path) -> None:
    """One line each, before the model is touched: label smoothing, and a
    ``compute_loss`` of a class other than Trainer's and TRL's SFTTrainer's (a subclass
    override; TRL's DPOTrainer)."""
    import transformers as T

    import layershard as ls

    cfg = T.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = T.LlamaForCausalLM(cfg)

    class Own(ls.hf.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    cases = [
        (ls.hf.Trainer, dict(label_smoothing_factor=0.1), "label_smoothing_factor with"),
        (Own, {}, "SFTTrainer's compute_loss on each rank's part of the sequences; Own overrides"),
    ]
    for cls, kw, match in cases:
        args = T.TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], **kw)
        with pytest.raises(ValueError, match=match) as e:
            cls(model=model, args=args, layershard=ls.hf.ShardingPlugin(cp=2))
        assert "\n" not in str(e.value)
    trl = pytest.importorskip("trl")
    from layershard.hf.trainer import _context_loss_owners

    assert trl.SFTTrainer in _context_loss_owners() and trl.DPOTrainer not in _context_loss_owners()
