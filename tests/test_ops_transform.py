"""Data-movement ops on the CPU against numpy: permute, reshape, slice, concat, split, expand, pad, gathers."""

from __future__ import annotations

import numpy as np
import pytest

from tessera import ops


def run(outs, inputs, *arrays):
    return ops.build(outs, inputs)(*arrays)


def test_permute_transpose(rng):
    x = ops.placeholder((2, 3, 5, 7), "float32", "x")
    xv = rng.standard_normal((2, 3, 5, 7)).astype(np.float32)
    outs = [ops.permute(x, (2, 0, 3, 1)), ops.transpose(x), ops.transpose(x, 0, 2), ops.permute(x, (-1, 0, 1, 2))]
    res = run(outs, [x], xv)
    refs = [xv.transpose(2, 0, 3, 1), xv.swapaxes(-2, -1), xv.swapaxes(0, 2), xv.transpose(3, 0, 1, 2)]
    for out, ref in zip(res, refs):
        np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("src,dst", [((6, 4), (24,)), ((6, 4), (3, -1)), ((2, 3, 4), (4, 3, 2)), ((2, 3, 4), (2, 12)),
                                     ((2, 3, 4), (6, 1, 4)), ((5,), (1, 5, 1)), ((1, 7, 1), (7,)), ((3, 10), (-1, 2, 5))])  # fmt: skip
def test_reshape(rng, src, dst):
    x = ops.placeholder(src, "float32", "x")
    xv = rng.standard_normal(src).astype(np.float32)
    np.testing.assert_array_equal(run([ops.reshape(x, dst)], [x], xv), xv.reshape(dst))


def test_squeeze_unsqueeze_flatten(rng):
    x = ops.placeholder((3, 1, 4, 1), "int32", "x")
    xv = rng.integers(-100, 100, (3, 1, 4, 1)).astype(np.int32)
    outs = [ops.squeeze(x), ops.squeeze(x, 1), ops.unsqueeze(x, 0), ops.unsqueeze(x, -1), ops.flatten(x), ops.flatten(x, 1, 2)]
    refs = [xv.squeeze(), xv.squeeze(1), xv[None], xv[..., None], xv.reshape(-1), xv.reshape(3, 4, 1)]
    for out, ref in zip(run(outs, [x], xv), refs):
        np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("axis,start,stop,step", [(0, 1, 5, 1), (1, None, None, 2), (1, -3, None, 1), (0, None, None, -1),
                                                  (1, 8, 1, -3), (0, -100, 100, 3), (1, 2, 3, 1)])  # fmt: skip
def test_slice(rng, axis, start, stop, step):
    x = ops.placeholder((7, 9), "float32", "x")
    xv = rng.standard_normal((7, 9)).astype(np.float32)
    sl = [slice(None)] * 2
    sl[axis] = slice(start, stop, step)
    np.testing.assert_array_equal(run([ops.slice(x, axis, start, stop, step)], [x], xv), xv[tuple(sl)])


def test_concat_split_chunk(rng):
    a = ops.placeholder((2, 3), "float32", "a")
    b = ops.placeholder((2, 5), "float32", "b")
    c = ops.placeholder((2, 1), "float16", "c")
    av, bv = rng.standard_normal((2, 3)).astype(np.float32), rng.standard_normal((2, 5)).astype(np.float32)
    cv = rng.standard_normal((2, 1)).astype(np.float16)
    cat = ops.concat([a, b, c], axis=1)
    pieces = ops.split(cat, [4, 4, 1], axis=1)
    chunks = ops.chunk(cat, 2, axis=1)
    cat0 = ops.concat([a, a], axis=0)
    res = run([cat, *pieces, *chunks, cat0], [a, b, c], av, bv, cv)
    ref = np.concatenate([av, bv, cv.astype(np.float32)], axis=1)
    np.testing.assert_array_equal(res[0], ref)
    for out, r in zip(res[1:4], np.split(ref, [4, 8], axis=1)):
        np.testing.assert_array_equal(out, r)
    for out, r in zip(res[4:6], np.split(ref, [5], axis=1)):
        np.testing.assert_array_equal(out, r)
    np.testing.assert_array_equal(res[6], np.concatenate([av, av], 0))


def test_expand(rng):
    x = ops.placeholder((3, 1), "float32", "x")
    xv = rng.standard_normal((3, 1)).astype(np.float32)
    outs = [ops.expand(x, (3, 4)), ops.broadcast_to(x, (2, 3, 5)), ops.expand(x, (2, -1, 6))]
    refs = [np.broadcast_to(xv, (3, 4)), np.broadcast_to(xv, (2, 3, 5)), np.broadcast_to(xv, (2, 3, 6))]
    for out, ref in zip(run(outs, [x], xv), refs):
        np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate"])
def test_pad(rng, mode):
    x = ops.placeholder((4, 5), "float32", "x")
    xv = rng.standard_normal((4, 5)).astype(np.float32)
    widths = [(1, 2), (3, 0)]
    y = ops.pad(x, widths, mode, value=1.5)
    ref = np.pad(xv, widths, mode="edge" if mode == "replicate" else mode, **({"constant_values": 1.5} if mode == "constant" else {}))
    np.testing.assert_array_equal(run([y], [x], xv), ref)


def test_gathers(rng):
    w = ops.placeholder((10, 4), "float32", "w")
    ids = ops.placeholder((2, 3), "int64", "ids")
    idx = ops.placeholder((5,), "int32", "idx")
    g = ops.placeholder((10, 4), "int64", "g")
    wv = rng.standard_normal((10, 4)).astype(np.float32)
    idsv = rng.integers(0, 10, (2, 3)).astype(np.int64)
    idxv = rng.integers(0, 4, 5).astype(np.int32)
    gv = rng.integers(0, 10, (10, 4)).astype(np.int64)
    outs = [ops.embedding(w, ids), ops.index_select(w, 1, idx), ops.take(w, idx, 0), ops.gather(w, 0, g)]
    res = run(outs, [w, ids, idx, g], wv, idsv, idxv, gv)
    np.testing.assert_array_equal(res[0], wv[idsv])
    np.testing.assert_array_equal(res[1], wv[:, idxv])
    np.testing.assert_array_equal(res[2], wv[idxv])
    np.testing.assert_array_equal(res[3], np.take_along_axis(wv, gv, 0))


def test_gather_negative_indices_wrap(rng):
    w = ops.placeholder((6, 2), "float32", "w")
    ids = ops.placeholder((3,), "int32", "ids")
    wv = rng.standard_normal((6, 2)).astype(np.float32)
    idsv = np.array([-1, 0, -6], np.int32)
    np.testing.assert_array_equal(run([ops.embedding(w, ids)], [w, ids], wv, idsv), wv[idsv])


def test_transpose_feeding_elementwise_is_one_kernel(rng):
    x = ops.placeholder((4, 6), "float32", "x")
    y = ops.placeholder((6, 4), "float32", "y")
    z = ops.relu(ops.add(ops.transpose(x), ops.reshape(ops.mul(y, 2.0), (6, 4))))
    f = ops.build([z], [x, y])
    assert f.num_kernels == 1
    xv, yv = rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal((6, 4)).astype(np.float32)
    np.testing.assert_allclose(f(xv, yv), np.maximum(xv.T + yv * 2, 0), rtol=1e-6)


def test_tile_and_flip(rng):
    x = ops.placeholder((3, 5), "float32", "x")
    i = ops.placeholder((4,), "int64", "i")
    outs = [ops.tile(x, (2, 3)), ops.tile(x, (2, 1, 2)), ops.tile(i, (3,)), ops.flip(x, 0), ops.flip(x, (0, -1)),
            ops.flip(ops.tile(i, (2, 1)), 1)]  # fmt: skip
    xv = rng.standard_normal((3, 5)).astype(np.float32)
    iv = rng.integers(-9, 9, 4)
    res = run(outs, [x, i], xv, iv)
    refs = [np.tile(xv, (2, 3)), np.tile(xv, (2, 1, 2)), np.tile(iv, 3), np.flip(xv, 0), np.flip(xv, (0, 1)),
            np.flip(np.tile(iv, (2, 1)), 1)]  # fmt: skip
    for out, ref in zip(res, refs):
        np.testing.assert_array_equal(out, ref)


def test_tile_symbolic_dim(rng):
    from tessera.ir import Var, dtypes

    n = Var("n", dtypes.int32)
    x = ops.placeholder((n, 2), "float32", "x")
    f = ops.build([ops.tile(x, (3, 2))], [x])
    for rows in (1, 4):
        xv = rng.standard_normal((rows, 2)).astype(np.float32)
        np.testing.assert_array_equal(f(xv), np.tile(xv, (3, 2)))
