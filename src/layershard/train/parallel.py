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
    if cfg.tp == 1:
        return
    refused = (  # what --tp does not run with yet: (flag, given, why)
        ("--qlora", cfg.qlora, "4-bit QLoRA has no tensor-parallel plan"),
    )  # fmt: skip
    for flag, given, why in refused:
        if given:
            raise ValueError(
                f"tp {cfg.tp} is not supported with {flag} yet ({why}); drop {flag} or --tp"
            )


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
    """``--strategy hybrid`` with ``--tp`` / ``--ep``: ``shard_size`` ranks (default a node's)
    hold one replica, split ``tp`` ways and their experts ``ep`` ways (``ls.parallelize``), so
    both must divide it. Raises ``ValueError`` (one line)."""
    if cfg.strategy != "hybrid" or (cfg.tp == 1 and cfg.ep == 1):
        return
    from layershard.distributed import local_world_size

    replica = cfg.shard_size or local_world or local_world_size(world)
    for name, n in (("tp", cfg.tp), ("ep", cfg.ep)):
        if replica % n:
            raise ValueError(
                f"{name} {n} must divide the ranks of a replica ({replica}: hybrid's shard_size, "
                f"by default a node's ranks); change --{name} or --shard-size"
            )


def data_rank(cfg: Any, rank: int, world: int) -> tuple[int, int]:
    """(this rank's data-parallel index, the number of data-parallel ranks): the ``tp``
    consecutive ranks of a TP group read the same batch."""
    return rank // cfg.tp, world // cfg.tp


def shard_model(model: nn.Module, cfg: Any, options: dict[str, Any]):
    """``ls.shard(model, **options)``, or with ``tp`` / ``ep`` ``ls.parallelize``: the TP plan
    applied or the experts split first, then sharded over the data-parallel ranks."""
    import layershard as ls

    if cfg.tp > 1 or cfg.ep > 1:
        return ls.parallelize(model, tp=cfg.tp, ep=cfg.ep, **options)
    return ls.shard(model, **options)
