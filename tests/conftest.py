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

from _cpu import align_onednn_isa

align_onednn_isa(os.environ)

_TESTS = Path(__file__).resolve().parent
for _group in sorted(p for p in _TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py"))):
    if str(_group) not in sys.path:
        sys.path.append(str(_group))
