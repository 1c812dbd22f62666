"""Kernels never take the process down and never give silent wrong answers: integer division
semantics, refused arguments, exact shape binding, concurrent launches."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import tessera as ts
from tessera import i32, i64, u32, u64
from tessera.runtime.tensor import numpy_dtype

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
