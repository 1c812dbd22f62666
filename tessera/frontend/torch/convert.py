"""Translate a dynamo FX graph (torch-level) into a FlowGraph.

Values of the FX graph map to: graph tensors (tensor-valued nodes), Python scalars or
symbolic sizes (`Sym`, from SymInt metadata), or tuples of those.  Scalar-valued nodes are
never translated into operators: their value at compile time comes from dynamo's metadata
(`node.meta["example_value"]`), symbolic where the size is dynamic.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from tessera.errors import UnsupportedError
from tessera.frontend.torch.sizes import dim_from_sym
from tessera.graph import FlowGraph, Operator, Tensor
from tessera.graph.symbolic import Dim, Sym
from tessera.ir import dtypes

Handler = Callable[["Converter", list, dict], Any]
HANDLERS: dict[str, Handler] = {}


def handles(*keys: str) -> Callable[[Handler], Handler]:
    """Register a conversion rule for torch callables named by `target_key`."""

    def deco(fn: Handler) -> Handler:
        for k in keys:
            HANDLERS[k] = fn
        return fn

    return deco


def target_key(node: torch.fx.Node) -> str:
    """A stable name for what a node calls: "F.relu", "torch.cat", "op.add", "method.view"."""
    if node.op == "call_method":
        return f"method.{node.target}"
    if node.op != "call_function":
        return f"{node.op}.{node.target}"
    t = node.target
    name = getattr(t, "__name__", str(t))
    if getattr(operator, name, None) is t:
        return f"op.{name}"
    if getattr(torch.nn.functional, name, None) is t or getattr(torch._C._nn, name, None) is t:
        return f"F.{name}"
    if getattr(torch, name, None) is t:
        return f"torch.{name}"
    if getattr(torch.Tensor, name, None) is t:
        return f"method.{name}"
    if getattr(math, name, None) is t:
        return f"math.{name}"
    if getattr(torch._C, name, None) is t:
        return f"torch._C.{name}"
    module = getattr(t, "__module__", None) or "?"
    return f"{module}.{name}"


def dtype_of(dt: torch.dtype) -> dtypes.DataType:
    name = str(dt).removeprefix("torch.")
    try:
        return dtypes.dtype({"bool": "bool", "half": "float16", "float": "float32", "double": "float64",
                             "long": "int64", "int": "int32"}.get(name, name))  # fmt: skip
    except ValueError:
        raise UnsupportedError(f"torch dtype {dt} is not supported") from None


def sym_to_dim(value: Any) -> Dim:
    """A torch int / SymInt as a tessera size (`sizes.dim_from_sym`)."""
    return dim_from_sym(value)


def scalar_from_meta(value: Any) -> Any:
    """The compile-time value of a scalar-valued node: int, float, bool, Sym or tuples of them."""
    if isinstance(value, (bool, int, float)) or value is None:
        return value
    if isinstance(value, torch.SymInt):
        return sym_to_dim(value)
    if isinstance(value, (torch.SymFloat, torch.SymBool)):
        expr = value.node.expr
        if expr.is_number or expr.is_Boolean:
            return bool(expr) if isinstance(value, torch.SymBool) else float(expr)
        raise UnsupportedError(f"data-dependent or symbolic scalar {expr}")
    if isinstance(value, (tuple, list, torch.Size)):
        return tuple(scalar_from_meta(v) for v in value)
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, torch.device):
        return value
    raise UnsupportedError(f"unsupported scalar value {type(value).__name__}")


def is_tensor_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


class Opaque:
    """The value of a node that could not be translated (only seen while probing)."""

    def __init__(self, reason: str):
        self.reason = reason


class Converter:
    """Builds one FlowGraph from FX nodes; handlers call `op` and `const`."""

    def __init__(self, name: str = "torch_graph"):
        self.name = name
        self.inputs: list[Tensor] = []
        self.operators: list[Operator] = []
        self.env: dict[torch.fx.Node, Any] = {}
        self.node: torch.fx.Node | None = None

    # ---- helpers for handlers -------------------------------------------------------------
    def op(self, kind: str, *inputs: Tensor, **attrs: Any) -> Tensor:
        outs = self.op_multi(kind, *inputs, **attrs)
        if len(outs) != 1:
            raise AssertionError(f"{kind} has {len(outs)} outputs")
        return outs[0]

    def op_multi(self, kind: str, *inputs: Tensor, **attrs: Any) -> list[Tensor]:
        op = Operator.create(kind, list(inputs), attrs)
        self.operators.append(op)
        return op.outputs

    def const(self, value: Any, like: Tensor | None = None, dtype: Any = None) -> Tensor:
        """A constant tensor; a Python number takes the dtype torch would give it against like."""
        if isinstance(value, Sym):
            dt = dtype or "int64"
            return self.op("full", shape=[], value=value, dtype=str(dt))
        if dtype is None and like is not None and isinstance(value, (bool, int, float)):
            dt = like.dtype
            if isinstance(value, float) and not dt.is_float:
                dt = dtypes.float32
            elif isinstance(value, int) and not isinstance(value, bool) and dt.is_bool:
                dt = dtypes.int64
            dtype = dt
        if dtype is None and isinstance(value, float):
            dtype = dtypes.float32
        return Tensor.constant(np.asarray(value), dtype)

    def tensor(self, value: Any, like: Tensor | None = None) -> Tensor:
        if isinstance(value, Tensor):
            return value
        if isinstance(value, Opaque):
            raise UnsupportedError(value.reason)
        if isinstance(value, (bool, int, float, Sym)):
            return self.const(value, like)
        raise UnsupportedError(f"expected a tensor, got {type(value).__name__}")

    def add_input(self, node: torch.fx.Node, meta: torch.Tensor) -> Tensor:
        shape = [sym_to_dim(d) for d in meta.shape]
        t = Tensor(shape, dtype_of(meta.dtype), "cuda" if meta.device.type == "cuda" else "cpu", node.name)
        self.inputs.append(t)
        return t

    def build(self, outputs: Sequence[Tensor]) -> FlowGraph:
        return FlowGraph(self.inputs, outputs, self.operators, self.name).verify()

    # ---- translating a node -------------------------------------------------------------
    def convert_node(self, node: torch.fx.Node) -> Any:
        """The value of a call node; raises UnsupportedError naming the op when it cannot."""
        self.node = node
        meta = node.meta.get("example_value", node.meta.get("val"))
        args = torch.fx.node.map_arg(node.args, lambda n: self.env[n])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: self.env[n])
        key = target_key(node)
        if meta is not None and not _has_tensor(meta):
            if key == "method.item" and isinstance(args[0], Tensor) and args[0].is_constant:
                return args[0].data.item()
            return scalar_from_meta(meta)
        handler = HANDLERS.get(key)
        if handler is None:
            raise UnsupportedError(f"torch op {key} is not supported")
        for v in _flatten(list(args) + list(kwargs.values())):
            if isinstance(v, Opaque):
                raise UnsupportedError(v.reason)
        return handler(self, list(args), dict(kwargs))


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_has_tensor(v) for v in value)
    return False


def _flatten(values: Any) -> list:
    out = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out.extend(_flatten(v))
        else:
            out.append(v)
    return out
