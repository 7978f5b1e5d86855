"""Activation memory per rank under context parallelism (issue 49): at cp 2 and 4 each rank
holds ``1 / cp`` of the unsplit run's activations, within 10%, for a sequence where activations
dominate (4096 tokens through a 64-wide Llama of 4 blocks: ~75 MiB of activations against
~0.3 MiB of weights).

Measured by torch's MemTracker (``plan.measure.LiveMemory``: the bytes of every tensor created
during one forward and backward, what autograd saves and the backward's temporaries, at their
peak), on each rank of 4, for the same model sharded over the same 4 ranks without CP (each
rank the whole sequence: the unsplit run) and with ``cp`` 4, or 2 (two CP groups, one sequence
each). What the CP run holds beyond ``1 / cp`` is what is not split: the gather buffers'
views counted when first used, the ring's blocks in flight (one k/v block ahead, a dk/dv block
in backward), the all-to-all's sends. Both measured on the second step (the first allocates the
gradient storage).

Measured 2026-11-29 (torch 2.13, this machine): unsplit 75.0 MiB; cp 2 ring 0.527, all-to-all
0.530 of it; cp 4 ring 0.264, all-to-all 0.266 (4 kv heads). Held to 1.10 / cp, the issue's
bound. With 2 kv heads at cp 4 all-to-all measured 0.281: kv heads fewer than cp are repeated
to cp heads before the exchange (all_to_all.py), so each rank holds one whole-sequence kv head
where 1 / cp of the unsplit run's is half of one: the price of the replication, in
docs/context-parallel.md.
"""

from __future__ import annotations

import torch
from _dist import RankChecks
from _parity import clone, tiny_llama

import layershard as ls
from layershard.parallel.context import context_batch
from layershard.plan.measure import LiveMemory

SEQ = 4096
BOUND = 1.10  # x 1 / cp: the "within 10%"


def _peak(model, ids: torch.Tensor) -> int:
    """MemTracker's peak of activations and backward temporaries over one step (the second)."""
    batch = context_batch(model, ids, ids)
    inputs = [batch[k] for k in batch if isinstance(batch[k], torch.Tensor)]
    model(**batch).loss.backward()  # the gradient storage is allocated here
    with LiveMemory(model, inputs) as mem:
        model(**batch).loss.backward()
        return mem.peak()


def _ratios(rank: int, world: int) -> None:
    ids = torch.randint(0, 256, (1, SEQ), generator=torch.Generator().manual_seed(0))
    measured = {}
    cases = {2: [(2, "ring"), (2, "all_to_all"), (4, "ring")], 4: [(4, "all_to_all")]}
    for kv, layouts in cases.items():  # all-to-all at cp 4 with as many kv heads (module doc)
        base = tiny_llama(vocab_size=256, dim=64, n_layers=4, n_heads=4, n_kv_heads=kv,
                          ffn_dim=128, max_seq_len=SEQ)  # fmt: skip
        unsplit = _peak(ls.shard(clone(base)), ids)
        for cp, mode in layouts:
            model = ls.parallelize(clone(base), cp=cp, cp_mode=mode)
            ratio = _peak(model, ids) / unsplit
            measured[(kv, cp, mode)] = round(ratio, 3)
            assert ratio <= BOUND / cp, (kv, cp, mode, ratio)
            assert ratio >= 1 / cp, (kv, cp, mode, ratio)  # nothing dropped
    if rank == 0:
        print(f"activation memory per rank / unsplit run's: {measured}")


checks = RankChecks(world_size=4, slow=True)
checks.check(_ratios, "activation_memory_falls_as_1_over_cp")
checks.collect(globals())
