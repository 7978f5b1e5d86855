"""Settings every test process needs before torch is imported (pytest loads this first; ranks
and launched commands inherit the environment)."""

from __future__ import annotations

import os

from _cpu import align_onednn_isa

align_onednn_isa(os.environ)
