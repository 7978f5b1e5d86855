"""Fault tolerance across replica groups, on torchft (``pip install layershard[ft]``).

Each replica group shards the model with ``ls.shard`` over its own ranks (its own
``torch.distributed`` world); the gradient slices are averaged across the groups of this step's
quorum through torchft's ``Manager``; the optimizer steps only where torchft says the step
commits; a group that (re)joins receives its ranks' slices, optimizer state, step and data
position live from a healthy peer (torchft's checkpoint transport)::

    import layershard as ls
    model = ls.shard(model)                               # over this group's ranks
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ft = ls.ft.FaultTolerant(model, opt, replica_id=f"group{g}")   # TORCHFT_LIGHTHOUSE set
    while ft.step_count < steps:
        ft.zero_grad()                                    # this step's quorum (asynchronous)
        x = batch(g, ft.data_position)                    # this group's data at the shared position
        model(x, labels=x).loss.backward()                # reduce-scattered within the group
        ft.step(max_norm=1.0)                             # averaged across groups; steps if committed

See docs/fault-tolerance.md.
"""

try:
    import torchft  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError(f"layershard.ft needs torchft ({e}); pip install 'layershard[ft]'") from e

from layershard.ft.replicas import Event, FaultTolerant, FTState, lighthouse_server

__all__ = ["Event", "FTState", "FaultTolerant", "lighthouse_server"]
