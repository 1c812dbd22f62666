"""Build generated sources with gcc (CPU) and nvcc (CUDA) through the artifact cache."""

from __future__ import annotations

import functools
import platform
import shutil
import subprocess
from pathlib import Path

from tessera import settings
from tessera.backend import cache
from tessera.backend.isa import cpu_isa
from tessera.errors import BrokenCompilerError, CompilationError, CompilerNotFoundError

C_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fPIC", "-shared", "-fopenmp", "-std=c11", "-Wall",
           "-Wno-unused-variable", "-Wno-unused-function"]  # fmt: skip
CUDA_FLAGS = ["-O3", "-std=c++17", "-lineinfo", "-Xptxas=-warn-spills"]
DEFAULT_CUDA_ARCH = "sm_90a"


def find_compiler(name: str, env_var: str) -> str:
    """The compiler `env_var` ($TESSERA_CC, $TESSERA_NVCC) names, else `name` on PATH."""
    override = settings.compiler(env_var)  # validated: an executable
    if override:
        return override
    path = shutil.which(name)
    if not path:
        hint = "install gcc (e.g. `apt-get install gcc`)" if name == "gcc" else "install the CUDA toolkit so nvcc is on PATH"
        raise CompilerNotFoundError(f"{name} was not found on PATH (or ${env_var}); {hint}")
    return path


@functools.cache
def compiler_version(path: str) -> str:
    """The compiler's identity for cache keys: its `--version` text."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, check=False)
    except OSError as exc:  # not runnable: wrong format, no permission...
        raise BrokenCompilerError(path, [path, "--version"], str(exc), "(not written yet)",
                                  "could not be run to ask its version") from None  # fmt: skip
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


def _run(cmd: list[str], name: str, key: str, source_name: str, source: str, out: Path) -> None:
    """Run the compiler; raise CompilationError unless it succeeded AND wrote `out`."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        kept = cache.keep_failed_source(key, source_name, source)
        raise BrokenCompilerError(name, cmd, str(exc), str(kept), f"({cmd[0]}) could not be run") from None
    if proc.returncode != 0:
        kept = cache.keep_failed_source(key, source_name, source)
        raise CompilationError(name, cmd, proc.stdout + proc.stderr, str(kept))
    if not out.is_file() or out.stat().st_size == 0:
        kept = cache.keep_failed_source(key, source_name, source)
        raise BrokenCompilerError(name, cmd, proc.stdout + proc.stderr, str(kept),
                                  f"({cmd[0]}) exited successfully but produced no output (expected {out.name}); "
                                  f"is it really {name}? Check ${_ENV_VARS[name]} and PATH")  # fmt: skip


_ENV_VARS = {"gcc": settings.CC.name, "nvcc": settings.NVCC.name}
_FILES = {"c": ("kernel.c", "kernel.so"), "cuda": ("kernel.cu", "kernel.cubin")}


def _prebuilt(kind: str, source: str, flags: str, machine: str, missing: CompilerNotFoundError) -> Path:
    """Without a compiler: an artifact of this exact source, flags and machine already in the
    cache (built earlier, or installed from a compiled-graph file); else `missing`, explained."""
    found = cache.lookup_source(kind, source, flags, machine, _FILES[kind][1])
    if found is None:
        raise CompilerNotFoundError(f"{missing}; and the artifact cache holds no prebuilt {_FILES[kind][1]} of this "
                                    "kernel for these flags and this machine (a compiled-graph file brings them "
                                    "for the machine type it was saved on)") from None  # fmt: skip
    return found


def build_c(source: str) -> Path:
    """Compile C source into a shared library; returns its path in the cache."""
    flags = list(C_FLAGS)
    machine = f"{_cpu_model()} isa={cpu_isa()}"  # a TESSERA_CPU_ISA cap changes the generated code
    try:
        gcc = find_compiler("gcc", settings.CC.name)
    except CompilerNotFoundError as exc:
        return _prebuilt("c", source, " ".join(flags), machine, exc)
    identity = cache.Identity("c", compiler_version(gcc), " ".join(flags), machine)
    key = identity.key(source)

    def build(src: Path, out: Path) -> None:
        _run([gcc, *flags, str(src), "-o", str(out), "-lm"], "gcc", key, src.name, source, out)

    return cache.get_or_build(identity, _FILES["c"][0], source, _FILES["c"][1], build)


def arch_flags(arch: str) -> list[str]:
    """nvcc flags for `arch` ("sm_90a", "sm_80", ...): real code for exactly that target."""
    num = arch.removeprefix("sm_")
    return [f"-gencode=arch=compute_{num},code=sm_{num}"]


def build_cuda(source: str, arch: str = DEFAULT_CUDA_ARCH) -> Path:
    """Compile CUDA source into a cubin for `arch`; returns its path in the cache."""
    flags = CUDA_FLAGS + arch_flags(arch)
    try:
        nvcc = find_compiler("nvcc", settings.NVCC.name)
    except CompilerNotFoundError as exc:
        return _prebuilt("cuda", source, " ".join(flags), "", exc)
    identity = cache.Identity("cuda", compiler_version(nvcc), " ".join(flags), "")  # the flags name the target
    key = identity.key(source)

    def build(src: Path, out: Path) -> None:
        _run([nvcc, "-cubin", *flags, str(src), "-o", str(out)], "nvcc", key, src.name, source, out)

    return cache.get_or_build(identity, _FILES["cuda"][0], source, _FILES["cuda"][1], build)


def artifact_files(kind: str) -> tuple[str, str]:
    """(source file name, artifact file name) of a cache entry of kind "c" or "cuda"."""
    if kind not in _FILES:
        raise ValueError(f"artifact kind must be one of {sorted(_FILES)}, got {kind!r}")
    return _FILES[kind]


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
