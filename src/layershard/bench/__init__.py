"""``layershard bench``: layershard against torch FSDP2, FSDP1 and DDP on the same model, data,
seed, global batch, precision and world size, each run in fresh processes under torchrun.

The worker (``layershard.bench.worker``) runs one implementation and writes one JSON file; the CLI
(``layershard.bench.cli``) launches the runs, alternating implementations over repeats, and
``layershard.bench.report`` aggregates them into a table, ``results.json`` and ``bench.png``.
"""

import re

# Steps a worker runs after the timed ones (collectives counted, model state measured, memory
# tracked or not): what crosses a testbed's links during a run is per all of its steps.
UNTIMED_STEPS = 3

# The implementations a bench compares, in the order of its tables: layershard's strategies
# ("layershard" is "full"), torch's, and the unsharded model on each rank with no communication.
IMPLS = (
    "layershard",
    "layershard-grad_op",
    "layershard-no_shard",
    "layershard-hybrid",
    "layershard-hpz",
    "layershard-bf16r",
    "layershard-fp8",
    "layershard-fp8-bf16r",
    "layershard-int8",
    "layershard-int8-bf16r",
    "layershard-muon-allgather",
    "layershard-ep",
    "layershard-tp",
    "layershard-cp-ring",
    "layershard-cp-all_to_all",
    "fsdp2",
    "fsdp2-ep",
    "transformers-ep",
    "fsdp1",
    "ddp",
    "plain",
)
# With --optimizer muon, "layershard" runs ls.optim.Muon (one owner per matrix) and this one the
# simple alternative (every rank gathers and orthogonalizes every matrix).
MUON_ALTERNATIVE = "layershard-muon-allgather"
# Expert parallelism (``--ep N``, issue 32): layershard through ``ls.parallelize(model, ep=N)``,
# and torch FSDP2 with the same expert split, applied as transformers' DistributedConfig applies
# it (experts fully_shard-ed over efsdp, divided by the whole data-parallel size), and, for an HF
# MoE model (--hf-config), transformers' own DistributedConfig(fsdp_size=world, ep_size=N).
EP_IMPLS = ("layershard-ep", "fsdp2-ep", "transformers-ep")
# Tensor parallelism (``--tp N``): layershard through ``ls.parallelize(model, tp=N)``, the model's
# TP plan over N ranks that share each batch, sharded over the world / N others.
TP_IMPL = "layershard-tp"
# Context parallelism (``--cp N --cp-mode ...``): layershard through ``ls.parallelize(model,
# cp=N, cp_mode=...)``, each sequence split over N ranks that share each batch (bench/context.py);
# the implementation's name says the mode.
CP_IMPLS = {"layershard-cp-ring": "ring", "layershard-cp-all_to_all": "all_to_all"}
STRATEGY_IMPL = {
    "full": "layershard",
    "grad_op": "layershard-grad_op",
    "no_shard": "layershard-no_shard",
    "hybrid": "layershard-hybrid",
    "hpz": "layershard-hpz",  # full, each unit kept 1/K over a node's K ranks for the backward
}

# layershard (full) with wire dtypes (issue 34): the gather dtype and, with "-bf16r", gradients
# reduced in bf16 with fp32 sums. ``layershard bench --gather-dtype fp8 --reduce-dtype bf16``.
WIRE_IMPL = {
    "layershard-bf16r": (None, "bf16"),
    "layershard-fp8": ("fp8", "fp32"),
    "layershard-fp8-bf16r": ("fp8", "bf16"),
    "layershard-int8": ("int8", "fp32"),
    "layershard-int8-bf16r": ("int8", "bf16"),
}


def wire_impl(gather: str | None, reduce: str) -> str | None:
    """The implementation name of a wire option (None: exact, the plain "layershard")."""
    if gather is None and reduce == "fp32":
        return None
    return "layershard" + (f"-{gather}" if gather else "") + ("-bf16r" if reduce == "bf16" else "")


# layershard with K consecutive blocks per unit (``--blocks-per-unit K``: ``ls.shard(
# blocks_per_unit=K)``), one collective for K blocks: "-bK" after a layershard implementation's
# name ("layershard-b2", "layershard-grad_op-b4").
def split_blocks(impl: str) -> tuple[str, int]:
    """(the implementation without its "-bK", K); K is 1 without one."""
    m = re.fullmatch(r"(layershard.*)-b([1-9][0-9]*)", impl)
    if m and int(m[2]) > 1:
        return m[1], int(m[2])
    return impl, 1


def impl_order(impl: str) -> tuple[int, int]:
    """Where ``impl`` goes in a table: ``IMPLS``' order, each with its "-bK" rows after it."""
    base, k = split_blocks(impl)
    return (IMPLS.index(base) if base in IMPLS else len(IMPLS), k)


def known_impl(impl: str) -> str:
    """``impl`` if the bench knows it (argparse's ``type``)."""
    base, k = split_blocks(impl)
    if base not in IMPLS or (k > 1 and base not in STRATEGY_IMPL.values()):
        raise ValueError(impl)
    return impl
