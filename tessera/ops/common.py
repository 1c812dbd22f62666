"""Shared helpers of the operator library: argument checks, shapes, broadcasting and dtype promotion.

Dimensions are int32 IR expressions (`tessera.ir.compute.as_dim`); two are the same size when
they are equal in tessera's size algebra (`tessera.ir.symbolic`: `2*(n + 1)` is `2*n + 2`),
which identifies shape symbols by name: one `Var` per dynamic size.  Symbolic sizes broadcast
only against an equal size or 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

from tessera.errors import ArgumentError, ShapeError, UnsupportedError
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.compute import ExprKeys, TensorElement, TensorNode, as_dim
from tessera.ir.dtypes import DataType
from tessera.ir.shapes import broadcast_shapes as sym_broadcast
from tessera.ir.shapes import from_expr, numel, to_expr
from tessera.ir.symbolic import Dim

Scalar = Union[bool, int, float]
TensorOrScalar = Union[TensorNode, bool, int, float]

# dtypes the ops compute with (sub-byte and fp8 types are storage formats for quantized kernels).
SUPPORTED = (dtypes.boolean, dtypes.int8, dtypes.int16, dtypes.int32, dtypes.int64, dtypes.uint8, dtypes.uint16,
             dtypes.uint32, dtypes.uint64, dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64)  # fmt: skip
NARROW_FLOATS = (dtypes.float16, dtypes.bfloat16)


# ---- arguments -----------------------------------------------------------------------------------------------------
def check_tensor(x: Any, op: str, what: str = "input") -> TensorNode:
    """`x` as a tensor node, or an ArgumentError that says what was passed instead."""
    if not isinstance(x, TensorNode):
        raise ArgumentError(f"{op}: {what} must be a tensor node (placeholder or op result), got {type(x).__name__}")
    if x.dtype not in SUPPORTED:
        raise UnsupportedError(f"{op}: {what} '{x.name}' has dtype {x.dtype}, which ops cannot compute with; "
                               f"dequantize or cast it to one of {', '.join(d.name for d in SUPPORTED)} first")  # fmt: skip
    return x


def check_float(x: TensorNode, op: str) -> None:
    if not x.dtype.is_float:
        raise UnsupportedError(f"{op}: needs a floating-point input, got '{x.name}' of dtype {x.dtype}; cast it first")


def normalize_axis(axis: int, rank: int, op: str) -> int:
    """A Python-style axis (negative counts from the end) as an index in [0, rank)."""
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise ArgumentError(f"{op}: axis must be an int, got {axis!r}")
    if not -rank <= axis < max(rank, 1):
        raise ArgumentError(f"{op}: axis {axis} is out of range for a tensor of rank {rank}")
    return axis % rank if rank else 0


def normalize_axes(axes: int | Sequence[int] | None, rank: int, op: str) -> tuple[int, ...]:
    """Sorted, distinct axes; None means every axis."""
    if axes is None:
        return tuple(range(rank))
    if isinstance(axes, int):
        axes = (axes,)
    out = tuple(sorted(normalize_axis(a, rank, op) for a in axes))
    if len(set(out)) != len(out):
        raise ArgumentError(f"{op}: axes {tuple(axes)} repeat an axis")
    return out


# ---- dimensions -----------------------------------------------------------------------------------------------------
# Dimensions are int32 IR expressions (what kernels index with); every question about sizes (is
# it constant, are two equal, what is a product or a quotient) is answered in tessera's one size
# algebra, `tessera.ir.symbolic`, which names shape symbols by their Var's name.
def size_of(d: E.Expr) -> Dim | None:
    """The canonical size of a dimension expression, None if it is not one (a load, a float)."""
    if isinstance(d, E.Const):
        return int(d.value)
    try:
        return from_expr(d)
    except TypeError:
        return None


def static(d: E.Expr) -> int | None:
    """The value of a constant dimension, None for a symbolic one."""
    if isinstance(d, E.Const):
        return int(d.value)
    v = size_of(d)
    return v if isinstance(v, int) else None


def same_dim(a: E.Expr, b: E.Expr) -> bool:
    """Whether two dimensions are the same size: equal in the size algebra (`2*(n + 1)` is `2*n + 2`)."""
    sa, sb = size_of(a), size_of(b)
    if sa is None or sb is None:
        keys = ExprKeys()
        return keys(a) == keys(b)
    return sa == sb


def dim_str(shape: Sequence[E.Expr]) -> str:
    return "(" + ", ".join(_dim_text(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _dim_text(d: E.Expr) -> str:
    s = size_of(d)
    return str(d) if s is None else str(s)


def shape_vars(dims: Sequence[E.Expr]) -> dict[str, E.Expr]:
    """The int32 Vars that dimensions use, by name (one Var per shape symbol)."""
    out: dict[str, E.Expr] = {}

    def walk(e: E.Expr) -> None:
        if isinstance(e, E.Var):
            out.setdefault(e.name, e)
        for child in (getattr(e, "a", None), getattr(e, "b", None), getattr(e, "value", None)):
            if isinstance(child, E.Expr):
                walk(child)
        for child in getattr(e, "args", ()) or ():
            walk(child)

    for d in dims:
        walk(d)
    return out


def size_expr(d: Dim, like: Sequence[E.Expr]) -> E.Expr:
    """A size as a dimension expression over the Vars that the dimensions `like` use."""
    return to_expr(d, shape_vars(like))


def _sizes(dims: Sequence[E.Expr], op: str) -> list[Dim]:
    out = []
    for d in dims:
        s = size_of(d)
        if s is None:
            raise ArgumentError(f"{op}: {d} is not a size expression (ints, int32 variables, + - * // %, min, max)")
        out.append(s)
    return out


def mul_dims(dims: Sequence[E.Expr]) -> E.Expr:
    """The product of dimensions, canonical."""
    return size_expr(numel(_sizes(dims, "product of sizes")), dims)


def numel_of(dims: Sequence[E.Expr]) -> Dim:
    """The element count of a shape, as a size."""
    return numel(_sizes(dims, "element count"))


def numel_equal(a: Sequence[E.Expr], b: Sequence[E.Expr]) -> bool:
    return numel_of(a) == numel_of(b)


# ---- broadcasting ------------------------------------------------------------------------------------------------
def broadcast_shapes(shapes: Sequence[Sequence[E.Expr]], op: str) -> tuple[E.Expr, ...]:
    """numpy broadcasting of shapes by tessera's one rule (`tessera.ir.symbolic.broadcast_shapes`):
    right-aligned, a literal 1 stretches, other sizes must be equal in the size algebra.  The ops
    library cannot check sizes assumed equal at run time, so it refuses them (the graph layer
    assumes and checks them, then hands ops shapes expressed alike)."""
    sizes = [_sizes(s, op) for s in shapes]
    try:
        result = sym_broadcast(*sizes, assume=False)
    except ShapeError as e:
        raise ArgumentError(f"{op}: {e}") from None
    like = [d for s in shapes for d in s]
    return tuple(size_expr(d, like) if not isinstance(d, int) else as_dim(d) for d in result)


def broadcast_read(x: TensorNode, out_shape: Sequence[E.Expr], axes: Sequence[E.Var]) -> TensorElement:
    """The element of `x` that lands at `axes` of the broadcast result of shape `out_shape`."""
    offset = len(out_shape) - x.rank
    idx = []
    for j, d in enumerate(x.shape):
        target = out_shape[j + offset]
        idx.append(E.Const(0, dtypes.int32) if static(d) == 1 and static(target) != 1 else axes[j + offset])
    return x[tuple(idx)]


# ---- dtypes ----------------------------------------------------------------------------------------------------------
# torch's promotion between two tensor dtypes: tessera.ir.dtypes holds it, with the kernel IR's C
# rule and the graph's.
promote_types = dtypes.promote_torch


def scalar_kind(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    raise ArgumentError(f"expected a tensor node or a Python number, got {type(v).__name__}")


def result_type(args: Sequence[TensorOrScalar], op: str) -> DataType:
    """The dtype of an elementwise result: tensors promote; Python numbers only lift the category.

    As in torch, ``x_f16 * 2.0`` stays float16 and ``x_int32 * 2.5`` becomes float32.
    """
    tensors = [a.dtype for a in args if isinstance(a, TensorNode)]
    if not tensors:
        raise ArgumentError(f"{op}: needs at least one tensor argument")
    return dtypes.result_type_torch(tensors, (scalar_kind(a) for a in args if not isinstance(a, TensorNode)), op)


def compute_type(t: DataType) -> DataType:
    """The type arithmetic on `t` values is carried out in: float16/bfloat16 widen to float32."""
    return dtypes.float32 if t in NARROW_FLOATS else t


def float_type(t: DataType) -> DataType:
    """The floating type a transcendental function of a `t` value returns (ints give float32)."""
    return t if t.is_float else dtypes.float32


def operand(a: TensorOrScalar, out_shape: Sequence[E.Expr], axes: Sequence[E.Var], t: DataType) -> E.Expr:
    """Argument `a` read at `axes` of the broadcast result, converted to the compute type `t`."""
    if isinstance(a, TensorNode):
        v: E.Expr = broadcast_read(a, out_shape, axes)
        return v if v.dtype == t else E.Cast(v, t)
    return E.Const(a, t)
