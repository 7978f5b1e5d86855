"""Re-derive the H100 kernel constants of plan/sources.py (KERNELS["h100"]) from the timings in
benchmarks/plan/accuracy/h100/ and print how well the kernel model reproduces them.

    python benchmarks/plan/accuracy/fit_kernels.py

GEMMs: least squares in log rate of ``kernels.gemm_time`` over the grid shapes of at least
2 GFLOP and every GEMM of the published runs' models (Nelder-Mead on emax, k0, launch,
small_tile). Attention: e(s) = e_inf s / (s + s_half) in log rate, head dim 128 (forward, and
forward + backward), and the head-dim-64 ratio. Element-wise floors: each block's time beyond
its GEMMs and attention (``kernels.block_compute`` without the floor).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

from layershard.plan.kernels import attention_time, gemm_time, linears
from layershard.plan.model import ModelShape
from layershard.plan.sources import KERNELS

HERE = Path(__file__).parent / "h100"
PEAK, HBM = 989e12, 3.35e12


def nelder_mead(f, x0, step, iters=3000, tol=1e-12):
    n = len(x0)
    pts = [list(x0)] + [[x0[j] + (step[j] if j == i else 0) for j in range(n)] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=lambda i: vals[i])
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if abs(vals[-1] - vals[0]) < tol:
            break
        c = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]
        xr = [c[j] + (c[j] - pts[-1][j]) for j in range(n)]
        fr = f(xr)
        if fr < vals[0]:
            xe = [c[j] + 2 * (c[j] - pts[-1][j]) for j in range(n)]
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = [c[j] + 0.5 * (pts[-1][j] - c[j]) for j in range(n)]
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0]] + [[pts[0][j] + 0.5 * (p[j] - pts[0][j]) for j in range(n)]
                                  for p in pts[1:]]  # fmt: skip
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    i = min(range(n + 1), key=lambda i: vals[i])
    return pts[i], vals[i]


def gemm_rows() -> tuple[list, list]:
    g = json.loads((HERE / "gemm.json").read_text())
    grid = [(r["m"], r["n"], r["k"], r["tflops"]) for r in g["grid"]
            if 2 * r["m"] * r["n"] * r["k"] >= 2e9]  # fmt: skip
    model = [(r["m"], r["n"], r["k"], r["tflops"]) for r in g["model"]]
    return grid, model


def gemm_errors(km, rows) -> list[float]:
    return [2 * m * n * k / gemm_time(m, n, k, PEAK, HBM, km) / 1e12 / tf - 1
            for m, n, k, tf in rows]  # fmt: skip


def main() -> None:
    km0 = KERNELS["h100"]
    grid, model = gemm_rows()

    def loss(p):
        emax, k0, launch_us, tile = p
        if emax <= 0 or k0 < 0 or launch_us < 0 or not 0 < tile <= 1:
            return 1e9
        km = replace(km0, emax=emax, k0=k0, launch_s=launch_us * 1e-6, small_tile=tile)
        return statistics.fmean(math.log1p(e) ** 2 for e in gemm_errors(km, grid + model))

    p, v = nelder_mead(loss, [0.8, 64, 5.0, 0.9], [0.05, 30, 3, 0.05])
    print(
        f"GEMM fit: emax {p[0]:.4f} k0 {p[1]:.1f} launch {p[2]:.1f} us small_tile {p[3]:.3f} "
        f"(rms log error {math.sqrt(v):.3f}); sources.py has emax {km0.emax:.4f} k0 "
        f"{km0.k0:.1f} launch {km0.launch_s * 1e6:.1f} us small_tile {km0.small_tile:.3f}"
    )
    for name, rows in (("grid >= 2 GFLOP", grid), ("published models' GEMMs", model)):
        e = [abs(x) for x in gemm_errors(km0, rows)]
        print(
            f"  {name}: {len(rows)} shapes, |error| median {statistics.median(e):.1%}, "
            f"90th percentile {sorted(e)[int(0.9 * len(e))]:.1%}, max {max(e):.1%}"
        )
    attn = json.loads((HERE / "attn.json").read_text())["rows"]
    for key, field, mult in (("attn_fwd", "fwd_s", 1.0), ("attn_fwd_bwd", "fwd_bwd_s", 3.5)):
        for hd in (128, 64):
            rs = [r for r in attn if r["hd"] == hd]

            def lf(q, rs=rs, field=field, mult=mult):
                e, sh = q
                if e <= 0 or sh < 0:
                    return 1e9
                return sum((math.log(mult * r["causal_fwd_flops"] / r[field] / PEAK)
                            - math.log(e * r["seq"] / (r["seq"] + sh))) ** 2 for r in rs)  # fmt: skip

            q, _ = nelder_mead(lf, [0.35, 800], [0.05, 200])
            print(f"attention {key} hd {hd}: e_inf {q[0]:.3f} s_half {q[1]:.0f}")
    print(
        f"sources.py: attn_fwd {km0.attn_fwd}, attn_fwd_bwd {km0.attn_fwd_bwd}, "
        f"hd64 ratio {km0.attn_hd64}"
    )
    for r in json.loads((HERE / "block.json").read_text())["rows"]:
        shape = ModelShape(vocab_size=256, dim=r["d"], n_layers=1, n_heads=r["heads"],
                           n_kv_heads=r["kv"], ffn_dim=r["ffn"],
                           family="gpt" if r["family"] == "gpt" else "llama")  # fmt: skip
        t = r["seq"] * r["batch"]
        gf = sum(gemm_time(t, n, k, PEAK, HBM, km0) for _, n, k in linears(shape))
        gb = sum(gemm_time(t, k, n, PEAK, HBM, km0) + gemm_time(n, k, t, PEAK, HBM, km0)
                 for _, n, k in linears(shape))  # fmt: skip
        af, ab = attention_time(t, r["seq"], r["heads"], r["d"] // r["heads"], PEAK, km0)
        print(
            f"block {r['family']} d {r['d']} tokens {t}: beyond GEMMs and attention "
            f"{(r['fwd_s'] - gf - af) * 1e3:.2f} ms forward, "
            f"{(r['fwd_bwd_s'] - r['fwd_s'] - gb - ab) * 1e3:.2f} ms backward"
        )


if __name__ == "__main__":
    main()
