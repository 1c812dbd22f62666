"""CpuAnchorKernel: the C kernels of one anchor operator, called on numpy arrays without allocating.

It lives in tessera.ops.anchors.kernel, next to AnchorKernel (AnchorPlan.load makes both);
this module keeps its old import path."""

from tessera.ops.anchors.kernel import CONSTANT, CpuAnchorKernel, aligned_empty

__all__ = ["CONSTANT", "CpuAnchorKernel", "aligned_empty"]
