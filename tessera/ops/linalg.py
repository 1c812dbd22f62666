"""Matrix products as compute definitions: matmul (numpy semantics: batched, broadcast, 1-D operands),
linear (x @ w.T + b) and bmm.

These are the plain definitions, scheduled as contractions (one thread per output element);
a tuned tensor-core template replaces them for anchor ops.  float16/bfloat16 accumulate in
float32, integers in int64.
"""

from __future__ import annotations

from tessera.errors import ArgumentError, UnsupportedError
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.compute import ReduceCompute, TensorNode, compute, fresh_name, reduce
from tessera.ops.common import broadcast_shapes, check_tensor, compute_type, dim_str, promote_types, same_dim, static


def _acc(t: dtypes.DataType) -> dtypes.DataType:
    return compute_type(t) if t.is_float else dtypes.int64


def matmul(a: TensorNode, b: TensorNode) -> TensorNode:
    """a @ b with numpy's rules: 1-D operands gain (and lose) a unit axis; batch axes broadcast."""
    check_tensor(a, "matmul", "a")
    check_tensor(b, "matmul", "b")
    if a.rank == 0 or b.rank == 0:
        raise ArgumentError("matmul: operands must have at least one dimension; use mul for scalars")
    t = promote_types(a.dtype, b.dtype, "matmul")
    if t.is_bool:
        raise UnsupportedError("matmul: bool operands are not supported; cast them first")
    acc = _acc(t)
    a_vec, b_vec = a.rank == 1, b.rank == 1
    k_a = a.shape[-1]
    k_b = b.shape[0] if b_vec else b.shape[-2]
    if not same_dim(k_a, k_b):
        raise ArgumentError(f"matmul: inner dimensions differ: a {dim_str(a.shape)} has {k_a}, b {dim_str(b.shape)} has {k_b}")
    a_batch = [] if a_vec else list(a.shape[:-2])
    b_batch = [] if b_vec else list(b.shape[:-2])
    batch = list(broadcast_shapes([a_batch, b_batch], "matmul (batch dims)"))
    m = [] if a_vec else [a.shape[-2]]
    n = [] if b_vec else [b.shape[-1]]
    nb = len(batch)

    def batch_index(x_batch: list, out_idx) -> list:
        off = nb - len(x_batch)
        return [E.Const(0, dtypes.int32) if static(d) == 1 and static(batch[j + off]) != 1 else out_idx[j + off]
                for j, d in enumerate(x_batch)]  # fmt: skip

    def fn(idx, r) -> E.Expr:
        bi, rest = idx[:nb], idx[nb:]
        i = rest[:len(m)]
        j = rest[len(m):]
        k = r[0]
        av = a[(*batch_index(a_batch, bi), *i, k)]
        bv = b[(k,)] if b_vec else b[(*batch_index(b_batch, bi), k, *j)]
        return E.Cast(av, acc) * E.Cast(bv, acc)

    return reduce([*batch, *m, *n], [k_a], fn, "sum", fresh_name("matmul"), t, acc, tag="contraction")


def bmm(a: TensorNode, b: TensorNode) -> TensorNode:
    """Batched matmul of [B, M, K] and [B, K, N] (torch.bmm)."""
    for x, what in ((a, "a"), (b, "b")):
        check_tensor(x, "bmm", what)
        if x.rank != 3:
            raise ArgumentError(f"bmm: {what} must be 3-D, got shape {dim_str(x.shape)}")
    if not same_dim(a.shape[0], b.shape[0]):
        raise ArgumentError(f"bmm: batch sizes differ: {a.shape[0]} and {b.shape[0]}")
    return matmul(a, b)


def linear(x: TensorNode, weight: TensorNode, bias: TensorNode | None = None) -> TensorNode:
    """x @ weight.T + bias with weight [out, in] (torch.nn.functional.linear)."""
    check_tensor(x, "linear", "x")
    check_tensor(weight, "linear", "weight")
    if weight.rank != 2:
        raise ArgumentError(f"linear: weight must be 2-D [out_features, in_features], got {dim_str(weight.shape)}")
    if x.rank < 1 or not same_dim(x.shape[-1], weight.shape[1]):
        raise ArgumentError(f"linear: x {dim_str(x.shape)} has {x.shape[-1] if x.rank else 0} features but weight "
                            f"{dim_str(weight.shape)} expects {weight.shape[1]}")  # fmt: skip
    t = promote_types(x.dtype, weight.dtype, "linear")
    acc = _acc(t)
    lead = list(x.shape[:-1])
    out_f = weight.shape[0]
    y: ReduceCompute = reduce([*lead, out_f], [x.shape[-1]],
                              lambda i, r: E.Cast(x[(*i[:-1], r[0])], acc) * E.Cast(weight[(i[-1], r[0])], acc),
                              "sum", fresh_name("linear"), t if bias is None else acc, acc, tag="contraction")  # fmt: skip
    if bias is None:
        return y
    check_tensor(bias, "linear", "bias")
    if bias.rank != 1 or not same_dim(bias.shape[0], out_f):
        raise ArgumentError(f"linear: bias must have shape ({out_f},), got {dim_str(bias.shape)}")
    t = promote_types(t, bias.dtype, "linear")
    return compute(y.shape, lambda *i: y[i] + E.Cast(bias[(i[-1],)], acc), fresh_name("linear_bias"), t)

