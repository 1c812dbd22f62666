"""Check call arguments against a kernel's signature and convert them to C values."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from math import prod
from typing import Any

import numpy as np

from tessera.errors import ArgumentError
from tessera.ir.dtypes import DataType
from tessera.ir.evaluate import EvaluationError, evaluate
from tessera.ir.expr import Const, Var
from tessera.ir.func import Function, LaunchConfig
from tessera.ir.functor import written_buffers
from tessera.ir.types import PointerType, TensorMapType, TensorType
from tessera.runtime.tensor import ArrayView, view_of
from tessera.runtime.tensor_map import TensorMapSlot, check_tensor_map

CTYPES = {
    "bool": ctypes.c_bool, "int8": ctypes.c_int8, "int16": ctypes.c_int16, "int32": ctypes.c_int32,
    "int64": ctypes.c_int64, "uint8": ctypes.c_uint8, "uint16": ctypes.c_uint16, "uint32": ctypes.c_uint32,
    "uint64": ctypes.c_uint64, "float32": ctypes.c_float, "float64": ctypes.c_double,
}  # fmt: skip


def ctype_of(t: Any) -> type:
    if isinstance(t, (PointerType, TensorType)):
        return ctypes.c_void_p
    if isinstance(t, TensorMapType):
        return TensorMapSlot
    if t.name not in CTYPES:
        raise ArgumentError(f"scalar parameters of type {t} are not supported")
    return CTYPES[t.name]


def _scalar(func: Function, p: Var, value: Any) -> Any:
    t: DataType = p.type
    if isinstance(value, np.generic):
        value = value.item()
    if t.is_bool:
        if not isinstance(value, (bool, int)):
            raise ArgumentError(f"{func.name}: parameter '{p.name}' expects a bool, got {type(value).__name__}")
        return bool(value)
    if t.is_integer:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ArgumentError(f"{func.name}: parameter '{p.name}' expects an int ({t}), got {type(value).__name__}")
        if not t.holds(value):
            raise ArgumentError(f"{func.name}: parameter '{p.name}' = {value} does not fit in {t}")
        return value
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ArgumentError(f"{func.name}: parameter '{p.name}' expects a number ({t}), got {type(value).__name__}")
    if not t.holds(float(value)):
        raise ArgumentError(f"{func.name}: parameter '{p.name}' = {value} does not fit in {t} (it would become inf)")
    return float(value)


def bind(func: Function, args: Sequence[Any], device: str,
         written: frozenset[Var] | None = None) -> tuple[list[Any], dict[str, int], list[ArrayView]]:  # fmt: skip
    """Validate `args` for `func` on `device`.

    `written` are the parameters the kernel may write (functor.written_buffers, computed when
    not given): those must be writable arrays.  Returns the C values of all parameters (hidden
    shape parameters last), the values of the shape symbols, and the array views (which keep
    the arrays alive).
    """
    if len(args) != len(func.params):
        names = ", ".join(p.name for p in func.params)
        raise ArgumentError(f"{func.name}() takes {len(func.params)} arguments ({names}), got {len(args)}")
    if written is None:
        written = written_buffers(func)
    values: dict[str, Any] = {}
    views: list[ArrayView] = []
    tensors: list[tuple[Var, ArrayView]] = []
    for p, a in zip(func.params, args):
        if isinstance(p.type, DataType):
            values[p.name] = _scalar(func, p, a)
    for p, a in zip(func.params, args):
        if isinstance(p.type, DataType):
            continue
        if isinstance(p.type, TensorMapType):
            values[p.name] = check_tensor_map(func.name, p.name, p.type, a).raw
            continue
        view = _array(func, p, a, device, p in written)
        if isinstance(p.type, TensorType):
            tensors.append((p, view))
        values[p.name] = view.ptr
        views.append(view)
    scalars = {p.name: values[p.name] for p in func.params if isinstance(p.type, DataType) and p.type.is_integer}
    symbols = _bind_shapes(func, tensors, scalars)
    for s in func.shape_params:
        if s.name not in symbols:
            raise ArgumentError(f"{func.name}: shape symbol '{s.name}' is not bound by any argument")
        values[s.name] = symbols[s.name]
    return [values[p.name] for p in func.all_params], symbols, views


def _array(func: Function, p: Var, a: Any, device: str, written: bool) -> ArrayView:
    view = view_of(a, f"{func.name}: argument '{p.name}'")
    if view.device != device:
        raise ArgumentError(f"{func.name}: argument '{p.name}' is on {view.device} but the kernel runs on {device}; move it first")
    if view.dtype != p.type.dtype:
        raise ArgumentError(f"{func.name}: argument '{p.name}' has dtype {view.dtype}, expected {p.type.dtype}")
    if not view.contiguous:
        raise ArgumentError(f"{func.name}: argument '{p.name}' is not contiguous; pass a contiguous copy (e.g. .contiguous() / np.ascontiguousarray)")
    if view.ptr % (view.dtype.nbits >> 3 or 1):
        raise ArgumentError(f"{func.name}: argument '{p.name}' is not aligned to its {view.dtype.nbytes}-byte elements "
                            f"(address {view.ptr:#x}); pass an aligned copy (e.g. np.array(x) / x.clone())")  # fmt: skip
    if written and not view.writable:
        raise ArgumentError(f"{func.name}: argument '{p.name}' is read-only but the kernel writes it; pass a writable "
                            "array (e.g. a copy: np.array(x) / x.copy())")  # fmt: skip
    return view


def _bind_shapes(func: Function, tensors: list[tuple[Var, ArrayView]], scalars: dict[str, int]) -> dict[str, int]:
    """Shape symbols from the arrays' shapes, every dimension checked exactly.

    A dimension is a constant, an integer parameter, a shape symbol (its first occurrence binds
    it) or an expression over those, checked once everything that can be bound is."""
    symbols: dict[str, int] = {}
    compound: list[tuple[Var, ArrayView, int, Any]] = []
    for p, view in tensors:
        t: TensorType = p.type
        if len(view.shape) != t.rank:
            raise ArgumentError(f"{func.name}: argument '{p.name}' has shape {view.shape}, expected rank {t.rank} {t}")
        if 0 in view.shape:
            raise ArgumentError(f"{func.name}: argument '{p.name}' is empty (shape {view.shape})")
        if prod(view.shape) >= 2**31:  # generated index arithmetic is 32-bit
            raise ArgumentError(f"{func.name}: argument '{p.name}' has {prod(view.shape)} elements; tensors of 2**31 or more elements are not supported yet")
        for axis, (dim, actual) in enumerate(zip(t.shape, view.shape)):
            if isinstance(dim, Const):
                expected = dim.value
            elif isinstance(dim, Var):
                expected = scalars.get(dim.name)
                if expected is None:
                    expected = symbols.setdefault(dim.name, actual)
            else:
                compound.append((p, view, axis, dim))
                continue
            if actual != expected:
                _mismatch(func, p, view, axis, dim, expected)
    for p, view, axis, dim in compound:
        try:
            expected = int(evaluate(dim, {**scalars, **symbols}))
        except EvaluationError as exc:
            raise ArgumentError(f"{func.name}: dimension {axis} of '{p.name}' is {dim}, which cannot be evaluated "
                                f"from the arguments ({exc})") from None  # fmt: skip
        if view.shape[axis] != expected:
            _mismatch(func, p, view, axis, dim, expected)
    return symbols


def _mismatch(func: Function, p: Var, view: ArrayView, axis: int, dim: Any, expected: int) -> None:
    what = str(expected) if isinstance(dim, Const) else f"'{dim}' = {expected}"
    raise ArgumentError(f"{func.name}: argument '{p.name}' has shape {view.shape}; dimension {axis} should be {what}")


def scalar_env(func: Function, values: list[Any]) -> dict[Var, Any]:
    """The scalar parameters' values, for evaluating launch expressions."""
    return {p: v for p, v in zip(func.all_params, values) if isinstance(p.type, DataType)}


def eval_launch_dims(func: Function, env: dict[Var, Any], dims: Sequence[Any]) -> tuple[int, int, int]:
    out = [int(evaluate(d, env)) for d in dims] + [1] * (3 - len(dims))
    for d in out:
        if d <= 0:
            raise ArgumentError(f"{func.name}: launch dimension evaluated to {d}; grid and block sizes must be positive")
    return out[0], out[1], out[2]


def eval_dynamic_smem(func: Function, env: dict[Var, Any], launch: LaunchConfig | None = None) -> int:
    """Dynamic shared memory bytes: the kernel's attrs.dynamic_smem plus its shared-tensor pool.

    `launch` is the lowered function's configuration when it differs from `func`'s."""
    launch = launch or func.launch
    if launch.dynamic_smem is None:
        return launch.shared_pool
    smem = int(evaluate(launch.dynamic_smem, env))
    if smem < 0:
        raise ArgumentError(f"{func.name}: attrs.dynamic_smem evaluated to {smem} bytes; it must be >= 0")
    return smem + launch.shared_pool
