"""A fuzzed graph as plain data: what the generator decided, rebuildable, packable and printable.

Tensors are named by refs: inputs by their names, operator outputs `t0, t1, ...`.  Shapes hold
ints and symbol names; attribute values that are symbolic sizes are {"sym": "2*n"}.  Constant
inputs take their values from the spec's seed, graph inputs from the seed, the run and a salt
(so every call sees fresh values).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tessera.graph import GraphBuilder, Sym, Tensor
from tessera.graph.symbolic import parse_dim
from tessera.ir.symbolic import substitute

# Value domains of inputs: (low, high, smallest magnitude) of the values drawn.  Never 0: a zero
# input hides indexing bugs (a wrong element is as likely to be 0) and divides by zero.
DOMAINS = {
    "signed": (-2.0, 2.0, 0.5),
    "positive": (0.5, 2.0, 0.5),
    "int": (-9, 9, 1),
    "int_positive": (1, 9, 1),
    "int_large": (-(2**40), 2**40, 2**33),  # int64 values no int32 holds
    "bool": (0, 1, 0),
    "signed_nan": (-2.0, 2.0, 0.5),  # "signed" with some NaNs
    "exp_small": (1, 3, 1),  # integer exponents
}
# Float inputs sometimes take exactly these values (rounding ties, integers) instead of random ones.
_SPECIAL = np.array([0.5, 1.0, 1.5, 2.0, 2.5 / 2, 0.75])


@dataclass
class InputSpec:
    name: str
    shape: list[Any]  # ints and symbol names
    dtype: str
    domain: str  # a DOMAINS key, or "index:<size>" (integers in [-size, size) for that size)
    constant: bool = False


@dataclass
class OpSpec:
    kind: str
    inputs: list[str]
    attrs: dict[str, Any]
    outputs: list[str]


@dataclass
class OutputSpec:
    ref: str
    atol: float  # |compiled - reference| allowed; 0 means bit-exact (integers, bools, exact float chains)
    why: str = ""  # how the tolerance was derived (the generator's error bound), for reports


@dataclass
class GraphSpec:
    seed: int
    runs: list[dict[str, int]]  # symbol values of each call
    inputs: list[InputSpec] = field(default_factory=list)
    ops: list[OpSpec] = field(default_factory=list)
    outputs: list[OutputSpec] = field(default_factory=list)

    # ---- serialization ---------------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @staticmethod
    def from_json(text: str | dict) -> GraphSpec:
        d = json.loads(text) if isinstance(text, str) else text
        return GraphSpec(
            d["seed"], [dict(r) for r in d["runs"]], [InputSpec(**i) for i in d["inputs"]],
            [OpSpec(**o) for o in d["ops"]], [OutputSpec(**o) for o in d["outputs"]],
        )  # fmt: skip

    def key(self) -> str:
        return f"{zlib.crc32(self.to_json().encode()):08x}"

    # ---- building ----------------------------------------------------------------------------------------------------
    def build(self, b: GraphBuilder, prefix: str = "") -> tuple[list[Tensor], list[Tensor]]:
        """Add this graph to b with every input and symbol name prefixed; returns the graph inputs
        (constants excluded) and the outputs, in spec order."""
        env: dict[str, Tensor] = {}
        graph_inputs = []
        for i in self.inputs:
            if i.constant:
                env[i.name] = b.constant(constant_value(self, i), prefix + i.name)
            else:
                env[i.name] = b.input(prefix + i.name, [rename(d, prefix) for d in i.shape], i.dtype)
                graph_inputs.append(env[i.name])
        for o in self.ops:
            attrs = {k: decode_attr(v, prefix) for k, v in o.attrs.items()}
            outs = b.op_multi(o.kind, *[env[r] for r in o.inputs], name=f"{prefix}{o.outputs[0]}", **attrs)
            env.update(zip(o.outputs, outs))
        return graph_inputs, [env[o.ref] for o in self.outputs]

    def graph(self, name: str = "fuzz") -> Any:
        b = GraphBuilder(name)
        _, outs = self.build(b)
        b.output(*outs)
        return b.build()

    def run_inputs(self, run: int, salt: int = 0) -> list[np.ndarray]:
        """Fresh arrays for the graph inputs of run `run` (constants excluded)."""
        rng = np.random.default_rng([self.seed, run, salt])
        out = []
        for i in self.inputs:
            if not i.constant:
                shape = tuple(evaluate_dim(d, self.runs[run]) for d in i.shape)
                out.append(draw_values(rng, i, shape, self.runs[run]))
        return out


def constant_value(spec: GraphSpec, i: InputSpec) -> np.ndarray:
    rng = np.random.default_rng([spec.seed, zlib.crc32(i.name.encode())])
    return draw_values(rng, i, tuple(int(d) for d in i.shape), {})


def draw_values(rng: np.random.Generator, i: InputSpec, shape: tuple[int, ...], bindings: dict[str, int]) -> np.ndarray:
    dt = np.dtype(i.dtype)
    if i.domain.startswith("index:"):
        n = evaluate_dim(i.domain[len("index:"):], bindings)
        return rng.integers(-n, n, shape).astype(dt)
    if i.domain == "bool":
        return rng.random(shape) < 0.5
    lo, hi, small = DOMAINS[i.domain]
    if dt.kind in "iu":
        values = rng.integers(small, hi + 1, shape)
        if lo < 0:
            values = values * rng.choice([-1, 1], shape)
        return values.astype(dt)
    mag = rng.uniform(small, hi, shape)
    special = rng.random(shape) < 0.1
    mag = np.where(special, rng.choice(_SPECIAL, shape), mag)
    if lo < 0:
        mag = mag * rng.choice([-1.0, 1.0], shape)
    if i.domain == "signed_nan":
        mag = np.where(rng.random(shape) < 0.15, np.nan, mag)
    return mag.astype(dt)


def evaluate_dim(d: Any, bindings: dict[str, int]) -> int:
    if isinstance(d, int):
        return d
    v = parse_dim(str(d))
    return v if isinstance(v, int) else v.evaluate(bindings)


def rename(d: Any, prefix: str) -> Any:
    """A shape entry with its symbol names prefixed (ints unchanged)."""
    if isinstance(d, int) or not prefix:
        return d
    v = parse_dim(str(d))
    if isinstance(v, int):
        return v
    renamed = substitute(v, {n: Sym.var(prefix + n) for n in v.names})
    return str(renamed)


def encode_attr(v: Any) -> Any:
    if isinstance(v, Sym):
        return {"sym": str(v)}
    if isinstance(v, (list, tuple)):
        return [encode_attr(x) for x in v]
    return v


def decode_attr(v: Any, prefix: str = "") -> Any:
    if isinstance(v, dict) and set(v) == {"sym"}:
        return parse_dim(rename(v["sym"], prefix))
    if isinstance(v, list):
        return [decode_attr(x, prefix) for x in v]
    return v


def python_source(spec: GraphSpec, failing_run: int | None = None) -> str:
    """A standalone script that builds the graph explicitly, compiles it and compares every
    run with the reference (what a regression test is made from)."""
    lines = [
        '"""Reproducer written by tests/fuzz (graph fuzzer): compiled vs reference."""',
        "import numpy as np",
        "from tessera.graph import GraphBuilder, Sym",
        "from tessera.graph.compiler import compile_graph",
        "from tessera.graph.symbolic import parse_dim",
        "",
        "nan, inf = float('nan'), float('inf')",
        "b = GraphBuilder('repro')",
    ]
    for i in spec.inputs:
        if i.constant:
            value = constant_value(spec, i)
            lines.append(f"{i.name} = b.constant(np.array({value.tolist()!r}, dtype=np.{i.dtype}))")
        else:
            lines.append(f"{i.name} = b.input({i.name!r}, {i.shape!r}, {i.dtype!r})")
    for o in spec.ops:
        args = [repr(o.kind), *o.inputs] + [f"{k}={_attr_source(v)}" for k, v in o.attrs.items()]
        call = f"b.op_multi({', '.join(args)})"
        lines.append(f"{', '.join(o.outputs)}, = {call}")
    lines.append(f"b.output({', '.join(o.ref for o in spec.outputs)})")
    lines += ["g = b.build()", "compiled = compile_graph(b.build(verify=False), 'cpu')", ""]
    runs = range(len(spec.runs)) if failing_run is None else [failing_run]
    atols = [o.atol for o in spec.outputs]
    for r in runs:
        arrays = spec.run_inputs(r)
        names = [i.name for i in spec.inputs if not i.constant]
        lines.append(f"# run {r}: {spec.runs[r]}")
        for n, a in zip(names, arrays):
            lines.append(f"{n}_v = np.array({a.tolist()!r}, dtype=np.{a.dtype})")
        args = ", ".join(f"{n}_v" for n in names)
        lines += [
            f"got, want = compiled({args}), g.run({args})",
            f"for k, (x, y, atol) in enumerate(zip(got, want, {atols!r})):",
            "    assert x.shape == y.shape and x.dtype == y.dtype, (k, x.shape, y.shape, x.dtype, y.dtype)",
            "    x64, y64 = x.astype(np.float64), y.astype(np.float64)",
            "    bad = ~((np.abs(x64 - y64) <= atol) | (x64 == y64) | (np.isnan(x64) & np.isnan(y64)))",
            "    assert not bad.any(), (k, x[bad][:5], y[bad][:5])",
            "",
        ]
    lines.append("print('ok')")
    return "\n".join(lines) + "\n"


def _attr_source(v: Any) -> str:
    if isinstance(v, dict) and set(v) == {"sym"}:
        return f"parse_dim({v['sym']!r})"
    if isinstance(v, list):
        return "[" + ", ".join(_attr_source(x) for x in v) + "]"
    return repr(v)
