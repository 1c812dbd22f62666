"""Symbolic dimensions: shapes whose entries are ints or named sizes such as "batch".

A symbolic dimension is a monomial `coeff * a^p * b^q ...` over named sizes.  Monomials
are closed under the products that reshapes and flattens create (batch*seq) and under the
exact divisions that `-1` in a reshape needs, which covers the shapes of the models we
compile.  Anything else (a sum such as past+seq) becomes a fresh opaque name: it still
checks as "some size" but cannot be evaluated from the inputs' shapes.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Union

from tessera.errors import TesseraError


class ShapeError(TesseraError, ValueError):
    """Operator inputs whose shapes, dtypes or attributes do not fit together."""


@dataclass(frozen=True)
class Sym:
    """A monomial over named sizes: `coeff * prod(name ** power)`; hashable and comparable."""

    coeff: int
    factors: tuple[tuple[str, int], ...]

    @staticmethod
    def var(name: str) -> Sym:
        if not name or "*" in name or name[0].isdigit():
            raise ValueError(f"invalid symbolic dimension name {name!r}")
        return Sym(1, ((name, 1),))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.factors)

    def __mul__(self, other: Dim) -> Dim:
        if isinstance(other, int):
            return _make(self.coeff * other, dict(self.factors))
        powers = dict(self.factors)
        for n, p in other.factors:
            powers[n] = powers.get(n, 0) + p
        return _make(self.coeff * other.coeff, powers)

    __rmul__ = __mul__

    def exact_div(self, other: Dim) -> Dim | None:
        """self / other when that is again a monomial with an integer coefficient, else None."""
        if isinstance(other, int):
            if other == 0 or self.coeff % other:
                return None
            return _make(self.coeff // other, dict(self.factors))
        if other.coeff == 0 or self.coeff % other.coeff:
            return None
        powers = dict(self.factors)
        for n, p in other.factors:
            if powers.get(n, 0) < p:
                return None
            powers[n] -= p
        return _make(self.coeff // other.coeff, powers)

    def evaluate(self, bindings: Mapping[str, int]) -> int:
        value = self.coeff
        for n, p in self.factors:
            if n not in bindings:
                raise ShapeError(f"symbolic size {n!r} is not bound by any input shape")
            value *= bindings[n] ** p
        return value

    def __str__(self) -> str:
        parts = [] if self.coeff == 1 else [str(self.coeff)]
        parts += [n if p == 1 else f"{n}^{p}" for n, p in self.factors]
        return "*".join(parts)

    def __repr__(self) -> str:
        return f"Sym({str(self)!r})"


Dim = Union[int, Sym]
Shape = tuple[Dim, ...]

_fresh = itertools.count()


def fresh_dim(hint: str = "d") -> Sym:
    """A new opaque size, for results such as a concat of two symbolic sizes."""
    return Sym.var(f"_{hint}{next(_fresh)}")


def _make(coeff: int, powers: dict[str, int]) -> Dim:
    factors = tuple(sorted((n, p) for n, p in powers.items() if p != 0))
    if coeff == 0 or not factors:
        return coeff
    return Sym(coeff, factors)


def as_dim(value: object) -> Dim:
    """Normalize a dimension given as int, Sym, numpy int or text ("batch", "2*batch*seq")."""
    if isinstance(value, Sym):
        return value
    if isinstance(value, str):
        return parse_dim(value)
    if hasattr(value, "__index__"):
        return int(value)  # type: ignore[arg-type]
    raise TypeError(f"a dimension must be an int or a symbolic name, not {value!r}")


def parse_dim(text: str) -> Dim:
    """Inverse of `str(dim)`: "batch", "2*batch*seq", "seq^2", "7"."""
    coeff, powers = 1, {}
    for part in text.strip().split("*"):
        part = part.strip()
        if part.lstrip("-").isdigit():
            coeff *= int(part)
            continue
        name, _, power = part.partition("^")
        Sym.var(name)  # validates the name
        powers[name] = powers.get(name, 0) + (int(power) if power else 1)
    return _make(coeff, powers)


def as_shape(values: Iterable[object]) -> Shape:
    return tuple(as_dim(v) for v in values)


def dim_mul(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return a * b
    return a * b if isinstance(a, Sym) else b * a  # type: ignore[operator]


def dim_div(a: Dim, b: Dim) -> Dim:
    """a / b where the caller knows b divides a; an opaque size if that cannot be shown."""
    if isinstance(a, int) and isinstance(b, int):
        if b == 0 or a % b:
            raise ShapeError(f"{a} is not divisible by {b}")
        return a // b
    if isinstance(a, int):
        return fresh_dim("q")
    q = a.exact_div(b)
    return fresh_dim("q") if q is None else q


def dim_add(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    if isinstance(a, Sym) and isinstance(b, Sym) and a.factors == b.factors:
        return _make(a.coeff + b.coeff, dict(a.factors))
    return fresh_dim("s")


def numel(shape: Sequence[Dim]) -> Dim:
    total: Dim = 1
    for d in shape:
        total = dim_mul(total, d)
    return total


def is_static(shape: Sequence[Dim]) -> bool:
    return all(isinstance(d, int) for d in shape)


def evaluate(value: object, bindings: Mapping[str, int]) -> object:
    """Replace every Sym inside value (a Sym, or nested lists/tuples of them) by its int."""
    if isinstance(value, Sym):
        return value.evaluate(bindings)
    if isinstance(value, (list, tuple)):
        return type(value)(evaluate(v, bindings) for v in value)
    return value


def contains_sym(value: object) -> bool:
    if isinstance(value, Sym):
        return True
    if isinstance(value, (list, tuple)):
        return any(contains_sym(v) for v in value)
    return False


class BoundDim(int):
    """The run-time value of a symbolic graph size (`sym`), for checking the graph's shape
    assumptions on concrete shapes (`tessera.graph.shape_check`).  It compares as its int; the
    difference is that broadcasting never stretches it, even when it is 1 (see broadcast_shapes)."""

    sym: Sym

    def __new__(cls, value: int, sym: Sym) -> BoundDim:
        obj = super().__new__(cls, value)
        obj.sym = sym
        return obj


def broadcast_shapes(*shapes: Sequence[Dim]) -> Shape:
    """numpy broadcasting over symbolic shapes, where only a literal 1 stretches.

    A symbolic size broadcast against a different size (a fixed size > 1, or another symbol)
    is *assumed equal* to it: against a fixed size it takes that size, against another symbol
    the first is kept.  The compiled kernels index it as the size it was assumed equal to, so
    the assumption is a contract that `tessera.graph.shape_check` enforces at run time: a
    symbolic size that turns out to be 1 there does not broadcast (numpy would stretch it);
    such inputs are refused with a ShapeError.  Give the graph a literal 1 where an axis
    broadcasts.  On concrete shapes holding `BoundDim`s, that refusal happens here.
    """
    rank = max((len(s) for s in shapes), default=0)
    out: list[Dim] = []
    for i in range(rank):
        dims = [s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0]
        result: Dim | None = None
        for d in dims:
            if d == result or (d == 1 and not isinstance(d, BoundDim)):
                continue
            if result is None or (result == 1 and not isinstance(result, BoundDim)):
                result = d
            elif isinstance(d, BoundDim) or isinstance(result, BoundDim):
                raise ShapeError(_bound_mismatch(result, d, i))
            elif isinstance(result, int) and isinstance(d, int):
                raise ShapeError(f"shapes {[tuple(s) for s in shapes]} do not broadcast (axis {i})")
            elif isinstance(result, Sym) and isinstance(d, int):
                result = d
        out.append(1 if result is None else result)
    return tuple(out)


def _bound_mismatch(a: int, b: int, axis: int) -> str:
    def name(d: int) -> str:
        return f"{d.sym}={int(d)}" if isinstance(d, BoundDim) else str(int(d))

    return (f"sizes {name(a)} and {name(b)} meet on broadcast axis {axis}, where the graph assumed them equal "
            f"(a symbolic size broadcasts only against an equal size or a literal 1, also when it is 1 at "
            f"run time); pass inputs with equal sizes there, or give the graph a literal 1 on the axis "
            f"that broadcasts")


def bind_shape(bindings: dict[str, int], shape: Sequence[Dim], actual: Sequence[int], what: str) -> None:
    """bind_shapes for one shape."""
    bind_shapes(bindings, [(shape, actual, what)])


def bind_shapes(bindings: dict[str, int], items: Iterable[tuple[Sequence[Dim], Sequence[int], str]]) -> None:
    """Bind the named sizes of (shape, actual shape, what) items and check every dimension exactly.

    Bare names (`batch`) are bound by their first occurrence in any item; then every compound
    dimension (`2*batch`, `batch*seq`) must equal its value.  A compound dimension with one
    unbound name binds it when the division is exact (`2*n` = 8 gives n = 4); one with more
    unbound names cannot be checked and is an error: pass those sizes in `bindings`."""
    items = [(tuple(shape), tuple(int(a) for a in actual), what) for shape, actual, what in items]
    pending: list[tuple[Sym, int, int, str]] = []
    for shape, actual, what in items:
        if len(shape) != len(actual):
            raise ShapeError(f"{what}: expected rank {len(shape)} {format_shape(shape)}, got shape {actual}")
        for axis, (d, a) in enumerate(zip(shape, actual)):
            if isinstance(d, Sym) and d.coeff == 1 and len(d.factors) == 1 and d.factors[0][1] == 1:
                name = d.factors[0][0]
                if bindings.setdefault(name, a) != a:
                    raise ShapeError(f"{what}: size {name!r} is {bindings[name]} elsewhere but {a} here (shape {actual})")
            elif isinstance(d, Sym):
                pending.append((d, a, axis, what))
            elif d != a:
                raise ShapeError(f"{what}: expected shape {format_shape(shape)}, got {actual}")
    while pending:
        solved = [p for p in pending if sum(n not in bindings for n in p[0].names) <= 1]
        if not solved:
            d, _, axis, what = pending[0]
            unbound = [n for n in d.names if n not in bindings]
            raise ShapeError(f"{what}: dimension {axis} is {d}, but the sizes {unbound} are bound by no input's shape; "
                             "pass their values")  # fmt: skip
        for item in solved:
            pending.remove(item)
            _check_compound(bindings, *item)


def _check_compound(bindings: dict[str, int], d: Sym, actual: int, axis: int, what: str) -> None:
    """Check `d` == actual, first binding its one unbound name (if any) from the equation."""
    unbound = [(n, p) for n, p in d.factors if n not in bindings]
    if unbound:
        (name, power), known = unbound[0], d.coeff
        for n, p in d.factors:
            if n != name:
                known *= bindings[n] ** p
        root = round(abs(actual / known) ** (1 / power)) if known else 0
        value = next((r for r in (root - 1, root, root + 1) if r >= 0 and known * r**power == actual), None)
        if value is None:
            raise ShapeError(f"{what}: dimension {axis} is {d}, which cannot be {actual} for any integer {name!r}")
        bindings[name] = value
    expected = d.evaluate(bindings)
    if expected != actual:
        raise ShapeError(f"{what}: dimension {axis} is {d} = {expected} for these sizes, but the array has {actual}")


def format_shape(shape: Sequence[Dim]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"
