"""Max pooling on the CPU as an anchor: the row kernel of tessera.templates.cpu.pool_kernel, float32 NCHW,
with the elementwise tail after it fused into its stores (post-scheduling fusion, as the GEMMs)."""

from __future__ import annotations

from collections.abc import Sequence

from tessera.errors import ArgumentError
from tessera.ir import dtypes
from tessera.ir.dtypes import DataType
from tessera.ops.geometry import window_output
from tessera.templates.cpu.gemm import check_f32, cpu_threads
from tessera.templates.cpu.pool_kernel import make_max_pool2d
from tessera.templates.epilogue import Epilogue, fuse_epilogue, identity_epilogue
from tessera.templates.gemm.plan import check_epilogue, check_shape
from tessera.templates.kernel import EXTRA, INPUT, OUTPUT, AnchorPlan, Launch
from tessera.templates.rewrite import i32, rename, specialize

# Below this many output elements the pool runs on one thread (an OpenMP team's start and join cost more).
MIN_PARALLEL_OUTPUTS = 1 << 15


def plan_cpu_max_pool2d(x_shape: Sequence[int], kernel: tuple[int, int], stride: tuple[int, int],
                        padding: tuple[int, int], dtype: DataType | str = "float32", *, ceil_mode: bool = False,
                        epilogue: Epilogue | None = None) -> AnchorPlan:  # fmt: skip
    """max_pool2d of an NCHW float32 x (padding is -inf and at most half the kernel; dilation 1):
    input [x], the epilogue (its acc the pooled tensor) fused into the stores."""
    dt = check_f32(dtype, "max_pool2d")
    x_shape = check_shape(x_shape, "x", "max_pool2d")
    if len(x_shape) != 4:
        raise ArgumentError(f"max_pool2d: x must be NCHW, got shape {x_shape}")
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    if min(kh, kw, sh, sw) < 1 or not (0 <= 2 * ph <= kh and 0 <= 2 * pw <= kw):
        raise ArgumentError(f"max_pool2d: kernel {kernel} and stride {stride} must be positive and padding "
                            f"{padding} between 0 and half the kernel")  # fmt: skip
    n, c, h, w = x_shape
    oh, ow = window_output(h, kh, sh, ph, ph, 1, ceil_mode), window_output(w, kw, sw, pw, pw, 1, ceil_mode)
    if oh < 1 or ow < 1:
        raise ArgumentError(f"max_pool2d: the output would be empty ({oh}x{ow}) for input {x_shape} and kernel {kernel}")
    out_shape = (n, c, oh, ow)
    check_epilogue(epilogue, out_shape, "max_pool2d")
    ep = epilogue or identity_epilogue(out_shape, dt)
    threads = cpu_threads() if n * c * oh * ow >= MIN_PARALLEL_OUTPUTS else 1
    f = make_max_pool2d((kh, kw), (sh, sw), (ph, pw), w, ow, threads).ir
    f = specialize(f, {"X": (n * c, h, w), "C": (n * c, oh, ow)})
    f = fuse_epilogue(f, "C", lambda nc, y, x: (nc // i32(c), nc % i32(c), y, x), ep)
    plan = AnchorPlan("max_pool2d", [], out_shape, dtypes.float32, 1, len(ep.extras), target="cpu")
    plan.out_dtype = ep.output.dtype
    extras = [(EXTRA, j) for j in range(plan.num_extras)]
    plan.launches.append(Launch(rename(f, f"max_pool2d_{kh}x{kw}_s{sh}x{sw}_t{threads}"), [(INPUT, 0), (OUTPUT, 0), *extras]))
    return plan
