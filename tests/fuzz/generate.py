"""The hypothesis strategy `graph_specs()`: random graphs that are valid, finite and comparable.

The generator builds the graph as it draws (GraphBuilder shape inference decides what is
valid), and tracks for every tensor:

- its shape in each run (the op's own inference on run-time shapes, `infer_run_time`, so a
  graph never breaks its shape assumptions at run time; empty tensors are avoided);
- an interval [lo, hi] holding its values and a lower bound `small` of |value|, so that
  log/sqrt see positive values, divisors stay away from 0, exp and products never overflow
  (float16 included) and integers never overflow;
- `err`, a bound on |compiled - reference| (first-order error analysis): each op adds its own
  rounding (`EPS` of the dtype it rounds to, times the result's magnitude, times the op's ulp
  count) to its inputs' errors scaled by its Lipschitz constant over the interval.  `err == 0`
  means both sides must agree bit for bit (inputs, data movement, max/min, casts, integer
  arithmetic); discontinuous ops (comparisons, floor/round/sign, float-to-int casts, argmax,
  remainder) only take such exact operands, so a rounding difference never flips them.

An output's tolerance is twice its bound (`TOL_FACTOR`): the bound is first-order and per-op
worst cases are not additive in practice, so a real bug (a wrong element, index or dtype) is
off by the values' own magnitude, far above it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import strategies as st

from tessera.errors import TesseraError
from tessera.graph import GraphBuilder, Operator, ShapeError, Sym, Tensor
from tessera.graph.shape_check import infer_run_time
from tessera.graph.symbolic import parse_dim

from .spec import DOMAINS, GraphSpec, InputSpec, OpSpec, OutputSpec, encode_attr, evaluate_dim

EPS = {"float32": 2.0**-23, "float16": 2.0**-10, "float64": 2.0**-52}
TOL_FACTOR = 2.0
MAX_NUMEL = 2048
_FMAX = {"float32": 1e30, "float16": 3e4, "float64": 1e100}
_IMAX = {"int8": 100, "uint8": 200, "int16": 30000, "int32": 2**30, "int64": 2**60, "bool": 1}
_UNSIGNED = ("uint8", "bool")
BIG = 2**62  # "to the end" in slice bounds


def _erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _softplus(x):
    return np.logaddexp(0, x)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


# name -> (float64 function, domain test on (lo, hi, small), ulps of the op's own rounding)
UNARY_FLOAT = {
    "exp": (np.exp, lambda lo, hi, s: hi <= 9, 4), "log": (np.log, lambda lo, hi, s: lo >= 0.05, 4),
    "sqrt": (np.sqrt, lambda lo, hi, s: lo >= 0.05, 2), "rsqrt": (lambda x: 1 / np.sqrt(x), lambda lo, hi, s: lo >= 0.05, 4),
    "sin": (np.sin, lambda lo, hi, s: max(-lo, hi) <= 50, 4), "cos": (np.cos, lambda lo, hi, s: max(-lo, hi) <= 50, 4),
    "tan": (np.tan, lambda lo, hi, s: max(-lo, hi) <= 1.2, 4), "tanh": (np.tanh, None, 4),
    "sigmoid": (lambda x: 1 / (1 + np.exp(-x)), None, 4), "silu": (lambda x: x / (1 + np.exp(-x)), None, 4),
    "erf": (_erf, None, 4), "softplus": (_softplus, None, 4),
    "log1p": (np.log1p, lambda lo, hi, s: lo >= -0.9, 4), "expm1": (np.expm1, lambda lo, hi, s: hi <= 9, 4),
    "mish": (lambda x: x * np.tanh(_softplus(x)), None, 6),
    "hardsigmoid": (lambda x: np.clip(x / 6 + 0.5, 0, 1), None, 2),
    "hardswish": (lambda x: x * np.clip(x / 6 + 0.5, 0, 1), None, 3),
}  # fmt: skip
ARITH = ("add", "sub", "mul", "div", "maximum", "minimum", "pow", "remainder", "bitwise_and", "bitwise_or")
COMPARE = ("eq", "ne", "lt", "le", "gt", "ge")
LOGICAL = ("logical_and", "logical_or", "logical_xor")
REDUCE = ("reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_prod")


@dataclass
class TInfo:
    """What the generator knows of one tensor."""

    ref: str
    tensor: Tensor
    shapes: list[tuple[int, ...]]  # per run
    lo: float
    hi: float
    small: float  # lower bound of |value| (0: may be 0)
    err: float  # bound of |compiled - reference|; 0: bit-exact
    nan: bool = False  # may hold NaNs (the interval is that of the other values)

    @property
    def dtype(self) -> str:
        return self.tensor.dtype.name

    @property
    def mag(self) -> float:
        return max(abs(self.lo), abs(self.hi))

    @property
    def is_float(self) -> bool:
        return self.dtype in EPS

    @property
    def exact(self) -> bool:
        return self.err == 0.0

    def max_dim(self, axis: int) -> int:
        return max(s[axis] for s in self.shapes)


Values = tuple  # (lo, hi, small, err)


def _eps(dtype: str) -> float:
    return EPS.get(dtype, 0.0)


def _in_range(dtype: str, lo: float, hi: float) -> bool:
    m = max(abs(lo), abs(hi))
    if not math.isfinite(m) or (dtype in _UNSIGNED and lo < 0):
        return False
    return m <= _FMAX[dtype] if dtype in _FMAX else m <= _IMAX[dtype]


def _convert_err(err: float, mag: float, src: str, dst: str) -> float:
    """Error after converting values to dst: exact values convert identically on both sides."""
    if err == 0.0:
        return 0.0
    return err + (_eps(dst) * mag if _eps(dst) > _eps(src) else 0.0)


def _grid(fn, lo: float, hi: float) -> tuple[float, float, float, float]:
    """(min, max, min |f|, Lipschitz bound) of fn over [lo, hi], from a fine grid with margins."""
    xs = np.linspace(lo, hi, 1025) if hi > lo else np.array([lo])
    with np.errstate(all="ignore"):
        ys = fn(xs.astype(np.float64))
    if not np.all(np.isfinite(ys)):
        return math.nan, math.nan, 0.0, math.inf
    slope = float(np.max(np.abs(np.diff(ys) / np.diff(xs)))) if len(xs) > 1 else 1.0
    span = float(ys.max() - ys.min())
    small = 0.0 if ys.min() <= 0 <= ys.max() else 0.9 * float(np.min(np.abs(ys)))
    return float(ys.min()) - 1e-3 * span, float(ys.max()) + 1e-3 * span, small, 1.5 * slope + 1e-6


class Gen:
    """One graph being generated: hypothesis draws, the builder, the spec and the tensor pool."""

    def __init__(self, draw: Any, seed: int, runs: list[dict[str, int]], symbols: list[str]):
        self.draw, self.runs, self.symbols = draw, runs, symbols
        self.b = GraphBuilder("gen")
        self.spec = GraphSpec(seed, runs)
        self.pool: list[TInfo] = []
        self.count = 0

    @property
    def bound_symbols(self) -> list[str]:
        """Symbols that some graph input's shape carries (others could not be bound at run time)."""
        return [s for s in self.symbols if any(s in i.shape for i in self.spec.inputs if not i.constant)]

    # ---- draws -------------------------------------------------------------------------------------------------
    def int(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def pick(self, seq: Any) -> Any:
        return self.draw(st.sampled_from(list(seq)))

    def chance(self, percent: int) -> bool:
        # Hypothesis' simplest draw (0) means "no": its degenerate examples stay plain.
        return self.int(0, 99) >= 100 - percent

    def operand(self, pred=lambda t: True) -> TInfo | None:
        """A pool tensor satisfying pred, most recent first."""
        cands = [t for t in reversed(self.pool) if pred(t)]
        return self.pick(cands) if cands else None

    # ---- tensors -----------------------------------------------------------------------------------------------
    def new_input(self, shape: list[Any], dtype: str, domain: str, constant: bool = False) -> TInfo | None:
        if constant and not all(isinstance(d, int) for d in shape):
            constant = False
        shapes = [tuple(evaluate_dim(d, r) for d in shape) for r in self.runs]
        if any(0 in s or int(np.prod(s)) > MAX_NUMEL for s in shapes):
            return None
        name = f"{'c' if constant else 'x'}{len(self.spec.inputs)}"
        spec = InputSpec(name, list(shape), dtype, domain, constant)
        if constant:
            from .spec import constant_value

            t = self.b.constant(constant_value(self.spec, spec), name)
        else:
            t = self.b.input(name, shape, dtype)
        self.spec.inputs.append(spec)
        if domain.startswith("index:"):
            n = max(evaluate_dim(domain[6:], r) for r in self.runs)
            lo, hi, small = -n, n - 1, 0
        else:
            lo, hi, small = DOMAINS[domain]
            if dtype == "bool":
                lo, hi, small = 0, 1, 0
        info = TInfo(name, t, shapes, float(lo), float(hi), float(small), 0.0, domain == "signed_nan")
        self.pool.append(info)
        return info

    def random_shape(self, rank: int) -> list[Any]:
        dims: list[Any] = []
        for _ in range(rank):
            if self.symbols and self.chance(35):
                dims.append(self.pick(self.symbols))
            else:
                # Mostly small; sometimes long enough for vectorized loops and their remainders.
                dims.append(self.pick([3, 1, 2, 4, 5, 6]) if not self.chance(15) else self.pick([8, 9, 16, 17, 33]))
        return dims

    def input_dtype(self, kinds: str = "fib") -> str:
        weights = {"float32": 10, "float16": 4, "float64": 1, "int32": 4, "int64": 2, "int8": 1, "uint8": 1,
                   "int16": 1, "bool": 2}  # fmt: skip
        kind = {"float32": "f", "float16": "f", "float64": "f", "bool": "b"}
        return self.pick([d for d, w in weights.items() if kind.get(d, "i") in kinds for _ in range(w)])

    def domain(self, dtype: str, sign: str = "any") -> str:
        """The value domain of a fresh input of dtype: sign "positive" or "any"."""
        if dtype == "bool":
            return "bool"
        if dtype in EPS:
            return "positive" if sign == "positive" else "signed_nan" if self.chance(10) else "signed"
        if dtype in _UNSIGNED or sign == "positive":
            return "int_positive"
        return "int_large" if dtype == "int64" and self.chance(15) else "int"

    def fresh(self, shape: list[Any], dtype: str, domain: str | None = None) -> TInfo | None:
        if domain is None:
            domain = self.domain(dtype)
        constant = all(isinstance(d, int) for d in shape) and self.chance(25)
        return self.new_input(shape, dtype, domain, constant)

    def apply(self, kind: str, inputs: list[TInfo], attrs: dict[str, Any], values: Any) -> list[TInfo] | None:
        """Add the operator if it is valid at graph level and in every run; `values(outs)` gives
        each output's (lo, hi, small, err) from the output tensors and run shapes, or None to
        reject it (out of a domain or a range)."""
        try:
            op = Operator.create(kind, [t.tensor for t in inputs], attrs)
        except (ShapeError, TesseraError, ValueError, TypeError):
            return None
        per_run = []
        for r, run in enumerate(self.runs):
            try:
                per_run.append(infer_run_time(op, [t.shapes[r] for t in inputs], run))
            except (ShapeError, ValueError, TypeError):
                return None
        outs: list[TInfo] = []
        for k, t in enumerate(op.outputs):
            shapes = [s[k] for s in per_run]
            if any(0 in s or int(np.prod(s)) > MAX_NUMEL for s in shapes):
                return None
            outs.append(TInfo(f"t{self.count + k}", t, shapes, 0.0, 0.0, 0.0, 0.0))
        for o in outs:
            v = values(o)
            if v is None:
                return None
            o.lo, o.hi, o.small, o.err = (float(x) for x in v)
            o.nan = o.is_float and any(t.nan for t in inputs)
            if not _in_range(o.dtype, o.lo, o.hi) or not math.isfinite(o.err):
                return None
            if not o.is_float and o.err:
                return None  # an integer result of inexact values could differ by one
        self.b.operators.append(op)
        self.count += len(outs)
        self.spec.ops.append(OpSpec(kind, [t.ref for t in inputs], {k: encode_attr(v) for k, v in attrs.items()},
                                    [o.ref for o in outs]))  # fmt: skip
        self.pool.extend(outs)
        return outs

    # ---- partners for binary operators ---------------------------------------------------------------------------
    def partner_shape(self, a: TInfo) -> list[Any]:
        """A shape that broadcasts with a's: the same, trailing dims of it with some set to 1,
        a scalar, or more leading dims."""
        dims = [d if isinstance(d, int) else d.name if d.name is not None and not d.name.startswith("_") else 1
                for d in a.tensor.shape]  # fmt: skip
        how = self.int(0, 4)
        if how == 0 or not dims:
            return dims if how == 0 else []
        if how == 1:
            return []
        if how == 2:
            return [1 if self.chance(40) else d for d in dims[self.int(0, len(dims) - 1):]]
        if how == 3:
            return [self.pick([2, 1, 3])] + dims
        return [1 if self.chance(30) else d for d in dims]

    def binary_partner(self, a: TInfo, dtype: str, domain: str | None) -> TInfo | None:
        if self.chance(30):
            cands = [t for t in reversed(self.pool) if t is not a and t.dtype == dtype
                     and (domain is None or _fits(t, domain))]  # fmt: skip
            if cands:
                return self.pick(cands[:6])
        return self.fresh(self.partner_shape(a), dtype, domain)


def _fits(t: TInfo, domain: str) -> bool:
    lo, hi, small = DOMAINS[domain]
    return t.lo >= lo and t.hi <= hi and t.small >= small and t.exact and (domain == "signed_nan" or not t.nan)


# ---- value rules ---------------------------------------------------------------------------------------------------------
def _round(dtype: str, mag: float, ulps: float = 1.0) -> float:
    """The rounding a result may differ by: the op's own error (in float32, or float64 for a
    float64 result), plus one unit of a float16 result (both sides compute in float32 and round,
    and may round to neighbours)."""
    e = ulps * EPS["float64" if dtype == "float64" else "float32"] * mag
    return e + (EPS["float16"] * mag if dtype == "float16" else 0.0)


def unary_values(kind: str, a: TInfo, out: TInfo, attrs: dict[str, Any]) -> Values | None:
    if kind == "reciprocal":
        if a.small < 0.05:
            return None
        m = 1 / a.small
        lo, hi = (-m, m) if a.lo < 0 < a.hi else sorted((1 / a.lo, 1 / a.hi))
        return lo, hi, 1 / a.mag, a.err / a.small**2 + _round(out.dtype, m, 2)
    if kind == "gelu":
        fn = _gelu_tanh if attrs["approximate"] == "tanh" else (lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))))
        dom, ulps = None, 6
    elif kind == "leaky_relu":
        s = attrs["negative_slope"]
        fn, dom, ulps = (lambda x: np.where(x >= 0, x, x * s)), None, 1
    elif kind == "elu":
        al = attrs["alpha"]
        fn, dom, ulps = (lambda x: np.where(x > 0, x, al * np.expm1(np.minimum(x, 0)))), None, 4
    else:
        fn, dom, ulps = UNARY_FLOAT[kind]
    if dom is not None and not dom(a.lo, a.hi, a.small):
        return None
    lo, hi, small, lip = _grid(fn, a.lo, a.hi)
    if not math.isfinite(lo):
        return None
    err = lip * _convert_err(a.err, a.mag, a.dtype, out.dtype) + _round(out.dtype, max(abs(lo), abs(hi)), ulps)
    return lo, hi, small, err


def arith_values(kind: str, a: TInfo, b: TInfo, out: TInfo, rounding: str | None = None) -> Values | None:
    dt = out.dtype
    ea, eb = _convert_err(a.err, a.mag, a.dtype, dt), _convert_err(b.err, b.mag, b.dtype, dt)
    if kind in ("add", "sub"):
        lo, hi = (a.lo + b.lo, a.hi + b.hi) if kind == "add" else (a.lo - b.hi, a.hi - b.lo)
        return lo, hi, 0.0, ea + eb + _round(dt, max(abs(lo), abs(hi))) if out.is_float else 0.0
    if kind == "mul":
        corners = [a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi]
        m = max(abs(c) for c in corners)
        err = b.mag * ea + a.mag * eb + ea * eb + _round(dt, m) if out.is_float else 0.0
        return min(corners), max(corners), a.small * b.small, err
    if kind in ("maximum", "minimum"):
        f = max if kind == "maximum" else min
        return f(a.lo, b.lo), f(a.hi, b.hi), 0.0, max(ea, eb)
    if kind == "div":
        if b.small <= 0 or (not out.is_float and b.small < 1):
            return None
        m = a.mag / b.small
        if rounding is None:
            err = ea / b.small + a.mag * eb / b.small**2 + _round(dt, m, 2) if out.is_float else 0.0
            return -m, m, 0.0, err
        if out.is_float and (a.err or b.err):
            return None  # floor/trunc of an inexact quotient could step
        return -m - 1, m + 1, 0.0, 0.0
    if kind == "pow":
        if not out.is_float or a.lo < 0.2 or max(abs(b.lo), abs(b.hi)) > 3:
            return None
        corners = [x**y for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
        m = max(corners)
        d_base = max(abs(y) * x ** (y - 1) for x in (a.lo, a.hi) for y in (b.lo, b.hi))
        d_exp = max(abs(math.log(x)) for x in (a.lo, a.hi)) * m
        return min(corners), m, min(corners), d_base * ea + d_exp * eb + _round(dt, m, 4)
    if kind == "remainder":
        if b.small <= 0 or a.err or b.err or (not out.is_float and b.small < 1):
            return None
        if out.is_float:
            return None if b.small < 0.5 else (-b.mag, b.mag, 0.0, 0.0)
        return -b.mag, b.mag, 0.0, 0.0
    if kind in ("bitwise_and", "bitwise_or"):
        if out.is_float:
            return None
        top = 2 ** math.ceil(math.log2(max(a.mag, b.mag) + 1))
        return (-top, top, 0.0, 0.0) if dt != "bool" else (0, 1, 0, 0)
    raise AssertionError(kind)


def reduce_values(kind: str, a: TInfo, out: TInfo, n: int) -> Values | None:
    dt = out.dtype
    ea = _convert_err(a.err, a.mag, a.dtype, dt if out.is_float else a.dtype)
    acc = EPS["float32"] if a.dtype == "float16" else _eps(a.dtype)  # float16 sums in float32
    if kind in ("reduce_max", "reduce_min"):
        return a.lo, a.hi, a.small, ea
    if kind == "reduce_sum" or kind == "cumsum":
        lo, hi = n * min(a.lo, 0.0), n * max(a.hi, 0.0)
        if kind == "cumsum":
            lo, hi = min(lo, a.lo), max(hi, a.hi)
        err = n * ea + 2 * n * n * acc * a.mag + _round(dt, max(abs(lo), abs(hi))) if out.is_float else 0.0
        return lo, hi, 0.0, err
    if kind == "reduce_mean":
        err = ea + 2 * n * acc * a.mag + _round(dt, a.mag, 2)
        return a.lo, a.hi, 0.0, err
    if kind == "reduce_prod":
        if a.mag > 2 or n > 6:
            return None
        m = a.mag**n
        err = n * a.mag ** (n - 1) * ea + 2 * n * acc * m + _round(dt, m) if out.is_float else 0.0
        return -m, m, a.small**n, err
    raise AssertionError(kind)


@st.composite
def graph_specs(draw: Any, max_ops: int = 10) -> GraphSpec:
    """One random graph: 1-3 inputs, up to max_ops operators, 1-3 outputs, 3 runs."""
    from .actions import ACTION_CHOICES, ACTIONS

    seed = draw(st.integers(0, 2**31 - 1))
    symbols = ["n", "m"][: draw(st.integers(0, 2))]
    sizes = st.one_of(st.integers(2, 5), st.sampled_from([7, 16, 19]))
    first = {s: draw(sizes) for s in symbols}
    second = {s: (1 if draw(st.booleans()) else draw(sizes)) for s in symbols}
    gen = Gen(draw, seed, [first, second, dict(first)], symbols)
    for _ in range(gen.int(1, 2)):
        for _attempt in range(4):
            shape = gen.random_shape(gen.pick([2, 1, 3, 0, 4]))
            dtype = gen.input_dtype()
            if gen.fresh(shape, dtype, gen.domain(dtype, gen.pick(["any", "positive"]))) is not None:
                break
    target = gen.int(min(2, max_ops), max_ops)
    attempts = 0
    while gen.count < target and attempts < 6 * max_ops:
        attempts += 1
        name = gen.pick(ACTION_CHOICES)
        ACTIONS[name](gen)
    produced = [t for t in gen.pool if t.tensor.producer is not None]
    if not produced:
        produced = list(gen.pool)
    chosen = []
    for _ in range(gen.int(1, 3)):
        # Now and then a graph input (or constant) is an output itself, or one tensor is output twice.
        t = gen.pick(list(reversed(produced))) if not gen.chance(5) else gen.pick(gen.pool)
        if t not in chosen or gen.chance(10):
            chosen.append(t)
    for t in chosen:
        atol = TOL_FACTOR * t.err
        gen.spec.outputs.append(OutputSpec(t.ref, atol, f"{t.dtype} error bound {t.err:.3g}, values in [{t.lo:.3g}, {t.hi:.3g}]"))
    return gen.spec


def sym_name(d: Any) -> str | None:
    """The symbol name of a bare symbolic dim that inputs can carry (not opaque), else None."""
    if isinstance(d, Sym) and d.name is not None and d.name[0] != "_":
        return d.name
    return None


def as_attr_dim(d: Any) -> Any:
    """A graph dim usable in an attribute (reshape/expand targets): ints, or Syms over input symbols."""
    if isinstance(d, int):
        return d
    if any(n.startswith("_") for n in d.names):
        return None
    return parse_dim(str(d))
