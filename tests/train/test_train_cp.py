"""`layershard train --cp N --cp-mode ring|all_to_all`: context parallelism in the training
command (the built-in presets and a transformers config; docs/context-parallel.md,
train/parallel.py, loop/context.py).

The whole runs (slow): on SFT data (prompt tokens masked, so the micro-batches' target counts
differ and the step's weighting by them is exercised), 2 micro-batches a step, CP on 2 ranks
(one CP group: the data split over world / cp = 1 rank) against the non-CP twin on 1 rank, the
same global batch: each step's loss, the validation loss, the first gradient norm. Each CP run
is half of a run resumed across cp sizes: cp 2 (all_to_all) checkpointed at step 3 and resumed
under cp 1, and cp 1 resumed under cp 2 (ring), which then evaluates, samples and exports under
CP. Five launches in all, made once (a module fixture).

The fast ones: the one-line refusals before launch, the next-token logits of the sample and the
training forward's loss under CP against one process (2 spawned ranks, both modes, lengths that
need padding), and the pure rules (the data split, the gradient accumulation, a resume's --cp 1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from _dist import run_ranks
from _parity import LOSS_RTOL
from _train import refused_one_line, train_main

from layershard.train.loop.report import read_metrics

STEPS, STOP = 6, 3
SMALL = ["--model-override", "dim=64", "--model-override", "n_layers=2",
         "--model-override", "ffn_dim=128"]  # fmt: skip
# Tolerance of a CP run's numbers against its non-CP twin's: CP computes the same math in
# another order of its fp32 sums (attention merged by log-sum-exp over the ring's blocks, or
# whole sequences per head group after an all-to-all; each gradient the sum of the cp ranks'
# parts), as tests/parallel/test_context_parallel_model.py measures against one process. A
# step's loss, a validation loss and a gradient norm are scalars reduced over the whole batch:
# held to _parity.LOSS_RTOL (1e-5 relative, ~84 fp32 eps; its reasoning there). Measured
# 2026-11-29 (torch 2.13, this machine, two runs of the module): losses at most 4.5e-7,
# validation losses 3.9e-7, first gradient norms 9.4e-8, the exports' losses 4.0e-7. Later
# gradient norms are not held: they follow the weights, whose last-bit differences AdamW
# amplifies (up to 7.8e-6 at step 6 here, too close to the bound for a scalar test). A wrong
# weighting is far outside: a CP step that weights each micro-batch by a rank's own target count
# instead of the group's (fault injected) misses by 3.4e-2 to 1.2e-1 in the loss and 4.4e-2 to
# 1.1e-1 in the gradient norm; one that weights the micro-batches equally, by 1.4e-4 to 1.2e-3
# on this data (the final weights on the run's 6 steps' batches).
RTOL = LOSS_RTOL


def _chat(path: Path) -> Path:
    """Prompts and responses of uneven lengths: the windows' target counts vary (masked
    prompts), and so do the micro-batches' means."""
    rows = []
    for i in range(120):
        a, b = i % 10, (i * 7) % 10
        ask = f"What is {a} plus {b}?" + " Answer in words, please." * (i % 4)
        answer = f"{a} plus {b} is {a + b}." + f" So {a + b} it is." * ((i * 3) % 5)
        rows.append({"prompt": ask, "response": answer})
        rows.append({"messages": [{"role": "user", "content": f"Say {a} twice."},
                                  {"role": "assistant", "content": f"{a} {a}"}]})  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _base(data: Path) -> list[str]:
    return [
        "--task", "sft", "--data", str(data), "--max-files", "1", "--val-fraction", "0.2",
        "--vocab-size", "512", "--seq-len", "64", "--micro-batch", "2", "--grad-accum", "2",
        "--lr", "3e-3", "--warmup-steps", "2", "--steps", str(STEPS), "--eval-interval", "3",
        "--eval-sequences", "8", "--sample-tokens", "6", "--report-to", "none", *SMALL,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cp")
    base = _base(_chat(root / "chat.jsonl"))
    one, two = ["--nproc-per-node", "1"], ["--nproc-per-node", "2"]
    out = {name: root / name for name in ("ref", "a2a", "ring")}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LAYERSHARD_CACHE", str(root / "ls-cache"))
        # the non-CP twin, uninterrupted
        assert train_main([*base, *one, "--run-dir", str(out["ref"])]) == 0
        # cp 2 (all_to_all) to step 3, resumed under cp 1 on one rank (its cp_mode dropped)
        a2a = [*base, "--run-dir", str(out["a2a"])]
        cp2 = ["--cp", "2", "--cp-mode", "all_to_all"]
        assert train_main([*a2a, *two, *cp2, "--stop-at-step", str(STOP)]) == 0
        assert train_main([*a2a, *one, "--resume", "--cp", "1"]) == 0
        # cp 1 to step 3, resumed under cp 2 (ring): evaluation, sample, export under CP
        ring = [*base, "--run-dir", str(out["ring"])]
        assert train_main([*ring, *one, "--stop-at-step", str(STOP)]) == 0
        assert train_main([*ring, *two, "--resume", "--cp", "2"]) == 0
    return out


def _metric(run: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(run / "metrics.jsonl") if key in r}


def _worst(run: Path, ref: Path, key: str, steps) -> float:
    a, b = _metric(run, key), _metric(ref, key)
    return max(abs(a[s] - b[s]) / abs(b[s]) for s in steps)


@pytest.mark.slow
def test_a_cp_run_equals_its_non_cp_twin(runs):
    ref = runs["ref"]
    assert sorted(_metric(ref, "loss")) == list(range(1, STEPS + 1))
    first, last = range(1, STOP + 1), range(STOP + 1, STEPS + 1)
    # each run's CP part: its losses and validation losses; the gradient norm of its first step,
    # taken where the weights are still the twin's to the bit (the cp 1 parts on one rank are
    # the twin's very computation), so that only CP's order of the sums differs
    for run, steps, val_steps, pure in ((runs["a2a"], first, (0, STOP), 1),
                                        (runs["ring"], last, (STEPS,), STOP + 1)):  # fmt: skip
        assert _worst(run, ref, "loss", steps) <= RTOL, run.name
        assert _worst(run, ref, "val_loss", val_steps) <= RTOL, run.name
        assert _worst(run, ref, "grad_norm", (pure,)) <= RTOL, run.name
    assert _worst(runs["ring"], ref, "loss", first) == 0.0  # (the cp 1 part: bitwise)
    losses = _metric(ref, "loss")
    assert losses[STEPS] < losses[1] - 0.5  # and it learned
    # a CP group reads one batch: the data is split over world / cp ranks, not world
    recorded = yaml.safe_load((runs["ring"] / "config.yaml").read_text())
    assert recorded["cp"] == 2 and recorded["cp_mode"] == "ring"
    assert recorded["_resolved"]["tokens_per_step"] == 64 * 2 * 2  # seq x micro x accum x 1
    summary = json.loads((runs["ring"] / "summary.json").read_text())
    assert summary["tokens_per_step"] == 64 * 2 * 2 and summary["world_size"] == 2


@pytest.mark.slow
def test_a_checkpoint_resumes_across_cp_sizes(runs):
    ref, last = runs["ref"], range(STOP + 1, STEPS + 1)
    # cp 2 -> cp 1: the a2a run's second part; cp 1 -> cp 2: the ring run's (above)
    run = runs["a2a"]
    assert sorted(_metric(run, "loss")) == list(range(1, STEPS + 1))
    assert _worst(run, ref, "loss", last) <= RTOL
    assert _worst(run, ref, "val_loss", (STEPS,)) <= RTOL
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    # --cp 1 dropped the run's all_to_all (a mode without cp is refused)
    assert recorded["cp"] == 1 and recorded["cp_mode"] == "ring"
    assert recorded["_resolved"]["world_size"] == 1


@pytest.mark.slow
def test_sample_and_export_under_cp(runs):
    transformers = pytest.importorskip("transformers")
    from layershard.train.data.batches import TokenSplit, read_windows

    run, ref = runs["ring"], runs["ref"]
    text = (run / "sample.txt").read_text()
    assert text.startswith("def ") and len(text) > len("def "), text
    # the export is the trained model whatever the layout: its loss on validation windows is
    # the twin's export's (a scalar over a batch: RTOL), and below the untrained model's
    split = json.loads((ref / "launch.json").read_text())["data"]["val"]
    tokens, mask = TokenSplit.from_dict(split).open()
    x, y = read_windows(tokens, mask, torch.arange(4).numpy(), 64)
    with torch.no_grad():
        ours, theirs = (
            transformers.AutoModelForCausalLM.from_pretrained(str(r / "final"))(x, labels=y).loss
            for r in (run, ref)
        )
    assert abs(ours.item() - theirs.item()) <= RTOL * theirs.item(), (ours, theirs)
    assert ours.item() < _metric(ref, "val_loss")[0] - 0.5


# ---- fast ----------------------------------------------------------------------------------


def _next_token(rank: int, world: int) -> None:
    """The sample's next-token logits and the training forward's loss under CP (both modes),
    against one process on the same whole sequences."""
    import torch.distributed as dist
    from _parity import clone, tiny_llama

    import layershard as ls
    from layershard.train.loop.context import model_inputs, next_token_logits

    g = torch.Generator().manual_seed(3)
    for mode in ("ring", "all_to_all"):
        base = tiny_llama(max_seq_len=16)
        model = ls.parallelize(clone(base), cp=2, cp_mode=mode)
        model.eval()
        with torch.no_grad():
            for t in (1, 3, 4, 7, 16):  # padded to a multiple of 2 x cp = 4, or not
                ids = torch.randint(0, 96, (1, t), generator=g)
                got, want = next_token_logits(model, ids), base(ids).logits[0, -1]
                err = ((got - want).abs().max() / want.abs().max()).item()
                assert err <= 1e-5, (mode, t, err)
            x = torch.randint(0, 96, (2, 16), generator=g)
            y = x.masked_fill(torch.rand(2, 16, generator=g) < 0.5, -100)
            loss = model(**model_inputs(model, x, y, lambda t: t)).loss.detach()
            dist.all_reduce(loss)  # the mean over the world of the ranks' losses (one group)
            want_loss = base(x, labels=y).loss
            assert abs(loss.item() / world - want_loss.item()) <= 1e-5 * want_loss.item()
        assert model_inputs(base, x, y, lambda t: t).keys() == {"input_ids", "labels"}


def test_next_token_logits_under_cp_equal_one_process():
    run_ranks(_next_token, 2)


def test_cp_combinations_that_cannot_run_are_refused_before_launch(tmp_path, capsys, monkeypatch):
    from _train import TINY

    monkeypatch.setenv("LAYERSHARD_CACHE", str(tmp_path / "cache"))
    odd_heads = ["--model-override", "n_heads=1", "--model-override", "n_kv_heads=1"]
    cases = (
        (["--cp", "2", "--seq-len", "66"], "seq_len 66 must be divisible by 2 x cp = 4"),
        (["--cp", "4"], "cp 4 must divide the world size 2"),
        (["--cp", "2", "--strategy", "hybrid", "--shard-size", "1"],
         "cp 2 must divide the ranks of a replica (1"),
        (["--cp", "2", "--tp", "2"], "cp x tp 4 must divide the world size 2"),
        (["--cp", "2", "--model", "moe", "--ep", "4"], "ep 4 must divide the world size 2"),
        (["--cp", "2", "--qlora", "--init-from", "hf"], "cp 2 is not supported with --qlora"),
        (["--cp", "2", "--hf-config", str(_hf(tmp_path, "MistralConfig", sliding_window=32))],
         "the model's sliding window (32) is shorter than seq_len 64"),
        (["--cp", "2", "--hf-config", str(_hf(tmp_path, "Qwen3MoeConfig", num_experts=4))],
         "cp 2 is not supported with a transformers mixture of experts"),
        (["--cp", "2", "--hf-config", str(_hf(tmp_path, "Gemma2Config"))],
         "attention logit softcapping is not supported"),
        (["--cp", "2", "--cp-mode", "all_to_all", *odd_heads],
         "--cp 2 must divide the model's n_heads=1"),
        (["--cp-mode", "all_to_all"], "cp_mode all_to_all applies to context parallelism"),
    )  # fmt: skip
    for flags, expected in cases:
        assert expected in refused_one_line(capsys, tmp_path, *TINY, *flags), flags


def _hf(tmp_path: Path, cls: str, **overrides) -> Path:
    """A tiny transformers config of class ``cls`` saved in its own folder (for --hf-config)."""
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    folder = tmp_path / f"{cls}-{len(overrides)}"
    getattr(transformers, cls)(**{**common, **overrides}).save_pretrained(str(folder))
    return folder


@pytest.mark.slow
def test_a_transformers_model_trains_under_cp_as_its_non_cp_twin(tmp_path, monkeypatch):
    """``--hf-config`` (a Qwen3: q/k norms, GQA) with ``--cp 2`` (the ring, 2 ranks) and with
    ``--tp 2 --cp 2`` (all-to-all, 4 ranks: each TP rank's 2 heads over the CP group of its TP
    coordinate) against the same run on 1 rank: each step's loss, the validation losses, the
    first gradient norm. Measured 2026-11-29: losses within 2.7e-7 (tp x cp, built-in preset:
    likewise), held to RTOL."""
    monkeypatch.setenv("LAYERSHARD_CACHE", str(tmp_path / "ls-cache"))
    hf = _hf(tmp_path, "Qwen3Config", head_dim=16)
    base = [*_base(_chat(tmp_path / "chat.jsonl")), "--hf-config", str(hf)]
    ref = tmp_path / "ref"
    assert train_main([*base, "--nproc-per-node", "1", "--run-dir", str(ref)]) == 0
    layouts = {
        "cp": ["--nproc-per-node", "2", "--cp", "2"],
        "tp_cp": ["--nproc-per-node", "4", "--tp", "2", "--cp", "2", "--cp-mode", "all_to_all"],
    }
    for name, flags in layouts.items():
        assert train_main([*base, *flags, "--run-dir", str(tmp_path / name)]) == 0
        run = tmp_path / name
        assert _worst(run, ref, "loss", range(1, STEPS + 1)) <= RTOL, name
        assert _worst(run, ref, "val_loss", (0, STOP, STEPS)) <= RTOL, name
        assert _worst(run, ref, "grad_norm", (1,)) <= RTOL, name
    losses = _metric(ref, "loss")
    assert losses[STEPS] < losses[1] - 0.5  # and it learned


@pytest.mark.slow
def test_a_mixture_of_experts_trains_under_cp_and_ep_as_its_non_cp_twin(tmp_path, monkeypatch):
    """The built-in MoE with ``--cp 2 --ep 2`` on 2 ranks (its balance loss pooled over the CP
    group, its tokens to the experts by EP's all-to-all) against the same run on 1 rank.
    Measured 2026-11-29: losses within 1.1e-7, gradient norms within 2.2e-7."""
    monkeypatch.setenv("LAYERSHARD_CACHE", str(tmp_path / "ls-cache"))
    base = [*_base(_chat(tmp_path / "chat.jsonl")), "--model", "moe",
            "--model-override", "n_heads=4"]  # fmt: skip
    ref, run = tmp_path / "ref", tmp_path / "cp_ep"
    assert train_main([*base, "--nproc-per-node", "1", "--run-dir", str(ref)]) == 0
    flags = ["--nproc-per-node", "2", "--cp", "2", "--ep", "2", "--run-dir", str(run)]
    assert train_main([*base, *flags]) == 0
    assert _worst(run, ref, "loss", range(1, STEPS + 1)) <= RTOL
    assert _worst(run, ref, "val_loss", (0, STOP, STEPS)) <= RTOL
    assert _worst(run, ref, "grad_norm", (1,)) <= RTOL


def test_the_data_is_split_over_world_over_cp():
    from layershard.train.config import grad_accum_for, resolve
    from layershard.train.parallel import data_rank

    cfg = resolve({"cp": 2, "seq_len": 64, "micro_batch": 2, "batch_tokens": 64 * 2 * 2 * 3})
    # 4 ranks: CP groups {0, 1}, {2, 3} read micro-batches 0 and 1 of 2
    assert [data_rank(cfg, r, 4) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert grad_accum_for(cfg, 4) == 3  # the batch over 2 data-parallel ranks, not 4
    # cp 2 x tp 2 on 8 ranks: blocks {0..3}, {4..7} (meshes.context_group) read micro-batches 0, 1
    both = resolve({"cp": 2, "tp": 2, "seq_len": 64, "micro_batch": 2,
                    "batch_tokens": 64 * 2 * 2 * 3})  # fmt: skip
    assert [data_rank(both, r, 8)[0] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert grad_accum_for(both, 8) == 3


def test_resume_with_cp_1_drops_the_cp_mode():
    from layershard.train.config import resume_layers

    recorded = {"cp": 2, "cp_mode": "all_to_all"}
    notes = resume_layers(recorded, {}, {"cp": 1})
    assert recorded == {"cp": 2} and notes == [
        "--cp 1: the run's cp_mode all_to_all (of context parallelism) is dropped"
    ]
    recorded = {"cp": 2, "cp_mode": "all_to_all"}
    assert resume_layers(recorded, {}, {"cp": 4}) == [] and recorded["cp_mode"] == "all_to_all"
