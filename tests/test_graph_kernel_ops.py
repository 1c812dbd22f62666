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
from tessera.errors import IndexOutOfRangeError, NegativePowerError
from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


def _graph(kind, inputs, n_out=1, **attrs):
    """A one-operator graph; inputs: (name, shape, dtype)."""
    b = GraphBuilder(kind)
    xs = [b.input(n, s, d) for n, s, d in inputs]
    outs = list(b.op_multi(kind, *xs, **attrs))
    assert len(outs) == n_out
    for o in outs:
        b.output(o)
    return b.build()


def _compiled(g, target="cpu"):
    """compile_graph, checking that no operator was left to its numpy reference."""
    compiled = compile_graph(g, target, arrays="native") if target == "cuda" else compile_graph(g, target)
    report = compiled.report()
    assert not report.reference, str(report)
    return compiled


def _host(a):
    return a.numpy() if hasattr(a, "numpy") else np.asarray(a)


def _check(g, make_inputs, calls=3, target="cpu", exact=True):
    """The compiled graph against the graph's references on `calls` fresh inputs."""
    compiled = _compiled(g, target)
    rng = np.random.default_rng(len(g.operators) * 7 + calls)
    for _ in range(calls):
        xs = make_inputs(rng)
        outs, refs = [_host(o) for o in compiled(*xs)], g.run(*xs)
        for o, r in zip(outs, refs):
            assert o.shape == r.shape and o.dtype == r.dtype, (o.shape, r.shape, o.dtype, r.dtype)
            if exact:
                np.testing.assert_array_equal(o, r)
            else:
                np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-5)


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


# ---- scatters ----------------------------------------------------------------------------------------------------
_REDUCTIONS = ["none", "add", "mul", "max", "min"]


def _values(rng, dt, shape):
    if dt.startswith("float"):
        return rng.standard_normal(shape).astype(dt)
    return rng.integers(-9, 10, shape).astype(dt)


@pytest.mark.parametrize("reduction", _REDUCTIONS)
@pytest.mark.parametrize("dt,axis,data,idx", [
    ("float32", 0, (5, 1, 4), (7, 1, 3)),      # repeated indices, indices narrower than data
    ("int64", -1, (3, 6), (3, 9)),
    ("float16", 1, (2, 1, 3), (2, 1, 3)),       # size-1 scatter axis: every index hits 0 (or -1)
])  # fmt: skip
def test_scatter_elements(reduction, dt, axis, data, idx):
    g = _graph("scatter_elements", [("d", list(data), dt), ("i", list(idx), "int64"), ("u", list(idx), dt)],
               axis=axis, reduction=reduction)
    n = data[axis]
    _check(g, lambda r: (_values(r, dt, data), r.integers(-n, n, idx), _values(r, dt, idx)), exact=dt != "float32")


@pytest.mark.parametrize("reduction", _REDUCTIONS)
@pytest.mark.parametrize("dt,data,idx", [
    ("float32", (4, 3, 2), (5, 1)),             # slices of [3, 2], repeated rows
    ("int32", (3, 1, 5), (2, 2, 2)),            # a 2x2 grid of index pairs, slices of [5]
    ("float64", (3, 4), (6, 2)),                # single elements
])  # fmt: skip
def test_scatter_nd(reduction, dt, data, idx):
    q = idx[-1]
    upd = (*idx[:-1], *data[q:])
    g = _graph("scatter_nd", [("d", list(data), dt), ("i", list(idx), "int64"), ("u", list(upd), dt)],
               reduction=reduction)

    def inputs(r):
        tuples = np.stack([r.integers(-data[k], data[k], idx[:-1]) for k in range(q)], -1)
        return _values(r, dt, data), tuples, _values(r, dt, upd)

    _check(g, inputs, exact=dt != "float32")


@pytest.mark.parametrize("kind", ["scatter_elements", "scatter_nd"])
def test_scatter_index_out_of_range_raises_on_the_cpu(kind):
    idx_shape = [2, 3] if kind == "scatter_elements" else [2, 1]
    upd_shape = [2, 3] if kind == "scatter_elements" else [2, 3]
    g = _graph(kind, [("d", [4, 3], "float32"), ("i", idx_shape, "int64"), ("u", upd_shape, "float32")])
    compiled = _compiled(g)
    rng = np.random.default_rng(5)
    d, u = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal(upd_shape).astype(np.float32)
    good = rng.integers(-4, 4, idx_shape)
    for bad_value in (4, -5, 2**40):
        bad = good.copy()
        bad.flat[-1] = bad_value
        with pytest.raises(IndexOutOfRangeError):
            compiled(d, bad, u)
    np.testing.assert_array_equal(compiled(d, good, u)[0], g.run(d, good, u)[0])  # usable afterwards


# ---- topk --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dt,shape,axis,k", [
    ("float32", (3, 9), -1, 4),
    ("float32", (7, 1, 2), 0, 7),               # k = n: a full sort
    ("int32", (2, 11, 3), 1, 5),                # many ties: lower index first
    ("float64", (1, 5), 1, 1),
    ("float32", (6,), 0, 3),
    ("float32", (2, 3001), 1, 7),               # long rows: chunks' candidates first (two stages)
    ("int32", (2101, 2), 0, 40),
])  # fmt: skip
def test_topk(largest, dt, shape, axis, k):
    g = _graph("topk", [("x", list(shape), dt)], n_out=2, k=k, axis=axis, largest=largest)

    def inputs(r):
        x = r.integers(-3, 4, shape).astype(dt)  # small range: ties everywhere
        if dt.startswith("float"):
            x = x + (r.random(shape) < 0.5) * r.standard_normal(shape).astype(dt)
            x.flat[r.integers(0, x.size)] = np.nan  # NaN sorts after every number
        return (x,)

    _check(g, inputs)


# ---- det ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dt,shape", [("float32", (5, 5)), ("float64", (2, 1, 3, 3)), ("float32", (4, 1, 1)),
                                      ("float32", (3, 7, 7))])  # fmt: skip
def test_det(dt, shape):
    g = _graph("det", [("x", list(shape), dt)])

    def inputs(r):
        x = r.standard_normal(shape).astype(dt)
        if len(shape) > 2 and shape[-1] > 1:
            x[0, ..., -1, :] = x[0, ..., 0, :]  # a singular matrix: det 0
        return (x,)

    compiled = _compiled(g)
    rng = np.random.default_rng(11)
    for _ in range(3):
        (x,) = inputs(rng)
        ref = np.linalg.det(x.astype(np.float64))
        out = compiled(x)[0]
        assert out.dtype == x.dtype and out.shape == ref.shape
        np.testing.assert_allclose(out, ref, rtol=1e-4 if dt == "float32" else 1e-12, atol=1e-5)


# ---- max pooling with indices ------------------------------------------------------------------------------------
@pytest.mark.parametrize("storage_order", [0, 1])
@pytest.mark.parametrize("dt,shape,attrs", [
    ("float32", (2, 3, 7, 6), dict(kernel=[3, 2], stride=[2, 1], pads=[1, 0, 1, 1], dilation=[1, 2])),
    ("int32", (1, 2, 9), dict(kernel=[3], stride=[2], pads=[1, 1], dilation=[1])),
    ("float32", (1, 1, 4, 1, 5), dict(kernel=[2, 1, 3], stride=[1, 1, 2], pads=[0, 0, 1, 1, 0, 0], dilation=[1, 1, 1])),
    ("float16", (1, 2, 5, 5), dict(kernel=[2, 2], stride=[2, 2], pads=[0, 0, 0, 0], dilation=[1, 1], ceil_mode=True)),
])  # fmt: skip
def test_max_pool_with_indices(storage_order, dt, shape, attrs):
    g = _graph("max_pool_with_indices", [("x", list(shape), dt)], n_out=2, storage_order=storage_order, **attrs)

    def inputs(r):
        x = r.integers(-4, 5, shape).astype(dt)  # ties: the first position wins
        if dt.startswith("float"):
            x.flat[r.integers(0, x.size)] = np.nan  # never the maximum
        return (x,)

    _check(g, inputs)


# ---- the CUDA source compiles (CPU tier), and the GPU runs them (cuda tier) --------------------------------------
def _program_graphs():
    """(graph, make_inputs, exact) for each operator written as statements and pooling with indices."""
    out = []
    for red in _REDUCTIONS:
        g = _graph("scatter_elements", [("d", [5, 1, 4], "float32"), ("i", [7, 1, 3], "int64"),
                                        ("u", [7, 1, 3], "float32")], reduction=red)  # fmt: skip
        out.append((g, lambda r: (_values(r, "float32", (5, 1, 4)), r.integers(-5, 5, (7, 1, 3)),
                                  _values(r, "float32", (7, 1, 3))), False))  # fmt: skip
        g = _graph("scatter_nd", [("d", [4, 3, 2], "int64"), ("i", [5, 1], "int32"), ("u", [5, 3, 2], "int64")],
                   reduction=red)
        out.append((g, lambda r: (_values(r, "int64", (4, 3, 2)), r.integers(-4, 4, (5, 1)).astype(np.int32),
                                  _values(r, "int64", (5, 3, 2))), True))  # fmt: skip
    g = _graph("topk", [("x", [3, 9, 2], "float32")], n_out=2, k=4, axis=1, largest=False)
    out.append((g, lambda r: (r.integers(-3, 4, (3, 9, 2)).astype(np.float32),), True))
    g = _graph("topk", [("x", [2, 4099], "float32")], n_out=2, k=9, axis=1)  # two stages
    out.append((g, lambda r: (r.integers(-50, 50, (2, 4099)).astype(np.float32),), True))
    g = _graph("det", [("x", [2, 1, 5, 5], "float32")])
    out.append((g, lambda r: (r.standard_normal((2, 1, 5, 5)).astype(np.float32),), False))
    g = _graph("max_pool_with_indices", [("x", [2, 3, 7, 6], "float32")], n_out=2, kernel=[3, 2], stride=[2, 1],
               pads=[1, 0, 1, 1], dilation=[1, 2], storage_order=1)
    out.append((g, lambda r: (r.integers(-4, 5, (2, 3, 7, 6)).astype(np.float32),), True))
    g = _graph("pow", [("x", [3, 1, 5], "int64"), ("y", [5], "int64")])
    out.append((g, lambda r: (r.integers(-30, 30, (3, 1, 5)), r.integers(0, 50, (5,))), True))
    g = _graph("bitcast", [("x", [4, 1, 3], "int32")], dtype="float32")
    out.append((g, lambda r: (_ints(r, "int32", (4, 1, 3)),), None))
    return out


@needs_nvcc
@pytest.mark.slow
def test_program_kernels_cuda_source_compiles():
    from tessera.backend import build_cuda
    from tessera.graph.lowering import lower_graph

    lowered = [lower_graph(g) for g, _, _ in _program_graphs()]
    for lg in lowered:
        gen = ops.generate(lg.outputs, lg.placeholders, target="cuda")
        assert "ts_status" not in gen.source
        assert str(build_cuda(gen.source, arch="sm_90a")).endswith(".cubin")


@pytest.mark.cuda
@pytest.mark.parametrize("case", range(len(_program_graphs())))
def test_program_kernels_on_the_gpu(case):
    """Each graph compiled for CUDA (native arrays, CUDA-graph replay from the second call) on
    fresh inputs, against the numpy references: nothing left to the host."""
    g, make_inputs, exact = _program_graphs()[case]
    compiled = _compiled(g, "cuda")
    rng = np.random.default_rng(case)
    for _ in range(3):
        xs = make_inputs(rng)
        outs, refs = [_host(o) for o in compiled(*xs)], g.run(*xs)
        for o, r in zip(outs, refs):
            assert o.shape == r.shape and o.dtype == r.dtype
            if exact is None:
                assert o.tobytes() == r.tobytes()
            elif exact:
                np.testing.assert_array_equal(o, r)
            else:
                np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
def test_cuda_scatter_out_of_range_index_is_clamped():
    """CUDA kernels cannot report: an index outside [-n, n) lands on the nearest end of its axis."""
    g = _graph("scatter_elements", [("d", [4], "float32"), ("i", [2], "int64"), ("u", [2], "float32")])
    compiled = _compiled(g, "cuda")
    d, u = np.zeros(4, np.float32) + 1, np.array([5.0, 7.0], np.float32)
    out = _host(compiled(d, np.array([9, -9]), u)[0])
    np.testing.assert_array_equal(out, [7.0, 1.0, 1.0, 5.0])
