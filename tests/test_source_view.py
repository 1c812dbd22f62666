"""`Kernel.source` shows the kernel and only the prelude helpers it uses; `Kernel.source_full`
is what is compiled.  The readable source still compiles (nothing it needs is left out)."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

import tessera as ts
from tessera import f16, f32, i32
from tessera.backend.build import build_c
from tessera.backend.source_view import readable
from tessera.examples.matmul import make_matmul
from tessera.examples.softmax import make_softmax
from tessera.examples.vector_add import make_vector_add

NVCC = shutil.which("nvcc")


@ts.kernel
def plain_add(a: f32["n"], b: f32["n"], c: f32["n"]):
    for i in ts.parallel(a.shape[0]):
        c[i] = a[i] + b[i]


@ts.kernel
def half_floordiv(a: f16["n"], k: i32["n"], d: i32["n"], out: f16["n"], q: i32["n"]):
    for i in ts.parallel(a.shape[0]):
        out[i] = a[i] * ts.cast(2.0, f16)
        q[i] = k[i] // d[i]


def _helpers(source: str) -> set[str]:
    import re

    return set(re.findall(r"\b(ts_(?!kernel_)\w+)\s*\(", source.split("ts_kernel_")[0]))


def test_cpu_source_drops_unused_helpers():
    full, short = plain_add.source_full, plain_add.source
    assert "ts_h2f" in full and "ts_floordiv_chk" in full
    assert "ts_h2f" not in short and "ts_floordiv" not in short
    assert "void ts_kernel_plain_add(" in short and short.count("\n") < full.count("\n") // 3
    assert "prelude helpers this kernel does not use are left out" in short and "#include <math.h>" in short
    assert plain_add.build()  # what is built is the full source
    assert readable(full) == short


def test_cpu_source_keeps_used_helpers_transitively(rng):
    short = half_floordiv.source
    assert {"ts_h2f", "ts_f2h", "ts_floordiv_chk", "ts_floordiv"} <= _helpers(short)  # _chk calls ts_floordiv
    assert "ts_floormod" not in short and "ts_udiv_chk" not in short
    # The readable source is a complete program: it compiles, and the library it makes runs.
    path = build_c(short)
    assert path.is_file()
    n = 23
    a = rng.standard_normal(n).astype(np.float16)
    k, d = rng.integers(-50, 50, n).astype(np.int32), rng.integers(1, 9, n).astype(np.int32)
    out, q = np.empty_like(a), np.empty_like(k)
    half_floordiv(a, k, d, out, q)
    np.testing.assert_array_equal(q, k // d)
    np.testing.assert_allclose(out, a * np.float16(2), rtol=1e-3)


@pytest.mark.parametrize("make", [make_matmul, make_softmax, make_vector_add])
def test_example_sources_stay_complete_on_the_cpu(make):
    kernel = make("cpu")
    assert build_c(kernel.source).is_file()


def test_cuda_source_keeps_only_the_instructions_it_uses():
    from tessera.ir import dtypes
    from tessera.templates.gemm.config import make_kernel
    from tessera.templates.gemm.space import heuristic_config

    kernel = make_kernel(dtypes.float16, heuristic_config(256, 256, 256, 1, "mma"), "nk", True)
    full, short = kernel.source_full, kernel.source
    used = _helpers(short)
    assert {"ts_copy_async", "ts_smem", "ts_ldmatrix"} <= used  # ts_smem only through the others
    assert "ts_tma_load_2d" in full and "ts_tma_load_2d" not in short and "ts_wgmma_desc" not in short
    assert "ts_mbarrier_wait" not in short and short.count("\n") < full.count("\n")
    assert readable(short) == short  # nothing more to leave out


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("make", [make_matmul, make_softmax, make_vector_add])
def test_example_sources_stay_complete_on_cuda(make, tmp_path):
    src = tmp_path / "k.cu"
    src.write_text(make("cuda").source)
    proc = subprocess.run([NVCC, "-cubin", "-std=c++17", "-arch=sm_90a", str(src), "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr


def test_text_without_kernels_is_unchanged():
    text = "#include <stdint.h>\nstatic inline int ts_one(void) { return 1; }\n"
    assert readable(text) == text
