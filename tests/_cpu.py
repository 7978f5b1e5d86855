"""Running the suite as on another CPU: ``ATEN_CPU_CAPABILITY=avx2|default`` (README, CI).

Note: that variable lowers ATen's own kernels only. oneDNN detects the machine's instruction
set by itself, and on a CPU with AMX torch 2.13's bf16 flash attention then packs its operands
for AMX with a kernel that exists only in ATen's AVX-512 build: every bf16 attention fails with
"pack_vnni2 is only supported when avx512 is supported". So when ATen is lowered, oneDNN is
capped at AVX2 as well (``ONEDNN_MAX_CPU_ISA``), which is what a CPU without AVX-512 has. It must
be set before torch is imported (oneDNN reads it once), hence conftest.py.
"""

from __future__ import annotations

from collections.abc import MutableMapping

LOWERED = {"avx2", "default"}  # ATen capabilities below AVX-512


def align_onednn_isa(env: MutableMapping[str, str]) -> None:
    """Cap oneDNN at AVX2 when ATen's capability is lowered and nobody chose oneDNN's cap."""
    if env.get("ATEN_CPU_CAPABILITY", "").lower() in LOWERED:
        env.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
