"""Build generated sources with gcc (CPU) and nvcc (CUDA) through the artifact cache."""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
from pathlib import Path

from tessera.backend import cache
from tessera.errors import CompilationError, CompilerNotFoundError

C_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fPIC", "-shared", "-fopenmp", "-std=c11", "-Wall",
           "-Wno-unused-variable", "-Wno-unused-function"]  # fmt: skip
CUDA_FLAGS = ["-O3", "-std=c++17", "-lineinfo", "-Xptxas=-warn-spills"]
DEFAULT_CUDA_ARCH = "sm_90a"


def find_compiler(name: str, env_var: str) -> str:
    override = os.environ.get(env_var)
    if override:  # a path or a command name; it must name an executable
        path = shutil.which(override)
        if not path:
            raise CompilerNotFoundError(f"${env_var} is set to {override!r}, which is not an executable {name}")
        return path
    path = shutil.which(name)
    if not path:
        hint = "install gcc (e.g. `apt-get install gcc`)" if name == "gcc" else "install the CUDA toolkit so nvcc is on PATH"
        raise CompilerNotFoundError(f"{name} was not found on PATH (or ${env_var}); {hint}")
    return path


@functools.cache
def compiler_version(path: str) -> str:
    out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    return out.stdout.strip()


@functools.cache
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _run(cmd: list[str], compiler: str, key: str, source_name: str, source: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        kept = cache.keep_failed_source(key, source_name, source)
        raise CompilationError(compiler, cmd, proc.stdout + proc.stderr, str(kept))


def build_c(source: str) -> Path:
    """Compile C source into a shared library; returns its path in the cache."""
    gcc = find_compiler("gcc", "TESSERA_CC")
    flags = list(C_FLAGS)
    key = cache.cache_key("c", source, compiler_version(gcc), " ".join(flags), _cpu_model())

    def build(src: Path, out: Path) -> None:
        _run([gcc, *flags, str(src), "-o", str(out), "-lm"], "gcc", key, src.name, source)

    return cache.get_or_build(key, "kernel.c", source, "kernel.so", build)


def arch_flags(arch: str) -> list[str]:
    """nvcc flags for `arch` ("sm_90a", "sm_80", ...): real code for exactly that target."""
    num = arch.removeprefix("sm_")
    return [f"-gencode=arch=compute_{num},code=sm_{num}"]


def build_cuda(source: str, arch: str = DEFAULT_CUDA_ARCH) -> Path:
    """Compile CUDA source into a cubin for `arch`; returns its path in the cache."""
    nvcc = find_compiler("nvcc", "TESSERA_NVCC")
    flags = CUDA_FLAGS + arch_flags(arch)
    key = cache.cache_key("cuda", source, compiler_version(nvcc), " ".join(flags))

    def build(src: Path, out: Path) -> None:
        _run([nvcc, "-cubin", *flags, str(src), "-o", str(out)], "nvcc", key, src.name, source)

    return cache.get_or_build(key, "kernel.cu", source, "kernel.cubin", build)


def detect_cuda_arch() -> str:
    """The arch of GPU 0 (sm_90 becomes sm_90a so Hopper-only instructions are usable),
    or DEFAULT_CUDA_ARCH when no GPU or driver is present."""
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return DEFAULT_CUDA_ARCH
        err, dev = driver.cuDeviceGet(0)
        attr = driver.CUdevice_attribute
        _, major = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        _, minor = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    except Exception:  # noqa: BLE001  (no bindings, no driver library, no device)
        return DEFAULT_CUDA_ARCH
    arch = f"sm_{major}{minor}"
    return arch + "a" if major in (9, 10, 12) else arch
