"""lowbit_linear on the CPU (float32 x): the kernels of tessera.templates.lowbit.cpu_kernels.

The operator's tensor-core words are re-laid once into the CPU row layout (the tensor-core layout
scatters a row's k over 32 lanes; SIMD decoding wants consecutive k); scales and biases are read
as they are.  Up to CPU_DECODE_ROWS rows of x (a decode step) run make_linear_decode, the codes
decoded in vector registers; more rows run make_linear_rows, each tile of W decoded once into a
float32 workspace and reused by every row of x.

* `plan_lowbit_linear_cpu`: the graph compiler's anchor, specialised to its shapes, the epilogue
  fused into the stores;
* `cpu_linear`: the same kernels unspecialised, for QuantizedLinear called outside torch.compile
  (built once per type, group and row count, whatever the layer's N and K).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from tessera.backend.isa import vector_lanes
from tessera.errors import ArgumentError, UnsupportedError
from tessera.ir import dtypes, lowbit
from tessera.quant.layout import pack_rows, unpack_units
from tessera.templates.cpu.gemm import MIN_PARALLEL_MACS, cpu_threads, lanes_or_refuse
from tessera.templates.epilogue import Epilogue, fuse_epilogue, identity_epilogue
from tessera.templates.kernel import CONSTANT, EXTRA, INPUT, OUTPUT, AnchorPlan, Launch
from tessera.templates.lowbit.cpu_kernels import kernel_group, make_linear_decode, make_linear_rows
from tessera.templates.lowbit.plan import matrix_rows
from tessera.templates.rewrite import rename, specialize

CPU_TILE_ROWS = 4  # rows of x (mr) and of W (nr) per register tile of the CPU row kernel
CPU_DECODE_ROWS = 4  # up to this many rows of x, the CPU decodes W in registers (make_linear_decode)


# Re-laid words per graph constant: a symbolic row count makes a plan per new M, and each would
# otherwise unpack and repack every weight again (keyed by the words array's id while it lives).
_ROW_WORDS: dict[tuple, np.ndarray] = {}


def cpu_row_words(words: np.ndarray, attrs: dict[str, Any]) -> np.ndarray:
    """The CPU row kernel's weights from the graph operator's words: the same codes in the row
    layout (tessera.quant.layout.pack_rows), made once per words array (read-only, shared by
    the plans of every M)."""

    t = dtypes.dtype(attrs["wtype"])
    key = (id(words), words.shape, t.name, attrs["n"], attrs["k"], attrs.get("span", 16))
    rows = _ROW_WORDS.get(key)
    if rows is None:
        rows = pack_rows(unpack_units(words, t, attrs["n"], attrs["k"], attrs.get("span", 16)), t)
        rows.flags.writeable = False
        try:
            weakref.finalize(words, _ROW_WORDS.pop, key, None)  # (an id is reused once its array is gone)
        except TypeError:  # not weak-referenceable: no cache
            return rows
        _ROW_WORDS[key] = rows
    return rows


def cpu_kernels_take(group_size: int, k: int) -> bool:
    """Whether the row-layout kernels take groups of `group_size` over K = k (tessera.templates.lowbit.
    cpu_kernels.kernel_group) on this machine (AVX2 or AVX-512)."""

    return vector_lanes() > 1 and kernel_group(group_size, k) is not None


def _cpu_kernel(m: int, n: int, k: int, attrs: dict[str, Any]) -> tuple[Any, str, tuple[int, ...], int]:
    """(kernel, name, config, workspace floats per worker or 0) for m rows of x: the one choice of
    kernel, workers and tile that the anchor and the eager path share."""

    t, gs, has_bias = dtypes.dtype(attrs["wtype"]), kernel_group(attrs["group_size"], k), bool(attrs["has_bias"])
    if gs is None:
        raise UnsupportedError(f"the CPU low-bit kernels take groups of 8 to 256 that divide 256, multiples of 256 or "
                               f"one per channel, not {attrs['group_size']} over K = {k}")  # fmt: skip
    lanes = lanes_or_refuse()
    # decoding costs per weight whatever M is: count it as 4 rows of multiply-adds
    threads = cpu_threads() if max(m, 4) * n * k >= MIN_PARALLEL_MACS else 1
    if m <= CPU_DECODE_ROWS:  # a decode step: the codes decoded in registers
        kernel = make_linear_decode(t, gs, has_bias, threads, m)
        return kernel, f"lowbit_linear_cpu_{t.name}_decode_m{m}_t{threads}", (m, 1, 8, threads), 0
    mr, nr = min(CPU_TILE_ROWS, m), CPU_TILE_ROWS
    kernel = make_linear_rows(t, gs, has_bias, lanes, threads, mr, nr)
    kp = -(-k // lowbit.UNIT_K) * lowbit.UNIT_K
    return kernel, f"lowbit_linear_cpu_{t.name}_{mr}x{nr}_t{threads}", (mr, nr, lanes, threads), nr * kp


def plan_lowbit_linear_cpu(x_shape: tuple[int, ...], attrs: dict[str, Any], words: np.ndarray,
                           scales: tuple[int, int], biases: tuple[int, int],
                           epilogue: Epilogue | None = None, inputs: int = 4) -> AnchorPlan:  # fmt: skip
    """lowbit_linear on the CPU: float32 x [M, K], the epilogue fused into the stores; `words`
    is the operator's constant data (re-laid here, once), its input slot is never read, nor is
    a fifth (`inputs` 5: the fragment-order words a CUDA compile of the same graph added)."""
    n, k = attrs["n"], attrs["k"]
    m, out_shape, rows_of = matrix_rows(x_shape, n, k)
    kernel, name, config, workspace = _cpu_kernel(m, n, k, attrs)
    rows = cpu_row_words(words, attrs)
    ep = epilogue if epilogue is not None else identity_epilogue(out_shape, dtypes.float32)
    plan = AnchorPlan("lowbit_linear", [], out_shape, ep.output.dtype, inputs, len(ep.extras), target="cpu",
                      constants=[rows])  # fmt: skip
    shapes = {"X": (m, k), "Wr": rows.shape, "S": scales, "B": biases, "Y": (m, n)}
    slots = [(INPUT, 0), (CONSTANT, 0), (INPUT, 2), (INPUT, 3), (OUTPUT, 0)]
    if workspace:
        shapes["Wf"] = (config[-1], workspace)
        slots.append(plan.workspace(shapes["Wf"], dtypes.float32))
    f = rename(fuse_epilogue(specialize(kernel.ir, shapes), "Y", rows_of, ep), name)
    plan.launches.append(Launch(f, [*slots, *((EXTRA, i) for i in range(len(ep.extras)))]))
    plan.config = config
    return plan


def cpu_linear(x: np.ndarray, rows: np.ndarray, scales: np.ndarray, biases: np.ndarray,
               attrs: dict[str, Any]) -> np.ndarray:  # fmt: skip
    """x [M, K] float32 @ W^T -> [M, N] float32 on the anchor's kernels, from the codes in the row
    layout (tessera.quant.layout.pack_rows), the lowbit_linear operator's scales and biases
    (float16, a [1, 1] placeholder without biases) and its attributes."""
    n, k = attrs["n"], attrs["k"]
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != k:
        raise ArgumentError(f"x must be float32 [M, {k}], got {list(x.shape)}")
    m = x.shape[0]
    y = np.empty((m, n), np.float32)
    if m == 0:  # (the kernels read row min(r, M - 1) of x)
        return y
    kernel, _, config, workspace = _cpu_kernel(m, n, k, attrs)
    extra = [np.empty((config[-1], workspace), np.float32)] if workspace else []
    kernel(x, rows, scales, biases, y, *extra)
    return y
