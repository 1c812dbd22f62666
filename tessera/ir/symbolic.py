"""Symbolic sizes: integer expressions over named sizes, in one canonical form.

This is tessera's one algebra of sizes.  The graph's shapes, shape inference and memory plans,
the ops library's broadcasting and shape checks, the front ends (ONNX dim_params, torch's
SymInts) and the kernels' index arithmetic all use it.

A size (`Dim`) is a Python int or a `Sym`: a polynomial with integer coefficients whose
variables ("atoms") are named sizes (`batch`), floor divisions `x // y`, and `min`/`max` of
sizes.  `x % y` is `x - y * (x // y)`.  Every operation returns the canonical form:

- polynomials are expanded and their terms sorted, so `(a + b) * 2 == 2*a + 2*b` and both hash
  equal; a result without symbols is a plain int;
- a floor division by a constant moves the divisible part out (`(4*a + b + 5) // 4` is
  `a + 1 + (b + 1) // 4`), reduces by common factors and merges nested divisions
  (`a // 2 // 3` is `a // 6`); one by a symbolic size divides exactly where the polynomial
  allows (`(a*b + a) // a` is `b + 1`);
- `min`/`max` flatten, drop duplicates and the arguments whose difference to another has
  a known sign (`max(n, n + 1)` is `n + 1`, `min(1, n)` is `1`: named sizes are sizes of
  non-empty tensors, at least 1), and fold constants.

Equal canonical forms mean equal values for every binding; different forms may still be equal
for all bindings (`(2*a) // 2` is `a`, but nothing decides `min(a, b) + max(a, b) == a + b`).
Where tessera cannot prove two sizes equal, the graph *assumes* they are where a broadcast or a
contraction needs it and checks at run time (`tessera.graph.shape_check`).

`evaluate_dim` gives a size's value for bound names; `solve` binds the one unknown name of a size
from an input's actual dimension.  `tessera.ir.shapes` converts sizes to and from the int32 IR
expressions the kernels index with and holds the broadcasting rule everyone uses.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Union

from tessera.errors import ShapeError

# A monomial: sorted ((atom, power), ...); a polynomial: sorted ((monomial, coeff), ...).
Mono = tuple[tuple["Atom", int], ...]
Terms = tuple[tuple[Mono, int], ...]


# ---- atoms --------------------------------------------------------------------------------------------------------
class Atom:
    """A variable of the polynomials: a name, a floor division or a min/max.  Compared by `key`."""

    __slots__ = ("key", "_hash")

    def __init__(self, key: tuple) -> None:
        self.key = key
        self._hash = hash(key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Atom) and self.key == other.key

    def __hash__(self) -> int:
        return self._hash

    def __lt__(self, other: Atom) -> bool:
        return self.key < other.key


class Name(Atom):
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__((0, name))


class FloorDiv(Atom):
    """num // den (Python's floor division), num and den canonical, not both constant."""

    __slots__ = ("num", "den")

    def __init__(self, num: Dim, den: Dim) -> None:
        self.num, self.den = num, den
        super().__init__((1, dim_key(num), dim_key(den)))


class MinMax(Atom):
    """min or max of two or more canonical sizes, sorted, at most one of them constant."""

    __slots__ = ("kind", "args")

    def __init__(self, kind: str, args: tuple[Dim, ...]) -> None:
        self.kind, self.args = kind, args
        super().__init__((2, kind, tuple(dim_key(a) for a in args)))


def dim_key(d: Dim) -> tuple:
    """A sort key over sizes that never compares an int with a tuple."""
    if isinstance(d, int):
        return (0, d)
    return (1, tuple((tuple((a.key, p) for a, p in m), c) for m, c in d.terms))


# ---- the size type -------------------------------------------------------------------------------------------------
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*$")


class Sym:
    """A symbolic size in canonical form (see the module docstring); immutable and hashable.

    Build one with `Sym.var("batch")` or `parse_dim("2*a + b")` and combine with `+ - * // %`,
    `sym_min`, `sym_max`; ints mix freely.  A result without symbols is an int."""

    __slots__ = ("terms", "_hash")

    def __init__(self, terms: Terms) -> None:
        self.terms = terms
        self._hash = hash(terms)

    @staticmethod
    def var(name: str) -> Sym:
        if not isinstance(name, str) or not _NAME.match(name) or name in ("min", "max"):
            raise ValueError(f"invalid symbolic size name {name!r}: use letters, digits, '_' and '.', "
                             "not starting with a digit")  # fmt: skip
        return _atom(Name(name))

    # ---- structure ----
    @property
    def names(self) -> tuple[str, ...]:
        """The named sizes this size depends on, sorted."""
        return tuple(sorted(free_names(self)))

    @property
    def name(self) -> str | None:
        """The name when this size is exactly one named size (`batch`), else None."""
        if len(self.terms) == 1:
            mono, c = self.terms[0]
            if c == 1 and len(mono) == 1 and mono[0][1] == 1 and isinstance(mono[0][0], Name):
                return mono[0][0].name
        return None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sym) and self.terms == other.terms

    def __hash__(self) -> int:
        return self._hash

    # ---- arithmetic ----
    def __add__(self, other: Dim) -> Dim:
        return _add(_terms(self), _terms(check_dim(other)))

    __radd__ = __add__

    def __sub__(self, other: Dim) -> Dim:
        return _add(_terms(self), _scale(_terms(check_dim(other)), -1))

    def __rsub__(self, other: Dim) -> Dim:
        return _add(_terms(check_dim(other)), _scale(_terms(self), -1))

    def __neg__(self) -> Dim:
        return _build(dict(_scale(_terms(self), -1)))

    def __mul__(self, other: Dim) -> Dim:
        return _mul(_terms(self), _terms(check_dim(other)))

    __rmul__ = __mul__

    def __floordiv__(self, other: Dim) -> Dim:
        return floordiv(self, check_dim(other))

    def __rfloordiv__(self, other: Dim) -> Dim:
        return floordiv(check_dim(other), self)

    def __mod__(self, other: Dim) -> Dim:
        return mod(self, check_dim(other))

    def __rmod__(self, other: Dim) -> Dim:
        return mod(check_dim(other), self)

    def exact_div(self, other: Dim) -> Dim | None:
        """self / other when that is a polynomial with integer coefficients, else None."""
        return exact_div(self, other)

    def evaluate(self, bindings: Mapping[str, int]) -> int:
        return evaluate_dim(self, bindings)

    def __str__(self) -> str:
        return dim_str(self)

    def __repr__(self) -> str:
        return f"Sym({dim_str(self)!r})"


Dim = Union[int, Sym]
Shape = tuple[Dim, ...]


def check_dim(d: Any) -> Dim:
    if isinstance(d, Sym):
        return d
    if isinstance(d, bool) or not hasattr(d, "__index__"):
        raise TypeError(f"a size must be an int or a Sym, not {d!r}")
    return int(d)


def _terms(d: Dim) -> Terms:
    if isinstance(d, Sym):
        return d.terms
    return (((), int(d)),) if d else ()


def _build(acc: dict[Mono, int]) -> Dim:
    items = [(m, c) for m, c in acc.items() if c]
    if not items:
        return 0
    if len(items) == 1 and items[0][0] == ():
        return items[0][1]
    items.sort(key=lambda t: tuple((a.key, p) for a, p in t[0]))
    return Sym(tuple(items))


def _add(a: Terms, b: Terms) -> Dim:
    acc: dict[Mono, int] = dict(a)
    for m, c in b:
        acc[m] = acc.get(m, 0) + c
    return _build(acc)


def _scale(a: Terms, k: int) -> Terms:
    return tuple((m, c * k) for m, c in a)


def _mono_mul(x: Mono, y: Mono) -> Mono:
    powers = dict(x)
    for a, p in y:
        powers[a] = powers.get(a, 0) + p
    return tuple(sorted(powers.items()))


def _mul(a: Terms, b: Terms) -> Dim:
    acc: dict[Mono, int] = {}
    for (ma, ca), (mb, cb) in itertools.product(a, b):
        m = _mono_mul(ma, mb)
        acc[m] = acc.get(m, 0) + ca * cb
    return _build(acc)


def _atom(a: Atom) -> Sym:
    return Sym(((((a, 1),), 1),))


def _single_atom(d: Dim) -> Atom | None:
    """The atom when d is exactly one atom (coefficient 1, power 1), else None."""
    if isinstance(d, Sym) and len(d.terms) == 1:
        mono, c = d.terms[0]
        if c == 1 and len(mono) == 1 and mono[0][1] == 1:
            return mono[0][0]
    return None


# ---- division, modulo, min and max -----------------------------------------------------------------------------------
def floordiv(a: Dim, b: Dim) -> Dim:
    """a // b with Python's floor semantics, canonical; a zero divisor is a ShapeError."""
    a, b = check_dim(a), check_dim(b)
    if isinstance(b, int):
        if b == 0:
            raise ShapeError(f"size {a} divided by zero")
        if isinstance(a, int):
            return a // b
        if b < 0:
            a, b = -a, -b
        if b == 1:
            return a
        quotient = _build({m: c // b for m, c in a.terms})
        rest = _build({m: c % b for m, c in a.terms})
        if isinstance(rest, int):  # 0 <= rest < b
            return quotient
        g = math.gcd(b, *(c for _, c in rest.terms))
        if g > 1:  # floor(g*r / g*b') == floor(r / b')
            rest, b = _build({m: c // g for m, c in rest.terms}), b // g
            if b == 1:
                return quotient + rest
        inner = _single_atom(rest)
        if isinstance(inner, FloorDiv) and isinstance(inner.den, int) and inner.den > 0:
            return quotient + floordiv(inner.num, inner.den * b)  # (x // k) // b == x // (k*b)
        return quotient + _atom(FloorDiv(rest, b))
    if a == 0:
        return 0
    q = exact_div(a, b)
    if q is not None:
        return q
    return _atom(FloorDiv(a, b))


def mod(a: Dim, b: Dim) -> Dim:
    """a % b with Python's semantics (the sign of b), as a - b * (a // b)."""
    return check_dim(a) - check_dim(b) * floordiv(a, b)


def exact_div(a: Dim, b: Dim) -> Dim | None:
    """a / b when it is a polynomial with integer coefficients (b a nonzero int or a one-term
    polynomial, or a itself a multiple of b), else None."""
    a, b = check_dim(a), check_dim(b)
    if isinstance(b, int):
        if b == 0 or any(c % b for _, c in _terms(a)):
            return None
        return _build({m: c // b for m, c in _terms(a)})
    if a == b:
        return 1
    if len(b.terms) != 1:
        return None
    (mb, cb), acc = b.terms[0], {}
    for m, c in _terms(a):
        powers = dict(m)
        for atom, p in mb:
            if powers.get(atom, 0) < p:
                return None
            powers[atom] -= p
        if c % cb:
            return None
        acc[tuple(sorted((x, p) for x, p in powers.items() if p))] = c // cb
    return _build(acc)


def sym_min(*args: Dim) -> Dim:
    """The minimum of sizes, canonical."""
    return minmax("min", args)


def sym_max(*args: Dim) -> Dim:
    """The maximum of sizes, canonical."""
    return minmax("max", args)


def minmax(kind: str, args: Iterable[Dim]) -> Dim:
    flat: list[Dim] = []
    for x in map(check_dim, args):
        inner = _single_atom(x)
        flat.extend(inner.args if isinstance(inner, MinMax) and inner.kind == kind else [x])
    if not flat:
        raise ShapeError(f"{kind}() of no sizes")
    # An argument whose difference to another has a known sign is decided: the dominated one goes.
    # Each new argument is compared with every kept one (min(2, a, 0) -> 0 for names >= 1), so the
    # result does not depend on the order the arguments come in.
    kept: list[Dim] = []
    for x in flat:
        survivors: list[Dim] = []
        x_dominated = False
        for y in kept:
            x_ge_y, y_ge_x = nonneg(x - y), nonneg(y - x)
            if x_dominated or not (x_ge_y or y_ge_x):
                survivors.append(y)
            elif (x_ge_y if kind == "min" else y_ge_x):
                x_dominated = True  # y is at least as good as x (equal ones: the kept one stays)
                survivors.append(y)
            # else y is dominated by x: dropped
        kept = survivors if x_dominated else [*survivors, x]
    if len(kept) == 1:
        return kept[0]
    return _atom(MinMax(kind, tuple(sorted(kept, key=dim_key))))


@functools.lru_cache(maxsize=4096)
def nonneg(d: Dim) -> bool:
    """Whether d >= 0 for every value of its names, which are sizes of non-empty tensors (>= 1;
    tessera's kernels refuse empty tensors, and run-time shape checks catch a size of 0).

    A sufficient test: with every name n written as 1 + m (m >= 0), the polynomial has
    non-negative coefficients over non-negative atoms."""
    if isinstance(d, int):
        return d >= 0
    return _nonneg0(_shift_names(d)) or any(nonneg(lower) for lower in _minmax_lower_bounds(d))


def _minmax_lower_bounds(d: Sym) -> list[Dim]:
    """Sizes at most d: a max that enters d only through terms c * max(..) * F with c > 0 and
    F >= 0 (a min: c < 0) replaced by each of its arguments, as max(2, c) - c >= c - c."""
    out = []
    atoms = {a for mono, _ in d.terms for a, _ in mono if isinstance(a, MinMax)}
    for m in sorted(atoms, key=lambda a: a.key):
        sign = 1 if m.kind == "max" else -1
        if all(c * sign > 0 and dict(mono)[m] == 1 and all(a == m or nonneg(_atom(a)) for a, _ in mono)
               for mono, c in d.terms if any(a == m for a, _ in mono)):  # fmt: skip
            out += [_map_atoms(d, lambda a, x=x, m=m: x if a == m else _atom(a)) for x in m.args]
    return out


def _shift_names(d: Dim) -> Dim:
    """d with every name n written as n + 1, its floor divisions and min/max kept as they stand.
    (substitute would simplify them again assuming names >= 1, that is the old names >= 2:
    max(2, c) became c + 1, and nonneg held both for c % b - max(2, c) % b and its negation.)"""
    if isinstance(d, int):
        return d

    def atom(a: Atom) -> Dim:
        if isinstance(a, Name):
            return Sym.var(a.name) + 1
        if isinstance(a, FloorDiv):
            num, den = _shift_names(a.num), _shift_names(a.den)
            return num // den if isinstance(num, int) and isinstance(den, int) else _atom(FloorDiv(num, den))
        assert isinstance(a, MinMax)
        args = [_shift_names(x) for x in a.args]
        constants = [x for x in args if isinstance(x, int)]
        args = [x for x in args if not isinstance(x, int)] + ([(max if a.kind == "max" else min)(constants)] if constants else [])
        return args[0] if len(args) == 1 else _atom(MinMax(a.kind, tuple(sorted(args, key=dim_key))))

    return _map_atoms(d, atom)


def _nonneg0(d: Dim) -> bool:
    """d >= 0 for names >= 0 (the shifted names of `nonneg`)."""
    if isinstance(d, int):
        return d >= 0
    return all(c >= 0 and all(_atom_nonneg0(a) for a, _ in mono) for mono, c in d.terms)


def _atom_nonneg0(a: Atom) -> bool:
    if isinstance(a, Name):
        return True
    if isinstance(a, FloorDiv):
        return _nonneg0(a.num) and _nonneg0(a.den)
    assert isinstance(a, MinMax)
    return (all if a.kind == "min" else any)(_nonneg0(x) for x in a.args)


# ---- evaluation, substitution, names -------------------------------------------------------------------------------
def _map_atoms(d: Dim, f: Callable[[Atom], Dim]) -> Dim:
    """Rebuild d with each atom replaced by f(atom), through the canonicalising operations."""
    if isinstance(d, int):
        return d
    total: Dim = 0
    for mono, c in d.terms:
        term: Dim = c
        for atom, p in mono:
            v = f(atom)
            for _ in range(p):
                term = term * v
        total = total + term
    return total


def substitute(d: Dim, bindings: Mapping[str, Dim]) -> Dim:
    """d with the bound names replaced by their sizes (ints or Syms), simplified."""

    def atom(a: Atom) -> Dim:
        if isinstance(a, Name):
            return check_dim(bindings[a.name]) if a.name in bindings else _atom(a)
        if isinstance(a, FloorDiv):
            return floordiv(substitute(a.num, bindings), substitute(a.den, bindings))
        assert isinstance(a, MinMax)
        return minmax(a.kind, [substitute(x, bindings) for x in a.args])

    return check_dim(d) if isinstance(d, int) else _map_atoms(d, atom)


def evaluate_dim(d: Dim, bindings: Mapping[str, int]) -> int:
    """The value of d for the bound names; a ShapeError names any size that is not bound."""
    value = substitute(d, bindings)
    if isinstance(value, Sym):
        raise ShapeError(f"symbolic size(s) {list(value.names)} of {d} are not bound by any input shape")
    return value


def free_names(d: Dim) -> set[str]:
    out: set[str] = set()
    if isinstance(d, Sym):
        for mono, _ in d.terms:
            for a, _ in mono:
                if isinstance(a, Name):
                    out.add(a.name)
                elif isinstance(a, FloorDiv):
                    out |= free_names(a.num) | free_names(a.den)
                else:
                    for x in a.args:  # type: ignore[attr-defined]
                        out |= free_names(x)
    return out


def solve(d: Dim, actual: int, bindings: Mapping[str, int]) -> tuple[str, int] | None:
    """Bind the one name of d that `bindings` lacks so that d == actual.

    Solved where the unknown appears polynomially (outside divisions and min/max) and the
    equation has one non-negative integer root: linear (`past + seq`, `2*n`) or one term
    (`c * n^p`).  Returns (name, value); None when d has no unknown or cannot be solved this
    way; a ShapeError when no integer value fits."""
    unknown = free_names(d) - set(bindings)
    if len(unknown) != 1:
        return None
    (name,) = unknown
    rest = substitute(d, bindings)
    if isinstance(rest, int):
        return None
    target = Name(name)
    degree, coeff, const = 0, 0, 0
    for mono, c in rest.terms:
        powers = dict(mono)
        others = [a for a in powers if a != target]
        if others:
            return None  # the unknown is inside a division or min/max, or multiplied by one
        p = powers.get(target, 0)
        if p == 0:
            const += c
        elif degree and p != degree:
            return None
        else:
            degree, coeff = p, c
    value = _root(actual - const, coeff, degree)
    if value is None:
        raise ShapeError(f"the size {d} cannot be {actual} for any integer {name!r} (sizes are >= 0)")
    return name, value


def _root(y: int, coeff: int, power: int) -> int | None:
    """The non-negative integer n with coeff * n**power == y, if any."""
    if y % coeff:
        return None
    x = y // coeff
    if x < 0:
        return None
    r = round(x ** (1 / power))
    return next((n for n in (r - 1, r, r + 1) if n >= 0 and n**power == x), None)


# ---- text -----------------------------------------------------------------------------------------------------------
def dim_str(d: Dim) -> str:
    """A readable form that `parse_dim` reads back: `2*a + b`, `(a + 1)//2`, `min(a, 8)`, `n^2`."""
    if isinstance(d, int):
        return str(d)
    parts: list[str] = []
    for mono, c in sorted(d.terms, key=lambda t: (t[0] == (), tuple((a.key, p) for a, p in t[0]))):
        factors = [_atom_str(a) + (f"^{p}" if p != 1 else "") for a, p in mono]
        mag = abs(c)
        text = "*".join(([str(mag)] if mag != 1 or not factors else []) + factors)
        parts.append(("-" if c < 0 else "+") + text)
    out = " ".join(p[0] + " " + p[1:] for p in parts)
    return out[2:] if out.startswith("+ ") else "-" + out[2:]


def _atom_str(a: Atom) -> str:
    if isinstance(a, Name):
        return a.name
    if isinstance(a, FloorDiv):
        return f"({_group(a.num)}//{_group(a.den)})"
    assert isinstance(a, MinMax)
    return f"{a.kind}({', '.join(dim_str(x) for x in a.args)})"


def _group(d: Dim) -> str:
    text = dim_str(d)
    return text if _single_atom(d) is not None or isinstance(d, int) and d >= 0 else f"({text})"


_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_.]*)|(//|[-+*%^(),]))")


def parse_dim(text: str) -> Dim:
    """Read a size written as `dim_str` writes it (also "batch", "4*batch*seq", "seq^2", "7")."""
    tokens: list[str] = []
    pos, text = 0, str(text)
    while pos < len(text.rstrip()):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"cannot read the size {text!r} (at {text[pos:]!r})")
        tokens.append(m.group(m.lastindex or 0))
        pos = m.end()
    parser = _Parser(tokens, text)
    out = parser.sum()
    if parser.i != len(tokens):
        raise ValueError(f"cannot read the size {text!r} (unexpected {tokens[parser.i]!r})")
    return out


class _Parser:
    def __init__(self, tokens: list[str], text: str) -> None:
        self.tokens, self.text, self.i = tokens, text, 0

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise ValueError(f"cannot read the size {self.text!r} (expected {expected or 'more'})")
        self.i += 1
        return tok

    def sum(self) -> Dim:
        out = self.product()
        while self.peek() in ("+", "-"):
            op = self.take()
            rhs = self.product()
            out = out + rhs if op == "+" else out - rhs
        return out

    def product(self) -> Dim:
        out = self.signed()
        while self.peek() in ("*", "//", "%"):
            op = self.take()
            rhs = self.signed()
            out = out * rhs if op == "*" else floordiv(out, rhs) if op == "//" else mod(out, rhs)
        return out

    def signed(self) -> Dim:
        """A minus binds looser than ^, as in Python: -a^2 is -(a^2), the form dim_str writes."""
        if self.peek() == "-":
            self.take()
            return -self.signed()
        return self.power()

    def power(self) -> Dim:
        base = self.atom()
        if self.peek() == "^":
            self.take()
            exp = int(self.take())
            out: Dim = 1
            for _ in range(exp):
                out = out * base
            return out
        return base

    def atom(self) -> Dim:
        tok = self.take()
        if tok.isdigit():
            return int(tok)
        if tok == "(":
            out = self.sum()
            self.take(")")
            return out
        if tok in ("min", "max") and self.peek() == "(":
            self.take("(")
            args = [self.sum()]
            while self.peek() == ",":
                self.take()
                args.append(self.sum())
            self.take(")")
            return minmax(tok, args)
        return Sym.var(tok)
