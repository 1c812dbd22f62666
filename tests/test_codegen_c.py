"""The C backend, end to end on the CPU: generated kernels against numpy at odd sizes.

Inputs are fresh random data (never all zeros) so that a kernel that does nothing, or
writes the wrong element, cannot pass by accident.  Outputs are pre-filled with a
sentinel for the same reason.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import tessera as ts
from tessera import bf16, boolean, f16, f32, f64, i8, i32, i64, u8, u32
from tessera.runtime.args import bind

SIZES = [1, 7, 37, 1001]


def nonzero_ints(rng, n, lo, hi, dtype):
    """Random non-zero integers in [lo, hi) of both signs."""
    x = rng.integers(lo, hi, n).astype(dtype)
    x[x == 0] = 1
    return x


def sentinel(shape, dtype):
    """Output buffers start as garbage-looking values, not zeros."""
    if np.dtype(dtype) == np.bool_:
        return np.ones(shape, dtype)
    if np.issubdtype(dtype, np.floating):
        return np.full(shape, np.nan, dtype)
    return np.full(shape, 123, dtype)


# ---- integer floor division and modulo ------------------------------------------------------------


@ts.kernel
def divmod_i32(a: i32["n"], b: i32["n"], q: i32["n"], r: i32["n"], q_lit: i32["n"], r_lit: i32["n"]):
    for i in range(a.shape[0]):
        q[i] = a[i] // b[i]
        r[i] = a[i] % b[i]
        q_lit[i] = (i - 17) // 5 + a[i] // -3
        r_lit[i] = (i - 17) % 5 + a[i] % -3


@ts.kernel
def divmod_i64(a: i64["n"], b: i64["n"], q: i64["n"], r: i64["n"]):
    for i in range(a.shape[0]):
        q[i] = a[i] // b[i]
        r[i] = a[i] % b[i]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.slow
def test_int32_floordiv_mod_negative(rng, n):
    a = nonzero_ints(rng, n, -10_000, 10_000, np.int32)
    b = nonzero_ints(rng, n, -60, 60, np.int32)
    a[: min(n, 4)] = [-7, 7, -6, 6][: min(n, 4)]  # exact multiples and near misses of small b
    b[: min(n, 4)] = [2, -2, -3, 3][: min(n, 4)]
    q, r, q_lit, r_lit = (sentinel(n, np.int32) for _ in range(4))
    divmod_i32(a, b, q, r, q_lit, r_lit)
    idx = np.arange(n)
    np.testing.assert_array_equal(q, a // b)
    np.testing.assert_array_equal(r, a % b)
    np.testing.assert_array_equal(q_lit, (idx - 17) // 5 + a // -3)
    np.testing.assert_array_equal(r_lit, (idx - 17) % 5 + a % -3)
    # and exactly Python's semantics, element by element
    assert [int(x) for x in q] == [int(x) // int(y) for x, y in zip(a, b)]
    assert [int(x) for x in r] == [int(x) % int(y) for x, y in zip(a, b)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.slow
def test_int64_floordiv_mod_negative(rng, n):
    a = nonzero_ints(rng, n, -(2**62), 2**62, np.int64)
    b = nonzero_ints(rng, n, -(2**40), 2**40, np.int64)
    b[::3] = rng.integers(-9, 9, b[::3].size) | 1  # small divisors too
    q, r = sentinel(n, np.int64), sentinel(n, np.int64)
    divmod_i64(a, b, q, r)
    assert [int(x) for x in q] == [int(x) // int(y) for x, y in zip(a, b)]
    assert [int(x) for x in r] == [int(x) % int(y) for x, y in zip(a, b)]


@pytest.mark.slow
def test_nonnegative_loop_index_division(rng):
    """Loop indices are non-negative, so plain C division is used; it must still be right."""

    @ts.kernel
    def idx_div(q: i32["n"], r: i32["n"]):
        for i in range(q.shape[0]):
            q[i] = i // 7
            r[i] = i % 7

    q, r = sentinel(100, np.int32), sentinel(100, np.int32)
    idx_div(q, r)
    np.testing.assert_array_equal(q, np.arange(100) // 7)
    np.testing.assert_array_equal(r, np.arange(100) % 7)
    assert "ts_floordiv" not in idx_div.source.split("void ts_kernel_idx_div")[1]


BIG = 5_000_000_000


@pytest.mark.slow
def test_large_python_int_constant_widens(rng):
    """An int literal that does not fit int32 must not be squeezed into int32 arithmetic."""

    @ts.kernel
    def widen(a: i32["n"], o: i64["n"], p: i64["n"]):
        for i in range(a.shape[0]):
            o[i] = (a[i] + BIG) // 7
            p[i] = (a[i] - 2**40) % 1000

    a = nonzero_ints(rng, 41, -(2**31), 2**31 - 1, np.int32)
    o, p = sentinel(41, np.int64), sentinel(41, np.int64)
    widen(a, o, p)
    np.testing.assert_array_equal(o, (a.astype(np.int64) + BIG) // 7)
    np.testing.assert_array_equal(p, (a.astype(np.int64) - 2**40) % 1000)


# ---- float modulo, int64 arithmetic, casts ----------------------------------------------------------


@ts.kernel
def fmod_kernel(a: f32["n"], b: f32["n"], r: f32["n"], c: f64["n"], d: f64["n"], s: f64["n"]):
    for i in range(a.shape[0]):
        r[i] = a[i] % b[i]
        s[i] = c[i] % d[i] + c[i] % -1.25


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.slow
def test_float_mod_matches_numpy(rng, n):
    a = rng.uniform(-100, 100, n).astype(np.float32)
    b = (rng.uniform(0.5, 7, n) * rng.choice([-1, 1], n)).astype(np.float32)
    a[: min(n, 3)] = [-6.0, 7.5, -1e-3][: min(n, 3)]
    b[: min(n, 3)] = [3.0, -2.5, 4.0][: min(n, 3)]
    c = rng.uniform(-1e3, 1e3, n)
    d = rng.uniform(0.1, 10, n) * rng.choice([-1, 1], n)
    r, s = sentinel(n, np.float32), sentinel(n, np.float64)
    fmod_kernel(a, b, r, c, d, s)
    np.testing.assert_array_equal(r, np.mod(a, b))
    np.testing.assert_allclose(s, np.mod(c, d) + np.mod(c, -1.25), rtol=1e-12, atol=1e-12)
    # the result has the sign of the divisor, as in Python
    assert np.all((r == 0) | (np.sign(r) == np.sign(b)))


@pytest.mark.parametrize("n", [3, 37])
@pytest.mark.slow
def test_int64_arithmetic(rng, n):
    @ts.kernel
    def arith64(a: i64["n"], b: i32["n"], s: i64, o: i64[5, "n"]):
        for i in range(a.shape[0]):
            o[0, i] = a[i] * 3 - b[i]  # i64 op i32 promotes to i64
            o[1, i] = (a[i] >> 7) ^ (a[i] << 3)
            o[2, i] = a[i] * s
            o[3, i] = max(a[i], s) - min(a[i], -s) + abs(a[i])
            o[4, i] = b[i] * 1_000_000_007  # fits in int32 only as a literal, not as a product

    a = nonzero_ints(rng, n, -(2**40), 2**40, np.int64)
    b = nonzero_ints(rng, n, -(2**31), 2**31 - 1, np.int32)
    s = 2**33 + 17
    o = sentinel((5, n), np.int64)
    arith64(a, b, s, o)
    np.testing.assert_array_equal(o[0], a * 3 - b)
    np.testing.assert_array_equal(o[1], (a >> 7) ^ (a << 3))
    np.testing.assert_array_equal(o[2], a * s)
    np.testing.assert_array_equal(o[3], np.maximum(a, s) - np.minimum(a, -s) + np.abs(a))
    # int32 * int32 is int32 in tessera (as in numpy): it wraps, then widens on store
    np.testing.assert_array_equal(o[4], (b.astype(np.int64) * 1_000_000_007).astype(np.int32).astype(np.int64))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.slow
def test_float_to_int_cast_truncates(rng, n):
    @ts.kernel
    def trunc(x: f32["n"], y: f64["n"], a: i32["n"], b: i64["n"], c: i32["n"], d: u8["n"], e: boolean["n"]):
        for i in range(x.shape[0]):
            a[i] = ts.cast(x[i], i32)
            b[i] = ts.cast(y[i], i64)
            c[i] = int(x[i] * 2.5)
            d[i] = ts.cast(abs(x[i]), u8)
            e[i] = bool(x[i])

    x = rng.uniform(-200, 200, n).astype(np.float32)
    x[: min(n, 4)] = [-2.5, 2.5, -0.999, 0.0][: min(n, 4)]
    y = rng.uniform(-(2**50), 2**50, n)
    a, c = sentinel(n, np.int32), sentinel(n, np.int32)
    b, d, e = sentinel(n, np.int64), sentinel(n, np.uint8), np.zeros(n, bool)
    e[:] = ~(x != 0)
    trunc(x, y, a, b, c, d, e)
    np.testing.assert_array_equal(a, x.astype(np.int32))
    np.testing.assert_array_equal(a, np.trunc(x).astype(np.int32))
    np.testing.assert_array_equal(b, y.astype(np.int64))
    np.testing.assert_array_equal(c, (x * np.float32(2.5)).astype(np.int32))
    np.testing.assert_array_equal(d, np.abs(x).astype(np.uint8))
    np.testing.assert_array_equal(e, x.astype(bool))


# ---- intrinsics ---------------------------------------------------------------------------------------

_erf = np.vectorize(math.erf)


@ts.kernel
def intrinsics32(x: f32["n"], y: f32["n"], z: f32["n"], o: f32[13, "n"]):
    for i in range(x.shape[0]):
        o[0, i] = ts.exp(x[i])
        o[1, i] = ts.log(y[i])
        o[2, i] = ts.sqrt(y[i])
        o[3, i] = ts.rsqrt(y[i])
        o[4, i] = ts.tanh(x[i])
        o[5, i] = ts.erf(x[i])
        o[6, i] = ts.max_(x[i], z[i])
        o[7, i] = ts.min_(x[i], z[i])
        o[8, i] = ts.abs_(x[i])
        o[9, i] = ts.pow_(y[i], z[i])
        o[10, i] = ts.fma(x[i], y[i], z[i])
        o[11, i] = math.log2(y[i]) + math.exp2(z[i]) + ts.floor(x[i]) - math.ceil(z[i])
        o[12, i] = y[i] ** 0.5 + x[i] ** 2


@ts.kernel
def intrinsics64(x: f64["n"], y: f64["n"], z: f64["n"], o: f64[10, "n"]):
    for i in range(x.shape[0]):
        o[0, i] = ts.exp(x[i])
        o[1, i] = ts.log(y[i])
        o[2, i] = ts.sqrt(y[i])
        o[3, i] = ts.rsqrt(y[i])
        o[4, i] = ts.tanh(x[i])
        o[5, i] = ts.erf(x[i])
        o[6, i] = max(x[i], z[i]) - min(x[i], z[i])
        o[7, i] = abs(x[i])
        o[8, i] = pow(y[i], z[i])
        o[9, i] = ts.fma(x[i], y[i], z[i])


def _inputs(rng, n, dtype):
    x = rng.uniform(-4, 4, n).astype(dtype)
    y = rng.uniform(0.01, 20, n).astype(dtype)
    z = rng.uniform(-3, 3, n).astype(dtype)
    return x, y, z


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.slow
def test_intrinsics_float32(rng, n):
    x, y, z = _inputs(rng, n, np.float32)
    o = sentinel((13, n), np.float32)
    intrinsics32(x, y, z, o)
    x64, y64, z64 = (v.astype(np.float64) for v in (x, y, z))
    refs = [
        np.exp(x64), np.log(y64), np.sqrt(y64), 1 / np.sqrt(y64), np.tanh(x64), _erf(x64),
        np.maximum(x, z), np.minimum(x, z), np.abs(x), np.power(y64, z64), x64 * y64 + z64,
        np.log2(y64) + np.exp2(z64) + np.floor(x64) - np.ceil(z64), np.sqrt(y64) + x64 * x64,
    ]  # fmt: skip
    for k, ref in enumerate(refs):
        np.testing.assert_allclose(o[k], ref, rtol=2e-6, atol=1e-6, err_msg=f"row {k}")
    for k in (6, 7, 8):  # exact operations are exact
        np.testing.assert_array_equal(o[k], refs[k])


@pytest.mark.parametrize("n", [5, 257])
@pytest.mark.slow
def test_intrinsics_float64(rng, n):
    x, y, z = _inputs(rng, n, np.float64)
    o = sentinel((10, n), np.float64)
    intrinsics64(x, y, z, o)
    refs = [
        np.exp(x), np.log(y), np.sqrt(y), 1 / np.sqrt(y), np.tanh(x), _erf(x),
        np.maximum(x, z) - np.minimum(x, z), np.abs(x), np.power(y, z), x * y + z,
    ]  # fmt: skip
    for k, ref in enumerate(refs):
        np.testing.assert_allclose(o[k], ref, rtol=1e-13, atol=1e-14, err_msg=f"row {k}")


@pytest.mark.slow
def test_integer_intrinsics(rng):
    @ts.kernel
    def int_intr(a: i32["n"], b: i32["n"], o: i32[3, "n"], f: f32["n"]):
        for i in range(a.shape[0]):
            o[0, i] = max(a[i], b[i])
            o[1, i] = min(a[i], b[i])
            o[2, i] = abs(a[i])
            f[i] = ts.sqrt(abs(a[i]))  # an int argument computes in float32

    a = nonzero_ints(rng, 53, -1000, 1000, np.int32)
    b = nonzero_ints(rng, 53, -1000, 1000, np.int32)
    o, f = sentinel((3, 53), np.int32), sentinel(53, np.float32)
    int_intr(a, b, o, f)
    np.testing.assert_array_equal(o, [np.maximum(a, b), np.minimum(a, b), np.abs(a)])
    np.testing.assert_allclose(f, np.sqrt(np.abs(a)), rtol=1e-6)


# ---- float16 and bfloat16 --------------------------------------------------------------------------------


@ts.kernel
def f32_to_f16(a: f32["n"], b: f16["n"], c: f16["n"]):
    for i in range(a.shape[0]):
        b[i] = ts.cast(a[i], f16)
        c[i] = a[i]  # implicit rounding on store


@ts.kernel
def f16_to_f32(a: f16["n"], b: f32["n"]):
    for i in range(a.shape[0]):
        b[i] = a[i]


@ts.kernel
def f64_to_f16(a: f64["n"], b: f16["n"]):
    for i in range(a.shape[0]):
        b[i] = ts.cast(a[i], f16)


@ts.kernel
def f16_arith(a: f16["n"], b: f16["n"], c: f16["n"]):
    for i in range(a.shape[0]):
        c[i] = a[i] * b[i] + 1.0


SPECIAL_F32 = np.array(
    [
        1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11),  # ties round to even
        1 + 2**-11 + 2**-20,  # just above a tie
        65504.0, 65519.99, 65520.0, -65520.0, 1e6,  # largest finite, overflow to inf
        2**-14, 2**-14 - 2**-25, 2**-24, 2**-25, 2**-25 * 1.0001, 3 * 2**-26, 1e-10, -1e-10,  # subnormals
        0.0, -0.0, np.inf, -np.inf, 0.1, -3.14159, 1 / 3,
    ],
    dtype=np.float32,
)  # fmt: skip


def _same_half_bits(got: np.ndarray, ref: np.ndarray) -> None:
    """Bit-exact float16 comparison; NaNs only have to be NaNs (payloads may differ)."""
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], ref.view(np.uint16)[~nan])


@pytest.mark.slow
def test_f32_to_f16_special_values():
    b, c = sentinel(SPECIAL_F32.size, np.float16), sentinel(SPECIAL_F32.size, np.float16)
    f32_to_f16(SPECIAL_F32, b, c)
    with np.errstate(over="ignore"):
        ref = SPECIAL_F32.astype(np.float16)
    _same_half_bits(b, ref)
    _same_half_bits(c, ref)
    assert np.signbit(b[SPECIAL_F32.tolist().index(0.0) + 1])  # -0.0 keeps its sign


@pytest.mark.slow
def test_f32_to_f16_random_bit_patterns(rng):
    """Every class of float32 (normals, subnormals, NaN, inf) rounds exactly like numpy."""
    n = 200_003
    x = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    near = rng.uniform(-70000, 70000, n).astype(np.float32)  # dense in float16's range
    for a in (x, near):
        b, c = sentinel(n, np.float16), sentinel(n, np.float16)
        f32_to_f16(a, b, c)
        with np.errstate(over="ignore", invalid="ignore"):
            ref = a.astype(np.float16)
        _same_half_bits(b, ref)
        _same_half_bits(c, ref)


@pytest.mark.slow
def test_f16_to_f32_all_bit_patterns():
    h = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    out = sentinel(h.size, np.float32)
    f16_to_f32(h, out)
    ref = h.astype(np.float32)
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(out.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])


@pytest.mark.slow
def test_f64_to_f16_rounds_once(rng):
    """float64 -> float16 must round directly, not through float32 (double rounding)."""
    tricky = np.array([1 + 2**-11 + 2**-40, -(1 + 2**-11 + 2**-40), 2**-25 + 2**-60, 65520 - 2**-30], np.float64)
    a = np.concatenate([tricky, rng.uniform(-7e4, 7e4, 10_001), rng.uniform(-1e-4, 1e-4, 1001)])
    b = sentinel(a.size, np.float16)
    f64_to_f16(a, b)
    with np.errstate(over="ignore"):
        ref = a.astype(np.float16)
    _same_half_bits(b, ref)


@pytest.mark.slow
def test_f16_arithmetic_rounds_like_numpy(rng):
    a = rng.uniform(-30, 30, 999).astype(np.float16)
    b = rng.uniform(-30, 30, 999).astype(np.float16)
    c = sentinel(999, np.float16)
    f16_arith(a, b, c)
    # computed in float32, rounded once on store
    ref = (a.astype(np.float32) * b.astype(np.float32) + np.float32(1)).astype(np.float16)
    _same_half_bits(c, ref)


# ---- names that C reserves -------------------------------------------------------------------------------


@pytest.mark.slow
def test_names_that_clash_with_c_are_renamed(rng):
    """Kernel, parameter and variable names that are C keywords, libm functions or prelude helpers."""

    @ts.kernel
    def exp(double: f64["n"], int: f32["n"], main: i32["n"]):
        for i in range(double.shape[0]):
            sqrt = math.sqrt(double[i])
            half = main[i] // 2
            ts_floordiv = main[i] % 3
            default = ts.exp(int[i])
            double[i] = math.exp(sqrt) + half + ts_floordiv
            int[i] = default

    d = rng.uniform(0.5, 4, 19)
    x = rng.uniform(-1, 1, 19).astype(np.float32)
    m = nonzero_ints(rng, 19, -100, 100, np.int32)
    ed = np.exp(np.sqrt(d)) + m // 2 + m % 3
    ex = np.exp(x)
    exp(d, x, m)
    np.testing.assert_allclose(d, ed, rtol=1e-12)
    np.testing.assert_allclose(x, ex, rtol=1e-6)

    @ts.kernel(name="fmod")
    def renamed(a: f32["n"]):
        for i in range(a.shape[0]):
            a[i] = a[i] % 1.5

    a = rng.uniform(-5, 5, 9).astype(np.float32)
    expected = np.mod(a, np.float32(1.5))
    renamed(a)
    np.testing.assert_allclose(a, expected, rtol=1e-6, atol=1e-6)


# ---- bool tensors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.slow
def test_bool_tensors(rng, n):
    @ts.kernel
    def masks(a: f32["n"], b: f32["n"], m: boolean["n"], out: boolean["n"], sel: f32["n"], cnt: i32[1]):
        c = 0
        for i in range(a.shape[0]):
            out[i] = (a[i] > b[i]) != m[i]
            sel[i] = a[i] if m[i] else b[i]
            if m[i] and not out[i]:
                c += 1
        cnt[0] = c

    a = rng.uniform(-1, 1, n).astype(np.float32)
    b = rng.uniform(-1, 1, n).astype(np.float32)
    m = rng.random(n) < 0.5
    out, sel, cnt = ~((a > b) != m), sentinel(n, np.float32), sentinel(1, np.int32)
    masks(a, b, m, out, sel, cnt)
    np.testing.assert_array_equal(out, (a > b) != m)
    np.testing.assert_array_equal(sel, np.where(m, a, b))
    assert cnt[0] == np.sum(m & ~out)
    assert set(out.view(np.uint8).tolist()) <= {0, 1}  # proper C bools, not arbitrary bytes


# ---- parallel loops and multi-dimensional tensors ----------------------------------------------------------


@pytest.mark.parametrize("m, n", [(1, 1), (3, 129), (65, 17)])
@pytest.mark.slow
def test_parallel_2d(rng, m, n):
    @ts.kernel
    def scale_rows(a: f32["m", "n"], s: f32["m"], out: f32["m", "n"]):
        for i in ts.parallel(a.shape[0]):
            for j in range(a.shape[1]):
                out[i, j] = a[i, j] * s[i] + j

    a = rng.standard_normal((m, n)).astype(np.float32)
    s = rng.standard_normal(m).astype(np.float32)
    out = sentinel((m, n), np.float32)
    scale_rows(a, s, out)
    np.testing.assert_allclose(out, a * s[:, None] + np.arange(n, dtype=np.float32), rtol=1e-6)


# ---- argument checking --------------------------------------------------------------------------------------


@ts.kernel
def axpy(alpha: f32, x: f32["n"], y: f32["n"]):
    for i in range(x.shape[0]):
        y[i] = alpha * x[i] + y[i]


@ts.kernel
def mat_vec(a: f32["m", "n"], x: f32["n"], y: f32["m"]):
    for i in range(a.shape[0]):
        acc = 0.0
        for j in range(a.shape[1]):
            acc += a[i, j] * x[j]
        y[i] = acc


@ts.kernel
def with_scalars(k: i32, big: i64, small: i8, flag: boolean, u: u32, x: f32["n"]):
    for i in range(x.shape[0]):
        if flag:
            x[i] = x[i] + k + big + small + u


@pytest.mark.slow
def test_axpy_runs(rng):
    x = rng.standard_normal(31).astype(np.float32)
    y = rng.standard_normal(31).astype(np.float32)
    expected = np.float32(0.5) * x + y
    axpy(0.5, x, y)
    np.testing.assert_allclose(y, expected, rtol=1e-6)
    axpy(np.float32(2), x, y)  # numpy scalars are accepted
    np.testing.assert_allclose(y, expected + 2 * x, rtol=1e-6)
    axpy(3, x, y)  # so are ints for float parameters


def _err(kernel, *args):
    with pytest.raises(ts.ArgumentError) as info:
        kernel(*args)
    return str(info.value)


@pytest.mark.slow
def test_wrong_dtype(rng):
    x = rng.standard_normal(8)  # float64
    y = np.ones(8, np.float32)
    msg = _err(axpy, 1.0, x, y)
    assert "'x'" in msg and "float64" in msg and "float32" in msg


def test_wrong_rank(rng):
    msg = _err(axpy, 1.0, np.ones((2, 4), np.float32), np.ones(8, np.float32))
    assert "'x'" in msg and "rank 1" in msg


@pytest.mark.slow
def test_inconsistent_shape_symbol():
    msg = _err(axpy, 1.0, np.ones(8, np.float32), np.ones(9, np.float32))
    assert "'y'" in msg and "'n' = 8" in msg
    msg = _err(mat_vec, np.ones((3, 5), np.float32), np.ones(4, np.float32), np.ones(3, np.float32))
    assert "'x'" in msg and "'n' = 5" in msg
    msg = _err(mat_vec, np.ones((3, 5), np.float32), np.ones(5, np.float32), np.ones(5, np.float32))
    assert "'y'" in msg and "'m' = 3" in msg


@pytest.mark.slow
def test_non_contiguous():
    x = np.ones(16, np.float32)[::2]
    msg = _err(axpy, 1.0, x, np.ones(8, np.float32))
    assert "'x'" in msg and "contiguous" in msg
    a = np.ones((5, 3), np.float32).T
    msg = _err(mat_vec, a, np.ones(5, np.float32), np.ones(3, np.float32))
    assert "'a'" in msg and "contiguous" in msg


def test_wrong_argument_count():
    msg = _err(axpy, 1.0, np.ones(8, np.float32))
    assert "3 arguments" in msg and "got 2" in msg
    msg = _err(axpy, 1.0, np.ones(8, np.float32), np.ones(8, np.float32), np.ones(8, np.float32))
    assert "got 4" in msg


def test_not_an_array_and_unsupported_dtype():
    msg = _err(axpy, 1.0, [1.0, 2.0], np.ones(2, np.float32))
    assert "'x'" in msg and "must be an array" in msg
    msg = _err(axpy, 1.0, np.ones(2, np.complex64), np.ones(2, np.float32))
    assert "'x'" in msg and "complex64" in msg


def test_empty_array():
    msg = _err(axpy, 1.0, np.ones(0, np.float32), np.ones(0, np.float32))
    assert "empty" in msg


@pytest.mark.slow
def test_scalar_checks():
    x = np.ones(4, np.float32)
    ok = (1, 2**40, -5, True, 2**32 - 1)
    with_scalars(*ok, x)
    np.testing.assert_allclose(x, 1 + 1 + 2**40 - 5 + 2**32 - 1, rtol=1e-6)
    cases = [
        ((2**31, *ok[1:]), "'k'", "does not fit in int32"),
        ((-(2**31) - 1, *ok[1:]), "'k'", "does not fit in int32"),
        ((1, 2**63, *ok[2:]), "'big'", "does not fit in int64"),
        ((1, 2, 128, *ok[3:]), "'small'", "does not fit in int8"),
        ((*ok[:4], -1), "'u'", "does not fit in uint32"),
        ((*ok[:4], 2**32), "'u'", "does not fit in uint32"),
        ((1.5, *ok[1:]), "'k'", "expects an int"),
        ((True, *ok[1:]), "'k'", "expects an int"),
        ((*ok[:3], "yes", ok[4]), "'flag'", "expects a bool"),
    ]
    for args, name, what in cases:
        msg = _err(with_scalars, *args, x)
        assert name in msg and what in msg, msg
    msg = _err(axpy, "2.0", x, x)
    assert "'alpha'" in msg and "expects a number" in msg


@pytest.mark.slow
def test_explicit_shape_parameter():
    @ts.kernel
    def fill(n: i32, a: f32["n"]):
        for i in range(n):
            a[i] = 2.5

    a = sentinel(6, np.float32)
    fill(6, a)
    np.testing.assert_array_equal(a, 2.5)
    msg = _err(fill, 7, a)
    assert "'a'" in msg and "'n' = 7" in msg


def test_cuda_kernel_rejects_host_arrays():
    """Argument binding for a CUDA kernel refuses numpy arrays (checked without a GPU)."""

    @ts.kernel(target="cuda")
    def gpu_copy(a: f32["n"], b: f32["n"]):
        ts.attrs.grid = ts.ceil_div(a.shape[0], 128)
        ts.attrs.block = 128
        i = ts.block_idx.x * 128 + ts.thread_idx.x
        if i < a.shape[0]:
            b[i] = a[i]

    a = np.ones(10, np.float32)
    with pytest.raises(ts.ArgumentError, match="'a' is on cpu but the kernel runs on cuda"):
        bind(gpu_copy.ir, [a, a.copy()], "cuda")


@pytest.mark.cuda
def test_cuda_kernel_call_with_host_arrays_is_argument_error():
    @ts.kernel(target="cuda")
    def gpu_copy2(a: f32["n"], b: f32["n"]):
        ts.attrs.grid = ts.ceil_div(a.shape[0], 128)
        ts.attrs.block = 128
        i = ts.block_idx.x * 128 + ts.thread_idx.x
        if i < a.shape[0]:
            b[i] = a[i]

    a = np.ones(10, np.float32)
    with pytest.raises(ts.ArgumentError, match="is on cpu"):
        gpu_copy2(a, a.copy())


def test_cpu_kernel_rejects_wrong_device_view():
    class FakeCuda:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (0, False), "version": 3}

    msg = _err(axpy, 1.0, FakeCuda(), np.ones(4, np.float32))
    assert "'x'" in msg and "cuda" in msg


# ---- torch CPU tensors ------------------------------------------------------------------------------------------


def test_torch_cpu_tensors(rng):
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(rng.standard_normal(77).astype(np.float32))
    y = torch.from_numpy(rng.standard_normal(77).astype(np.float32))
    expected = 1.5 * x + y
    axpy(1.5, x, y)
    torch.testing.assert_close(y, expected)
    a = torch.randn(9, 13, generator=torch.Generator().manual_seed(3))
    v = torch.randn(13, generator=torch.Generator().manual_seed(4))
    out = torch.full((9,), float("nan"))
    mat_vec(a, v, out)
    torch.testing.assert_close(out, a @ v, rtol=1e-5, atol=1e-5)
    # errors: dtype, contiguity, shape
    with pytest.raises(ts.ArgumentError, match="float64"):
        axpy(1.0, x.double(), y)
    with pytest.raises(ts.ArgumentError, match="contiguous"):
        mat_vec(a.t().contiguous().t(), v, out)
    with pytest.raises(ts.ArgumentError, match="'n' = 13"):
        mat_vec(a, v[:12].clone(), out)


@pytest.mark.slow
def test_torch_half_and_bfloat16(rng):
    torch = pytest.importorskip("torch")

    @ts.kernel
    def narrow(a: f32["n"], h: f16["n"], b: bf16["n"], back: f32["n"]):
        for i in range(a.shape[0]):
            h[i] = a[i]
            b[i] = ts.cast(a[i], bf16)
            back[i] = ts.cast(b[i], f32) + h[i]

    src = rng.uniform(-1e4, 1e4, 10_007).astype(np.float32)
    src[:4] = [1 + 2**-8, 1 + 3 * 2**-8, 3.0e38, -1e-40]  # bfloat16 ties, overflow, subnormal
    a = torch.from_numpy(src)
    h = torch.empty(a.shape, dtype=torch.float16)
    b = torch.empty(a.shape, dtype=torch.bfloat16)
    back = torch.empty(a.shape)
    narrow(a, h, b, back)
    assert torch.equal(h.view(torch.int16), a.to(torch.float16).view(torch.int16))
    assert torch.equal(b.view(torch.int16), a.to(torch.bfloat16).view(torch.int16))
    torch.testing.assert_close(back, b.float() + h.float(), rtol=0, atol=0)


@pytest.mark.slow
def test_torch_bool_and_int64(rng):
    torch = pytest.importorskip("torch")

    @ts.kernel
    def pick(m: boolean["n"], a: i64["n"], out: i64["n"]):
        for i in range(a.shape[0]):
            out[i] = a[i] // 3 if m[i] else -a[i] % 5

    m = torch.from_numpy(rng.random(50) < 0.5)
    a = torch.from_numpy(nonzero_ints(rng, 50, -(2**40), 2**40, np.int64))
    out = torch.full((50,), 7, dtype=torch.int64)
    pick(m, a, out)
    assert torch.equal(out, torch.where(m, a // 3, (-a) % 5))


@pytest.mark.slow
def test_max_min_propagate_nan(rng):
    @ts.kernel
    def maxmin(a: f32["n"], b: f32["n"], hi: f32["n"], lo: f32["n"]):
        for i in range(a.shape[0]):
            hi[i] = max(a[i], b[i])
            lo[i] = min(a[i], b[i])

    a = rng.standard_normal(9).astype(np.float32)
    b = rng.standard_normal(9).astype(np.float32)
    a[1], b[4], a[7], b[7] = np.nan, np.nan, np.nan, np.nan
    hi, lo = np.empty_like(a), np.empty_like(a)
    maxmin(a, b, hi, lo)
    np.testing.assert_array_equal(hi, np.maximum(a, b))
    np.testing.assert_array_equal(lo, np.minimum(a, b))


@pytest.mark.slow
def test_inline_mapping_loop():
    @ts.kernel
    def fill(out: i32[4, 8]):
        for i, j in ts.spatial(4, 8):
            out[i, j] = i * 8 + j

    out = np.full((4, 8), -1, np.int32)
    fill(out)
    np.testing.assert_array_equal(out, np.arange(32).reshape(4, 8))


@ts.kernel
def _scale_add(a: f32["n"], c: f32["n"]):
    for i in ts.parallel(n):
        c[i] = a[i] * 2.0 + ts.exp(a[i])


@ts.kernel
def _widen(a: f16["n"], c: f32["n"]):
    for i in range(n):
        c[i] = ts.cast(a[i], f32) * 2.0


def test_intrinsics_header_only_where_a_kernel_needs_it(rng):
    """<immintrin.h> costs gcc about half a second per build: a scalar kernel's source leaves it
    out (and the helpers that use intrinsics are compiled out), a float16 one keeps it (vcvtph2ps);
    both compute the same either way."""
    assert "immintrin" not in _scale_add.source_full and "immintrin" in _widen.source_full
    x = rng.standard_normal(37).astype(np.float32)
    out = np.empty_like(x)
    _scale_add(x, out)
    np.testing.assert_allclose(out, x * 2 + np.exp(x), rtol=1e-6)
    h = x.astype(np.float16)
    _widen(h, out)
    np.testing.assert_array_equal(out, h.astype(np.float32) * 2)
