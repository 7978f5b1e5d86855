"""The plan's TP and EP rows (issue 32, plan/parallel.py): memory per rank against hand-computed
numbers for toy shapes whose every parameter and shard is a multiple of 8 (no alignment gaps,
no padding), the all-to-all and TP all-reduce bytes, tp = ep = 1 rows equal to the 1-D rows,
transformers MoE configs, and one-line refusals."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from layershard.cli import main
from layershard.plan import Cluster, ModelShape, Settings, get_gpu, make_plan, suggest
from layershard.plan.memory import predict_activations, predict_memory
from layershard.plan.parallel import (
    Mesh,
    check_mesh,
    mesh_candidates,
    predict_mesh_activations,
    predict_mesh_memory,
)
from layershard.plan.steptime import predict_time
from layershard.plan.timing import a2a_bytes

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "plan" / "parallel"

# d 64, 4 heads of 16, 2 KV heads, MLP 128, vocab 256, 2 layers
DENSE = ModelShape(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                   max_seq_len=64, name="toy")  # fmt: skip
# the same attention, 8 experts of 32, top-2
MOE = replace(DENSE, ffn_dim=0, n_experts=8, top_k=2, moe_ffn_dim=32, name="toy-moe")
H100 = get_gpu("h100")


def _split_and_copied(shape: ModelShape) -> tuple[int, int, int]:
    """(weights TP splits, weights every TP rank holds whole, expert weights) of the model."""
    d, h, kv, hd, L, V = shape.dim, shape.n_heads, shape.n_kv_heads, shape.hd, shape.n_layers, shape.vocab_size  # fmt: skip
    attn = 2 * d * h * hd + 2 * d * kv * hd
    mlp = 0 if shape.moe else 3 * d * shape.ffn_dim
    copied = L * (2 * d + shape.n_experts * d) + d  # norms, router; the final norm
    experts = L * shape.n_experts * 3 * d * shape.moe_ffn_dim
    return L * (attn + mlp) + 2 * V * d, copied, experts


@pytest.mark.parametrize("tp", [1, 2])
def test_dense_state_is_one_over_dp_shard_times_tp(tp):
    mesh = Mesh(8, tp)
    split, copied, _ = _split_and_copied(DENSE)
    per_rank = split // (mesh.dp_shard * tp) + copied // mesh.dp_shard
    mem = predict_mesh_memory(DENSE, mesh, "bf16", "fp32", "adamw")
    assert mem["params"] == mem["grads"] == 4 * per_rank
    # AdamW: 8 B per element + a 4-byte step per parameter tensor (9 a block, embed, norm, head)
    assert mem["optimizer"] == 8 * per_rank + 4 * (9 * 2 + 3)
    # by hand for tp 2: a block's local shard (64 + 2048 + 1024 + 1024 + 2048 + 64 + 3 x 4096)
    # / 4, the embedding's and the head's 128 x 64 / 4, the final norm's 64 / 4
    if tp == 2:
        assert per_rank == 2 * 18560 // 4 + 2 * 2048 + 16 == 13392


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 4), (1, 8), (2, 1)])
def test_expert_state_is_one_over_efsdp_times_ep(tp, ep):
    mesh = Mesh(8, tp, ep)
    split, copied, experts = _split_and_copied(MOE)
    dense = split // (mesh.dp_shard * tp) + copied // mesh.dp_shard
    expert = experts // (mesh.efsdp * ep)
    mem = predict_mesh_memory(MOE, mesh, "bf16", "fp32", "adamw")
    assert mem["params"] == 4 * (dense + expert)
    assert mem["grads"] == 4 * (dense + expert)
    # both are 1/world of their kind here: 6144 expert elements per layer per rank
    assert expert == 2 * 6144
    # each layer's E/ep experts: two gather slots (bf16) and two gradient slots (fp32) of them
    one_layer = (MOE.n_experts // ep) * 3 * MOE.dim * MOE.moe_ffn_dim
    dense_mem = predict_memory(
        replace(MOE, n_heads=4 // tp, n_kv_heads=2 // tp, head_dim=16, vocab_size=256 // tp,
                experts_apart=True), mesh.dp_shard,
    )  # fmt: skip
    assert mem["gather_buffers"] == dense_mem["gather_buffers"] + 2 * 2 * one_layer
    assert mem["grad_buffers"] == dense_mem["grad_buffers"] + 2 * 4 * one_layer
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")


def test_tp_activations_and_logits_shrink():
    full = predict_activations(DENSE, 2, 16)
    half = predict_mesh_activations(DENSE, Mesh(8, 2), 2, 16)
    assert half["logits"] == full["logits"] // 2  # vocabulary-parallel loss
    # per token and layer, bf16: 2 c (h + kv) hd and 4 c f halve, 4 c d does not
    c, T, L = 2, 32, 2
    saved = c * (2 * (4 + 2) * 16 + 4 * 128) // 2 + 4 * 4 // 2  # and 4 h of log-sum-exp
    assert full["activations"] - half["activations"] == L * T * saved


def test_all_to_all_and_tp_all_reduce_bytes():
    cl = Cluster(8, 8)
    s = Settings(micro_batch=2, seq_len=16, tp=2, ep=4)
    p = make_plan(MOE, H100, cl, s)
    c, d, L, k = 2, 64, 2, 2
    routed = 2 * 16 // 2 * k  # the TP group's 32 tokens split 2 ways, top-2
    per_a2a = routed * d * c
    # two all-to-alls per MoE layer per pass, 3/4 of each leaving the rank, all over NVLink
    assert p.time.comm_bytes["all_to_all"]["nvlink"] == L * 4 * per_a2a * 3 / 4
    assert p.time.comm_groups["all_to_all"] == "ep 4/node"
    # TP: an all-reduce per block per pass (attention), one for the embedding and one for the
    # head, of the block's T d activations; a ring of 2 sends 2 (2 - 1) / 2 of them; the MoE's
    # T/tp outputs (forward) and its inputs' gradients (backward) all-gathered: (2 - 1) / 2
    assert p.time.comm_bytes["tp_all_reduce"]["nvlink"] == (2 * L + 2) * 32 * d * c * 1.0
    assert p.time.comm_bytes["tp_all_gather"]["nvlink"] == 2 * L * 32 * d * c * 0.5
    dense = make_plan(DENSE, H100, cl, replace(s, ep=1))  # a dense block: two all-reduces
    assert dense.time.comm_bytes["tp_all_reduce"]["nvlink"] == (4 * L + 2) * 32 * d * c * 1.0
    # the experts' collectives over efsdp (2 ranks at stride 4): forward, backward (but the
    # last layer's), reduce-scatter in fp32; half of each leaves the rank
    one_layer = 2 * 3 * d * 32
    assert p.time.comm_bytes["expert_all_gather_fwd"]["nvlink"] == L * one_layer * c / 2
    assert p.time.comm_bytes["expert_all_gather_bwd"]["nvlink"] == (L - 1) * one_layer * c / 2
    assert p.time.comm_bytes["expert_reduce_scatter"]["nvlink"] == L * one_layer * 4 / 2
    assert "tp 2, ep 4 (dp_shard 4, efsdp 2)" in p.strategy_label


def test_a2a_bytes_by_link():
    full = 1600
    assert a2a_bytes(full, 8, Cluster(8, 8)) == {"nvlink": 1400.0, "network": 0.0}
    # 16 ranks over 2 nodes: 7 of the 16 parts stay in the node, 8 cross the network
    assert a2a_bytes(full, 16, Cluster(16, 8)) == {"nvlink": 700.0, "network": 800.0}


def test_mesh_rows_trade_all_gathers_for_all_to_alls():
    cl = Cluster(8, 8)
    s = Settings(micro_batch=1, seq_len=64)
    one_d = make_plan(MOE, H100, cl, s)
    ep8 = make_plan(MOE, H100, cl, replace(s, ep=8))
    gathered = sum(v["nvlink"] for k, v in one_d.time.comm_bytes.items() if "all_gather" in k)
    gathered_ep = sum(v["nvlink"] for k, v in ep8.time.comm_bytes.items() if "all_gather" in k)
    assert gathered_ep < gathered / 2  # the experts are no longer gathered (efsdp 1)
    assert "all_to_all" in ep8.time.comm_bytes and "all_to_all" not in one_d.time.comm_bytes
    # the same model FLOPs per token
    assert ep8.time.model_flops == pytest.approx(one_d.time.model_flops)


@pytest.mark.parametrize("shape", [DENSE, MOE])
def test_tp1_ep1_rows_are_the_1d_rows(shape):
    mesh = Mesh(8)
    assert predict_mesh_memory(shape, mesh) == predict_memory(shape, 8)
    assert predict_mesh_activations(shape, mesh, 2, 16) == predict_activations(shape, 2, 16)
    cl = Cluster(8, 8)
    a = predict_time(shape, H100, cl, 2, 16)
    b = predict_time(shape, H100, cl, 2, 16, mesh=mesh)
    assert (a.step_s, a.comm_bytes, a.compute_by_kind) == (
        b.step_s,
        b.comm_bytes,
        b.compute_by_kind,
    )
    s = Settings(micro_batch=2, seq_len=16)
    plain = suggest(shape, H100, cl, s)
    with_meshes = suggest(shape, H100, cl, s, meshes=mesh_candidates(shape, cl))
    rows = {r.label: r.plan.time.step_s for r in with_meshes.ranking if r.plan}
    for r in plain.ranking:
        if r.plan is not None:
            assert rows[r.label] == r.plan.time.step_s
            assert r.plan.memory == next(x.plan.memory for x in with_meshes.ranking
                                         if x.label == r.label)  # fmt: skip


def test_mesh_candidates():
    """Only the sizes `layershard train` accepts (its check_tp_model): 2 KV heads split 2 ways
    at most (tp 4 was tried, and written to configs train refused), a MoE's TP only with EP."""
    cl = Cluster(16, 8)
    assert mesh_candidates(DENSE, cl) == [(1, 1), (2, 1)]
    assert mesh_candidates(MOE, cl, tp=2) == [(2, 2), (2, 4), (2, 8)]
    assert mesh_candidates(MOE, cl, ep=8) == [(1, 8), (2, 8)]
    # a TP size train refuses is still planned when given (--write-config refuses it)
    assert mesh_candidates(DENSE, cl, tp=4) == [(4, 1)]
    # Qwen3-30B-A3B: 32 heads over 4 KV heads, its experts packed (train splits them by EP only)
    qwen = ModelShape.from_hf_config(CONFIGS / "qwen3-30b-a3b")
    pairs = mesh_candidates(qwen, Cluster(8, 8))
    assert pairs == [
        (1, 1),
        *((1, e) for e in (2, 4, 8)),
        *((t, e) for t in (2, 4) for e in (2, 4, 8)),
    ]


@pytest.mark.parametrize(
    "shape,mesh,message",
    [
        (MOE, Mesh(6, 1, 3), "--ep 3 does not divide the 8 experts"),
        (DENSE, Mesh(6, 3), "--tp 3 does not divide the 4 attention heads"),
        (DENSE, Mesh(8, 1, 2), "--ep 2: toy has no experts"),
        (DENSE, Mesh(6, 4), "--tp 4 does not divide the 6 GPUs"),
    ],
)
def test_refusals(shape, mesh, message):
    with pytest.raises(ValueError, match=message):
        check_mesh(shape, mesh)


def test_cli_refuses_in_one_line(capsys):
    assert main(["plan", "--model", "moe", "--gpus", "6", "--ep", "3", "--no-suggest"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "layershard plan: error: --ep 3 does not divide the 8 experts"
    assert main(["plan", "--model", "llama-7b", "--gpus", "6", "--tp", "3", "--no-suggest"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "layershard plan: error: --tp 3 does not divide the 32 attention heads"


def test_cli_tp_row_and_recommendation(capsys):
    argv = ["plan", "--model", "moe", "--gpus", "4", "--gpus-per-node", "4", "--seq-len", "256",
            "--tp", "2", "--ep", "4"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "strategy: full, tp 2, ep 4 (dp_shard 2, efsdp 1)" in out
    mesh = make_plan(MOE, H100, Cluster(4, 4), Settings(1, 16, tp=2, ep=4)).to_dict()["mesh"]
    assert mesh == {"tp": 2, "ep": 4, "dp_shard": 2, "efsdp": 1}
    assert "all_to_all" in out and "tp_all_reduce" in out
    # train's own flags: it takes --tp with --ep (attention over TP, experts over EP)
    assert "layershard train: --tp 2 --ep 4" in out
    assert "--activation-checkpointing" in out


def test_qwen3_moe_and_mixtral_configs(tmp_path):
    qwen = ModelShape.from_hf_config(CONFIGS / "qwen3-30b-a3b")
    assert (qwen.n_experts, qwen.top_k, qwen.moe_ffn_dim, qwen.n_layers) == (128, 8, 768, 48)
    assert round(qwen.total_params / 1e9, 2) == 30.53  # Qwen3-30B-A3B: 30.5B
    mixtral = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "vocab_size": 32000, "intermediate_size": 14336,
               "num_local_experts": 8, "num_experts_per_tok": 2}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(mixtral))
    m = ModelShape.from_hf_config(tmp_path)
    assert (m.n_experts, m.top_k, m.moe_ffn_dim) == (8, 2, 14336)
    assert round(m.total_params / 1e9, 1) == 46.7  # Mixtral 8x7B: 46.7B
    (tmp_path / "config.json").write_text(json.dumps(mixtral | {"n_routed_experts": 64}))
    with pytest.raises(ValueError, match="not DeepSeek"):
        ModelShape.from_hf_config(tmp_path)
    sparse = {**mixtral, "moe_intermediate_size": 768, "decoder_sparse_step": 2}
    (tmp_path / "config.json").write_text(json.dumps(sparse))
    with pytest.raises(ValueError, match="every layer must be a MoE layer"):
        ModelShape.from_hf_config(tmp_path)


def test_write_config_with_tp_ep(capsys, tmp_path):
    out = tmp_path / "run.yaml"
    base = ["plan", "--model", "moe", "--gpus", "4", "--gpus-per-node", "4", "--seq-len", "256",
            "--write-config", str(out)]  # fmt: skip
    # given --tp with --ep: train takes both, and the config loads as train's
    assert main([*base, "--tp", "2", "--ep", "4"]) == 0
    cfg = yaml.safe_load(out.read_text())
    assert cfg["model"] == "moe" and cfg["tp"] == 2 and cfg["ep"] == 4
    from layershard.train.config import TrainConfig

    assert TrainConfig(**{k: v for k, v in cfg.items() if k != "plan"}).tp == 2
    out.unlink()
    # not --tp of the MoE without --ep (its experts would stay whole on every TP rank)
    assert main([*base, "--tp", "2", "--ep", "1"]) == 2
    assert "train takes --tp for a mixture of experts only with --ep" in capsys.readouterr().err
    assert not out.exists()
    # given --ep alone: train takes it (ls.parallelize), and the config loads as train's
    assert main([*base, "--ep", "4"]) == 0
    cfg = yaml.safe_load(out.read_text())
    assert cfg["model"] == "moe" and cfg["ep"] == 4 and "tp" not in cfg
    assert TrainConfig(**{k: v for k, v in cfg.items() if k != "plan"}).ep == 4
    # searched: the fastest row that train runs is written (no TP of the MoE without EP)
    assert main(base) == 0
    cfg = yaml.safe_load(out.read_text())
    assert cfg["model"] == "moe" and (cfg.get("tp", 1) == 1 or cfg.get("ep", 1) > 1)
    # a dense model at --tp 2: a tp: row, which train takes (micro_batch: per TP group)
    dense = ["plan", "--model", "tiny", "--gpus", "4", "--gpus-per-node", "4", "--seq-len", "256",
             "--tp", "2", "--write-config", str(out)]  # fmt: skip
    assert main(dense) == 0
    assert "layershard train: --tp 2 --strategy full" in capsys.readouterr().out
    cfg = yaml.safe_load(out.read_text())
    assert cfg["model"] == "tiny" and cfg["tp"] == 2 and "ep" not in cfg
    assert TrainConfig(**{k: v for k, v in cfg.items() if k != "plan"}).tp == 2


@pytest.mark.parametrize("ckpt", [0, 1])
def test_mesh_step_adds_up(ckpt):
    """--explain's parts (compute by kind, contention, copies, exposed communication by link,
    the optimizer) add up to a mesh row's step; the blocking collectives are all exposed."""
    s = Settings(micro_batch=2, seq_len=16, tp=2, ep=4, checkpoint_layers=ckpt)
    t = make_plan(MOE, H100, Cluster(8, 8), s).time
    parts = sum(t.compute_by_kind.values()) + t.contention_s + t.copy_s + t.optimizer_s
    assert parts + sum(t.exposed_by_link.values()) == pytest.approx(t.step_s)
    assert t.exposed_comm_s == pytest.approx(sum(t.exposed_by_link.values()))
    # a checkpointed layer's recompute repeats its forward's all-to-alls and all-reduces
    a2a = t.comm_bytes["all_to_all"]["nvlink"]
    assert a2a == (8 + 2 * ckpt) * 32 * 64 * 2 * 3 / 4


def test_tp_moe_elementwise_of_its_share_of_the_tokens():
    """With TP a rank routes T/tp tokens: the routed rows' element-wise bytes shrink with them
    (the rest of the block's, on the whole T, does not)."""
    from layershard.plan.kernels import elementwise_elems
    from layershard.plan.parallel import tp_shape
    from layershard.plan.sources import KERNELS, elementwise_floors

    shape = ModelShape.from_hf_config(CONFIGS / "qwen3-30b-a3b")
    mesh, T, c = Mesh(8, 2, 8), 8 * 4096, 2
    t = predict_time(shape, H100, Cluster(8, 8), 8, 4096, mesh=mesh)
    km, hbm, e = KERNELS["h100"], H100.hbm_bw_gbs * 1e9, H100.eff
    routed = shape.top_k * (5 * shape.moe_ffn_dim + 4 * shape.dim) * (T - T // 2)
    ew = (elementwise_elems(tp_shape(shape, mesh)) * T - routed) * c / (hbm * km.hbm_eff)
    floor_f, floor_b = elementwise_floors("llama")
    blocks = shape.n_layers * (max(ew, floor_f) + max(2 * ew, floor_b))
    outside = 2 * (2 * c * shape.dim * T / hbm)  # the embedding's and the final norm's bytes
    assert ew > floor_f  # the bytes, not the launch floor, bound it here
    assert t.compute_by_kind["elementwise"] == pytest.approx((blocks + outside) / e.compute_scale)


def test_train_refuses_a_tp_that_splits_a_layer_unevenly():
    """train's own check of the layers a TP plan splits (models/splits.py), not only the heads:
    a preset whose FFN width tp does not divide is no row train can run."""
    from layershard.plan.parallel import Mesh, train_refuses

    shape = ModelShape(vocab_size=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=130)
    assert train_refuses(Mesh(8, 2, 1), shape) is None
    why = train_refuses(Mesh(8, 4, 1), shape)
    assert why is not None and "--tp 4 must divide the output features" in why, why
    assert "layers.0.mlp.w1: 130" in why
