"""Optimizers that need more than the flat slices a sharded model hands out.

``ls.optim.Muon``: Muon for the blocks' 2-D weights (each matrix orthogonalized whole, by one
owner rank), AdamW for everything else; the same update rule as ``torch.optim.Muon``.
"""

from layershard.optim.muon import Muon, assign_owners, newton_schulz_flops

__all__ = ["Muon", "assign_owners", "newton_schulz_flops"]
