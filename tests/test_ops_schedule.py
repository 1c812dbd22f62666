"""The auto-scheduler and build entry: fusion, symbolic shapes, compute-definition IR, error messages,
and CUDA source that nvcc accepts (compiled here, run on the GPU tier)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from tessera import ops
from tessera.backend import build_cuda
from tessera.errors import ArgumentError, UnsupportedError
from tessera.ir import Var, dtypes
from tessera.ir import expr as E
from tessera.ops.schedule.inline import MAX_INLINED_SIZE

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


def test_fused_chain_is_one_kernel(rng):
    """Broadcast add, transpose, reshape and five activations: one kernel, one pass over memory."""
    x = ops.placeholder((8, 6), "float32", "x")
    b = ops.placeholder((6,), "float32", "b")
    h = ops.add(x, b)
    h = ops.transpose(ops.reshape(ops.gelu(h), (2, 4, 6)), 1, 2)
    y = ops.mul(ops.sigmoid(ops.tanh(ops.exp(ops.neg(h)))), 3.0)
    for target in ("cpu", "cuda"):
        assert len(ops.generate([y], [x, b], target).kernels) == 1
    f = ops.build([y], [x, b])
    assert f.num_kernels == 1 and f.source.count("void ts_kernel_op_") == 1
    xv, bv = rng.standard_normal((8, 6)).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    from math import erf

    h = xv.astype(np.float64) + bv
    g = 0.5 * h * (1 + np.vectorize(erf)(h / np.sqrt(2)))
    ref = 3 / (1 + np.exp(-np.tanh(np.exp(-g.reshape(2, 4, 6).transpose(0, 2, 1)))))
    np.testing.assert_allclose(f(xv, bv), ref, rtol=2e-6, atol=2e-6)


def test_symbolic_batch_runs_at_two_sizes_without_recompiling(rng, cache_dir):
    n = Var("batch", dtypes.int32)
    x = ops.placeholder((n, 3, 10), "float32", "x")
    w = ops.placeholder((10,), "float32", "w")
    y = ops.reshape(ops.softmax(ops.mul(x, w), -1), (-1, 10))  # -1 becomes batch * 3
    f = ops.build([y, ops.sum(x, (1, 2))], [x, w])
    artifacts = sorted(p.name for p in cache_dir.rglob("*.so"))
    for batch in (2, 7):
        xv = rng.standard_normal((batch, 3, 10)).astype(np.float32)
        wv = rng.standard_normal(10).astype(np.float32)
        yv, sv = f(xv, wv)
        z = xv.astype(np.float64) * wv
        e = np.exp(z - z.max(-1, keepdims=True))
        np.testing.assert_allclose(yv, (e / e.sum(-1, keepdims=True)).reshape(-1, 10), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(sv, xv.astype(np.float64).sum((1, 2)), rtol=1e-5, atol=1e-5)
    assert sorted(p.name for p in cache_dir.rglob("*.so")) == artifacts and len(artifacts) == 1


def test_symbolic_concat_and_slice(rng):
    """Compound dimensions (a + b) get their own scalar parameter; slicing a symbolic axis uses min/max."""
    a, b = Var("a", dtypes.int32), Var("b", dtypes.int32)
    x = ops.placeholder((a, 4), "float32", "x")
    y = ops.placeholder((b, 4), "float32", "y")
    cat = ops.concat([x, y], 0)
    tail = ops.slice(cat, 0, -3, None)
    f = ops.build([cat, tail], [x, y])
    for na, nb in ((2, 5), (4, 1)):
        xv, yv = rng.standard_normal((na, 4)).astype(np.float32), rng.standard_normal((nb, 4)).astype(np.float32)
        c, t = f(xv, yv)
        ref = np.concatenate([xv, yv])
        np.testing.assert_array_equal(c, ref)
        np.testing.assert_array_equal(t, ref[-3:])


def test_compute_definition_ir(rng):
    """A hand-written compute DAG: the building blocks the graph layer can use directly."""
    n = Var("n", dtypes.int32)
    x = ops.placeholder((n, 16), "float16", "x")
    sq = ops.compute((n, 16), lambda i, j: E.Cast(x[i, j], dtypes.float32) * E.Cast(x[i, j], dtypes.float32), "sq")
    ss = ops.reduce((n,), (16,), lambda ax, r: sq[ax[0], r[0]], "sum", "ss", acc_dtype=dtypes.float32)
    out = ops.compute((n, 16), lambda i, j: x[i, j] * E.Cast(E.Call("rsqrt", (ss[i],), dtypes.float32), dtypes.float16),
                      "out")  # fmt: skip
    assert isinstance(ss, ops.ReduceCompute) and ss.acc_dtype == dtypes.float32 and out.dtype == dtypes.float16
    assert repr(x) == "Placeholder(x: float16[n, 16])"
    g = ops.generate([out], [x])
    assert len(g.kernels) == 1 and [t.name for t in g.kernels[0].tensors] == ["x", "out"]
    xv = rng.standard_normal((3, 16)).astype(np.float16)
    x64 = xv.astype(np.float64)
    ref = x64 * (1 / np.sqrt((x64**2).sum(1, keepdims=True)))
    np.testing.assert_allclose(ops.build([out], [x])(xv).astype(np.float64), ref, rtol=4e-3, atol=4e-3)


def test_blowup_materialises_a_producer(rng):
    """A producer read many times by a deep chain is computed once into memory instead of inlined."""
    x = ops.placeholder((5,), "float32", "x")
    h = x
    for _ in range(14):  # each level reads the previous one three times
        h = ops.where(ops.gt(h, 0.0), h, ops.mul(h, 0.5))
    g = ops.generate([h], [x])
    assert len(g.kernels) > 1
    assert all(len(k.func.body.__str__()) < 40 * MAX_INLINED_SIZE for k in g.kernels)
    xv = rng.standard_normal(5).astype(np.float32)
    np.testing.assert_allclose(ops.build([h], [x])(xv), np.where(xv > 0, xv, xv * 0.5**14), rtol=1e-6)


def test_preallocated_outputs_and_identity(rng):
    x = ops.placeholder((3, 4), "float32", "x")
    f = ops.build([ops.exp(x), x], [x])
    xv = rng.standard_normal((3, 4)).astype(np.float32)
    o1, o2 = np.empty((3, 4), np.float32), np.empty((3, 4), np.float32)
    f.run([xv], [o1, o2])
    np.testing.assert_allclose(o1, np.exp(xv), rtol=1e-6)
    np.testing.assert_array_equal(o2, xv)
    with pytest.raises(ArgumentError, match="must have shape"):
        f.run([xv], [o1, np.empty((4, 3), np.float32)])


# ---- error messages -----------------------------------------------------------------------------------------------
def test_shape_and_dtype_errors():
    a = ops.placeholder((3, 4), "float32", "a")
    b = ops.placeholder((5,), "float32", "b")
    n = Var("n", dtypes.int32)
    s = ops.placeholder((n,), "float32", "s")
    i = ops.placeholder((4,), "int32", "i")
    with pytest.raises(ArgumentError, match=r"cannot be broadcast together: dimension 1 is 4 in one and 5"):
        ops.add(a, b)
    with pytest.raises(ArgumentError, match="symbolic sizes broadcast only against an equal size or 1"):
        ops.mul(s, ops.placeholder((4,), "float32"))
    with pytest.raises(ArgumentError, match="inner dimensions differ"):
        ops.matmul(a, a)
    with pytest.raises(ArgumentError, match="element counts differ"):
        ops.reshape(a, (5, 2))
    with pytest.raises(ArgumentError, match="at most one dimension may be -1"):
        ops.reshape(a, (-1, -1))
    with pytest.raises(ArgumentError, match="axis 2 is out of range for a tensor of rank 2"):
        ops.sum(a, 2)
    with pytest.raises(ArgumentError, match="not a permutation"):
        ops.permute(a, (0, 0))
    with pytest.raises(UnsupportedError, match="needs a floating-point input.*cast it first"):
        ops.softmax(i)
    with pytest.raises(UnsupportedError, match="mean: needs a floating-point input"):
        ops.mean(i)
    with pytest.raises(UnsupportedError, match="dequantize or cast it"):
        ops.exp(ops.placeholder((4,), "int4", "q"))
    with pytest.raises(ArgumentError, match="index 'a' must be int32 or int64"):
        ops.embedding(a, a)
    with pytest.raises(ArgumentError, match="condition 'a' must be a bool tensor"):
        ops.where(a, a, 0.0)
    with pytest.raises(ArgumentError, match="must be a tensor node"):
        ops.exp(np.zeros(3))
    with pytest.raises(ArgumentError, match="weight 'b' has shape \\(5,\\), expected \\(4,\\)"):
        ops.layer_norm(a, b)
    with pytest.raises(ArgumentError, match="is empty"):
        ops.slice(a, 0, 2, 1)
    with pytest.raises(ArgumentError, match="out_channels 4 must be a multiple of groups=3"):
        ops.conv2d(ops.placeholder((1, 3, 5, 5), "float32"), ops.placeholder((4, 1, 3, 3), "float32"), groups=3)
    with pytest.raises(UnsupportedError, match="sub: not defined for bool"):
        ops.sub(ops.gt(a, 0.0), ops.gt(a, 1.0))


def test_build_and_call_errors(rng):
    n = Var("n", dtypes.int32)
    x = ops.placeholder((n, 4), "float32", "x")
    y = ops.placeholder((n, 4), "float32", "y")
    z = ops.add(x, y)
    with pytest.raises(ArgumentError, match=r"placeholder\(s\) \['y'\] that are not among the inputs"):
        ops.build([z], [x])
    f = ops.build([z], [x, y])
    with pytest.raises(ArgumentError, match="op takes 2 inputs"):
        f(np.zeros((2, 4), np.float32))
    with pytest.raises(ArgumentError, match="symbol 'n' = 2"):
        f(np.ones((2, 4), np.float32), np.ones((3, 4), np.float32))
    with pytest.raises(ArgumentError, match="has dtype float64, expected float32"):
        f(np.ones((2, 4)), np.ones((2, 4)))
    with pytest.raises(ArgumentError, match="dimension 1 should be 4"):
        f(np.ones((2, 5), np.float32), np.ones((2, 5), np.float32))
    m = Var("n", dtypes.int32)
    w = ops.placeholder((m,), "float32", "w")
    with pytest.raises(ArgumentError, match="two different shape symbols are both named 'n'"):
        ops.build([ops.exp(x), ops.exp(w)], [x, w])


# ---- CUDA source ----------------------------------------------------------------------------------------------------
def _cuda_suite():
    n = Var("n", dtypes.int32)
    x = ops.placeholder((n, 300), "float16", "x")
    w = ops.placeholder((300,), "float16", "w")
    small = ops.placeholder((n, 7), "bfloat16", "small")
    big = ops.placeholder((4, 5000), "float32", "big")
    a = ops.placeholder((n, 64), "float16", "a")
    b = ops.placeholder((64, 32), "float16", "b")
    img = ops.placeholder((1, 3, 9, 9), "float32", "img")
    k = ops.placeholder((4, 3, 3, 3), "float32", "k")
    ids = ops.placeholder((n,), "int64", "ids")
    outs = [
        ops.gelu(ops.add(x, w), "tanh"),                   # elementwise
        ops.layer_norm(x, w, w),                           # warp per row, fused statistics
        ops.softmax(small),                                # thread per row
        ops.log_softmax(big),                              # block per row
        ops.sum(big),                                      # one block, 1024 threads
        ops.prod(ops.cast(big, "float64"), 0),
        ops.max(ops.cast(small, "int8"), 1),
        ops.min(ops.gt(small, 0.0), 1),
        ops.matmul(a, b),                                  # contraction: thread per output
        ops.conv2d(img, k, padding=1),
        ops.max_pool2d(img, 3, 2, 1),
        ops.embedding(x, ids),
        ops.rms_norm(x, w),
    ]  # fmt: skip
    return outs, [x, w, small, big, a, b, img, k, ids]


def test_cuda_schedules_are_chosen():
    outs, inputs = _cuda_suite()
    g = ops.generate(outs, inputs, "cuda")
    kinds = {k.schedule for k in g.kernels}
    assert {"cuda-elementwise256", "cuda-warp256", "cuda-thread128", "cuda-block256", "cuda-block1024"} <= kinds
    assert "__shfl_xor_sync" in g.source and "__syncthreads" in g.source
    # A shuffle must never sit inside a conditional expression (it would run on some lanes only).
    assert not [line for line in g.source.splitlines() if "__shfl" in line and "?" in line]


@needs_nvcc
def test_cuda_source_compiles_with_nvcc():
    outs, inputs = _cuda_suite()
    g = ops.generate(outs, inputs, "cuda")
    assert build_cuda(g.source).suffix == ".cubin"


def test_generated_source_is_deterministic_and_names_do_not_clash(rng):
    """Rebuilding the same graph gives the same source (warm cache across processes); a tensor named like a
    shape symbol still binds correctly."""

    def graph():
        n = Var("x", dtypes.int32)
        x = ops.placeholder((n, 12), "float32", "x")
        return [ops.softmax(ops.add(x, 1.0))], [x]

    assert ops.generate(*graph()).source == ops.generate(*graph()).source
    f = ops.build(*graph())
    xv = rng.standard_normal((5, 12)).astype(np.float32)
    e = np.exp(xv - xv.max(1, keepdims=True))
    np.testing.assert_allclose(f(xv), e / e.sum(1, keepdims=True), rtol=1e-5)


def test_build_many_uses_one_compiler_run(rng, cache_dir):
    x = ops.placeholder((3, 8), "float32", "x")
    y = ops.placeholder((8,), "float32", "y")
    f1, f2 = ops.build_many([([ops.softmax(x)], [x]), (ops.add(x, y), [x, y])])
    assert len(list(cache_dir.rglob("*.so"))) == 1
    xv, yv = rng.standard_normal((3, 8)).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    e = np.exp(xv - xv.max(1, keepdims=True))
    np.testing.assert_allclose(f1(xv), e / e.sum(1, keepdims=True), rtol=1e-5)
    np.testing.assert_array_equal(f2(xv, yv), xv + yv)
