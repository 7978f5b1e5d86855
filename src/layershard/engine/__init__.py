"""The engine: how a model is split into units, each rank holding 1/N of each, and how a unit's
weights are gathered before it computes and its gradients reduced after. ``layershard.sharded``
is the façade users hold; the contract the modules here keep is docs/engine.md.

Reading order, the path of one training step: ``units`` (what a unit is) -> ``flat`` (how its
parameters are stored and sliced) -> ``build`` (what ``shard()`` assembles) -> ``schedule`` (the
hooks: gather before compute, backward triggers, the ranks' agreement) -> ``reducer`` (gradients
into slices) -> ``buffers`` / ``gather_slots`` / ``collectives`` (where the bytes go).
``strategy``, ``precision`` and ``init`` are the options; ``agreement`` and ``waits`` keep ranks in
step and say where they wait.
"""
