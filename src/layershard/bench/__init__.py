"""``layershard bench``: layershard against torch FSDP2, FSDP1 and DDP on the same model, data,
seed, global batch, precision and world size, each run in fresh processes under torchrun.

The worker (``layershard.bench.worker``) runs one implementation and writes one JSON file; the CLI
(``layershard.bench.cli``) launches the runs, alternating implementations over repeats, and
``layershard.bench.report`` aggregates them into a table, ``results.json`` and ``bench.png``.
"""

IMPLS = ("layershard", "fsdp2", "fsdp1", "ddp")
