"""Context parallelism in the plan (``layershard plan --cp N --cp-mode ring|all_to_all``): memory,
communication and time of a rank whose sequences are split over a CP group of ``cp``
consecutive GPUs (``ls.parallelize(cp=...)``, docs/context-parallel.md).

**The layout.** ``world = dp x cp``; the weights are sharded over the whole world as without CP,
so the model states, the gathers and the reductions are the 1-D layout's on all the GPUs. A CP
group's ranks share their micro-batch: ``micro_batch`` is per CP group (as it is per TP group
with ``--tp``), and each rank holds ``T_l = micro_batch x seq / cp`` tokens of it.

**Memory** (per rank). Everything the 1-D plan charges per token is charged for ``T_l`` tokens:
the blocks' saved activations, the final norm and the head's input, the logits and the loss (or
the chunked loss's buffers). Parts that do not scale by ``1 / cp``:

- each block saves its attention's output twice: the attention returns it as (batch, heads,
  seq, hd), which it saves for its backward, and the transpose to ``wo``'s input copies it
  (without CP flash attention's output is laid out so that this is a view): ``+ c h hd`` per
  token and block; in ``all_to_all`` mode the keys and values as SDPA sees them: widened to
  ``lcm(kv, cp)`` heads when ``cp`` does not divide them, and repeated to the query heads
  where the kernel has no grouped heads (as the 1-D plan assumes: fp32), and two int64 indices
  over the whole sequence per block (``16 seq`` bytes, whatever the tokens); tested against
  the tensors autograd saves for the built-in Block on 2 ranks (tests/plan/test_plan_cp.py);
- RoPE's tables are gathered at the rank's global positions, ``2 T_l hd c`` (without CP a cast
  of the first ``seq`` rows, ``2 seq hd c``, none in fp32);
- the chunked loss's head-weight gradient (``c V d``) and the model states do not shrink;
- the attention's in-flight buffers (``cp_inflight``, held while one block's attention runs, at
  the backward's peak): ring: the K/V block in hand and the arriving one (``2 x 2 kv hd c`` per
  local token), the block repeated to the query heads (``2 h hd c``, when ``kv < h``), dK/dV in
  fp32, the block's and the arriving one (``2 x 2 kv hd 4``), and dq in fp32 (``h hd 4``);
  all-to-all: q, k, v and the output of ``h / cp`` heads over the whole sequence (k and v
  with the heads SDPA sees, above), ``2 (h + kv') hd c`` per local token.

**Compute** per rank: every linear layer, element-wise kernel and the loss on ``T_l`` tokens;
attention's quadratic part on ``(seq / cp) x seq`` (causal: half; the load-balanced layout
gives every rank the same share). Ring attention runs ``cp`` steps of two ``c x c`` blocks
(``c = seq / (2 cp)``): each of a step's ``seq / cp`` query rows meets ``c`` keys, as a row of a
causal sequence of ``2 c`` does on average, so its kernels run at the measured rate of causal
attention over ``seq / cp`` tokens (``kernels.attention_time``; an assumption: the blocks
themselves were not timed); all-to-all runs
one kernel over the whole sequence with ``h / cp`` heads.

**Communication** per layer and micro-batch (``T_l`` local tokens, ``c`` the compute dtype's
bytes), over the CP group (consecutive ranks: NVLink within a node):

    ring, forward     cp - 1 hops of the local K/V block, 2 T_l kv hd c each
    ring, backward    cp - 1 hops of the K/V block, and cp hops of its dK/dV (fp32, as
                      ring.py accumulates them: 2 T_l kv hd 4), the last one home
    all_to_all        forward: 4 all-to-alls, q (T_l h hd c), k, v (T_l kv' hd c; kv' =
                      lcm(kv, cp) when cp does not divide kv) and the output back; (cp - 1)/cp
                      of each leaves the rank; backward: the same 4
    a checkpointed layer's backward also runs its forward's again.

**Overlap.** Ring attention starts each hop before it computes with the block in hand, so a
hop hides under one block's attention (``1 / cp`` of the layer's): each step's window is that
block's attention against its hops (backward: the K/V hop and the previous step's dK/dV hop,
on the same link), with the contention of a collective beside compute as in
``plan/steptime.py``; the last dK/dV hop home is waited for before the layer's backward goes
on (exposed). All-to-all does not overlap: the attention waits for its inputs and the layer for
its output.

Refused in one line, as ``ls.parallelize`` and ``layershard train`` refuse them: a sequence not
divisible by ``2 x cp``, ``cp`` not dividing the GPUs (or hybrid's shard size), ``n_heads`` not
divisible by ``cp`` in ``all_to_all``, cp with ``--tp``/``--ep``, a mixture of experts, and
GPT-style blocks. Not modelled: the ring's merge of partial outputs and the all-to-all's layout
copies (element-wise, a few percent of attention at long sequences), packed documents' masks, and
the ring on CUDA as layershard runs it today (blockwise math, not flash kernels: see
docs/context-parallel.md); the plan assumes flash block kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from layershard.plan.hardware import Cluster
from layershard.plan.kernels import StageCompute, attention_time
from layershard.plan.memory import (
    dtype_bytes,
    layer_activation_bytes_per_token,
    predict_activations,
)
from layershard.plan.model import ModelShape
from layershard.plan.sources import KERNELS
from layershard.plan.timing import Stage, Transfer

MODES = ("ring", "all_to_all")
Xfer = tuple[float, dict[str, float]]
Window = tuple[float, list[Xfer]]  # (compute the window hides under, transfers in it)


# --- the settings ------------------------------------------------------------------------------


def add_arguments(group: Any) -> None:
    """``--cp`` and ``--cp-mode`` of ``layershard plan``."""
    group.add_argument("--cp", type=int, help="context-parallel size: each sequence split over N "
                       "consecutive GPUs (--micro-batch is then per CP group); the search then "
                       "also compares rows without it at the same global batch")  # fmt: skip
    group.add_argument("--cp-mode", choices=MODES, default=None,
                       help="context parallelism's attention: ring (default) or all_to_all")  # fmt: skip


def cp_settings(args: Any) -> dict[str, Any]:
    """``Settings``' ``cp`` and ``cp_mode`` from the flags; ``ValueError`` for a mode alone."""
    cp = args.cp or 1
    if cp == 1 and args.cp_mode not in (None, "ring"):
        raise ValueError(
            f"--cp-mode {args.cp_mode} applies to context parallelism; pass --cp N (N > 1), or "
            "leave out --cp-mode"
        )
    return {"cp": cp, "cp_mode": args.cp_mode or "ring"}


def check_cp(shape: ModelShape, cluster: Cluster, s: Any) -> None:
    """Raise ``ValueError`` (one line) for a CP setting layershard refuses or the plan cannot
    model (module docstring)."""
    cp, mode = s.cp, s.cp_mode
    if mode not in MODES:
        raise ValueError(f"--cp-mode must be ring or all_to_all, got {mode!r}")
    if cp == 1:
        return
    if cp < 1:
        raise ValueError(f"--cp must be >= 1, got {cp}")
    if s.tp > 1 or s.ep > 1:
        raise ValueError(
            f"--cp {cp} with --tp/--ep is not supported yet (layershard runs context parallelism "
            "with data parallelism only); drop --tp/--ep or --cp"
        )
    if shape.moe:
        raise ValueError(
            f"--cp {cp}: a mixture of experts is not supported with context parallelism yet (its "
            "load-balancing loss is not split with the sequence)"
        )
    if shape.gpt:
        raise ValueError(
            f"--cp {cp}: only Llama-style blocks are modelled with context parallelism"
        )
    if cluster.gpus % cp:
        raise ValueError(f"--cp {cp} does not divide the {cluster.gpus} GPUs")
    if s.seq_len % (2 * cp):
        raise ValueError(
            f"--seq-len {s.seq_len} must be divisible by 2 x cp = {2 * cp} (each sequence is cut "
            "into 2 cp equal chunks)"
        )
    if mode == "all_to_all" and shape.n_heads % cp:
        raise ValueError(
            f"--cp {cp} --cp-mode all_to_all: n_heads={shape.n_heads} must be divisible by cp; "
            "use --cp-mode ring or another --cp"
        )
    if s.strategy == "hybrid" and (s.shard_size or cluster.local) % cp:
        raise ValueError(
            f"--cp {cp} must divide hybrid's shard size {s.shard_size or cluster.local} (a CP "
            "group lies within a replica)"
        )


def modes(shape: ModelShape, cp: int) -> list[str]:
    """The CP modes layershard runs for this model at ``cp``."""
    return [m for m in MODES if m == "ring" or shape.n_heads % cp == 0]


def cp_options(
    cluster: Cluster, s: Any, options: list[dict[str, Any]], keep_strategy: bool, shape: ModelShape
) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
    """The suggestion's rows when ``s.cp > 1``: ``full`` (with and without offload; the given
    strategy with ``keep_strategy``) at ``cp`` in each mode layershard runs, and ``options``
    (the 1-D rows) without CP at the same global batch, ``micro_batch x grad_accum / cp``
    sequences per GPU; when that is not a whole number, one ``(label, reason)`` saying so."""
    base = (
        [s.strategy_kwargs()]
        if keep_strategy
        else [{"strategy": "full", "shard_size": None, "reshard_after_forward": True,
               "offload": off} for off in (False, True)]
    )  # fmt: skip
    rows = [{**b, "cp": s.cp, "cp_mode": m} for m in modes(shape, s.cp) for b in base]
    per_gpu, rest = divmod(s.micro_batch * s.grad_accum, s.cp)
    if rest:
        n = s.micro_batch * s.grad_accum * cluster.gpus // s.cp
        why = (
            f"not compared: without cp a global batch of {n} sequence{'s' * (n != 1)} is not a "
            f"whole number of sequences per GPU on {cluster.gpus} GPUs"
        )
        return rows, [("without cp", why)]
    one_d = {"cp": 1, "cp_mode": "ring", "micro_batch": per_gpu, "grad_accum": 1}
    return rows + [{**o, **one_d} for o in options], []


def train_fields(s: Any, hf_config: Any) -> dict[str, Any]:
    """``cp`` and ``cp_mode`` for a ``layershard train`` config; ``ValueError`` when train does
    not take them (a transformers model, or a train without ``--cp``)."""
    if hf_config:
        raise ValueError("layershard train runs --cp with its presets only, not --hf-config")
    from dataclasses import fields

    from layershard.train.config import TrainConfig

    if "cp" not in {f.name for f in fields(TrainConfig)}:
        raise ValueError("this layershard train has no cp option")
    return {"cp": s.cp, "cp_mode": s.cp_mode}


# --- memory ------------------------------------------------------------------------------------


def _a2a_kv_heads(shape: ModelShape, cp: int, compute_dtype: Any, repeat_kv: bool | None) -> int:
    """The kv heads per local token that all-to-all attention hands SDPA (all_to_all.py): the
    query heads where the kernel has no grouped heads (``repeat_kv``; default as the 1-D plan's
    ``predict_activations``: in fp32), else the kv heads widened to ``lcm(kv, cp)``."""
    if repeat_kv is None:
        repeat_kv = dtype_bytes(compute_dtype) == 4
    return shape.n_heads if repeat_kv else math.lcm(shape.n_kv_heads, cp)


def layer_bytes_per_token(
    shape: ModelShape,
    mode: str,
    compute_dtype: Any = "bf16",
    cp: int = 1,
    repeat_kv: bool | None = None,
) -> int:
    """Bytes one block saves for backward per local token under CP (module docstring): the 1-D
    block's with k and v as the attention keeps them (ring: their own heads; all-to-all: as
    SDPA sees them, ``_a2a_kv_heads``), and the attention's output again."""
    c = dtype_bytes(compute_dtype)
    own = layer_activation_bytes_per_token(shape, compute_dtype)  # k, v with their own heads
    if mode == "all_to_all":
        kv = _a2a_kv_heads(shape, cp, compute_dtype, repeat_kv)
        own += 2 * c * (kv - shape.n_kv_heads) * shape.hd
    return own + c * shape.n_heads * shape.hd


def layer_bytes(
    shape: ModelShape,
    mode: str,
    compute_dtype: Any,
    tokens: int,
    seq_len: int,
    cp: int = 1,
    repeat_kv: bool | None = None,
) -> int:
    """Bytes one block saves on a rank of ``tokens`` local tokens: ``layer_bytes_per_token``
    of each, and in all-to-all mode the two int64 indices over the whole sequence that its
    ``index_select`` calls save (the layout to the natural order and back)."""
    per_token = layer_bytes_per_token(shape, mode, compute_dtype, cp, repeat_kv) * tokens
    return per_token + (2 * 8 * seq_len if mode == "all_to_all" else 0)


def inflight_bytes_per_token(
    shape: ModelShape, mode: str, compute_dtype: Any = "bf16", cp: int = 1
) -> int:
    """Bytes per local token the attention holds while one block's attention runs, beyond what
    is saved (module docstring)."""
    c = dtype_bytes(compute_dtype)
    h, kv, hd = shape.n_heads, shape.n_kv_heads, shape.hd
    if mode == "all_to_all":
        return 2 * (h + _a2a_kv_heads(shape, cp, compute_dtype, None)) * hd * c
    repeated = 2 * h * hd * c if h > kv else 0
    return 2 * 2 * kv * hd * c + repeated + 2 * 2 * kv * hd * 4 + h * hd * 4


def predict_cp_activations(shape: ModelShape, s: Any) -> dict[str, int]:
    """``predict_activations``' keys for a rank of a CP group, plus ``cp_inflight``."""
    L, k = shape.n_layers, max(0, min(s.checkpoint_layers, shape.n_layers))
    c, d = dtype_bytes(s.param_dtype), shape.dim
    local = s.seq_len // s.cp
    t = s.micro_batch * local
    per_layer = layer_bytes(shape, s.cp_mode, s.param_dtype, t, s.seq_len, s.cp)
    blocks = (L - k) * per_layer + k * c * d * t + (per_layer if k else 0)
    rope = 2 * t * shape.hd * c  # cos and sin at this rank's positions, whatever the dtype
    tail = (2 * c * d + 4) * t + rope  # the final norm's input and rsqrt, the head's input
    # the logits, the loss (or the chunked loss's buffers and head gradient) of T_l tokens
    out = predict_activations(shape, s.micro_batch, local, 0, s.param_dtype,
                              loss_chunks=s.loss_chunks, loss=s.loss)  # fmt: skip
    out["activations"] = blocks + tail
    out["recompute"] = per_layer if k else 0
    out["cp_inflight"] = inflight_bytes_per_token(shape, s.cp_mode, s.param_dtype, s.cp) * t
    return out


# --- communication and time --------------------------------------------------------------------


class ContextTime:
    """``predict_time``'s additions for a CP row: each layer's CP transfers, ring attention's
    kernels at the rate of its blocks, and the windows in which the transfers hide (or not)."""

    def __init__(self, shape: ModelShape, cp: int, mode: str) -> None:
        self.shape, self.cp, self.mode = shape, cp, mode

    def kv_hop(self, micro_batch: int, seq_len: int, c: int, phase: str) -> Transfer:
        """One hop of the local K/V block (ring)."""
        sh = self.shape
        nbytes = 2 * micro_batch * seq_len // self.cp * sh.n_kv_heads * sh.hd * c
        return Transfer("send_recv", phase, "cp", self.cp, 1, nbytes)

    def layer_transfers(
        self, micro_batch: int, seq_len: int, c: int
    ) -> tuple[list[Transfer], list[Transfer]]:
        """One layer's CP transfers per micro-batch: (forward, backward)."""
        sh, cp = self.shape, self.cp
        if self.mode == "ring":
            hop = self.kv_hop(micro_batch, seq_len, c, "forward")
            back = replace(hop, phase="backward")
            grads = self.kv_hop(micro_batch, seq_len, 4, "backward")  # dK/dV, fp32
            return [hop] * (cp - 1), [back] * (cp - 1) + [grads] * cp
        t = micro_batch * seq_len // cp
        kv = sh.n_kv_heads if sh.n_kv_heads % cp == 0 else math.lcm(sh.n_kv_heads, cp)
        fwd = [Transfer("all_to_all", "forward", "cp", cp, 1, t * n * sh.hd * c)
               for n in (sh.n_heads, kv, kv, sh.n_heads)]  # fmt: skip
        return fwd, [replace(x, phase="backward") for x in fwd]

    def step_transfers(self, micro_batch: int, seq_len: int, c: int, k: int) -> list[Transfer]:
        """Every CP transfer of one micro-batch: each layer's, and a checkpointed layer's
        forward again in its backward."""
        f, b = self.layer_transfers(micro_batch, seq_len, c)
        return (f + b) * self.shape.n_layers + f * k

    def add_compute(self, sc: list[StageCompute], stages: list[Stage], gpu: Any, tokens: int,
                    seq_len: int, k: int) -> None:  # fmt: skip
        """Ring attention at the rate of its blocks (``kernels.attention_time`` over ``seq / cp``
        tokens for the same FLOPs: module docstring); all-to-all's kernel sees the whole sequence,
        as ``block_compute`` has it."""
        km = KERNELS.get(gpu.kernels) if gpu.kernels else None
        if self.mode != "ring" or km is None:
            return
        length = max(1, seq_len // self.cp)  # a step's rows each meet seq / (2 cp) keys
        sh, p = self.shape, gpu.peak_flops
        whole = attention_time(tokens, seq_len, sh.n_heads, sh.hd, p, km)
        block = attention_time(tokens * seq_len // length, length, sh.n_heads, sh.hd, p, km)
        rf, rb = block[0] / whole[0], block[1] / whole[1]
        for x, s in zip(sc, stages):
            if "attention" not in x.fwd or not s.name.startswith("layers."):
                continue
            if int(s.name.split(".")[1]) < k:
                x.bwd["recompute"] += x.fwd["attention"] * (rf - 1)
            x.fwd["attention"] *= rf
            x.bwd["attention"] *= rb

    def attention_s(
        self, x: StageCompute, s: Stage, tokens: int, seq_len: int
    ) -> tuple[float, float]:
        """A block's attention (forward, backward) on this rank: the kernel model's, or its
        share of the block's FLOPs where compute is FLOPs at an efficiency."""
        if "attention" in x.fwd:
            return x.fwd["attention"], x.bwd["attention"]
        f = 4 * seq_len * self.shape.n_heads * self.shape.hd * tokens  # timing.block_fwd_flops
        return (x.fwd_s * f / s.fwd_flops if s.fwd_flops else 0.0,
                x.bwd_s * 2 * f / s.bwd_flops if s.bwd_flops else 0.0)  # fmt: skip

    def layer_windows(self, one: Callable[[Transfer], Xfer], a_f: float, a_b: float,
                      micro_batch: int, seq_len: int, c: int) -> tuple[list[Window], list[Window]]:  # fmt: skip
        """One layer's (forward, backward) windows per micro-batch (module docstring)."""
        cp = self.cp
        if self.mode != "ring":
            f, b = self.layer_transfers(micro_batch, seq_len, c)
            return [(0.0, [one(x) for x in f])], [(0.0, [one(x) for x in b])]
        kv = one(self.kv_hop(micro_batch, seq_len, c, "forward"))
        kvb, dkv = (one(self.kv_hop(micro_batch, seq_len, n, "backward")) for n in (c, 4))
        step_f, step_b = a_f / cp, a_b / cp
        fwd = [(step_f, [kv])] * (cp - 1)
        bwd = [(step_b, [kvb])] + [(step_b, [kvb, dkv])] * (cp - 2) + [(step_b, [dkv])]
        return fwd, bwd + [(0.0, [dkv])]  # the last dK/dV hop home: nothing to hide under

    def windows(self, one: Callable[[Transfer], Xfer], sc: list[StageCompute],
                stages: list[Stage], micro_batch: int, seq_len: int, c: int,
                k: int) -> tuple[list[Window], list[Window]]:  # fmt: skip
        """Every layer's windows of one micro-batch, (forward, backward), a checkpointed
        layer's forward again in its backward."""
        fwd: list[Window] = []
        bwd: list[Window] = []
        tokens = micro_batch * seq_len // self.cp
        for x, s in zip(sc, stages):
            if not s.name.startswith("layers."):
                continue
            a_f, a_b = self.attention_s(x, s, tokens, seq_len)
            lf, lb = self.layer_windows(one, a_f, a_b, micro_batch, seq_len, c)
            fwd += lf
            bwd += lb + (lf if int(s.name.split(".")[1]) < k else [])
        return fwd, bwd

    def report(self, one: Callable[[Transfer], Xfer], links: Callable[[Transfer], dict],
               sc: list[StageCompute], stages: list[Stage], micro_batch: int, seq_len: int,
               c: int, k: int, grad_accum: int, contention: float) -> dict[str, Any]:  # fmt: skip
        """What the plan says of CP: bytes per layer per step, a hop against a block's
        attention, whether the transfers hide, the exposed and slowed time per step."""
        f, b = self.layer_transfers(micro_batch, seq_len, c)
        per_layer = grad_accum * sum(sum(links(t).values()) for t in f + b)
        i, block = next((i, s) for i, s in enumerate(stages) if s.name.startswith("layers."))
        a_f, a_b = self.attention_s(sc[i], block, micro_batch * seq_len // self.cp, seq_len)
        lf, lb = self.layer_windows(one, a_f, a_b, micro_batch, seq_len, c)
        fw, bw = self.windows(one, sc, stages, micro_batch, seq_len, c, k)
        hides = [sum(t for t, _ in xs) <= comp for comp, xs in lf + lb if comp > 0]
        exposed = sum(max(0.0, sum(t for t, _ in xs) - comp) for comp, xs in fw + bw)
        slowed = sum(contention * min(sum(t for t, _ in xs), comp) for comp, xs in fw + bw)
        out: dict[str, Any] = {
            "cp": self.cp, "mode": self.mode, "bytes_per_layer_per_step": per_layer,
            "transfers_per_layer": {"forward": len(f), "backward": len(b)},
            "block_attention_s": {"forward": a_f / self.cp, "backward": a_b / self.cp},
            "layer_attention_s": {"forward": a_f, "backward": a_b},
            "hidden": self.mode == "ring" and all(hides),
            "exposed_s_per_step": exposed * grad_accum,
            "slowed_s_per_step": slowed * grad_accum,
        }  # fmt: skip
        if self.mode == "ring":
            out["hop_s"] = {"forward": lf[0][1][0][0] if lf else 0.0,
                            "backward": max(sum(t for t, _ in xs) for _, xs in lb[:-1]),
                            "home": lb[-1][1][0][0]}  # fmt: skip
        else:
            out["all_to_all_s"] = {"forward": sum(t for t, _ in lf[0][1]),
                                   "backward": sum(t for t, _ in lb[0][1])}  # fmt: skip
        return out


# --- the plan's text ---------------------------------------------------------------------------


def render_lines(plan: Any) -> list[str]:
    """The CP section of ``layershard plan``'s text."""
    s, r, sh = plan.settings, plan.time.context, plan.shape
    ms = 1e3
    local = s.seq_len // s.cp
    lines = [
        f"Context parallelism: cp {s.cp}, {s.cp_mode} (groups of {s.cp} consecutive GPUs, "
        f"{plan.time.comm_groups.get('cp_ring' if s.cp_mode == 'ring' else 'cp_all_to_all', '')})",
        f"  micro-batch {s.micro_batch} per CP group: each GPU holds {local} of each sequence's "
        f"{s.seq_len} tokens",
    ]
    mb = r["bytes_per_layer_per_step"] / 1e6
    hidden = "yes" if r["hidden"] else "no"
    lines.append(f"  {s.cp_mode}: {mb:.1f} MB per layer per step, hidden under attention: {hidden}")
    bf, bb = r["block_attention_s"]["forward"] * ms, r["block_attention_s"]["backward"] * ms
    if s.cp_mode == "ring":
        h = r["hop_s"]
        lines += [
            f"    a K/V hop {h['forward'] * ms:.3f} ms against a block's attention {bf:.3f} ms "
            f"(forward); K/V + dK/dV {h['backward'] * ms:.3f} ms against {bb:.3f} ms (backward)",
            f"    the last dK/dV hop home waits: {h['home'] * ms:.3f} ms per layer and pass",
        ]
    else:
        a = r["all_to_all_s"]
        n = r["transfers_per_layer"]
        lines.append(
            f"    all-to-all does not overlap: per layer {n['forward']} all-to-alls forward "
            f"{a['forward'] * ms:.3f} ms, {n['backward']} backward {a['backward'] * ms:.3f} ms; "
            f"its attention {r['layer_attention_s']['forward'] * ms:.3f} / "
            f"{r['layer_attention_s']['backward'] * ms:.3f} ms"
        )
    slowed = r["slowed_s_per_step"]
    lines.append(
        f"  exposed per step {r['exposed_s_per_step']:.3f} s"
        + (f", compute slowed beside the hops {slowed:.3f} s" if s.cp_mode == "ring" else "")
        + f"; in-flight attention buffers {plan.memory['cp_inflight'] / 2**30:.2f} GiB"
    )
    if s.cp_mode == "ring":
        lines.append(
            "  (planned with flash block kernels; layershard's ring runs blockwise math on CUDA "
            "today: docs/context-parallel.md)"
        )
    if sh.family == "hf-llama":
        lines.append("  (--hf-config: layershard train runs --cp with its presets only)")
    return lines
