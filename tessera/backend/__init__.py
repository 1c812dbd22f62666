"""Code generation (C, CUDA) and building (gcc, nvcc) with the artifact cache."""

from tessera.backend.build import build_c, build_cuda, detect_cuda_arch
from tessera.backend.codegen_c import generate_c
from tessera.backend.codegen_cuda import generate_cuda

__all__ = ["build_c", "build_cuda", "detect_cuda_arch", "generate_c", "generate_cuda"]
