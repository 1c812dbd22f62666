"""`@ts.inline` (tessera.lang.inline): kernel code expanded where kernels call it."""

from __future__ import annotations

import numpy as np
import pytest

import tessera as ts
from tessera import f32
from tessera.errors import KernelSyntaxError


@ts.inline
def add_scaled(out, x, i, count, times, n):
    for _ in ts.unroll(times):  # compile-time argument: unrolled per call
        count += 1  # the caller's variable
        if i < n:
            out[i] = out[i] + x[i] * 2.0


@ts.inline
def twice(out, x, i, count, n):
    add_scaled(out, x, i, count, 2, n)  # inline functions call inline functions


def test_an_inline_body_runs_in_place_with_the_callers_variables():
    @ts.kernel
    def kernel(X: f32["n"], Out: f32["n"]):
        count = 0
        for i in range(n):
            Out[i] = 0.0
            twice(Out, X, i, count, n)
            add_scaled(Out, X, i, count, 1, n)
        Out[0] = Out[0] + count * 100.0

    for n in (1, 5):
        x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
        out = np.full(n, np.nan, np.float32)
        kernel(x, out)
        want = 6 * x
        want[0] += 300 * n  # three increments per element
        np.testing.assert_allclose(out, want, rtol=1e-6)


@ts.inline
def reads_a_caller_local(out):
    out[0] = secret  # noqa: F821  (not visible: the caller's local)


@ts.inline
def returns(out):
    return


@ts.inline
def recurses(out):
    recurses(out)


@ts.inline
def bumps(counter):
    counter = counter + 1


def test_inline_misuse_is_reported_where_it_is():
    with pytest.raises(KernelSyntaxError, match="name 'secret' is not defined.*reads_a_caller_local") as err:

        @ts.kernel
        def k1(Out: f32["n"]):
            secret = 1.0  # noqa: F841
            reads_a_caller_local(Out)

    assert "test_lang_inline.py" in str(err.value) and "out[0] = secret" in str(err.value)
    with pytest.raises(KernelSyntaxError, match="cannot return"):

        @ts.kernel
        def k2(Out: f32["n"]):
            returns(Out)

    with pytest.raises(KernelSyntaxError, match=r"add_scaled\(out, x, i, count, times, n\).*missing"):

        @ts.kernel
        def k3(Out: f32["n"]):
            add_scaled(Out, Out, 0, 0)

    with pytest.raises(KernelSyntaxError, match="'recurses' calls itself"):

        @ts.kernel
        def k4(Out: f32["n"]):
            recurses(Out)

    with pytest.raises(KernelSyntaxError, match="'counter' of inline function 'bumps' was passed a compile-time value"):

        @ts.kernel
        def k5(Out: f32["n"]):
            bumps(3)

    with pytest.raises(TypeError, match="expands inside kernels"):
        twice(None, None, 0, 0, 1)
