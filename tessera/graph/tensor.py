"""Graph tensors: a shape (ints or symbolic sizes), a dtype, a device and optional constant data."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from tessera.errors import UnsupportedError
from tessera.graph.symbolic import Dim, Shape, as_shape, format_shape, is_static, numel
from tessera.ir import dtypes
from tessera.ir.dtypes import DataType


class Producer(Protocol):
    """What a tensor knows of the operator that computes it (tessera.graph.operator.Operator,
    a module above this one, which sets `Tensor.producer`)."""

    kind: str
    name: str
    inputs: list[Tensor]
    outputs: list[Tensor]
    attrs: dict[str, Any]

DEVICES = ("cpu", "cuda")

_NUMPY_NAMES = {
    "bool": "bool", "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
    "uint8": "uint8", "uint16": "uint16", "uint32": "uint32", "uint64": "uint64",
    "float16": "float16", "float32": "float32", "float64": "float64",
}  # fmt: skip


def numpy_dtype(dt: DataType) -> np.dtype:
    """The numpy dtype that holds dt; bfloat16 needs the optional ml_dtypes package."""
    if dt.name in _NUMPY_NAMES:
        return np.dtype(_NUMPY_NAMES[dt.name])
    if dt.name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise UnsupportedError("bfloat16 tensors on the numpy path need the ml_dtypes package") from None
        return np.dtype(ml_dtypes.bfloat16)
    raise UnsupportedError(f"no numpy dtype holds {dt.name}")


def from_numpy_dtype(dt: np.dtype | type) -> DataType:
    dt = np.dtype(dt)
    if dt.name == "bfloat16":
        return dtypes.bfloat16
    for name, np_name in _NUMPY_NAMES.items():
        if dt == np.dtype(np_name):
            return dtypes.dtype(name)
    raise UnsupportedError(f"numpy dtype {dt} has no tessera equivalent")


_names = itertools.count()


class Tensor:
    """A value in a FlowGraph.

    Compared and hashed by identity.  `producer` is the operator that computes it (None for
    graph inputs and constants); `data` holds a constant's value as a numpy array.
    """

    def __init__(self, shape: Sequence[object], dtype: DataType | str, device: str = "cpu",
                 name: str | None = None, data: np.ndarray | None = None):  # fmt: skip
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, not {device!r}")
        self.shape: Shape = as_shape(shape)
        self.dtype: DataType = dtypes.dtype(dtype)
        self.device = device
        self.name = name or f"t{next(_names)}"
        self.producer: Producer | None = None
        self.data: np.ndarray | None = None
        if data is not None:
            self.set_data(data)

    @staticmethod
    def constant(value: np.ndarray | float | int | bool, dtype: DataType | str | None = None,
                 name: str | None = None, device: str = "cpu", copy: bool = True) -> Tensor:  # fmt: skip
        """A constant tensor holding value, made C-contiguous: a copy, unless `copy` is False
        (value is the caller's to give away: nothing else writes to it; a weight of 1 GB is
        not copied again)."""
        array = np.asarray(value)
        if dtype is not None:
            array = array.astype(numpy_dtype(dtypes.dtype(dtype)), copy=copy)
        dt = from_numpy_dtype(array.dtype)
        data = np.array(array, order="C", copy=True) if copy else np.ascontiguousarray(array)
        return Tensor(array.shape, dt, device, name or f"c{next(_names)}", data.reshape(array.shape))

    def set_data(self, data: np.ndarray) -> None:
        data = np.asarray(data)
        if tuple(data.shape) != self.shape or data.dtype != numpy_dtype(self.dtype):
            raise ValueError(f"constant {self.name}: data {data.dtype}{list(data.shape)} does not match {self}")
        data = data.view()
        data.setflags(write=False)  # shared by every run and every copy of the graph
        self.data = data

    @property
    def is_constant(self) -> bool:
        return self.data is not None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> Dim:
        return numel(self.shape)

    @property
    def is_static(self) -> bool:
        return is_static(self.shape)

    def type_str(self) -> str:
        return f"{self.dtype.short}{format_shape(self.shape)}" + ("" if self.device == "cpu" else f"@{self.device}")

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type_str()}"
