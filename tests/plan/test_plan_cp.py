"""Context parallelism in the plan (`layershard plan --cp N --cp-mode ring|all_to_all`,
plan/context.py): activation memory divided by cp plus the terms that are not, the ring's and the
all-to-all's bytes per layer against their formulas, the ring's hidden/not-hidden decision
flipping where hop time crosses a block's attention time, the compute per rank, the suggestion's
rows at one global batch, the one-line refusals, and the per-block activation formula against
the tensors autograd saves for the built-in Block on 2 ranks (both modes)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from _dist import RankChecks

from layershard.cli import main
from layershard.plan import Cluster, ModelShape, Settings, get_gpu, make_plan, suggest
from layershard.plan.context import layer_bytes
from layershard.plan.network import collective_latency_s

# Llama 3 8B's published config (Meta-Llama-3-8B config.json: vocab 128256, d 4096, 32 layers,
# 32 heads over 8 KV heads of 128, MLP 14336) as the built-in Llama, which CP runs; no preset
# has it, so the shape is spelled out here.
L3_8B = ModelShape(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                   ffn_dim=14336, max_seq_len=131072, name="llama-3-8b")  # fmt: skip
H100 = get_gpu("h100")
NODE = Cluster(8, 8)
SEQ = 131072
C = 2  # bf16


def plan(shape=L3_8B, cluster=NODE, **settings):
    return make_plan(
        shape, H100, cluster, Settings(**{"micro_batch": 1, "seq_len": SEQ, **settings})
    )


# --- memory ------------------------------------------------------------------------------------


def test_activations_per_gpu_are_one_over_cp_plus_the_attention_output():
    """Llama 3 8B at 131072 tokens on 8 H100: without CP one GPU's activations, / 8, are cp 8's
    but for one term per block (plan/context.py): the attention's output saved twice (the ring
    returns it heads-major and saves it, the transpose to wo's input copies it), c h hd bytes
    per local token and block: 4.9% of a block's 168,072 bytes per token, so cp 8 is within 5%
    of 1/8. RoPE's tables are per token under CP (gathered at the rank's positions): 2 T hd c,
    which at micro-batch 1 equals 1/8 of the 1-D plan's 2 seq hd c, exactly."""
    one, ring = plan(), plan(cp=8)
    t_local, L = SEQ // 8, L3_8B.n_layers
    output_copy = L * t_local * C * L3_8B.n_heads * L3_8B.hd
    assert ring.memory["activations"] == one.memory["activations"] // 8 + output_copy
    assert one.memory["activations"] % 8 == 0
    assert 1 < ring.memory["activations"] / (one.memory["activations"] / 8) < 1.05
    # the logits and the loss, per token: exactly 1/8 ((c + 12) V a token)
    assert ring.memory["logits"] == one.memory["logits"] // 8 == 14 * 128256 * t_local
    # the weights are sharded over all 8 GPUs, as without CP
    assert ring.memory["model_states"] == one.memory["model_states"]
    # the ring's in-flight buffers, by hand: K/V blocks in hand and arriving (2 x 2 kv hd c),
    # the block repeated to the 32 query heads (2 h hd c), dK/dV in fp32 in hand and arriving
    # (2 x 2 kv hd 4), dq in fp32 (h hd 4): 8192 + 16384 + 16384 + 16384 bytes a local token
    assert ring.memory["cp_inflight"] == (8192 + 16384 + 16384 + 16384) * t_local
    # checkpointed, the recompute block is one local block: (saved bytes + c h hd) T_l
    ck = plan(cp=8, checkpoint_layers=32)
    assert ck.memory["recompute"] == layer_bytes(L3_8B, "ring", "bf16", t_local, SEQ)
    assert ck.memory["recompute"] == (168072 + C * 32 * 128) * t_local


def test_all_to_all_activations_keep_the_kv_heads_sdpa_sees_and_the_indices():
    """All-to-all: k and v saved as SDPA sees them (bf16 on H100: flash attention takes the 8
    grouped kv heads; widened to lcm(kv, cp) when cp does not divide them), the output twice,
    and two int64 indices over the whole sequence per block; in flight, q, k, v and the output
    of h / cp heads over the whole sequence (2 (h + kv') hd c a local token)."""
    one, a2a = plan(), plan(cp=8, cp_mode="all_to_all")
    t_local, L, h, kv, hd = SEQ // 8, 32, 32, 8, 128
    extra = L * (t_local * C * h * hd + 2 * 8 * SEQ)
    assert a2a.memory["activations"] == one.memory["activations"] // 8 + extra
    assert a2a.memory["cp_inflight"] == 2 * (h + kv) * hd * C * t_local
    # cp 16 over 8 kv heads: each widened to 2 (lcm 16), 2 c (16 - 8) hd more a local token
    a16 = plan(cluster=Cluster(16, 8), cp=16, cp_mode="all_to_all")
    t16 = SEQ // 16
    extra16 = L * (t16 * C * (h * hd + 2 * (16 - kv) * hd) + 2 * 8 * SEQ)
    assert a16.memory["activations"] == one.memory["activations"] // 16 + extra16


def test_cp_fits_where_one_gpu_per_sequence_does_not():
    """The point of it: at 131072 tokens the logits alone (219 GiB) do not fit one H100; over 8
    GPUs, every block checkpointed, the peak includes the ring's in-flight buffers and fits."""
    one = plan(checkpoint_layers=32)
    ring = plan(cp=8, checkpoint_layers=32)
    assert not one.fits and ring.fits
    assert one.memory["logits"] / 2**30 > 200
    assert ring.memory["peak"] < ring.budget


# --- communication -----------------------------------------------------------------------------


def test_ring_bytes_per_layer_equal_the_formula():
    """Forward: cp - 1 hops of the local K/V block, 2 x seq/cp x kv x hd x c; backward: the K/V
    again, and cp hops of dK/dV in fp32 (ring.py accumulates and sends them so), the last one
    home. Per step: x grad_accum, and a checkpointed layer's forward again in its backward."""
    cp, mb, ga, k = 8, 2, 3, 4
    p = plan(cp=cp, micro_batch=mb, grad_accum=ga, checkpoint_layers=k)
    kv_block = 2 * mb * SEQ // cp * 8 * 128 * C
    assert kv_block == 134217728
    per_layer = (cp - 1) * kv_block + (cp - 1) * kv_block + cp * 2 * kv_block  # dK/dV fp32
    assert p.time.context["bytes_per_layer_per_step"] == ga * per_layer
    assert p.time.comm_bytes["cp_ring"] == {
        "nvlink": ga * (32 * per_layer + k * (cp - 1) * kv_block), "network": 0.0, "pcie": 0.0,
    }  # fmt: skip
    assert p.time.comm_groups["cp_ring"] == "cp 8/node"
    # the FSDP collectives are the 1-D plan's on the whole world
    one = plan(micro_batch=mb, grad_accum=ga, checkpoint_layers=k)
    for kind in ("all_gather_fwd", "all_gather_bwd", "reduce_scatter"):
        assert p.time.comm_bytes[kind] == one.time.comm_bytes[kind]


def test_all_to_all_bytes_per_layer_equal_the_formula():
    """4 all-to-alls forward (q, k, v to heads, the output back) and 4 backward, each of the
    local tensor, (cp - 1)/cp of it leaving the rank; k and v with lcm(kv, cp) heads when cp
    does not divide the kv heads (all_to_all.py repeats them so)."""
    p = plan(cp=8, cp_mode="all_to_all")
    t_local = SEQ // 8
    local = t_local * (32 + 8 + 8 + 32) * 128 * C
    assert p.time.context["bytes_per_layer_per_step"] == 2 * local * 7 / 8
    assert p.time.context["transfers_per_layer"] == {"forward": 4, "backward": 4}
    # 4 query heads over 2 KV heads at cp 4: k and v travel with lcm(2, 4) = 4 heads
    toy = ModelShape(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128,
                     max_seq_len=64, name="toy")  # fmt: skip
    q = make_plan(toy, H100, Cluster(4, 4), Settings(1, 64, cp=4, cp_mode="all_to_all"))
    assert q.time.context["bytes_per_layer_per_step"] == 2 * 16 * (4 + 4 + 4 + 4) * 16 * C * 3 / 4
    assert q.time.comm_bytes["cp_all_to_all"]["nvlink"] == 2 * 2 * 16 * 16 * 16 * C * 3 / 4


def test_cp_over_two_nodes_crosses_the_network():
    """A CP group of 16 consecutive ranks on nodes of 8: its ring's slowest hop and 8/16 of its
    all-to-alls' parts cross the network."""
    two = Cluster(16, 8)
    ring = plan(cluster=two, cp=16)
    assert ring.time.comm_bytes["cp_ring"]["nvlink"] == 0
    a2a = plan(cluster=two, cp=16, cp_mode="all_to_all")
    row = a2a.time.comm_bytes["cp_all_to_all"]
    assert row["network"] == pytest.approx(row["nvlink"] * 8 / 7)  # (16 - 8) / 16 vs 7 / 16


# --- overlap -----------------------------------------------------------------------------------


def _threshold_bw(r: dict, kv_block: int, eff: float) -> float:
    """The NVLink GB/s at which the ring's slowest window's hops take exactly its block's
    attention (forward: a K/V hop; backward, cp > 2: a K/V hop and a dK/dV hop, 3 x the block's
    bytes, on the same link); each hop pays NCCL's latency of one point-to-point step."""
    lat = collective_latency_s("send_recv", 8, 1)
    fwd = kv_block / (eff * (r["block_attention_s"]["forward"] - lat))
    bwd = 3 * kv_block / (eff * (r["block_attention_s"]["backward"] - 2 * lat))
    return max(fwd, bwd) / 1e9


def test_ring_hides_exactly_where_the_hop_takes_less_than_a_blocks_attention():
    """The decision flips at the bandwidth the formula gives: 2% above it every hop hides under
    its block's attention, and what is exposed is the last dK/dV hop home of each layer (forward
    nothing); 2% below it the ring says no and exposes more."""
    seq, cp = 8192, 8
    s = Settings(micro_batch=1, seq_len=seq, cp=cp)
    r = make_plan(L3_8B, H100, NODE, s).time.context
    kv_block = 2 * seq // cp * 8 * 128 * C
    bw = _threshold_bw(r, kv_block, H100.eff.nvlink)
    above = make_plan(L3_8B, get_gpu("h100", intra_bw=bw * 1.02), NODE, s).time.context
    below = make_plan(L3_8B, get_gpu("h100", intra_bw=bw * 0.98), NODE, s).time.context
    assert above["hidden"] and not below["hidden"]
    home = above["hop_s"]["home"]
    assert above["exposed_s_per_step"] == pytest.approx(32 * home)
    assert below["exposed_s_per_step"] > 32 * below["hop_s"]["home"]
    # the report says which: its hop against its block's attention
    assert above["hop_s"]["forward"] <= above["block_attention_s"]["forward"]
    assert above["hop_s"]["backward"] <= above["block_attention_s"]["backward"]
    assert max(below["hop_s"]["forward"] / below["block_attention_s"]["forward"],
               below["hop_s"]["backward"] / below["block_attention_s"]["backward"]) > 1  # fmt: skip


def test_ring_hides_at_long_sequences_not_at_short_ones():
    """A hop grows with seq / cp, a block's attention with (seq / cp)^2: Llama 2 7B (32 KV
    heads: 4x Llama 3's K/V bytes) at cp 8 hides its hops at 131072 tokens, not at 4096."""
    for seq, hides in ((131072, True), (4096, False)):
        shape = ModelShape.from_preset("llama-7b")
        shape = replace(shape, max_seq_len=seq)
        r = make_plan(shape, H100, NODE, Settings(1, seq, cp=8)).time.context
        fits_under = (r["hop_s"]["forward"] <= r["block_attention_s"]["forward"]
                      and r["hop_s"]["backward"] <= r["block_attention_s"]["backward"])  # fmt: skip
        assert r["hidden"] is fits_under is hides, (seq, r)


def test_all_to_all_never_hides():
    """All-to-all's exchanges wait for each other and the attention: all exposed, every layer,
    both passes (and a checkpointed layer's forward again)."""
    p = plan(cp=8, cp_mode="all_to_all", checkpoint_layers=2)
    r = p.time.context
    a = r["all_to_all_s"]
    assert not r["hidden"]
    assert r["exposed_s_per_step"] == pytest.approx(
        32 * (a["forward"] + a["backward"]) + 2 * a["forward"]
    )
    assert r["slowed_s_per_step"] == 0


# --- compute -----------------------------------------------------------------------------------


def test_compute_per_rank_is_one_over_cp():
    """Linear layers, element-wise work and the loss on seq / cp tokens; attention's quadratic
    part on (seq / cp) x seq: hardware and model FLOPs per GPU exactly 1/8. All-to-all's kernel
    sees the whole sequence (h / cp heads): its attention time is 1/8 too; the ring's runs at
    the rate of its seq / (2 cp) blocks, slower."""
    one, ring, a2a = plan(), plan(cp=8), plan(cp=8, cp_mode="all_to_all")
    assert ring.time.hardware_flops == one.time.hardware_flops / 8
    assert ring.time.model_flops == pytest.approx(one.time.model_flops / 8)
    for kind in ("gemm", "elementwise", "loss"):
        ratio = ring.time.compute_by_kind[kind] / one.time.compute_by_kind[kind]
        assert ratio < 1 / 7, kind  # 1/8 of the tokens (GEMM tiles and launches: a little more)
    att = one.time.compute_by_kind["attention"]
    assert a2a.time.compute_by_kind["attention"] == pytest.approx(att / 8)
    assert ring.time.compute_by_kind["attention"] > att / 8
    assert ring.time.tokens_per_s_per_gpu == pytest.approx(SEQ / 8 / ring.time.step_s)


# --- the suggestion and the command --------------------------------------------------------------


def test_suggestion_compares_cp_rows_with_the_rest_at_one_global_batch():
    """With cp: full at cp 8 in both modes (with and without offload), and the 1-D rows at the
    same global batch (8 sequences: 1 per GPU without CP, 8 per CP group with it)."""
    shape = replace(L3_8B, max_seq_len=32768)
    s = Settings(micro_batch=8, seq_len=32768, cp=8)
    sug = suggest(shape, H100, NODE, s)
    labels = [r.label for r in sug.ranking]
    for label in ("full, cp 8 ring", "full, cp 8 all_to_all", "full, offload, cp 8 ring",
                  "full", "grad_op", "no_shard"):  # fmt: skip
        assert label in labels, labels
    for r in sug.ranking:
        if r.plan is not None:
            ps = r.plan.settings
            assert ps.micro_batch * ps.grad_accum * 8 // ps.cp == 8, r.label
    # without cp, nothing changes: no CP row
    plain = suggest(shape, H100, NODE, replace(s, cp=1, micro_batch=1))
    assert not any("cp" in r.label for r in plain.ranking)
    # a global batch of 1 sequence on 8 GPUs: the rows without cp are not compared
    one = suggest(L3_8B, H100, NODE, Settings(1, SEQ, cp=8))
    apart = [r for r in one.ranking if r.label == "without cp"]
    assert len(apart) == 1 and apart[0].reason.startswith("not compared")
    assert "do not fit" not in one.why


def test_plan_text_and_json(capsys, tmp_path):
    out_json = tmp_path / "plan.json"
    argv = ["plan", "--model", "llama-1b", "--gpus", "8", "--seq-len", "65536", "--cp", "8",
            "--checkpoint-layers", "all", "--no-suggest", "--json", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "strategy: full, cp 8 ring" in out
    assert "Context parallelism: cp 8, ring (groups of 8 consecutive GPUs, cp 8/node)" in out
    r = json.loads(out_json.read_text())
    mb = r["context"]["bytes_per_layer_per_step"] / 1e6
    hidden = "yes" if r["context"]["hidden"] else "no"
    assert f"ring: {mb:.1f} MB per layer per step, hidden under attention: {hidden}" in out
    assert r["settings"]["cp"] == 8 and r["memory_bytes"]["cp_inflight"] > 0
    # without --cp: no CP keys in the JSON, no CP text (the recorded outputs stay as they are)
    assert main([*argv[:7], "--no-suggest", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    r = json.loads(out_json.read_text())
    assert (
        "cp" not in r["settings"] and "context" not in r and "cp_inflight" not in r["memory_bytes"]
    )
    assert "Context parallelism" not in out and "cp_" not in out


def refused(capsys, *argv: str) -> str:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("layershard plan: error: "), err
    return err.removeprefix("layershard plan: error: ")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--seq-len", "100", "--cp", "4"], "--seq-len 100 must be divisible by 2 x cp = 8"),
        (["--gpus", "6", "--cp", "4"], "--cp 4 does not divide the 6 GPUs"),
        (["--cp", "8", "--cp-mode", "all_to_all"], "n_heads=4 must be divisible by cp"),
        (["--cp", "2", "--tp", "2"], "--cp 2 with --tp/--ep is not supported yet"),
        (["--cp-mode", "all_to_all"], "--cp-mode all_to_all applies to context parallelism"),
        (["--cp", "0"], "--cp"),
        (["--cp", "4", "--strategy", "hybrid", "--shard-size", "2"],
         "--cp 4 must divide hybrid's shard size 2"),
    ],
)  # fmt: skip
def test_refusals_in_one_line(capsys, argv, message):
    base = ["--model", "tiny", "--gpus", "8", "--seq-len", "64", "--no-suggest"]
    assert message in refused(capsys, *base, *argv)


def test_moe_and_ep_refused(capsys):
    assert "a mixture of experts is not supported" in refused(
        capsys, "--model", "moe", "--gpus", "2", "--seq-len", "64", "--cp", "2", "--no-suggest"
    )
    assert "with --tp/--ep" in refused(
        capsys, "--model", "moe", "--gpus", "2", "--seq-len", "64", "--cp", "2", "--ep", "2",
        "--no-suggest",
    )  # fmt: skip


def test_write_config_takes_cp_only_where_train_does(capsys, tmp_path):
    """`--write-config` writes cp and cp_mode when this `layershard train` has them (and train's
    own checks take the file), else refuses in one line (it never writes a config train would
    not read)."""
    from dataclasses import fields

    from test_plan_cli import train_checks

    from layershard.train.config import TrainConfig

    path = tmp_path / "plan.yaml"
    argv = ["--model", "tiny", "--gpus", "2", "--gpus-per-node", "2", "--seq-len", "64",
            "--cp", "2", "--cp-mode", "all_to_all", "--no-suggest", "--write-config", str(path)]  # fmt: skip
    if "cp" in {f.name for f in fields(TrainConfig)}:
        assert main(["plan", *argv]) == 0
        import yaml

        cfg = yaml.safe_load(path.read_text())
        assert (cfg["cp"], cfg["cp_mode"]) == (2, "all_to_all")
        train_checks(path, world=2, local=2)
        # train runs --cp with its presets only: a plan of an --hf-config is not written
        hf = tmp_path / "hf" / "config.json"
        hf.parent.mkdir()
        hf.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
                                  "num_attention_heads": 4, "vocab_size": 256}))  # fmt: skip
        assert "with its presets only" in refused(capsys, "--hf-config", str(hf), *argv[2:])
    else:
        assert "has no cp option" in refused(capsys, *argv)
        assert not path.exists()


# --- the per-block formula against autograd, on 2 ranks ------------------------------------------


def _saved_bytes(rank: int, world: int) -> None:
    """The tensors autograd saves for one built-in Block under CP (unique storages, without the
    weights and the RoPE tables), ring and all-to-all, fp32 and bf16, 1, 2 and 4 KV heads of 4
    (1 and 2: all_to_all.py widens them to lcm(kv, 2) heads): ``layer_bytes``, byte for byte."""
    from layershard.models import build_config
    from layershard.models.llama import Block, Rotary, _native_gqa
    from layershard.parallel.context import ContextParallel, split

    seq, batch = 64, 2
    pos = split(torch.arange(seq).expand(batch, seq), world, rank)
    for mode in ("ring", "all_to_all"):
        for dtype in (torch.float32, torch.bfloat16):
            for kv in (1, 2, 4):
                cfg = build_config("tiny", n_kv_heads=kv)
                torch.manual_seed(0)
                block = Block(cfg).to(dtype)
                block.attn.context_parallel = ContextParallel(dist.group.WORLD, mode)
                cos, sin = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)(
                    seq // world, dtype, pos
                )
                x = torch.randn(batch, seq // world, cfg.dim, dtype=dtype, requires_grad=True)
                skip = {t.untyped_storage().data_ptr() for t in [*block.parameters(), cos, sin]}
                saved: dict[int, int] = {}

                def pack(t, saved=saved, skip=skip):
                    st = t.untyped_storage()
                    if st.data_ptr() not in skip:
                        saved[st.data_ptr()] = st.nbytes()
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    y = block(x, cos, sin)
                y.sum().backward()  # every rank of the group runs the attention's backward
                q_, kv_ = torch.zeros(1, 4, 1, 8, dtype=dtype), torch.zeros(1, 2, 1, 8, dtype=dtype)
                repeat = not _native_gqa(q_, kv_, kv_)  # as SDPA runs grouped heads here
                want = layer_bytes(
                    ModelShape.from_config(cfg),
                    mode,
                    dtype,
                    batch * seq // world,
                    seq,
                    world,
                    repeat_kv=repeat,
                )
                assert sum(saved.values()) == want, (mode, dtype, kv, sum(saved.values()), want)
                assert math.isfinite(float(x.grad.float().sum()))


checks = RankChecks(world_size=2, suffix="_cp2")
checks.check(_saved_bytes, name="plan_cp_block_saves_what_the_formula_says")
checks.collect(globals())
