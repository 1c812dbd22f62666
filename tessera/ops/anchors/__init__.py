"""Anchor operators on tuned kernel templates, with post-scheduling epilogue fusion (Hidet).

The graph compiler hands each anchor (matmul, linear, conv2d; attention from GEMMs + softmax) and the elementwise tail that
follows it to `prepare_*`, which specialises a tensor-core GEMM template to the shapes, folds
the tail into the template's output stores (`fuse_epilogue`) and compiles everything in one
nvcc run.  The resulting `AnchorKernel` is called on torch CUDA tensors without allocating::

    from tessera import ops
    from tessera.ops.anchors import Epilogue, prepare_linear

    acc = ops.placeholder((16, 4096), "float16", "acc")
    k = prepare_linear((16, 1024), (4096, 1024), "float16", bias=True,
                       epilogue=Epilogue(acc, ops.gelu(acc), []))
    k([x, w, b], out)            # out = gelu(x @ w.T + b), one GEMM kernel

On the CPU, `tessera.ops.anchors.cpu_gemm` (`plan_cpu_linear`, `plan_cpu_matmul`;
`cpu_conv.plan_cpu_conv2d`; `plan_attention(..., target="cpu")`) does the same for float32 on the x86
micro-kernel of tessera.kernels.cpu_gemm; `.load()` gives a CpuAnchorKernel called on numpy arrays.
"""

from tessera.ops.anchors.attention import plan_attention, prepare_attention
from tessera.ops.anchors.conv import plan_conv2d, prepare_conv2d
from tessera.ops.anchors.epilogue import Epilogue, EpilogueError, compose, fuse_epilogue, identity_epilogue
from tessera.ops.anchors.gemm import plan_linear, plan_matmul, prepare_linear, prepare_matmul
from tessera.ops.anchors.kernel import AnchorKernel, AnchorPlan

__all__ = [
    "AnchorKernel", "AnchorPlan", "Epilogue", "EpilogueError", "compose", "fuse_epilogue", "identity_epilogue",
    "plan_attention", "plan_conv2d", "plan_linear", "plan_matmul", "prepare_attention", "prepare_conv2d",
    "prepare_linear", "prepare_matmul",
]  # fmt: skip
