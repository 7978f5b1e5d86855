"""Mixed precision: the compute dtype of gathered weights, the dtype they travel in, and the dtype
gradients are reduced in.

Masters, gradient slices and optimizer state are always fp32. With ``param_dtype=bf16`` each rank
casts its slice to bf16 at every gather, straight into its chunk of the gather buffer, and
all-gathers that: half the bytes on the wire. ``gather_dtype`` (fp8 e4m3 or int8, engine/wire_dtype.py)
sends one byte per weight instead, quantized from the fp32 slice at every gather and dequantized
into ``param_dtype`` after it; ``None`` (the default) sends ``param_dtype``, exactly. Gradients are
computed in ``param_dtype``, copied (cast) into the gradient buffer in ``reduce_dtype``,
reduce-scattered and accumulated into fp32 slices; with ``reduce_dtype=bf16`` each rank's chunk
travels in bf16 and the chunks are summed in fp32, rounded to bf16 once, on every backend (an
all-to-all: collectives.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from layershard.engine.wire_dtype import GATHER_DTYPES

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype = torch.float32
    # the dtype weights travel in over the all-gather: None sends param_dtype (exact);
    # torch.float8_e4m3fn (a scale per parameter) or torch.int8 (a scale per 256) quantize
    gather_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.gather_dtype is not None and self.gather_dtype not in GATHER_DTYPES:
            raise ValueError(
                f"MixedPrecision.gather_dtype={self.gather_dtype!r} is not supported; use None "
                "(the compute dtype, exact), torch.float8_e4m3fn or torch.int8"
            )
        for field_name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, field_name)
            if dtype not in _FLOATS:
                raise ValueError(
                    f"MixedPrecision.{field_name}={dtype!r} is not supported; "
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
