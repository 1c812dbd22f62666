"""Loading and calling built kernels: CPU shared libraries and CUDA cubins."""

from tessera.runtime.cpu import CpuKernel
from tessera.runtime.cuda import CudaKernel, DeviceArray, is_available, synchronize

__all__ = ["CpuKernel", "CudaKernel", "DeviceArray", "is_available", "synchronize"]
