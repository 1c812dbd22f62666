"""The C backend's vectorisable float32 exp, tanh and erf (tessera/backend/c_math.py) against
float64: ulp bounds over a sweep of float32 bit patterns, the special values, and that gcc
vectorises the loops that call them."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from tessera import ops
from tessera.backend.codegen_c import generate_c
from tessera.ir import dtypes
from tessera.ir.expr import Var

ERF = np.vectorize(math.erf, otypes=[np.float64])
REFERENCE = {"exp": np.exp, "tanh": np.tanh, "erf": ERF}
MAX_ULP = {"exp": 1.05, "tanh": 1.5, "erf": 2.5}
FLT_MAX = float(np.finfo(np.float32).max)


def _ulp_error(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """|got - ref| in units of the float32 spacing at ref (the smallest subnormal at least)."""
    step = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    step = np.maximum(step, float(np.finfo(np.float32).smallest_subnormal))
    return np.abs(got.astype(np.float64) - ref) / step


def _sweep() -> np.ndarray:
    """Every 4099th float32 bit pattern that is finite (both signs, subnormals to the largest),
    and a dense run around the branch points, in an odd-length array (a vector tail)."""
    bits = np.arange(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32)
    dense = np.concatenate([np.linspace(-10, 10, 200_001), np.linspace(-0.7, 0.7, 20_001), np.linspace(87, 90, 3_001),
                            np.linspace(-105, -85, 3_001)]).astype(np.float32)  # fmt: skip
    x = np.concatenate([bits[np.isfinite(bits)], dense])
    return x[: x.size - (x.size % 2 == 0)]


@pytest.fixture(scope="module")
def kernels():
    x = ops.placeholder((Var("n", dtypes.int32),), "float32", "x")
    return ops.build([ops.exp(x), ops.tanh(x), ops.erf(x)], [x], target="cpu")


@pytest.mark.parametrize("name", ["exp", "tanh", "erf"])
@pytest.mark.slow
def test_ulp_bound_over_float32_sweep(kernels, name):
    x = _sweep()
    got = dict(zip(["exp", "tanh", "erf"], kernels(x)))[name]
    with np.errstate(over="ignore"):
        ref = REFERENCE[name](x.astype(np.float64))
    overflow = np.abs(ref) > FLT_MAX
    assert np.all(np.isinf(got[overflow])), f"{name}: values beyond float32 must be inf"
    err = _ulp_error(got[~overflow], ref[~overflow])
    worst = int(np.argmax(err))
    assert err[worst] <= MAX_ULP[name], (f"{name}({x[~overflow][worst]!r}) = {got[~overflow][worst]!r}, "
                                         f"float64 {ref[~overflow][worst]!r}: {err[worst]:.2f} ulp")  # fmt: skip


def test_special_values(kernels):
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 88.72, 88.73, -103.97, -104.5, 9.5, -9.5, 4.0, -4.0, 1e-30,
                  -1e-30, 1e-45], np.float32)  # fmt: skip
    e, t, f = kernels(x)
    assert np.isnan(e[0]) and np.isnan(t[0]) and np.isnan(f[0])
    np.testing.assert_array_equal(e[1:3], [np.inf, 0.0])
    np.testing.assert_array_equal(t[1:3], [1.0, -1.0])
    np.testing.assert_array_equal(f[1:3], [1.0, -1.0])
    assert e[3] == 1.0 and e[4] == 1.0 and t[3] == 0.0 and f[3] == 0.0
    assert np.signbit(t[4]) and np.signbit(f[4])  # odd functions keep -0.0
    assert np.isfinite(e[5]) and np.isinf(e[6])  # the overflow threshold, 88.7228
    assert 0 < e[7] < 1e-44 and e[8] == 0.0  # the last subnormal, then 0
    np.testing.assert_array_equal(t[9:11], [1.0, -1.0])
    np.testing.assert_array_equal(f[11:13], [1.0, -1.0])
    np.testing.assert_allclose(t[13:16], x[13:16], rtol=0)  # tanh(x) = x at tiny x, subnormals too
    np.testing.assert_allclose(f[13:15], x[13:15] * (2 / np.sqrt(np.pi)), rtol=2e-7)


@pytest.mark.slow
def test_gelu_forms_match_float64(rng):
    """Both GELUs (erf and tanh) through the helpers, on an odd shape, fresh inputs each call."""
    x = ops.placeholder((37, 131), "float32", "x")
    f = ops.build([ops.gelu(x), ops.gelu(x, "tanh")], [x], target="cpu")
    for _ in range(2):
        xv = (rng.standard_normal((37, 131)) * 4).astype(np.float32)
        exact, approx = f(xv)
        x64 = xv.astype(np.float64)
        np.testing.assert_allclose(exact, 0.5 * x64 * (1 + ERF(x64 / math.sqrt(2))), rtol=2e-6, atol=1e-7)
        inner = math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64**3)
        np.testing.assert_allclose(approx, 0.5 * x64 * (1 + np.tanh(inner)), rtol=2e-6, atol=1e-7)


@pytest.mark.slow
def test_loops_calling_them_use_the_helpers():
    """float32 calls go to the helpers (which gcc inlines and vectorises); float64 stays on libm."""
    x32, x64 = ops.placeholder((5, 7), "float32", "x"), ops.placeholder((5, 7), "float64", "y")
    src32 = ops.build([ops.tanh(x32)], [x32], target="cpu").source
    src64 = ops.build([ops.tanh(x64)], [x64], target="cpu").source
    kernel32 = src32[src32.index("void ts_kernel"):]
    kernel64 = src64[src64.index("void ts_kernel"):]
    assert "ts_tanhf(" in kernel32 and not re.search(r"\btanhf\(", kernel32)
    assert re.search(r"\btanh\(", kernel64) and "ts_tanhf(" not in kernel64
    assert "ts_expf" in generate_c([])  # in the prelude every C source shares
