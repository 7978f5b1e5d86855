"""Tensor and expert parallelism in the plan (issue 32): memory, collectives and time of a row
with TP size ``tp`` and EP size ``ep`` composed with layershard's data-parallel sharding.

The mesh (as transformers lays it out, ``DistributedConfig``): ``world = dp_shard x tp`` for the
dense units, ``world = efsdp x ep`` for the experts, so ``efsdp = dp_shard x tp / ep``. TP is the
innermost dim (its ranks consecutive, within a node when ``tp <= GPUs per node``), then
``dp_shard`` (stride ``tp``); for the experts ``ep`` is innermost, ``efsdp`` at stride ``ep``.

**Dense units** are the TP-local shards of the model (Megatron's split, torchtitan's plan):
``wq wk wv w1 w3`` column-wise, ``wo w2`` row-wise, the embedding and the LM head by vocabulary
(the loss vocabulary-parallel), so a block holds ``h/tp`` heads, ``kv/tp`` KV heads (one, copied,
when ``tp > kv``), ``f/tp`` of the MLP; norms (and a MoE's router) are copied on every TP rank.
layershard flattens those local shards and shards them over ``dp_shard``: per rank ``1/(dp_shard
x tp)`` of every split weight, ``1/dp_shard`` of the copied ones. Activations of the TP region
shrink with it (heads, MLP, logits); the block's input, norms and residuals are whole on every TP
rank (no sequence parallelism). Per block and micro-batch, forward: an all-reduce of the block's
``b s d`` activations after attention and one after the MLP; backward: the same two on the
inputs' gradients (and the forward's again in a checkpointed block's recompute); plus one in the
embedding's forward and one in the LM head's backward. A MoE layer is not split by TP (below):
its ``T/tp`` outputs are all-gathered over the TP group in the forward, the gradients of its
inputs in the backward, in place of the MLP's all-reduces. They run over the TP group (NVLink
when it lies in a node) and the compute waits for them: they are exposed communication.

**Experts** (a MoE model): each MoE layer's ``E`` experts split ``ep`` ways, ``E/ep`` per rank,
a unit of their own per layer (gather and gradient slots of their own, two taken in turn),
sharded over ``efsdp``: per rank ``1/(efsdp x ep)`` of the experts' state. Gathered over efsdp
(forward, backward but for the last layer's), reduce-scattered over efsdp; their gradients
divided by the whole data-parallel size (no bytes change). The tokens: a TP group's tokens are
split ``tp`` ways before routing (torchtitan's sequence-sharded MoE input), so a rank routes
``T/tp`` tokens; two all-to-alls per MoE layer per pass (dispatch and combine), each of
``T/tp x top_k x d`` elements of the compute dtype, ``(ep - 1)/ep`` of them leaving the rank
(``timing.a2a_bytes``), with a balanced router (each expert gets ``T/tp x top_k x ep / E``
rows). The expert GEMMs and activations are those of ``T/tp`` tokens.

Rows with ``tp = ep = 1`` are the 1-D rows (``make_plan`` does not come here). Modelled for the
``full`` strategy only (no hybrid, hpZ, grad_op, no_shard or offload) and Llama-style blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache
from types import SimpleNamespace
from typing import Any

from layershard.plan.hardware import GPU, Cluster
from layershard.plan.kernels import (
    KernelModel,
    StageCompute,
    elementwise_elems,
    expert_linears,
    gemm_time,
)
from layershard.plan.memory import (
    dtype_bytes,
    layer_activation_bytes_per_token,
    optimizer_bytes,
    predict_activations,
    predict_memory,
    receives_whole_units,
    released_between_passes,
    unit_grad_bytes,
)
from layershard.plan.model import ModelShape, Unit
from layershard.plan.sources import KERNELS, Efficiency, elementwise_floors
from layershard.plan.timing import Layout, Stage, Transfer, Wire

TP_SIZES = (1, 2, 4, 8)  # the TP sizes the suggestion tries (within a node)


@dataclass(frozen=True)
class Mesh:
    world: int
    tp: int = 1
    ep: int = 1

    @property
    def dp_shard(self) -> int:
        return self.world // self.tp

    @property
    def efsdp(self) -> int:
        return self.world // self.ep

    @property
    def trivial(self) -> bool:
        return self.tp == 1 and self.ep == 1

    def describe(self, moe: bool) -> str:
        parts = ([f"tp {self.tp}"] if self.tp > 1 else []) + (
            [f"ep {self.ep}"] if self.ep > 1 else []
        )
        dims = f"dp_shard {self.dp_shard}" + (f", efsdp {self.efsdp}" if moe else "")
        return f"{', '.join(parts)} ({dims})"


def check_mesh(shape: ModelShape, mesh: Mesh, settings: Any = None) -> None:
    """Raise ``ValueError`` (one line) for a mesh the plan cannot model."""
    tp, ep, n = mesh.tp, mesh.ep, mesh.world
    if tp < 1 or ep < 1:
        raise ValueError(f"--tp and --ep must be >= 1 (got tp {tp}, ep {ep})")
    if n % tp:
        raise ValueError(f"--tp {tp} does not divide the {n} GPUs")
    if tp > 1 and shape.gpt:
        raise ValueError("--tp: only Llama-style blocks are modelled with tensor parallelism")
    if shape.n_heads % tp:
        raise ValueError(f"--tp {tp} does not divide the {shape.n_heads} attention heads")
    kv = shape.n_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(f"--tp {tp} neither divides nor is a multiple of the {kv} KV heads")
    if ep > 1 and not shape.moe:
        raise ValueError(f"--ep {ep}: {shape.name} has no experts (expert parallelism needs MoE)")
    if ep > 1 and shape.n_experts % ep:
        raise ValueError(f"--ep {ep} does not divide the {shape.n_experts} experts")
    if n % ep:
        raise ValueError(f"--ep {ep} does not divide the {n} GPUs")
    if settings is not None and not mesh.trivial:
        s = settings
        if s.strategy != "full" or s.offload or s.reshard_after_forward is not True:
            raise ValueError(
                "--tp/--ep are modelled with --strategy full only (no hybrid, hpZ, grad_op, "
                "no_shard or offload)"
            )
        if s.gather_dtype is not None:
            raise ValueError(
                "--tp/--ep are not modelled with --gather-dtype; drop --gather-dtype or --tp/--ep"
            )


def tp_shape(shape: ModelShape, mesh: Mesh) -> ModelShape:
    """The model as one TP rank holds it (module docstring); a MoE's experts apart."""
    tp = mesh.tp
    return replace(
        shape,
        n_heads=shape.n_heads // tp,
        n_kv_heads=max(1, shape.n_kv_heads // tp),
        ffn_dim=-(-shape.ffn_dim // tp),
        vocab_size=-(-shape.vocab_size // tp),
        head_dim=shape.hd,
        experts_apart=shape.moe and not mesh.trivial,
    )


def expert_unit(shape: ModelShape, mesh: Mesh) -> Unit | None:
    """One MoE layer's ``E/ep`` local experts (gate_up, down) as a unit, or None."""
    if not shape.moe or mesh.trivial:
        return None
    e, d, fe = shape.n_experts // mesh.ep, shape.dim, shape.moe_ffn_dim
    return Unit("experts", (e * 2 * fe * d, e * d * fe), "block")


def predict_mesh_memory(
    shape: ModelShape,
    mesh: Mesh,
    param_dtype: Any = "bf16",
    reduce_dtype: Any = "fp32",
    optimizer: str | None = "adamw",
    no_sync: bool = False,
    backend: str = "nccl",
) -> dict[str, int]:
    """``predict_memory``'s keys for a rank of the mesh: the TP-local dense units over dp_shard
    (``predict_memory`` itself) plus each layer's expert unit over efsdp: fp32 params, grads and
    optimizer state of its shard, two gather slots and two gradient slots of its size (with
    their reduce scratch), ``no_sync``'s accumulators."""
    check_mesh(shape, mesh)
    mem = predict_memory(
        tp_shape(shape, mesh), mesh.dp_shard, param_dtype, reduce_dtype, optimizer, "full",
        no_sync, backend=backend,
    )  # fmt: skip
    eu = expert_unit(shape, mesh)
    if eu is not None:
        n, L = mesh.efsdp, shape.n_layers
        c, r = dtype_bytes(param_dtype), dtype_bytes(reduce_dtype)
        shard, padded = eu.shard_numel(n), eu.padded_numel(n)
        in_place = n == 1 and c == 4
        mem["params"] += 4 * L * shard
        mem["grads"] += 4 * L * shard
        if optimizer is not None:
            mem["optimizer"] += optimizer_bytes(optimizer) * L * eu.local_numel(n, 0)
        mem["gather_buffers"] += 0 if in_place else 2 * c * padded
        mem["grad_buffers"] += 2 * r * padded
        if n > 1:
            whole = receives_whole_units(backend, r)
            mem["reduce_scratch"] += 2 * r * (padded if whole else shard)
        if no_sync:
            mem["no_sync"] += 4 * L * padded
        mem["total"] = sum(v for k, v in mem.items() if k != "total")
    return mem


def moe_tokens(tokens: int, mesh: Mesh) -> int:
    """Tokens a rank routes: its TP group's, split tp ways."""
    return -(-tokens // mesh.tp)


def predict_mesh_activations(
    shape: ModelShape,
    mesh: Mesh,
    micro_batch: int,
    seq_len: int,
    checkpoint_layers: int = 0,
    compute_dtype: Any = "bf16",
    loss_chunks: int = 0,
    loss: str = "fp32",
) -> dict[str, int]:
    """``predict_activations`` of the TP-local model; a MoE layer's routed part (everything past
    the norm's output: router, expert rows) of ``T/tp`` tokens."""
    local = replace(tp_shape(shape, mesh), experts_apart=False)
    act = predict_activations(
        local, micro_batch, seq_len, checkpoint_layers, compute_dtype,
        loss_chunks=loss_chunks, loss=loss,
    )  # fmt: skip
    if shape.moe and mesh.tp > 1:
        dense = replace(local, n_experts=0, top_k=0, moe_ffn_dim=0, ffn_dim=0)
        c = dtype_bytes(compute_dtype)
        rk = c == 4  # predict_activations' default
        routed = layer_activation_bytes_per_token(
            local, compute_dtype, rk
        ) - layer_activation_bytes_per_token(dense, compute_dtype, rk)
        tokens = micro_batch * seq_len
        cut = routed * tokens - routed * moe_tokens(tokens, mesh)
        k = max(0, min(checkpoint_layers, shape.n_layers))
        act["activations"] -= cut * ((shape.n_layers - k) + (1 if k else 0))
        if k:
            act["recompute"] -= cut
    return act


def mesh_parts(
    shape: ModelShape, mesh: Mesh, s: Any
) -> tuple[Layout, dict[str, int], dict[str, int], int, int]:
    """``make_plan``'s inputs for a mesh row: the dense layout, model states, activations, the
    largest unit's unsharded gradients and the gather bytes given back at the loss."""
    check_mesh(shape, mesh, s)
    local = tp_shape(shape, mesh)
    mem = predict_mesh_memory(shape, mesh, s.param_dtype, s.reduce_dtype, s.optimizer, s.no_sync)
    act = predict_mesh_activations(
        shape, mesh, s.micro_batch, s.seq_len, s.checkpoint_layers, s.param_dtype,
        s.loss_chunks, s.loss,
    )  # fmt: skip
    c = dtype_bytes(s.param_dtype)
    grads = unit_grad_bytes(local, mesh.dp_shard, s.param_dtype)
    eu = expert_unit(shape, mesh)
    if eu is not None:
        grads = max(grads, c * eu.padded_numel(mesh.efsdp))
    released = released_between_passes(local, mesh.dp_shard, s.param_dtype, "full")
    layout = Layout("full", mesh.dp_shard, mesh.dp_shard)
    return layout, mem, act, grads, released


class MeshTime:
    """``predict_time``'s additions for a mesh row: the dense shard group at stride tp, the
    experts' collectives, TP's all-reduces and EP's all-to-alls, the expert GEMMs."""

    def __init__(self, shape: ModelShape, mesh: Mesh) -> None:
        check_mesh(shape, mesh)
        self.shape, self.mesh = shape, mesh
        self.local = tp_shape(shape, mesh)
        self.layout = Layout("full", mesh.dp_shard, mesh.dp_shard)
        self.expert = expert_unit(shape, mesh)

    @property
    def expert_shard_elems(self) -> int:
        if self.expert is None:
            return 0
        return self.shape.n_layers * self.expert.shard_numel(self.mesh.efsdp)

    def extend(self, stages: list[Stage], root: Stage | None, micro_batch: int, seq_len: int,
               k: int, wire: Wire) -> None:  # fmt: skip
        m, sh = self.mesh, self.shape
        c, r = wire.c, wire.r
        tokens = micro_batch * seq_len
        act = tokens * sh.dim * c  # a block's activations (or their gradients)
        for s in ([root] if root else []) + stages:
            for ts in (s.gather_fwd, s.gather_bwd, s.reduce):
                ts[:] = [replace(t, stride=m.tp) if t.group == "shard" else t for t in ts]
        blocks = [s for s in stages if s.name.startswith("layers.")]
        by_name = {s.name: s for s in stages}
        if m.tp > 1:
            by_name["embed"].blocking_fwd.append(
                Transfer("all_reduce", "forward", "tp", m.tp, 1, act)
            )
            by_name["lm_head"].blocking_bwd.append(Transfer("all_reduce", "backward", "tp", m.tp, 1, act))  # fmt: skip
        rows = moe_tokens(tokens, m) * sh.top_k
        for i, s in enumerate(blocks):
            fwd: list[Transfer] = []
            bwd: list[Transfer] = []
            if m.tp > 1:  # after attention; after the MLP, or the MoE's T/tp outputs gathered
                second = "all_gather" if sh.moe else "all_reduce"
                fwd += [Transfer("all_reduce", "forward", "tp", m.tp, 1, act),
                        Transfer(second, "forward", "tp", m.tp, 1, act)]  # fmt: skip
                bwd += [Transfer("all_reduce", "backward", "tp", m.tp, 1, act),
                        Transfer(second, "backward", "tp", m.tp, 1, act)]  # fmt: skip
            if sh.moe and m.ep > 1:
                fwd += [Transfer("all_to_all", "forward", "ep", m.ep, 1, rows * sh.dim * c)] * 2
                bwd += [Transfer("all_to_all", "backward", "ep", m.ep, 1, rows * sh.dim * c)] * 2
            s.blocking_fwd += fwd
            s.blocking_bwd += bwd + (fwd if i < k else [])
            if self.expert is None:
                continue
            # the expert FLOPs of T/tp tokens (block_fwd_flops counted them on T)
            ef = 2 * sh.top_k * 3 * sh.dim * sh.moe_ffn_dim
            cut = ef * tokens - ef * moe_tokens(tokens, m)
            s.fwd_flops -= cut
            s.bwd_flops -= cut * (3 if i < k else 2)
            n, padded = m.efsdp, self.expert.padded_numel(m.efsdp)
            if n > 1:
                s.gather_fwd.append(Transfer("all_gather", "forward", "efsdp", n, m.ep, padded * c))
                if i < len(blocks) - 1:  # the last layer's experts are still in their slot
                    s.gather_bwd.append(Transfer("all_gather", "backward", "efsdp", n, m.ep, padded * c))  # fmt: skip
                s.reduce.append(Transfer("reduce_scatter", "backward", "efsdp", n, m.ep, padded * r))  # fmt: skip
            elif c != 4:
                s.local_copy += padded * (4 + c)

    def add_compute(self, sc: list[StageCompute], stages: list[Stage], gpu: GPU, e: Efficiency,
                    tokens: int, k: int, c: int) -> None:  # fmt: skip
        """Each MoE layer's local experts on their balanced share of the routed rows."""
        sh, m = self.shape, self.mesh
        if self.expert is None:
            return
        local_experts = sh.n_experts // m.ep
        rows = max(1, moe_tokens(tokens, m) * sh.top_k * m.ep // sh.n_experts)
        km = KERNELS.get(gpu.kernels) if gpu.kernels else None
        hbm = gpu.hbm_bw_gbs * 1e9
        if km is None or e.compute is not None:
            rate = gpu.peak_flops * (e.compute if e.compute is not None else 0.5)
            f = 2 * rows * local_experts * sum(n * kk for _, n, kk in expert_linears(sh)) / rate
            kind, g_f, g_b = "flops", f, 2 * f
        else:
            p = gpu.peak_flops
            g_f = g_b = 0.0
            for _, n, kk in expert_linears(sh):
                g_f += gemm_time(rows, n, kk, p, hbm, km, c)
                g_b += gemm_time(rows, kk, n, p, hbm, km, c) + gemm_time(n, kk, rows, p, hbm, km, c)
            scale = local_experts / e.compute_scale
            kind, g_f, g_b = "gemm", g_f * scale, g_b * scale
            if m.tp > 1:
                self._routed_elementwise(sc, stages, km, hbm, e, tokens, k, c)
        for x, s in zip(sc, stages):
            if not s.name.startswith("layers."):
                continue
            x.fwd[kind] = x.fwd.get(kind, 0.0) + g_f
            x.bwd[kind] = x.bwd.get(kind, 0.0) + g_b
            if int(s.name.split(".")[1]) < k:
                key = "recompute" if kind == "gemm" else kind
                x.bwd[key] = x.bwd.get(key, 0.0) + g_f

    def _routed_elementwise(self, sc: list[StageCompute], stages: list[Stage], km: KernelModel,
                            hbm: float, e: Efficiency, tokens: int, k: int, c: int) -> None:  # fmt: skip
        """``block_compute``'s element-wise bytes with the routed rows' part (gather, SwiGLU,
        add back: ``top_k (5 fe + 4 d)`` per token) of ``T/tp`` tokens, not ``T``."""
        sh = self.shape
        routed = (
            sh.top_k * (5 * sh.moe_ffn_dim + 4 * sh.dim) * (tokens - moe_tokens(tokens, self.mesh))
        )
        ew = (elementwise_elems(self.local) * tokens - routed) * c / (hbm * km.hbm_eff)
        floors, scale = elementwise_floors(sh.family), 1.0 / e.compute_scale
        new_f, new_b = max(ew, floors[0]) * scale, max(2 * ew, floors[1]) * scale
        for x, s in zip(sc, stages):
            if s.name.startswith("layers."):
                if int(s.name.split(".")[1]) < k:
                    x.bwd["recompute"] += new_f - x.fwd["elementwise"]
                x.fwd["elementwise"], x.bwd["elementwise"] = new_f, new_b


def mesh_candidates(
    shape: ModelShape, cluster: Cluster, tp: int | None = None, ep: int | None = None
) -> list[tuple[int, int]]:
    """The (tp, ep) pairs the suggestion compares: ``tp`` as given, else 1, 2, 4, 8 within a
    node; ``ep`` as given, else 1 and the divisors of the experts up to the world. Only pairs
    ``layershard train`` runs (``train_refuses``), so that a written config is one it takes;
    a given pair it refuses is still planned (a what-if; ``--write-config`` refuses it)."""
    n = cluster.gpus

    def ok(t: int, e: int) -> bool:
        try:
            check_mesh(shape, Mesh(n, t, e))
        except ValueError:
            return False
        return True

    tps = [tp] if tp else [t for t in TP_SIZES if t <= cluster.local]
    eps = (
        [ep] if ep else [1] + [e for e in range(2, n + 1) if shape.moe and shape.n_experts % e == 0]
    )
    pairs = [(t, e) for t in tps for e in eps if ok(t, e)]
    runs = [(t, e) for t, e in pairs if train_refuses(Mesh(n, t, e), shape) is None]
    return runs or pairs


def train_refuses(s: Any, shape: ModelShape) -> str | None:
    """Why ``layershard train`` cannot run these ``tp`` / ``ep`` on this model (None: it can).
    Its own check (train/parallel.py ``check_tp_model``: the heads and KV heads divisible by
    tp, a TP plan for the architecture), and this plan's limit: TP of a MoE only with EP (its
    experts would otherwise stay whole on every TP rank, which this plan does not model)."""
    if s.tp == 1:
        return None
    if shape.moe and s.ep == 1:
        return "train takes --tp for a mixture of experts only with --ep"
    from layershard.train.parallel import check_split_shapes, check_tp_model

    try:
        kind, spec = _train_model(shape)
        wanted = SimpleNamespace(tp=s.tp, ep=s.ep)
        check_tp_model(wanted, kind, spec)
        check_split_shapes(wanted, kind, _one_block(shape))
    except ValueError as e:
        return str(e)
    return None


@cache
def _one_block(shape: ModelShape) -> Any:
    """The model with one block, on the meta device: what train's check of the layers the TP
    plan splits (``check_split_shapes``) reads; every block has the same widths."""
    import dataclasses
    import logging

    import torch

    kind, spec = _train_model(shape)
    with torch.device("meta"):
        if kind == "hf":
            import transformers

            one = spec.__class__.from_dict({**spec.to_dict(), "num_hidden_layers": 1})
            logging.disable(logging.WARNING)  # the optional kernels transformers imports, unused
            try:
                return transformers.AutoModelForCausalLM.from_config(one)
            finally:
                logging.disable(logging.NOTSET)
        from layershard.models import LlamaConfig, LlamaForCausalLM

        fields = {f.name for f in dataclasses.fields(LlamaConfig)}
        given = {k: getattr(shape, k) for k in fields if hasattr(shape, k)}
        return LlamaForCausalLM(LlamaConfig(**{**given, "n_layers": 1}))


def _train_model(shape: ModelShape) -> tuple[str, Any]:
    """The model as train's checks see it: a preset's shape, or the transformers config that
    ``--hf-config`` names (its TP plan is the architecture's). Raises ``ValueError``."""
    if shape.hf_config is None:
        return "preset", shape
    config, error = _transformers_config(shape.hf_config)
    if error:
        raise ValueError(error)
    return "hf", config


@cache
def _transformers_config(path: str) -> tuple[Any, str]:
    """(the config, '') or (None, why train cannot read it), read once per file."""
    from layershard.models.hf import load_hf_config

    try:
        return load_hf_config(path), ""
    except ImportError as e:
        return None, f"layershard train reads --hf-config with transformers ({e})"
    except Exception as e:  # noqa: BLE001 - ValueError, or transformers' own validation
        return None, f"layershard train cannot read {path}: {' '.join(str(e).split())[:200]}"


def train_flags(s: Any) -> str:
    """The chosen row's settings as ``layershard train`` flags."""
    flags = ([f"--tp {s.tp}"] if s.tp > 1 else []) + ([f"--ep {s.ep}"] if s.ep > 1 else [])
    flags += [f"--strategy {s.strategy}", f"--micro-batch {s.micro_batch}",
              f"--grad-accum {s.grad_accum}",
              f"--activation-checkpointing {s.checkpoint_layers}"]  # fmt: skip
    if s.loss_chunks:
        flags.append(f"--loss-chunks {s.loss_chunks}")
    return " ".join(flags)
