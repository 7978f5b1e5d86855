"""Checkpoints: exact resume (and resharded resume at other world sizes), crash safety, bad input,
HF export/import, the CLI. Ranks write what they measured to files; the test reads them back."""

from __future__ import annotations

import functools
import json
import os
import pickle
import random
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from _parity import LOSS_RTOL, local, pair_bound, train_in_orders, train_losses

import layershard as ls
from layershard.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    checkpoint_info,
)
from layershard.checkpoint import publish as pub
from layershard.models import LlamaConfig, LlamaForCausalLM

TINY = dict(vocab_size=96, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
GLOBAL_BATCH, SEQ, LR, STEPS, SAVE_AT = 8, 16, 1e-2, 6, 3


def _model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}))


def _global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, TINY["vocab_size"], (GLOBAL_BATCH, SEQ), generator=g)


def _batch(step: int, rank: int, world: int) -> torch.Tensor:
    return local(_global_batch(step), rank, world)


def _train(model, opt, steps, rank, world) -> list[float]:
    return train_losses(model, [_global_batch(s) for s in steps], rank, world, opt)


def _full_optim(model, opt) -> dict[str, torch.Tensor]:
    """The unsharded AdamW state (gathered like the parameters), on every rank."""
    world = dist.get_world_size()
    out = {}
    for f in model.flat_params:
        for key in ("exp_avg", "exp_avg_sq"):
            local = torch.zeros(f.shard_numel)
            for slot, p in zip(f.slots, f.shard_params):
                lo, hi = f.local_range(slot)
                local[lo - f.shard_start : hi - f.shard_start] = opt.state[p][key]
            full = torch.empty(f.padded_numel)
            dist.all_gather(list(full.chunk(world)), local)
            for slot, p in zip(f.slots, f.shard_params):
                out[f"{slot.name}/{key}"] = full[slot.offset : slot.offset + slot.numel].clone()
                out[f"{slot.name}/step"] = opt.state[p]["step"].reshape(1).clone()
    return out


def _full_params(model) -> dict[str, torch.Tensor]:
    sd = model.full_state_dict(rank0_only=False)
    return {k: v.clone() for k, v in sd.items()}


# ---- resume ------------------------------------------------------------------------------------


def _run_and_save(rank: int, world: int, root: str) -> None:
    """Train STEPS steps; at SAVE_AT save a checkpoint and record the state and the next random
    numbers of every rank; at the end record the losses and parameters (the reference)."""
    root = Path(root)
    model = ls.shard(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = _train(model, opt, range(SAVE_AT), rank, world)
    ckpts = root / f"ws{world}"
    ls.save_checkpoint(
        ckpts / f"step_{SAVE_AT:06d}",
        model,
        opt,
        step=SAVE_AT,
        extra={"samples": SAVE_AT * GLOBAL_BATCH},
    )
    at_save = {"params": _full_params(model), "optim": _full_optim(model, opt)}
    draws = {"torch": torch.rand(4), "python": torch.tensor([random.random()], dtype=torch.float64)}
    torch.save(draws, root / f"ws{world}_rng{rank}.pt")
    losses += _train(model, opt, range(SAVE_AT, STEPS), rank, world)
    final = _full_params(model)
    if rank == 0:
        torch.save(
            {"at_save": at_save, "losses": torch.tensor(losses), "final": final},
            root / f"ws{world}_ref.pt",
        )
    dist.barrier()


def _resume(rank: int, world: int, root: str, src: int) -> None:
    """Load ws{src}'s checkpoint into a differently initialized model with a differently
    configured optimizer, check the state is the saved one exactly, train to STEPS, compare."""
    root = Path(root)
    ref = torch.load(root / f"ws{src}_ref.pt", weights_only=True)
    model = ls.shard(_model(seed=123))
    opt = torch.optim.AdamW(model.parameters(), lr=LR / 7, weight_decay=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = ls.load_checkpoint(root / f"ws{src}", model, opt)  # a folder holding `latest`
    assert meta["step"] == SAVE_AT and meta["extra"] == {"samples": SAVE_AT * GLOBAL_BATCH}
    assert meta["world_size"] == src and meta["model_config"]["dim"] == TINY["dim"]
    assert opt.param_groups[0]["lr"] == LR and opt.param_groups[0]["weight_decay"] == 0.01
    # Resharding is exact: parameters and optimizer state are the saved ones, bit for bit.
    for name, t in _full_params(model).items():
        assert torch.equal(t, ref["at_save"]["params"][name]), name
    for name, t in _full_optim(model, opt).items():
        assert torch.equal(t, ref["at_save"]["optim"][name]), name
    if world == src:
        assert meta["rng_restored"]
        draws = torch.load(root / f"ws{src}_rng{rank}.pt", weights_only=True)
        assert torch.equal(torch.rand(4), draws["torch"])
        assert random.random() == draws["python"].item()
    else:
        assert not meta["rng_restored"]
        if rank == 0:
            assert any("re-seeded" in str(w.message) for w in caught)
    losses = _train(model, opt, range(SAVE_AT, STEPS), rank, world)
    final = _full_params(model)
    expected_losses = ref["losses"][SAVE_AT:].tolist()
    if world == src:  # bitwise
        assert losses == expected_losses, (losses, expected_losses)
        for name, t in final.items():
            assert torch.equal(t, ref["final"][name]), name
    else:  # another reduction order from the save on
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(expected_losses), rtol=LOSS_RTOL, atol=0
        )
        if rank == 0:
            bound = _two_orders_apart(max(world, src))
            for name, t in final.items():
                torch.testing.assert_close(t, ref["final"][name], rtol=0, atol=bound, msg=name)


@functools.cache
def _two_orders_apart(parts: int) -> float:
    """How far two runs that sum the ranks' gradients in different legitimate orders may land
    apart after STEPS steps (tests/_parity.py, pair_bound); the resumed runs differ only for the
    steps after SAVE_AT, so this is generous, and a resharding fault moves weights by ~lr.
    Measured 2026-11-26, torch 2.13: 2.8e-8-1.2e-7 against bounds of 2.3e-6-1.2e-5 under AVX-512
    +AMX, AVX2 and default."""
    data = [_batch(step, 0, 1) for step in range(STEPS)]
    return pair_bound(*train_in_orders(_model(), data, parts))


def _ws4(rank: int, world: int, root: str) -> None:
    _resume(rank, world, root, src=2)  # save at 2, load at 4
    _run_and_save(rank, world, root)


def _ws2_resumes(rank: int, world: int, root: str) -> None:
    _resume(rank, world, root, src=2)  # same world size: bitwise
    _resume(rank, world, root, src=4)  # save at 4, load at 2


@pytest.fixture(scope="module")
def saved_ws2(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("resume")
    run_ranks(_run_and_save, 2, str(root))
    return root


def test_resume_exact_and_resharded(saved_ws2):
    root = saved_ws2
    run_ranks(_ws4, 4, str(root))
    run_ranks(_ws2_resumes, 2, str(root))
    run_ranks(_resume, 1, str(root), 2)  # save at 2, load at 1
    m = json.loads((root / "ws2" / "step_000003" / "layershard.json").read_text())
    assert m["world_size"] == 2 and m["step"] == 3 and m["optimizer"]["class"].endswith("AdamW")
    assert set(m["files"]) == {"__0_0.distcp", "__1_0.distcp", ".metadata"}
    assert (root / "ws2" / "latest").read_text().strip() == "step_000003"


def test_cli_info_and_offline_export(saved_ws2, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from layershard.cli import main
    from layershard.models import to_hf_name

    root = saved_ws2
    assert main(["checkpoint", "info", str(root / "ws2")]) == 0
    out = capsys.readouterr().out
    assert "step         3" in out and "world size   2" in out and "integrity    ok" in out
    assert main(["checkpoint", "info", "--json", str(root / "ws2" / "step_000003")]) == 0
    info = json.loads(capsys.readouterr().out)
    folder = root / "ws2" / "step_000003"
    assert info["ok"] and info["bytes"] == sum(
        p.stat().st_size for p in folder.iterdir() if p.name != "layershard.json"
    )

    out_dir = tmp_path / "hf"
    assert (
        main(
            [
                "checkpoint",
                "export",
                str(root / "ws2"),
                str(out_dir),
                "--dtype",
                "float32",
                "--max-shard-size",
                "30KB",
            ]
        )
        == 0
    )
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # split at the size cap
    hf = AutoModelForCausalLM.from_pretrained(out_dir)
    params = torch.load(root / "ws2_ref.pt", weights_only=True)["at_save"]["params"]
    hf_sd = hf.state_dict()
    assert set(hf_sd) == {to_hf_name(k) for k in params}
    for k, v in params.items():
        assert torch.equal(hf_sd[to_hf_name(k)], v), k


def _dotted_global_pickle(module: str, name: str, arg: str) -> bytes:
    """A protocol-4 pickle that calls ``module``'s attribute path ``name`` with ``arg``: what a
    crafted checkpoint uses to reach ``os.system`` through a module the unpickler trusts."""

    def short(s: str) -> bytes:
        b = s.encode()
        return b"\x8c" + bytes([len(b)]) + b  # SHORT_BINUNICODE

    # PROTO 4, module, name, STACK_GLOBAL, arg, TUPLE1, REDUCE, STOP
    return b"\x80\x04" + short(module) + short(name) + b"\x93" + short(arg) + b"\x85R."


def test_crafted_checkpoint_runs_no_code(saved_ws2, tmp_path, capsys):
    """Security: a checkpoint whose DCP metadata (hash re-recorded in the manifest) names
    ``os.system`` through ``torch.distributed.checkpoint.metadata`` (which imports ``os``) is
    refused with one clear error by ``checkpoint info``, ``export`` and the loader, and runs
    nothing. The same for a DCP "bytes" entry, which DCP itself unpickles with
    ``weights_only=False``."""
    import pickletools

    import torch.distributed.checkpoint as dcp

    from layershard.checkpoint.safe_read import SafeFileSystemReader, read_dcp_metadata
    from layershard.cli import main

    marker = tmp_path / "pwned"
    payload = _dotted_global_pickle(
        "torch.distributed.checkpoint.metadata", "os.system", f"touch {marker}"
    )
    assert "STACK_GLOBAL" in [op.name for op, _, _ in pickletools.genops(payload)]
    d = tmp_path / "evil"
    shutil.copytree(saved_ws2 / "ws2" / "step_000003", d)
    (d / ".metadata").write_bytes(payload)
    _retag(d, ".metadata")

    with pytest.raises(CheckpointCorruptError, match=r"untrusted.*os\.system.*Nothing from it"):
        read_dcp_metadata(d)
    assert main(["checkpoint", "info", str(d)]) == 1
    assert "integrity    FAILED" in capsys.readouterr().out
    assert main(["checkpoint", "export", str(d), str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "untrusted DCP metadata" in err, err
    assert not marker.exists()
    assert not (tmp_path / "hf").exists()

    # A "bytes" entry: DCP's own loader would run it (torch.load(weights_only=False)).
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    b = tmp_path / "bytes"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"x": Evil()}, storage_writer=dcp.FileSystemWriter(b), no_dist=True)
        sd = {"x": None}
        with pytest.raises(BaseException) as caught:  # DCP wraps each rank's error
            dcp.load(sd, storage_reader=SafeFileSystemReader(b), no_dist=True)
    assert "pickled bytes" in repr(caught.value) or "pickled bytes" in str(caught.value)
    assert not marker.exists()


# ---- crash safety and bad input ----------------------------------------------------------------


def _crash(rank: int, world: int, root: str) -> None:
    root = Path(root)
    model = ls.shard(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _train(model, opt, range(1), rank, world)
    ls.save_checkpoint(root / "ck" / "step_1", model, opt, step=1)
    sd = model.full_state_dict()
    if rank == 0:
        torch.save(sd, root / "step_1.pt")
    dist.barrier()
    _train(model, opt, range(1, 2), rank, world)
    # The job dies after writing its data, before the metadata and the rename: every rank (a
    # node lost). Killing rank 1 alone raced: rank 0's save could see the broken connection and
    # remove its folder before the launcher stopped it (seen once, in a clean-clone CI run of
    # 2026-11-26; three other full runs that day passed).
    import torch.distributed.checkpoint as dcp

    original = dcp.FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        fut = original(self, plan, planner)
        fut.wait()
        os._exit(1)

    dcp.FileSystemWriter.write_data = write_then_die
    ls.save_checkpoint(root / "ck" / "step_2", model, opt, step=2)
    raise AssertionError("unreachable: the ranks die during the save")


def _retag(folder: Path, name: str) -> None:
    """Record a file's new size and hash in the manifest (to reach the checks behind them)."""
    m = json.loads((folder / pub.MANIFEST).read_text())
    size, sha = pub.file_digest(folder / name)
    m["files"][name] = {"bytes": size, "sha256": sha}
    (folder / pub.MANIFEST).write_text(json.dumps(m))


def _after_crash_and_bad_input(rank: int, world: int, root: str) -> None:
    root = Path(root)
    ck = root / "ck"
    model = ls.shard(_model(seed=9))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    meta = ls.load_checkpoint(ck, model, opt)  # `latest` still names step_1
    assert meta["step"] == 1 and meta["path"].endswith("step_1")
    sd = model.full_state_dict()
    if rank == 0:
        for k, v in torch.load(root / "step_1.pt", weights_only=True).items():
            assert torch.equal(sd[k], v), k
    leftovers = sorted(ck.glob("step_2.tmp-*"))
    assert len(leftovers) == 1
    with pytest.raises(CheckpointNotFoundError, match="interrupted save"):
        ls.load_checkpoint(leftovers[0], model, opt)
    with pytest.raises(CheckpointNotFoundError):
        ls.load_checkpoint(ck / "step_2", model, opt)

    # A later save of the same name succeeds and clears the leftover; keep_last prunes step_1.
    ls.save_checkpoint(ck / "step_2", model, opt, step=2, keep_last=1)
    assert not any(ck.glob("*.tmp-*")) and not (ck / "step_1").exists()
    good = ck / "step_2"

    def bad_copy(name: str) -> Path:
        d = root / name
        if rank == 0:
            shutil.copytree(good, d)
        dist.barrier()
        return d

    def broken(d: Path, edit) -> Path:
        if rank == 0:
            edit(d)
        dist.barrier()
        return d

    # truncated data file
    d = broken(bad_copy("truncated"), lambda d: os.truncate(d / "__1_0.distcp", 1000))
    with pytest.raises(CheckpointCorruptError, match=r"__1_0\.distcp: truncated"):
        ls.load_checkpoint(d, model, opt)

    # flipped bytes, same size
    def flip(d):
        p = d / "__0_0.distcp"
        data = bytearray(p.read_bytes())
        data[len(data) // 2 : len(data) // 2 + 8] = bytes(8)
        p.write_bytes(bytes(data))

    d = broken(bad_copy("flipped"), flip)
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp: corrupt"):
        ls.load_checkpoint(d, model, opt)

    # corrupt manifest
    d = broken(
        bad_copy("badjson"), lambda d: (d / pub.MANIFEST).write_text('{"format": "layershard-chec')
    )
    with pytest.raises(CheckpointCorruptError, match="layershard.json: corrupt manifest"):
        ls.load_checkpoint(d, model, opt)

    # a DCP metadata file that would run code when unpickled (its hash updated, so only the
    # restricted unpickler stands in the way)
    marker = root / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    def evil(d):
        (d / ".metadata").write_bytes(pickle.dumps(Evil()))
        _retag(d, ".metadata")

    d = broken(bad_copy("evil"), evil)
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata: untrusted.*refusing to load"):
        ls.load_checkpoint(d, model, opt)
    assert not marker.exists()

    # wrong dtype recorded for one tensor
    def to_bf16(d):
        from layershard.checkpoint.safe_read import read_dcp_metadata

        md = read_dcp_metadata(d)
        md.state_dict_metadata["model/layers.1.attn.wq.weight"].properties.dtype = torch.bfloat16
        (d / ".metadata").write_bytes(pickle.dumps(md))
        _retag(d, ".metadata")

    d = broken(bad_copy("bf16"), to_bf16)
    with pytest.raises(
        CheckpointMismatchError,
        match=r"model/layers\.1\.attn\.wq\.weight: stored as bfloat16, expected float32",
    ):
        ls.load_checkpoint(d, model, opt)

    # checkpoints of other models, another optimizer
    fewer = ls.shard(_model(n_layers=2))
    with pytest.raises(
        CheckpointMismatchError,
        match=r"in the checkpoint but not in the model: layers\.2\.attn_norm\.weight",
    ):
        ls.load_checkpoint(good, fewer)
    wider = ls.shard(_model(ffn_dim=48))
    with pytest.raises(
        CheckpointMismatchError,
        match=r"model/layers\.0\.mlp\.w1\.weight: the checkpoint has shape \(64, 32\), the model \(48, 32\)",
    ):
        ls.load_checkpoint(good, wider)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointMismatchError, match="optimizer is torch.optim.adamw.AdamW"):
        ls.load_checkpoint(good, model, sgd)

    # a save never replaces a folder that is not a checkpoint
    if rank == 0:
        (root / "mine").mkdir()
        (root / "mine" / "notes.txt").write_text("keep me")
    dist.barrier()
    with pytest.raises(CheckpointError, match="is not a layershard checkpoint"):
        ls.save_checkpoint(root / "mine", model)
    assert (root / "mine" / "notes.txt").read_text() == "keep me"

    # after all of that, the model is still the good checkpoint's and loads again
    ls.load_checkpoint(good, model, opt)


def test_crash_during_save_leaves_previous_checkpoint_loadable(tmp_path):
    with pytest.raises(Exception, match="exit code 1"):
        run_ranks(_crash, 2, str(tmp_path))
    ck = tmp_path / "ck"
    assert (ck / "latest").read_text().strip() == "step_1"
    assert not (ck / "step_2").exists() and len(list(ck.glob("step_2.tmp-*"))) == 1
    info = checkpoint_info(ck)
    assert info["ok"] and info["step"] == 1 and info["leftovers"][0].startswith("step_2.tmp-")
    bad = checkpoint_info(next(ck.glob("step_2.tmp-*")))
    assert not bad["ok"] and "interrupted save" in bad["error"]
    run_ranks(_after_crash_and_bad_input, 2, str(tmp_path))


# ---- Hugging Face --------------------------------------------------------------------------------


def _hf_tiny(tied: bool = True):
    import transformers

    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=tied,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def _hf(rank: int, world: int, root: str) -> None:
    import transformers
    from safetensors import safe_open

    root = Path(root)
    x = torch.randint(0, TINY["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(5))
    cases = [
        ("ours", lambda: _model(seed=4)),
        ("ours_tied", lambda: _model(seed=4, tie_embeddings=True)),
        ("hf_tied", lambda: _hf_tiny(True)),
    ]
    for name, build in cases:
        eager = build()
        model = ls.shard(build())
        logits = model(x).logits
        out = root / name
        ls.export_hf(model, out, dtype=torch.float32, max_shard_size="40KB")
        if rank == 0:
            index = json.loads((out / "model.safetensors.index.json").read_text())
            hf = transformers.AutoModelForCausalLM.from_pretrained(out)
            expected = {k: v.shape for k, v in hf.state_dict().items()}
            if hf.config.tie_word_embeddings:
                expected.pop("lm_head.weight")
            assert {k: tuple(v) for k, v in expected.items()} == {
                k: tuple(safe_open(str(out / f), "pt").get_slice(k).get_shape())
                for k, f in index["weight_map"].items()
            }
            torch.testing.assert_close(hf(x).logits, logits, rtol=1e-5, atol=1e-5)
        # load_hf into a model built on the meta device equals the eager model, bitwise
        with torch.device("meta"):
            meta_model = build()
        loaded = ls.shard(meta_model, param_init_fn=getattr(meta_model, "_init_weights", None))
        ls.load_hf(loaded, out)
        sd = loaded.full_state_dict()
        if rank == 0:
            ref = eager.state_dict()
            assert set(sd) <= set(ref)
            for k, v in sd.items():
                assert torch.equal(v, ref[k]), (name, k)
        dist.barrier()

    # bf16 export (the default) holds the rounded fp32 weights
    model = ls.shard(_model(seed=4))
    ls.export_hf(model, root / "bf16")
    full = model.full_state_dict()
    if rank == 0:
        index = json.loads((root / "bf16" / "model.safetensors.index.json").read_text())
        f = index["weight_map"]["model.layers.1.self_attn.q_proj.weight"]
        with safe_open(str(root / "bf16" / f), "pt") as fh:
            t = fh.get_tensor("model.layers.1.self_attn.q_proj.weight")
        assert t.dtype == torch.bfloat16 and torch.equal(
            t, full["layers.1.attn.wq.weight"].to(torch.bfloat16)
        )
        assert json.loads((root / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"

    # bad input for load_hf: another model's weights, a truncated file
    with pytest.raises(CheckpointMismatchError, match=r"model\.layers\.2\.input_layernorm\.weight"):
        ls.load_hf(model, root / "hf_tied")  # 2 layers, the model has 3
    wider = ls.shard(_model(ffn_dim=48))
    with pytest.raises(
        CheckpointMismatchError,
        match=r"mlp\.gate_proj\.weight has shape \(64, 32\), the model expects \(48, 32\)",
    ):
        ls.load_hf(wider, root / "ours")
    if rank == 0:
        shutil.copytree(root / "ours", root / "trunc")
        victim = sorted((root / "trunc").glob("model-*.safetensors"))[-1]
        os.truncate(victim, victim.stat().st_size // 2)
    dist.barrier()
    with pytest.raises(CheckpointCorruptError, match=r"model-\d+-of-\d+\.safetensors"):
        ls.load_hf(model, root / "trunc")


def test_export_hf_and_load_hf(tmp_path):
    run_ranks(_hf, 2, str(tmp_path))
