"""One benchmark run: one implementation, one world size, in fresh processes under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m layershard.bench.worker --impl layershard --model small --out run.json

Every implementation builds the same model from the same seed, trains it on the same synthetic
global batches (each rank its contiguous share) with the same AdamW, and is timed the same way:
``barrier; t0; forward+backward+step+zero_grad; [cuda sync]; barrier; t1``. After the timed steps
come untimed measurement steps: one under a collective-counting dispatch mode and, on CPU, one under
``torch.distributed._tools.mem_tracker.MemTracker`` for the peak. Rank 0 writes one JSON file.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import json
import os
import sys
import time
import traceback
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from layershard.bench import (
    EP_IMPLS,
    MUON_ALTERNATIVE,
    STRATEGY_IMPL,
    TP_IMPL,
    WIRE_IMPL,
    known_impl,
    split_blocks,
)
from layershard.bench import context as cp_rows
from layershard.bench.measure import (
    CountCollectives,
    live_tensors,
    mem_tracker,
    model_state_bytes,
    ring_bytes_sent,
)

STRATEGY_IMPLS = {impl: strategy for strategy, impl in STRATEGY_IMPL.items() if strategy != "full"}
MUON_LR = 0.02  # Muon's lr in --optimizer muon runs (AdamW keeps --lr for the other parameters)


def is_layershard(impl: str) -> bool:
    impl = split_blocks(impl)[0]
    ours = ("layershard", MUON_ALTERNATIVE, "layershard-ep", TP_IMPL)
    return impl in ours or impl in STRATEGY_IMPLS or impl in WIRE_IMPL or impl in cp_rows.CP_IMPLS


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="layershard.bench.worker")
    p.add_argument("--impl", required=True, type=known_impl)
    p.add_argument("--model", default="small")
    p.add_argument(
        "--model-override", action="append", default=[], metavar="KEY=VALUE",
        help="a LlamaConfig field of the preset (e.g. dim=384)",
    )  # fmt: skip
    p.add_argument("--hf-config", default=None)
    p.add_argument("--vocab-size", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--precision", choices=["fp32", "bf16"], default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw")
    p.add_argument("--loss", choices=["inside", "outside"], default="inside")
    p.add_argument("--ep", type=int, default=1, help="expert parallel size (the *-ep impls)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (layershard-tp)")
    p.add_argument("--cp", type=int, default=1, help="context parallel size (layershard-cp-*)")
    p.add_argument("--no-mem", action="store_true", help="skip the MemTracker step")
    p.add_argument("--out", required=True, help="JSON file (written by rank 0)")
    return p.parse_args(argv)


# ---- model -----------------------------------------------------------------------------------------


def build_model(args) -> tuple[nn.Module, dict]:
    """The fp32 model on the CPU, initialized from ``args.seed``, and a description of it."""
    torch.manual_seed(args.seed)
    if args.hf_config:
        import transformers

        from layershard.bench.cli import load_hf_config

        hf = load_hf_config(args.hf_config)
        if args.vocab_size:
            hf.vocab_size = args.vocab_size
        model = transformers.AutoModelForCausalLM.from_config(
            hf, dtype=torch.float32, trust_remote_code=False
        )
        desc = {"source": "hf-config", "path": args.hf_config, "vocab_size": hf.vocab_size}
    else:
        from layershard.models import LlamaForCausalLM, build_config

        over = {"vocab_size": args.vocab_size} if args.vocab_size else {}
        for item in args.model_override:
            key, _, value = item.partition("=")
            over[key] = int(value) if value.lstrip("-").isdigit() else float(value)
        if args.seq_len > build_config(args.model).max_seq_len:
            over["max_seq_len"] = args.seq_len
        cfg = build_config(args.model, **over)
        model = LlamaForCausalLM(cfg)
        desc = {"source": "preset", "preset": args.model, **cfg.to_dict()}
    desc["params"] = sum(p.numel() for p in model.parameters())
    desc["buffer_bytes"] = sum(b.numel() * b.element_size() for b in model.buffers())
    return model, desc


def compute_loss(model: nn.Module, x: torch.Tensor, where: str) -> torch.Tensor:
    """The causal LM loss of ``x``: computed by the model (``labels=``), or from the logits it
    returns, by the caller (``outside``: what a user's own training loop does)."""
    if where == "inside":
        if getattr(model, "context_parallel", None) is not None:  # a CP row: this rank's part
            return cp_rows.loss(model, x)
        return model(x, labels=x).loss
    logits = model(x).logits
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten())


def block_list(model: nn.Module) -> nn.ModuleList:
    """The longest ``nn.ModuleList`` of same-class modules (the decoder layers)."""
    best = None
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) and len({type(c) for c in m}) == 1:
            if best is None or len(m) > len(best):
                best = m
    if best is None:
        raise ValueError("no repeated blocks (nn.ModuleList of same-class modules) found")
    return best


def final_norm_and_head(model: nn.Module) -> list[nn.Module]:
    """[final norm, output head] when the head's weight is not tied (FSDP2's second group)."""
    get_head = getattr(model, "get_output_embeddings", None)  # transformers' models have it
    head = get_head() if get_head is not None else None
    head = head or getattr(model, "lm_head", None)
    norm = None
    for name in ("norm", "model.norm", "transformer.ln_f", "model.final_layernorm"):
        with contextlib.suppress(AttributeError):
            norm = model.get_submodule(name)
            break
    mods = [m for m in (norm, head) if m is not None]
    get_emb = getattr(model, "get_input_embeddings", None)
    emb = get_emb() if get_emb is not None else None
    emb = emb or getattr(model, "embed", None)
    if head is not None and emb is not None and head.weight is emb.weight:
        mods = [m for m in mods if m is not head]  # a tied head stays with the root
    return mods


# ---- implementations -------------------------------------------------------------------------------


def wrap(impl: str, model: nn.Module, device: torch.device, bf16: bool, world: int, ep: int = 1):
    """(wrapped model, autocast context factory, notes); ``ep``: the EP, TP (layershard-tp) or
    CP (layershard-cp-*) size"""
    notes = {}
    no_autocast = contextlib.nullcontext
    if impl in cp_rows.CP_IMPLS:
        notes = {"cp": ep, "cp_mode": cp_rows.CP_IMPLS[impl]}
        return cp_rows.wrap(impl, model, device, bf16, ep), no_autocast, notes
    if impl in EP_IMPLS or impl == TP_IMPL:
        key = "tp" if impl == TP_IMPL else "ep"
        return _wrap_ep(impl, model, device, bf16, world, ep), no_autocast, {key: ep}
    if is_layershard(impl):
        import layershard as ls

        mp = ls.MixedPrecision(torch.bfloat16, torch.float32) if bf16 else None
        if impl in WIRE_IMPL:  # weights over the gather in fp8/int8, bf16 reductions
            gather, reduce = WIRE_IMPL[impl]
            mp = ls.MixedPrecision(
                torch.bfloat16 if bf16 else torch.float32,
                torch.bfloat16 if reduce == "bf16" else torch.float32,
                {"fp8": torch.float8_e4m3fn, "int8": torch.int8, None: None}[gather],
            )
            notes["wire"] = f"gather {gather or 'exact'}, reduce {reduce}"
        impl, blocks_per_unit = split_blocks(impl)
        strategy = STRATEGY_IMPLS.get(impl, "full")
        kwargs: dict = {"strategy": strategy}
        # a node's ranks on the testbed (layershard bench --nodes); else two groups: 2 x 2 at 4
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        group = local if local < world else max(1, world // 2)
        if strategy == "hybrid":
            kwargs["shard_size"] = group
            notes["groups"] = f"{world // group} x {group}"
        if strategy == "hpz":  # ZeRO++ hpZ: the backward gathers within a node
            kwargs = {"strategy": "full", "reshard_after_forward": group}
            notes["groups"] = f"hpZ over {group} of {world}"
        if blocks_per_unit > 1:
            kwargs["blocks_per_unit"] = blocks_per_unit
            notes["blocks_per_unit"] = blocks_per_unit
        model = ls.shard(model, mixed_precision=mp, device=device, **kwargs)
        return model, no_autocast, notes
    if impl == "plain":  # the unsharded model on each rank's own batch: no communication at all
        model.to(device)
        notes["precision"] = "torch.autocast(bfloat16)" if bf16 else "fp32"
        if bf16:
            return model, partial(torch.autocast, device.type, dtype=torch.bfloat16), notes
        return model, no_autocast, notes
    if impl == "fsdp2":
        from layershard.groups import device_mesh

        model.to(device)
        tail = _fully_shard(model, device_mesh(device.type, (world,), ("dp_shard",)), bf16)
        notes["groups"] = f"{len(block_list(model))} blocks, {len(tail)}-module tail, root"
        return model, no_autocast, notes
    if impl == "fsdp1":
        from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision as FSDPMixedPrecision
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        block_cls = type(block_list(model)[0])
        fsdp_mp = (
            FSDPMixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if bf16
            else None
        )
        with warnings_quiet():
            wrapped = FSDP(
                model,
                auto_wrap_policy=partial(
                    transformer_auto_wrap_policy, transformer_layer_cls={block_cls}
                ),
                sharding_strategy=ShardingStrategy.FULL_SHARD,
                backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                mixed_precision=fsdp_mp,
                device_id=device,  # torch.device("cpu") makes FSDP1 run on CPU/gloo
                use_orig_params=True,
            )
        return wrapped, no_autocast, notes
    if impl == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model.to(device)
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        if bf16:
            notes["precision"] = "torch.autocast(bfloat16), fp32 weights and gradients"
            return ddp, partial(torch.autocast, device.type, dtype=torch.bfloat16), notes
        return ddp, no_autocast, notes
    raise ValueError(impl)


def _wrap_ep(impl: str, model: nn.Module, device: torch.device, bf16: bool, world: int, ep: int):
    """Expert parallelism ``ep`` with layershard (``ls.parallelize``) or FSDP2 (``fully_shard``
    as transformers' ``apply_fully_sharded_data_parallelism`` applies it, on the same meshes
    and the same expert split)."""
    import layershard as ls
    from layershard.meshes import make_meshes
    from layershard.parallelize import split_experts

    if impl in ("layershard-ep", TP_IMPL):  # TP_IMPL: ``ep`` is the TP size
        mp = ls.MixedPrecision(torch.bfloat16, torch.float32) if bf16 else None
        sizes: dict[str, Any] = {"tp" if impl == TP_IMPL else "ep": ep}
        return ls.parallelize(model, mixed_precision=mp, device=device, **sizes)
    if impl == "transformers-ep":  # an HF MoE model: transformers applies EP and FSDP2 itself
        from transformers.distributed import DistributedConfig

        if bf16 or not hasattr(model, "maybe_distribute_model"):
            raise SystemExit("transformers-ep: an fp32 --hf-config MoE model (Qwen3-MoE, Mixtral)")
        model.to(device)
        cls: Any = type(model)  # a transformers PreTrainedModel class
        config, _, meshes = cls.prepare_distribute_model(
            DistributedConfig(fsdp_size=world, ep_size=ep)
        )
        return cls.maybe_distribute_model(model, config, meshes)
    from torch.distributed.fsdp import fully_shard

    from layershard.models.moe import Experts
    from layershard.parallel.expert import is_hf_experts

    dense, expert = make_meshes(ep=ep, device_type=device.type)
    split_experts(model, expert["ep"].get_group())
    model.to(device)
    efsdp = expert["efsdp"]
    for m in model.modules():
        if isinstance(m, Experts) or is_hf_experts(m):
            fully_shard(m, mesh=efsdp, mp_policy=_fsdp2_precision(bf16))
            m.set_gradient_divide_factor(float(world))  # type: ignore[operator]
            if efsdp.size() > 1:  # gloo refuses PREMUL_SUM: sum, then divide locally
                m.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    _fully_shard(model, dense["dp_shard"], bf16)
    return model


def _fsdp2_precision(bf16: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if bf16:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _fully_shard(model: nn.Module, mesh, bf16: bool) -> list[nn.Module]:
    """FSDP2 as the bench applies it: each block, then the final norm and head together, then
    the root, over ``mesh``; returns that tail."""
    from torch.distributed.fsdp import fully_shard

    mp_policy = _fsdp2_precision(bf16)
    for block in block_list(model):
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    tail = final_norm_and_head(model)
    if tail:
        fully_shard(tail, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return tail


@contextlib.contextmanager
def warnings_quiet():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _engine_sha1() -> str:
    """Hash of the engine's sources (src/layershard/*.py): runs made with different engine code
    can be told apart."""
    import hashlib
    from pathlib import Path

    import layershard

    h = hashlib.sha1()
    for f in sorted(Path(layershard.__file__).parent.glob("*.py")):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()[:12]


def _model_flops(desc: dict, seq_len: int, global_batch: int) -> float | None:
    """Training FLOPs of one step (the planner's 6 N T + attention), for a preset's model."""
    if desc.get("source") != "preset":
        return None
    from layershard.models import LlamaConfig
    from layershard.plan import ModelShape
    from layershard.plan.timing import model_flops

    fields = LlamaConfig.__dataclass_fields__
    cfg = LlamaConfig(**{k: v for k, v in desc.items() if k in fields})
    return model_flops(ModelShape.from_config(cfg), seq_len * global_batch, seq_len)


def _muon_notes(model, opt) -> dict:
    """Mode and Newton-Schulz FLOPs per step on the busiest rank and in all (from the shapes)."""
    from layershard.optim import newton_schulz_flops

    shapes = {s.name: s.shape for f in model.flat_params for s in f.slots}
    owners = opt.owners()
    flops = {n: newton_schulz_flops(shapes[n], opt.param_groups[0]["ns_steps"]) for n in owners}
    total = sum(flops[n] for n in owners)
    loads = [0] * model.sharding.shard_size
    for n, r in owners.items():
        loads[r] += flops[n]
    busiest = total if opt.mode == "all_gather" else max(loads, default=0)
    return {
        "mode": opt.mode,
        "lr": MUON_LR,
        "matrices": len(owners),
        "ns_flops_total": total,
        "ns_flops_busiest_rank": busiest,
    }


# ---- main ------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    faulthandler.dump_traceback_later(
        float(os.environ.get("LAYERSHARD_BENCH_WATCHDOG_S", 1800)), exit=True
    )
    cuda = torch.cuda.is_available()
    if args.threads:
        torch.set_num_threads(args.threads)
    backend = "nccl" if cuda else "gloo"
    import layershard as ls

    ls.init_distributed(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    )
    precision = args.precision or ("bf16" if cuda else "fp32")
    bf16 = precision == "bf16"
    # a TP or CP group's ranks share their batch
    tp = args.tp if args.impl == TP_IMPL else args.cp if args.impl in cp_rows.CP_IMPLS else 1
    if args.global_batch % (world // tp):
        raise SystemExit(f"--global-batch {args.global_batch} not divisible by {world // tp} ranks")
    local_b, dp_rank = args.global_batch // (world // tp), rank // tp

    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    model, desc = build_model(args)
    vocab: int = cast(Any, model.config).vocab_size  # a LlamaConfig or a transformers config
    model, autocast, notes = wrap(args.impl, model, device, bf16, world, tp if tp > 1 else args.ep)
    muon = args.optimizer == "muon"
    opt: torch.optim.Optimizer
    muon_opt: ls.optim.Muon | None = None
    if muon:
        if not is_layershard(args.impl):
            raise SystemExit(f"--optimizer muon: {args.impl} has no sharded Muon")
        mode = "all_gather" if args.impl == MUON_ALTERNATIVE else "owner"
        opt = muon_opt = ls.optim.Muon(
            model, lr=MUON_LR, adamw=dict(lr=args.lr, weight_decay=0.01), mode=mode
        )
        notes["muon"] = _muon_notes(model, muon_opt)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    n_measure = 3  # collectives step, model-state step, memory step
    total = args.warmup + args.steps + n_measure
    gen = torch.Generator().manual_seed(args.seed + 1)
    batches = []
    for _ in range(total):
        tokens = torch.randint(0, vocab, (args.global_batch, args.seq_len), generator=gen)
        batches.append(tokens[dp_rank * local_b : (dp_rank + 1) * local_b].to(device))

    opt_times: list[float] = []
    marks: list[float] = []  # when each step's backward and optimizer step began (time.time())

    def step(x, after_opt_step=None, time_opt=False):
        with autocast():
            loss = compute_loss(model, x, args.loss)
        marks.append(time.time())
        loss.backward()
        marks.append(time.time())
        if time_opt:  # every rank enters together (no backward skew) and waits for the last
            sync()
            dist.barrier()
            t = time.perf_counter()
            opt.step()
            sync()
            dist.barrier()
            opt_times.append(time.perf_counter() - t)
        else:
            opt.step()
        if after_opt_step is not None:
            after_opt_step()
        opt.zero_grad(set_to_none=True)
        return loss.detach().float()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    losses, times, walls = [], [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup and cuda:  # the peak of the timed steps
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        sync()
        t0, wall = time.perf_counter(), time.time()
        losses.append(step(batches[i], time_opt=muon))
        sync()
        dist.barrier()
        times.append(time.perf_counter() - t0)
        walls.append([wall, *marks[-2:], time.time()])  # benchmarks/links/link_timeline.py
    memory: dict = {}
    if cuda:
        memory["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
        memory["max_memory_reserved"] = torch.cuda.max_memory_reserved(device)

    # Untimed (UNTIMED_STEPS of them, bench/__init__.py): collectives of one step.
    if is_layershard(args.impl):
        model.comm_stats(reset=True)
    if muon_opt is not None:
        muon_opt.comm_stats(reset=True)
    counter = CountCollectives()
    i = args.warmup + args.steps
    try:
        with counter:
            losses.append(step(batches[i]))
        comm: dict[str, dict[str, Any]] = {
            op: {"count": counter.count[op], "bytes": counter.bytes[op]} for op in counter.count
        }
        comm_error = None
    except Exception as e:  # noqa: BLE001
        losses.append(step(batches[i]))
        comm, comm_error = {}, f"{type(e).__name__}: {e}"
    for op, d in comm.items():
        d["sent_bytes_ring"] = ring_bytes_sent(op, d["bytes"], world)
    own_comm = model.comm_stats(reset=True) if is_layershard(args.impl) else None
    optimizer_comm = muon_opt.comm_stats(reset=True) if muon_opt is not None else None

    # Untimed: peak memory of one step under MemTracker (CPU; also run on CUDA as a cross-check).
    # Model state while everything exists: after the optimizer step, before zero_grad.
    state = {}

    def measure_state():
        gc.collect()
        state.update(model_state_bytes(model, opt, is_layershard(args.impl)))

    i += 1
    losses.append(step(batches[i], measure_state))
    i += 1
    mem_error = None
    if args.no_mem:
        losses.append(step(batches[i]))
        mem_error = "skipped (--no-mem)"
    else:
        try:
            mt = mem_tracker()
            ids = {id(b) for b in batches}
            mt.track_external(model, opt, *[t for t in live_tensors() if id(t) not in ids])
            with mt:
                losses.append(step(batches[i]))
            peak = mt.get_tracker_snapshot("peak")
            snap = peak.get(device) or next(iter(peak.values()))
            memory["memtracker_peak"] = int(snap["Total"])
            memory["memtracker_breakdown"] = {
                str(k.value if hasattr(k, "value") else k): int(v) for k, v in snap.items()
            }
            del mt
        except Exception as e:  # noqa: BLE001 - report n/a with the reason
            mem_error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            traceback.print_exc()
            if len(losses) == i:
                losses.append(step(batches[i]))

    # Global mean loss per step; per-rank memory and state gathered to rank 0.
    loss_t = torch.stack(losses).to(device)
    dist.all_reduce(loss_t, op=dist.ReduceOp.SUM)
    loss_t /= world
    per_rank = [None] * world
    dist.all_gather_object(
        per_rank,
        {
            "memory": memory,
            "model_state": state,
            "mem_error": mem_error,
            "optimizer_comm": optimizer_comm,
        },
    )
    t_max = torch.tensor(times, dtype=torch.float64, device=device)  # NCCL: on the GPU
    dist.all_reduce(t_max, op=dist.ReduceOp.MAX)
    opt_max = torch.tensor(opt_times or [0.0], dtype=torch.float64, device=device)
    dist.all_reduce(opt_max, op=dist.ReduceOp.MAX)

    if rank == 0:
        result = {
            "impl": args.impl,
            "world_size": world,
            "device": device.type,
            "backend": backend,
            "precision": precision,
            "threads_per_rank": torch.get_num_threads(),
            "torch": torch.__version__,
            "model": desc,
            "seq_len": args.seq_len,
            "global_batch": args.global_batch,
            "tokens_per_step": args.seq_len * args.global_batch,
            "model_flops_per_step": _model_flops(desc, args.seq_len, args.global_batch),
            "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
            "warmup": args.warmup,
            "steps": args.steps,
            "lr": args.lr,
            "optimizer": args.optimizer,
            "opt_step_times": opt_max.cpu().tolist()[args.warmup :] if muon else None,
            "seed": args.seed,
            "step_times": t_max.cpu().tolist()[args.warmup :],
            "warmup_times": t_max.cpu().tolist()[: args.warmup],
            "step_walls": walls,  # each step (warm-ups first): start, backward, optimizer, end
            "losses": loss_t.cpu().tolist(),
            "comm_per_step": comm,
            "comm_error": comm_error,
            "comm_raw_ops": dict(counter.raw),
            "layershard_comm_stats": own_comm,
            "per_rank": per_rank,
            "notes": notes,
            "engine_source_sha1": _engine_sha1(),
            "loadavg_1min": [load_start, os.getloadavg()[0] if hasattr(os, "getloadavg") else None],
        }
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.out)
    dist.barrier()
    # The results are written: leave without tearing down gloo/FSDP state, whose C++ destructors
    # have aborted a rank at exit ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
