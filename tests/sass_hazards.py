"""Find instructions that touch an in-flight wgmma's registers in a cubin's SASS.

An HGMMA reads its A fragment (register-A form) and writes its accumulators asynchronously,
until a `WARPGROUP.DEPBAR.LE gsb0, n` leaves at most n groups in flight.  Any other instruction
that reads or writes those registers before that point races with the tensor cores.  The PTX
tessera emits orders such accesses after `wgmma.wait_group`, but ptxas (CUDA 13.0) was seen
to hoist an epilogue's F2FP conversions of the accumulators above the final
`DEPBAR.LE gsb0, 0x0` of the register-A low-bit GEMM (tessera.templates.lowbit.gemm_rs): on the
H200 exactly those configurations lost part of the last k-step's products (rel_err ~2e-2), so
this is checked on the machine code, not the source.

The scan walks the listing in address order (straight-line: a loop's back edge is not
followed), which is how the hazard showed: in the loop's exit block.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

_INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_HGMMA = re.compile(r"HGMMA\.64x(\d+)x\d+\S*\s+R(\d+),\s*(R(\d+)|gdesc)")
_DEPBAR = re.compile(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*(0x[0-9a-f]+|\d+)")
_REGISTER = re.compile(r"\bR(\d+)\b")


def cuobjdump() -> str | None:
    """cuobjdump from $TESSERA_CUOBJDUMP, the PATH, or the nvidia-cuda-cuobjdump wheel."""
    path = os.environ.get("TESSERA_CUOBJDUMP") or shutil.which("cuobjdump")
    if path:
        return path
    try:
        import nvidia

        for root in nvidia.__path__:
            for sub in ("cu13", "cuda_cuobjdump", "cu12"):
                candidate = os.path.join(root, sub, "bin", "cuobjdump")
                if os.access(candidate, os.X_OK):
                    return candidate
    except ImportError:
        pass
    return None


def hazards(sass: str) -> list[str]:
    """The instructions of `sass` (cuobjdump -sass text) that read or write registers of an
    HGMMA still in flight (its accumulators, and its A fragment when register-sourced)."""
    pending: list[set[int]] = []  # register sets of the HGMMAs in flight, oldest first
    found = []
    for line in sass.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        text = re.sub(r"^@!?U?P\w+\s+", "", m.group(2))  # (a predicate guards, it does not read)
        h = _HGMMA.match(text)
        if h:
            regs = set(range(int(h.group(2)), int(h.group(2)) + int(h.group(1)) // 2))
            if h.group(4):
                regs |= set(range(int(h.group(4)), int(h.group(4)) + 4))
            pending.append(regs)
            continue
        d = _DEPBAR.match(text)
        if d:
            keep = int(d.group(1), 0)
            pending = pending[len(pending) - keep:] if keep else []
            continue
        used = {int(r) for r in _REGISTER.findall(text)}
        if any(used & regs for regs in pending):
            found.append(f"/*{m.group(1)}*/ {m.group(2)}")
    return found


def kernel_hazards(kernel) -> list[str]:
    """Build `kernel` (a tessera CUDA kernel) for sm_90a and scan its SASS."""
    tool = cuobjdump()
    if tool is None:
        raise RuntimeError("cuobjdump is not available")
    cubin = kernel.build()
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    if "HGMMA" not in sass:
        raise RuntimeError(f"no HGMMA in {cubin}: not an SM90 build?")
    return hazards(sass)
