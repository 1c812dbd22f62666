"""Kernels see the names of the scope they are defined in, with and without decorator arguments."""

from __future__ import annotations

import numpy as np
import pytest

import tessera as ts
from tessera.ir.dtypes import numpy_dtype


def _bare_factory(dtype, step):
    @ts.kernel
    def add_step(a: dtype["n"]):
        for i in range(a.shape[0]):
            a[i] = a[i] + step

    return add_step


def _called_factory(dtype, step):
    @ts.kernel()
    def add_step(a: dtype["n"]):
        for i in range(a.shape[0]):
            a[i] = a[i] + step

    return add_step


def _named_factory(dtype, step):
    @ts.kernel(name="renamed_add")
    def add_step(a: dtype["n"]):
        for i in range(a.shape[0]):
            a[i] = a[i] + step

    return add_step


@pytest.mark.parametrize("factory", [_bare_factory, _called_factory, _named_factory])
@pytest.mark.parametrize("dtype", [ts.f32, ts.f64, ts.i32])
def test_factory_locals_are_visible(factory, dtype):
    # `dtype` appears only in an annotation: it is no closure cell, only the factory's local.
    k = factory(dtype, 3)
    a = np.arange(5).astype(numpy_dtype(dtype))
    k(a)
    np.testing.assert_array_equal(a, np.arange(5) + 3)


def _nested(bare: bool):
    """A factory in a factory: the outer local reaches the kernel as a closure cell of the
    middle function, the inner local as the defining frame's local."""

    def outer(scale):
        def middle(dtype):
            factor = scale  # makes `scale` a free variable of middle

            if bare:
                @ts.kernel
                def scaled(a: dtype["n"]):
                    for i in range(a.shape[0]):
                        a[i] = a[i] * factor
            else:
                @ts.kernel()
                def scaled(a: dtype["n"]):
                    for i in range(a.shape[0]):
                        a[i] = a[i] * factor

            return scaled

        return middle

    return outer


@pytest.mark.parametrize("bare", [True, False])
def test_nested_factories(bare):
    k = _nested(bare)(4)(ts.f32)
    a = np.arange(6, dtype=np.float32)
    k(a)
    np.testing.assert_array_equal(a, np.arange(6, dtype=np.float32) * 4)


@pytest.mark.parametrize("bare", [True, False])
def test_two_factory_calls_do_not_share_names(bare):
    fac = _bare_factory if bare else _called_factory
    k32, k64 = fac(ts.f32, 1), fac(ts.f64, 2)
    a, b = np.zeros(3, np.float32), np.zeros(3, np.float64)
    k32(a)
    k64(b)
    np.testing.assert_array_equal(a, 1)
    np.testing.assert_array_equal(b, 2)
    with pytest.raises(ts.errors.ArgumentError, match="dtype"):
        k32(b)
