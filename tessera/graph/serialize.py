"""Saving a FlowGraph to one file and loading it back, without pickle.

File format (version 1): a zip archive with two members.

* `graph.json` -- the structure::

      {"format": "tessera.flowgraph", "version": 1, "name": str,
       "tensors": [{"name": str, "shape": [int | "batch" | "2*batch*seq"], "dtype": "float32",
                    "device": "cpu", "constant": bool}],
       "inputs": [tensor index], "outputs": [tensor index],
       "operators": [{"kind": str, "name": str, "attrs": {...}, "inputs": [tensor index],
                      "outputs": [tensor index]}]}

  Operators are listed in topological order.  Attribute values are JSON numbers,
  strings, booleans, null and lists, plus three tagged objects: `{"sym": "2*batch"}`
  (a symbolic size), `{"dtype": "float16"}` and `{"float": "inf" | "-inf" | "nan"}`.
* `constants.npz` -- the constant tensors' data, keyed `c<tensor index>`, read with
  `allow_pickle=False`.  bfloat16 data is stored as its uint16 bit pattern.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import FileFormatError, TesseraError
from tessera.graph.flow_graph import FlowGraph, provide
from tessera.graph.operator import Operator
from tessera.graph.symbolic import Sym, parse_dim
from tessera.graph.tensor import Tensor
from tessera.ir import dtypes
from tessera.ir.dtypes import DataType, numpy_dtype

FORMAT, VERSION = "tessera.flowgraph", 1


def _enc(v: Any) -> Any:
    if isinstance(v, Sym):
        return {"sym": str(v)}
    if isinstance(v, DataType):
        return {"dtype": v.name}
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)):
        return float(v) if math.isfinite(v) else {"float": str(float(v))}
    if isinstance(v, (list, tuple)):
        return [_enc(x) for x in v]
    raise TypeError(f"attribute value {v!r} cannot be saved")


def _dec(v: Any) -> Any:
    if isinstance(v, dict):
        if "sym" in v:
            return parse_dim(v["sym"])
        if "dtype" in v:
            return dtypes.dtype(v["dtype"])
        if "float" in v:
            return float(v["float"])
        raise FileFormatError(f"unknown tagged attribute {v}")
    if isinstance(v, list):
        return [_dec(x) for x in v]
    return v


def save(graph: FlowGraph, path: str | Path) -> None:
    """Write graph to path (a zip with graph.json and constants.npz)."""
    index: dict[Tensor, int] = {}
    tensors: list[Tensor] = []

    def ref(t: Tensor) -> int:
        if t not in index:
            index[t] = len(tensors)
            tensors.append(t)
        return index[t]

    inputs = [ref(t) for t in graph.inputs]
    ops = []
    for op in graph.operators:
        ops.append({"kind": op.kind, "name": op.name, "attrs": {k: _enc(v) for k, v in op.attrs.items()},
                    "inputs": [ref(t) for t in op.inputs], "outputs": [ref(t) for t in op.outputs]})  # fmt: skip
    outputs = [ref(t) for t in graph.outputs]
    doc = {
        "format": FORMAT, "version": VERSION, "name": graph.name,
        "tensors": [{"name": t.name, "shape": [d if isinstance(d, int) else str(d) for d in t.shape],
                     "dtype": t.dtype.name, "device": t.device, "constant": t.is_constant and t.producer is None}
                    for t in tensors],
        "inputs": inputs, "outputs": outputs, "operators": ops,
    }  # fmt: skip
    arrays = {}
    for i, t in enumerate(tensors):
        if t.is_constant and t.producer is None:
            data = t.data
            arrays[f"c{i}"] = data.view(np.uint16) if t.dtype == dtypes.bfloat16 else data
    blob = io.BytesIO()
    np.savez(blob, **arrays)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as z:
        z.writestr("graph.json", json.dumps(doc, indent=1))
        z.writestr("constants.npz", blob.getvalue())
    tmp.replace(path)


def load(path: str | Path) -> FlowGraph:
    """Read a graph written by `save`; verifies it before returning.  A file that is not
    such a graph (unreadable, malformed, inconsistent) raises FileFormatError."""
    try:
        with zipfile.ZipFile(path) as z:
            for member in ("graph.json", "constants.npz"):
                if member not in z.namelist():
                    raise FileFormatError(f"{path}: missing member {member}; not a tessera graph file")
            doc = json.loads(z.read("graph.json"))
            npz = np.load(io.BytesIO(z.read("constants.npz")), allow_pickle=False)
            arrays = {k: npz[k] for k in npz.files}
    except (zipfile.BadZipFile, ValueError, UnicodeDecodeError, OSError, EOFError, RecursionError) as exc:
        raise FileFormatError(f"{path}: not a readable tessera graph file ({type(exc).__name__}: {exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise FileFormatError(f"{path}: not a {FORMAT} v{VERSION} file")
    try:
        return _decode(doc, arrays)
    except FileFormatError as exc:
        raise FileFormatError(f"{path}: {exc}") from None
    except TesseraError as exc:  # the operators do not verify (shapes, dtypes, attributes)
        raise FileFormatError(f"{path}: the graph in the file is invalid: {exc}") from None
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RecursionError) as exc:
        raise FileFormatError(f"{path}: malformed graph.json ({type(exc).__name__}: {exc})") from None


def _decode(doc: dict, arrays: dict[str, np.ndarray]) -> FlowGraph:
    tensors = []
    for i, spec in enumerate(doc["tensors"]):
        t = Tensor(spec["shape"], spec["dtype"], spec["device"], spec["name"])
        if spec["constant"] is True:
            if f"c{i}" not in arrays:
                raise FileFormatError(f"constants.npz lacks the data of constant {spec['name']!r} (c{i})")
            data = arrays[f"c{i}"]
            t.set_data(data.view(numpy_dtype(t.dtype)) if t.dtype == dtypes.bfloat16 and data.dtype == np.uint16 else data)
        tensors.append(t)

    def at(i: Any) -> Tensor:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(tensors):
            raise FileFormatError(f"tensor index {i!r} out of range")
        return tensors[i]

    ops = []
    for spec in doc["operators"]:
        attrs = {k: _dec(v) for k, v in spec["attrs"].items()}
        ops.append(Operator(spec["kind"], [at(i) for i in spec["inputs"]], [at(i) for i in spec["outputs"]], attrs,
                            spec["name"]))  # fmt: skip
    graph = FlowGraph([at(i) for i in doc["inputs"]], [at(i) for i in doc["outputs"]], ops, doc["name"])
    return graph.verify()


provide("save", save)  # FlowGraph.save
