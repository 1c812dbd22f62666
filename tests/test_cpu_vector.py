"""SIMD vector types and intrinsics in CPU kernels (tessera.ir.vector), against numpy."""

import numpy as np
import pytest

import tessera as ts
from tessera import f32
from tessera.backend.isa import cpu_isa, supports_lanes, vector_lanes

LANES = [n for n in (8, 16) if supports_lanes(n)]
pytestmark = pytest.mark.skipif(not LANES, reason=f"no SIMD vectors on this CPU ({cpu_isa()})")


def _axpy(lanes: int):
    @ts.kernel(target="cpu", name=f"axpy{lanes}")
    def axpy(x: f32["N"], y: f32["N"], out: f32["N"], total: f32[1], a: f32):
        va = ts.vbroadcast(a, lanes)
        s = ts.vbroadcast(0.0, lanes)
        for i in range(0, N - N % lanes, lanes):
            v = ts.vfma(va, ts.vload(x[i], lanes), ts.vload(y[i], lanes))
            ts.prefetch(x[i + lanes])  # a hint: prefetching past the end is harmless
            ts.vstore(out[i], v)
            s = ts.vadd(s, v)
        r = N % lanes
        if r > 0:  # the tail: masked loads read, and the masked store writes, only r lanes
            i0 = N - r
            v = ts.vfma(va, ts.vload(x[i0], lanes, r), ts.vload(y[i0], lanes, r))
            ts.vstore(out[i0], v, r)
            s = ts.vadd(s, v)
        total[0] = ts.vsum(s)

    return axpy


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 17, 100])
@pytest.mark.slow
def test_axpy_with_tail(lanes, n):
    k = _axpy(lanes)
    rng = np.random.default_rng(n)
    for _ in range(2):  # several calls, fresh inputs
        x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
        # guard elements after the end: a masked store must not touch them
        out = np.full(n + lanes, 7.0, np.float32)
        total = np.zeros(1, np.float32)
        a = float(rng.standard_normal())
        k(x, y, out[:n], total, a)
        ref = a * x.astype(np.float64) + y
        np.testing.assert_allclose(out[:n], ref, rtol=1e-5, atol=1e-5)
        assert (out[n:] == 7.0).all()
        np.testing.assert_allclose(total[0], ref.sum(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.slow
def test_vector_register_tensor_max_min_mul(lanes):
    vt = ts.f32x16 if lanes == 16 else ts.f32x8

    @ts.kernel(target="cpu", name=f"mix{lanes}")
    def mix(x: f32[lanes * 2], out: f32[lanes * 2], mx: f32[1]):
        regs = ts.register_tensor(vt, [2])
        regs[0] = ts.vload(x[0], lanes)
        regs[1] = ts.vload(x[lanes], lanes)
        ts.vstore(out[0], ts.vmax(regs[0], regs[1]))
        ts.vstore(out[lanes], ts.vsub(ts.vmul(regs[0], regs[1]), ts.vmin(regs[0], regs[1])))
        mx[0] = ts.vreduce_max(regs[1])

    x = np.random.default_rng(1).standard_normal(2 * lanes).astype(np.float32)
    out, mx = np.zeros(2 * lanes, np.float32), np.zeros(1, np.float32)
    mix(x, out, mx)
    a, b = x[:lanes], x[lanes:]
    np.testing.assert_allclose(out[:lanes], np.maximum(a, b))
    np.testing.assert_allclose(out[lanes:], a * b - np.minimum(a, b), rtol=1e-6)
    assert mx[0] == b.max()


def _parse_error(fn, target="cpu"):
    with pytest.raises(ts.KernelSyntaxError) as info:
        ts.kernel(target=target)(fn)
    return str(info.value)


def test_vector_misuse_is_a_clear_error():
    def mixed(x: f32[16], out: f32[16]):
        ts.vstore(out[0], ts.vadd(ts.vload(x[0], 16), ts.vload(x[0], 8)))

    assert "one vector type" in _parse_error(mixed)

    def lanes(x: f32[16], out: f32[16]):
        ts.vstore(out[0], ts.vload(x[0], 4))

    assert "8 or 16 lanes" in _parse_error(lanes)

    def scalar_store(x: f32[16], out: f32[16]):
        ts.vstore(out[0], x[0])

    assert "vector" in _parse_error(scalar_store)

    def to_scalar(x: f32[16], out: f32[16]):
        out[0] = ts.vload(x[0], 16)

    assert "vectors do not convert" in _parse_error(to_scalar)

    def shorts(x: ts.int16[16], out: ts.int16[16]):
        ts.vstore(out[0], ts.vload(x[0], 16))

    assert "not supported" in _parse_error(shorts)

    def on_gpu(x: f32[16], out: f32[16]):
        ts.attrs.grid, ts.attrs.block = 1, 32
        out[0] = ts.vsum(ts.vload(x[0], 16))

    assert "only available in CPU kernels" in _parse_error(on_gpu, "cuda")


def _word_ops(lanes: int):
    u32, i32 = ts.uint32, ts.int32

    @ts.kernel(target="cpu", name=f"word_ops{lanes}")
    def word_ops(w: u32["N"], table: f32[lanes], shift: ts.int32, fields: f32["N"], mixed: u32["N"],
                 signed: i32["N"], looked: f32["N"]):  # fmt: skip
        tab = ts.vload(table[0], lanes)
        for i in range(0, N, lanes):
            r = min(lanes, N - i)
            v = ts.vload(w[i], lanes, r)  # masked: lanes past N read as 0
            field = ts.vand(ts.vshr(v, 4), ts.vbroadcast(0x3F, lanes, u32))  # bits 4..9: 0..63
            ts.vstore(fields[i], ts.vfloat(ts.vbitcast(field, i32)), r)
            mix = ts.vxor(ts.vor(ts.vshl(v, shift), ts.vshr(v, shift)), ts.vbroadcast(0x80000001, lanes, u32))
            ts.vstore(mixed[i], ts.vsub(ts.vadd(mix, v), ts.vbroadcast(7, lanes, u32)), r)
            ts.vstore(signed[i], ts.vshr(ts.vbitcast(v, i32), 3), r)  # arithmetic on int32
            f = ts.vlookup(tab, v)  # the low bits pick the entry
            flipped = ts.vxor(ts.vbitcast(f, u32), ts.vand(ts.vshl(v, 27), ts.vbroadcast(0x80000000, lanes, u32)))
            ts.vstore(looked[i], ts.vbitcast(flipped, f32), r)

    return word_ops


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.parametrize("n", [1, 8, 13, 40])
@pytest.mark.slow
def test_integer_vectors_match_numpy(lanes, n):
    """uint32 / int32 lanes: masked loads and stores, shifts by constants and by a runtime amount
    (logical on uint32, arithmetic on int32), bit operations, wrapping add / sub, conversion to
    float32, bit casts and table lookups, against numpy; several calls with fresh words."""
    k = _word_ops(lanes)
    rng = np.random.default_rng(n + lanes)
    for shift in (0, 5, 31):
        w = rng.integers(0, 2**32, n, dtype=np.uint32)
        table = rng.standard_normal(lanes).astype(np.float32)
        outs = [np.full(n + 1, 3, dt) for dt in (np.float32, np.uint32, np.int32, np.float32)]  # a guard at the end
        k(w, table, shift, *[o[:n] for o in outs])
        fields, mixed, signed, looked = outs
        np.testing.assert_array_equal(fields[:n], ((w >> 4) & 0x3F).astype(np.float32))
        ref = ((w << np.uint32(shift)) | (w >> np.uint32(shift))) ^ np.uint32(0x80000001)
        np.testing.assert_array_equal(mixed[:n], ref + w - np.uint32(7))
        np.testing.assert_array_equal(signed[:n], w.view(np.int32) >> 3)
        sign = np.where((w >> 4) & 1, -1.0, 1.0).astype(np.float32)
        np.testing.assert_array_equal(looked[:n], table[w & (lanes - 1)] * sign)
        assert all(o[n] == 3 for o in outs)


@pytest.mark.parametrize("lanes", LANES)
@pytest.mark.slow
def test_vfloat16_reads_every_half_bit_pattern(lanes):
    """vfloat16: each lane's low 16 bits as float16, exactly (subnormals, infinities, NaN),
    whatever the high 16 bits hold."""
    @ts.kernel(target="cpu", name=f"halves{lanes}")
    def halves(w: ts.uint32["N"], out: f32["N"]):
        for i in range(0, N, lanes):
            ts.vstore(out[i], ts.vfloat16(ts.vload(w[i], lanes)))

    bits = np.arange(2**16, dtype=np.uint32)
    noise = np.random.default_rng(lanes).integers(0, 2**16, bits.size, dtype=np.uint32) << np.uint32(16)
    out = np.empty(bits.size, np.float32)
    halves(bits | noise, out)
    ref = bits.astype(np.uint16).view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(out[~nan].view(np.uint32), ref[~nan].view(np.uint32))


@pytest.mark.slow
def test_avx512_integer_vectors_compile_with_gcc(monkeypatch, tmp_path):
    """The 16-lane C of the integer vectors (AVX-512: masked epi32 loads and stores, vpermps,
    vpmovdw + vcvtph2ps) builds with gcc, also on a machine that cannot run it."""
    import shutil
    import subprocess

    from tessera.backend import codegen_c

    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc")
    monkeypatch.setattr(codegen_c, "supports_lanes", lambda lanes, isa=None: lanes in (8, 16))

    @ts.kernel(target="cpu", name="halves16_compile_only")
    def halves(w: ts.uint32["N"], out: f32["N"]):
        for i in range(0, N, 16):
            ts.vstore(out[i], ts.vfloat16(ts.vload(w[i], 16)))

    for i, k in enumerate((_word_ops(16), halves)):
        src = tmp_path / f"k{i}.c"
        src.write_text(k.source)
        flags = ["-O2", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mfma", "-mf16c", "-fopenmp", "-std=c11"]
        out = subprocess.run([gcc, *flags, "-c", str(src), "-o", str(tmp_path / f"k{i}.o")], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-3000:]


def test_integer_vector_misuse_is_a_clear_error():
    lanes = LANES[0]

    def float_of_uint(w: ts.uint32[16], out: f32[16]):
        ts.vstore(out[0], ts.vfloat(ts.vload(w[0], lanes)))

    assert "vbitcast a uint32 vector to int32" in _parse_error(float_of_uint)

    def and_of_floats(x: f32[16], out: f32[16]):
        ts.vstore(out[0], ts.vand(ts.vload(x[0], lanes), ts.vload(x[0], lanes)))

    assert "int32 or uint32 vectors" in _parse_error(and_of_floats)

    def fma_of_ints(w: ts.int32[16], out: ts.int32[16]):
        v = ts.vload(w[0], lanes)
        ts.vstore(out[0], ts.vfma(v, v, v))

    assert "float32 vectors" in _parse_error(fma_of_ints)

    def far_shift(w: ts.uint32[16], out: ts.uint32[16]):
        ts.vstore(out[0], ts.vshl(ts.vload(w[0], lanes), 32))

    assert "0..31" in _parse_error(far_shift)

    def float_index(x: f32[16], out: f32[16]):
        v = ts.vload(x[0], lanes)
        ts.vstore(out[0], ts.vlookup(v, v))

    assert "integer index vector" in _parse_error(float_index)

    def fraction(w: ts.uint32[16], out: ts.uint32[16]):
        ts.vstore(out[0], ts.vbroadcast(1.5, lanes, ts.uint32))

    assert "not a uint32" in _parse_error(fraction)

    def half_of_floats(x: f32[16], out: f32[16]):
        ts.vstore(out[0], ts.vfloat16(ts.vload(x[0], lanes)))

    assert "float16 bits from int32 or uint32 lanes" in _parse_error(half_of_floats)

    def mixed_store(w: ts.uint32[16], out: f32[16]):
        ts.vstore(out[0], ts.vload(w[0], lanes))

    assert "element type" in _parse_error(mixed_store)


def test_isa_cap(monkeypatch):
    monkeypatch.setenv("TESSERA_CPU_ISA", "avx2")
    assert vector_lanes() in (1, 8)
    monkeypatch.setenv("TESSERA_CPU_ISA", "sse9")
    with pytest.raises(ts.ArgumentError, match="TESSERA_CPU_ISA"):
        cpu_isa()


@pytest.mark.parametrize("n", [1, 7, 769])
@pytest.mark.slow
def test_float_sums_are_simd_reductions(n):
    """The auto-scheduler's float sums become `omp simd` reductions (vectorised, reassociated);
    integer sums and maxima stay ordinary loops.  Results match numpy, tails included."""
    from tessera import ops

    x = ops.placeholder((3, n), "float32", "x")
    y = ops.add(ops.sum(x, -1), ops.max(x, -1))
    src = ops.generate([y], [x], "cpu", name="s").source
    assert src.count("#pragma omp simd reduction(+:") == (n > 1)  # a 1-element sum has no loop
    xi = ops.placeholder((3, n), "int32", "xi")
    assert "omp simd" not in ops.generate([ops.sum(xi, -1)], [xi], "cpu", name="si").source
    op = ops.build([y], [x], "cpu", name="s")
    for seed in range(2):
        a = np.random.default_rng(seed).standard_normal((3, n)).astype(np.float32)
        np.testing.assert_allclose(op(a), a.astype(np.float64).sum(-1) + a.max(-1), rtol=1e-5, atol=1e-5)
