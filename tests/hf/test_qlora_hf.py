"""QLoRA through ``ls.hf.Trainer`` and ``ls.hf.sharded(trl.SFTTrainer)`` at 2 ranks against the
same trainers on one process (same global batch), as a user writes them for one GPU
(tests/_qlora_hf_script.py). Two launches: one process, then torchrun at 2 ranks."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("bitsandbytes")
pytest.importorskip("trl")

from _parity import LOSS_RTOL  # noqa: E402
from test_hf_trainer import GRAD_NORM_RTOL, PARAM_TOL, _rel  # noqa: E402

# End-to-end launches of whole runs: outside the fast tier.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parents[1] / "_qlora_hf_script.py"


@functools.cache
def _results() -> tuple[Path, dict, dict]:
    out = Path(tempfile.mkdtemp(prefix="layershard-qlora-hf-"))
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    paths = [str(ROOT / "src"), str(ROOT / "tests"), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.pop("ACCELERATE_USE_FSDP", None)
    single = [sys.executable, str(SCRIPT), str(out)]
    ranks = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    for cmd in (single, ranks + [str(SCRIPT), str(out)]):
        proc = subprocess.run(cmd, env=env, cwd=ROOT, text=True, capture_output=True, timeout=300)
        if proc.returncode != 0:
            pytest.fail(f"{cmd}: exited {proc.returncode}\n{(proc.stdout + proc.stderr)[-6000:]}")
    one, ls = (json.loads((out / f"{k}.json").read_text()) for k in ("single", "ls"))
    return out, one, ls


def _section(name: str) -> tuple[Path, dict, dict]:
    out, one, ls = _results()
    for res in (one, ls):
        assert "error" not in res[name], res[name].get("error")
    return out, one[name], ls[name]


def _adapter_diff(out: Path, run: str) -> tuple[float, float]:
    from safetensors.torch import load_file

    a = load_file(str(out / f"single-{run}" / "final" / "adapter_model.safetensors"))
    b = load_file(str(out / f"ls-{run}" / "final" / "adapter_model.safetensors"))
    assert set(a) == set(b) and a and all("lora_" in k for k in a)
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    moved = max(a[k].float().abs().max().item() for k in a if "lora_B" in k)  # zero at init
    return diff, moved


def test_trainer_qlora_matches_one_process() -> None:
    """PEFT get_peft_model on a BitsAndBytesConfig model, ls.hf.Trainer: losses, gradient norms
    and saved adapters as Trainer on one process; the adapter alone is saved, and PEFT loads it
    onto the 4-bit base with the sharded model's logits."""
    out, one, ls = _section("trainer")
    # tolerances of test_hf_trainer.py (calibrated there for fp32 runs against one process)
    assert _rel(ls["logged"], one["logged"], 1) < LOSS_RTOL
    assert _rel(ls["logged"], one["logged"], 2) < GRAD_NORM_RTOL
    diff, moved = _adapter_diff(out, "trainer")
    assert diff < PARAM_TOL and moved > 100 * PARAM_TOL
    assert "adapter_model.safetensors" in ls["files"]
    assert not any(f.startswith("model") for f in ls["files"])
    # the same computation on the same weights: equal up to fp32 rounding of the logits
    assert ls["logits_diff"] <= 1e-5 * ls["logits_scale"]
    # resumed from the halfway checkpoint (adapters and optimizer from layershard/, the 4-bit
    # base read again from the model folder): the same steps, bitwise (same ranks, same order)
    half = len(ls["logged"]) // 2
    assert ls["resumed_steps"] == list(range(half + 1, 2 * half + 1))  # it ran the second half
    assert ls["resumed"][half:] == ls["logged"][half:]


def test_sft_trainer_qlora_matches_one_process() -> None:
    """trl's SFTTrainer given the 4-bit model and peft_config (completion-only loss), sharded by
    ls.hf.sharded: as SFTTrainer on one process training fp32 adapters (ls.hf undoes trl's bf16
    cast of QLoRA adapters: layershard keeps fp32 master weights)."""
    out, one, ls = _section("sft")
    assert _rel(ls["logged"], one["logged"], 1) < LOSS_RTOL
    assert _rel(ls["logged"], one["logged"], 2) < GRAD_NORM_RTOL
    diff, moved = _adapter_diff(out, "sft")
    assert diff < PARAM_TOL and moved > 100 * PARAM_TOL
