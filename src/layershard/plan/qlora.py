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

Three memory levers, each optional and exact (docs/qlora.md): the chunked loss (``loss_chunks``:
``ls.chunked_loss``, the logits never whole), the checkpointed block inputs in host memory
(``offload_activations``: ``ls.hf.qlora.offload_checkpointed_inputs``, one block's input back on
the GPU for its recompute), and ``ls.CPUOffload`` (``offload``: the packed base and every slice in
pinned host memory, gathered to the GPU unit by unit). ``largest_seq`` is the longest sequence
that fits with each; ``render`` prints them as a table.

The model-state terms by layer and outside the layers (``qlora_terms``) equal the bytes a rank
holds at Llama-3-8B's and Llama-3-70B's true widths, measured on the fake process group
(tests/plan/test_plan_qlora_widths.py, benchmarks/qlora/widths.py).

The peak adds the LM head's gathered weights and the logits, which the engine does not hold at
once (the head's weights are freed before the loss): an upper bound by that much. Not measured
on a GPU; the model-state terms are checked against ``memory_report()`` on CPU
(tests/engine/test_qlora.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from layershard.plan.memory import (
    chunked_logits_bytes,
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
    offload_activations: bool = False  # the checkpointed block inputs in host memory
    loss_chunks: int = 0  # the chunked loss in K chunks (0: the logits whole)

    @property
    def frozen(self) -> str:
        return self.frozen_dtype or self.compute_dtype


def _linears(shape: ModelShape) -> list[tuple[int, int]]:
    """A block's linear weights as (in, out): q, k, v, o, gate, up, down."""
    d, f, hd = shape.dim, shape.ffn_dim, shape.hd
    q, kv = shape.n_heads * hd, shape.n_kv_heads * hd
    return [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]


STATE_KINDS = (
    "packed_base",
    "quant_state",
    "frozen_other",
    "adapters",
    "adapter_grads",
    "optimizer",
)


def qlora_terms(shape: ModelShape, s: QLoRASettings) -> dict[str, dict[str, float]]:
    """Model-state bytes per GPU: ``layer``, what each block adds, and ``fixed``, what does not
    grow with the depth (the embedding, head and final norm, the gather slots, the largest unit
    gathered). The quantization state is whole on every GPU; the rest 1/N."""
    n, c, fz = s.world, dtype_bytes(s.compute_dtype), dtype_bytes(s.frozen)
    linears = _linears(shape)
    block_4bit = sum(i * o for i, o in linears)
    block_lora = sum(s.lora_rank * (i + o) for i, o in linears)
    block_norms = shape.block_params - block_4bit
    per_absmax = 1 + 4 / NESTED_BLOCK if s.double_quant else 4
    outside = shape.total_params - shape.n_layers * shape.block_params  # embedding, head, norm
    layer = {
        "packed_base": block_4bit / 2 / n,
        "quant_state": block_4bit / QUANT_BLOCK * per_absmax + len(linears) * TENSOR_STATE,
        "frozen_other": fz * block_norms / n,
        "adapters": 4 * block_lora / n,
        "adapter_grads": 4 * block_lora / n,
        "optimizer": OPTIMIZER_BYTES * block_lora / n,
    }
    fixed = {
        "frozen_other": fz * outside / n,
        "gather_slots": 2 * (block_4bit // 2 + c * (block_norms + block_lora)),
        "large_gather": c * max(shape.embedding_params, shape.head_params),
    }
    return {"layer": layer, "fixed": fixed}


def qlora_memory(shape: ModelShape, s: QLoRASettings) -> dict[str, int]:
    """Bytes per GPU by category (``host``: what is in host memory under the offloads)."""
    c = dtype_bytes(s.compute_dtype)
    terms = qlora_terms(shape, s)
    layer, fixed = terms["layer"], terms["fixed"]
    linears = _linears(shape)
    block_lora = sum(s.lora_rank * (i + o) for i, o in linears)
    tokens = s.micro_batch * s.seq_len
    act_shape = ModelShape(**{**shape.__dict__, "family": "hf-llama"})
    largest = max(i * o for i, o in linears)
    m = {k: int(shape.n_layers * layer[k] + fixed.get(k, 0)) for k in STATE_KINDS}
    m |= {
        "gather_slots": int(fixed["gather_slots"]),
        "large_gather": int(fixed["large_gather"]),
        "grad_slots": 2 * 2 * 4 * block_lora,  # fp32 gradients and their reduce scratch
        "checkpointed_inputs": shape.n_layers * tokens * shape.dim * c,
        # under offload_activations: the input of the block being recomputed, back on the GPU
        "input_reloaded": tokens * shape.dim * c if s.offload_activations else 0,
        "block_recompute": tokens * layer_activation_bytes_per_token(act_shape, s.compute_dtype),
        "lora_activations": tokens * len(linears) * s.lora_rank * c,
        "dequantized_weight": c * largest,
        "logits": (
            chunked_logits_bytes(shape, tokens, s.loss_chunks, s.compute_dtype)
            if s.loss_chunks  # the head is frozen: no weight gradient at the loss
            else tokens * logits_bytes_per_token(shape, s.compute_dtype)
        ),
    }
    host = HOST_KINDS if s.offload else ()
    host += ("checkpointed_inputs",) if s.offload_activations else ()
    on_host = sum(m[k] for k in host)
    m["model_states"] = sum(m[k] for k in STATE_KINDS)
    work = sum(m[k] for k in m if k not in (*STATE_KINDS, "model_states"))
    m["peak"] = m["model_states"] + work - on_host
    m["host"] = on_host
    return m


HOST_KINDS: tuple[str, ...] = (
    "packed_base", "frozen_other", "adapters", "adapter_grads", "optimizer",
)  # fmt: skip
# The levers, each added to those above it (``replace`` on the settings)
LEVERS: tuple[tuple[str, dict], ...] = (
    ("none", {"offload": False, "offload_activations": False, "loss_chunks": 0}),
    ("+ chunked loss (8 chunks)", {"loss_chunks": 8}),
    ("+ checkpointed inputs on host", {"offload_activations": True}),
    ("+ CPUOffload (base, states on host)", {"offload": True}),
)
SEQ_STEP = 256


def largest_seq(shape: ModelShape, s: QLoRASettings, gpu_memory: int) -> int:
    """The longest sequence (a multiple of ``SEQ_STEP``, at most the model's context) whose
    peak fits ``gpu_memory``; 0 if none does. The peak grows with the sequence: bisection."""
    budget = usable(gpu_memory)

    def fits(seq: int) -> bool:
        return qlora_memory(shape, replace(s, seq_len=seq))["peak"] <= budget

    lo, hi = 0, shape.max_seq_len // SEQ_STEP
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * SEQ_STEP) else (lo, mid - 1)
    return lo * SEQ_STEP


def levers(shape: ModelShape, s: QLoRASettings, gpu_memory: int) -> list[dict]:
    """For each lever in turn (with those above it): the peak at ``s.seq_len``, host memory
    per GPU and the largest sequence that fits."""
    rows: list[dict] = []
    changes: dict = {}
    for label, change in LEVERS:
        changes |= change
        t = replace(s, **changes)
        m = qlora_memory(shape, t)
        rows.append({
            "levers": label, "peak_bytes": m["peak"], "host_bytes": m["host"],
            "largest_seq": largest_seq(shape, t, gpu_memory),
        })  # fmt: skip
    return rows


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
    "input_reloaded": "one block input back from host",
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
        "largest_seq": largest_seq(shape, s, gpu_memory),
        "levers": levers(shape, s, gpu_memory),
    }


def _seq(seq: int, shape: ModelShape) -> str:
    if seq == 0:
        return "none"
    return f"{seq} (the model's context)" if seq + SEQ_STEP > shape.max_seq_len else str(seq)


def render(shape: ModelShape, s: QLoRASettings, gpu_name: str, gpu_memory: int) -> str:
    m = qlora_memory(shape, s)
    budget = usable(gpu_memory)
    on = [("CPU offload", s.offload), ("checkpointed inputs on host", s.offload_activations),
          (f"chunked loss ({s.loss_chunks} chunks)", s.loss_chunks > 0)]  # fmt: skip
    lines = [
        f"layershard plan --qlora: {shape.name} ({shape.total_params / 1e9:.2f}B params), "
        f"NF4{' + double quant' if s.double_quant else ''}, LoRA r={s.lora_rank} on every block "
        f"linear, {s.compute_dtype} compute",
        f"  on {s.world} x {gpu_name} ({gpu_memory / GIB:.1f} GiB), seq {s.seq_len}, "
        f"micro-batch {s.micro_batch}, every block checkpointed"
        + "".join(f", {what}" for what, yes in on if yes),
        "",
        f"{'Memory per GPU':42s}{'GiB':>9s}",
    ]
    host = (HOST_KINDS if s.offload else ()) + (
        ("checkpointed_inputs",) if s.offload_activations else ()
    )
    for k, label in LABELS.items():
        if k == "input_reloaded" and not s.offload_activations:
            continue
        label = label.replace("norms", f"norms ({s.frozen})") if k == "frozen_other" else label
        lines.append(f"  {label:40s}{m[k] / GIB:9.2f}{' (host)' if k in host else ''}")
    verdict = "fits" if m["peak"] <= budget else "DOES NOT FIT"
    lines += [
        f"  {'= peak on the GPU (upper bound)':40s}{m['peak'] / GIB:9.2f}",
        f"  {'usable (context, fragmentation aside)':40s}{budget / GIB:9.2f}   {verdict}",
    ]
    if host:
        lines.append(f"  {'host memory per GPU':40s}{m['host'] / GIB:9.2f}")
    lines += [
        f"  largest sequence that fits: {_seq(largest_seq(shape, s, gpu_memory), shape)}",
        "",
        f"Levers (each with those above)        {'peak GiB':>9s}{'host GiB':>9s}"
        f"  largest sequence (micro-batch {s.micro_batch})",
    ]
    for row in levers(shape, s, gpu_memory):
        lines.append(
            f"  {row['levers']:36s}{row['peak_bytes'] / GIB:9.2f}{row['host_bytes'] / GIB:9.2f}"
            f"  {_seq(row['largest_seq'], shape)}"
        )
    return "\n".join(lines)
