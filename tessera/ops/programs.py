"""Operators written as Programs (tessera.ir.compute.Program: statements per task) because no
expression per element says them: scatters (writes at data-dependent positions), topk (a
selection) and det (an LU factorization).

Each program's tasks touch disjoint elements, so the CPU runs them on OpenMP threads and CUDA
gives each its own thread -- no atomics, and every result is deterministic:

* `scatter_elements`: one task per position of the indices outside `axis`; it walks that
  line of updates in order, so repeated indices are applied in index order (with reduction
  "none" the last update wins, like numpy's assignment and ONNX's reference; ONNX leaves that
  order undefined).
* `scatter_nd`: one task per element of the scattered slices (data's trailing dims); it walks
  the index tuples in order (repeated tuples: the last wins, or all are reduced in order).
* `index_copy`: one task per position of the source outside `axis`; it walks the index in
  order (repeated indices: the last wins).  With `in_place` it has no init: the output's
  memory must already hold the data (the compiled graph writes a KV-cache update into the
  cache itself), and the kernel writes the indexed slices alone.
* `topk`: one task per row; selection k times (O(k n)), the order being value then index;
  long rows first keep each chunk's k best (one task per chunk), then select among those.
* `det`: one task per matrix: LU with partial pivoting in a local buffer, in float64.

Indices outside [-n, n) raise IndexOutOfRangeError after a CPU kernel (`safe_index`); CUDA
kernels cannot report, and clamp them into [0, n): such an update lands on the first or last
element of its axis -- never outside the tensor.
"""

from __future__ import annotations

import math

from tessera.errors import ArgumentError, UnsupportedError
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.compute import Compute, Program, TensorNode, compute, fresh_name, program
from tessera.ir.types import REGISTER, TensorType
from tessera.ops.common import check_tensor, compute_type, normalize_axis, same_dim, static
from tessera.ops.schedule.loops import i32, serial_nest
from tessera.ops.transform import safe_index

REDUCTIONS = ("none", "add", "mul", "max", "min")
MAX_DET_SIZE = 64  # det keeps one n x n float64 matrix per task in registers / the stack
TOPK_TWO_STAGE = 2048  # rows at least this long (a constant length) select topk in two stages


def _check_indices(idx: TensorNode, op: str) -> None:
    check_tensor(idx, op, "indices")
    if idx.dtype not in (dtypes.int32, dtypes.int64):
        raise ArgumentError(f"{op}: indices '{idx.name}' must be int32 or int64, got {idx.dtype}")


def _combine(reduction: str, old: E.Expr, new: E.Expr, t: dtypes.DataType) -> E.Expr:
    """The value stored where an update lands, computed in `t` (max/min propagate NaN like numpy)."""
    if reduction == "none":
        return new
    a, b = E.Cast(old, t) if old.dtype != t else old, E.Cast(new, t) if new.dtype != t else new
    if reduction == "add":
        return a + b
    if reduction == "mul":
        return a * b
    return E.Call(reduction, (a, b), t)


def _check_scatter(data: TensorNode, updates: TensorNode, reduction: str, op: str) -> dtypes.DataType:
    check_tensor(data, op, "data")
    check_tensor(updates, op, "updates")
    if reduction not in REDUCTIONS:
        raise ArgumentError(f"{op}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if updates.dtype != data.dtype:
        raise ArgumentError(f"{op}: updates ({updates.dtype}) must have data's dtype ({data.dtype})")
    if data.dtype.is_bool and reduction != "none":
        raise UnsupportedError(f"{op}: reduction {reduction!r} of bool tensors is not supported; cast to an integer type")
    return compute_type(data.dtype)


def scatter_elements(data: TensorNode, indices: TensorNode, updates: TensorNode, axis: int = 0,
                     reduction: str = "none") -> Program:  # fmt: skip
    """ONNX ScatterElements: out = data, then out[..., indices[p], ...] (at axis) = updates[p]
    (or reduced into it) for every position p of indices; negative indices count from the end."""
    ct = _check_scatter(data, updates, reduction, "scatter_elements")
    _check_indices(indices, "scatter_elements")
    a = normalize_axis(axis, data.rank, "scatter_elements")
    if indices.rank != data.rank or updates.rank != data.rank or not all(
            same_dim(x, y) for x, y in zip(indices.shape, updates.shape)):  # fmt: skip
        raise ArgumentError(f"scatter_elements: indices {indices!r} and updates {updates!r} must have one shape, of "
                            f"data's rank {data.rank}")  # fmt: skip
    lines = [d for k, d in enumerate(indices.shape) if k != a]

    def body(out: E.Var, *t: E.Var) -> S.Stmt:
        j = E.Var("j", dtypes.int32)
        src = (*t[:a], j, *t[a:])
        pos = E.Var("pos", dtypes.int32)
        dst = (*t[:a], pos, *t[a:])
        value = _combine(reduction, E.Load(out, dst), updates[src], ct)
        step = S.seq(S.DeclareVar(pos, safe_index(indices[src], data.shape[a])), S.Store(out, dst, value))
        return S.For(j, i32(0), indices.shape[a], i32(1), step)

    return program(data.shape, data.dtype, lines, body, init=lambda *i: data[i], name=fresh_name("scatter_elements"))


def scatter_nd(data: TensorNode, indices: TensorNode, updates: TensorNode, reduction: str = "none") -> Program:
    """ONNX ScatterND: out = data, then out[indices[u]] = updates[u] (or reduced into it) for
    every index tuple u of indices (its last dim is the tuple length q; each tuple addresses a
    slice of data's trailing rank - q dims); negative indices count from the end."""
    ct = _check_scatter(data, updates, reduction, "scatter_nd")
    _check_indices(indices, "scatter_nd")
    q = static(indices.shape[-1]) if indices.rank else None
    if q is None or not 1 <= q <= data.rank:
        raise ArgumentError(f"scatter_nd: the last dim of indices {indices!r} must be a constant in [1, {data.rank}]")
    lead, tail = list(indices.shape[:-1]), list(data.shape[q:])
    if updates.rank != len(lead) + len(tail) or not all(same_dim(x, y) for x, y in zip(updates.shape, lead + tail)):
        raise ArgumentError(f"scatter_nd: updates {updates!r} must have shape indices.shape[:-1] + data.shape[{q}:]")

    def body(out: E.Var, *s: E.Var) -> S.Stmt:
        u = [E.Var(f"u{k}", dtypes.int32) for k in range(len(lead))]
        pos = [E.Var(f"pos{k}", dtypes.int32) for k in range(q)]
        decls = [S.DeclareVar(p, safe_index(indices[(*u, i32(k))], data.shape[k])) for k, p in enumerate(pos)]
        dst = (*pos, *s)
        value = _combine(reduction, E.Load(out, dst), updates[(*u, *s)], ct)
        return serial_nest(u, lead, S.seq(*decls, S.Store(out, dst, value)))

    return program(data.shape, data.dtype, tail, body, init=lambda *i: data[i], name=fresh_name("scatter_nd"))


def _before(va: E.Expr, vb: E.Expr, a: E.Expr, b: E.Expr, largest: bool) -> E.Expr:
    """Whether the element at position a (value va) comes before the one at b in topk's order:
    the larger (smaller) value first, NaN after every number, equal values by the lower
    position (numpy's stable sort)."""
    first = E.Binary(">" if largest else "<", va, vb)
    tie = E.Binary("&&", E.Binary("==", va, vb), E.Binary("<", a, b))
    order = E.Binary("||", first, tie)
    if not va.dtype.is_float:
        return order
    nan_a, nan_b = E.Binary("!=", va, va), E.Binary("!=", vb, vb)
    both_nan = E.Binary("&&", E.Binary("&&", nan_a, nan_b), E.Binary("<", a, b))
    return E.Binary("||", E.Binary("&&", E.Unary("!", nan_a), E.Binary("||", nan_b, order)), both_nan)


def _select(k: int, m: E.Expr, before, valid, store) -> S.Stmt:
    """The first k of m candidates in topk's order, by selection: pass j takes the best
    candidate after pass j-1's pick (the order is total, so nothing is taken twice);
    store(j, c) gets candidate c, or -1 once fewer than j + 1 are valid."""
    j, i = E.Var("j", dtypes.int32), E.Var("i", dtypes.int32)
    prev, best = E.Var("prev", dtypes.int32), E.Var("best", dtypes.int32)
    cond = E.Binary("&&", E.Binary("||", E.Binary("<", prev, i32(0)), before(prev, i)),
                    E.Binary("||", E.Binary("<", best, i32(0)), before(i, best)))  # fmt: skip
    if valid is not None:
        cond = E.Binary("&&", valid(i), cond)
    scan = S.For(i, i32(0), m, i32(1), S.If(cond, S.Assign(best, i)))
    keep = S.If(E.Binary(">=", best, i32(0)), S.Assign(prev, best))
    pick = S.seq(S.DeclareVar(best, i32(-1)), scan, store(j, best), keep)
    return S.seq(S.DeclareVar(prev, i32(-1)), S.For(j, i32(0), i32(k), i32(1), pick))


def _chunks(n: int | None, k: int) -> int:
    """How many chunks a row of n is split into for topk's first stage (1: one stage)."""
    if n is None or n < TOPK_TWO_STAGE:
        return 1
    return max(2, math.isqrt(n // k))


def topk_indices(x: TensorNode, k: int, axis: int = -1, largest: bool = True) -> Program:
    """The int64 positions along axis of the k largest (smallest) elements of each row, in order
    (values descending, or ascending; NaN last; ties by the lower index).

    One task per row selects them (k passes over the row).  Rows of a constant length of at
    least TOPK_TWO_STAGE are first cut into about sqrt(n / k) chunks, one task each keeping its
    chunk's k best positions; the row's task then selects among those candidates."""
    check_tensor(x, "topk")
    a = normalize_axis(axis, x.rank, "topk")
    n = x.shape[a]
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or (static(n) is not None and k > static(n)):
        raise ArgumentError(f"topk: k must be an int in [1, {dim_text(n)}], got {k!r}")
    shape = [i32(k) if d == a else s for d, s in enumerate(x.shape)]
    rows = [s for d, s in enumerate(x.shape) if d != a]
    chunks = _chunks(static(n), k)

    def at(r, i: E.Expr) -> tuple[E.Expr, ...]:
        return (*r[:a], i, *r[a:])

    def position_order(r):
        return lambda p, q: _before(x[at(r, p)], x[at(r, q)], p, q, largest)

    if chunks == 1:
        def body(out: E.Var, *r: E.Var) -> S.Stmt:
            return _select(k, n, position_order(r), None, lambda j, c: S.Store(out, at(r, j), E.Cast(c, dtypes.int64)))

        return program(shape, dtypes.int64, rows, body, name=fresh_name("topk"))

    size = -(-static(n) // chunks)
    cand_shape = [i32(chunks * k) if d == a else s for d, s in enumerate(x.shape)]

    def stage1(out: E.Var, *t: E.Var) -> S.Stmt:
        r, c = t[:-1], t[-1]
        start = c * size
        order = position_order(r)
        return _select(k, i32(size), lambda p, q: order(start + p, start + q), lambda p: start + p < n,
                       lambda j, p: S.Store(out, at(r, c * k + j), E.Select(p < i32(0), p, start + p)))  # fmt: skip

    cand = program(cand_shape, dtypes.int32, [*rows, i32(chunks)], stage1, name=fresh_name("topk_candidates"))

    def stage2(out: E.Var, *r: E.Var) -> S.Stmt:
        order = position_order(r)
        pos = lambda c: cand[at(r, c)]  # noqa: E731
        return _select(k, i32(chunks * k), lambda p, q: order(pos(p), pos(q)), lambda p: pos(p) >= i32(0),
                       lambda j, c: S.Store(out, at(r, j), E.Cast(pos(c), dtypes.int64)))  # fmt: skip

    return program(shape, dtypes.int64, rows, stage2, name=fresh_name("topk"))


def dim_text(d: E.Expr) -> str:
    return str(static(d)) if static(d) is not None else str(d)


def index_copy(data: TensorNode, index: TensorNode, source: TensorNode, axis: int = 0,
               in_place: bool = False) -> Program:  # fmt: skip
    """torch's index_copy: out = data, then out[..., index[j], ...] (at axis) = source[..., j, ...]
    for every j (negative indices count from the end).  `in_place`: out starts as whatever its
    memory holds -- data's own memory, where the caller placed it -- and only the indexed slices
    are written."""
    _check_scatter(data, source, "none", "index_copy")
    _check_indices(index, "index_copy")
    a = normalize_axis(axis, data.rank, "index_copy")
    if index.rank != 1:
        raise ArgumentError(f"index_copy: index {index!r} must be 1-D")
    if source.rank != data.rank or not same_dim(source.shape[a], index.shape[0]) or not all(
            same_dim(x, y) for k, (x, y) in enumerate(zip(source.shape, data.shape)) if k != a):  # fmt: skip
        raise ArgumentError(f"index_copy: source {source!r} must have data's shape {list(data.shape)} with dim {a} "
                            f"the index's length")  # fmt: skip
    lines = [d for k, d in enumerate(data.shape) if k != a]

    def body(out: E.Var, *t: E.Var) -> S.Stmt:
        j = E.Var("j", dtypes.int32)
        pos = E.Var("pos", dtypes.int32)
        store = S.Store(out, (*t[:a], pos, *t[a:]), source[(*t[:a], j, *t[a:])])
        step = S.seq(S.DeclareVar(pos, safe_index(index[(j,)], data.shape[a])), store)
        return S.For(j, i32(0), index.shape[0], i32(1), step)

    init = None if in_place else (lambda *i: data[i])
    return program(data.shape, data.dtype, lines, body, init=init, name=fresh_name("index_copy"))


def topk(x: TensorNode, k: int, axis: int = -1, largest: bool = True) -> tuple[Compute, Program]:
    """(values, int64 indices) of the k largest (smallest) elements along axis, sorted; ties
    keep the lower index first, NaN comes after every number (numpy's stable argsort)."""
    idx = topk_indices(x, k, axis, largest)
    a = normalize_axis(axis, x.rank, "topk")

    def fn(*i: E.Var) -> E.Expr:
        return x[(*i[:a], E.Cast(idx[i], dtypes.int32), *i[a + 1:])]

    return compute(idx.shape, fn, fresh_name("topk_values"), x.dtype, tag="gather"), idx


def det(x: TensorNode) -> Program:
    """Determinants of the trailing n x n matrices (n a constant up to MAX_DET_SIZE): LU with
    partial pivoting per matrix, in float64, rounded once to x's dtype."""
    check_tensor(x, "det")
    if x.rank < 2 or not x.dtype.is_float:
        raise ArgumentError(f"det: needs floating-point matrices [..., n, n], got {x!r}")
    n = static(x.shape[-1])
    if n is None or static(x.shape[-2]) != n:
        raise UnsupportedError(f"det: the matrices of {x!r} must be square with a constant size")
    if n > MAX_DET_SIZE:
        raise UnsupportedError(f"det: matrices larger than {MAX_DET_SIZE}x{MAX_DET_SIZE} are not supported (got {n})")
    f64 = dtypes.float64
    batch = list(x.shape[:-2])

    def body(out: E.Var, *b: E.Var) -> S.Stmt:
        m = E.Var("lu", TensorType(f64, (i32(n * n),), REGISTER))
        r0, c0, r, c, c2, col, piv, row = (E.Var(v, dtypes.int32) for v in ("r0", "c0", "r", "c", "c2", "col", "piv", "row"))
        big, d, f, tmp, acc = (E.Var(v, f64) for v in ("big", "d", "f", "tmp", "det"))

        def el(i: E.Expr, j: E.Expr) -> E.Load:
            return E.Load(m, (i * n + j,))

        def st(i: E.Expr, j: E.Expr, v: E.Expr) -> S.Store:
            return S.Store(m, (i * n + j,), v)

        def absval(v: E.Expr) -> E.Expr:
            return E.Call("abs", (v,), f64)

        load = serial_nest([r0, c0], [i32(n), i32(n)], st(r0, c0, E.Cast(x[(*b, r0, c0)], f64)))
        find = S.seq(S.DeclareVar(piv, col), S.DeclareVar(big, absval(el(col, col))),
                     S.For(r, col + 1, i32(n), i32(1),
                           S.If(E.Binary(">", absval(el(r, col)), big), S.seq(S.Assign(big, absval(el(r, col))), S.Assign(piv, r)))))  # fmt: skip
        swap = S.If(E.Binary("!=", piv, col), S.seq(
            S.For(c, i32(0), i32(n), i32(1), S.seq(S.DeclareVar(tmp, el(col, c)), st(col, c, el(piv, c)), st(piv, c, tmp))),
            S.Assign(acc, -acc)))  # fmt: skip
        eliminate = S.For(row, col + 1, i32(n), i32(1), S.seq(
            S.DeclareVar(f, E.Binary("/", el(row, col), d)),
            S.For(c2, col + 1, i32(n), i32(1), st(row, c2, el(row, c2) - f * el(col, c2)))))  # fmt: skip
        step = S.seq(find, swap, S.DeclareVar(d, el(col, col)), S.Assign(acc, acc * d),
                     S.If(E.Binary("!=", d, E.Const(0.0, f64)), eliminate))  # fmt: skip
        where = tuple(b) if b else (i32(0),)
        return S.seq(S.DeclareBuffer(m), load, S.DeclareVar(acc, E.Const(1.0, f64)),
                     S.For(col, i32(0), i32(n), i32(1), step), S.Store(out, where, E.Cast(acc, x.dtype)))  # fmt: skip

    return program(batch, x.dtype, batch, body, name=fresh_name("det"))
