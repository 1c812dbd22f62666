"""Front end of the memory and tensor-core instructions (tessera.ir.instructions).

Kernels name memory operands as tensor elements, `ts.copy_async(As[s, r, c], A[m, k])`; the
element reads the expression parser builds for them become addresses here.
"""

from __future__ import annotations

import inspect
from typing import Any

from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.instructions import INSTRUCTIONS, check_instruction


class InstructionError(Exception):
    """A malformed instruction use; the parser reports it at the current line."""


def _copy_vector(dst: Any, src: Any, bytes: int = 16) -> tuple[tuple, dict]:
    return (dst, src), {"bytes": bytes}


def _copy_async(dst: Any, src: Any, bytes: int = 16, pred: Any = True) -> tuple[tuple, dict]:
    return (dst, src, pred), {"bytes": bytes}


def _copy_async_wait(pending: int) -> tuple[tuple, dict]:
    return (), {"pending": pending}


def _ldmatrix(dst: Any, src: Any, num: int = 4, trans: bool = False) -> tuple[tuple, dict]:
    return (dst, src), {"num": num, "trans": trans}


def _mma(c: Any, a: Any, b: Any, shape: str = "m16n8k16") -> tuple[tuple, dict]:
    return (c, a, b), {"shape": shape}


def _wgmma(d: Any, a: Any, b: Any, n: int) -> tuple[tuple, dict]:
    return (d, a, b), {"n": n}


def _no_operands() -> tuple[tuple, dict]:
    return (), {}


# Python signatures of the kernel-facing calls (defaults live here, validation in ir).
SIGNATURES = {
    "copy_vector": _copy_vector, "copy_async": _copy_async, "copy_async_commit": _no_operands,
    "copy_async_wait": _copy_async_wait, "ldmatrix": _ldmatrix, "mma": _mma, "wgmma": _wgmma,
    "wgmma_fence": _no_operands, "wgmma_commit": _no_operands, "wgmma_wait": _copy_async_wait,
    "fence_proxy_async": _no_operands,
}  # fmt: skip


def _operand(kind: str, value: Any) -> E.Expr:
    if kind == "addr":
        if isinstance(value, E.Load):
            return E.Address(value.buffer, value.indices)
        raise InstructionError("memory operands must be tensor elements such as buf[i, j]")
    if isinstance(value, bool):
        return E.Const(value, E.dtypes.boolean)
    if not isinstance(value, E.Expr):
        raise InstructionError(f"operand {value!r} is not a kernel value")
    return value


def build_instruction(name: str, target: str, args: list[Any], kwargs: dict[str, Any]) -> S.Instruction:
    """Bind a call's arguments, check them and build the Instruction statement."""
    spec = INSTRUCTIONS[name]
    if spec.gpu_only and target != "cuda":
        raise InstructionError(f"{name}() is only available in CUDA kernels")
    signature = SIGNATURES[name]
    try:
        inspect.signature(signature).bind(*args, **kwargs)
    except TypeError as exc:
        raise InstructionError(f"{name}{inspect.signature(signature)}: {exc}") from None
    raw_operands, attrs = signature(*args, **kwargs)
    for key, value in attrs.items():
        if isinstance(value, E.Expr):
            raise InstructionError(f"{name}()'s {key}= must be a compile-time constant")
    operands = tuple(_operand(kind, v) for kind, v in zip(spec.operands, raw_operands))
    error = check_instruction(name, operands, attrs)
    if error:
        raise InstructionError(error)
    return S.Instruction(name, operands, attrs)
