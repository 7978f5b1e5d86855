"""``layershard train --tp N`` / ``--ep N``: the rules of the config that concern them, the
model's own checks (made by the launcher, before it writes anything), and the sharding itself
(``ls.parallelize`` instead of ``ls.shard``).

Under ``tp`` the ranks of a TP group (``tp`` consecutive ranks, as ``ls.parallelize`` lays the
mesh out) compute one batch together: the data is split over the ``world / tp`` data-parallel
ranks (``data_rank``). ``--strategy hybrid`` replicates over nodes (``shard_size`` ranks per
replica, split ``tp`` ways: HSDP x TP). With ``--ep`` too (the built-in MoE), the attention is
TP and the experts EP (each TP rank sends its share of the shared tokens: parallel/expert.py).
What ``--tp`` does not run with yet is refused in one line: strategy no_shard and ``--qlora``.
Checkpoints (``--async-checkpoint`` too), ``--resume``, ``--init-from``, the ``final/`` export
and Muon work as without TP (checkpoint/boxes.py, optim/muon.py). A preset of 1B+ parameters
starts on the meta device under ``--tp`` too (``modeling.starts_on_meta``): ``ls.parallelize``
applies the TP plan to the meta model and ``shard()`` materializes it one unit at a time, each
rank keeping its TP part's slice.

``--cp N`` (context parallelism, the built-in presets and transformers models): each sequence
split over ``cp`` ranks (``ls.parallelize(cp=...)``, docs/context-parallel.md; with ``--tp``
the ``cp`` ranks of each TP coordinate in a block of ``cp x tp``), which read the same batch
(the data split over ``world / (cp x tp)`` ranks, as under TP) and feed the model their part of
it (``loop/context.py``); with ``--ep`` (the built-in MoE) each rank's tokens reach the experts
by EP's all-to-all. Refused in one line before launch: cp with ``--qlora``, a transformers
mixture of experts, a transformers model whose attention cannot be routed or whose sliding
window is shorter than the sequence, a ``seq_len`` not divisible by ``2 x cp``, ``cp x tp`` not
dividing the world (or hybrid's replica), ``all_to_all`` with ``n_heads`` not divisible by ``cp
x tp``, and ``--cp-mode all_to_all`` without ``--cp`` (a mode that would not be used).
"""

from __future__ import annotations

from typing import Any

from torch import nn

# (``cfg`` below is a ``train.config.TrainConfig``, which imports this module: not imported here)


def check_parallel(cfg: Any) -> None:
    """The config rules of ``tp`` and ``ep`` (a ``ValueError`` becomes the one-line error)."""
    for name, n, what in (("ep", cfg.ep, "expert"), ("tp", cfg.tp, "tensor")):
        if n > 1 and (cfg.strategy == "no_shard" or cfg.reshard_after_forward not in (True, False)):
            raise ValueError(
                f"{name} {n}: {what} parallelism runs with strategy full, grad_op or hybrid "
                "(reshard_after_forward true or false); drop --strategy/--reshard-after-forward, "
                f"or --{name}"
            )
    if cfg.ep > 1 and cfg.optimizer == "muon":
        raise ValueError(
            f"ep {cfg.ep} is not supported with --optimizer muon yet (the experts are sharded "
            "over another group than the other weights); use --optimizer adamw, or drop --ep"
        )
    check_cp(cfg)
    if cfg.tp > 1 and cfg.qlora:
        _refuse("tp", cfg.tp, "--qlora", "4-bit QLoRA has no tensor-parallel plan")


def _refuse(name: str, n: int, flag: str, why: str) -> None:
    raise ValueError(
        f"{name} {n} is not supported with {flag} yet ({why}); drop {flag} or --{name}"
    )


def check_cp(cfg: Any) -> None:
    """The config rules of ``cp`` and ``cp_mode`` (a ``ValueError`` becomes the one-line error)."""
    cp = cfg.cp
    if cp == 1:
        if cfg.cp_mode != "ring":  # the default: a mode given without --cp would do nothing
            raise ValueError(
                f"cp_mode {cfg.cp_mode} applies to context parallelism; pass --cp N (N > 1), "
                "or leave out --cp-mode"
            )
        return
    if cfg.qlora:
        _refuse("cp", cp, "--qlora", "4-bit bases are not tested under context parallelism")


def check_cp_model(cfg: Any, kind: str, spec: Any) -> None:
    """Can the model (``spec``: a preset's ``LlamaConfig`` or a transformers config) run with
    ``cfg.cp`` on ``cfg.seq_len``? Sequences that split into ``2 x cp`` chunks; not a transformers
    mixture of experts (its load-balancing loss is not split with the sequence); in ``all_to_all`` mode
    heads divisible by ``cp x tp`` (each rank attends with ``n_heads / (tp x cp)`` of them); a
    transformers model whose attention ``ls.parallelize`` can route (``hf_context.check``, on
    a meta-device copy) and whose sliding window, if any, is no shorter than the sequence.
    Raises ``ValueError`` (one line). (Checked with the model, not by the config's schema,
    which takes any ``cp`` with the default seq_len.)"""
    cp = cfg.cp
    if cp == 1:
        return
    if cfg.seq_len % (2 * cp):
        raise ValueError(
            f"seq_len {cfg.seq_len} must be divisible by 2 x cp = {2 * cp} (each sequence is "
            "cut into 2 x cp chunks, two per rank); change --seq-len or --cp"
        )
    if kind == "preset":  # (the built-in MoE's balance loss pools the CP group's routing)
        heads = spec.n_heads
    else:
        heads = spec.num_attention_heads
        if getattr(spec, "num_local_experts", 0) or getattr(spec, "num_experts", 0):
            raise ValueError(
                f"cp {cp} is not supported with a transformers mixture of experts yet (its "
                "load-balancing loss is not split with the sequence); use a dense model, a "
                "built-in preset, or drop --cp"
            )
    if cfg.cp_mode == "all_to_all" and heads % (cp * cfg.tp):
        per = " x --tp" if cfg.tp > 1 else ""
        raise ValueError(
            f"--cp-mode all_to_all: --cp {cp}{per} must divide the model's n_heads={heads} "
            f"(each rank attends with n_heads / {'(tp x cp)' if per else 'cp'} heads); use "
            "--cp-mode ring or another --cp"
        )
    if kind == "hf":
        window = getattr(spec, "sliding_window", None)
        if window and getattr(spec, "use_sliding_window", True) and window < cfg.seq_len:
            raise ValueError(
                f"cp {cp}: the model's sliding window ({window}) is shorter than seq_len "
                f"{cfg.seq_len}, which context parallelism does not run; use --seq-len {window} "
                "or less, or a model without one"
            )


def check_cp_routing(cfg: Any, model: nn.Module) -> None:
    """Can ``ls.parallelize(cp=...)`` route a transformers ``model``'s attention (built on the
    meta device)? ``hf_context.check``'s refusals, as ``ValueError`` naming ``--cp``."""
    if cfg.cp == 1:
        return
    from layershard.models import hf_context

    hf_context.check(model, f"--cp {cfg.cp}")


def check_tp_model(cfg: Any, kind: str, spec: Any) -> None:
    """Can the model be split ``cfg.tp`` ways? Its heads must divide, and it needs a TP plan:
    the built-in Llama's (a MoE block's attention part: its experts go to ``--ep`` or stay
    whole) or a transformers config's ``base_model_tp_plan`` with column- and row-wise styles
    only. Raises ``ValueError`` (one line)."""
    tp = cfg.tp
    if tp == 1:
        return
    if kind == "preset":
        if spec.n_experts and cfg.ep == 1:
            raise ValueError(
                f"--tp {tp} of a mixture of experts needs --ep too: its attention goes over TP, "
                "its experts over EP (the built-in TP plan does not split experts)"
            )
        heads = {"n_heads": spec.n_heads, "n_kv_heads": spec.n_kv_heads}
    else:
        from layershard.models.hf_tp import hf_tp_plan

        keys = ("num_attention_heads", "num_key_value_heads")
        heads = {k: getattr(spec, k) for k in keys if getattr(spec, k, None) is not None}
        try:
            hf_tp_plan(spec, experts=cfg.ep == 1)  # with --ep, EP splits the experts
        except (ValueError, NotImplementedError) as e:
            raise ValueError(f"--tp {tp}: {e}") from None
    for key, n in heads.items():
        if n % tp:
            raise ValueError(
                f"--tp {tp} must divide the model's {key}={n} (each TP rank computes "
                f"{key} / tp heads); change --tp"
            )


def check_split_shapes(cfg: Any, kind: str, model: nn.Module) -> None:
    """Can ``model`` (built on the meta device) be split ``cfg.tp`` and ``cfg.ep`` ways, with
    the plans ``ls.parallelize`` applies (models/splits.py)? Raises ``ValueError`` (one line)."""
    from layershard.models.splits import check_ep, check_tp

    try:
        check_ep(model, cfg.ep)
        if cfg.tp == 1:
            return
        if kind == "preset":
            from layershard.models.llama_tp import block_plan

            layers = model.get_submodule("layers")
            assert isinstance(layers, nn.ModuleList), "a built-in Llama's blocks"
            for i, block in enumerate(layers):
                check_tp(block, block_plan(block), cfg.tp, prefix=f"layers.{i}.")
        else:
            from layershard.models.hf_tp import hf_tp_plan

            base = model.get_submodule(getattr(model, "base_model_prefix", "model"))
            check_tp(base, hf_tp_plan(getattr(model, "config"), cfg.ep == 1), cfg.tp)  # noqa: B009
    except ValueError as e:
        raise ValueError(f"--{str(e).replace('=', ' ', 1)}") from None


def check_replica(cfg: Any, world: int, local_world: int | None) -> None:
    """``--strategy hybrid`` with ``--tp`` / ``--ep`` / ``--cp``: ``shard_size`` ranks (default a
    node's) hold one replica, split ``tp`` ways, their experts ``ep`` ways, their sequences ``cp``
    ways (``ls.parallelize``), so each must divide it. Raises ``ValueError`` (one line)."""
    if cfg.strategy != "hybrid" or cfg.tp == cfg.ep == cfg.cp == 1:
        return
    from layershard.distributed import local_world_size

    replica = cfg.shard_size or local_world or local_world_size(world)
    for name, n in (("tp", cfg.tp), ("ep", cfg.ep), ("cp", cfg.cp), ("cp x tp", cfg.cp * cfg.tp)):
        if replica % n:
            raise ValueError(
                f"{name} {n} must divide the ranks of a replica ({replica}: hybrid's shard_size, "
                f"by default a node's ranks); change --{name.replace(' x ', ' or --')} or "
                "--shard-size"
            )


def check_world(cfg: Any, world: int) -> None:
    """``tp``, ``ep`` and ``cp`` must each divide the world size. Raises ``ValueError`` (one
    line)."""
    for name, n, why in (
        ("tp", cfg.tp, "each block's weights split over tp ranks, the data over world / tp"),
        ("ep", cfg.ep, "each layer's experts split over ep ranks"),
        ("cp", cfg.cp, "each sequence split over cp ranks, the data over world / cp"),
        ("cp x tp", cfg.cp * cfg.tp, "each sequence over cp ranks of every TP coordinate"),
    ):
        if world % n:
            flag = "--cp or --tp" if name == "cp x tp" else f"--{name}"
            raise ValueError(
                f"{name} {n} must divide the world size {world} ({why}); change {flag} or "
                "--nproc-per-node / --nnodes"
            )


def group_size(cfg: Any) -> int:
    """The consecutive ranks that read one batch together: a TP group's, a CP group's, or with
    both the ``cp x tp`` ranks of a block (``meshes.context_group``)."""
    return cfg.tp * cfg.cp


def data_world(cfg: Any, world: int) -> int:
    """The number of data-parallel ranks of ``world``: each TP or CP group reads one batch."""
    return world // group_size(cfg)


def data_rank(cfg: Any, rank: int, world: int) -> tuple[int, int]:
    """(this rank's data-parallel index, the number of data-parallel ranks): the ``tp x cp``
    consecutive ranks of a TP and CP block read the same batch, as ``ls.parallelize`` lays the
    groups out (``ContextParallel.data_rank`` / ``data_size`` under CP)."""
    return rank // group_size(cfg), data_world(cfg, world)


def shard_model(model: nn.Module, cfg: Any, options: dict[str, Any]):
    """``ls.shard(model, **options)``, or with ``tp`` / ``ep`` / ``cp`` ``ls.parallelize``: the TP
    plan applied, the experts split or the model given its CP group first, then sharded over the
    data-parallel ranks (under CP, over every rank: ``dp x cp``)."""
    import layershard as ls

    if cfg.tp > 1 or cfg.ep > 1 or cfg.cp > 1:
        cp = {"cp": cfg.cp, "cp_mode": cfg.cp_mode} if cfg.cp > 1 else {}
        return ls.parallelize(model, tp=cfg.tp, ep=cfg.ep, **cp, **options)
    return ls.shard(model, **options)
