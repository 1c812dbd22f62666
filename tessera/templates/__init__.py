"""Kernel templates: one package per family, found through one registry (registry.py).

    from tessera.templates import choose
    template = choose(op, "cuda")          # the template that computes a graph operator, or None
    template.refuse(op)                    # None, or why it does not take it (explain prints it)
    template.space(op, shapes)             # the schedules tuning times
    kernel = template.prepare(group, shapes, tune=True)

Families (each folder: kernels written in tessera, their schedule space, a plan that adapts a
problem to them, and one `register` call in its __init__): `gemm` (tensor-core GEMMs),
`conv` (convolutions as GEMMs), `row` (norms, softmax), `attention`, `cpu` (x86 GEMM,
convolution, pooling), `lowbit` (low-bit weights), `moe` (mixture-of-experts blocks).  Shared machinery: `epilogue.py` (fusing an
elementwise tail into a template's stores), `rewrite.py` (IR rewrites that specialise a
template), `kernel.py` (a plan's launches, built and loaded into an AnchorKernel).

Adding a template: a folder here with a `Template` subclass registered in its __init__, and
its import below (the order is the order `choose` asks them in).

The anchors can be called directly, without a graph::

    from tessera import ops
    from tessera.templates import Epilogue, prepare_linear

    acc = ops.placeholder((16, 4096), "float16", "acc")
    k = prepare_linear((16, 1024), (4096, 1024), "float16", bias=True,
                       epilogue=Epilogue(acc, ops.gelu(acc), []))
    k([x, w, b], out)            # out = gelu(x @ w.T + b), one GEMM kernel
"""

from tessera.templates import attention, conv, cpu, gemm, lowbit, moe, row  # noqa: F401  (each registers its templates)
from tessera.templates.attention.plan import plan_attention, prepare_attention
from tessera.templates.conv.plan import plan_conv2d, prepare_conv2d
from tessera.templates.epilogue import Epilogue, EpilogueError, compose, fuse_epilogue, identity_epilogue
from tessera.templates.gemm.plan import plan_linear, plan_matmul, prepare_linear, prepare_matmul
from tessera.templates.kernel import AnchorKernel, AnchorPlan
from tessera.templates.registry import StepKernel, Template, choose, chosen, passes, refusals, register, templates

__all__ = [
    "AnchorKernel", "AnchorPlan", "Epilogue", "EpilogueError", "StepKernel", "Template", "choose", "chosen",
    "compose", "fuse_epilogue", "identity_epilogue", "passes", "plan_attention", "plan_conv2d", "plan_linear",
    "plan_matmul", "prepare_attention", "prepare_conv2d", "prepare_linear", "prepare_matmul", "refusals",
    "register", "templates",
]  # fmt: skip
