"""Graph tensors: a shape (ints or symbolic sizes), a dtype, a device and optional constant data."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from tessera.graph.symbolic import Dim, Shape, as_shape, format_shape, is_static, numel
from tessera.ir import dtypes
from tessera.ir.dtypes import DataType, from_numpy_dtype, numpy_dtype


class Producer(Protocol):
    """What a tensor knows of the operator that computes it (tessera.graph.operator.Operator,
    a module above this one, which sets `Tensor.producer`)."""

    kind: str
    name: str
    inputs: list[Tensor]
    outputs: list[Tensor]
    attrs: dict[str, Any]

DEVICES = ("cpu", "cuda")

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
