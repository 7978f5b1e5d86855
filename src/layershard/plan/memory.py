"""Per-GPU memory: model states (exactly as layershard lays them out) and activations.

Model states, per rank, for the ``full`` strategy (ZeRO-3, what ``shard()`` does). N = world
size; every unit's flat tensor is padded to a multiple of N and each rank holds
``S_u = ceil(numel_u / N)``; ``S = sum_u S_u`` (~P/N), ``U_max`` = padded numel of the largest
non-root unit, ``R`` = padded numel of the root unit (0 without tied/root-owned parameters),
``G_max`` = padded numel of the largest unit including the root (the root unit shares the
gradient slots), ``c`` = bytes per element of the compute (param) dtype, ``r`` = of the reduce dtype:

    params          4 S                 fp32 master shards
    grads           4 S                 fp32 sharded gradients
    optimizer       K_opt S' + 4 n_t    AdamW: exp_avg + exp_avg_sq per parameter view = 8 S'
                                        (S' = S without the padding) + a 4-byte ``step`` per
                                        parameter tensor (n_t of them)
    gather_buffers  c (U_0 + U_1 + S + R)  two gather slots, each sized for the units that take
                                        turns in it, a slot per small unit (S: their sum; the
                                        engine's buffers.assign_gather_slots), + the root unit's
    grad_buffers    2 r G_max           two gradient slots taken in turn (held during backward only)
    reduce_scratch  2 r max_u S_u       each gradient slot's reduce-scatter output (NCCL, fp32);
                    (2 r G_max)         on gloo, or a 16-bit r, each slot's all-to-all receive
                                        buffer; held during backward only
    large_gather    c L_max             the gathered weights of a unit larger than every block
                                        (an embedding or LM head of a large vocabulary): storage
                                        of its own, held only while it runs, one at a time
    large_grad      r (L_max + X)       its gradient buffer and reduce scratch X (L_max on gloo
                                        or 16-bit r, L_max / N otherwise), from its reduction to
                                        the next one
    module_buffers  4 * 2 T hd          Rotary's fp32 cos/sin tables (T = max_seq_len)
    no_sync         4 sum_u N S_u       unsharded fp32 accumulators, only if ``no_sync()`` was used

Here U_0, U_1, G_max and S_u count only units up to the largest block (B_max); larger ones
(``L_max``: the largest of them) never size a shared slot (``engine/gather_slots.py``).

Every parameter starts at a multiple of 8 elements and every rank's slice is a multiple of 8
elements (``layershard.engine.flat.ALIGN``), so ``S_u`` includes small alignment gaps. There is no
compute-dtype copy of the shard: each gather casts the fp32 shard into its own chunk of the
gather buffer.

The model-state part is the ZeRO paper's ``(2 + 2 + K) Psi / N_d`` with a different split: the
paper keeps fp16 params (2) and fp16 grads (2) and puts the fp32 master into K = 12; layershard
keeps fp32 grads (4), the fp32 master (4) and Adam (8): 16 bytes/param/N whatever the compute
dtype, plus buffers that do not shrink with N. ``zero_paper_model_states`` and ``bytes_per_param`` show
both.
"""

from __future__ import annotations

from typing import Any

from layershard.engine.gather_slots import (
    assign_gather_slots,
    own_numel,
    released_numel,
    slot_limit,
    slot_numels,
)
from layershard.plan.model import ModelShape, units

GB = 10**9  # the ZeRO paper's GB

# The keys of ShardedModule.memory_report(), in order ("total" is their sum).
STATE_KEYS = (
    "params",
    "grads",
    "optimizer",
    "gather_buffers",
    "grad_buffers",
    "reduce_scratch",
    "large_gather",
    "large_grad",
    "module_buffers",
    "no_sync",
)

# Bytes per token and dim that transformers' Llama-style blocks save beyond ours: each of
# the two RMSNorms keeps its input cast to fp32 (bf16/fp16 compute; tests/plan/test_plan_memory.py)
HF_NORM_EXTRA = 8

# Optimizer state bytes per parameter (fp32 states).
OPTIMIZER_BYTES = {"adamw": 8, "adamw-fused": 8, "adam": 8, "sgd": 4, "sgd-nomomentum": 0}

# shard(strategy=...) names; "full" is what the engine implements, the others are for comparison.
STRATEGIES = ("full", "grad_op", "no_shard", "hybrid")
_STRATEGY_ALIASES = {"zero3": "full", "zero2": "grad_op", "ddp": "no_shard", "hsdp": "hybrid"}


def strategy_name(strategy: str) -> str:
    """``full`` / ``grad_op`` / ``no_shard`` (also accepts ``zero3`` / ``zero2`` / ``ddp``)."""
    name = _STRATEGY_ALIASES.get(strategy, strategy)
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; known: {', '.join(STRATEGIES)}")
    return name


_DTYPE_BYTES = {
    "fp32": 4, "float32": 4, "float": 4,
    "bf16": 2, "bfloat16": 2,
    "fp16": 2, "float16": 2, "half": 2,
}  # fmt: skip


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a ``torch.dtype`` or a name such as ``"bf16"`` / ``"float32"``."""
    if dtype is None:
        return 4
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int):
        return itemsize
    name = str(dtype).removeprefix("torch.").lower()
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; use fp32, bf16 or fp16")
    return _DTYPE_BYTES[name]


def optimizer_bytes(optimizer: str) -> int:
    key = optimizer.lower()
    if key not in OPTIMIZER_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZER_BYTES)}")
    return OPTIMIZER_BYTES[key]


# --- the ZeRO paper ----------------------------------------------------------------------------


def zero_paper_model_states(psi: float, nd: int, k: int = 12, stage: int = 3) -> float:
    """Model-state bytes per device from Rajbhandari et al. 2020 (ZeRO), Figure 1 / Section 5.

    ``psi`` parameters, ``nd`` data-parallel degree, ``k`` optimizer bytes per parameter
    (12 for mixed-precision Adam: fp32 params, momentum, variance); fp16 params and grads.

        stage 0 (baseline DP):   (2 + 2 + K) Psi
        stage 1 (P_os):          2 Psi + 2 Psi + K Psi / Nd
        stage 2 (P_os+g):        2 Psi + (2 + K) Psi / Nd
        stage 3 (P_os+g+p):      (2 + 2 + K) Psi / Nd

    Psi = 7.5B, Nd = 64, K = 12 gives 120 GB, 31.4 GB, 16.6 GB and 1.88 GB (the paper's Figure 1).
    """
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return 2 * psi + 2 * psi + k * psi / nd
    if stage == 2:
        return 2 * psi + (2 + k) * psi / nd
    if stage == 3:
        return (2 + 2 + k) * psi / nd
    raise ValueError(f"ZeRO stage must be 0..3, got {stage}")


def bytes_per_param(param_dtype: Any = "bf16", optimizer: str = "adamw") -> dict[str, int]:
    """layershard's sharded model-state bytes per parameter (multiply by P / N), next to the
    ZeRO paper's 2 + 2 + K split of the same total, with fp32 grads. The compute dtype changes
    nothing here: gathers cast the fp32 shard (no compute-dtype copy is kept)."""
    dtype_bytes(param_dtype)  # validates the name
    out = {
        "params": 4,
        "grads": 4,
        "optimizer": optimizer_bytes(optimizer),
    }
    out["total"] = sum(out.values())
    return out


# --- layershard's layout -----------------------------------------------------------------------


def receives_whole_units(backend: str, reduce_bytes: int) -> bool:
    """Does a reduce-scatter receive every rank's whole chunk (an all-to-all, then a local sum)?
    On gloo, and for 16-bit reductions on every backend (``Comm.by_all_to_all``)."""
    return backend == "gloo" or reduce_bytes < 4


def predict_memory(
    config: Any,
    world_size: int,
    param_dtype: Any = "bf16",
    reduce_dtype: Any = "fp32",
    optimizer: str | None = "adamw",
    strategy: str = "full",
    no_sync: bool = False,
    rank: int = 0,
    backend: str = "nccl",
    shard_size: int | None = None,
    reshard_after_forward: bool | int = True,
    offload: bool = False,
    blocks_per_unit: int = 1,
) -> dict[str, int]:
    """Per-rank bytes of layershard's model states, keyed as ``ShardedModule.memory_report()``,
    for every strategy of ``ls.shard`` (byte for byte, tested).

    ``config`` is a ``layershard.models.LlamaConfig`` or a ``ModelShape``; dtypes are
    ``torch.dtype`` or names (``"bf16"``). ``optimizer=None`` leaves out the ``optimizer`` key, as
    ``memory_report()`` without an optimizer does. ``no_sync`` adds the unsharded gradient
    accumulators that ``ShardedModule.no_sync()`` allocates. ``rank`` (global) matters only for
    the optimizer state, which is per parameter view and so skips the padding on the last ranks
    of a shard group. Activations are not included (see ``predict_activations``).
    ``backend="gloo"`` (CPU) reduce-scatters through an all-to-all, and so does a 16-bit
    ``reduce_dtype`` on every backend (fp32 sums): its ``reduce_scratch`` receives whole units,
    not shards.

    ``blocks_per_unit``: K blocks per unit (``ls.shard(blocks_per_unit=K)``): the buffers
    sized for units of K blocks.

    ``strategy``: ``full`` (ZeRO-3; ``reshard_after_forward=K`` adds each unit's 1/K kept for
    the backward), ``grad_op`` (ZeRO-2: a gather buffer per unit, the whole model in the compute
    dtype), ``hybrid`` (``full`` within groups of ``shard_size`` ranks) or ``no_shard`` (nothing
    sharded; in fp32 the model computes on its own weights, with no gather buffer).
    ``offload`` moves params, grads and optimizer state to CPU memory; the bytes are the same.
    """
    shape = ModelShape.from_config(config)
    strategy = strategy_name(strategy)
    n = int(world_size)
    if n < 1:
        raise ValueError("world_size must be >= 1")
    if strategy == "hybrid":
        s_n = int(shard_size or n)
        if n % s_n:
            raise ValueError(f"shard_size={s_n} must divide world_size={n}")
    else:
        s_n = 1 if strategy == "no_shard" else n
    shard_rank = rank % s_n
    c = dtype_bytes(param_dtype)
    r = dtype_bytes(reduce_dtype)
    k_opt = 0 if optimizer is None else optimizer_bytes(optimizer)
    # torch's Adam/AdamW keep a 4-byte fp32 ``step`` tensor per parameter
    adam = optimizer is not None and optimizer.lower() in ("adam", "adamw", "adamw-fused")
    step_bytes = 4 * shape.n_param_tensors if adam else 0
    us = units(shape, blocks_per_unit)  # K blocks per unit: buffers of K blocks

    # compute on the shards themselves: one rank per shard group, fp32, not offloaded
    in_place = s_n == 1 and c == 4 and not offload
    root = 0 if in_place else sum(u.padded_numel(s_n) for u in us if u.persistent)
    sharded = [u for u in us if not u.persistent]
    others = [u.padded_numel(s_n) for u in sharded]
    blocks = [u.kind == "block" for u in sharded]
    # units larger than every block size no shared buffer (the engine's build.py)
    limit = slot_limit(others, blocks)
    large_gather = 0
    if strategy in ("grad_op", "no_shard"):  # every unit keeps its own buffer
        gathered = 0 if in_place else sum(others)
    else:  # two slots taken in turn, a slot of its own per small unit, storage of its own per
        # unit larger than a block (the engine's own rule)
        lookup = bool(sharded) and not sharded[0].needs_weights_in_backward
        which = assign_gather_slots(others, lookup, blocks)
        gathered = sum(slot_numels(which, others).values())
        large_gather = own_numel(which, others)
    k = (
        1
        if reshard_after_forward is True or reshard_after_forward is False
        else int(reshard_after_forward)
    )
    if k > 1 and strategy == "full" and k < n:  # the 1/K kept from forward to backward
        gathered += sum(
            u.padded_numel(s_n) // k for u in us if not u.persistent and u.needs_weights_in_backward
        )

    # gradient slots: two taken in turn, sized for the largest unit up to a block; one buffer
    # at a time for a larger unit, of its size (with its scratch)
    def scratch(u) -> int:
        if s_n == 1:
            return 0
        whole = receives_whole_units(backend, r)
        return u.padded_numel(s_n) if whole else u.shard_numel(s_n)

    shared = [u for u in us if u.padded_numel(s_n) <= limit]
    big = max((u for u in us if u.padded_numel(s_n) > limit), key=lambda u: u.padded_numel(s_n),
              default=None)  # fmt: skip
    out = {
        "params": 4 * sum(u.shard_numel(s_n) for u in us),
        "grads": 4 * sum(u.shard_numel(s_n) for u in us),
        "optimizer": k_opt * sum(u.local_numel(s_n, shard_rank) for u in us) + step_bytes,
        "gather_buffers": c * (gathered + root),
        "grad_buffers": 2 * r * max((u.padded_numel(s_n) for u in shared), default=0),
        "reduce_scratch": 2 * r * max((scratch(u) for u in shared), default=0),
        "large_gather": c * large_gather,
        "large_grad": 0 if big is None else r * (big.padded_numel(s_n) + scratch(big)),
        "module_buffers": 4 * shape.rope_buffer_numel,
        "no_sync": 4 * sum(u.padded_numel(s_n) for u in us) if no_sync else 0,
    }
    if optimizer is None:
        del out["optimizer"]
    out["total"] = sum(out.values())
    return out


# --- activations -------------------------------------------------------------------------------


def layer_activation_bytes_per_token(
    shape: ModelShape, compute_dtype: Any = "bf16", repeat_kv: bool = False
) -> int:
    """Bytes one Llama block saves for backward per token, counted tensor by tensor for
    ``layershard.models.llama.Block`` (the method of Korthikanti et al. 2022, "Reducing
    Activation Recomputation in Large Transformer Models", Sec. 4.1), with fused SDPA
    (flash / memory-efficient attention: no s^2 term, only a fp32 log-sum-exp per head).

    With c = bytes of the compute dtype, d = dim, f = ffn_dim, h = heads, kv = kv heads,
    hd = head_dim:

        2 RMSNorms    2 x (their input c d + its fp32 rsqrt 4): ``_RMSNormFunction`` keeps no
                      fp32 copy of the input and no normalized input
        attention     norm output c d (shared by wq/wk/wv)  +  q c h hd  +  k, v 2 c kv hd as
                      SDPA sees them (grouped heads are not repeated; h instead of kv with
                      ``repeat_kv``: a kernel without grouped heads, see below)  +  SDPA output
                      c h hd (wo's input is a view of it)  +  log-sum-exp 4 h
        SwiGLU MLP    norm output c d  +  w1 x (silu input) c f  +  silu(w1 x) c f
                      +  w3 x c f  +  the product (w2 input) c f

        total = c (4 d + 2 (h + kv) hd + 4 f) + 8 + 4 h

    For bf16, h hd = d and kv = h that is 16 d + 8 f + 8 + 4 h (Korthikanti's GPT block: 34 d
    with f = 4 d, dropout masks and GELU instead of SwiGLU; HF's ``LlamaForCausalLM`` saves 8 d
    more: each RMSNorm's fp32 input copy and normalized input). tests/plan/test_plan.py checks it
    exactly against the tensors autograd saves (``saved_tensors_hooks``) for the reference Block,
    and tests/engine/test_activation_memory.py the whole model against torch's MemTracker.
    ``repeat_kv``: the model repeats k and v when the SDPA kernel that runs has no grouped heads
    (``llama._native_gqa``; e.g. fp32 on CUDA, where flash attention does not run).
    """
    c = dtype_bytes(compute_dtype)
    d, f, h, hd = shape.dim, shape.ffn_dim, shape.n_heads, shape.hd
    kv = h if repeat_kv else shape.n_kv_heads
    if shape.gpt:
        # LayerNorms: input c d + fp32 mean and rstd (8) each; Wqkv's input (the norm's
        # output); q, k, v as one storage; the attention output (out_proj's input) and its
        # log-sum-exp; the MLP's input, GELU's input and output (up's output, down's input)
        return c * (4 * d + (h + 2 * kv) * hd + h * hd + 2 * f) + 16 + 4 * h
    own = c * (4 * d + 2 * (h + kv) * hd + 4 * f) + 8 + 4 * h
    if shape.moe:
        # The MLP's c (d + 4 f) becomes the MoE's (models/moe.py): the norm output c d; per
        # token the router's fp32 softmax 4 E, top-k indices 8 k, top-k values 4 k and their sum
        # 4; per routed token (k per token) the expert's input rows c d, gate_up's output 2 c f,
        # silu's c f, the product c f, down's output c d, the weighted output c d (index_add
        # keeps its source), its fp32 weight 4 and the (token, slot) indices 16.
        e, k, fe = shape.n_experts, shape.top_k, shape.moe_ffn_dim
        own += c * d + 4 * e + 12 * k + 4 + k * (c * (3 * d + 4 * fe) + 20) - c * (d + 4 * f)
    # transformers' RMSNorm keeps its input cast to fp32 and the normalized fp32 input
    return own + (HF_NORM_EXTRA * d if shape.family == "hf-llama" else 0)


def logits_bytes_per_token(
    shape: ModelShape, compute_dtype: Any = "bf16", loss: str = "fp32"
) -> int:
    """Peak bytes per token of the LM head's output and the loss (``causal_lm_loss``), reached
    at the start of the loss's backward, before any unit's backward (so before the gradient
    slots exist): the logits in the compute dtype c V (the caller holds the output), the fp32
    log-softmax cross-entropy saves 4 V, and two fp32 gradients 8 V (nll_loss's and
    log-softmax's, both alive while log-softmax's backward runs). The forward's own peak is
    lower: c V + 8 V with the fp32 cast of bf16/fp16 logits (freed after log-softmax), c V + 4 V
    in fp32 (no copy is made), + 8 for the shifted labels. Plus two fp32 scalars per step (the
    loss and nll_loss's total weight), not counted. Measured with MemTracker in
    tests/engine/test_activation_memory.py.

    ``loss="fused"`` (flash-attn's fused cross-entropy, llm-foundry's default): the logits and
    their gradient in the compute dtype, 2 c V, and an fp32 log-sum-exp."""
    c = dtype_bytes(compute_dtype)
    if loss == "fused":
        return 2 * c * shape.vocab_size + 4
    return (c + 12) * shape.vocab_size


def chunked_logits_bytes(
    shape: ModelShape, tokens: int, chunks: int, compute_dtype: Any = "bf16"
) -> int:
    """Peak bytes of the chunked loss (``layershard.loss``, ``loss_chunks=K``) beyond the LM
    head's input, except the head's weight gradient (``loss_head_grad_bytes``), for ``tokens``
    tokens; reached in its backward, which goes ``v = ceil(V / K)`` vocabulary rows at a time.
    With T = tokens, c = bytes of the compute dtype:

        saved for backward   16 T     int64 targets, fp32 log-sum-exp, fp32 target mask
        hidden-state grad    4 d T    summed over the chunks in fp32
        row scales           4 T      fp32
        one chunk, 16-bit    max((c + 4) v T + 12 T, c v T + c d T): the chunk's logits
                             and their fp32 copy, with the targets' columns (int64) and
                             -1 entries (fp32) of that chunk; later the gradient cast to c and
                             its product with the weight rows, in c
        one chunk, fp32      4 v T + 12 T (no copies; the product is added in place)

    The plain loss's ``(c + 12) V`` per token becomes about ``(c + 4) V / K + 4 d + 32`` (8 B
    a token for fp32 logits); the forward (``ceil(T / K)`` tokens at a time) holds no gradient
    and peaks lower. Plus three fp32 scalars per step, not counted. Measured with MemTracker in
    tests/engine/test_chunked_loss.py."""
    c = dtype_bytes(compute_dtype)
    t = int(tokens)
    v = -(-shape.vocab_size // int(chunks))
    d = shape.dim
    if c == 4:
        chunk = 4 * v * t + 12 * t
    else:
        chunk = max((c + 4) * v * t + 12 * t, c * v * t + c * d * t)
    return 16 * t + 4 * d * t + 4 * t + chunk


def loss_head_grad_bytes(shape: ModelShape, compute_dtype: Any = "bf16") -> int:
    """The LM head's weight gradient in the compute dtype, c V d: the chunked loss's backward
    returns it whole, so it is alive at the loss's peak (the plain loss's is made later, in the
    head's own backward, and counted there as a unit's gradients)."""
    return dtype_bytes(compute_dtype) * shape.vocab_size * shape.dim


def predict_activations(
    config: Any,
    micro_batch: int,
    seq_len: int,
    checkpoint_layers: int = 0,
    compute_dtype: Any = "bf16",
    repeat_kv: bool | None = None,
    loss_chunks: int = 0,
    loss: str = "fp32",
) -> dict[str, int]:
    """Peak activation bytes per rank, at the start of backward (all saved tensors alive).

    - Blocks: ``(L - k) * A`` for the non-checkpointed layers plus ``k * c d`` (only the block
      input is kept for the ``k`` checkpointed layers) plus one more ``A`` while a checkpointed
      layer recomputes its forward (if ``k > 0``); ``A = layer_activation_bytes_per_token * b s``.
    - Outside the blocks: the final RMSNorm (its input c d and rsqrt 4 per token), the LM head's
      input (c d), and the RoPE tables in a 16-bit compute dtype (2 s hd c, shared by all blocks:
      casts of Rotary's fp32 buffers; in fp32 they are views of the buffers, in
      ``module_buffers``).
    - Logits: ``logits_bytes_per_token`` per token, or with ``loss_chunks=K`` the chunked loss's
      ``chunked_logits_bytes``, and then also a key ``loss_head_grad``: the head's weight
      gradient, alive at the chunked loss's peak.

    ``repeat_kv`` (default: only in fp32, as on CUDA, where flash attention, the kernel with
    grouped heads, runs 16-bit dtypes only): see ``layer_activation_bytes_per_token``.
    """
    shape = ModelShape.from_config(config)
    L = shape.n_layers
    k = max(0, min(int(checkpoint_layers), L))
    c = dtype_bytes(compute_dtype)
    if repeat_kv is None:
        repeat_kv = c == 4
    tokens = int(micro_batch) * int(seq_len)
    per_layer = layer_activation_bytes_per_token(shape, compute_dtype, repeat_kv) * tokens
    blocks = (L - k) * per_layer + k * c * shape.dim * tokens + (per_layer if k else 0)
    rope = 0 if c == 4 or shape.gpt else 2 * int(seq_len) * shape.hd * c
    tail = (2 * c * shape.dim + (8 if shape.gpt else 4)) * tokens + rope
    # the block a checkpointed layer recomputes exists in backward only (the loss's peak is
    # before it): "activations" counts it (the larger of the two), "recompute" says how much
    out = {"activations": blocks + tail, "recompute": per_layer if k else 0}
    if loss_chunks:
        out["logits"] = chunked_logits_bytes(shape, tokens, loss_chunks, compute_dtype)
        out["loss_head_grad"] = loss_head_grad_bytes(shape, compute_dtype)
    else:
        out["logits"] = logits_bytes_per_token(shape, compute_dtype, loss) * tokens
    return out


def unit_grad_bytes(
    config: Any, world_size: int, compute_dtype: Any = "bf16", blocks_per_unit: int = 1
) -> int:
    """The largest unit's unsharded gradients as autograd hands them over (compute dtype), alive
    in backward until they are copied into a gradient slot: the backward peak's transient."""
    shape = ModelShape.from_config(config)
    us = units(shape, blocks_per_unit)
    return dtype_bytes(compute_dtype) * max(u.padded_numel(int(world_size)) for u in us)


def released_between_passes(
    config: Any,
    world_size: int,
    param_dtype: Any = "bf16",
    strategy: str = "full",
    shard_size: int | None = None,
    blocks_per_unit: int = 1,
) -> int:
    """Bytes of ``gather_buffers`` given back from the forward's last unit to backward: the two
    slots in turns, except the last unit's weights if it takes one of them (the engine's
    buffers.py, "between the passes"). 0 where backward gathers nothing (grad_op, no_shard)."""
    strategy = strategy_name(strategy)
    if strategy in ("grad_op", "no_shard"):
        return 0
    s_n = int(shard_size or world_size) if strategy == "hybrid" else int(world_size)
    shape = ModelShape.from_config(config)
    sharded = [u for u in units(shape, blocks_per_unit) if not u.persistent]
    if not sharded:
        return 0
    others = [u.padded_numel(s_n) for u in sharded]
    lookup = not sharded[0].needs_weights_in_backward
    which = assign_gather_slots(others, lookup, [u.kind == "block" for u in sharded])
    return dtype_bytes(param_dtype) * released_numel(which, others)


def peak_bytes(
    mem: dict[str, int],
    act: dict[str, int],
    unit_grads: int,
    released: int = 0,
    step_temps: int = 0,
) -> int:
    """Per-rank peak of a steady-state step (optimizer state already allocated), the largest of:

    - at the loss (its forward, and its backward, which runs before any unit's backward):
      model states without the gradient slots and their reduce scratch (they exist only during
      a unit's backward) and, at the plain loss, without the gather bytes given back between
      the passes (``released``: ``released_between_passes``; the chunked loss runs inside the
      head's call, before they are) + activations + logits (+ the head's weight gradient under
      the chunked loss, whose backward is also the head's);
      The fp32 gradient shards are not there yet (``zero_grad(set_to_none=True)``, torch's
      default, freed them; measured with MemTracker, tests/plan/test_plan_memory.py), nor the block
      a checkpointed layer recomputes in backward (``act["recompute"]``);
    - backward, at a unit's post-backward: model states + the activations still saved (at most
      all of them, a recomputing block's too) + that unit's unsharded gradients
      (``unit_grad_bytes``); the gradient shards are allocated unit by unit as activations are
      freed, so either the activations (its first units) or the shards (its last) are counted;
      under context parallelism also the attention's in-flight buffers (``act["cp_inflight"]``,
      plan/context.py), held while the first unit's attention runs its backward;
    - the optimizer step: model states without the backward's buffers + the optimizer's
      temporaries (``step_temps``: ``optimizer_step_temporaries``).

    Units larger than a block (``large_gather``, ``large_grad``) hold their storage only while
    they run: none at the plain loss (the head's weights are freed after its forward), the
    head's weights at the chunked loss (it runs inside the head's call, backward included), and
    in backward either a large unit's weights or its gradient buffer (the weights are freed
    before its gradients are copied out), beside the gradient slots.
    """
    return sum(peak_parts(mem, act, unit_grads, released, step_temps)[1].values())


def optimizer_step_temporaries(optimizer: str, mem: dict[str, int]) -> int:
    """Bytes torch's foreach AdamW (``torch.optim.AdamW()`` on a GPU, the default) allocates
    while it steps: two fp32 tensors the size of the whole shard (measured with layershard's
    engine on the H100: benchmarks/plan/accuracy/h100/engine.json, the peak of llama-7b at
    micro-batch 1 is the device states + 2 x the fp32 shard, within 0.7%). Fused and
    per-tensor implementations (``adamw-fused``) hold at most one tensor's."""
    return 2 * mem.get("params", 0) if optimizer.lower() in ("adam", "adamw") else 0


def peak_parts(
    mem: dict[str, int],
    act: dict[str, int],
    unit_grads: int,
    released: int = 0,
    step_temps: int = 0,
) -> tuple[str, dict[str, int]]:
    """Where the peak is ("at the loss" or "in backward") and what it holds, by kind, adding
    up to ``peak_bytes`` (``layershard plan --explain``)."""
    states = mem["total"]
    large_gather, large_grad = mem.get("large_gather", 0), mem.get("large_grad", 0)
    backward_only = mem["grad_buffers"] + mem.get("reduce_scratch", 0) + large_grad
    chunked = "loss_head_grad" in act  # the loss runs inside the head's call
    grads = mem.get("grads", 0)
    forward = {
        "model states": states,
        "gradient slots (backward only)": -backward_only,
        "gather bytes given back at the loss": -(0 if chunked else large_gather + released),
        "gradient shards (freed by zero_grad(set_to_none=True))": -grads,
        "activations": act["activations"] - act.get("recompute", 0),
        "logits + loss": act["logits"],
        "head weight grad (chunked loss)": act.get("loss_head_grad", 0),
    }
    large = max(large_gather, large_grad) - large_gather - large_grad
    # in backward the gradient shards are allocated unit by unit as they are reduced, while the
    # activations are freed unit by unit: the most of both is at one end of it
    backward = {
        "model states": states,
        "gradient shards (allocated unit by unit in backward)": -grads,
        "large unit: weights or gradients, one at a time": large,
        "activations": act["activations"],
        "attention's in-flight buffers (context parallelism)": act.get("cp_inflight", 0),
        "one unit's unsharded gradients": unit_grads,
    }
    backward_end = {
        "model states": states,
        "large unit: weights or gradients, one at a time": large,
        "one unit's unsharded gradients": unit_grads,
    }
    step = {  # optimizer_step_temporaries
        "model states": states,
        "gradient slots (backward only)": -backward_only,
        "large unit: weights (freed)": -large_gather,
        "optimizer step temporaries (foreach AdamW)": step_temps,
    }
    where = max(
        (
            ("at the loss", forward),
            ("in backward, its first units", backward),
            ("in backward, its last units", backward_end),
            ("at the optimizer step", step),
        ),
        key=lambda kv: sum(kv[1].values()),
    )
    return where[0], {k: v for k, v in where[1].items() if v}
