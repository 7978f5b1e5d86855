"""Accuracy of CPU flash attention's grouped heads (``enable_gqa=True``) against repeating k and
v to every q head, in bf16, each measured as the relative distance (Frobenius norm) to the fp64
result of the same inputs; mean over 5 seeds. Why ``llama._native_gqa`` uses the grouped kernel
on CPU in fp32/fp64 only.

    PYTHONPATH=src python benchmarks/memory/activations/gqa_accuracy.py > benchmarks/memory/activations/gqa_accuracy.txt
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def run(q, k, v, g, grouped):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    n_rep = q.shape[1] // k.shape[1]
    if grouped:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        kr, vr = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
        y = F.scaled_dot_product_attention(q, kr, vr, is_causal=True)
    return (y, *torch.autograd.grad(y, (q, k, v), g))


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def main() -> None:
    print(f"torch {torch.__version__}, bf16, batch 2, relative error against fp64, mean of 5 seeds")
    print(f"{'heads q/kv, seq, head_dim':28} {'':8} {'y':>9} {'dq':>9} {'dk':>9} {'dv':>9}")
    for h, kv, s, d in [(4, 2, 16, 8), (4, 1, 64, 16), (8, 2, 256, 64), (32, 8, 512, 128)]:
        errs = {True: [0.0] * 4, False: [0.0] * 4}
        for seed in range(5):
            torch.manual_seed(seed)
            q, k, v = torch.randn(2, h, s, d), torch.randn(2, kv, s, d), torch.randn(2, kv, s, d)
            g = torch.randn(2, h, s, d)
            ref = run(q.double(), k.double(), v.double(), g.double(), False)
            for grouped in (True, False):
                out = run(q.bfloat16(), k.bfloat16(), v.bfloat16(), g.bfloat16(), grouped)
                for i in range(4):
                    errs[grouped][i] += rel(out[i], ref[i]) / 5
        for grouped in (True, False):
            name = f"{h}/{kv}, {s}, {d}" if grouped else ""
            cells = " ".join(f"{e:9.2e}" for e in errs[grouped])
            print(f"{name:28} {'grouped' if grouped else 'repeated':8} {cells}")


if __name__ == "__main__":
    main()
