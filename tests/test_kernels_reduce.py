"""Reduction, softmax and normalisation kernels.

CPU tier: the schedule chooser, nvcc compiles of every kernel family (vector and element
loads, cached and streaming, short-row and one-row-per-block schedules), no register spills
at the benchmark shapes.  GPU tier (-m cuda): every variant and the dispatch functions
against float64 torch at odd shapes, in float16, bfloat16 and float32.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

import tessera as ts
from tessera import bf16, f16, f32
from tessera.errors import UnsupportedError
from tessera.templates.row import kinds as reduce_ops
from tessera.templates.row import make_layernorm, make_rmsnorm, make_row_reduce, make_softmax
from tessera.templates.row.kinds import MAX_CACHED_ELEMS, SOFTMAX_CACHED_ELEMS, choose_schedule, kernel_for
from tessera.templates.row.schedule import SCALAR_BLOCK, RowSchedule

EPS = 1e-5
NVCC = shutil.which("nvcc")
REDUCE_OPS = ["sum", "mean", "max", "min"]
ALL_OPS = REDUCE_OPS + ["softmax", "layernorm", "rmsnorm"]


def _make(op: str, dtype, schedule: RowSchedule) -> ts.Kernel:
    if op in REDUCE_OPS:
        return make_row_reduce(op, dtype, schedule)
    return {"softmax": make_softmax, "layernorm": make_layernorm, "rmsnorm": make_rmsnorm}[op](dtype, schedule)


# ---- CPU tier ---------------------------------------------------------------------------------


@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("vector", [True, False])
@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("raw", [True, False])
def test_choose_schedule(itemsize, vector, cached, raw):
    vec = 16 // itemsize if vector else 1
    dtype = f16 if itemsize == 2 else f32
    for C in [1, 2, 3, 7, 8, 24, 64, 100, 256, 768, 1000, 1024, 1032, 4096, 4099, 8192, 8193, 16384, 32768, 40000,
              100000]:  # fmt: skip
        if vector and C % vec:
            continue
        s = choose_schedule(C, itemsize, vector, cached, raw=raw)
        assert not s.problems(dtype), (C, s)
        assert s.vec == vec
        loads = -(-C // vec)
        if s.raw:
            assert raw and cached and vector and s.capacity >= C and s.per_thread <= 8 and s.threads >= 64, (C, s)
        elif s.cached:
            assert cached and s.capacity >= C and s.per_thread * vec <= MAX_CACHED_ELEMS, (C, s)
        if loads <= 32 * 4:  # short rows share a block
            assert s.lanes <= 32 and s.rows_per_block > 1, (C, s)


def test_short_rows_use_a_warp_or_less():
    s = choose_schedule(768, 2, True)  # 2048 x 768 fp16: 96 loads per row
    assert (s.lanes, s.per_thread, s.cached, s.rows_per_block) == (32, 3, True, 4)
    assert choose_schedule(8192, 2, True) == RowSchedule(256, 256, 8, 4, True)
    assert not choose_schedule(1 << 20, 2, True).cached  # far beyond the registers: streaming
    # Softmax caches at most 16 values per thread: more threads per row, or streaming.
    assert choose_schedule(4096, 2, True, max_cached_elems=16) == RowSchedule(256, 256, 8, 2, True)
    assert not choose_schedule(16384, 2, True, max_cached_elems=16).cached
    # 16-bit softmax caches the row as loaded: 8 vector loads per thread, blocks of C / 64 threads.
    assert kernel_for("softmax", "torch.float16", 4096, True) is make_softmax(f16, RowSchedule(64, 64, 8, 8, True, True))  # fmt: skip
    assert kernel_for("softmax", "torch.bfloat16", 16384, True).ir.name.endswith("t256_l256_v8_p8_cr")
    assert kernel_for("softmax", "torch.float16", 768, True).ir.name.endswith("t128_l32_v8_p3_c")  # short rows
    assert kernel_for("softmax", "torch.float32", 8192, True).ir.name.endswith("t512_l512_v4_p4_c")
    assert not kernel_for("softmax", "torch.float16", 4096, False).ir.name.endswith("r")  # element loads
    assert not choose_schedule(1 << 16, 2, True, True, 16, raw=True).cached  # beyond 512 threads: streaming
    assert kernel_for("sum", "torch.float32", 8192, True) is make_row_reduce("sum", f32, RowSchedule(512, 512, 4, 4))


def test_schedule_problems():
    assert RowSchedule(256, 16, 8, 4).problems(f16) == []
    assert RowSchedule(256, 256, 4, 4).problems(f32) == []
    for bad in (RowSchedule(100, 100), RowSchedule(256, 64), RowSchedule(256, 12), RowSchedule(256, 256, 8)):
        with pytest.raises(UnsupportedError):
            _make("sum", f32, bad)
    with pytest.raises(ValueError, match="unknown reduction"):
        make_row_reduce("prod", f16)
    assert "raw" in RowSchedule(256, 256, 8, 4, False, True).problems(f16)[0]
    assert str(RowSchedule(256, 256, 8, 4, True, True)) == "t256_l256_v8_p4_cr"
    for make in (make_layernorm, make_rmsnorm):  # the norms cache float32 only
        with pytest.raises(UnsupportedError, match="raw"):
            make(f16, RowSchedule(256, 256, 8, 4, True, True))


# One of each kernel family: (schedule, dtype).
FAMILIES = [
    (RowSchedule(128, 32, 8, 3, True), f16),  # short rows, vector, cached
    (RowSchedule(128, 4, 8, 2, False), f16),  # short rows, vector, streaming
    (RowSchedule(256, 256, 8, 4, True), f16),  # row per block, vector, cached
    (RowSchedule(512, 512, 8, 4, False), bf16),  # row per block, vector, streaming
    (RowSchedule(512, 512, 4, 8, True), f32),  # row per block, float32 vector, cached
    (RowSchedule(128, 8, 1, 4, True), bf16),  # short rows, element loads, cached
    (RowSchedule(512, 512, 1, 9, True), f16),  # element loads, cached (C = 4099)
    (SCALAR_BLOCK, f32),  # the original schedule
]
# Softmax with the row cached as loaded (raw): row per block, short rows, element loads.
RAW_SOFTMAX = [(RowSchedule(256, 256, 8, 8, True, True), f16), (RowSchedule(64, 16, 8, 4, True, True), bf16),
               (RowSchedule(128, 128, 1, 9, True, True), f32)]  # fmt: skip


def _build_all(kernels: list[ts.Kernel]) -> list[str]:
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as ex:
        return list(ex.map(lambda k: k.build(), kernels))


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.slow
def test_reduce_kernels_compile():
    kernels = [_make(op, dt, s) for s, dt in FAMILIES for op in ("sum", "max", "softmax", "layernorm", "rmsnorm")]
    kernels += [make_row_reduce("max", f16), make_softmax(f16), make_layernorm(f16), make_rmsnorm(f16)]
    kernels += [make_softmax(dt, s) for s, dt in RAW_SOFTMAX]
    for k, path in zip(kernels, _build_all(kernels)):
        assert path.endswith(".cubin")
        assert "__shfl_xor_sync" in k.source or "_l1_" in k.ir.name
    for s, dt in FAMILIES:
        src = make_softmax(dt, s).source
        assert ("ts_copy_vector<16>" in src) == (s.vec > 1), s
        assert ("__syncthreads" in src) == s.block_combine, s


def _ptxas_usage(source: str, tmp_path, name: str) -> str:
    cu = tmp_path / f"{name}.cu"
    cu.write_text(source)
    cmd = [NVCC, "-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas=-v", str(cu),
           "-o", str(tmp_path / f"{name}.cubin")]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return out.stderr


@pytest.mark.cuda
@pytest.mark.toolchain
@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_benchmark_schedules_do_not_spill(tmp_path):
    """The cached kernels keep the row in registers: a spill would put it in local memory.  GPU
    tier: register allocation is ptxas's, so this holds for the toolchain the GPU machine runs."""
    cases = [(C, f16) for C in (768, 4096, 8192, 16384)] + [(8192, f32), (4099, f16)]
    jobs = []
    for C, dt in cases:
        vector = C % (16 // dt.nbytes) == 0
        s = choose_schedule(C, dt.nbytes, vector)
        assert s.cached
        jobs += [(f"{op}_{C}_{dt.short}", _make(op, dt, s).source) for op in ("softmax", "layernorm", "rmsnorm")]
        jobs.append((f"softmax_dispatch_{C}_{dt.short}", kernel_for("softmax", f"torch.{dt}", C, vector).source))
    with ThreadPoolExecutor(2) as ex:
        logs = list(ex.map(lambda j: _ptxas_usage(j[1], tmp_path, j[0]), jobs))
    for (name, _), log in zip(jobs, logs):
        # ptxas may spill a stray word at no cost; a spilled row cache is hundreds of bytes.
        spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", log)]
        assert max(spills, default=0) <= 16, (name, log)


def test_dispatch_checks_its_arguments():
    torch = pytest.importorskip("torch")
    with pytest.raises(UnsupportedError, match="CUDA"):
        reduce_ops.softmax(torch.ones(3, 4))
    with pytest.raises(UnsupportedError, match="float16"):
        reduce_ops.row_reduce(torch.ones(3, 4, dtype=torch.int32), "sum")
    with pytest.raises(ValueError, match="unknown reduction"):
        reduce_ops.row_reduce(torch.ones(3, 4), "prod")


# ---- GPU tier ---------------------------------------------------------------------------------

# Odd shapes; (33, 1001) has C % 8 != 0 (element loads only); (3, 40000) streams in every
# dtype; (2048, 768) is the short-row benchmark shape; (7, 24) has 3 vector loads per row.
SHAPES = [(1, 1), (3, 1000), (17, 4099), (130, 8193), (2048, 768), (7, 24), (33, 1001), (5, 12288), (3, 40000)]
DTYPES = ["float16", "bfloat16", "float32"]
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-5}


def variants(op: str, C: int, dtype) -> list[RowSchedule]:
    """Every schedule family that can run rows of C elements, the dispatcher's choices first."""
    cached = op not in REDUCE_OPS
    V = 16 // dtype.nbytes
    vecs = [1, V] if C % V == 0 else [1]
    out = [choose_schedule(C, dtype.nbytes, vec > 1, cached) for vec in vecs]
    if op == "softmax":
        out += [choose_schedule(C, dtype.nbytes, vec > 1, True, SOFTMAX_CACHED_ELEMS, raw) for vec in vecs
                for raw in (False, True)]  # fmt: skip
    for vec in vecs:
        out += [RowSchedule(128, 128, vec, 2, False), RowSchedule(64, 4, vec, 2, False)]  # several steps per row
        p = -(-C // (16 * vec))
        if cached and p <= 32 and p * vec <= 64:
            out.append(RowSchedule(64, 16, vec, p, True))  # short-row, cached
        if op == "softmax":  # the row cached as loaded: short-row and row-per-block
            if p <= 32 and p * vec <= 64:
                out.append(RowSchedule(64, 16, vec, p, True, True))
            p = -(-C // (128 * vec))
            if p <= 32 and p * vec <= 128:
                out.append(RowSchedule(128, 128, vec, p, True, True))
    out.append(SCALAR_BLOCK)
    return list(dict.fromkeys(out))


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    """Compile every kernel the GPU tests use in parallel, once, and load them."""
    kernels = {
        _make(op, ts.dtype(d), s) for d in DTYPES for _, C in SHAPES for op in ALL_OPS for s in variants(op, C, ts.dtype(d))
    }  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        if not os.environ.get("TESSERA_CACHE_DIR"):  # a cache the caller chose (prebuilt cubins) is kept
            mp.setenv("TESSERA_CACHE_DIR", str(tmp_path_factory.mktemp("reduce-cache")))
        with ThreadPoolExecutor(os.cpu_count() or 1) as ex:  # nvcc runs outside the GIL
            list(ex.map(lambda k: k.build(), kernels))
        for k in kernels:  # loading stays on this thread (the CUDA context)
            k.compile()
    return True


def _data(dtype_name: str, shape):
    torch = pytest.importorskip("torch")
    tdt = getattr(torch, dtype_name)
    x = torch.randn(*shape, device="cuda", dtype=tdt) * 3
    w = torch.randn(shape[-1], device="cuda", dtype=tdt)
    b = torch.randn(shape[-1], device="cuda", dtype=tdt)
    return torch, x, w, b


def _rel(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _reference(torch, op: str, x, w, b):
    x64, F = x.double(), torch.nn.functional
    if op in REDUCE_OPS:
        return {"sum": torch.sum, "mean": torch.mean, "max": torch.amax, "min": torch.amin}[op](x64, dim=-1)
    if op == "softmax":
        return torch.softmax(x64, -1)
    if op == "layernorm":
        return F.layer_norm(x64, (x.shape[-1],), w.double(), b.double(), EPS)
    return F.rms_norm(x64, (x.shape[-1],), w.double(), EPS)


def _tol(op: str, dtype_name: str, C: int = 1, lanes: int = 1 << 30) -> float:
    """The bound for one schedule.  A lane adds C / lanes float32 terms in sequence; rounding
    errors of such a sum grow like sqrt(n) * u with high probability (Higham and Mary, 2019), so
    float32 rows summed by few lanes (4 lanes over 40000 elements: 10000 terms each) get
    4 * sqrt(n) * u, which exceeds the flat 1e-5 only there."""
    base = TOL[dtype_name]
    if dtype_name == "float32":
        base = max(base, 4 * (C / lanes) ** 0.5 * 2.0**-24)
    return base * (10 if op in ("sum", "mean") else 2 if op in ("layernorm", "rmsnorm") else 1)


@pytest.mark.cuda
@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_every_variant_matches_float64(prebuilt, shape, dtype_name, op):
    torch, x, w, b = _data(dtype_name, shape)
    ref = _reference(torch, op, x, w, b)
    failures = []
    for s in variants(op, shape[1], ts.dtype(dtype_name)):
        y = torch.full(ref.shape, float("nan"), device="cuda", dtype=x.dtype)
        k = _make(op, ts.dtype(dtype_name), s)
        args = {"layernorm": (x, w, b, y, EPS), "rmsnorm": (x, w, y, EPS)}.get(op, (x, y))
        k(*args)
        err = _rel(y, ref)
        if not err < _tol(op, dtype_name, shape[-1], s.lanes):  # also catches NaN
            failures.append(f"{s}: rel err {err:.2e}")
    assert not failures, failures


@pytest.mark.cuda
@pytest.mark.parametrize("op", ALL_OPS)
@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("shape", SHAPES + [(2, 3, 96)])
def test_dispatch_matches_float64(prebuilt, shape, dtype_name, op):
    torch, x, w, b = _data(dtype_name, shape)
    ref = _reference(torch, op, x, w, b)
    out = _dispatch(op, x, w, b)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert _rel(out, ref) < _tol(op, dtype_name)


def _dispatch(op, x, w, b):
    if op in REDUCE_OPS:
        return reduce_ops.row_reduce(x, op)
    if op == "softmax":
        return reduce_ops.softmax(x)
    if op == "layernorm":
        return reduce_ops.layer_norm(x, w, b, EPS)
    return reduce_ops.rms_norm(x, w, EPS)


@pytest.mark.cuda
@pytest.mark.parametrize("op", ALL_OPS)
def test_dispatch_unaligned_and_strided_inputs(prebuilt, op):
    """A base pointer off by one element must take the element-load path; strided x is copied."""
    torch, x, w, b = _data("float16", (64, 1000))
    unaligned = torch.randn(64 * 1000 + 1, device="cuda", dtype=torch.float16)[1:].view(64, 1000)
    assert unaligned.data_ptr() % 16 != 0
    for inp in (unaligned, x.t().contiguous().t()[:, :512], x[:, 8:]):
        ref = _reference(torch, op, inp, w[: inp.shape[1]], b[: inp.shape[1]])
        out = _dispatch(op, inp, w[: inp.shape[1]], b[: inp.shape[1]])
        assert _rel(out, ref) < _tol(op, "float16")


@pytest.mark.cuda
@pytest.mark.parametrize("C", [768, 8192, 40000])
def test_softmax_masked_rows(prebuilt, C):
    """-inf entries (attention masks) contribute 0, also when a whole leading stretch is -inf."""
    torch = pytest.importorskip("torch")
    x = torch.randn(4, C, device="cuda", dtype=torch.float32)
    x[0, : C // 2] = float("-inf")
    x[1, ::3] = float("-inf")
    x[2, 1:] = float("-inf")
    for s in variants("softmax", C, f32):
        y = torch.empty_like(x)
        make_softmax(f32, s)(x, y)
        ref = torch.softmax(x.double(), -1)
        assert _rel(y, ref) < 1e-5, s


@pytest.mark.cuda
def test_layernorm_large_mean(prebuilt):
    """Rows with mean >> std: the streaming variance (shifted sums) must not cancel."""
    torch = pytest.importorskip("torch")
    x = torch.randn(3, 40000, device="cuda", dtype=torch.float32) + 1000.0
    w = torch.ones(40000, device="cuda")
    b = torch.zeros(40000, device="cuda")
    ref = torch.nn.functional.layer_norm(x.double(), (40000,), w.double(), b.double(), EPS)
    for s in variants("layernorm", 40000, f32):
        y = torch.empty_like(x)
        make_layernorm(f32, s)(x, w, b, y, EPS)
        assert _rel(y, ref) < 1e-4, s
