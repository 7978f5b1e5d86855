"""Settings every test process needs before torch is imported (pytest loads this first; ranks
and launched commands inherit the environment), and where the tests find each other.

The tests are grouped by the package they test (``engine/``, ``checkpoint/``, ``train/``...);
helpers shared by every group live here at the top (``_dist.py``, ``_parity.py``...). A test
module imports them, and now and then another test module's checks (``from test_parity import
...``), by plain name: every group's folder is on ``sys.path``, in the parent process and in the
ranks it spawns (``torch.multiprocessing`` passes ``sys.path`` on)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from _cpu import align_onednn_isa

align_onednn_isa(os.environ)

_TESTS = Path(__file__).resolve().parent
for _group in sorted(p for p in _TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py"))):
    if str(_group) not in sys.path:
        sys.path.append(str(_group))


# ---- runs that tests in several modules compare against (made once a session, only read) ------


@pytest.fixture(scope="session")
def nodes_reference(tmp_path_factory) -> Path:
    """tests/train/test_multinode.py's one-node run of two ranks, which the simulated nodes of
    that module and of tests/testbed/ must end like."""
    from test_multinode import one_node_run

    return one_node_run(tmp_path_factory)


@pytest.fixture(scope="session")
def qlora_base(tmp_path_factory) -> Path:
    """A model folder with its tokenizer.json, as `layershard train --init-from` reads: one step
    of a 2-layer, 64-wide transformers Llama (tests/train/test_qlora_train.py and
    test_train_qlora_bf16.py start their QLoRA runs from it; they only read it)."""
    import transformers
    from _train import TINY, train_main

    root = tmp_path_factory.mktemp("qlora-base")
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    cfg.save_pretrained(str(root / "hf"))
    base = root / "base"
    args = ["--steps", "1", "--eval-interval", "0", *TINY]
    assert train_main(["--run-dir", str(base), "--hf-config", str(root / "hf"), *args]) == 0
    return base / "final"
