"""The GPU suite: ``pytest -m gpu`` (skipped without CUDA). One GPU runs it all in minutes.

Every test that shards runs twice: at world size 1 as usual ("copy": gathers are copies) and with
``LAYERSHARD_FORCE_COMM=1`` ("comm": the same collectives, comm stream and events as N > 1, NCCL
over one rank). Two ranks cannot share one GPU under NCCL, so the two-rank test runs gloo with
CUDA tensors. ``LAYERSHARD_GPU_REPORT=DIR`` writes the measured figures (overlap, exposed
communication, memory) as JSON files there. ``LAYERSHARD_GPU_TESTS_ON_CPU=1`` runs the tests that
can run on the CPU (no streams, no CUDA memory), to check the suite itself without a GPU.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from _parity import EPS, SPREAD_FACTOR, loss_bound, max_diff, param_bound, train_in_orders

import layershard as ls
from layershard.models import LlamaConfig, LlamaForCausalLM

ON_CPU = os.environ.get("LAYERSHARD_GPU_TESTS_ON_CPU") == "1"
HAS_CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_CUDA and not ON_CPU, reason="needs CUDA (pytest -m gpu)"),
]
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="CUDA only (streams, kernels, memory)")
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

# ~134M parameters: embed and head 32000 x 768 each, 12 blocks of 7.1M
GPU_LLAMA = dict(
    vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048,
    max_seq_len=512,
)  # fmt: skip
SMALL = dict(vocab_size=512, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=256, max_seq_len=128)  # fmt: skip


def _report(name: str, data: dict) -> None:
    out = os.environ.get("LAYERSHARD_GPU_REPORT")
    print(f"{name}: {json.dumps(data)}", flush=True)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(data, indent=1))


@pytest.fixture(scope="module", autouse=True)
def one_rank():
    if HAS_CUDA:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity means fp32 GEMMs
        torch.backends.cudnn.allow_tf32 = False
    created = not dist.is_initialized()
    if created:
        ls.init_distributed(backend="nccl" if HAS_CUDA else "gloo")
    yield
    if created:
        dist.destroy_process_group()


@pytest.fixture(params=["copy", "comm"])
def comm_path(request, monkeypatch):
    monkeypatch.setenv("LAYERSHARD_FORCE_COMM", "1" if request.param == "comm" else "0")
    return request.param


def _llama(cfg: dict, seed: int = 0, **over) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**cfg, **over})).to(DEVICE)


def _batches(n: int, vocab: int, batch: int, seq: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g).to(DEVICE) for _ in range(n)]


def _train_pair(model, reference, batches, lr=1e-3, step_fn=None):
    """Train the sharded model and the reference on the same batches; returns the worst relative
    loss difference and the reference's losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=lr)
    worst, ref_losses = 0.0, []
    for x in batches:
        loss = (step_fn or _plain_step)(model, x)
        opt.step()
        opt.zero_grad()
        ref_loss = _plain_step(reference, x)
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, abs(loss - ref_loss) / abs(ref_loss))
        ref_losses.append(ref_loss)
    return worst, ref_losses


def _orders(base, batches, parts: int, lr: float = 1e-3):
    def adamw(m):
        return [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr)]

    return train_in_orders(base, batches, parts, optimizers=adamw)


def _bound(base, reference, batches, parts: int, lr: float = 1e-3) -> float:
    """How far from the reference a sharded run may land: the spread of the reference trained in
    other legitimate orders of its sums on this device (tests/_parity.py, param_bound)."""
    return param_bound(reference, *_orders(base, batches, parts, lr))


def _plain_step(model, x) -> float:
    loss = model(x, labels=x).loss
    loss.backward()
    return loss.item()


# ---- exactness ------------------------------------------------------------------------------------
@needs_cuda
def test_fp32_parity_100m(comm_path):
    base = _llama(GPU_LLAMA)
    reference, model = copy.deepcopy(base), ls.shard(copy.deepcopy(base))
    data = _batches(20, GPU_LLAMA["vocab_size"], 4, 512)
    worst, ref_losses = _train_pair(model, reference, data)
    dev, where = max_diff(model.full_state_dict(cpu=False), reference)
    # Both bounds from the reference trained in other legitimate orders on this GPU: its first
    # run (H100, 2026-11-26) put the losses 1.5e-5 and 2.2e-5 (relative) from the reference
    # where the test allowed a fixed 1e-5, with the weights at 0.45x their bound.
    runs = _orders(base, data, 1)
    bound, lbound = param_bound(reference, *runs), loss_bound(ref_losses, runs)
    _report(f"fp32_parity_{comm_path}", {"loss_rel": worst, "loss_bound": lbound,
                                         "param_max_abs": dev, "at": where, "bound": bound})  # fmt: skip
    assert worst <= lbound, (worst, lbound)
    assert dev <= bound, (dev, where, bound)


def _relative_distance(a: dict, b: torch.nn.Module, start: dict) -> float:
    num = sum(
        ((a[n].float() - p.detach().float()) ** 2).sum().item() for n, p in b.named_parameters()
    )
    den = sum(((p.detach().float() - start[n]) ** 2).sum().item() for n, p in b.named_parameters())
    return math.sqrt(num / den)


def _bf16_reference(base, batches, micro: int, lr: float = 1e-3):
    """MixedPrecision(bf16)'s numerics on one process: each step the fp32 masters are cast to a
    bf16 copy of the model, which computes the loss and its gradients in bf16 (in ``micro``
    micro-batches, their gradients summed in fp32); the summed gradients step the fp32 masters
    with AdamW. Returns the masters and each step's loss."""
    masters = copy.deepcopy(base)
    opt = torch.optim.AdamW(masters.parameters(), lr=lr)
    losses = []
    for x in batches:
        shadow = copy.deepcopy(masters).to(torch.bfloat16)
        total = 0.0
        for xm in x.chunk(micro):
            loss = shadow(xm, labels=xm).loss / micro
            loss.backward()
            total += loss.item()
            for p, b in zip(masters.parameters(), shadow.parameters()):
                p.grad = b.grad.float() if p.grad is None else p.grad + b.grad.float()
            shadow.zero_grad(set_to_none=True)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return masters, losses


def _bf16_parity(cfg: dict, steps: int, batch: int, seq: int, device) -> dict:
    """layershard's bf16 compute against ``_bf16_reference`` in one micro-batch; bounds: the
    same reference in two micro-batches (another legitimate order of its sums)."""
    base = _llama(cfg).to(device)
    model = ls.shard(copy.deepcopy(base), mixed_precision=ls.MixedPrecision(torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [x.to(device) for x in _batches(steps, cfg["vocab_size"], batch, seq)]
    ours = []
    for x in data:
        ours.append(_plain_step(model, x))
        opt.step()
        opt.zero_grad()
    ref, ref_losses = _bf16_reference(base, data, 1)
    other, other_losses = _bf16_reference(base, data, 2)
    worst = max(abs(a - r) / abs(r) for a, r in zip(ours, ref_losses))
    spread = max(abs(a - r) / abs(r) for a, r in zip(other_losses, ref_losses))
    full = model.full_state_dict(cpu=False)
    dev, where = max_diff(full, ref)
    return {
        "loss_rel": worst,
        "loss_bound": SPREAD_FACTOR * spread + EPS,
        "param_max_abs": dev,
        "at": where,
        "bound": param_bound(ref, other),
    }


@needs_cuda
def test_bf16_parity(comm_path):
    """bf16 compute with fp32 masters against the same numerics on one process
    (``_bf16_reference``), within the spread of that reference's legitimate orders. (It was
    compared with torch.autocast, whose residual stream and norms stay fp32: the first GPU run
    put our weights 0.262 from it, farther than an fp32 run's 0.250, which compared two recipes,
    not the engine with its reference.)"""
    d = _bf16_parity(dict(GPU_LLAMA, n_layers=4), 20, 4, 512, DEVICE)
    _report(f"bf16_{comm_path}", d)
    assert d["loss_rel"] <= d["loss_bound"], d
    assert d["param_max_abs"] <= d["bound"], d


def _features(device: torch.device) -> dict:
    """Activation checkpointing, no_sync accumulation, tied and frozen parameters, meta init: a
    small model against one process, exact (fp32)."""
    out = {}
    base = _llama(SMALL, tie_embeddings=True)
    base.layers[1].mlp.requires_grad_(False)
    reference = copy.deepcopy(base)
    model = ls.shard(copy.deepcopy(base), activation_checkpointing=2, device=device)

    def accumulate(m, x):
        half = x.shape[0] // 2
        with m.no_sync():
            (m(x[:half], labels=x[:half]).loss / 2).backward()
        loss = m(x[half:], labels=x[half:]).loss / 2
        loss.backward()
        return 2 * loss.item()  # the second half's loss, as the reference's below

    def ref_step(m, x):
        half = x.shape[0] // 2
        (m(x[:half], labels=x[:half]).loss / 2).backward()
        loss = m(x[half:], labels=x[half:]).loss / 2
        loss.backward()
        return 2 * loss.item()

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-3)
    worst = 0.0
    data = _batches(6, SMALL["vocab_size"], 8, 128)
    for x in data:
        a, b = accumulate(model, x), ref_step(reference, x)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        worst = max(worst, abs(a - b) / b)
    out["features_loss_rel"] = worst
    full = model.full_state_dict(cpu=False)  # collective; rank 0 gets the weights
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not dist.is_initialized() or dist.get_rank() == 0:
        dev, where = max_diff(full, reference)
        out["features_param_max_abs"] = dev
        bound = out["features_bound"] = _bound(base, reference, data, 2 * world)
        assert worst <= 1e-5 and dev <= bound, (worst, dev, where, bound)

    # meta init on the device equals eager init (our Llama: bitwise, see the README)
    torch.manual_seed(3)
    with torch.device("meta"):
        meta = LlamaForCausalLM(LlamaConfig(**SMALL))
    lazy = ls.shard(meta, device=device)
    eager = ls.shard(_llama(SMALL, seed=3).cpu(), device=device)
    a, b = lazy.full_state_dict(), eager.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    return out


def test_features_small(comm_path):
    _report(f"features_{comm_path}", _features(DEVICE))


def _two_ranks_gloo_cuda(rank: int, world: int) -> None:
    _features(torch.device("cuda", 0))


@needs_cuda
def test_two_ranks_on_one_gpu_gloo():
    """NCCL refuses two ranks on one device, so two gloo ranks exchange CUDA tensors."""
    run_ranks(_two_ranks_gloo_cuda, 2)


# ---- races ----------------------------------------------------------------------------------------
@needs_cuda
def test_cuda_sanitizer():
    """The comm-path tests under torch's CUDA sanitizer (CSAN): no unsynchronized access to any
    tensor between the compute and comm streams."""
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-m", "gpu", __file__, "-k",
         "features_small and comm"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    report = r.stdout[-3000:] + r.stderr[-3000:]
    _report("sanitizer", {"returncode": r.returncode, "tail": report[-1500:]})
    assert r.returncode == 0 and "data race" not in report, report


@needs_cuda
def test_delays_injected_stay_exact():
    """``torch.cuda._sleep`` inside every block (compute stream) and before every collective
    (comm stream) widens every timing window; results must not change."""
    os.environ["LAYERSHARD_FORCE_COMM"] = "1"
    try:
        base = _llama(SMALL)
        reference = copy.deepcopy(base)
        model = ls.shard(copy.deepcopy(base))
        for block in model.module.layers:
            block.register_forward_pre_hook(lambda m, a: torch.cuda._sleep(2_000_000))
        comm = model._schedule.comm
        issue = comm._issue

        def slow_issue(run, *args, **kwargs):
            def delayed(a):
                torch.cuda._sleep(2_000_000)  # on the comm stream, before the collective
                return run(a)

            return issue(delayed, *args, **kwargs)

        comm._issue = slow_issue
        data = _batches(6, SMALL["vocab_size"], 8, 128)
        worst, _ = _train_pair(model, reference, data)
        dev, _ = max_diff(model.full_state_dict(cpu=False), reference)
        bound = _bound(base, reference, data, 1)
        _report("delays", {"loss_rel": worst, "param_max_abs": dev, "bound": bound})
        assert worst <= 1e-5 and dev <= bound, (dev, bound)
    finally:
        os.environ.pop("LAYERSHARD_FORCE_COMM", None)


# ---- overlap --------------------------------------------------------------------------------------
def _intervals(events, pred):
    return sorted((e.time_range.start, e.time_range.end) for e in events if pred(e))


def _overlap(a: list, b: list) -> float:
    """Total length of ``a``'s intervals covered by any of ``b``'s."""
    total = 0.0
    for s, e in a:
        for bs, be in b:
            lo, hi = max(s, bs), min(e, be)
            if hi > lo:
                total += hi - lo
    return total


@needs_cuda
def test_gathers_overlap_compute():
    """A profiled step: the comm stream's work (the casts into the gather buffers and the
    collectives) runs while the compute stream computes, never alone: exposed communication
    (comm-stream time not covered by any compute kernel) is at most a tenth of it. How much of it
    runs under GEMMs is reported: on one GPU through the comm path (one rank) the collectives are
    short copies and the small model is launch-bound, so they may run beside other kernels (the
    first run, H100 2026-11-26: 340 us of comm work, none under a GEMM, none exposed)."""
    os.environ["LAYERSHARD_FORCE_COMM"] = "1"
    try:
        model = ls.shard(_llama(GPU_LLAMA), mixed_precision=ls.MixedPrecision(torch.bfloat16))
        x = _batches(1, GPU_LLAMA["vocab_size"], 4, 512)[0]
        for _ in range(2):  # warm up
            model(x, labels=x).loss.backward()
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            model(x, labels=x).loss.backward()
            torch.cuda.synchronize()
        out = os.environ.get("LAYERSHARD_GPU_REPORT")
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(Path(out) / "step_trace.json"))
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        comm_stream = model._schedule.comm.stream.cuda_stream

        def on_comm(e):
            return getattr(e, "stream", None) == comm_stream or "nccl" in e.name.lower()

        comm = _intervals(kernels, on_comm)
        gemm = _intervals(
            kernels, lambda e: not on_comm(e) and any(k in e.name.lower() for k in ("gemm", "cutlass", "matmul", "sm90", "sm80"))
        )  # fmt: skip
        compute = _intervals(kernels, lambda e: not on_comm(e))
        comm_total = sum(e - s for s, e in comm)
        data = {
            "comm_us": comm_total,
            "comm_under_gemm_us": _overlap(comm, gemm),
            "exposed_comm_us": comm_total - _overlap(comm, compute),
            "n_comm_ops": len(comm),
        }
        _report("overlap", data)
        assert comm and data["exposed_comm_us"] <= 0.1 * comm_total, data
    finally:
        os.environ.pop("LAYERSHARD_FORCE_COMM", None)


# ---- memory ---------------------------------------------------------------------------------------
@needs_cuda
def test_memory_constant_and_as_planned(comm_path):
    """``max_memory_allocated`` of every step from the second on is the same, and within 5% of
    what the planner predicts for the same run."""
    from layershard.models import build_config
    from layershard.plan import predict_activations, predict_memory
    from layershard.plan.memory import peak_bytes, unit_grad_bytes

    cfg = build_config("small", max_seq_len=512)
    model = ls.shard(
        LlamaForCausalLM(cfg).to(DEVICE), mixed_precision=ls.MixedPrecision(torch.bfloat16)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    peaks = []
    for x in _batches(5, cfg.vocab_size, 8, 512):
        torch.cuda.reset_peak_memory_stats()
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        peaks.append(torch.cuda.max_memory_allocated())
    mem = predict_memory(cfg, 1, "bf16", "fp32", "adamw")
    act = predict_activations(cfg, 8, 512, 0, "bf16")
    predicted = peak_bytes(mem, act, unit_grad_bytes(cfg, 1, "bf16"))
    _report(f"memory_{comm_path}", {"peaks": peaks, "predicted_peak": predicted})
    assert len(set(peaks[1:])) == 1, peaks
    assert abs(peaks[-1] / predicted - 1) <= 0.05, (peaks[-1], predicted)


# ---- CPU offload ------------------------------------------------------------------------------------
@needs_cuda
def test_cpu_offload_places_and_trains_exactly(comm_path):
    """Shards, gradient slices and optimizer state in pinned host memory, gathered weights and
    gradient buffers on the GPU; training (with a no_sync micro-batch) equals one process."""
    base = _llama(SMALL)
    reference = copy.deepcopy(base)
    model = ls.shard(copy.deepcopy(base), offload=ls.CPUOffload())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    worst = 0.0
    data = _batches(4, SMALL["vocab_size"], 8, 128)
    for x in data:
        with model.no_sync():
            (model(x[:4], labels=x[:4]).loss / 2).backward()
        loss = model(x[4:], labels=x[4:]).loss / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        (reference(x[:4], labels=x[:4]).loss / 2).backward()
        ref = reference(x[4:], labels=x[4:]).loss / 2
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, abs(loss.item() - ref.item()) / ref.item())
    for f in model.flat_params:
        assert f.shard.device.type == "cpu" and f.shard.is_pinned()
        assert f.grad is None or f.grad.device.type == "cpu"
    assert all(v.device.type == "cpu" for st in opt.state.values() for v in st.values())
    assert all(u.slot.data.device.type == "cuda" for u in model.units)
    dev, _ = max_diff(model.full_state_dict(cpu=False), reference)
    bound = _bound(base, reference, data, 2)
    _report(f"offload_{comm_path}", {"loss_rel": worst, "param_max_abs": dev, "bound": bound})
    assert worst <= 1e-5 and dev <= bound, (dev, bound)


# ---- QLoRA: 4-bit bases (engine/four_bit.py) ------------------------------------------------------
@pytest.mark.parametrize("offload", [False, True])
def test_qlora_parity(comm_path, offload):
    """A 4-bit (NF4, double quant) PEFT model on the device: bitsandbytes' CUDA kernels, the packed
    bytes gathered through the comm stream (and, with CPU offload, from pinned host memory), the
    backward reading the weight view from the slot. Losses within the spread of the reference
    trained in other orders, adapters within param_bound, the packed bytes bitwise unchanged.
    Unverified until run on a GPU: the CPU suite covers the same code on gloo."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    if offload and not HAS_CUDA:
        pytest.skip("CPU offload needs a device to offload from")
    from _qlora import qlora_model

    base = qlora_model()
    if HAS_CUDA:  # from_pretrained quantized on the CPU; bitsandbytes moves the bytes as they are
        base = base.to(DEVICE)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 96, (4, 12), generator=g).to(DEVICE) for _ in range(10)]
    originals = {n: p.data.clone() for n, p in base.named_parameters() if p.dtype == torch.uint8}
    runs = _orders(base, batches, 1)
    reference = copy.deepcopy(base)
    model = ls.shard(
        copy.deepcopy(base), device=DEVICE, offload=ls.CPUOffload() if offload else None
    )
    worst, ref_losses = _train_pair(model, reference, batches)
    bound = max(loss_bound(ref_losses, runs), 1e-6)
    assert worst <= bound, (worst, bound)
    full = model.full_state_dict()
    adapters = {k: v for k, v in full.items() if "lora_" in k}
    ref = {k: p.detach().cpu() for k, p in reference.named_parameters() if "lora_" in k}
    diff = max((adapters[k] - ref[k]).abs().max().item() for k in ref)
    pbound = param_bound(reference, *runs)
    assert diff <= pbound, (diff, pbound)
    assert all(torch.equal(full[k], v.cpu()) for k, v in originals.items())
    _report(
        f"qlora_{comm_path}_{'offload' if offload else 'device'}", {"loss": worst, "params": diff}
    )


# ---- fp8 weights handed to torchao's Float8Linear (engine/float8.py) -------------------------------
def test_float8_handoff(comm_path):
    """``gather_dtype=fp8`` with torchao ``Float8Linear`` modules on the device: on the comm path
    the weights reach the modules as ``Float8TrainingTensor`` over the gathered bytes (torch's
    ``_scaled_mm`` on the GPU); either way logits and gradients bit for bit those of the same
    model on one process without layershard. Unverified until run on a GPU: the CPU suite
    (tests/engine/test_float8_handoff.py) covers the same code on gloo at 2 ranks."""
    pytest.importorskip("torchao.float8")
    from test_float8_handoff import _bound_types, data, fp8_net, loss_of

    base = fp8_net().to(DEVICE)
    x = data(1, 1)[0].to(DEVICE)
    reference = copy.deepcopy(base)
    ref_logits = reference(x).detach()
    loss_of(reference, x).backward()
    mp = ls.MixedPrecision(torch.float32, torch.float32, gather_dtype=torch.float8_e4m3fn)
    model = ls.shard(copy.deepcopy(base), device=DEVICE, mixed_precision=mp)
    types = _bound_types(model)
    assert torch.equal(model(x), ref_logits)
    handed = comm_path == "comm"
    assert ("Float8TrainingTensor" in types) == handed, types
    loss_of(model, x).backward()
    full = {}
    for f in (f for f in model.flat_params if f.requires_grad):
        for slot, p in zip(f.slots, f.shard_params):
            full[slot.name] = p.grad.reshape(slot.shape)  # one rank: the slice is the whole
    diff = max(
        (full[n] - p.grad).abs().max().item()
        for n, p in reference.named_parameters()
        if p.requires_grad
    )
    _report(f"float8_handoff_{comm_path}", {"grad_max_abs_diff": diff, "handed": handed})
    assert diff == 0.0, diff


def test_torchao_nf4_parity(comm_path):
    """torchao NF4 bases (torchtune's QLoRA linears, ``linear_nf4``) on the device: the NF4 bytes
    gathered through the comm stream into the slot and an ``NF4Tensor`` bound over them, the
    backward reading them from the slot. Losses within the spread of the reference trained in
    other orders, adapters within param_bound, the NF4 bytes bitwise unchanged. Unverified until
    run on a GPU: tests/engine/test_qlora_nf4.py covers the same code on gloo."""
    pytest.importorskip("torchao")
    from _nf4 import nf4_llama, nf4_weights
    from test_qlora_nf4 import _Params

    base = nf4_llama().to(DEVICE)
    originals = {n: p.quantized_data.clone() for n, p in nf4_weights(base).items()}
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 96, (4, 12), generator=g).to(DEVICE) for _ in range(10)]
    runs = _orders(base, batches, 1)
    reference = copy.deepcopy(base)
    model = ls.shard(copy.deepcopy(base), device=DEVICE)
    worst, ref_losses = _train_pair(model, reference, batches)
    bound = max(loss_bound(ref_losses, runs), 1e-6)
    assert worst <= bound, (worst, bound)
    full = model.full_state_dict()
    ref = {k: p.detach().cpu() for k, p in reference.named_parameters() if ".lora_" in k}
    diff = max((full[k] - v).abs().max().item() for k, v in ref.items())
    adapters = {k: p.detach() for k, p in reference.named_parameters() if ".lora_" in k}
    pbound = param_bound(_Params(adapters), *runs)  # an NF4Tensor has no subtraction
    _report(f"torchao_nf4_{comm_path}", {"loss": worst, "params": diff, "bound": pbound})
    assert diff <= pbound, (diff, pbound)
    assert all(torch.equal(full[k], v.cpu()) for k, v in originals.items())


# ---- bf16 reductions summed in fp32 (engine/collectives.py) ---------------------------------------
def test_bf16_reduce_sums_in_fp32(comm_path):
    """``reduce_dtype=bf16`` reduces through an all-to-all and an fp32 sum on every backend (under
    NCCL: ``all_to_all_single``, the sum on the comm stream), with a whole unit of receive
    scratch per gradient slot (as the planner predicts for NCCL at 2+ ranks). One rank: the sum of one chunk,
    so the gradients equal the copy path's bit for bit. The 2-4 rank sums are checked on gloo's
    two code paths (tests/engine/test_wire_dtypes.py); unverified here until run on a GPU."""
    mp = ls.MixedPrecision(torch.float32, torch.bfloat16)
    x = _batches(1, SMALL["vocab_size"], 2, 64)[0]
    grads = {}
    for path in ("copy", "comm"):
        os.environ["LAYERSHARD_FORCE_COMM"] = "1" if path == "comm" else "0"
        model = ls.shard(_llama(SMALL), device=DEVICE, mixed_precision=mp)
        _plain_step(model, x)
        grads[path] = [p.grad.clone() for p in model.parameters()]
        if path == "comm":  # whole units received: the scratch is the gradient slots' size
            report = model.memory_report()
            assert report["reduce_scratch"] == report["grad_buffers"] > 0, report
    os.environ["LAYERSHARD_FORCE_COMM"] = "1" if comm_path == "comm" else "0"
    assert all(torch.equal(a, b) for a, b in zip(grads["copy"], grads["comm"], strict=True))
    _report(f"bf16_reduce_{comm_path}", {"equal": True})
