"""Names that kernels use: hardware indices, memory, loops, casts and math intrinsics.

These objects are markers: the parser recognises them by identity and turns their uses
into IR.  Calling them from ordinary Python raises an error that says so.
"""

from __future__ import annotations

from typing import Any

from tessera.ir.dtypes import DataType
from tessera.ir.intrinsics import INTRINSICS
from tessera.ir.types import PointerType


class Builtin:
    """A kernel-only name.  `kind` tells the parser how to treat it."""

    def __init__(self, name: str, kind: str):
        self.name, self.kind = name, kind

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"tessera.{self.name} can only be used inside a @tessera.kernel function")

    def __repr__(self) -> str:
        return f"<tessera builtin {self.name}>"


# Hardware indices: thread_idx.x, block_idx.y, ...
thread_idx = Builtin("threadIdx", "hwindex")
block_idx = Builtin("blockIdx", "hwindex")
block_dim = Builtin("blockDim", "hwindex")
grid_dim = Builtin("gridDim", "hwindex")

# Launch configuration, set by assignment inside the kernel: attrs.grid = (...), attrs.block = 256.
attrs = Builtin("attrs", "attrs")

# Statements and memory.
syncthreads = Builtin("syncthreads", "barrier")
register_tensor = Builtin("register_tensor", "alloc")
shared_tensor = Builtin("shared_tensor", "alloc")

# Loop iterators.
unroll = Builtin("unroll", "loop")
parallel = Builtin("parallel", "loop")
grid = Builtin("grid", "loop")

# Expressions.
cast = Builtin("cast", "cast")
bitcast = Builtin("bitcast", "bitcast")  # the same bits read as another dtype of the same width
ceil_div = Builtin("ceil_div", "ceil_div")
select = Builtin("select", "select")

# Collectives: every thread of the warp (block) must reach them; all get the result.
warp_reduce = Builtin("warp_reduce", "collective")
block_reduce = Builtin("block_reduce", "collective")

# Memory and tensor-core instructions (tessera.ir.instructions): statements, CUDA only except
# copy_vector.  Memory operands are tensor elements: ts.copy_vector(r[0], x[i, j], bytes=16).
copy_vector = Builtin("copy_vector", "instruction")
copy_async = Builtin("copy_async", "instruction")
copy_async_commit = Builtin("copy_async_commit", "instruction")
copy_async_wait = Builtin("copy_async_wait", "instruction")
ldmatrix = Builtin("ldmatrix", "instruction")
stmatrix = Builtin("stmatrix", "instruction")
mma = Builtin("mma", "instruction")
wgmma = Builtin("wgmma", "instruction")
wgmma_fence = Builtin("wgmma_fence", "instruction")
wgmma_commit = Builtin("wgmma_commit", "instruction")
wgmma_wait = Builtin("wgmma_wait", "instruction")
fence_proxy_async = Builtin("fence_proxy_async", "instruction")
# Hopper asynchronous pipelines: mbarriers, TMA loads and per-warpgroup register budgets.
mbarrier_init = Builtin("mbarrier_init", "instruction")
fence_mbarrier_init = Builtin("fence_mbarrier_init", "instruction")
mbarrier_arrive = Builtin("mbarrier_arrive", "instruction")
mbarrier_arrive_expect_tx = Builtin("mbarrier_arrive_expect_tx", "instruction")
mbarrier_wait = Builtin("mbarrier_wait", "instruction")
tma_load = Builtin("tma_load", "instruction")
tma_load_im2col = Builtin("tma_load_im2col", "instruction")
setmaxnreg = Builtin("setmaxnreg", "instruction")
syncwarp = Builtin("syncwarp", "instruction")
named_barrier_sync = Builtin("named_barrier_sync", "instruction")
named_barrier_arrive = Builtin("named_barrier_arrive", "instruction")
cluster_sync = Builtin("cluster_sync", "instruction")
load_cluster = Builtin("load_cluster", "instruction")
tma_load_multicast = Builtin("tma_load_multicast", "instruction")
# Shared -> global by TMA (a bulk group each) and the wait before the source is written again.
tma_store = Builtin("tma_store", "instruction")
tma_store_wait = Builtin("tma_store_wait", "instruction")
mbarrier_arrive_cluster = Builtin("mbarrier_arrive_cluster", "instruction")
# Flags in global memory between blocks of one grid (release / acquire at GPU scope).
signal_flag = Builtin("signal_flag", "instruction")
wait_flag = Builtin("wait_flag", "instruction")
# Sums between blocks: float32 adds at the L2, and a counter whose old value says who came last.
reduce_add = Builtin("reduce_add", "instruction")
ticket = Builtin("ticket", "instruction")
# Low-bit weights (tessera.ir.lowbit): unpack packed uint32 words into fp16 mma fragments.
dequant = Builtin("dequant", "instruction")

# SIMD vectors (CPU kernels; tessera.ir.vector): values of type f32x16 / f32x8 (and int32 / uint32 lanes).
vstore = Builtin("vstore", "instruction")
prefetch = Builtin("prefetch", "instruction")
vload = Builtin("vload", "vector")
vbroadcast = Builtin("vbroadcast", "vector")
vfma = Builtin("vfma", "vector")
vadd, vsub, vmul = Builtin("vadd", "vector"), Builtin("vsub", "vector"), Builtin("vmul", "vector")
vmax, vmin = Builtin("vmax", "vector"), Builtin("vmin", "vector")
vsum, vreduce_max = Builtin("vsum", "vector"), Builtin("vreduce_max", "vector")
# integer lanes (int32 / uint32): bit operations, conversion to float32 and table lookups
vand, vor, vxor = Builtin("vand", "vector"), Builtin("vor", "vector"), Builtin("vxor", "vector")
vshl, vshr = Builtin("vshl", "vector"), Builtin("vshr", "vector")
vfloat, vbitcast, vlookup = Builtin("vfloat", "vector"), Builtin("vbitcast", "vector"), Builtin("vlookup", "vector")
vfloat16 = Builtin("vfloat16", "vector")

_intrinsics = {name: Builtin(name, "intrinsic") for name in INTRINSICS}
exp, exp2, log, log2 = (_intrinsics[n] for n in ("exp", "exp2", "log", "log2"))
fast_exp2, fmax = _intrinsics["fast_exp2"], _intrinsics["fmax"]
sqrt, rsqrt, sin, cos, tanh, erf = (_intrinsics[n] for n in ("sqrt", "rsqrt", "sin", "cos", "tanh", "erf"))
floor, ceil, round_ = _intrinsics["floor"], _intrinsics["ceil"], _intrinsics["round"]
pow_, fma = _intrinsics["pow"], _intrinsics["fma"]
abs_, max_, min_ = _intrinsics["abs"], _intrinsics["max"], _intrinsics["min"]
shfl_xor, shfl_down, shfl_idx = _intrinsics["shfl_xor"], _intrinsics["shfl_down"], _intrinsics["shfl_idx"]


def ptr(dtype: DataType) -> PointerType:
    """Annotation for a raw pointer parameter: `x: ptr(f32)`."""
    return PointerType(dtype)


def python_equivalents() -> dict[Any, Builtin]:
    """Python built-ins and math functions that kernels may use in place of ours."""
    import builtins
    import math

    out: dict[Any, Builtin] = {builtins.abs: abs_, builtins.max: max_, builtins.min: min_, builtins.pow: pow_}
    for name in ("exp", "exp2", "log", "log2", "sqrt", "sin", "cos", "tanh", "erf", "floor", "ceil"):
        if hasattr(math, name):
            out[getattr(math, name)] = _intrinsics[name]
    out[math.pow] = pow_
    return out
