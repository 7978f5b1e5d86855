"""The suite's reruns as on another CPU (``ATEN_CPU_CAPABILITY=avx2|default``, README) work on
a CPU with AMX: see ``tests/_cpu.py``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _cpu import align_onednn_isa

# bf16 attention forward and backward against the same in fp32, each error relative to the
# largest fp32 value. Bound: bf16 keeps 8 bits (2^-8 relative per rounding) and the inputs, the
# probabilities, the output and the gradients' matmul inputs each round once: 4 x 2^-8. Measured
# 0.0019-0.0064 under AVX512, AVX2 and DEFAULT on an AMX CPU.
CODE = """
import torch, torch.nn.functional as F
torch.manual_seed(0)
q, k, v = (torch.randn(2, 4, 64, 32) for _ in range(3))
ref = [t.clone().requires_grad_() for t in (q, k, v)]
low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
out_ref = F.scaled_dot_product_attention(*ref, is_causal=True)
out = F.scaled_dot_product_attention(*low, is_causal=True)
out_ref.square().sum().backward()
out.float().square().sum().backward()
pairs = [(out, out_ref)] + [(a.grad, b.grad) for a, b in zip(low, ref)]
rel = max(((a.float() - b).abs().max() / b.abs().max()).item() for a, b in pairs)
print(torch.backends.cpu.get_cpu_capability(), rel)
assert rel <= 4 * 2**-8, rel
"""


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_bf16_attention_under_a_lowered_capability(capability: str) -> None:
    """Fails on an AMX CPU without ``align_onednn_isa`` ("pack_vnni2 is only supported when
    avx512 is supported"); on a CPU without AMX it passes either way."""
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    env["ATEN_CPU_CAPABILITY"] = capability
    align_onednn_isa(env)
    p = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split()[0] == capability.upper(), p.stdout
