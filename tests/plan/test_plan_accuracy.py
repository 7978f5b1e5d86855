"""The planner against published runs (plan/records.py, issue 36): the fitted defaults come out
of the fit set again, and every fit-set run that ran is said to fit."""

from __future__ import annotations

import pytest

from layershard.plan.accuracy import compare, fit_defaults
from layershard.plan.records import published_runs
from layershard.plan.sources import CONTENTION, CONTEXT_BYTES, FITTED_SCALES, FRAGMENTATION


def test_fitted_defaults_reproduce():
    # Levenberg-Marquardt from the committed values on the fit set (held-out runs never enter)
    # lands where they are: each within 1% (they are rounded to 4 digits)
    start = {f"compute_scale:{g}": FITTED_SCALES[g][0] for g in FITTED_SCALES}
    start |= {f"attention_scale:{g}": FITTED_SCALES[g][1] for g in FITTED_SCALES}
    start["contention"] = CONTENTION
    got = fit_defaults(iters=3, start=start)
    for key, value in start.items():
        assert got[key] == pytest.approx(value, rel=0.01), key
    assert got["rms_log_error"] < 0.07


def test_fit_set_runs_fit_and_the_margin_is_the_largest_that_lets_them():
    # FRAGMENTATION is derived: the largest allocator margin under which every fit-set run
    # (they all ran) fits; 0.01 below the bound (rounded down)
    rows = compare([r for r in published_runs() if not r.held_out])
    bound = min((r.plan.gpu.memory_bytes - CONTEXT_BYTES) / r.plan.memory["peak"] - 1 for r in rows)
    assert all(r.fits for r in rows)
    assert bound - 0.01 <= FRAGMENTATION <= bound
