"""The auto-scheduler: compute DAG -> fused kernels (IR functions) for the CPU and CUDA.

One concern per file: `inline` (fusion by inlining), `partition` (kernels and reduction
epilogue fusion), `row` (a reduction kernel's body), `cpu` and `cuda` (schedules and launch
configurations), `reduction` (combiners, warp/block all-reduce), `buffers` (parameters),
`loops` (index arithmetic) and `kernel` (the driver).
"""

from tessera.ops.schedule.kernel import KernelSpec, schedule

__all__ = ["KernelSpec", "schedule"]
