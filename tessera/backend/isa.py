"""The x86 vector instruction set of the machine tessera's C kernels are built for.

CPU kernels are compiled with `-march=native`, so the ISA is the build machine's: AVX-512
(16 float32 lanes) where the CPU has avx512f, AVX2 + FMA (8 lanes) otherwise, and no SIMD
vectors at all on anything older (or not x86).  `TESSERA_CPU_ISA=avx2` (or `scalar`; see
tessera.settings) caps it, to test the narrower code paths on a wider machine.  The ISA is part
of every C artifact's cache key (backend.build), so a kernel built for one width is never loaded
for another.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

from tessera import settings

ISAS = settings.CPU_ISA.choices  # narrowest first
_LANES_F32 = {"scalar": 1, "avx2": 8, "avx512": 16}


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _hardware_isa() -> str:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "scalar"
    flags = _cpu_flags()
    if {"avx512f", "avx512vl", "avx512dq", "avx512bw"} <= flags:
        return "avx512"
    if {"avx2", "fma", "f16c"} <= flags:  # (F16C: every AVX2 CPU has it; vfloat16 needs it)
        return "avx2"
    return "scalar"


def cpu_isa() -> str:
    """"avx512", "avx2" or "scalar": the widest vector ISA the C kernels may use here."""
    hw = _hardware_isa()
    cap = settings.cpu_isa_cap()
    if cap is None:
        return hw
    return cap if ISAS.index(cap) < ISAS.index(hw) else hw


def vector_lanes(isa: str | None = None) -> int:
    """float32 lanes of one vector register under `isa` (default: this machine's)."""
    return _LANES_F32[isa or cpu_isa()]


def supports_lanes(lanes: int, isa: str | None = None) -> bool:
    """Whether f32 vectors of `lanes` lanes can be compiled under `isa`."""
    isa = isa or cpu_isa()
    return lanes == 8 and isa in ("avx2", "avx512") or lanes == 16 and isa == "avx512"
