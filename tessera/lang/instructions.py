"""Front end of the memory and tensor-core instructions (tessera.ir.instructions).

Kernels name memory operands as tensor elements, `ts.copy_async(As[s, r, c], A[m, k])`; the
element reads the expression parser builds for them become addresses here.
"""

from __future__ import annotations

import inspect
from typing import Any

from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.instructions import CPU_ONLY, INSTRUCTIONS, check_instruction
from tessera.ir.types import TensorMapType


class InstructionError(Exception):
    """A malformed instruction use; the parser reports it at the current line."""


def _copy_vector(dst: Any, src: Any, bytes: int = 16) -> tuple[tuple, dict]:
    return (dst, src), {"bytes": bytes}


def _copy_async(dst: Any, src: Any, bytes: int = 16, pred: Any = True) -> tuple[tuple, dict]:
    return (dst, src, pred), {"bytes": bytes}


def _copy_async_wait(pending: int) -> tuple[tuple, dict]:
    return (), {"pending": pending}


def _wgmma_wait(pending: int, *fenced: Any) -> tuple[tuple, dict]:
    return fenced, {"pending": pending}


def _ldmatrix(dst: Any, src: Any, num: int = 4, trans: bool = False) -> tuple[tuple, dict]:
    return (dst, src), {"num": num, "trans": trans}


def _stmatrix(dst: Any, src: Any, num: int = 4, trans: bool = False) -> tuple[tuple, dict]:
    return (dst, src), {"num": num, "trans": trans}


def _mma(c: Any, a: Any, b: Any, shape: str = "m16n8k16") -> tuple[tuple, dict]:
    return (c, a, b), {"shape": shape}


def _wgmma(d: Any, a: Any, b: Any, n: int, trans_b: bool = False) -> tuple[tuple, dict]:
    # With trans_b the descriptor needs the byte stride of B's 64-column chunks: read it off
    # B's shared tensor type, [..., n / 64, k, 64] (checked in tessera.ir.instructions).
    chunk = 0
    if trans_b is True and isinstance(b, E.Load):
        k = getattr(b.buffer.type.shape[-2], "value", 0) if getattr(b.buffer.type, "rank", 0) >= 2 else 0
        chunk = int(k) * 128
    return (d, a, b), {"n": n, "trans_b": trans_b, "b_chunk_bytes": chunk}


def _mbarrier_init(bar: Any, count: Any) -> tuple[tuple, dict]:
    return (bar, count), {}


def _mbarrier_arrive(bar: Any) -> tuple[tuple, dict]:
    return (bar,), {}


def _mbarrier_arrive_expect_tx(bar: Any, bytes: Any) -> tuple[tuple, dict]:
    return (bar, bytes), {}


def _mbarrier_wait(bar: Any, parity: Any) -> tuple[tuple, dict]:
    return (bar, parity), {}


def _tma_load(dst: Any, tensor_map: Any, bar: Any, *coords: Any) -> tuple[tuple, dict]:
    return (dst, tensor_map, bar, *coords), {}


def _tma_store(tensor_map: Any, src: Any, *coords: Any) -> tuple[tuple, dict]:
    return (tensor_map, src, *coords), {}


def _tma_store_wait(pending: int = 0) -> tuple[tuple, dict]:
    return (), {"pending": pending}


def _tma_load_multicast(dst: Any, tensor_map: Any, bar: Any, mask: Any, *coords: Any) -> tuple[tuple, dict]:
    return (dst, tensor_map, bar, mask, *coords), {}


def _mbarrier_arrive_cluster(bar: Any, rank: Any) -> tuple[tuple, dict]:
    return (bar, rank), {}


def _flag(flag: Any, value: Any) -> tuple[tuple, dict]:
    return (flag, value), {}


def _reduce_add(dst: Any, src: Any, bytes: int = 16) -> tuple[tuple, dict]:
    return (dst, src), {"bytes": bytes}


def _ticket(counter: Any, add: Any, old: Any) -> tuple[tuple, dict]:
    return (counter, add, old), {}


def _load_cluster(dst: Any, src: Any, rank: Any, bytes: int = 16) -> tuple[tuple, dict]:
    return (dst, src, rank), {"bytes": bytes}


def _named_barrier(id: Any, threads: Any) -> tuple[tuple, dict]:
    return (id, threads), {}


def _setmaxnreg(regs: int, increase: bool) -> tuple[tuple, dict]:
    return (), {"regs": regs, "increase": increase}


def _vstore(dst: Any, value: Any, count: Any = None) -> tuple[tuple, dict]:
    return ((dst, value) if count is None else (dst, value, count)), {}


def _prefetch(address: Any, write: bool = False, locality: int = 3) -> tuple[tuple, dict]:
    return (address,), {"write": write, "locality": locality}


def _dequant(dst: Any, src: Any, scale: Any = None, bias: Any = None, wtype: Any = None, start: int = 0,
             count: int = 8, raw: bool = False) -> tuple[tuple, dict]:  # fmt: skip
    # without a scale the values are (code - bias) exactly (the kernel scales the fp32 sums);
    # raw: the bits alone, code + lowbit.raw_magic (the kernel subtracts too)
    attrs = {"wtype": wtype, "start": start, "count": count, "has_bias": bias is not None, "has_scale": scale is not None,
             "raw": raw}  # fmt: skip
    scale = dst if scale is None else scale  # placeholders: unused operands
    return (dst, src, scale, scale if bias is None else bias), attrs


def _no_operands() -> tuple[tuple, dict]:
    return (), {}


# Python signatures of the kernel-facing calls (defaults live here, validation in ir).
SIGNATURES = {
    "copy_vector": _copy_vector, "copy_async": _copy_async, "copy_async_commit": _no_operands,
    "copy_async_wait": _copy_async_wait, "ldmatrix": _ldmatrix, "stmatrix": _stmatrix, "mma": _mma, "wgmma": _wgmma,
    "wgmma_fence": _no_operands, "wgmma_commit": _no_operands, "wgmma_wait": _wgmma_wait,
    "fence_proxy_async": _no_operands, "mbarrier_init": _mbarrier_init, "fence_mbarrier_init": _no_operands,
    "mbarrier_arrive": _mbarrier_arrive, "mbarrier_arrive_expect_tx": _mbarrier_arrive_expect_tx,
    "mbarrier_wait": _mbarrier_wait, "tma_load": _tma_load, "tma_load_im2col": _tma_load,
    "tma_load_multicast": _tma_load_multicast, "tma_store": _tma_store, "tma_store_wait": _tma_store_wait,
    "mbarrier_arrive_cluster": _mbarrier_arrive_cluster,
    "signal_flag": _flag, "wait_flag": _flag, "reduce_add": _reduce_add, "ticket": _ticket, "setmaxnreg": _setmaxnreg, "syncwarp": _no_operands,
    "cluster_sync": _no_operands, "load_cluster": _load_cluster, "vstore": _vstore, "prefetch": _prefetch,
    "dequant": _dequant, "named_barrier_sync": _named_barrier, "named_barrier_arrive": _named_barrier,
}  # fmt: skip


def _operand(kind: str, value: Any) -> E.Expr:
    if kind == "addr":
        if isinstance(value, E.Load):
            return E.Address(value.buffer, value.indices)
        raise InstructionError("memory operands must be tensor elements such as buf[i, j]")
    if kind == "tmap":
        if isinstance(value, E.Var) and isinstance(value.type, TensorMapType):
            return value
        raise InstructionError("the map operand must be a tensor-map parameter (annotated ts.tensor_map(dtype, box))")
    if isinstance(value, bool):
        return E.Const(value, E.dtypes.boolean)
    if kind == "int" and isinstance(value, int):
        return E.Const(value, E.dtypes.int32 if -(2**31) <= value < 2**31 else E.dtypes.int64)
    if not isinstance(value, E.Expr):
        raise InstructionError(f"operand {value!r} is not a kernel value")
    return value


def build_instruction(name: str, target: str, args: list[Any], kwargs: dict[str, Any]) -> S.Instruction:
    """Bind a call's arguments, check them and build the Instruction statement."""
    spec = INSTRUCTIONS[name]
    if spec.gpu_only and target != "cuda":
        raise InstructionError(f"{name}() is only available in CUDA kernels")
    if name in CPU_ONLY and target != "cpu":
        raise InstructionError(f"{name}() is only available in CPU kernels")
    signature = SIGNATURES[name]
    try:
        inspect.signature(signature).bind(*args, **kwargs)
    except TypeError as exc:
        raise InstructionError(f"{name}{inspect.signature(signature)}: {exc}") from None
    raw_operands, attrs = signature(*args, **kwargs)
    for key, value in attrs.items():
        if isinstance(value, E.Expr):
            raise InstructionError(f"{name}()'s {key}= must be a compile-time constant")
    kinds = spec.kinds(len(raw_operands))
    if kinds is None:
        raise InstructionError(f"{name} takes {len(spec.operands)} operand(s), got {len(raw_operands)}")
    operands = tuple(_operand(kind, v) for kind, v in zip(kinds, raw_operands))
    error = check_instruction(name, operands, attrs)
    if error:
        raise InstructionError(error)
    return S.Instruction(name, operands, attrs)
