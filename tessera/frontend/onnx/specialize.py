"""`tessera.onnx.compile`: an ONNX model compiled for a target, specialised on the values of
its shape-like inputs.

Some models take shapes, axes, repeats, pads or sizes as graph inputs (Reshape's shape,
ReduceSum's axes, Tile's repeats, Resize's sizes), or compute them from graph inputs, or
produce tensors whose shape depends on input values (NonZero, Unique).  A FlowGraph needs
those values at import time.  `OnnxModel` finds such inputs on the first import (the importer
raises ShapeInputError naming them), and on each call imports and compiles the model with
their values bound as constants -- everything they determine folds -- keyed by those values.
The key is the guard: a call whose shape-like inputs have other values (dtype, shape or
contents) gets another specialisation (built once, then reused; the least recently used of
more than `max_specializations` is dropped).  A model without shape-like inputs compiles once,
at construction, and serves every size of its symbolic dimensions -- unless its shape
arithmetic on those sizes is beyond what the importer follows symbolically
(SymbolicValueError): then the input shapes join the key, and each new set of input shapes
imports and compiles the model with them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import ArgumentError
from tessera.frontend.onnx.importer import Importer, ShapeInputError, SymbolicValueError, convert_opset, read_model
from tessera.graph.compiler import compile_graph
from tessera.graph.compiler.report import CompileReport

log = logging.getLogger("tessera")


class OnnxModel:
    """An ONNX model compiled by tessera; call it with the model's inputs (positionally in the
    model's input order, by ONNX input name, or as one dict) to get the list of outputs."""

    def __init__(self, model: str | Path | bytes | Any, target: str = "cpu", *, max_specializations: int = 8,
                 **compile_options: Any):  # fmt: skip
        self.model = convert_opset(read_model(model))
        self.target, self.compile_options = target, compile_options
        self.max_specializations = max_specializations
        initializers = {i.name for i in self.model.graph.initializer}
        self.input_names = [vi.name for vi in self.model.graph.input if vi.name not in initializers]
        self.shape_inputs: list[str] = []
        self.by_input_shapes = False  # the input shapes are part of the key (SymbolicValueError)
        self._compiled: OrderedDict[tuple, Any] = OrderedDict()
        try:
            self._compiled[()] = self._build({}, {})
        except ShapeInputError as exc:
            self._add_shape_inputs(exc.inputs)
        except SymbolicValueError as exc:
            log.info("tessera: %s; compiling per input shapes", exc)
            self.by_input_shapes = True

    def input_tensors(self) -> list[Any]:
        """The model's inputs as graph tensors (tessera.graph.Tensor) of their declared dtypes and
        shapes, in call order (shape-like inputs included)."""
        return Importer(self.model).declared_inputs()

    @property
    def latest(self) -> Any:
        """The CompiledGraph of the most recent call's specialisation (None before any is built)."""
        return next(reversed(self._compiled.values()), None)

    @property
    def specializations(self) -> int:
        """How many specialisations are built (1 for a model without shape-like inputs)."""
        return len(self._compiled)

    def _add_shape_inputs(self, names: list[str]) -> None:
        new = set(self.shape_inputs) | set(names)
        self.shape_inputs = [n for n in self.input_names if n in new]

    def _build(self, values: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]) -> Any:
        graph = Importer(self.model, dict(values), dict(shapes)).run()
        return compile_graph(graph, self.target, **self.compile_options)

    def _arrays(self, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        if len(args) == 1 and isinstance(args[0], Mapping) and not kwargs:
            kwargs, args = args[0], ()
        if args and kwargs:
            raise ArgumentError("pass the inputs either positionally or by name, not both")
        if not kwargs:
            if len(args) != len(self.input_names):
                raise ArgumentError(f"the model takes {len(self.input_names)} inputs {self.input_names}, got {len(args)}")
            return dict(zip(self.input_names, args))
        missing = [n for n in self.input_names if n not in kwargs]
        extra = sorted(set(kwargs) - set(self.input_names))
        if missing or extra:
            raise ArgumentError(f"missing inputs {missing}, unknown inputs {extra}")
        return dict(kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> list[Any]:
        arrays = self._arrays(args, kwargs)
        while True:
            values = {n: _host(arrays[n]) for n in self.shape_inputs}
            shapes = {n: tuple(np.shape(arrays[n])) for n in self.input_names if n not in values} if self.by_input_shapes else {}
            key = tuple((n, v.dtype.str, v.shape, v.tobytes()) for n, v in values.items()) + tuple(shapes.items())
            compiled = self._compiled.get(key)
            if compiled is None:
                try:
                    compiled = self._build(values, shapes)
                except ShapeInputError as exc:  # a value that only matters once others are known
                    if set(exc.inputs) <= set(self.shape_inputs):
                        raise
                    self._add_shape_inputs(exc.inputs)
                    continue
                except SymbolicValueError:
                    if self.by_input_shapes:
                        raise
                    self.by_input_shapes = True
                    continue
                if self.shape_inputs or shapes:
                    log.info("tessera: ONNX model specialised on %s (%d specialisation(s))",
                             {**{n: v.tolist() if v.size <= 16 else f"{v.dtype}{list(v.shape)}" for n, v in values.items()},
                              **{n: f"shape {list(s)}" for n, s in shapes.items()}}, len(self._compiled) + 1)  # fmt: skip
                self._compiled[key] = compiled
                if len(self._compiled) > self.max_specializations:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(key)
            return compiled(*[arrays[n] for n in self.input_names if n not in values])

    def report(self) -> Any:
        """A CompileReport: the compile report of every specialisation built so far."""
        notes = []
        if self.shape_inputs or self.by_input_shapes:
            on = [*self.shape_inputs, *(["the input shapes"] if self.by_input_shapes else [])]
            notes.append(f"specialised on {', '.join(on)}: one graph per distinct value (at most "
                         f"{self.max_specializations} kept)")  # fmt: skip
        return CompileReport("ONNX model", [c.report() for c in self._compiled.values()], notes=notes)

    def summary(self) -> dict[str, Any]:
        """The shape-like inputs and the summary of the most recent specialisation."""
        last = self.latest
        return {"shape_inputs": list(self.shape_inputs), "by_input_shapes": self.by_input_shapes,
                "specializations": len(self._compiled),
                **(last.summary() if last is not None else {})}  # fmt: skip


def _host(a: Any) -> np.ndarray:
    if type(a).__module__.startswith("torch"):
        a = a.detach().cpu().numpy()
    elif hasattr(a, "__tessera_view__") and hasattr(a, "numpy"):  # a tessera DeviceArray
        a = a.numpy()
    return np.asarray(a, order="C")  # (not ascontiguousarray: it makes scalars 1-D)


def compile(model: str | Path | bytes | Any, target: str = "cpu", **options: Any) -> OnnxModel:  # noqa: A001
    """Compile an ONNX model (path, bytes or ModelProto) for "cpu" or "cuda" (options as for
    compile_graph, plus max_specializations).  Shape-like inputs are handled by specialisation."""
    return OnnxModel(model, target, **options)
