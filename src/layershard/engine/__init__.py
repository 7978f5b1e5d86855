"""The engine: how a model is split into units, each rank holding 1/N of each, and how a unit's
weights are gathered before it computes and its gradients reduced after. ``layershard.sharded``
is the façade users hold; the contract the modules here keep is docs/engine.md.

Read in the order of one training step:

1. ``units``: what a unit is (the repeated blocks, the units beside them, tied parameters);
   ``model_checks``: what ``shard()`` refuses before it builds anything.
2. ``flat``: a unit's parameters as one flat tensor, padded, each rank's slice of it;
   ``param_kind``: what else the engine asks of a parameter (plain, or one of the kinds below).
3. ``build``: what ``shard()`` assembles (storage, slots, units, collectives, the schedule);
   ``init``: the shards filled, or materialized from the meta device unit by unit.
4. ``schedule``: the hooks (gather before compute, prefetch, backward triggers), with ``order``
   (what follows each unit), ``backward_hooks`` (what tells a unit's backward begins or ends),
   ``backward_pass`` (one backward's state: the ranks' plan, deferred reductions) and
   ``block_runs`` (a unit of several blocks runs them in order).
5. ``reducer``: gradients into this rank's fp32 slices.
6. Where the bytes go: ``buffers`` (gather and gradient slots), ``gather_slots`` (which unit
   takes which slot, arithmetic the planner shares), ``collectives`` (all-gather and
   reduce-scatter across torch versions and backends), ``gloo_routes`` (on gloo, how a group's
   bytes cross between nodes: lanes, and routes by node).

The options: ``options`` (their types, checked where they enter), ``strategy`` (full, grad_op,
no_shard, hybrid, hpZ), ``precision`` (mixed precision, fp16's scaler), ``wire_dtype`` (fp8/int8
gathers). The kinds of parameter
(``param_kind``): ``four_bit`` (4-bit weights as packed bytes), ``dtensor`` (tensor-parallel
DTensor shards), ``float8`` (fp8 bytes handed to torchao's ``Float8Linear``). Keeping the ranks
in step: ``agreement`` (one rank's failure raises on every rank) and ``waits`` (what a blocked
thread waits for, which the watchdog reports).
"""
