"""No instruction touches an in-flight wgmma's registers in the SASS of tessera's SM90 kernels
(tests/sass_hazards.py): the register-A low-bit GEMM at every config over types, groups and
zero points, the TMA GEMM, the shared-memory fused low-bit GEMM and flash attention.  CPU tier:
nvcc and cuobjdump (the nvidia-cuda-cuobjdump wheel of the test extras) only."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
from sass_hazards import cuobjdump, hazards, kernel_hazards

import tessera as ts
from tessera.ir import dtypes

pytestmark = [pytest.mark.toolchain,
              pytest.mark.skipif(shutil.which("nvcc") is None or cuobjdump() is None,
                                 reason="needs nvcc and cuobjdump (pip install nvidia-cuda-cuobjdump)")]  # fmt: skip


def test_the_scan_finds_an_accumulator_read_before_the_wait():
    """A read of an HGMMA's accumulator or A register between it and the DEPBAR that retires it
    is found; after the DEPBAR, or of other registers, it is not."""
    sass = """
        /*0100*/                   HGMMA.64x128x16.F32 R24, R96, gdesc[UR12], R24, gsb0 ;
        /*0110*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0120*/                   F2FP.F16.F32.PACK_AB R200, R201, R202 ;
        /*0130*/                   F2FP.F16.F32.PACK_AB R88, R25, R24 ;
        /*0140*/                   IADD3 R97, R1, 0x1, RZ ;
        /*0150*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0160*/                   F2FP.F16.F32.PACK_AB R90, R27, R26 ;
    """
    assert hazards(sass) == ["/*0130*/ F2FP.F16.F32.PACK_AB R88, R25, R24", "/*0140*/ IADD3 R97, R1, 0x1, RZ"]
    assert hazards(sass.replace("gsb0, 0x1", "gsb0, 0x0")) == []


def _kernels() -> list[tuple[str, object]]:
    from tessera.templates.attention.flash import FlashConfig, make_flash_attention
    from tessera.templates.gemm import tma as gemm_tma
    from tessera.templates.lowbit import gemm as lowbit_gemm
    from tessera.templates.lowbit import gemm_rs as lowbit_gemm_rs
    from tessera.templates.lowbit import gemm_rs_config as rs_config

    out = []
    for name, group, bias in (("int4", 128, False), ("int8", 128, False), ("e4m3", 128, False), ("e2m1", 64, False),
                              ("uint4", 32, True), ("int2", 512, False), ("int3", 16, True)):  # fmt: skip
        for config in rs_config.CONFIGS + rs_config.CLUSTER_CONFIGS + rs_config.STREAM_K_CONFIGS:
            if not lowbit_gemm_rs.problems(ts.dtype(name), group, bias, config):
                out.append((f"rs {name} g{group}{' z' if bias else ''} {config}",
                            lowbit_gemm_rs.make_lowbit_gemm_rs(ts.dtype(name), group, bias, config)))  # fmt: skip
    out.append(("gemm_tma 256x128 staged", gemm_tma.make_gemm_tma(dtypes.float16, gemm_tma.TmaConfig(256, 128, 3, epilogue="staged"))))
    out.append(("gemm_tma 128x256 staged", gemm_tma.make_gemm_tma(dtypes.float16, gemm_tma.TmaConfig(128, 256, 3, epilogue="staged"))))
    out.append(("lowbit_gemm int4", lowbit_gemm.make_lowbit_gemm(ts.dtype("int4"), 128, False, lowbit_gemm.prefill_config())))
    out.append(("flash attention d128", make_flash_attention(dtypes.float16, 128, FlashConfig())))
    return out


@pytest.mark.slow
def test_no_sm90_kernel_touches_registers_of_a_wgmma_in_flight():
    kernels = _kernels()
    with ThreadPoolExecutor(2) as ex:
        found = list(ex.map(lambda nk: kernel_hazards(nk[1]), kernels))
    bad = {name: f[:3] for (name, _), f in zip(kernels, found) if f}
    assert not bad, bad
