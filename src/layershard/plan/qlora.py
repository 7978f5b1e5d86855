"""``layershard plan --qlora``: memory per GPU for a 4-bit (bitsandbytes NF4) base with LoRA
adapters, as ``ls.shard`` stores it (engine/four_bit.py):

- every linear weight of the blocks as packed bytes (0.5 byte per weight), 1/N per rank;
- its quantization state whole on every rank: absmax per block of 64 weights, 4 bytes, or with
  double quantization 1 byte plus 4 bytes per 256 of those (and the small code books);
- the other frozen parameters (embedding, LM head, norms) 1/N in the dtype the model is loaded
  in (``frozen_dtype``; default the compute dtype: ``from_pretrained(dtype=torch.bfloat16)``):
  ``ls.shard`` keeps frozen parameters in their own dtype (engine/build.py ``_by_dtype``);
- the adapters (r x (in + out) per targeted linear) as fp32 master weights, gradients and AdamW
  state, 1/N;
- two block-sized gather slots in the compute dtype holding a block's packed bytes, norms and
  adapters; the embedding or LM head gathered on its own (larger than a block) while it runs;
- activations with every block checkpointed: each block's input, one block's recompute (HF
  Llama), the largest linear dequantized in the compute dtype (one at a time), the LoRA
  intermediates, the logits and loss.

The peak adds the LM head's gathered weights and the logits, which the engine does not hold at
once (the head's weights are freed before the loss): an upper bound by that much. Not measured
on a GPU; the model-state terms are checked against ``memory_report()`` on CPU
(tests/engine/test_qlora.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from layershard.plan.memory import (
    dtype_bytes,
    layer_activation_bytes_per_token,
    logits_bytes_per_token,
)
from layershard.plan.model import ModelShape
from layershard.plan.sources import CONTEXT_BYTES, FRAGMENTATION

GIB = 1 << 30
QUANT_BLOCK = 64  # bitsandbytes' default blocksize for 4-bit weights
NESTED_BLOCK = 256  # double quantization: absmax quantized in blocks of 256
TENSOR_STATE = 16 * 4 + 256 * 4 + 4 + 64  # code book, nested code book, offset, small tensors
# AdamW's two fp32 moments
OPTIMIZER_BYTES = 8


@dataclass(frozen=True)
class QLoRASettings:
    world: int
    lora_rank: int = 16
    double_quant: bool = True
    compute_dtype: str = "bf16"
    seq_len: int = 4096
    micro_batch: int = 1
    offload: bool = False
    frozen_dtype: str | None = None  # the loaded dtype of embedding, head, norms; None: compute

    @property
    def frozen(self) -> str:
        return self.frozen_dtype or self.compute_dtype


def _linears(shape: ModelShape) -> list[tuple[int, int]]:
    """A block's linear weights as (in, out): q, k, v, o, gate, up, down."""
    d, f, hd = shape.dim, shape.ffn_dim, shape.hd
    q, kv = shape.n_heads * hd, shape.n_kv_heads * hd
    return [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]


def qlora_memory(shape: ModelShape, s: QLoRASettings) -> dict[str, int]:
    """Bytes per GPU by category (``host_*``: in host memory under offload)."""
    n, c = s.world, dtype_bytes(s.compute_dtype)
    linears = _linears(shape)
    block_4bit = sum(i * o for i, o in linears)
    block_lora = sum(s.lora_rank * (i + o) for i, o in linears)
    block_norms = shape.block_params - block_4bit
    base_4bit = shape.n_layers * block_4bit
    per_absmax = 1 + 4 / NESTED_BLOCK if s.double_quant else 4
    tensors = shape.n_layers * len(linears)
    lora = shape.n_layers * block_lora
    other_frozen = shape.total_params - base_4bit  # embedding, head, norms
    tokens = s.micro_batch * s.seq_len
    act_shape = ModelShape(**{**shape.__dict__, "family": "hf-llama"})
    largest = max(i * o for i, o in linears)
    m = {
        "packed_base": base_4bit // 2 // n,
        "quant_state": int(base_4bit / QUANT_BLOCK * per_absmax) + tensors * TENSOR_STATE,
        "frozen_other": dtype_bytes(s.frozen) * other_frozen // n,
        "adapters": 4 * lora // n,
        "adapter_grads": 4 * lora // n,
        "optimizer": OPTIMIZER_BYTES * lora // n,
        "gather_slots": 2 * (block_4bit // 2 + c * (block_norms + block_lora)),
        "large_gather": c * max(shape.embedding_params, shape.head_params),
        "grad_slots": 2 * 2 * 4 * block_lora,  # fp32 gradients and their reduce scratch
        "checkpointed_inputs": shape.n_layers * tokens * shape.dim * c,
        "block_recompute": tokens * layer_activation_bytes_per_token(act_shape, s.compute_dtype),
        "lora_activations": tokens * len(linears) * s.lora_rank * c,
        "dequantized_weight": c * largest,
        "logits": tokens * logits_bytes_per_token(shape, s.compute_dtype),
    }
    host = ("packed_base", "frozen_other", "adapters", "adapter_grads", "optimizer")
    on_host = sum(m[k] for k in host) if s.offload else 0
    m["model_states"] = sum(m[k] for k in (*host, "quant_state"))
    work = sum(m[k] for k in m if k not in (*host, "quant_state", "model_states"))
    m["peak"] = m["model_states"] - on_host + work
    m["host"] = on_host
    return m


def usable(gpu_memory: int) -> int:
    """What tensors may take: the CUDA context and the allocator's fragmentation kept aside
    (plan/sources.py)."""
    return int((gpu_memory - CONTEXT_BYTES) / (1 + FRAGMENTATION))


LABELS = {
    "packed_base": "4-bit base, packed bytes / N",
    "quant_state": "quantization state (whole per GPU)",
    "frozen_other": "embedding, head, norms / N",
    "adapters": "LoRA adapters (fp32) / N",
    "adapter_grads": "adapter gradients / N",
    "optimizer": "AdamW state / N",
    "gather_slots": "two block gather slots",
    "large_gather": "embedding / head gathered",
    "grad_slots": "adapter gradient slots",
    "checkpointed_inputs": "checkpointed block inputs",
    "block_recompute": "one block's recompute",
    "lora_activations": "LoRA intermediates (one block)",
    "dequantized_weight": "one weight dequantized",
    "logits": "logits + loss",
}


def to_dict(shape: ModelShape, s: QLoRASettings, gpu_name: str, gpu_memory: int) -> dict:
    """The plan as ``--json`` writes it (under ``qlora``)."""
    m = qlora_memory(shape, s)
    budget = usable(gpu_memory)
    return {
        "model": asdict(shape) | {"params": shape.total_params},
        "gpu": gpu_name,
        "gpu_memory_bytes": gpu_memory,
        "settings": asdict(s),
        "memory_bytes": m,
        "usable_bytes": budget,
        "fits": m["peak"] <= budget,
    }


def render(shape: ModelShape, s: QLoRASettings, gpu_name: str, gpu_memory: int) -> str:
    m = qlora_memory(shape, s)
    budget = usable(gpu_memory)
    where = " (host)" if s.offload else ""
    lines = [
        f"layershard plan --qlora: {shape.name} ({shape.total_params / 1e9:.2f}B params), "
        f"NF4{' + double quant' if s.double_quant else ''}, LoRA r={s.lora_rank} on every block "
        f"linear, {s.compute_dtype} compute",
        f"  on {s.world} x {gpu_name} ({gpu_memory / GIB:.1f} GiB), seq {s.seq_len}, "
        f"micro-batch {s.micro_batch}, every block checkpointed{', CPU offload' if s.offload else ''}",
        "",
        f"{'Memory per GPU':42s}{'GiB':>9s}",
    ]
    host = ("packed_base", "frozen_other", "adapters", "adapter_grads", "optimizer")
    for k, label in LABELS.items():
        label = label.replace("norms", f"norms ({s.frozen})") if k == "frozen_other" else label
        lines.append(f"  {label:40s}{m[k] / GIB:9.2f}{where if k in host else ''}")
    verdict = "fits" if m["peak"] <= budget else "DOES NOT FIT"
    lines += [
        f"  {'= peak on the GPU (upper bound)':40s}{m['peak'] / GIB:9.2f}",
        f"  {'usable (context, fragmentation aside)':40s}{budget / GIB:9.2f}   {verdict}",
    ]
    if s.offload:
        lines.append(f"  {'host memory per GPU':40s}{m['host'] / GIB:9.2f}")
    return "\n".join(lines)
