"""The ONNX importer: `tessera.onnx.load(path_or_model) -> FlowGraph` (opset 13 and later).

Initializers become constants and dim_params become symbolic sizes.  Exporters compute
dynamic shapes with small integer subgraphs (Shape -> Gather -> Unsqueeze -> Concat ->
Reshape); the importer evaluates those at import time on symbolic sizes (`Known` values),
so a Reshape to (batch*seq, hidden) becomes a reshape attribute, not a runtime tensor.
An op outside the supported set raises `UnsupportedError` naming the op type and node.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import ArgumentError, FileFormatError, UnsupportedError
from tessera.graph import FlowGraph, Operator, Tensor
from tessera.graph.symbolic import Dim, Sym, fresh_dim

_ONNX_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64", 9: "bool",
                10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 16: "bfloat16"}  # fmt: skip


class Known:
    """An integer tensor of rank 0 or 1 whose entries are known at import time (maybe symbolic)."""

    def __init__(self, values: list[Dim], scalar: bool = False):
        self.values, self.scalar = list(values), scalar

    @property
    def is_static(self) -> bool:
        return all(isinstance(v, int) for v in self.values)


Rule = Callable[["Importer", Any, list, dict], Any]
RULES: dict[str, Rule] = {}


def rule(*op_types: str) -> Callable[[Rule], Rule]:
    def deco(fn: Rule) -> Rule:
        for t in op_types:
            RULES[t] = fn
        return fn

    return deco


class Importer:
    """Walks one ONNX graph; rules call `op`, `tensor` and `ints`."""

    def __init__(self, model: Any):
        import onnx
        from onnx import numpy_helper

        self.onnx, self.numpy_helper = onnx, numpy_helper
        self.model = model
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
        if self.opset < 13:
            raise UnsupportedError(f"ONNX opset {self.opset} is older than 13; convert the model with onnx.version_converter")
        self.values: dict[str, Any] = {"": None}
        self.operators: list[Operator] = []
        self.inputs: list[Tensor] = []

    # ---- helpers for rules --------------------------------------------------------------
    def op(self, kind: str, *inputs: Tensor, **attrs: Any) -> Tensor:
        return self.op_multi(kind, *inputs, **attrs)[0]

    def op_multi(self, kind: str, *inputs: Tensor, **attrs: Any) -> list[Tensor]:
        o = Operator.create(kind, [self.tensor(t) for t in inputs], attrs)
        self.operators.append(o)
        return o.outputs

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
        raise UnsupportedError(f"expected a tensor, got {type(value).__name__}")

    def known(self, value: Any) -> Known | None:
        """value as a Known when it is one, or a small integer constant."""
        if isinstance(value, Known):
            return value
        if isinstance(value, Tensor) and value.is_constant and value.dtype.name == "int64" and value.ndim <= 1:
            if value.data.size <= 64:
                return Known([int(v) for v in value.data.reshape(-1)], scalar=value.ndim == 0)
        return None

    def ints(self, value: Any, what: str) -> list[Dim]:
        k = self.known(value)
        if k is None:
            raise UnsupportedError(f"{what} must be known at import time (a constant or a shape computation)")
        return list(k.values)

    def const_array(self, value: Any, what: str) -> np.ndarray:
        if isinstance(value, Tensor) and value.is_constant:
            return value.data
        k = self.known(value)
        if k is not None and k.is_static:
            return np.array(k.values[0] if k.scalar else k.values, np.int64)
        raise UnsupportedError(f"{what} must be a constant")

    # ---- the walk -----------------------------------------------------------------------
    def run(self) -> FlowGraph:
        g = self.model.graph
        for init in g.initializer:
            self.values[init.name] = Tensor.constant(self.numpy_helper.to_array(init), name=init.name)
        for vi in g.input:
            if vi.name in self.values:
                continue
            tt = vi.type.tensor_type
            if tt.elem_type not in _ONNX_DTYPES:
                raise UnsupportedError(f"input {vi.name}: ONNX element type {tt.elem_type} is not supported")
            shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param if d.dim_param else fresh_dim("in"))
                     for d in tt.shape.dim]  # fmt: skip
            shape = [_sym_name(d) if isinstance(d, str) else d for d in shape]
            t = Tensor(shape, _ONNX_DTYPES[tt.elem_type], name=vi.name)
            self.inputs.append(t)
            self.values[vi.name] = t
        for node in g.node:
            if node.domain not in ("", "ai.onnx"):
                raise UnsupportedError(f"ONNX op {node.domain}::{node.op_type} (node {node.name!r}) is not supported")
            fn = RULES.get(node.op_type)
            if fn is None:
                raise UnsupportedError(f"ONNX op {node.op_type} (node {node.name!r}) is not supported by tessera")
            attrs = {a.name: self.onnx.helper.get_attribute_value(a) for a in node.attribute}
            args = [self._value(i, f"node {node.name!r} ({node.op_type})") for i in node.input]
            try:
                result = fn(self, node, args, attrs)
            except UnsupportedError as e:
                raise UnsupportedError(f"ONNX op {node.op_type} (node {node.name!r}): {e}") from None
            except (KeyError, IndexError, ValueError, TypeError, AttributeError) as e:  # a malformed node
                raise FileFormatError(f"ONNX op {node.op_type} (node {node.name!r}) is malformed or of an unsupported "
                                      f"form: {type(e).__name__}: {e}") from None  # fmt: skip
            results = list(result) if isinstance(result, (list, tuple)) else [result]
            for name, value in zip(node.output, results):
                if name:
                    if isinstance(value, Tensor) and value.producer is not None and value.name.startswith("t"):
                        value.name = _clean(name)
                    self.values[name] = value
        outputs = [self.tensor(self._value(o.name, "a graph output")) for o in g.output]
        return FlowGraph(self.inputs, outputs, self.operators, _clean(g.name or "onnx_graph")).verify()


    def _value(self, name: str, reader: str) -> Any:
        if name not in self.values:
            raise FileFormatError(f"malformed ONNX model: {reader} needs {name!r}, which no graph input, initializer "
                                  "or earlier node defines")  # fmt: skip
        return self.values[name]


def _clean(name: str) -> str:
    return "".join(c if c.isalnum() or c in "_." else "_" for c in name) or "v"


def _sym_name(text: str) -> Dim:
    name = _clean(text)
    return Sym.var(name if not name[0].isdigit() else "d" + name)


def load(model: str | Path | Any) -> FlowGraph:
    """Import an ONNX model (a path, bytes, or an onnx.ModelProto) as a verified FlowGraph.

    A missing file raises ArgumentError; a file or bytes that are not an ONNX model (not
    protobuf, truncated, no graph, external data missing) raise FileFormatError."""
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
    try:
        return Importer(model).run()
    except FileFormatError as exc:
        raise FileFormatError(f"{where}: {exc}") from None


# The rules live in a sibling module to keep this file short; importing it registers them.
from tessera.frontend import onnx_rules as _rules  # noqa: E402, F401

