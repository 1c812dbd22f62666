"""Checking fuzzed graphs: many specs packed into one compiled FlowGraph, every output compared
with the reference of its own component, failures attributed and minimized.

Packing.  Compiling is the bottleneck (each compile runs gcc), so a batch of specs becomes one
FlowGraph of disjoint components (inputs, symbols and operators prefixed `c<k>_`), compiled once
and called once per run with every component's inputs; each output is checked against its own
component's reference, so a mismatch names its graph.  Failures that belong to the whole batch
(the compiler raising, a group that fails to lower or build and falls back, a call raising) are
attributed by bisection: each half is checked again on its own.

Classification per graph:
- mismatch: an output whose shape, dtype or values differ from the reference beyond its tolerance;
- crash: compile_graph or the call raising, or a fused group that the compiler claimed it could
  lower but then failed to lower or build (logged fallback);
- reference_error: the graph's own reference raising (a generator or op-definition bug);
- refusal: an operator that `lowering_error` declines (it runs in its numpy reference; logged
  with the reason) -- counted by reason, not a failure.
"""

from __future__ import annotations

import logging
import re
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph

from .spec import GraphSpec, InputSpec, OpSpec, OutputSpec

_REFUSAL = re.compile(r"(\S+) \((\w+)\) runs in its numpy reference: (.*)")


@dataclass
class Failure:
    kind: str  # "mismatch", "crash", "reference_error"
    spec: GraphSpec
    detail: str
    together_with: list[GraphSpec] = field(default_factory=list)  # a failure only seen in this company

    def summary(self) -> str:
        return f"{self.kind} in graph {self.spec.key()}: {self.detail}"


@dataclass
class Result:
    graphs: int = 0
    failures: list[Failure] = field(default_factory=list)
    refusals: Counter = field(default_factory=Counter)  # "kind: reason" -> operators
    refused_graphs: int = 0  # graphs with at least one refused operator
    compiles: int = 0

    def merge(self, other: Result) -> Result:
        self.graphs += other.graphs
        self.failures += other.failures
        self.refusals.update(other.refusals)
        self.refused_graphs += other.refused_graphs
        self.compiles += other.compiles
        return self

    def count(self, kind: str) -> int:
        return sum(1 for f in self.failures if f.kind == kind)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def compare(got: Any, want: np.ndarray, out: OutputSpec) -> str | None:
    """Why got is not want within out.atol, or None."""
    got = np.asarray(got)
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"output {out.ref}: got {got.dtype}{list(got.shape)}, reference {want.dtype}{list(want.shape)}"
    if got.dtype.kind in "biu" or out.atol == 0:
        bad = ~((got == want) | (np.isnan(got) & np.isnan(want)) if got.dtype.kind == "f" else (got == want))
    else:
        g64, w64 = got.astype(np.float64), want.astype(np.float64)
        with np.errstate(invalid="ignore"):
            close = (np.abs(g64 - w64) <= out.atol) | (g64 == w64) | (np.isnan(g64) & np.isnan(w64))
        bad = ~close
    if not bad.any():
        return None
    idx = tuple(int(i) for i in np.argwhere(bad)[0])
    worst = ""
    if got.dtype.kind == "f":
        diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
        diff = np.where(np.isnan(diff), np.inf, diff)  # NaN on one side only
        worst = f", max |diff| {np.max(np.where(bad, diff, 0)):.4g} > atol {out.atol:.3g} ({out.why})"
    return (f"output {out.ref} ({got.dtype}{list(got.shape)}): {int(bad.sum())} of {bad.size} elements differ, "
            f"first at {list(idx)}: got {got[idx]!r}, reference {want[idx]!r}{worst}")  # fmt: skip


def _references(spec: GraphSpec, salt: int) -> list[list[np.ndarray]]:
    g = spec.graph()
    with np.errstate(all="ignore"):  # NaN inputs set numpy's "invalid" flag in some loops
        return [g.run(*spec.run_inputs(r, salt)) for r in range(len(spec.runs))]


def check_batch(specs: list[GraphSpec], salt: int = 0) -> Result:
    """Check specs packed into one compiled graph; failures attributed to their spec."""
    result = Result()
    refs: dict[int, list[list[np.ndarray]]] = {}
    packable: list[GraphSpec] = []
    for spec in specs:
        try:
            refs[id(spec)] = _references(spec, salt)
            packable.append(spec)
        except Exception as exc:  # noqa: BLE001  (the reference failing is itself the finding)
            result.graphs += 1
            result.failures.append(Failure("reference_error", spec, _exc_text(exc)))
    if not packable:
        return result
    outcome = _run_packed(packable, refs, salt)
    if isinstance(outcome, Result):
        return result.merge(outcome)
    # A batch-level failure: attribute it by checking halves on their own.
    if len(packable) == 1:
        result.graphs += 1
        result.compiles += 1
        result.failures.append(Failure("crash", packable[0], outcome))
        return result
    half = len(packable) // 2
    parts = [check_batch(packable[:half], salt), check_batch(packable[half:], salt)]
    for p in parts:
        result.merge(p)
    if not any(f.kind == "crash" for p in parts for f in p.failures):
        result.failures.append(Failure("crash", packable[0], f"only when packed together: {outcome}", packable[1:]))
    return result


def _run_packed(specs: list[GraphSpec], refs: dict[int, list[list[np.ndarray]]], salt: int) -> Result | str:
    """The Result of one packed compile, or the text of a batch-level failure."""
    b = GraphBuilder("fuzz_batch")
    outputs: list[tuple[GraphSpec, int, int]] = []  # (spec, output index, position in graph outputs)
    for k, spec in enumerate(specs):
        _, outs = spec.build(b, prefix=f"c{k}_")
        for j, t in enumerate(outs):
            outputs.append((spec, j, len(b.outputs)))
            b.output(t)
    graph = b.build()
    records = _Records()
    logger = logging.getLogger("tessera")
    logger.addHandler(records)
    try:
        compiled = compile_graph(graph, "cpu")
    except Exception as exc:  # noqa: BLE001
        return f"compile_graph raised {_exc_text(exc)}"
    finally:
        logger.removeHandler(records)
    guards = _Guards(compiled)
    result = Result(graphs=len(specs), compiles=1)
    refused: set[int] = set()
    for msg in records.messages:
        m = _REFUSAL.search(msg)
        if m and "its fused group did not build" not in msg:
            result.refusals[f"{m.group(2)}: {m.group(3)}"] += 1
            refused.add(int(m.group(1).split("_", 1)[0][1:]))
        elif "could not lower" in msg or "failed to build" in msg or "building the fused groups" in msg:
            return f"the compiler fell back: {msg}"
    result.refused_graphs = len(refused)
    bad: dict[int, str] = {}
    for r in range(max(len(s.runs) for s in specs)):
        arrays = [a for s in specs for a in s.run_inputs(r, salt)]
        originals = [a.copy() for a in arrays]
        try:
            got = compiled(*arrays)
        except Exception as exc:  # noqa: BLE001
            return f"run {r} raised {_exc_text(exc)}"
        broken = guards.broken()
        if broken:
            return f"run {r} wrote out of bounds: {broken}"
        if any(a.tobytes() != o.tobytes() for a, o in zip(arrays, originals)):
            return f"run {r} wrote into its inputs"
        for spec, j, pos in outputs:
            if id(spec) in bad:
                continue
            why = compare(got[pos], refs[id(spec)][r][j], spec.outputs[j])
            if why is not None:
                bad[id(spec)] = f"run {r} {spec.runs[r]}: {why}"
    for spec in specs:
        if id(spec) in bad:
            result.failures.append(Failure("mismatch", spec, bad[id(spec)]))
    return result


class _Guards:
    """Every buffer the compiled graph allocates (outputs, the arena of intermediates and
    temporaries) gets canary bytes on both sides, checked after each call: a kernel writing out
    of bounds is reported at once instead of corrupting the heap for a later crash."""

    PAD = 256

    def __init__(self, compiled: Any):
        self.raw: list[tuple[np.ndarray, str]] = []
        compiled._empty = self._empty
        compiled._alloc_arena = lambda nbytes: self._guarded(max(nbytes, 1), np.uint8, (max(nbytes, 1),), "the arena")

    def _empty(self, shape: tuple[int, ...], dt: Any) -> np.ndarray:
        from tessera.ir.dtypes import numpy_dtype

        npdt = numpy_dtype(dt)
        return self._guarded(int(np.prod(shape, dtype=np.int64)) * npdt.itemsize, npdt, shape, f"an output {dt.name}{list(shape)}")

    def _guarded(self, nbytes: int, npdt: Any, shape: tuple[int, ...], what: str) -> np.ndarray:
        raw = np.full(nbytes + 2 * self.PAD, 0xA5, np.uint8)
        self.raw.append((raw, what))
        return raw[self.PAD: self.PAD + nbytes].view(npdt).reshape(shape)

    def broken(self) -> str | None:
        for raw, what in self.raw:
            if (raw[: self.PAD] != 0xA5).any():
                return f"before {what}"
            if (raw[-self.PAD:] != 0xA5).any():
                return f"after {what}"
        return None


def _exc_text(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {tb[-1].filename.split('/tessera/')[-1]}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"


# ---- minimization ------------------------------------------------------------------------------------------------------
def fails(spec: GraphSpec, kind: str, salt: int = 0) -> bool:
    try:
        return any(f.kind == kind for f in check_batch([spec], salt).failures)
    except Exception:  # noqa: BLE001  (a broken candidate is not the failure we are after)
        return False


def _prune(spec: GraphSpec) -> GraphSpec:
    """Drop operators and inputs the outputs do not need."""
    need = {o.ref for o in spec.outputs}
    ops = []
    for o in reversed(spec.ops):
        if need & set(o.outputs):
            ops.append(o)
            need |= set(o.inputs)
    ops.reverse()
    inputs = [i for i in spec.inputs if i.name in need]
    return GraphSpec(spec.seed, spec.runs, inputs, ops, spec.outputs)


def _replace(spec: GraphSpec, ref: str, new: str, drop_op: int | None = None) -> GraphSpec:
    ops = [OpSpec(o.kind, [new if r == ref else r for r in o.inputs], o.attrs, o.outputs)
           for k, o in enumerate(spec.ops) if k != drop_op]  # fmt: skip
    outs = [OutputSpec(new if o.ref == ref else o.ref, o.atol, o.why) for o in spec.outputs]
    return _prune(GraphSpec(spec.seed, spec.runs, list(spec.inputs), ops, outs))


def _as_input(spec: GraphSpec, ref: str) -> GraphSpec | None:
    """spec with tensor `ref` (an operator output) made a graph input of its shape and dtype."""
    g = spec.graph()
    t = next((t for op in g.operators for t in op.outputs if op.name == _producer_name(spec, ref) and
              t is op.outputs[_out_index(spec, ref)]), None)  # fmt: skip
    if t is None:
        return None
    shape: list[Any] = []
    for d in t.shape:
        if isinstance(d, int):
            shape.append(d)
        elif d.name is not None and not d.name.startswith("_"):
            shape.append(d.name)
        else:
            return None
    dt = t.dtype.name
    domain = "bool" if dt == "bool" else "int" if dt.startswith("int") else "signed"
    taken = {i.name for i in spec.inputs}
    name = next(f"x{k}" for k in range(len(taken) + 1, 10**6) if f"x{k}" not in taken)
    cut = _replace(spec, ref, name)
    cut.inputs.append(InputSpec(name, shape, dt, domain))
    return _prune(cut)


def _producer_name(spec: GraphSpec, ref: str) -> str:
    return next(o.outputs[0] for o in spec.ops if ref in o.outputs)


def _out_index(spec: GraphSpec, ref: str) -> int:
    return next(o.outputs.index(ref) for o in spec.ops if ref in o.outputs)


def minimize(spec: GraphSpec, kind: str, salt: int = 0, budget: int = 60,
             checker: Any = None) -> GraphSpec:  # fmt: skip
    """A smaller spec that still fails the same way: one output, unneeded operators dropped,
    intermediate tensors turned into inputs, operators bypassed.  `checker(spec, kind)` says
    whether a candidate fails (default: `fails`, in this process)."""
    checker = checker or (lambda s, k: fails(s, k, salt))
    tries = 0

    def still(candidate: GraphSpec | None) -> bool:
        nonlocal tries
        if candidate is None or tries >= budget:
            return False
        tries += 1
        return checker(candidate, kind)

    for out in spec.outputs:
        one = _prune(GraphSpec(spec.seed, spec.runs, list(spec.inputs), list(spec.ops), [out]))
        if len(spec.outputs) > 1 and still(one):
            spec = one
            break
    changed = True
    while changed and tries < budget:
        changed = False
        for op in reversed(spec.ops):
            for ref in op.outputs:
                if any(ref in o.inputs for o in spec.ops) and still(cand := _as_input(spec, ref)):
                    spec, changed = cand, True
                    break
            if changed:
                break
            g = spec.graph()
            by_name = {o.name: o for o in g.operators}
            gop = by_name.get(op.outputs[0])
            if gop is None or len(op.outputs) != 1:
                continue
            for k, r in enumerate(op.inputs):
                src = gop.inputs[k]
                if src.shape == gop.outputs[0].shape and src.dtype == gop.outputs[0].dtype:
                    cand = _replace(spec, op.outputs[0], r, drop_op=spec.ops.index(op))
                    if still(cand):
                        spec, changed = cand, True
                        break
            if changed:
                break
    return spec
