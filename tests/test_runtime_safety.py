"""Kernels never take the process down and never give silent wrong answers: integer division
semantics, refused arguments, exact shape binding, concurrent launches."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import tessera as ts
from tessera import f32, i32, i64, u32, u64
from tessera.ir.dtypes import numpy_dtype

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")

# ---- integer division: no SIGFPE; on the CPU a zero divisor raises like torch --------------------------------


def _div_kernel(dtype, parallel: bool):
    loop = ts.parallel if parallel else range

    @ts.kernel
    def div_mod(a: dtype["n"], b: dtype["n"], q: dtype["n"], r: dtype["n"]):
        for i in loop(a.shape[0]):
            q[i] = a[i] // b[i]
            r[i] = a[i] % b[i]

    return div_mod


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("dtype", [ts.i8, ts.i16, i32, i64, ts.u8, u32, u64])
def test_integer_division_by_zero_raises_and_the_process_survives(dtype, parallel, rng):
    k = _div_kernel(dtype, parallel)
    nd = numpy_dtype(dtype)
    info = np.iinfo(nd)
    a = rng.integers(info.min, info.max, 1000, dtype=nd, endpoint=True)
    b = rng.integers(info.min, info.max, 1000, dtype=nd, endpoint=True)
    b[b == 0] = 1
    q, r = np.empty_like(a), np.empty_like(a)
    k(a, b, q, r)
    with np.errstate(over="ignore"):  # INT_MIN // -1 wraps in numpy too
        np.testing.assert_array_equal(q, a // b)
        np.testing.assert_array_equal(r, a % b)
    b[[3, 700]] = 0
    with pytest.raises(ts.DivisionByZeroError, match="div_mod: integer division or modulo by zero") as err:
        k(a, b, q, r)
    assert isinstance(err.value, ZeroDivisionError) and isinstance(err.value, RuntimeError)
    b[b == 0] = 1
    k(a, b, q, r)  # the next call starts with a clean status
    np.testing.assert_array_equal(r, a % b)


@pytest.mark.parametrize("dtype", [i32, i64])
def test_int_min_divided_by_minus_one_wraps(dtype):
    nd = numpy_dtype(dtype)
    lo = np.iinfo(nd).min
    k = _div_kernel(dtype, False)
    a = np.array([lo, lo, lo + 1, 7, -7], nd)
    b = np.array([-1, 1, -1, -1, -1], nd)
    q, r = np.empty_like(a), np.empty_like(a)
    k(a, b, q, r)
    np.testing.assert_array_equal(q, [lo, lo, -(lo + 1), -7, 7])
    np.testing.assert_array_equal(r, 0)


def test_scalar_and_constant_divisors():
    @ts.kernel
    def by_scalar(a: i32["n"], s: i32, q: i32["n"], r: i32["n"]):
        for i in range(a.shape[0]):
            q[i] = a[i] // s
            r[i] = a[i] % -1 + a[i] // -3

    a = np.array([-(2**31), 5, -5], np.int32)
    q, r = np.empty_like(a), np.empty_like(a)
    by_scalar(a, -1, q, r)
    np.testing.assert_array_equal(q, [-(2**31), -5, 5])
    np.testing.assert_array_equal(r, a // -3)
    with pytest.raises(ZeroDivisionError):
        by_scalar(a, 0, q, r)


def test_division_by_zero_in_a_branch_not_taken_is_fine():
    @ts.kernel
    def guarded(a: i32["n"], b: i32["n"]):
        for i in range(a.shape[0]):
            if b[i] != 0:
                a[i] = a[i] // b[i]

    a, b = np.array([6, 6], np.int32), np.array([4, 0], np.int32)
    guarded(a, b)
    np.testing.assert_array_equal(a, [1, 6])


def test_only_divisors_that_may_be_zero_are_checked():
    """Constant divisors, tensor sizes and products of them cost nothing extra in hot loops."""

    @ts.kernel
    def mixed(a: i32["n"], b: i32["n"], c: i32["n", "m"], s: i32):
        for i in range(a.shape[0]):
            a[i] = i // 7 + (i - 3) % c.shape[1] + (i - 5) // (c.shape[0] * 2) + a[i] // -3 + a[i] // b[i] + a[i] % s

    body = mixed.source.split("void ts_kernel_mixed")[1]
    assert body.count("_chk(") == 2  # a[i] // b[i] and a[i] % s
    assert "ts_floordiv_chk(a_[i_], b_[i_], ts_status)" in body and "ts_floormod_chk(a_[i_], s_, ts_status)" in body


def test_torch_front_end_raises_like_torch_on_the_cpu():
    torch = pytest.importorskip("torch")
    from tessera.frontend.torch import stats

    class Div(torch.nn.Module):
        def forward(self, x, y):
            return x // y + torch.div(x, y, rounding_mode="trunc")

    torch._dynamo.reset()
    compiled = torch.compile(Div(), backend="tessera")
    x = torch.tensor([7, -7, 9, 1], dtype=torch.int32)
    y = torch.tensor([2, 2, -4, 3], dtype=torch.int32)
    before = dict(stats)
    torch.testing.assert_close(compiled(x, y), Div()(x, y))
    assert stats["kernels"] > before["kernels"] and stats["eager_nodes"] == before["eager_nodes"]
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        Div()(x, torch.zeros_like(y))  # what torch does
    with pytest.raises(ZeroDivisionError):  # tessera's DivisionByZeroError is also a RuntimeError
        compiled(x, torch.zeros_like(y))


def _cuda_div(a: i32["n"], b: i32["n"], q: i32["n"], r: i32["n"]):
    ts.attrs.grid = ts.ceil_div(a.shape[0], 128)
    ts.attrs.block = 128
    i = ts.block_idx.x * 128 + ts.thread_idx.x
    if i < a.shape[0]:
        q[i] = a[i] // b[i]
        r[i] = a[i] % b[i]


@needs_nvcc
def test_cuda_checked_division_compiles():
    k = ts.Kernel(_cuda_div, "cuda", arch="sm_90")
    assert "ts_floordiv_chk(a_[i_], b_[i_])" in k.source
    assert k.build().endswith(".cubin")


@pytest.mark.cuda
def test_cuda_division_by_zero_gives_zero():
    torch = pytest.importorskip("torch")
    k = ts.Kernel(_cuda_div, "cuda")
    a = torch.tensor([7, -7, -(2**31), 5, -(2**31)], dtype=torch.int32, device="cuda")
    b = torch.tensor([0, 0, -1, -2, 0], dtype=torch.int32, device="cuda")
    q, r = torch.empty_like(a), torch.empty_like(a)
    k(a, b, q, r)
    assert q.tolist() == [0, 0, -(2**31), -3, 0]
    assert r.tolist() == [0, 0, 0, -1, 0]


@pytest.mark.cuda
def test_cuda_ops_division_by_zero_gives_zero():
    torch = pytest.importorskip("torch")
    from tessera import ops

    a = ops.placeholder((4,), "int64", "a")
    b = ops.placeholder((4,), "int64", "b")
    f = ops.build([ops.floor_divide(a, b), ops.remainder(a, b)], [a, b], "cuda")
    q, r = f(torch.tensor([7, -7, 3, 4], device="cuda"), torch.tensor([2, 0, 0, -3], device="cuda"))
    assert q.tolist() == [3, 0, 0, -2] and r.tolist() == [1, 0, 0, -2]


# ---- arguments that must be refused -----------------------------------------------------------------------------


@ts.kernel
def _add_one(a: f32["n"], b: f32["n"]):
    for i in range(a.shape[0]):
        b[i] = a[i] + 1.0


@pytest.mark.parametrize("which", ["input", "output"])
def test_non_native_byte_order_is_refused(which):
    big = np.arange(4, dtype=">f4")
    native = np.zeros(4, np.float32)
    args = (big, native) if which == "input" else (native, big)
    with pytest.raises(ts.ArgumentError, match=r"argument '[ab]': dtype >f4 is not in the machine's byte order.*astype"):
        _add_one(*args)
    out = np.zeros(4, np.float32)
    _add_one(big.astype(big.dtype.newbyteorder("=")), out)  # the suggested conversion
    np.testing.assert_array_equal(out, np.arange(4) + 1)


def test_non_native_cuda_array_interface_is_refused():
    from tessera.runtime.tensor import as_view

    class Fake:
        __cuda_array_interface__ = {"shape": (4,), "typestr": ">f4", "data": (4096, False), "version": 3}

    with pytest.raises(ts.ArgumentError, match="byte order"):
        as_view(Fake())


def test_read_only_output_is_refused_and_not_written():
    data = bytes(16)
    ro = np.frombuffer(data, dtype=np.float32)
    with pytest.raises(ts.ArgumentError, match="argument 'b' is read-only but the kernel writes it"):
        _add_one(np.ones(4, np.float32), ro)
    assert data == bytes(16)
    frozen = np.zeros(4, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ts.ArgumentError, match="read-only"):
        _add_one(np.ones(4, np.float32), frozen)


def test_read_only_input_is_fine():
    src = np.frombuffer(np.arange(4, dtype=np.float32).tobytes(), dtype=np.float32)
    out = np.zeros(4, np.float32)
    _add_one(src, out)
    np.testing.assert_array_equal(out, np.arange(4) + 1)


def test_writes_through_pointers_and_instructions_count():
    @ts.kernel
    def via_ptr(a: f32["n"], p: ts.ptr(f32)):
        for i in range(a.shape[0]):
            if i >= 0:
                p[i] = a[i]

    @ts.kernel
    def via_copy(a: f32[4], b: f32[4]):
        ts.copy_vector(b[0], a[0], 16)

    for k in (via_ptr, via_copy):
        ro = np.frombuffer(bytes(16), dtype=np.float32)
        with pytest.raises(ts.ArgumentError, match="read-only"):
            k(np.ones(4, np.float32), ro)
        out = np.zeros(4, np.float32)
        k(ro, out)  # read-only where it is only read


def test_read_only_cuda_array_interface_view():
    from tessera.runtime.tensor import as_view

    class Fake:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (4096, True), "version": 3}

    assert as_view(Fake()).writable is False


def test_ops_refuse_a_read_only_output():
    from tessera import ops

    x = ops.placeholder((4,), "float32", "x")
    f = ops.build(ops.add(x, 1.0), [x])
    ro_in = np.frombuffer(np.ones(4, np.float32).tobytes(), dtype=np.float32)
    np.testing.assert_array_equal(f(ro_in), 2)
    with pytest.raises(ts.ArgumentError, match="read-only"):
        f.run([ro_in], [np.frombuffer(bytes(16), dtype=np.float32)])


def test_ops_refuse_a_non_native_input():
    from tessera import ops

    x = ops.placeholder((4,), "float32", "x")
    f = ops.build(ops.add(x, 1.0), [x])
    with pytest.raises(ts.ArgumentError, match="input 'x': dtype >f4 is not in the machine's byte order"):
        f(np.ones(4, ">f4"))


def test_misaligned_array_is_refused():
    buf = np.zeros(20, np.uint8)
    odd = buf[1:17].view(np.float32)  # 4-byte elements at an odd address
    assert not odd.flags.aligned
    with pytest.raises(ts.ArgumentError, match="not aligned to its 4-byte elements"):
        _add_one(np.ones(4, np.float32), odd)


def test_float_scalar_parameter_that_would_overflow_is_refused():
    @ts.kernel
    def scale(a: f32["n"], s: f32):
        for i in range(a.shape[0]):
            a[i] = a[i] * s

    a = np.ones(3, np.float32)
    with pytest.raises(ts.ArgumentError, match="'s' = 1e\\+300 does not fit in float32"):
        scale(a, 1e300)
    scale(a, float("inf"))  # infinity is a float32 value
    assert np.isinf(a).all()


# ---- compile-time constants are never silently truncated --------------------------------------------------------

BIG = 2**40


def test_big_constant_into_int64_is_exact():
    @ts.kernel
    def fill(out: i64["n"]):
        for i in range(out.shape[0]):
            out[i] = BIG + i

    out = np.zeros(3, np.int64)
    fill(out)
    np.testing.assert_array_equal(out, BIG + np.arange(3))


def _parse(body: str):
    src = f"def k(out: i32['n'], h: ts.f16['n'], d: ts.f64['n']):\n    for i in range(out.shape[0]):\n        {body}\n"
    ns = {"ts": ts, "i32": i32, "BIG": BIG}
    import linecache

    name = f"<constant-test-{abs(hash(src))}>"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    exec(compile(src, name, "exec"), ns)
    return ts.Kernel(ns["k"], "cpu")


@pytest.mark.parametrize("body, message", [
    ("out[i] = BIG", r"constant 1099511627776 does not fit in int32 \(an element of 'out'\)"),
    ("x: ts.int32 = BIG", r"does not fit in int32 \(variable 'x'\)"),
    ("x = 0\n        x = BIG", r"does not fit in int32 \(variable 'x'\)"),
    ("out[i] = ts.cast(BIG, i32)", "constant 1099511627776 does not fit in int32"),
    ("out[i] = i32(BIG)", "does not fit in int32"),
    ("out[i] = ts.cast(1e10, i32)", "constant 10000000000.0 does not fit in int32"),
    ("out[i] = ts.cast(float('nan'), i32)", "nan does not fit in int32"),
    ("h[i] = 1e6", r"1000000.0 does not fit in float16 \(an element of 'h'\)"),
    ("h[i] = 70000", "70000 does not fit in float16"),
    ("h[i] = ts.f16(1e6)", "does not fit in float16"),
    ("d[i] = 2**80", "the constant 1208925819614629174706176 does not fit in int64"),
])  # fmt: skip
def test_constant_that_does_not_fit_is_refused(body, message):
    with pytest.raises(ts.KernelSyntaxError, match=message):
        _parse(body)


def test_constants_the_other_operand_cannot_hold_widen_the_operation():
    k = _parse("h[i] = h[i] * 1e6 * 1e-6 + (h[i] + 100000) * 0.0\n        big = 1e300\n        d[i] = big / 1e290\n"
               "        out[i] = ts.cast(-3.7, i32)")  # fmt: skip
    h = np.array([1.5, -2.25, 3], np.float16)
    out, d = np.zeros(3, np.int32), np.zeros(3)
    k(out, h, d)
    np.testing.assert_array_equal(h, [1.5, -2.25, 3])  # not inf * 0 = nan: computed in float32
    np.testing.assert_allclose(d, 1e10)  # `big` is a float64 variable, not float32 inf
    np.testing.assert_array_equal(out, -3)


def _cuda_widen(h: ts.f16["n"]):
    ts.attrs.grid = 1
    ts.attrs.block = 32
    i = ts.thread_idx.x
    if i < h.shape[0]:
        h[i] = h[i] * 1e6 * 1e-6 + (h[i] + 100000) * 0.0


@needs_nvcc
def test_cuda_literal_a_half_cannot_hold_is_not_half_inf():
    k = ts.Kernel(_cuda_widen, "cuda", arch="sm_90")
    assert "half(1000000.0f)" not in k.source and "half(100000.0f)" not in k.source
    assert k.build().endswith(".cubin")


@pytest.mark.cuda
def test_cuda_literal_a_half_cannot_hold_widens_the_operation():
    torch = pytest.importorskip("torch")
    h = torch.tensor([1.5, -2.25, 3.0], dtype=torch.float16, device="cuda")
    ts.Kernel(_cuda_widen, "cuda")(h)
    assert h.tolist() == [1.5, -2.25, 3.0]


@pytest.mark.parametrize("shape", ["[2**40]", "[0]", "[-3]"])
def test_static_dimension_must_be_a_positive_int32(shape):
    src = f"def k(a: ts.f32{shape}):\n    a[0] = 1.0\n"
    ns = {"ts": ts}
    import linecache

    name = f"<dim-test-{shape}>"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    exec(compile(src, name, "exec"), ns)
    with pytest.raises(ts.KernelSyntaxError, match="tensor dimension must be positive and below 2\\*\\*31"):
        ts.Kernel(ns["k"], "cpu")


# ---- the runtime's shape binding is exact --------------------------------------------------------------------------


def test_compound_dimensions_are_checked_exactly():
    from tessera.ir import expr as E
    from tessera.ir import stmt as S
    from tessera.ir.func import Function
    from tessera.ir.types import TensorType
    from tessera.runtime.args import bind

    n = E.Var("n", ts.int32)
    m = E.Var("m", ts.int32)
    x = E.Var("x", TensorType(ts.f32, (E.Binary("*", E.Const(2, ts.int32), n), m)))  # [2*n, m], before n is bound
    y = E.Var("y", TensorType(ts.f32, (n, E.Binary("+", m, E.Const(1, ts.int32)))))  # [n, m + 1]
    func = Function("compound", [x, y], S.Seq([]), shape_params=[n, m])
    _, symbols, _ = bind(func, [np.zeros((6, 4), np.float32), np.zeros((3, 5), np.float32)], "cpu")
    assert symbols == {"m": 4, "n": 3}
    with pytest.raises(ts.ArgumentError, match=r"argument 'x' has shape \(7, 4\); dimension 0 should be '2 \* n' = 6"):
        bind(func, [np.zeros((7, 4), np.float32), np.zeros((3, 5), np.float32)], "cpu")
    with pytest.raises(ts.ArgumentError, match=r"argument 'y' has shape \(3, 4\); dimension 1 should be 'm \+ 1' = 5"):
        bind(func, [np.zeros((6, 4), np.float32), np.zeros((3, 4), np.float32)], "cpu")
    lone = Function("lone", [x], S.Seq([]), shape_params=[n, m])
    with pytest.raises(ts.ArgumentError, match="cannot be evaluated from the arguments"):
        bind(lone, [np.zeros((6, 4), np.float32)], "cpu")


def test_integer_parameter_dimension_is_checked():
    @ts.kernel
    def rows(a: f32["n", "k"], k: i32):
        for i in range(a.shape[0]):
            a[i, 0] = 1.0

    rows(np.zeros((2, 3), np.float32), 3)
    with pytest.raises(ts.ArgumentError, match="dimension 1 should be 'k' = 4"):
        rows(np.zeros((2, 3), np.float32), 4)
