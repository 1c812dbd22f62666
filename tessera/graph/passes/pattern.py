"""Graph rewrites as declared patterns: what a chain of operators looks like, and what replaces it.

A pattern describes the tensor an operator produces, from the root down:

    x = Bound("x")
    x * (1.0 + Op("erf", x / math.sqrt(2.0))) * 0.5      # mul(mul(x, add(1, erf(div(x, c)))), 0.5)

- `Op(kind, *args)`: a tensor computed by an operator of that kind (or one of a tuple of kinds)
  whose inputs match args, in either order for `add` and `mul`; `where` tests the operator.
  `name` binds the tensor it produces, so a second use of the name refers to the same tensor.
- `Bound(name)`: any tensor (`where` tests it), bound to the name; the same name binds the same
  tensor everywhere in one match.  `Bound()` matches anything and binds nothing.
- `Scalar(value)`: a one-element constant equal to value to a few units in the last place of the
  dtype its reader computes in (`exact=True`: equal).
- `any_of(*patterns)`: the first alternative that leads to a match, trying the next ones after.
- `+`, `*`, `/` between patterns and numbers build `add`, `mul` and true-division `div` patterns.

A `Rule` pairs a pattern with a builder that makes the replacing operator(s) from the `Match`
(or returns None to decline, and the search goes on).  `rewrite_with` applies rules to a graph.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.operator import Operator
from tessera.graph.passes._match import Uses, close_to, rewrite, scalar
from tessera.graph.tensor import Tensor

COMMUTATIVE = frozenset({"add", "mul"})


class _State(NamedTuple):
    """A partial match: the bindings so far and the operators matched, root first.  Never
    changed in place: alternatives that fail further down must not see each other's bindings."""

    vars: dict[str, Tensor]
    ops: tuple[Operator, ...]

    def bind(self, name: str | None, t: Tensor) -> _State | None:
        if name is None:
            return self
        have = self.vars.get(name)
        if have is not None:
            return self if have is t else None
        return _State({**self.vars, name: t}, self.ops)


class Pattern:
    """What a tensor must be; see the module docstring."""

    def match(self, t: Tensor, reader: Operator | None, s: _State) -> Iterator[_State]:
        """Every way t matches, extending s; reader is the operator reading t in the match."""
        raise NotImplementedError

    def root_kinds(self) -> frozenset[str] | None:
        """The operator kinds a match can be rooted at (None: any)."""
        return None

    def __add__(self, other: Pattern | float) -> Op:
        return Op("add", self, _lift(other))

    __radd__ = __add__

    def __mul__(self, other: Pattern | float) -> Op:
        return Op("mul", self, _lift(other))

    __rmul__ = __mul__

    def __truediv__(self, other: Pattern | float) -> Op:
        return Op("div", self, _lift(other), where=lambda op: op.attrs.get("rounding") is None)


def _lift(p: Pattern | float) -> Pattern:
    return p if isinstance(p, Pattern) else Scalar(float(p))


class Bound(Pattern):
    def __init__(self, name: str | None = None, where: Callable[[Tensor], bool] | None = None):
        self.name, self.where = name, where

    def match(self, t: Tensor, reader: Operator | None, s: _State) -> Iterator[_State]:
        bound = s.bind(self.name, t)
        if bound is not None and (self.where is None or self.where(t)):
            yield bound

    def __repr__(self) -> str:
        return f"Bound({self.name!r})"


class Scalar(Pattern):
    def __init__(self, value: float, exact: bool = False):
        self.value, self.exact = value, exact

    def match(self, t: Tensor, reader: Operator | None, s: _State) -> Iterator[_State]:
        v = scalar(t)
        # judged in the precision the reader computes in: a float16 chain's 0.5 is 0.5 to float16's ulp
        like = reader.outputs[0] if reader is not None and reader.outputs else t
        if (v == self.value) if self.exact else close_to(v, self.value, like):
            yield s

    def __repr__(self) -> str:
        return f"Scalar({self.value})"


class Op(Pattern):
    def __init__(self, kind: str | tuple[str, ...], *args: Pattern | float, name: str | None = None,
                 where: Callable[[Operator], bool] | None = None):  # fmt: skip
        self.kinds = frozenset((kind,) if isinstance(kind, str) else kind)
        self.args = tuple(_lift(a) for a in args)
        self.name, self.where = name, where
        self.commutative = len(self.args) == 2 and self.kinds <= COMMUTATIVE

    def match(self, t: Tensor, reader: Operator | None, s: _State) -> Iterator[_State]:
        op = t.producer
        if not isinstance(op, Operator) or op.kind not in self.kinds or len(op.inputs) != len(self.args):
            return
        if self.where is not None and not self.where(op):
            return
        bound = s.bind(self.name, t)
        if bound is None:
            return
        if op not in bound.ops:  # a sub-pattern written twice (a shared tensor) matches its op again
            bound = _State(bound.vars, bound.ops + (op,))
        yield from _match_all(self.args, op.inputs, op, bound)
        if self.commutative and op.inputs[0] is not op.inputs[1]:
            yield from _match_all(self.args[::-1], op.inputs, op, bound)

    def root_kinds(self) -> frozenset[str] | None:
        return self.kinds

    def named(self, name: str) -> Op:
        """This pattern, binding the tensor it matches to name."""
        p = copy.copy(self)
        p.name = name
        return p

    def __repr__(self) -> str:
        return f"Op({'|'.join(sorted(self.kinds))}, {', '.join(map(repr, self.args))})"


class AnyOf(Pattern):
    def __init__(self, *options: Pattern):
        self.options = options

    def match(self, t: Tensor, reader: Operator | None, s: _State) -> Iterator[_State]:
        for p in self.options:
            yield from p.match(t, reader, s)

    def root_kinds(self) -> frozenset[str] | None:
        kinds: set[str] = set()
        for p in self.options:
            k = p.root_kinds()
            if k is None:
                return None
            kinds |= k
        return frozenset(kinds)


def any_of(*options: Pattern) -> Pattern:
    """Alternatives, tried in order."""
    return options[0] if len(options) == 1 else AnyOf(*options)


def _match_all(pats: Sequence[Pattern], ts: Sequence[Tensor], reader: Operator, s: _State) -> Iterator[_State]:
    """Every way each pattern matches its tensor, bindings threaded left to right."""
    if not pats:
        yield s
        return
    for s1 in pats[0].match(ts[0], reader, s):
        yield from _match_all(pats[1:], ts[1:], reader, s1)


@dataclass(frozen=True)
class Match:
    """One match, as a rule's builder sees it: `m["x"]` is the tensor bound to x."""

    root: Operator
    ops: tuple[Operator, ...]  # every matched operator, root first
    vars: Mapping[str, Tensor]
    uses: Uses

    def __getitem__(self, name: str) -> Tensor:
        return self.vars[name]

    def get(self, name: str) -> Tensor | None:
        return self.vars.get(name)

    def op(self, name: str) -> Operator:
        """The operator that computes the tensor bound to name (a named Op)."""
        p = self.vars[name].producer
        if not isinstance(p, Operator):
            raise KeyError(f"{name!r} is bound to a tensor no operator computes")
        return p


Builder = Callable[[Match], Operator | Sequence[Operator] | None]


class Rule(NamedTuple):
    """A pattern and what replaces a match of it.  The replacement must produce the root's
    output tensors (the same objects: the rest of the graph reads them) and may read only
    tensors the match keeps (bound variables, not the intermediates it removes)."""

    pattern: Pattern
    build: Builder


def _internal(ops: tuple[Operator, ...], uses: Uses) -> bool:
    """Whether every tensor the non-root operators produce is read only inside the match and is
    no graph output: those tensors disappear with the rewrite."""
    inside = set(ops)
    return all(t not in uses.outputs and all(r in inside for r in uses.users.get(t, []))
               for op in ops[1:] for t in op.outputs)  # fmt: skip


def _first(rule: Rule, root: Operator, uses: Uses, taken: set[Operator]) -> tuple[Match, list[Operator]] | None:
    """The first match of rule at root that is free, self-contained and accepted by its builder."""
    for s in rule.pattern.match(root.outputs[0], None, _State({}, ())):
        if s.ops[:1] != (root,) or taken.intersection(s.ops) or not _internal(s.ops, uses):
            continue
        m = Match(root, s.ops, s.vars, uses)
        # building an Operator makes it its outputs' producer: undone if the match cannot go
        producers = {t: op for op in s.ops for t in op.outputs}
        built = rule.build(m)
        new = [] if built is None else [built] if isinstance(built, Operator) else list(built)
        gone = {t for op in s.ops[1:] for t in op.outputs}
        if not new or any(t in gone for op in new for t in op.inputs):  # declined, or reads an intermediate
            for t, op in producers.items():
                t.producer = op
            continue
        made = {t for op in new for t in op.outputs}
        if not all(t in made for t in root.outputs):
            raise ValueError(f"rule {rule.pattern!r}: the replacement of {root.name} does not produce its outputs")
        return m, new
    return None


def rewrite_with(graph: FlowGraph, rules: Sequence[Rule]) -> int:
    """Rewrite graph in place with rules; returns the number of matches replaced.

    Each operator is tried as a root, the last first, so that a longer chain (rooted further
    down) wins over a part of it; for one root the rules are tried in order.  Operators of one
    match belong to no other.
    """
    uses = Uses(graph)
    taken: set[Operator] = set()
    drop: list[Operator] = []
    new: list[Operator] = []
    count = 0
    kinds = [r.pattern.root_kinds() for r in rules]
    for op in reversed(graph.operators):
        if op in taken or not op.outputs:
            continue
        for rule, ks in zip(rules, kinds):
            if ks is not None and op.kind not in ks:
                continue
            found = _first(rule, op, uses, taken)
            if found is not None:
                taken.update(found[0].ops)
                drop += found[0].ops
                new += found[1]
                count += 1
                break
    if count:
        rewrite(graph, drop, new)
    return count
