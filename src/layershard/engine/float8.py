"""fp8 weights handed to torchao's ``Float8Linear`` as gathered, not dequantized (issue 34).

With ``MixedPrecision(gather_dtype=torch.float8_e4m3fn)`` every weight travels as e4m3 bytes and
is dequantized into the compute dtype after the gather (wire_dtype.py). A ``Float8Linear`` would then
cast that weight back to e4m3 for its matmul. For the weight of a ``Float8Linear`` whose weight
cast is torchao's dynamic tensorwise e4m3 (its default), the engine does what torchao's FSDP2
hooks do (``fsdp_pre_all_gather``/``fsdp_post_all_gather``): each rank casts its part of the
weight with torchao's scale (``amax_to_scale`` of the weight's amax over every rank, from the
one all-reduce of every forward, wire_dtype.py), the bytes are gathered, copied into the first bytes of
the weight's place in the gather slot, and the weight the module sees is a
``Float8TrainingTensor`` over them. The matmul uses it as is; the cast the module would do is
skipped, and the bytes and scale are the ones it would compute (the amax of a whole weight is
the max of its parts'), so the forward equals ``Float8Linear`` on one process bit for bit.

Note: the bytes live in the unit's gather buffer, so the backward must read them from wherever
the unit is gathered for its backward, as for any weight: ``Float8Linear`` saves the weight for
backward, and the saved-tensor hooks (backward_hooks.py) keep a ``Float8TrainingTensor`` whose bytes
lie in the unit's buffer as a ``SavedFloat8`` (where, not the tensor), rebuilt over the buffer of
the backward's re-gather. The gradient that reaches the weight is in the compute dtype
(``AsFloat8`` passes it through), reduced like any other.

torchao is never imported here unless a model holds a ``Float8Linear`` (``sys.modules``).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from layershard.engine.param_kind import ParamKind

FP8 = torch.float8_e4m3fn


def _torchao(name: str) -> Any:
    return sys.modules.get(f"torchao.float8.{name}")


def float8_linear_class() -> type | None:
    mod = _torchao("float8_linear")
    return getattr(mod, "Float8Linear", None) if mod is not None else None


def training_tensor_class() -> type | None:
    mod = _torchao("float8_training_tensor")
    return getattr(mod, "Float8TrainingTensor", None) if mod is not None else None


def _handed_over(module: Any) -> bool:
    """Does ``module`` cast its weight as the engine can: dynamic, tensorwise, e4m3, the same
    cast for the backward's ``grad_input`` (which will use the forward's bytes), and not
    torchao's own FSDP2 weight wrapper?"""
    from torchao.float8.config import ScalingGranularity, ScalingType

    c = module.config
    casts = (c.cast_config_weight, c.cast_config_weight_for_grad_input)
    return not c.enable_fsdp_float8_all_gather and all(
        k.scaling_type is ScalingType.DYNAMIC
        and k.scaling_granularity is ScalingGranularity.TENSORWISE
        and k.target_dtype == FP8
        for k in casts
    )


class Float8Weight(ParamKind):
    """One ``Float8Linear`` weight gathered as its fp8 bytes: its module (the cast's config) and
    the scale of this forward (torchao's convention: bytes = e4m3(weight * scale)). As a
    ``ParamKind``: quantized by torchao's rule, kept as bytes after the gather, computed with as
    torchao's ``Float8TrainingTensor``."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.scale = torch.ones((), dtype=torch.float32)

    @staticmethod
    def of(slot: Any) -> Float8Weight | None:
        """The handoff for parameter ``slot`` (a ``ParamSlot``) when every use of it is the
        weight of a ``Float8Linear`` the engine can hand fp8 bytes to; else None."""
        cls = float8_linear_class()
        if cls is None or type(slot.kind) is not ParamKind:  # 4-bit, TP, experts: not handed
            return None
        mods = [u.module for u in slot.uses]
        if not all(isinstance(m, cls) and u.attr == "weight" for m, u in zip(mods, slot.uses)):
            return None
        if len({id(m) for m in mods}) != 1 or not _handed_over(mods[0]):
            return None
        return Float8Weight(mods[0])

    def set_scale(self, amax: torch.Tensor) -> None:
        from torchao.float8.float8_utils import amax_to_scale

        self.scale = amax_to_scale(amax, FP8, self.module.config.round_scales_to_power_of_2)

    def quantize(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (uint8, ``x.numel()`` bytes) <- the e4m3 bytes of ``x``, as torchao's
        ``hp_tensor_and_scale_to_float8`` computes them."""
        from torchao.float8.float8_utils import to_fp8_saturated

        scale = self.scale.to(x.device)
        out.view(FP8).copy_(to_fp8_saturated(x.to(torch.float32) * scale, FP8))

    def tensor(self, data: torch.Tensor, orig_dtype: torch.dtype) -> torch.Tensor:
        """The ``Float8TrainingTensor`` over ``data`` (e4m3) with this forward's scale."""
        from torchao.float8.float8_training_tensor import GemmInputRole

        cls = training_tensor_class()
        assert cls is not None  # a Float8Linear exists, so its module was imported
        scale = self.scale.to(data.device)
        return cls(data, scale, orig_dtype, self.module.linear_mm_config, GemmInputRole.WEIGHT)

    def bind(self, t: torch.Tensor) -> torch.Tensor:
        """The weight the module computes with, from its place in the gather buffer
        (``t``, compute dtype, whose first bytes hold the e4m3 bytes)."""
        return AsFloat8.apply(t, self)

    def set_fp8_scale(self, amax: torch.Tensor) -> None:
        self.set_scale(amax)

    def quantize_fp8(self, x: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        self.quantize(x, out)  # torchao's scale (``set_scale``), not the wire's

    def dequantize_fp8(self, q: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        out.view(torch.uint8)[: out.numel()].copy_(q)  # the bytes as they are, first in place


def bytes_of(carrier: torch.Tensor) -> torch.Tensor:
    """The e4m3 view of the first ``carrier.numel()`` bytes of ``carrier`` (contiguous), in its
    shape."""
    raw = carrier.detach().reshape(-1).view(torch.uint8)[: carrier.numel()]
    return raw.view(FP8).view(carrier.shape)


class AsFloat8(torch.autograd.Function):
    """Forward: the ``Float8TrainingTensor`` over a gathered weight's bytes. Backward: the
    weight's gradient (compute dtype) to the gathered weight, unchanged, as torchao's own cast
    (``_ToFloat8ConstrFunc``) passes it."""

    @staticmethod
    def forward(ctx, carrier: torch.Tensor, weight: Float8Weight) -> torch.Tensor:
        return weight.tensor(bytes_of(carrier), carrier.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class SavedFloat8:
    """A ``Float8TrainingTensor`` over a unit's gathered bytes that its forward saved: where its
    bytes are in the unit's buffer (byte offset, shape and strides, a transpose included) and
    what else it holds, rebuilt over the buffer of the backward (see the module's note)."""

    __slots__ = ("offset", "shape", "stride", "scale", "dtype", "config", "role", "dim")

    def __init__(self, t: Any, offset: int) -> None:
        d = t._data
        self.offset, self.shape, self.stride = offset, d.shape, d.stride()
        self.scale, self.dtype = t._scale, t._orig_dtype
        self.config, self.role, self.dim = t._linear_mm_config, t._gemm_input_role, t._axiswise_dim

    @staticmethod
    def of(t: torch.Tensor, lo: int, hi: int) -> SavedFloat8 | None:
        """``t`` kept as where its bytes are, when it is a ``Float8TrainingTensor`` whose bytes
        lie in the buffer at addresses ``[lo, hi)``; else None."""
        cls = training_tensor_class()
        if cls is None or type(t) is not cls:
            return None
        p = t._data.data_ptr()  # type: ignore[attr-defined]
        return SavedFloat8(t, p - lo) if lo <= p < hi else None

    def of_buffer(self, buffer: torch.Tensor) -> torch.Tensor:
        raw = buffer.view(torch.uint8)
        data = raw.as_strided(self.shape, self.stride, raw.storage_offset() + self.offset)
        cls = training_tensor_class()
        assert cls is not None
        return cls(data.view(FP8), self.scale, self.dtype, self.config, self.role, self.dim)
