"""Expression nodes of the IR.

Expressions are immutable trees.  Every expression has a `type`: a DataType for scalar
values, or a PointerType/TensorType for variables that name memory.  Python operators are
overloaded so passes can build index arithmetic naturally (`i * 16 + j`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from tessera.ir import dtypes, text
from tessera.ir.dtypes import DataType
from tessera.ir.types import PointerType, TensorType, Type

ARITH_OPS = ("+", "-", "*", "/", "//", "%")
BIT_OPS = ("&", "|", "^", "<<", ">>")
COMPARE_OPS = ("<", "<=", ">", ">=", "==", "!=")
LOGIC_OPS = ("&&", "||")
BINARY_OPS = ARITH_OPS + BIT_OPS + COMPARE_OPS + LOGIC_OPS
UNARY_OPS = ("-", "!", "~")

# Hardware indices readable inside GPU kernels.
HARDWARE_INDICES = tuple(f"{reg}.{axis}" for reg in ("threadIdx", "blockIdx", "blockDim", "gridDim") for axis in "xyz")


class IRTypeError(TypeError):
    """An IR node was built from operands of the wrong type."""


class Expr:
    """Base class of all expressions."""

    type: Type

    @property
    def dtype(self) -> DataType:
        if not isinstance(self.type, DataType):
            raise IRTypeError(f"expression of type {self.type} is not a scalar")
        return self.type

    # Operator sugar for building IR from Python (passes, templates, tests).
    def __add__(self, o: Any) -> Expr:
        return Binary("+", self, as_expr(o))

    def __radd__(self, o: Any) -> Expr:
        return Binary("+", as_expr(o), self)

    def __sub__(self, o: Any) -> Expr:
        return Binary("-", self, as_expr(o))

    def __rsub__(self, o: Any) -> Expr:
        return Binary("-", as_expr(o), self)

    def __mul__(self, o: Any) -> Expr:
        return Binary("*", self, as_expr(o))

    def __rmul__(self, o: Any) -> Expr:
        return Binary("*", as_expr(o), self)

    def __floordiv__(self, o: Any) -> Expr:
        return Binary("//", self, as_expr(o))

    def __mod__(self, o: Any) -> Expr:
        return Binary("%", self, as_expr(o))

    def __neg__(self) -> Expr:
        return Unary("-", self)

    def __lt__(self, o: Any) -> Expr:
        return Binary("<", self, as_expr(o))

    def __le__(self, o: Any) -> Expr:
        return Binary("<=", self, as_expr(o))

    def __gt__(self, o: Any) -> Expr:
        return Binary(">", self, as_expr(o))

    def __ge__(self, o: Any) -> Expr:
        return Binary(">=", self, as_expr(o))

    def __str__(self) -> str:
        return text.to_str("expr", self)

    __hash__ = object.__hash__


@dataclass(eq=False, repr=False)
class Var(Expr):
    """A named value: a scalar variable, a pointer, or a tensor (buffer)."""

    name: str
    type: Type

    def __repr__(self) -> str:
        return f"Var({self.name}: {self.type})"

    __hash__ = object.__hash__


@dataclass(eq=False, repr=False)
class Const(Expr):
    value: Union[int, float, bool]
    type: DataType

    def __post_init__(self) -> None:
        if self.type.is_float:
            self.value = float(self.value)
        elif self.type.is_bool:
            self.value = bool(self.value)
        else:
            self.value = int(self.value)
            if not self.type.holds(self.value):  # generated code would silently truncate it
                raise IRTypeError(f"the constant {self.value} does not fit in {self.type}")

    def __repr__(self) -> str:
        return f"Const({self.value}, {self.type})"

    __hash__ = object.__hash__


@dataclass(eq=False, repr=False)
class Binary(Expr):
    op: str
    a: Expr
    b: Expr
    type: DataType = field(init=False)

    def __post_init__(self) -> None:
        self.type = binary_result_type(self.op, self.a, self.b)

    __hash__ = object.__hash__


@dataclass(eq=False, repr=False)
class Unary(Expr):
    op: str
    a: Expr
    type: DataType = field(init=False)

    def __post_init__(self) -> None:
        if self.op not in UNARY_OPS:
            raise IRTypeError(f"unknown unary operator {self.op!r}")
        t = self.a.dtype
        if self.op == "!":
            self.type = dtypes.boolean
        elif self.op == "~":
            if not (t.is_integer or t.is_bool):
                raise IRTypeError(f"'~' needs an integer operand, got {t}")
            self.type = dtypes.promote(t, t)
        else:
            if t.is_bool:
                raise IRTypeError("cannot negate a bool")
            self.type = dtypes.promote(t, t)

    __hash__ = object.__hash__


@dataclass(eq=False, repr=False)
class Cast(Expr):
    value: Expr
    type: DataType

    def __post_init__(self) -> None:
        self.value.dtype  # noqa: B018  (raises for non-scalars)

    __hash__ = object.__hash__


@dataclass(eq=False, repr=False)
class Select(Expr):
    """cond ? a : b"""

    cond: Expr
    a: Expr
    b: Expr
    type: DataType = field(init=False)

    def __post_init__(self) -> None:
        self.type = dtypes.promote(self.a.dtype, self.b.dtype) if self.a.dtype != self.b.dtype else self.a.dtype

    __hash__ = object.__hash__


@dataclass(eq=False, repr=False)
class Call(Expr):
    """A call of an intrinsic function (see tessera.ir.intrinsics)."""

    func: str
    args: tuple[Expr, ...]
    type: DataType

    __hash__ = object.__hash__


@dataclass(eq=False, repr=False)
class Load(Expr):
    """Read one element of a tensor or pointer."""

    buffer: Var
    indices: tuple[Expr, ...]
    type: DataType = field(init=False)

    def __post_init__(self) -> None:
        self.type = check_access(self.buffer, self.indices)

    __hash__ = object.__hash__


@dataclass(eq=False, repr=False)
class Address(Expr):
    """The address of one element of a tensor or pointer: an operand of memory instructions."""

    buffer: Var
    indices: tuple[Expr, ...]
    type: PointerType = field(init=False)

    def __post_init__(self) -> None:
        self.type = PointerType(check_access(self.buffer, self.indices))

    @property
    def scope(self) -> str:
        """Memory scope of the addressed element: global, shared or register."""
        t = self.buffer.type
        return t.scope if isinstance(t, TensorType) else "global"

    __hash__ = object.__hash__


@dataclass(eq=False, repr=False)
class HardwareIndex(Expr):
    """threadIdx.x, blockIdx.y, blockDim.z, gridDim.x, ..."""

    name: str
    type: DataType = dtypes.int32

    def __post_init__(self) -> None:
        if self.name not in HARDWARE_INDICES:
            raise IRTypeError(f"unknown hardware index {self.name!r}")

    __hash__ = object.__hash__


def as_expr(value: Any, dtype: DataType | None = None) -> Expr:
    """Wrap Python numbers as constants; pass expressions through."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, bool):
        return Const(value, dtype or dtypes.boolean)
    if isinstance(value, int):
        if dtype is None:
            dtype = dtypes.int32 if -(2**31) <= value < 2**31 else dtypes.int64
        return Const(value, dtype)
    if isinstance(value, float):
        if dtype is None:  # like ints: a value float32 cannot hold keeps Python's float64
            dtype = dtypes.float32 if dtypes.float32.holds(value) else dtypes.float64
        return Const(value, dtype)
    raise IRTypeError(f"cannot use {value!r} ({type(value).__name__}) as an IR expression")


def binary_result_type(op: str, a: Expr, b: Expr) -> DataType:
    if op not in BINARY_OPS:
        raise IRTypeError(f"unknown binary operator {op!r}")
    ta, tb = a.dtype, b.dtype
    if op in COMPARE_OPS or op in LOGIC_OPS:
        return dtypes.boolean
    if op in BIT_OPS:
        if not ((ta.is_integer or ta.is_bool) and (tb.is_integer or tb.is_bool)):
            raise IRTypeError(f"operator '{op}' needs integer operands, got {ta} and {tb}")
        if op in ("<<", ">>") and ta.is_integer:
            return dtypes.compute_type(ta)
        return dtypes.promote(ta, tb)
    if op == "/" and not (ta.is_float or tb.is_float):
        return dtypes.float32
    if op == "//" and (ta.is_float or tb.is_float):
        raise IRTypeError(f"'//' needs integer operands, got {ta} and {tb}; use '/' for floats")
    return dtypes.promote(ta, tb)


def check_access(buffer: Var, indices: tuple[Expr, ...]) -> DataType:
    """Validate an element access and return the element type."""
    t = buffer.type
    if isinstance(t, PointerType):
        if len(indices) != 1:
            raise IRTypeError(f"pointer '{buffer.name}' takes one index, got {len(indices)}")
    elif isinstance(t, TensorType):
        if len(indices) != t.rank:
            raise IRTypeError(f"tensor '{buffer.name}' has rank {t.rank} but got {len(indices)} indices")
    else:
        raise IRTypeError(f"'{buffer.name}' of type {t} cannot be indexed")
    for idx in indices:
        if not (idx.dtype.is_integer or idx.dtype.is_bool):
            raise IRTypeError(f"index into '{buffer.name}' must be an integer, got {idx.dtype}")
    return t.dtype
