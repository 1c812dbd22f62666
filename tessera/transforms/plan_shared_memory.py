"""Place a CUDA kernel's shared tensors in one dynamic shared-memory pool when they need more
than the 48 KiB that static `__shared__` arrays may use.

Offsets are assigned in declaration order (`pool_layout`): swizzled tensors and any of 1 KiB or
more at 1024-byte boundaries (wgmma's swizzled 8-row groups must start at 1024-byte addresses),
smaller ones at 128-byte boundaries (what a TMA box needs; mbarriers need 8), so that a
kernel's handful of 32-byte barrier arrays do not take a KiB each.  The pool size is
recorded in `LaunchConfig.shared_pool`; the CUDA code generator
carves the tensors from `extern __shared__` memory at the same offsets (via
`shared_buffer_offsets`) and the runtime adds the pool to the launch's dynamic size.
"""

from __future__ import annotations

from dataclasses import replace

from tessera.errors import UnsupportedError
from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.evaluate import evaluate
from tessera.ir.func import CUDA_KERNEL, Function
from tessera.ir.functor import IRVisitor
from tessera.ir.types import SHARED
from tessera.target import SM90, Architecture, Target

STATIC_LIMIT = 48 * 1024
ALIGN = 1024
SMALL_ALIGN = 128  # unswizzled tensors under ALIGN bytes


def pool_layout(tensors: list[tuple[int, bool]]) -> tuple[list[int], int]:
    """Byte offsets of tensors given as (bytes, swizzled) in declaration order, and the pool's size."""
    offsets, total = [], 0
    for nbytes, swizzled in tensors:
        align = ALIGN if swizzled or nbytes >= ALIGN else SMALL_ALIGN
        total = -(-total // align) * align
        offsets.append(total)
        total += nbytes
    return offsets, -(-total // SMALL_ALIGN) * SMALL_ALIGN


class _SharedBuffers(IRVisitor):
    def __init__(self) -> None:
        self.found: list[E.Var] = []

    def visit_DeclareBuffer(self, s: S.DeclareBuffer) -> None:
        if s.var.type.scope == SHARED:
            self.found.append(s.var)


def shared_buffer_offsets(func: Function) -> tuple[dict[E.Var, int], int]:
    """Byte offset of each shared tensor in declaration order, and the total size."""
    finder = _SharedBuffers()
    finder.visit(func.body)
    tensors = []
    for var in finder.found:
        t = var.type
        size = 1
        for d in t.shape:
            try:
                size *= int(evaluate(d, {}))
            except Exception:  # noqa: BLE001  (a variable: not a compile-time size)
                raise UnsupportedError(f"shared tensor '{var.name}' needs a compile-time shape, got {t}") from None
        tensors.append((size * t.dtype.nbytes, t.swizzle is not None))
    offsets, total = pool_layout(tensors)
    return dict(zip(finder.found, offsets)), total


def plan_shared_memory(func: Function, target: Target | Architecture = SM90) -> Function:
    """Move `func`'s shared tensors to one dynamic pool when they exceed the static limit; refuse
    a pool larger than `target`'s shared memory per block (the kernels are built for sm_90a)."""
    if func.kind != CUDA_KERNEL:
        return func
    _, total = shared_buffer_offsets(func)
    if total <= STATIC_LIMIT:
        return func
    if func.launch.dynamic_smem is not None:
        raise UnsupportedError(
            f"{func.name}: shared tensors need {total} bytes (> 48 KiB, so they move to dynamic shared memory) "
            "and attrs.dynamic_smem is also set; drop attrs.dynamic_smem, the size is computed for you"
        )
    if total > target.smem_per_block:
        raise UnsupportedError(f"{func.name}: shared tensors need {total} bytes; "
                               f"a {target.name} block has at most {target.smem_per_block // 1024} KiB")  # fmt: skip
    out = func.with_body(func.body)
    out.launch = replace(func.launch, shared_pool=total)
    return out
