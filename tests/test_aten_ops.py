"""Every core ATen op the torch front end lowers, compiled through torch.compile(backend="tessera")
and compared with torch on fresh random inputs at odd sizes (size-1 dims included).

Cases are compiled in groups (one dynamo graph, one kernel build per group) to keep the CPU tier
fast; each op still gets its own test id, which checks that the op reached the ATen graph, was
lowered (did not run in torch) and matches: float outputs against torch in float64, integer and
boolean outputs exactly.  fp32 runs on the CPU; fp16/bf16 variants are marked `cuda`.
"""

from __future__ import annotations

import functools
import math

import pytest

torch = pytest.importorskip("torch")

from tessera.frontend.torch import backend  # noqa: E402
from tessera.frontend.torch.coverage import core_ops, status  # noqa: E402
from tessera.frontend.torch.decompositions import KEEP  # noqa: E402

aten = torch.ops.aten


def f(*shape):
    return lambda g: torch.randn(*shape, generator=g)


def pos(*shape):
    return lambda g: torch.rand(*shape, generator=g) * 3 + 0.1


def unit(*shape):
    return lambda g: torch.rand(*shape, generator=g) * 1.8 - 0.9


def near_one(*shape):
    """Values of magnitude 0.7 to 1.3, either sign: long products stay in fp16's range."""
    return lambda g: (torch.rand(*shape, generator=g) * 0.6 + 0.7) * (torch.randint(0, 2, shape, generator=g) * 2 - 1)


def ints(*shape, lo=-20, hi=20, dtype=torch.int64):
    return lambda g: torch.randint(lo, hi, shape, generator=g).to(dtype)


def bools(*shape):
    return lambda g: torch.rand(*shape, generator=g) > 0.5


def perm_index(n, rows):
    """[rows, n] int64: each row a permutation of range(n) (scatter targets without collisions)."""
    return lambda g: torch.stack([torch.randperm(n, generator=g) for _ in range(rows)])


def special(*shape):
    def make(g):
        x = torch.randn(*shape, generator=g)
        x.view(-1)[::4] = math.inf
        x.view(-1)[1::5] = -math.inf
        x.view(-1)[2::7] = math.nan
        return x

    return make


def twice(t):
    return t * 2  # makes a view op's result a computed tensor (AOTAutograd replays returned views itself)


# op -> (function of the inputs, input makers, flags); flags: "exact" compares with torch in the same
# dtype (discontinuous ops), "shape" compares shape and dtype only (uninitialised memory)
CASES = {
    "aten._adaptive_avg_pool2d.default": (lambda x: aten._adaptive_avg_pool2d(x, [2, 3]), [f(2, 3, 7, 9)], ""),
    "aten._log_softmax.default": (lambda x: aten._log_softmax(x, 1, False), [f(3, 7, 5)], ""),
    "aten._native_batch_norm_legit_no_training.default": (
        lambda x, w, b, m, v: aten._native_batch_norm_legit_no_training(x, w, b, m, v, 0.1, 1e-5)[0],
        [f(2, 5, 3, 7), f(5), f(5), f(5), pos(5)], ""),
    "aten._softmax.default": (lambda x: aten._softmax(x, -1, False), [f(3, 1, 13)], ""),
    "aten._to_copy.default": (lambda x: aten._to_copy(x * 7, dtype=torch.int32), [f(5, 3)], "exact"),
    "aten.abs.default": (aten.abs, [f(4, 7)], ""),
    "aten.acos.default": (aten.acos, [unit(3, 9)], ""),
    "aten.acosh.default": (lambda x: aten.acosh(x + 1), [pos(3, 9)], ""),
    "aten.add.Scalar": (lambda x: aten.add.Scalar(x, 2.5, alpha=3), [f(3, 5)], ""),
    "aten.add.Tensor": (lambda x, y: aten.add.Tensor(x, y, alpha=2), [f(3, 1, 5), f(4, 1)], ""),
    "aten.addmm.default": (lambda b, x, y: aten.addmm(b, x, y, beta=0.5, alpha=2), [f(7), f(5, 9), f(9, 7)], ""),
    "aten.alias.default": (lambda x: twice(aten.alias(x)), [f(3, 5)], ""),
    "aten.amax.default": (lambda x: aten.amax(x, [0, 2], True), [f(3, 4, 5)], ""),
    "aten.amin.default": (lambda x: aten.amin(x, [-1]), [f(3, 4, 5)], ""),
    "aten.any.default": (aten.any.default, [bools(3, 5)], "exact"),
    "aten.any.dim": (lambda x: aten.any.dim(x > 1, 1, True), [f(3, 5)], "exact"),
    "aten.any.dims": (lambda x: aten.any.dims(x, [0, 2]), [ints(3, 4, 5, lo=0, hi=3)], "exact"),
    "aten.arange.start_step": (lambda x: x + aten.arange.start_step(3, 40, 3, dtype=torch.float32, device=x.device), [f(13)], ""),
    "aten.argmax.default": (lambda x: aten.argmax(x, 1, True), [f(4, 9, 3)], "exact"),
    "aten.argmin.default": (lambda x: aten.argmin(x), [f(4, 9)], "exact"),
    "aten.as_strided.default": (  # a reshape, a transpose, overlapping windows at an offset, a view of a transpose
        lambda x: [twice(aten.as_strided(x, [5, 3], [3, 1])), twice(aten.as_strided(x, [5, 1, 3], [1, 7, 5])),
                   twice(aten.as_strided(x, [4, 3], [2, 1], 3)), twice(aten.as_strided(x.t(), [3, 5], [1, 3], 0)),
                   twice(aten.as_strided(x.t(), [2, 5], [1, 3], 1))],
        [f(3, 5)], ""),
    "aten.asin.default": (aten.asin, [unit(3, 7)], ""),
    "aten.asinh.default": (aten.asinh, [f(3, 7)], ""),
    "aten.atan.default": (aten.atan, [f(3, 7)], ""),
    "aten.atan2.default": (aten.atan2, [f(5, 7), f(5, 7)], ""),
    "aten.atanh.default": (aten.atanh, [unit(3, 7)], ""),
    "aten.avg_pool2d.default": (lambda x: aten.avg_pool2d(x, [3, 2], [2, 1], [1, 1], True, False),
                                [f(2, 3, 9, 7)], ""),
    "aten.bitwise_and.Scalar": (lambda x: aten.bitwise_and.Scalar(x, 6), [ints(4, 5)], "exact"),
    "aten.bitwise_and.Tensor": (aten.bitwise_and.Tensor, [ints(4, 5), ints(4, 5)], "exact"),
    "aten.bitwise_not.default": (aten.bitwise_not, [ints(4, 5)], "exact"),
    "aten.bitwise_or.Scalar": (lambda x: aten.bitwise_or.Scalar(x, 5), [ints(4, 5)], "exact"),
    "aten.bitwise_or.Tensor": (aten.bitwise_or.Tensor, [bools(4, 5), bools(4, 5)], "exact"),
    "aten.bitwise_xor.Scalar": (lambda x: aten.bitwise_xor.Scalar(x, 3), [ints(4, 5)], "exact"),
    "aten.bitwise_xor.Tensor": (aten.bitwise_xor.Tensor, [ints(4, 5), ints(4, 5)], "exact"),
    "aten.bmm.default": (aten.bmm, [f(3, 5, 7), f(3, 7, 2)], ""),
    "aten.cat.default": (lambda x, y: aten.cat([x, y, x], 1), [f(3, 2, 4), f(3, 5, 4)], ""),
    "aten.ceil.default": (aten.ceil, [f(5, 3)], "exact"),
    "aten.clamp.Tensor": (aten.clamp.Tensor, [f(4, 5), f(5), f(4, 1)], ""),
    "aten.clamp.default": (lambda x: aten.clamp(x, -0.5, 0.7), [f(4, 5)], ""),
    "aten.clone.default": (lambda x: aten.clone(x) + 1, [f(3, 5)], ""),
    "aten.constant_pad_nd.default": (lambda x: aten.constant_pad_nd(x, [1, 2, -1, 3], 0.5), [f(2, 5, 7)], ""),
    "aten.convolution.default": (
        lambda x, w, b: aten.convolution(x, w, b, [2, 1], [1, 2], [1, 2], False, [0, 0], 2),
        [f(2, 4, 9, 11), f(6, 2, 3, 3), f(6)], ""),
    "aten.copy.default": (lambda x, y: aten.copy(x, y), [f(4, 5), f(5)], ""),
    "aten.cos.default": (aten.cos, [f(3, 7)], ""),
    "aten.cosh.default": (aten.cosh, [f(3, 7)], ""),
    "aten.cumsum.default": (lambda x: aten.cumsum(x, 1), [f(3, 9, 2)], ""),
    "aten.diagonal.default": (lambda x: twice(aten.diagonal(x, 1, 0, 2)), [f(5, 3, 7)], ""),
    "aten.div.Scalar": (lambda x: aten.div.Scalar(x, 3.0), [f(4, 5)], ""),
    "aten.div.Scalar_mode": (lambda x: aten.div.Scalar_mode(x, 4, rounding_mode="floor"), [ints(4, 5)], "exact"),
    "aten.div.Tensor": (aten.div.Tensor, [f(4, 5), pos(5)], ""),
    "aten.div.Tensor_mode": (lambda x, y: aten.div.Tensor_mode(x, y, rounding_mode="trunc"),
                             [ints(4, 5), ints(4, 5, lo=1, hi=6)], "exact"),
    "aten.elu.default": (lambda x: aten.elu(x, 0.7, 1.2, 0.9), [f(4, 5)], ""),
    "aten.embedding.default": (aten.embedding, [f(11, 4), ints(3, 5, lo=0, hi=11)], ""),
    "aten.empty.memory_format": (lambda x: aten.empty.memory_format([3, 5], dtype=torch.float32, device=x.device), [f(1)], "shape"),
    "aten.empty_strided.default": (lambda x: aten.empty_strided([3, 5], [5, 1], dtype=torch.float32, device=x.device), [f(1)],
                                   "shape"),
    "aten.eq.Scalar": (lambda x: aten.eq.Scalar(x, 3), [ints(4, 5, lo=0, hi=5)], "exact"),
    "aten.eq.Tensor": (aten.eq.Tensor, [ints(4, 5, lo=0, hi=3), ints(5, lo=0, hi=3)], "exact"),
    "aten.erf.default": (aten.erf, [f(3, 7)], ""),
    "aten.exp.default": (aten.exp, [f(3, 7)], ""),
    "aten.expand.default": (lambda x: twice(aten.expand(x, [3, 4, 5])), [f(4, 1)], ""),
    "aten.expm1.default": (aten.expm1, [f(3, 7)], ""),
    "aten.flip.default": (lambda x: aten.flip(x, [0, 2]), [f(3, 4, 5)], ""),
    "aten.floor.default": (aten.floor, [f(5, 3)], "exact"),
    "aten.fmod.Scalar": (lambda x: aten.fmod.Scalar(x, 1.5), [f(4, 5)], "exact"),
    "aten.fmod.Tensor": (aten.fmod.Tensor, [ints(4, 5), ints(4, 5, lo=1, hi=7)], "exact"),
    "aten.full.default": (lambda x: x + aten.full([3, 5], 1.25, device=x.device), [f(3, 5)], ""),
    "aten.full_like.default": (lambda x: aten.full_like(x, 7, dtype=torch.int64), [f(3, 5)], "exact"),
    "aten.gather.default": (lambda x, i: aten.gather(x, 1, i), [f(3, 7), ints(3, 4, lo=0, hi=7)], ""),
    "aten.ge.Scalar": (lambda x: aten.ge.Scalar(x, 0.25), [f(4, 5)], "exact"),
    "aten.ge.Tensor": (aten.ge.Tensor, [f(4, 5), f(4, 1)], "exact"),
    "aten.gelu.default": (lambda x: aten.gelu(x, approximate="tanh") + aten.gelu(x), [f(4, 5)], ""),
    "aten.gt.Scalar": (lambda x: aten.gt.Scalar(x, -0.5), [f(4, 5)], "exact"),
    "aten.gt.Tensor": (aten.gt.Tensor, [ints(4, 5), ints(4, 5)], "exact"),
    "aten.hardtanh.default": (lambda x: aten.hardtanh(x, 0.0, 6.0), [f(4, 5)], ""),
    "aten.index.Tensor": (lambda x, i, j: aten.index.Tensor(x, [None, i, j]),
                          [f(2, 5, 7, 3), ints(4, lo=-5, hi=5), ints(4, lo=0, hi=7)], ""),
    "aten.index_put.default": (lambda x, i, v: aten.index_put(x, [None, i], v, True),
                               [f(3, 7, 2), ints(5, lo=-7, hi=7), f(3, 5, 2)], ""),
    "aten.index_select.default": (lambda x, i: aten.index_select(x, 1, i), [f(3, 7), ints(5, lo=0, hi=7)], ""),
    "aten.isinf.default": (aten.isinf, [special(5, 7)], "exact"),
    "aten.isnan.default": (aten.isnan, [special(5, 7)], "exact"),
    "aten.le.Scalar": (lambda x: aten.le.Scalar(x, 0.1), [f(4, 5)], "exact"),
    "aten.le.Tensor": (aten.le.Tensor, [f(4, 5), f(5)], "exact"),
    "aten.leaky_relu.default": (lambda x: aten.leaky_relu(x, 0.2), [f(4, 5)], ""),
    "aten.log.default": (aten.log, [pos(3, 7)], ""),
    "aten.log10.default": (aten.log10, [pos(3, 7)], ""),
    "aten.log1p.default": (aten.log1p, [pos(3, 7)], ""),
    "aten.log2.default": (aten.log2, [pos(3, 7)], ""),
    "aten.logical_and.default": (aten.logical_and, [bools(4, 5), f(4, 5)], "exact"),
    "aten.logical_not.default": (aten.logical_not, [ints(4, 5, lo=0, hi=2)], "exact"),
    "aten.logical_or.default": (aten.logical_or, [bools(4, 5), bools(1, 5)], "exact"),
    "aten.logical_xor.default": (aten.logical_xor, [bools(4, 5), bools(4, 5)], "exact"),
    "aten.lt.Scalar": (lambda x: aten.lt.Scalar(x, 2), [ints(4, 5)], "exact"),
    "aten.lt.Tensor": (aten.lt.Tensor, [f(4, 5), f(4, 5)], "exact"),
    "aten.masked_scatter.default": (aten.masked_scatter, [f(3, 5), bools(3, 5), f(4, 5)], ""),
    "aten.max.dim": (lambda x: aten.max.dim(x, 1, True), [f(3, 7, 2)], "exact"),
    "aten.max_pool2d_with_indices.default": (
        lambda x: aten.max_pool2d_with_indices(x, [3, 3], [2, 2], [1, 1], [1, 1], True)[0], [f(2, 3, 9, 8)], ""),
    "aten.maximum.default": (aten.maximum, [f(4, 5), f(5)], ""),
    "aten.mean.default": (aten.mean.default, [f(4, 5)], ""),
    "aten.mean.dim": (lambda x: aten.mean.dim(x, [0, 2], True), [f(3, 4, 5)], ""),
    "aten.min.dim": (lambda x: aten.min.dim(x, 0), [f(3, 7)], "exact"),
    "aten.minimum.default": (aten.minimum, [f(4, 5), f(4, 1)], ""),
    "aten.mm.default": (aten.mm, [f(5, 9), f(9, 7)], ""),
    "aten.mul.Scalar": (lambda x: aten.mul.Scalar(x, -1.5), [f(4, 5)], ""),
    "aten.mul.Tensor": (aten.mul.Tensor, [f(4, 5), f(4, 1)], ""),
    "aten.native_dropout.default": (lambda x: aten.native_dropout(x, 0.3, False), [f(4, 5)], "exact"),
    "aten.native_group_norm.default": (
        lambda x, w, b: aten.native_group_norm(x, w, b, 2, 6, 35, 3, 1e-5)[0], [f(2, 6, 5, 7), f(6), f(6)], ""),
    "aten.native_layer_norm.default": (lambda x, w, b: aten.native_layer_norm(x, [5, 7], w, b, 1e-5)[0],
                                       [f(3, 5, 7), f(5, 7), f(5, 7)], ""),
    "aten.ne.Scalar": (lambda x: aten.ne.Scalar(x, 1), [ints(4, 5, lo=0, hi=3)], "exact"),
    "aten.ne.Tensor": (aten.ne.Tensor, [ints(4, 5, lo=0, hi=3), ints(4, 5, lo=0, hi=3)], "exact"),
    "aten.neg.default": (aten.neg, [f(4, 5)], ""),
    "aten.permute.default": (lambda x: twice(aten.permute(x, [2, 0, 1])), [f(3, 4, 5)], ""),
    "aten.pow.Scalar": (lambda x: aten.pow.Scalar(2.5, x), [f(4, 5)], ""),
    "aten.pow.Tensor_Scalar": (lambda x: aten.pow.Tensor_Scalar(x, 3), [f(4, 5)], ""),
    "aten.pow.Tensor_Tensor": (aten.pow.Tensor_Tensor, [pos(4, 5), f(5)], ""),
    "aten.prod.default": (aten.prod.default, [near_one(3, 4)], ""),  # (a product of 12 unit values underflows fp16)
    "aten.prod.dim_int": (lambda x: aten.prod.dim_int(x, 1, True), [f(3, 4)], ""),
    "aten.reciprocal.default": (aten.reciprocal, [pos(4, 5)], ""),
    "aten.relu.default": (aten.relu, [f(4, 5)], ""),
    "aten.remainder.Scalar": (lambda x: aten.remainder.Scalar(x, 3), [ints(4, 5)], "exact"),
    "aten.remainder.Tensor": (aten.remainder.Tensor, [ints(4, 5), ints(4, 5, lo=1, hi=6)], "exact"),
    "aten.repeat.default": (lambda x: aten.repeat(x, [2, 1, 3]), [f(4, 5)], ""),
    "aten.round.default": (lambda x: aten.round(x * 3), [f(4, 5)], "exact"),
    "aten.rsqrt.default": (aten.rsqrt, [pos(4, 5)], ""),
    "aten.scalar_tensor.default": (lambda x: x * aten.scalar_tensor(2.5), [f(3)], ""),
    "aten.scatter.src": (lambda x, i, s: aten.scatter.src(x, 1, i, s), [f(3, 7), perm_index(7, 3), f(3, 7)], ""),
    "aten.scatter.value": (lambda x, i: aten.scatter.value(x, 1, i[:, :4], 2.5), [f(3, 7), perm_index(7, 3)], ""),
    "aten.scatter_add.default": (lambda x, i, s: aten.scatter_add(x, 0, i, s),
                                 [f(5, 4), ints(3, 4, lo=0, hi=5), f(3, 4)], ""),
    "aten.scatter_reduce.two": (lambda x, i, s: aten.scatter_reduce.two(x, 0, i, s, "amax"),
                                [f(5, 4), ints(3, 4, lo=0, hi=5), f(3, 4)], ""),
    "aten.select.int": (lambda x: twice(aten.select(x, 1, -2)), [f(3, 4, 5)], ""),
    "aten.sigmoid.default": (aten.sigmoid, [f(4, 5)], ""),
    "aten.sign.default": (aten.sign, [f(4, 5)], "exact"),
    "aten.sin.default": (aten.sin, [f(4, 5)], ""),
    "aten.sinh.default": (aten.sinh, [f(4, 5)], ""),
    "aten.slice.Tensor": (lambda x: twice(aten.slice.Tensor(x, 1, 1, -1, 2)), [f(3, 9)], ""),
    "aten.slice_scatter.default": (lambda x, s: aten.slice_scatter(x, s, 1, 1, 8, 3), [f(3, 9), f(3, 3)], ""),
    "aten.split_with_sizes.default": (lambda x: [twice(t) for t in aten.split_with_sizes(x, [2, 5], 1)],
                                      [f(3, 7)], ""),
    "aten.sqrt.default": (aten.sqrt, [pos(4, 5)], ""),
    "aten.squeeze.dims": (lambda x: twice(aten.squeeze.dims(x, [1, 3])), [f(3, 1, 5, 1)], ""),
    "aten.sub.Scalar": (lambda x: aten.sub.Scalar(x, 1.5), [f(4, 5)], ""),
    "aten.sub.Tensor": (lambda x, y: aten.sub.Tensor(x, y, alpha=0.5), [f(4, 5), f(5)], ""),
    "aten.sum.dim_IntList": (lambda x: aten.sum.dim_IntList(x, [1], True), [f(3, 7, 2)], ""),
    "aten.tan.default": (aten.tan, [unit(4, 5)], ""),
    "aten.tanh.default": (aten.tanh, [f(4, 5)], ""),
    "aten.trunc.default": (lambda x: aten.trunc(x * 3), [f(4, 5)], "exact"),
    "aten.unsqueeze.default": (lambda x: twice(aten.unsqueeze(x, -1)), [f(4, 5)], ""),
    "aten.var.correction": (lambda x: aten.var.correction(x, [1], correction=1, keepdim=True), [f(3, 7, 2)], ""),
    "aten.view.default": (lambda x: twice(aten.view(x, [5, 3, 4])), [f(3, 4, 5)], ""),
    "aten.where.self": (aten.where.self, [bools(4, 5), f(4, 5), f(5)], ""),
    # ops kept whole (decompositions.KEEP)
    "aten._scaled_dot_product_flash_attention_for_cpu.default": (
        lambda q, k, v, m: [aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0],
                            aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=m, scale=0.3)[0]],
        [f(2, 3, 7, 8), f(2, 3, 9, 8), f(2, 3, 9, 8), f(2, 1, 7, 9)], "cpu"),
    "aten.silu.default": (aten.silu, [f(4, 5)], ""),
    "aten.hardswish.default": (aten.hardswish, [f(4, 5)], ""),
    "aten.hardsigmoid.default": (aten.hardsigmoid, [f(4, 5)], ""),
    "aten.mish.default": (aten.mish, [f(4, 5)], ""),
    "aten.softplus.default": (lambda x: aten.softplus(x * 8, 2.0, 15.0), [f(4, 5)], ""),
    "aten.tril.default": (lambda x: aten.tril(x, -1), [f(2, 5, 7)], ""),
    "aten.triu.default": (lambda x: aten.triu(x, 2), [f(2, 5, 7)], ""),
    "aten.index_copy.default": (lambda x, i, s: aten.index_copy(x, 1, i[0, :5], s),
                                [f(3, 8, 2), perm_index(8, 1), f(3, 5, 2)], ""),
}  # fmt: skip

GROUP = 20
NAMES = sorted(CASES)
GROUPS = {name: i // GROUP for i, name in enumerate(NAMES)}
FLOAT_TYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def test_every_lowered_core_op_has_a_case():
    lowered = {str(op) for op in core_ops() if status(op)[0] == "lowered"} | set(KEEP)
    assert lowered == set(CASES), (sorted(lowered - set(CASES)), sorted(set(CASES) - lowered))


class _Group(torch.nn.Module):
    def __init__(self, names):
        super().__init__()
        self.names = names

    def forward(self, *inputs):
        out, k = [], 0
        for name in self.names:
            fn, makers, _ = CASES[name]
            out.append(fn(*inputs[k : k + len(makers)]))
            k += len(makers)
        return out


def _inputs(names, seed, dtype, device):
    g = torch.Generator().manual_seed(seed)
    out = []
    for name in names:
        for make in CASES[name][1]:
            t = make(g)
            out.append((t.to(dtype) if t.is_floating_point() else t).to(device))
    return out


@functools.cache
def _compiled_group(group, dtype, device, dynamic=False):
    """(names, results per call as (inputs, outputs), set of op names in the ATen graphs, ops run in torch)."""
    names = [n for n in NAMES if GROUPS[n] == group and not (device == "cuda" and "cpu" in CASES[n][2])]
    collected = []
    torch._dynamo.reset()
    compiled = torch.compile(_Group(names), backend=lambda gm, ex: backend(gm, ex, collect=collected),
                             dynamic=dynamic or None)  # fmt: skip
    calls = []
    with torch.no_grad():
        for seed in (1, 2):
            ins = _inputs(names, seed, dtype, device)
            calls.append((ins, compiled(*ins)))
    seen = {str(n.target) for cg in collected for n in cg.gm.graph.nodes if n.op == "call_function"}
    in_torch = {str(s.target) for cg in collected for s in cg.steps if isinstance(s, torch.fx.Node)}
    in_torch |= {"whole graph: " + cg.fallback_reason for cg in collected if cg.fallback_reason}
    return names, calls, seen, in_torch


def _leaves(x):
    return [t for v in x for t in _leaves(v)] if isinstance(x, (list, tuple)) else [x]


def _check(name, dtype, device, dynamic=False):
    names, calls, seen, in_torch = _compiled_group(GROUPS[name], dtype, device, dynamic)
    if not dynamic:  # (under dynamic=True an op may run in torch: only its results are checked)
        assert name in seen, f"{name} is not in the ATen graph (seen: {sorted(seen)})"
        assert name not in in_torch and not any(s.startswith("whole graph") for s in in_torch), in_torch
    fn, makers, flags = CASES[name]
    start = sum(len(CASES[n][1]) for n in names[: names.index(name)])
    low = dtype in (torch.float16, torch.bfloat16)
    for ins, outs in calls:
        mine = ins[start : start + len(makers)]
        got = _leaves(outs[names.index(name)])
        if "exact" in flags or "shape" in flags:
            ref = _leaves(fn(*mine))
        else:
            ref = _leaves(fn(*[t.double() if t.is_floating_point() else t for t in mine]))
        assert len(got) == len(ref)
        for o, r in zip(got, ref):
            assert o.shape == r.shape, (name, o.shape, r.shape)
            if "shape" in flags:
                assert o.dtype == r.dtype
                continue
            if o.dtype in FLOAT_TYPES:
                o64, r64 = o.double().cpu(), r.double().cpu()
                assert torch.equal(o64.isnan(), r64.isnan()), name
                ok = ~r64.isnan()
                err = float((o64[ok] - r64[ok]).abs().max() / r64[ok].abs().max().clamp_min(1e-30)) if ok.any() else 0
                assert err < (2e-2 if low else 2e-5 if "exact" not in flags else 1e-6), (name, err)
            else:
                assert o.dtype == r.dtype, (name, o.dtype, r.dtype)
                assert torch.equal(o.cpu(), r.cpu()), name


def _by_group(tag: str) -> list:
    """NAMES, each marked with its compiled group: under pytest-xdist (--dist loadgroup) one worker
    runs a group's cases, so each group compiles once, not once per worker that gets one of its cases."""
    return [pytest.param(n, marks=pytest.mark.xdist_group(f"aten-{tag}-{GROUPS[n]}")) for n in NAMES]


@pytest.mark.parametrize("name", _by_group("fp32"))
@pytest.mark.slow
def test_op_fp32_cpu(name):
    _check(name, torch.float32, "cpu")


@pytest.mark.parametrize("name", _by_group("fp32-dynamic"))
@pytest.mark.slow
def test_op_fp32_cpu_symbolic_sizes(name):
    """The same cases with every input size symbolic (dynamic=True): the lowerings' symbolic paths."""
    _check(name, torch.float32, "cpu", dynamic=True)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_op_low_precision_cuda(name, dtype):
    if "cpu" in CASES[name][2]:
        pytest.skip("a CPU-only op (CUDA's attention ops are tested by the GPU model tests)")
    _check(name, dtype, "cuda")
