"""CUDA C++ code generation for GPU kernels (built with nvcc into a cubin).

float16 and bfloat16 values use CUDA's `half` and `nv_bfloat16` types and their native
arithmetic; math intrinsics on them are computed in float.
"""

from __future__ import annotations

from dataclasses import replace
from math import prod

from tessera.backend import codegen_lowbit
from tessera.backend.codegen_c_like import CLikeCodegen, shared_helpers, symbol_name
from tessera.errors import UnsupportedError
from tessera.ir import dtypes
from tessera.ir import stmt as S
from tessera.ir.dtypes import DataType
from tessera.ir.evaluate import evaluate
from tessera.ir.expr import Const
from tessera.ir.func import CUDA_KERNEL, Function
from tessera.ir.types import TensorMapType, TensorType
from tessera.transforms.plan_shared_memory import shared_buffer_offsets

CUDA_PRELUDE = r"""
#include <cuda.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

// The bits of a value and back (BitCast).
__device__ __forceinline__ uint32_t ts_bits_of_float32(float v) { return __float_as_uint(v); }
__device__ __forceinline__ float ts_float32_of_bits(uint32_t u) { return __uint_as_float(u); }
__device__ __forceinline__ uint64_t ts_bits_of_float64(double v) { return (uint64_t)__double_as_longlong(v); }
__device__ __forceinline__ double ts_float64_of_bits(uint64_t u) { return __longlong_as_double((long long)u); }
__device__ __forceinline__ uint16_t ts_bits_of_float16(half v) { return __half_as_ushort(v); }
__device__ __forceinline__ half ts_float16_of_bits(uint16_t u) { return __ushort_as_half(u); }
__device__ __forceinline__ uint16_t ts_bits_of_bfloat16(nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
__device__ __forceinline__ nv_bfloat16 ts_bfloat16_of_bits(uint16_t u) { return __ushort_as_bfloat16(u); }
{helpers}
// Programmatic dependent launch (SM90+): every kernel first waits for the grids it depends on
// to complete (their writes visible), then lets its own dependents be scheduled, so that the
// runtime may launch the next kernel while this one runs (tessera.runtime.cuda launches with
// programmatic stream serialization).  Nothing before this touches global memory.  Without
// that launch attribute both instructions are no-ops.
__device__ __forceinline__ void ts_grid_dependency_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// Memory and tensor-core instructions (tessera.ir.instructions).  Register fragments are
// addressed through pointers; with constant indices after unrolling they stay in registers.
template <int N> struct ts_vec;
template <> struct ts_vec<2> { typedef uint16_t t; };
template <> struct ts_vec<4> { typedef uint32_t t; };
template <> struct ts_vec<8> { typedef uint2 t; };
template <> struct ts_vec<16> { typedef uint4 t; };
template <int N> __device__ __forceinline__ void ts_copy_vector(void* dst, const void* src) {
  *reinterpret_cast<typename ts_vec<N>::t*>(dst) = *reinterpret_cast<const typename ts_vec<N>::t*>(src);
}
__device__ __forceinline__ float ts_fast_exp2(float x) { float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ uint32_t ts_smem(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
template <int N> __device__ __forceinline__ void ts_copy_async(void* dst, const void* src, bool pred) {
  // src-size 0 reads nothing and zero-fills: out-of-bounds tiles need no separate path.
  if (N == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(ts_smem(dst)), "l"(src), "r"(pred ? 16 : 0));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" :: "r"(ts_smem(dst)), "l"(src), "n"(N), "r"(pred ? N : 0));
}
__device__ __forceinline__ void ts_copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// (a & b) | c in one LOP3 even when b and c are both constants (dequant's mask and fp16 magic).
__device__ __forceinline__ uint32_t ts_lop3_and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d; asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d;
}
// byte i of the result is byte (selector >> 4i) & 7 of {b, a} (prmt.b32: dequant's whole-byte fields).
__device__ __forceinline__ uint32_t ts_prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t d; asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(selector)); return d;
}
#if __CUDA_ARCH__ >= 890
// two e4m3 codes (the low 16 bits, the first in the low byte) to half2, exactly (raw dequant)
__device__ __forceinline__ uint32_t ts_cvt_e4m3x2(uint32_t x) {
  uint32_t d; asm("{ .reg .b16 l, h;\n mov.b32 {l, h}, %1;\n cvt.rn.f16x2.e4m3x2 %0, l;\n}\n" : "=r"(d) : "r"(x)); return d;
}
#endif
template <int N> __device__ __forceinline__ void ts_copy_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }
template <int NUM, bool TRANS> __device__ __forceinline__ void ts_ldmatrix(void* dst, const void* src) {
  uint32_t* r = reinterpret_cast<uint32_t*>(dst);
  uint32_t a = ts_smem(src);
  if (NUM == 4 && !TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  else if (NUM == 4)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  else if (NUM == 2 && !TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
  else if (NUM == 2)
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(a));
  else if (!TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(a));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(a));
}
// stmatrix (SM90): register q of each lane (two 16-bit values) is its part of matrix q's mma
// fragment; lane 8q + r gives the address of row r of matrix q (16 bytes).
template <int NUM, bool TRANS> __device__ __forceinline__ void ts_stmatrix(void* dst, const void* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t* r = reinterpret_cast<const uint32_t*>(src);
  uint32_t a = ts_smem(dst);
  if (NUM == 4 && !TRANS)
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};\n" :: "r"(a), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
  else if (NUM == 4)
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" :: "r"(a), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
  else if (NUM == 2 && !TRANS)
    asm volatile("stmatrix.sync.aligned.m8n8.x2.shared.b16 [%0], {%1,%2};\n" :: "r"(a), "r"(r[0]), "r"(r[1]) : "memory");
  else if (NUM == 2)
    asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1,%2};\n" :: "r"(a), "r"(r[0]), "r"(r[1]) : "memory");
  else if (!TRANS)
    asm volatile("stmatrix.sync.aligned.m8n8.x1.shared.b16 [%0], {%1};\n" :: "r"(a), "r"(r[0]) : "memory");
  else
    asm volatile("stmatrix.sync.aligned.m8n8.x1.trans.shared.b16 [%0], {%1};\n" :: "r"(a), "r"(r[0]) : "memory");
#else
  __trap();  // (stmatrix needs SM90)
#endif
}
#define TS_MMA_M16N8K16(NAME, T)                                                                  \
  __device__ __forceinline__ void NAME(float* c, const void* a, const void* b) {                \
    const uint32_t* x = reinterpret_cast<const uint32_t*>(a);                                   \
    const uint32_t* y = reinterpret_cast<const uint32_t*>(b);                                   \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." T "." T ".f32 "                         \
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                        \
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                \
                 : "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]), "r"(y[0]), "r"(y[1]));             \
  }
TS_MMA_M16N8K16(ts_mma_m16n8k16_f16, "f16")
TS_MMA_M16N8K16(ts_mma_m16n8k16_bf16, "bf16")
// wgmma shared-memory descriptor: K-major tile, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t ts_wgmma_desc(const void* p) {
  uint64_t addr = ts_smem(p);
  return ((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void ts_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void ts_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void ts_tma_store_wait() { asm volatile("cp.async.bulk.wait_group.read %0;\n" :: "n"(N) : "memory"); }
template <int N> __device__ __forceinline__ void ts_wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(N) : "memory"); }
// A register fence: the compiler must assume the asm changed r, so no read of r moves above it.
__device__ __forceinline__ void ts_fence_register(float& r) { asm volatile("" : "+f"(r) :: "memory"); }
__device__ __forceinline__ void ts_fence_register(uint32_t& r) { asm volatile("" : "+r"(r) :: "memory"); }
__device__ __forceinline__ void ts_fence_register(int32_t& r) { asm volatile("" : "+r"(r) :: "memory"); }
template <int N, class T> __device__ __forceinline__ void ts_fence_registers(T* r) {
  #pragma unroll
  for (int i = 0; i < N; ++i) ts_fence_register(r[i]);
}
__device__ __forceinline__ void ts_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// MN-major (transposed) operand: 64-element chunks of 128-byte rows, 8-row groups 1024 bytes
// apart (stride byte offset), chunks `chunk` bytes apart (leading byte offset).
__device__ __forceinline__ uint64_t ts_wgmma_desc_mn(const void* p, uint32_t chunk) {
  uint64_t addr = ts_smem(p);
  return ((addr & 0x3FFFF) >> 4) | ((uint64_t)((chunk >> 4) & 0x3FFF) << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
// One arrival on the mbarrier at `bar`'s offset in block `rank` of the cluster.  Release at CTA
// scope (PTX's default, as CUTLASS's ClusterBarrier::arrive): .release.cluster compiles to
// MEMBAR.ALL.GPU, which waits for every load the thread has in flight (a consumer's prefetch of
// the next weights), and made the register-A GEMM's cluster configs 1.7x slower on the H200.
__device__ __forceinline__ void ts_mbarrier_arrive_cluster(void* bar, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(ts_smem(bar)), "r"(rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" :: "r"(remote) : "memory");
}
// Flags between blocks of a grid: one thread signals after its group's barrier (release at GPU
// scope is cumulative over the writes the barrier ordered before it); a waiter acquires.
__device__ __forceinline__ void ts_signal_flag(void* flag, uint32_t value) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;\n" :: "l"(flag), "r"(value) : "memory");
}
__device__ __forceinline__ void ts_wait_flag(const void* flag, uint32_t value) {
  uint32_t seen;
  do {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(flag) : "memory");
  } while (seen != value);
}
// Sums between blocks: float32 adds done at the L2 (relaxed, GPU scope), and a counter whose old
// value the adding thread gets back (acq_rel: it publishes what a barrier ordered before it, and
// sees what earlier tickets published).
template <int N> __device__ __forceinline__ void ts_reduce_add(float* dst, const float* src) {
  if constexpr (N == 16)
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" :: "l"(dst), "f"(src[0]), "f"(src[1]), "f"(src[2]), "f"(src[3]) : "memory");
  else if constexpr (N == 8)
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" :: "l"(dst), "f"(src[0]), "f"(src[1]) : "memory");
  else
    asm volatile("red.global.add.f32 [%0], %1;\n" :: "l"(dst), "f"(src[0]) : "memory");
}
__device__ __forceinline__ void ts_ticket(void* counter, uint32_t add, void* old) {
  asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], %2;\n" : "=r"(*static_cast<uint32_t*>(old)) : "l"(counter), "r"(add) : "memory");
}
// Every thread of every block of the cluster meets here; memory written before (global and
// shared) is visible to the cluster's threads after it.
__device__ __forceinline__ void ts_cluster_sync() {
  asm volatile("fence.acq_rel.gpu;\nbarrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
// Distributed shared memory: N bytes at the same offset in block `rank` of the cluster.
template <int N> __device__ __forceinline__ void ts_load_cluster(void* dst, const void* src, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(ts_smem(src)), "r"(rank));
  uint32_t* r = reinterpret_cast<uint32_t*>(dst);
  if (N == 16)
    asm volatile("ld.shared::cluster.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(remote) : "memory");
  else if (N == 8)
    asm volatile("ld.shared::cluster.v2.u32 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(remote) : "memory");
  else
    asm volatile("ld.shared::cluster.u32 %0, [%1];\n" : "=r"(r[0]) : "r"(remote) : "memory");
}
// mbarriers (64-bit words in shared memory) and TMA loads that complete on them.
__device__ __forceinline__ void ts_mbarrier_init(void* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" :: "r"(ts_smem(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void ts_fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void ts_mbarrier_arrive(void* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" :: "r"(ts_smem(bar)) : "memory");
}
__device__ __forceinline__ void ts_mbarrier_arrive_expect_tx(void* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" :: "r"(ts_smem(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void ts_mbarrier_wait(void* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done) : "r"(ts_smem(bar)), "r"(parity) : "memory");
  }
}
__device__ __forceinline__ void ts_tma_load_1d(void* dst, const CUtensorMap* map, void* bar, int32_t c0) {
  asm volatile("cp.async.bulk.tensor.1d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3}], [%2];\n"
               :: "r"(ts_smem(dst)), "l"(map), "r"(ts_smem(bar)), "r"(c0) : "memory");
}
__device__ __forceinline__ void ts_tma_load_2d(void* dst, const CUtensorMap* map, void* bar, int32_t c0, int32_t c1) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n"
               :: "r"(ts_smem(dst)), "l"(map), "r"(ts_smem(bar)), "r"(c0), "r"(c1) : "memory");
}
__device__ __forceinline__ void ts_tma_load_3d(void* dst, const CUtensorMap* map, void* bar, int32_t c0, int32_t c1, int32_t c2) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n"
               :: "r"(ts_smem(dst)), "l"(map), "r"(ts_smem(bar)), "r"(c0), "r"(c1), "r"(c2) : "memory");
}
__device__ __forceinline__ void ts_tma_load_4d(void* dst, const CUtensorMap* map, void* bar, int32_t c0, int32_t c1, int32_t c2, int32_t c3) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n"
               :: "r"(ts_smem(dst)), "l"(map), "r"(ts_smem(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3) : "memory");
}
__device__ __forceinline__ void ts_tma_load_5d(void* dst, const CUtensorMap* map, void* bar, int32_t c0, int32_t c1, int32_t c2, int32_t c3, int32_t c4) {
  asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, %7}], [%2];\n"
               :: "r"(ts_smem(dst)), "l"(map), "r"(ts_smem(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4) : "memory");
}
"""


def _tma_coordinates(rank: int, first: int) -> tuple[str, str, str]:
    """A TMA helper's coordinate parameters c0.., their asm operands from %first on, and their inputs."""
    return (", ".join(f"int32_t c{i}" for i in range(rank)), ", ".join(f"%{first + i}" for i in range(rank)),
            ", ".join(f'"r"(c{i})' for i in range(rank)))  # fmt: skip


def tma_multicast_helper(rank: int) -> str:
    """ts_tma_load_multicast_{rank}d(dst, map, bar, mask, c0..): one TMA box written to the blocks
    of the cluster in the 16-bit `mask`, coordinates innermost first."""
    coords, regs, ins = _tma_coordinates(rank, 4)
    return (f"__device__ __forceinline__ void ts_tma_load_multicast_{rank}d(void* dst, const CUtensorMap* map, void* bar, "
            f"uint32_t mask, {coords}) {{\n"
            f'  asm volatile("cp.async.bulk.tensor.{rank}d.shared::cluster.global.mbarrier::complete_tx::bytes'
            f'.multicast::cluster [%0], [%1, {{{regs}}}], [%2], %3;\\n"\n'
            f'               :: "r"(ts_smem(dst)), "l"(map), "r"(ts_smem(bar)), "h"((unsigned short)mask), {ins} : "memory");\n}}\n')  # fmt: skip


def tma_store_helper(rank: int) -> str:
    """ts_tma_store_{rank}d(map, src, c0..): one box from shared memory to the map's tensor
    (coordinates innermost first), committed as a bulk group of its own."""
    coords, regs, ins = _tma_coordinates(rank, 2)
    return (f"__device__ __forceinline__ void ts_tma_store_{rank}d(const CUtensorMap* map, const void* src, {coords}) {{\n"
            f'  asm volatile("cp.async.bulk.tensor.{rank}d.global.shared::cta.bulk_group [%0, {{{regs}}}], [%1];\\n"\n'
            f'               "cp.async.bulk.commit_group;\\n"\n'
            f'               :: "l"(map), "r"(ts_smem(src)), {ins} : "memory");\n}}\n')  # fmt: skip


def tma_im2col_helper(rank: int) -> str:
    """ts_tma_load_im2col_{rank}d(dst, map, bar, c, w, [h, [d,]] n, off_w, [off_h, [off_d]]): one
    im2col-mode TMA load; coordinates and the 16-bit window offsets innermost first."""
    coords = [f"int32_t c{i}" for i in range(rank)]
    offsets = [f"int32_t o{i}" for i in range(rank - 2)]
    regs = ", ".join(f"%{3 + i}" for i in range(rank))
    oregs = ", ".join(f"%{3 + rank + i}" for i in range(rank - 2))
    ins = ", ".join([*(f'"r"(c{i})' for i in range(rank)), *(f'"h"((unsigned short)o{i})' for i in range(rank - 2))])
    return (f"__device__ __forceinline__ void ts_tma_load_im2col_{rank}d(void* dst, const CUtensorMap* map, void* bar, "
            f"{', '.join(coords + offsets)}) {{\n"
            f'  asm volatile("cp.async.bulk.tensor.{rank}d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes '
            f'[%0], [%1, {{{regs}}}], [%2], {{{oregs}}};\\n"\n'
            f'               :: "r"(ts_smem(dst)), "l"(map), "r"(ts_smem(bar)), {ins} : "memory");\n}}\n')  # fmt: skip


def wgmma_helper(n: int, kind: str, b_chunk_bytes: int = 0, a_regs: bool = False) -> str:
    """ts_wgmma_m64n{n}k16_{kind}[_t{chunk}][_rs](float* d, const void* a, const void* b): d += A @ B^T.

    The accumulator has n / 2 registers per thread; the asm lists each as an operand.  With
    `b_chunk_bytes` B is MN-major (the transpose bit set), in 64-column chunks that far apart.
    With `a_regs` A is the thread's four 32-bit A-fragment registers (the RS form), not a
    shared-memory descriptor."""
    regs = n // 2
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    dlist = ", ".join(f"%{i}" for i in range(regs))
    name, trans = wgmma_name(n, kind, b_chunk_bytes, a_regs), int(bool(b_chunk_bytes))
    bdesc = f"ts_wgmma_desc_mn(b, {b_chunk_bytes}u)" if b_chunk_bytes else "ts_wgmma_desc(b)"
    if a_regs:
        alist = ", ".join(f"%{regs + i}" for i in range(4))
        return (
            f"__device__ __forceinline__ void {name}(float* d, const void* a, const void* b) {{\n"
            f"  const uint32_t* x = reinterpret_cast<const uint32_t*>(a);\n"
            f"  asm volatile(\"{{\\n.reg .pred p;\\nsetp.ne.b32 p, 1, 0;\\n\"\n"
            f"    \"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind} {{{dlist}}}, {{{alist}}}, %{regs + 4}, p, 1, 1, {trans};\\n}}\\n\"\n"
            f"    : {outs}\n    : \"r\"(x[0]), \"r\"(x[1]), \"r\"(x[2]), \"r\"(x[3]), \"l\"({bdesc}) : \"memory\");\n}}"
        )
    return (
        f"__device__ __forceinline__ void {name}(float* d, const void* a, const void* b) {{\n"
        f"  asm volatile(\"{{\\n.reg .pred p;\\nsetp.ne.b32 p, 1, 0;\\n\"\n"
        f"    \"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind} {{{dlist}}}, %{regs}, %{regs + 1}, p, 1, 1, 0, {trans};\\n}}\\n\"\n"
        f"    : {outs}\n    : \"l\"(ts_wgmma_desc(a)), \"l\"({bdesc}) : \"memory\");\n}}"
    )


def _elements(t: TensorType) -> int:
    """Elements of a register tensor type (its shape is constant, perhaps not folded)."""
    return prod(int(evaluate(d, {})) for d in t.shape)


def wgmma_name(n: int, kind: str, b_chunk_bytes: int = 0, a_regs: bool = False) -> str:
    return f"ts_wgmma_m64n{n}k16_{kind}" + (f"_t{b_chunk_bytes}" if b_chunk_bytes else "") + ("_rs" if a_regs else "")

_SHUFFLES = {"shfl_xor": "__shfl_xor_sync", "shfl_down": "__shfl_down_sync", "shfl_idx": "__shfl_sync"}
_HW = {"threadIdx": "threadIdx", "blockIdx": "blockIdx", "blockDim": "blockDim", "gridDim": "gridDim"}
_NARROW = {"float16": "half", "bfloat16": "nv_bfloat16"}


class CudaCodegen(CLikeCodegen):
    target = "cuda"

    def scalar_type(self, t: DataType) -> str:
        if t.name in _NARROW:
            return _NARROW[t.name]
        return super().scalar_type(t)

    def storage_type(self, t: DataType) -> str:
        return "uint8_t" if t.is_storage_only else self.scalar_type(t)

    def load_value(self, t: DataType, text: str) -> str:
        return text

    def store_value(self, t: DataType, text: str) -> str:
        return text

    def cast(self, value: str, src: DataType, dst: DataType) -> str:
        if dst.name in _NARROW:
            if src == dtypes.float64:  # round once, not through float
                return f"__double2{'half' if dst == dtypes.float16 else 'bfloat16'}({value})"
            return f"{_NARROW[dst.name]}((float)({value}))"
        if src.name in _NARROW:
            return f"(({self.scalar_type(dst)})(float)({value}))"
        return f"(({self.scalar_type(dst)})({value}))"

    def binary(self, e, parent: int) -> str:
        if e.op == "%" and e.type.name in _NARROW:  # the floor-mod helper computes in float; round back
            a, b = self.operand(e.a, e.type, 0), self.operand(e.b, e.type, 0)
            return f"{_NARROW[e.type.name]}(ts_fmod_floorf((float)({a}), (float)({b})))"
        return super().binary(e, parent)

    def const_float(self, value: float, t: DataType) -> str:
        if t.name in _NARROW:
            return f"{_NARROW[t.name]}({super().const_float(value, dtypes.float32)})"
        return super().const_float(value, t)

    def visit_Call(self, e) -> str:
        if e.func in _SHUFFLES:  # the lane operand keeps its integer type
            value = self.operand(e.args[0], e.type, 0)
            return f"{_SHUFFLES[e.func]}(0xffffffffu, {value}, {self.expr(e.args[1])})"
        return super().visit_Call(e)

    def math_call(self, name: str, args: list[str], t: DataType) -> str:
        if name == "fast_exp2":  # float32 in, float32 out (narrow types round back)
            if t == dtypes.float64:
                return f"exp2({args[0]})"
            out = f"ts_fast_exp2((float)({args[0]}))"
            return f"{_NARROW[t.name]}({out})" if t.name in _NARROW else out
        if t.name in _NARROW:  # compute in float, round back
            wide = [f"(float)({a})" for a in args]
            return f"{_NARROW[t.name]}({super().math_call(name, wide, dtypes.float32)})"
        if name == "rsqrt" and t == dtypes.float32:
            return f"rsqrtf({args[0]})"
        return super().math_call(name, args, t)

    def hardware_index(self, name: str) -> str:
        reg, axis = name.split(".")
        return f"((int32_t){_HW[reg]}.{axis})"

    def visit_Instruction(self, s: S.Instruction) -> None:
        ops = [self.expr(x) for x in s.operands]
        a = s.attrs
        if s.name == "copy_vector":
            self.emit(f"ts_copy_vector<{a['bytes']}>({ops[0]}, {ops[1]});")
        elif s.name == "copy_async":
            self.emit(f"ts_copy_async<{a['bytes']}>({ops[0]}, {ops[1]}, {ops[2]});")
        elif s.name == "copy_async_commit":
            self.emit("ts_copy_async_commit();")
        elif s.name == "copy_async_wait":
            self.emit(f"ts_copy_async_wait<{a['pending']}>();")
        elif s.name == "ldmatrix":
            self.emit(f"ts_ldmatrix<{a['num']}, {'true' if a['trans'] else 'false'}>({ops[0]}, {ops[1]});")
        elif s.name == "stmatrix":
            self.emit(f"ts_stmatrix<{a['num']}, {'true' if a['trans'] else 'false'}>({ops[0]}, {ops[1]});")
        elif s.name == "wgmma":
            kind = "bf16" if s.operands[1].type.dtype == dtypes.bfloat16 else "f16"
            chunk = a["b_chunk_bytes"] if a["trans_b"] else 0
            regs = s.operands[1].scope == "register"
            self.helpers.add(wgmma_helper(a["n"], kind, chunk, regs))
            self.emit(f"{wgmma_name(a['n'], kind, chunk, regs)}({ops[0]}, {ops[1]}, {ops[2]});")
        elif s.name in ("wgmma_fence", "wgmma_commit", "fence_proxy_async", "fence_mbarrier_init"):
            self.emit(f"ts_{s.name}();")
        elif s.name in ("mbarrier_init", "mbarrier_arrive", "mbarrier_arrive_expect_tx", "mbarrier_wait"):
            self.emit(f"ts_{s.name}({', '.join(ops)});")
        elif s.name == "tma_load":
            coords = ", ".join(reversed(ops[3:]))  # the IR gives them outermost first, TMA innermost first
            self.emit(f"ts_tma_load_{len(ops) - 3}d({ops[0]}, &{ops[1]}, {ops[2]}, {coords});")
        elif s.name == "tma_load_multicast":
            rank = len(ops) - 4
            self.helpers.add(tma_multicast_helper(rank))
            coords = ", ".join(reversed(ops[4:]))
            self.emit(f"ts_tma_load_multicast_{rank}d({ops[0]}, &{ops[1]}, {ops[2]}, {ops[3]}, {coords});")
        elif s.name == "tma_store":
            rank = len(ops) - 2
            self.helpers.add(tma_store_helper(rank))
            self.emit(f"ts_tma_store_{rank}d(&{ops[0]}, {ops[1]}, {', '.join(reversed(ops[2:]))});")
        elif s.name == "tma_store_wait":
            self.emit(f"ts_tma_store_wait<{a['pending']}>();")
        elif s.name == "mbarrier_arrive_cluster":
            self.emit(f"ts_mbarrier_arrive_cluster({ops[0]}, {ops[1]});")
        elif s.name in ("signal_flag", "wait_flag"):
            self.emit(f"ts_{s.name}({ops[0]}, {ops[1]});")
        elif s.name == "reduce_add":
            self.emit(f"ts_reduce_add<{a['bytes']}>({ops[0]}, {ops[1]});")
        elif s.name == "ticket":
            self.emit(f"ts_ticket({ops[0]}, {ops[1]}, {ops[2]});")
        elif s.name == "tma_load_im2col":
            rank = s.operands[1].type.rank
            coords, offsets = ops[3 : 3 + rank], ops[3 + rank :]
            self.helpers.add(tma_im2col_helper(rank))
            args = ", ".join([*reversed(coords), *reversed(offsets)])  # innermost first
            self.emit(f"ts_tma_load_im2col_{rank}d({ops[0]}, &{ops[1]}, {ops[2]}, {args});")
        elif s.name in ("named_barrier_sync", "named_barrier_arrive"):
            op = "sync" if s.name == "named_barrier_sync" else "arrive"
            self.emit(f'asm volatile("bar.{op} %0, %1;\\n" :: "r"({ops[0]}), "r"({ops[1]}) : "memory");')
        elif s.name == "syncwarp":
            self.emit("__syncwarp();")
        elif s.name == "cluster_sync":
            self.emit("ts_cluster_sync();")
        elif s.name == "load_cluster":
            self.emit(f"ts_load_cluster<{a['bytes']}>({ops[0]}, {ops[1]}, {ops[2]});")
        elif s.name == "setmaxnreg":
            self.emit(f'asm volatile("setmaxnreg.{"inc" if a["increase"] else "dec"}.sync.aligned.u32 {a["regs"]};\\n");')
        elif s.name == "wgmma_wait":
            self.emit(f"ts_wgmma_wait<{a['pending']}>();")
            for op in s.operands:  # the fenced register tensors, whole
                self.emit(f"ts_fence_registers<{_elements(op.buffer.type)}>({self.name_of(op.buffer)});")
        elif s.name == "dequant":
            self.helpers.add(codegen_lowbit.cuda_helper(a))
            self.emit(f"{codegen_lowbit.helper_name(a)}({', '.join(ops)});")
        elif s.name == "mma":
            kind = "bf16" if s.operands[1].type.dtype == dtypes.bfloat16 else "f16"
            self.emit(f"ts_mma_{a['shape']}_{kind}({ops[0]}, {ops[1]}, {ops[2]});")
        else:
            raise UnsupportedError(f"instruction {s.name} has no CUDA lowering")

    def emit_barrier(self) -> None:
        self.emit("__syncthreads();")

    def params(self, func: Function) -> list[str]:
        """Tensor maps are passed by value in parameter space (TMA reads them there)."""
        maps = {p for p in func.all_params if isinstance(p.type, TensorMapType)}
        if not maps:
            return super().params(func)
        rest = super().params(replace(func, params=[p for p in func.params if p not in maps]))
        out, k = [], 0
        for p in func.all_params:
            if p in maps:
                out.append(f"const __grid_constant__ CUtensorMap {self.name_of(p)}")
            else:
                out.append(rest[k])
                k += 1
        return out

    def loop_pragma(self, kind: str) -> str | None:
        if kind == S.PARALLEL:
            raise UnsupportedError("parallel() loops are for CPU kernels")
        return "#pragma unroll" if kind == S.UNROLL else None

    def emit_declare_buffer(self, var, t: TensorType) -> None:
        size = self.expr(t.shape[0])
        if t.scope == "shared" and var in self.pool_offsets:
            ctype = self.storage_type(t.dtype)
            offset = self.pool_offsets[var]
            self.emit(f"{ctype}* {self.name_of(var)} = reinterpret_cast<{ctype}*>(ts_shared_pool + {offset});")
            return
        prefix = "__shared__ __align__(1024) " if t.scope == "shared" else ""
        self.emit(f"{prefix}{self.storage_type(t.dtype)} {self.name_of(var)}[{size}];")

    def function(self, func: Function) -> str:
        if func.kind != CUDA_KERNEL:
            raise UnsupportedError(f"the CUDA backend compiles CUDA kernels, not {func.kind}")
        self.prepare(func)
        params = ", ".join(self.params(func))
        bounds = ""
        block = func.launch.block
        if block and all(isinstance(b, Const) for b in block):
            threads = prod(int(b.value) for b in block)
            mb = f", {func.launch.min_blocks}" if func.launch.min_blocks else ""
            bounds = f"__launch_bounds__({threads}{mb}) "
        if func.launch.cluster:
            dims = (*func.launch.cluster, 1, 1)[:3]
            bounds += f"__cluster_dims__({dims[0]}, {dims[1]}, {dims[2]}) "
        self.emit(f'extern "C" __global__ void {bounds}{symbol_name(func)}({params}) {{')
        self.depth += 1
        self.pool_offsets: dict = {}
        self.helpers: set[str] = set()  # per-shape instruction helpers this kernel needs
        if func.launch.shared_pool:
            self.pool_offsets, _ = shared_buffer_offsets(func)
            self.emit("extern __shared__ __align__(1024) uint8_t ts_shared_pool[];")
        self.emit("ts_grid_dependency_sync();")
        self.visit(func.body)
        self.depth -= 1
        self.emit("}")
        return "\n".join(self.lines)


def generate_cuda(funcs: list[Function]) -> str:
    """CUDA source for a list of lowered CUDA kernels."""
    parts = [CUDA_PRELUDE.strip().replace("{helpers}", shared_helpers("__device__ __forceinline__", status=False))]
    helpers: set[str] = set()
    bodies = []
    for f in funcs:
        gen = CudaCodegen()
        bodies.append(gen.function(f))
        helpers |= gen.helpers
    return "\n\n".join(parts + sorted(helpers) + bodies) + "\n"
