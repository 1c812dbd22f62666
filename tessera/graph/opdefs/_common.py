"""Helpers shared by the op definitions: dtype handling, axis normalization, window geometry."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tessera.graph.symbolic import ShapeError
from tessera.ir import dtypes
from tessera.ir.dtypes import DataType
from tessera.ops import geometry

LOW_PRECISION = ("float16", "bfloat16")


def upcast(x: np.ndarray) -> np.ndarray:
    """fp16/bf16 values computed in fp32, as GPU kernels accumulate; the executor casts back."""
    if x.dtype.name in LOW_PRECISION:
        return x.astype(np.float32)
    return x


def norm_axis(axis: int, rank: int, what: str = "axis") -> int:
    if not -rank <= axis < max(rank, 1):
        raise ShapeError(f"{what} {axis} is out of range for rank {rank}")
    return axis % max(rank, 1)


def norm_axes(axes: Sequence[int] | None, rank: int) -> tuple[int, ...]:
    if axes is None:
        return tuple(range(rank))
    out = tuple(sorted({norm_axis(a, rank) for a in axes}))
    if len(out) != len(axes):
        raise ShapeError(f"repeated axes {list(axes)}")
    return out


def float_result(dt: DataType) -> DataType:
    """The dtype of a math function of dt: floats keep theirs, integers and bool give float32."""
    return dt if dt.is_float else dtypes.float32


def require_float(dt: DataType, what: str) -> None:
    if not dt.is_float:
        raise ShapeError(f"{what} needs a floating-point input, got {dt}")


def pair(v: int | Sequence[int], what: str) -> tuple[int, int]:
    """tessera.ops.geometry.pair for shape inference: a bad value is a ShapeError (Operator.create
    puts the op's name in front)."""
    return geometry.pair(v, what, "", error=ShapeError)


def pads(padding: int | Sequence[int]) -> tuple[int, int, int, int]:
    """tessera.ops.geometry.pads for shape inference: (top, left, bottom, right) from 1, 2 or 4
    ints, negative ones allowed (ONNX pooling crops with them), a bad value a ShapeError."""
    return geometry.pads(padding, "", allow_negative=True, error=ShapeError)
