"""Source operators: tensors made from attributes alone (full, arange).  Constant tensors
themselves are not operators: they are graph tensors that carry data."""

from __future__ import annotations

import math

import numpy as np

from tessera.graph.registry import REQUIRED, register
from tessera.graph.symbolic import ShapeError, Sym
from tessera.ir import dtypes
from tessera.ir.dtypes import numpy_dtype
from tessera.ir.symbolic import floordiv, sym_max


def _np_dtype(name):
    return numpy_dtype(dtypes.dtype(name))


register("full", category="source", num_inputs=0, attrs={"shape": REQUIRED, "value": 0.0, "dtype": "float32"},
         infer=lambda xs, a: [(tuple(a["shape"]), dtypes.dtype(a["dtype"]))],
         reference=lambda xs, a: [np.full(a["shape"], a["value"], dtype=_np_dtype(a["dtype"]))])  # fmt: skip


def _arange_infer(xs, a):
    start, end, step = a["start"], a["end"], a["step"]
    if step == 0:
        raise ShapeError("arange step cannot be 0")
    if isinstance(end, Sym) or isinstance(start, Sym):
        if not isinstance(step, int):
            raise ShapeError(f"arange with symbolic bounds needs an integer step, got {step!r}")
        # ceil((end - start) / step), and 0 for an empty range
        n = sym_max(0, floordiv(end - start + step - 1, step) if step > 0 else floordiv(start - end - step - 1, -step))
    else:
        n = max(0, math.ceil((end - start) / step))
    return [((n,), dtypes.dtype(a["dtype"]))]


register("arange", category="source", num_inputs=0, infer=_arange_infer,
         attrs={"start": 0, "end": REQUIRED, "step": 1, "dtype": "int64"},
         reference=lambda xs, a: [np.arange(a["start"], a["end"], a["step"], dtype=_np_dtype(a["dtype"]))])  # fmt: skip
