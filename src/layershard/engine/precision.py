"""Mixed precision: the compute dtype of gathered weights and the dtype gradients are reduced in.

Masters, gradient slices and optimizer state are always fp32. With ``param_dtype=bf16`` each rank
keeps a bf16 copy of its slice, refreshed once per optimizer step (when the fp32 slice changed), and
all-gathers that: half the bytes on the wire. Gradients are computed in bf16, copied (cast) into the
fp32 gradient buffer, reduce-scattered in ``reduce_dtype`` and accumulated into fp32 slices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for field_name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, field_name)
            if dtype not in _FLOATS:
                raise ValueError(
                    f"MixedPrecision.{field_name}={dtype} is not supported; "
                    "use torch.float32, torch.bfloat16 or torch.float16"
                )


FULL_PRECISION = MixedPrecision(torch.float32, torch.float32)


def GradScaler(
    process_group: dist.ProcessGroup | None = None, device: str | None = None, **kwargs
) -> ShardedGradScaler:
    """A loss scaler for fp16 compute that works on gradient slices: torch's ShardedGradScaler,
    whose inf/NaN check is all-reduced so that every rank skips the same steps."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return ShardedGradScaler(device=device, process_group=process_group, **kwargs)
