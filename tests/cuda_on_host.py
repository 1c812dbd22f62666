"""Run a generated CUDA kernel on the host, for the CPU tier: the kernel's C++ built by nvcc as
host code, each warp's 32 lanes as 32 threads meeting at `__syncwarp` (std::thread and a
barrier), blocks and warps one after another.

It checks a kernel's index arithmetic, shared-memory traffic and `dequant` helpers (cuda_fp16's
half2 arithmetic runs on the host too) without a GPU; it is not a CUDA emulator.  Only kernels
whose threads meet at nothing but `__syncwarp` (no block barrier, no asynchronous copies, no
tensor-core instructions), whose own helpers are `dequant`'s and whose prelude helpers are the
host-safe ones below run this way: others fail to compile, which says so.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np

HOST_PRELUDE = r"""
#include <cuda_fp16.h>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>
struct ts_dim3 { int x, y, z; };
static thread_local ts_dim3 ts_thread_idx, ts_block_idx;
struct ts_warp_barrier {  // the 32 lanes of one warp
  std::mutex m; std::condition_variable cv; int waiting = 0, phase = 0;
  void wait() {
    std::unique_lock<std::mutex> lock(m);
    int p = phase;
    if (++waiting == 32) { waiting = 0; ++phase; cv.notify_all(); } else cv.wait(lock, [&] { return phase != p; });
  }
};
static thread_local ts_warp_barrier* ts_barrier;
static inline void ts_host_syncwarp() { ts_barrier->wait(); }
static inline void ts_grid_dependency_sync() {}
template <int N> static inline void ts_copy_vector(void* dst, const void* src) { std::memcpy(dst, src, N); }
static inline uint32_t ts_lop3_and_or(uint32_t a, uint32_t b, uint32_t c) { return (a & b) | c; }
static inline uint32_t ts_prmt(uint32_t a, uint32_t b, uint32_t s) {
  uint64_t x = a | ((uint64_t)b << 32); uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= (uint32_t)((x >> (8 * ((s >> 4 * i) & 7))) & 0xFF) << (8 * i);
  return r;
}
static std::vector<char> ts_read(const char* path) {
  FILE* f = std::fopen(path, "rb"); std::vector<char> out;
  if (!f) { std::perror(path); std::exit(2); }
  char buf[1 << 16]; size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.insert(out.end(), buf, buf + n);
  std::fclose(f); return out;
}
template <class F> static void ts_launch(int blocks, int threads, F kernel) {
  for (int b = 0; b < blocks; ++b)
    for (int w = 0; w < threads / 32; ++w) {
      ts_warp_barrier bar; std::vector<std::thread> lanes;
      for (int l = 0; l < 32; ++l)
        lanes.emplace_back([&, b, w, l] { ts_block_idx = {b, 0, 0}; ts_thread_idx = {32 * w + l, 0, 0};
                                          ts_barrier = &bar; kernel(); });
      for (auto& t : lanes) t.join();
    }
}
"""

# one-line helpers of the generated prelude that are plain C (integer division, min and max)
_PLAIN = re.compile(r"^__device__ __forceinline__ (int32_t|int64_t|uint32_t|uint64_t) (ts_\w+)\(.*\}$")
_SIGNATURE = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(([^)]*)\)')


def host_source(sources: list[str]) -> tuple[str, list[tuple[str, list[str]]]]:
    """One host C++ file for the kernels of `sources` (their `source_full`); returns it and each
    kernel's (name, parameter names without the trailing underscore)."""
    helpers: dict[str, str] = {}
    plain: dict[str, str] = {}
    bodies: dict[str, str] = {}
    kernels = []
    for src in sources:
        for line in src.splitlines():
            m = _PLAIN.match(line)
            if m and "asm" not in line and not re.search(r"\b__[a-z]", line.split("{", 1)[1]):
                plain.setdefault(m.group(2), line.replace("__device__ __forceinline__", "static inline"))
        end = src.index('extern "C"')
        start = src.find("__device__ __forceinline__ void ts_dequant_", 0, end)  # the kernel's own helpers
        start = end if start < 0 else start
        for chunk in re.split(r"\n(?=__device__ __forceinline__ void ts_dequant_)", "\n" + src[start:end]):
            chunk = chunk.strip()
            if chunk:
                helpers.setdefault(chunk.split("(", 1)[0], chunk.replace("__device__ __forceinline__", "static inline"))
        kernel = src[end:]
        m = _SIGNATURE.search(kernel)
        params = [p.strip().split()[-1].rstrip("_") for p in m.group(2).split(",")]
        kernels.append((m.group(1), params))
        kernel = _SIGNATURE.sub(lambda m: f"static void {m.group(1)}({m.group(2)})", kernel, count=1)
        # shared memory: one static array per kernel (blocks run one after another); the dynamic pool at its largest
        kernel = re.sub(r"extern __shared__ __align__\((\d+)\) (\w+) (\w+)\[\];", r"alignas(\1) static \2 \3[233472];",
                        kernel)  # fmt: skip
        kernel = re.sub(r"__shared__ __align__\((\d+)\)", r"alignas(\1) static", kernel)
        kernel = kernel.replace("threadIdx", "ts_thread_idx").replace("blockIdx", "ts_block_idx")
        bodies.setdefault(m.group(1), kernel.replace("__syncwarp()", "ts_host_syncwarp()"))
    used, text = [], "\n".join(bodies.values())
    while True:  # the plain helpers the kernels call, and those that these call
        more = [name for name in plain if name not in used and re.search(rf"\b{name}\(", text)]
        if not more:
            break
        used += more
        text = "\n".join(plain[name] for name in more)
    parts = [HOST_PRELUDE, *(plain[n] for n in plain if n in used), *helpers.values(), *bodies.values()]
    return "\n".join(parts), kernels


def run_on_host(tmp_path: Path, cases: list[tuple]) -> list[np.ndarray]:
    """cases: (kernel, {parameter: numpy array or int}, output parameter, blocks, threads);
    builds every kernel into one host program, runs each case, returns each output array
    (the input arrays' copies: the kernels write them)."""
    src, kernels = host_source([c[0].source_full for c in cases])
    main = ["int main() {"]
    outs = []
    for i, ((_, values, out, blocks, threads), (name, params)) in enumerate(zip(cases, kernels)):
        args, decls = [], []
        for p in params:
            v = values[p]
            if isinstance(v, np.ndarray):
                path = tmp_path / f"c{i}_{p}.bin"
                np.ascontiguousarray(v).tofile(path)
                decls.append(f'  std::vector<char> c{i}_{p} = ts_read("{path}");')
                ctype = {np.dtype(np.uint32): "uint32_t", np.dtype(np.float16): "half"}[v.dtype]
                args.append(f"reinterpret_cast<{ctype}*>(c{i}_{p}.data())")
            else:
                args.append(str(int(v)))
        main += [*decls, f"  ts_launch({blocks}, {threads}, [&] {{ {name}({', '.join(args)}); }});",
                 f'  {{ FILE* f = std::fopen("{tmp_path / f"o{i}.bin"}", "wb"); '
                 f"std::fwrite(c{i}_{out}.data(), 1, c{i}_{out}.size(), f); std::fclose(f); }}"]  # fmt: skip
        outs.append((tmp_path / f"o{i}.bin", values[out]))
    (tmp_path / "host.cu").write_text(src + "\n" + "\n".join(main) + "\n  return 0;\n}\n")
    built = subprocess.run(["nvcc", "-std=c++17", "-O1", "-o", str(tmp_path / "host"), str(tmp_path / "host.cu")],
                           capture_output=True, text=True)  # fmt: skip
    if built.returncode:
        raise RuntimeError(f"nvcc could not build {tmp_path / 'host.cu'} for the host:\n{built.stderr[-3000:]}")
    subprocess.run([str(tmp_path / "host")], check=True, capture_output=True)
    return [np.fromfile(path, like.dtype).reshape(like.shape) for path, like in outs]
