"""The ONNX importer: one ONNX graph walked node by node into a FlowGraph.

- Opsets: models older than opset 13 are converted on import with `onnx.version_converter`;
  rules read both the attribute and the input forms that later opsets moved things to, up to
  the newest opset the installed onnx knows.
- Values known at import time are folded as they are built: an operator whose inputs are all
  constants runs its numpy reference at once (shape arithmetic on static shapes -- Neg, Mod,
  And/Or/Not, Squeeze, Range, Concat... -- ends as constants).  Shape values with symbolic
  sizes travel as `Known` (exporters compute dynamic shapes with Shape -> Gather -> Concat ->
  Reshape), so a Reshape to (batch*seq, hidden) becomes an attribute, not a runtime tensor.
- A value that must be known (a Reshape's shape, Reduce axes, Tile repeats...) but comes from
  graph inputs raises `ShapeInputError` naming those inputs; one computed from symbolic sizes
  in ways `Known` does not follow raises `SymbolicValueError`.  `tessera.onnx.compile` catches
  them and specialises the compiled graph on those inputs' values, or on the input shapes
  (see specialize.py).
- An op without a rule, or with an attribute its rule does not handle, is imported from its
  ONNX function definition when the schema has one (functions.py); otherwise the importer
  raises `UnsupportedError` naming the op, the node, the attribute and the opset.
"""

from __future__ import annotations

import logging
from collections import ChainMap
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import ArgumentError, FileFormatError, UnsupportedError
from tessera.graph import FlowGraph, Operator, Tensor
from tessera.graph.registry import get_op
from tessera.graph.symbolic import Dim, ShapeError, Sym, contains_sym, fresh_dim
from tessera.ir import dtypes
from tessera.ir.dtypes import numpy_dtype

log = logging.getLogger("tessera")

# ONNX element type -> tessera dtype name, as the rules read attributes ("to", "dtype"): a view of
# the one table, tessera.ir.dtypes.ONNX_ELEMENT_TYPES.
ONNX_DTYPES = {code: dt.name for code, dt in dtypes.ONNX_ELEMENT_TYPES.items()}
MIN_NATIVE_OPSET = 13  # older models are converted to this opset on import
# Folding at import time is bounded like the constant-folding pass: a broadcast of a few bytes
# to megabytes stays an operator.
MAX_FOLD_BYTES = 1 << 22


class ShapeInputError(UnsupportedError):
    """A value the importer must know (a shape, axes, repeats...) depends on graph inputs.

    `inputs` names those ONNX graph inputs; `tessera.onnx.compile` specialises on their values."""

    def __init__(self, message: str, inputs: list[str]):
        super().__init__(message)
        self.inputs = inputs


class SymbolicValueError(UnsupportedError):
    """A value the importer must know is computed from symbolic sizes in a way `Known` values
    do not follow (static_ints of a symbolic size, a Mod of sizes...).  `tessera.onnx.compile`
    specialises on the input shapes then (the sizes become numbers and everything folds)."""


class Known:
    """An integer tensor of rank 0 or 1 whose entries are known at import time, some symbolic."""

    def __init__(self, values: list[Dim], scalar: bool = False):
        self.values, self.scalar = list(values), scalar

    @property
    def is_static(self) -> bool:
        return all(isinstance(v, int) for v in self.values)


Rule = Callable[["Importer", Any, list, dict], Any]


class RuleSpec:
    """A rule and the node attributes it understands (any other attribute is refused by name)."""

    def __init__(self, fn: Rule, attrs: frozenset[str] | None):
        self.fn, self.attrs = fn, attrs


RULES: dict[str, RuleSpec] = {}
ALL_ATTRS = None  # a rule that reads every attribute its op defines


def rule(*op_types: str, attrs: Iterable[str] | None = ()) -> Callable[[Rule], Rule]:
    """Register fn as the rule of op_types; `attrs` lists the attributes it handles (None: all)."""

    def deco(fn: Rule) -> Rule:
        for t in op_types:
            RULES[t] = RuleSpec(fn, None if attrs is None else frozenset(attrs))
        return fn

    return deco


# How a node is imported from its ONNX function body where no rule takes it (functions.py sets it
# when imported, as the rule modules fill RULES; tessera.frontend.onnx imports them all): True
# when imported, False when the op's schema defines no body.
_FUNCTION_EXPANDER: list[Callable[[Importer, Any, int], bool]] = []


def function_expander(fn: Callable[[Importer, Any, int], bool]) -> Callable[[Importer, Any, int], bool]:
    """Register fn(importer, node, opset) as the importer of ops from their function bodies."""
    _FUNCTION_EXPANDER[:] = [fn]
    return fn


def expand_function(im: Importer, node: Any, opset: int) -> bool:
    """Import node from its ONNX function body; False when its schema defines none."""
    return any(expand(im, node, opset) for expand in _FUNCTION_EXPANDER)


class Importer:
    """Walks one ONNX graph; rules call `op`, `tensor`, `ints` and `const_array`."""

    def __init__(self, model: Any, input_values: dict[str, np.ndarray] | None = None,
                 input_shapes: dict[str, tuple[int, ...]] | None = None):  # fmt: skip
        import onnx
        from onnx import numpy_helper

        self.onnx, self.numpy_helper = onnx, numpy_helper
        self.model = model
        self.opset = default_opset(model)
        self.input_values = dict(input_values or {})
        self.input_shapes = dict(input_shapes or {})  # concrete shapes that replace the declared ones
        self.values: ChainMap[str, Any] = ChainMap({"": None})  # a scope per subgraph being imported
        self.operators: list[Operator] = []
        self.inputs: list[Tensor] = []
        self.input_names: dict[Tensor, str] = {}  # graph input tensor -> its ONNX name
        self.node: Any = None  # the node being imported, for messages
        self.node_opset = self.opset  # the opset of that node (a function body may use a newer one)
        self._fresh = 0

    # ---- helpers for rules --------------------------------------------------------------------------------------
    def op(self, kind: str, *inputs: Any, **attrs: Any) -> Tensor:
        return self.op_multi(kind, *inputs, **attrs)[0]

    def op_multi(self, kind: str, *inputs: Any, **attrs: Any) -> list[Tensor]:
        """Add a graph operator; when every input is a constant, its reference runs now instead."""
        ts = [self.tensor(t) for t in inputs]
        o = Operator.create(kind, ts, attrs)
        if o.outputs and all(t.is_static and 0 in t.shape for t in o.outputs):  # nothing to compute
            return [Tensor.constant(np.empty(t.shape, numpy_dtype(t.dtype))) for t in o.outputs]
        if all(t.is_constant for t in ts) and not contains_sym(list(o.attrs.values())) and \
                all(t.is_static for t in o.outputs):  # fmt: skip
            out_bytes = sum(int(np.prod(t.shape)) * t.dtype.nbytes for t in o.outputs)
            if out_bytes <= max(MAX_FOLD_BYTES, 4 * sum(t.data.nbytes for t in ts)):
                return self._fold(o)
        self.operators.append(o)
        return o.outputs

    def _fold(self, o: Operator) -> list[Tensor]:
        opdef = get_op(o.kind)
        with np.errstate(all="ignore"):  # integer overflow / division by zero: the reference's semantics
            results = opdef.reference([t.data for t in o.inputs], o.attrs)
        out = []
        for t, r in zip(o.outputs, results):
            r = np.asarray(r).astype(numpy_dtype(t.dtype), copy=False)
            if r.shape != t.shape:
                raise ShapeError(f"{o.kind}: folded to shape {r.shape}, inferred {t.shape}")
            out.append(Tensor.constant(r))
        return out

    def tensor(self, value: Any) -> Tensor:
        if isinstance(value, Tensor):
            return value
        if isinstance(value, Known):
            if value.is_static:
                return Tensor.constant(np.array(value.values[0] if value.scalar else value.values, np.int64))
            if value.scalar:
                return self.op("full", shape=[], value=value.values[0], dtype="int64")
            parts = [self.op("full", shape=[1], value=v, dtype="int64") for v in value.values]
            return self.op("concat", *parts, axis=0) if len(parts) > 1 else parts[0]
        if value is None:
            raise UnsupportedError("a required input is missing")
        raise UnsupportedError(f"expected a tensor, got {type(value).__name__}")

    def known(self, value: Any) -> Known | None:
        """value as a Known when it is one, or an integer constant of rank 0 or 1."""
        if isinstance(value, Known):
            return value
        if isinstance(value, Tensor) and value.is_constant and value.ndim <= 1 and \
                (value.dtype.is_integer or value.dtype.is_bool) and value.data.size <= 1 << 16:  # fmt: skip
            return Known([int(v) for v in value.data.reshape(-1)], scalar=value.ndim == 0)
        return None

    def ints(self, value: Any, what: str) -> list[Dim]:
        """The entries of a shape-like value (maybe symbolic sizes); ShapeInputError if they
        come from graph inputs, UnsupportedError if they are not known at all."""
        k = self.known(value)
        if k is None:
            self.need_value(value, what)
        return list(k.values)

    def static_ints(self, value: Any, what: str) -> list[int]:
        vals = self.ints(value, what)
        if not all(isinstance(v, int) for v in vals):
            raise SymbolicValueError(f"{what} {vals} has symbolic entries; it must be static (tessera.onnx.compile "
                                     "specialises on the input shapes for that)")  # fmt: skip
        return [int(v) for v in vals]

    def const_array(self, value: Any, what: str) -> np.ndarray:
        """The value of an input that must be a constant (any dtype and rank)."""
        if isinstance(value, Tensor) and value.is_constant:
            return value.data
        k = self.known(value)
        if k is not None and k.is_static:
            return np.array(k.values[0] if k.scalar else k.values, np.int64)
        self.need_value(value, what)
        raise AssertionError("unreachable")

    def need_value(self, value: Any, what: str) -> None:
        """Raise the error for a value that must be known at import time and is not."""
        deps = self.input_dependencies(value) if isinstance(value, Tensor) else []
        if deps:
            raise ShapeInputError(f"{what} depends on graph input(s) {deps}, whose values tessera.onnx.load does "
                                  "not know; tessera.onnx.compile specialises the compiled graph on them (or pass "
                                  "input_values= to tessera.onnx.load)", deps)  # fmt: skip
        if any(not t.is_static for t in self.inputs):
            raise SymbolicValueError(f"{what} is computed from symbolic sizes in a way tessera cannot follow; "
                                     "tessera.onnx.compile specialises on the input shapes for that")  # fmt: skip
        raise UnsupportedError(f"{what} must be known at import time (a constant or a shape computation)")

    def input_dependencies(self, t: Tensor) -> list[str]:
        """The ONNX names of the graph inputs t is computed from."""
        seen, stack, found = set(), [t], []
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            if x in self.input_names:
                found.append(self.input_names[x])
            elif x.producer is not None:
                stack.extend(x.producer.inputs)
        return sorted(found)

    def scalar(self, v: float | int | bool, like: Tensor) -> Tensor:
        """A rank-0 constant of like's dtype."""
        return Tensor.constant(np.asarray(v).astype(numpy_dtype(like.dtype)))

    def fresh_name(self, hint: str) -> str:
        self._fresh += 1
        return f"{hint}__{self._fresh}"

    # ---- the walk -----------------------------------------------------------------------------------------------
    def run(self) -> FlowGraph:
        g = self.model.graph
        for init in g.initializer:
            self.values[init.name] = Tensor.constant(self.numpy_helper.to_array(init), name=_clean(init.name))
        for vi in g.input:
            if vi.name in self.values:
                continue
            self.values[vi.name] = self._graph_input(vi)
        unused = set(self.input_values) - {vi.name for vi in g.input}
        if unused:
            raise ArgumentError(f"input_values names {sorted(unused)}, which are not inputs of the model")
        self.import_nodes(g.node, self.opset)
        outputs = [self.tensor(self._value(o.name, "a graph output")) for o in g.output]
        return FlowGraph(self.inputs, outputs, self.operators, _clean(g.name or "onnx_graph")).verify()

    def declared_inputs(self) -> list[Tensor]:
        """The model's inputs (not initializers) as graph tensors of their declared dtype and
        shape (named dims as symbolic sizes), without importing a node."""
        initializers = {i.name for i in self.model.graph.initializer}
        return [self._graph_input(vi) for vi in self.model.graph.input if vi.name not in initializers]

    def _graph_input(self, vi: Any) -> Tensor:
        tt = vi.type.tensor_type
        if vi.type.WhichOneof("value") != "tensor_type":
            raise UnsupportedError(f"input {vi.name}: {vi.type.WhichOneof('value')} values are not supported "
                                   "(tessera graphs carry tensors)")  # fmt: skip
        if tt.elem_type not in ONNX_DTYPES:
            raise UnsupportedError(f"input {vi.name}: ONNX element type {_type_name(tt.elem_type)} is not supported")
        dtype = ONNX_DTYPES[tt.elem_type]
        if vi.name in self.input_values:
            value = np.asarray(self.input_values[vi.name])
            if value.dtype != numpy_dtype(_dt(dtype)):
                raise ArgumentError(f"input {vi.name!r} must be {dtype}, got {value.dtype}")
            return Tensor.constant(value, name=_clean(vi.name))
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param if d.dim_param else fresh_dim("in"))
                 for d in tt.shape.dim]  # fmt: skip
        shape = [_sym_name(d) if isinstance(d, str) else d for d in shape]
        if vi.name in self.input_shapes:
            given = tuple(int(d) for d in self.input_shapes[vi.name])
            if len(given) != len(shape) or any(isinstance(d, int) and d != g for d, g in zip(shape, given)):
                raise ArgumentError(f"input {vi.name!r} has shape {list(given)}, the model declares {shape}")
            shape = list(given)
        t = Tensor(shape, dtype, name=_clean(vi.name))
        self.inputs.append(t)
        self.input_names[t] = vi.name
        return t

    def import_nodes(self, nodes: Iterable[Any], opset: int) -> None:
        for node in nodes:
            self.import_node(node, opset)

    def import_node(self, node: Any, opset: int) -> None:
        saved = self.node, self.node_opset
        self.node, self.node_opset = node, opset
        where = f"ONNX op {node.op_type} (node {node.name!r}, opset {opset})"
        try:
            if node.domain not in ("", "ai.onnx"):
                version = next((o.version for o in self.model.opset_import if o.domain == node.domain), None)
                raise UnsupportedError(f"ONNX op {node.domain}::{node.op_type} (node {node.name!r}, {node.domain} opset "
                                       f"{version}) is not supported: tessera imports the default (ai.onnx) domain only")  # fmt: skip
            attrs = {a.name: self.onnx.helper.get_attribute_value(a) for a in node.attribute}
            spec = RULES.get(node.op_type)
            unknown = sorted(set(attrs) - spec.attrs) if spec is not None and spec.attrs is not None else []
            if spec is None or unknown:
                if expand_function(self, node, opset):
                    return
                if spec is None:
                    raise UnsupportedError(f"{where} is not supported by tessera")
                raise UnsupportedError(f"{where}: attribute {unknown[0]}={_short(attrs[unknown[0]])} is not supported")
            args = [self._value(i, f"node {node.name!r} ({node.op_type})") for i in node.input]
            try:
                result = spec.fn(self, node, args, attrs)
                self.bind_outputs(node.output, result)
            except UnsupportedError as e:  # named after the node (keeping the type: compile reads it)
                if not str(e).startswith("ONNX op "):
                    e.args = (f"{where}: {e}",)
                raise e from None
            except (KeyError, IndexError, ValueError, TypeError, AttributeError) as e:  # a malformed node
                raise FileFormatError(f"{where} is malformed or of an unsupported form: {type(e).__name__}: {e}") \
                    from None  # fmt: skip
        finally:
            self.node, self.node_opset = saved

    def import_subgraph(self, graph: Any, inputs: list[Any]) -> list[Any]:
        """Import a subgraph (a control-flow body) once, in its own scope: its inputs bound to
        `inputs`, its initializers and nodes local, the enclosing values visible; its outputs."""
        if len(inputs) != len(graph.input):
            raise UnsupportedError(f"subgraph {graph.name!r} takes {len(graph.input)} inputs, got {len(inputs)}")
        outer = self.values
        self.values = outer.new_child()
        try:
            for init in graph.initializer:
                self.values[init.name] = Tensor.constant(self.numpy_helper.to_array(init), name=_clean(init.name))
            for vi, value in zip(graph.input, inputs):
                self.values[vi.name] = value
            self.import_nodes(graph.node, self.node_opset)
            return [self._value(o.name, f"subgraph {graph.name!r}") for o in graph.output]
        finally:
            self.values = outer

    def bind_outputs(self, names: Iterable[str], result: Any) -> None:
        results = list(result) if isinstance(result, (list, tuple)) else [result]
        names = list(names)
        for i, name in enumerate(names):
            if not name:
                continue
            if i >= len(results):
                raise UnsupportedError(f"output {i} ({name!r}) is not supported: the operator gives {len(results)} "
                                       f"output(s) here")  # fmt: skip
            value = results[i]
            if isinstance(value, Tensor) and value.producer is not None and value.name.startswith("t"):
                value.name = _clean(name)
            self.values[name] = value

    def _value(self, name: str, reader: str) -> Any:
        if name not in self.values:
            raise FileFormatError(f"malformed ONNX model: {reader} needs {name!r}, which no graph input, initializer "
                                  "or earlier node defines")  # fmt: skip
        return self.values[name]


def _dt(name: str) -> Any:
    return dtypes.dtype(name)


def _type_name(elem_type: int) -> str:
    import onnx

    try:
        return onnx.TensorProto.DataType.Name(elem_type)
    except ValueError:
        return str(elem_type)


def _short(v: Any) -> str:
    text = repr(v.decode() if isinstance(v, bytes) else v)
    return text if len(text) < 60 else text[:57] + "..."


def _clean(name: str) -> str:
    return "".join(c if c.isalnum() or c in "_." else "_" for c in name) or "v"


def _sym_name(text: str) -> Dim:
    name = _clean(text)
    return Sym.var(name if not name[0].isdigit() else "d" + name)


def default_opset(model: Any) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def convert_opset(model: Any) -> Any:
    """model at opset MIN_NATIVE_OPSET or later: older models go through onnx.version_converter."""
    import onnx

    opset = default_opset(model)
    newest = onnx.defs.onnx_opset_version()
    if opset > newest:
        raise UnsupportedError(f"the model uses ONNX opset {opset}, newer than the installed onnx knows ({newest}); "
                               "upgrade onnx")  # fmt: skip
    if opset >= MIN_NATIVE_OPSET:
        return model
    if opset == 0 and model.graph.node:
        raise FileFormatError("the model imports no default-domain (ai.onnx) opset")
    try:
        converted = onnx.version_converter.convert_version(model, MIN_NATIVE_OPSET)
    except Exception as exc:  # noqa: BLE001  (the converter raises RuntimeError and onnx's own types)
        raise UnsupportedError(f"ONNX opset {opset} model: onnx.version_converter could not convert it to opset "
                               f"{MIN_NATIVE_OPSET} ({type(exc).__name__}: {str(exc).strip()[:300]})") from None  # fmt: skip
    before, after = _interface(model), _interface(converted)
    if before != after:  # e.g. opset 8's batched Scan: the converter drops the batch axis from the inputs
        changed = sorted({name for name, t in before.items() if after.get(name) != t})
        ops = sorted({n.op_type for n in model.graph.node})
        raise UnsupportedError(f"ONNX opset {opset} model: onnx.version_converter changed the types of {changed} while "
                               f"converting it to opset {MIN_NATIVE_OPSET} (ops {ops}); re-export the model with "
                               f"opset {MIN_NATIVE_OPSET} or later")  # fmt: skip
    log.info("tessera: converted an opset %d ONNX model to opset %d", opset, MIN_NATIVE_OPSET)
    return converted


def _interface(model: Any) -> dict[str, str]:
    """Each graph input's and output's type, as text."""
    return {vi.name: str(vi.type) for vi in [*model.graph.input, *model.graph.output]}


def read_model(model: str | Path | bytes | Any) -> Any:
    """An onnx.ModelProto from a path, bytes or a ModelProto, with clear errors for bad files."""
    import onnx
    from google.protobuf.message import DecodeError

    where = "the ONNX bytes"
    try:
        if isinstance(model, (str, Path)):
            where = str(model)
            if not Path(model).is_file():
                raise ArgumentError(f"{model}: {'is a directory' if Path(model).is_dir() else 'no such file'}")
            model = onnx.load(str(model))
        elif isinstance(model, (bytes, bytearray)):
            model = onnx.load_from_string(bytes(model))
        elif not isinstance(model, onnx.ModelProto):
            raise ArgumentError(f"onnx.load takes a path, bytes or an onnx.ModelProto, got {type(model).__name__}")
    except DecodeError as exc:
        raise FileFormatError(f"{where}: not an ONNX model (truncated or another format: {exc})") from None
    except (OSError, ValueError, onnx.checker.ValidationError) as exc:  # external data missing or misplaced
        raise FileFormatError(f"{where}: cannot read the ONNX model ({type(exc).__name__}: {exc})") from None
    if not model.HasField("graph") or model.ir_version == 0:
        raise FileFormatError(f"{where}: not an ONNX model (it has no graph or no IR version; empty or another format?)")
    return model


def load(model: str | Path | bytes | Any, input_values: dict[str, Any] | None = None) -> FlowGraph:
    """Import an ONNX model (a path, bytes, or an onnx.ModelProto) as a verified FlowGraph.

    `input_values` fixes graph inputs to values (they become constants, not graph inputs):
    the way to import a model whose shapes, axes or repeats are graph inputs.  Without it
    such a model raises ShapeInputError naming the inputs; `tessera.onnx.compile` handles
    that by itself.  A missing file raises ArgumentError; a file or bytes that are not an ONNX
    model (not protobuf, truncated, no graph, external data missing) raise FileFormatError."""
    where = str(model) if isinstance(model, (str, Path)) else "the ONNX model"
    model = convert_opset(read_model(model))
    try:
        return Importer(model, input_values).run()
    except FileFormatError as exc:
        raise FileFormatError(f"{where}: {exc}") from None
