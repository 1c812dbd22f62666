"""tessera: a deep-learning compiler built on task mappings, emitting C for CPUs and CUDA for GPUs.

Kernel authors import the names below, e.g.::

    import tessera as ts
    from tessera import f32

    @ts.kernel
    def add(a: f32["n"], b: f32["n"], c: f32["n"]):
        for i in ts.parallel(a.shape[0]):
            c[i] = a[i] + b[i]
"""

from tessera.errors import (
    ArgumentError,
    CompilationError,
    CompilerNotFoundError,
    DeviceError,
    DivisionByZeroError,
    KernelSyntaxError,
    TesseraError,
    UnsupportedError,
)  # fmt: skip
from tessera.ir import fragments
from tessera.ir.dtypes import *  # noqa: F403  (f32, float16, int4, e4m3, ...)
from tessera.ir.dtypes import DataType, dtype
from tessera.ir.mapping import TaskMapping, repeat, spatial
from tessera.ir.types import Swizzle, TensorMapType, VectorType, tensor_map, tensor_map_im2col
from tessera.ir.vector import f32x8, f32x16
from tessera.jit import Kernel, kernel
from tessera.lang.builtins import (
    abs_,
    attrs,
    bitcast,
    block_dim,
    block_idx,
    block_reduce,
    cast,
    ceil,
    ceil_div,
    cluster_sync,
    copy_async,
    copy_async_commit,
    copy_async_wait,
    copy_vector,
    cos,
    dequant,
    erf,
    exp,
    exp2,
    fast_exp2,
    fence_mbarrier_init,
    fence_proxy_async,
    floor,
    fma,
    fmax,
    grid,
    grid_dim,
    ldmatrix,
    load_cluster,
    log,
    log2,
    max_,
    mbarrier_arrive,
    mbarrier_arrive_cluster,
    mbarrier_arrive_expect_tx,
    mbarrier_init,
    mbarrier_wait,
    min_,
    mma,
    named_barrier_arrive,
    named_barrier_sync,
    parallel,
    pow_,
    prefetch,
    ptr,
    reduce_add,
    register_tensor,
    rsqrt,
    select,
    setmaxnreg,
    shared_tensor,
    shfl_down,
    shfl_idx,
    shfl_xor,
    signal_flag,
    sin,
    sqrt,
    stmatrix,
    syncthreads,
    syncwarp,
    tanh,
    thread_idx,
    ticket,
    tma_load,
    tma_load_im2col,
    tma_load_multicast,
    tma_store,
    tma_store_wait,
    unroll,
    vadd,
    vand,
    vbitcast,
    vbroadcast,
    vfloat,
    vfloat16,
    vfma,
    vload,
    vlookup,
    vmax,
    vmin,
    vmul,
    vor,
    vreduce_max,
    vshl,
    vshr,
    vstore,
    vsub,
    vsum,
    vxor,
    wait_flag,
    warp_reduce,
    wgmma,
    wgmma_commit,
    wgmma_fence,
    wgmma_wait,
)  # fmt: skip
from tessera.lang.inline import Inline, inline
from tessera.reporting import explain  # the compile report of anything tessera compiled

__version__ = "0.1.0"

__all__ = [
    "ArgumentError", "CompilationError", "CompilerNotFoundError", "DeviceError", "DivisionByZeroError", "KernelSyntaxError",
    "TesseraError", "UnsupportedError", "DataType", "dtype", "TaskMapping", "repeat", "spatial", "Kernel", "kernel", "Inline", "inline",
    "abs_", "attrs", "block_dim", "block_reduce", "shfl_down", "shfl_idx", "shfl_xor", "warp_reduce", "block_idx", "bitcast", "cast", "ceil", "ceil_div", "cos", "erf", "exp", "exp2", "fast_exp2", "floor",
    "fma", "fmax", "grid", "grid_dim", "log", "log2", "max_", "min_", "parallel", "pow_", "ptr", "register_tensor",
    "rsqrt", "select", "shared_tensor", "sin", "sqrt", "syncthreads", "tanh", "thread_idx", "unroll",
    "Swizzle", "fragments", "copy_vector", "copy_async", "copy_async_commit", "copy_async_wait", "ldmatrix", "stmatrix", "mma",
    "wgmma", "wgmma_fence", "wgmma_commit", "wgmma_wait", "fence_proxy_async", "TensorMapType", "tensor_map",
    "tensor_map_im2col", "tma_load_im2col",
    "mbarrier_init", "fence_mbarrier_init", "mbarrier_arrive", "mbarrier_arrive_expect_tx", "mbarrier_wait",
    "tma_load", "tma_store", "tma_store_wait", "setmaxnreg", "syncwarp", "cluster_sync", "load_cluster", "tma_load_multicast", "mbarrier_arrive_cluster", "signal_flag", "wait_flag", "reduce_add", "ticket", "explain", "named_barrier_sync", "named_barrier_arrive",
    "VectorType", "f32x8", "f32x16", "vload", "vstore", "vbroadcast", "vfma", "vadd", "vsub", "vmul", "vmax", "vmin",
    "vsum", "vreduce_max", "vand", "vor", "vxor", "vshl", "vshr", "vfloat", "vfloat16", "vbitcast", "vlookup", "prefetch", "dequant",
]  # fmt: skip


def __getattr__(name: str):
    # The model compiler loads on first use, so `import tessera` needs neither torch nor onnx:
    # tessera.onnx.load(...) imports the ONNX front end, tessera.graph the graph layer.
    if name in ("onnx", "graph"):
        import importlib

        return importlib.import_module("tessera.frontend.onnx" if name == "onnx" else "tessera.graph")
    if name in ("quant", "quantize"):  # low-bit weights (quantize needs torch)
        import importlib

        if name == "quant":
            return importlib.import_module("tessera.quant")
        return importlib.import_module("tessera.eager.quantize").quantize
    raise AttributeError(f"module 'tessera' has no attribute {name!r}")
