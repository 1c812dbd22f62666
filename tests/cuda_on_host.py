"""Run a generated CUDA kernel on the host, for the CPU tier: the kernel's C++ built by nvcc as
host code, every thread of a block a std::thread (blocks, or clusters, one after another, the
last first),
meeting at `__syncwarp` (its warp's 32 lanes) and `__syncthreads` (the block).

It checks a kernel's index arithmetic, shared-memory traffic, `dequant` helpers (cuda_fp16's
half2 arithmetic runs on the host too) and its Hopper pipeline without a GPU.  The SM90 pieces
are modelled by what they promise, not by how the hardware does it:

* mbarriers: arrival counts, transaction bytes and the phase bit, under one lock; an arrival
  past the count or transaction bytes below zero abort the program (a protocol bug);
* TMA tile loads (`ts_tma_load_{1..5}d`): the box copied at once, zeros past the tensor's
  bounds, the 32/64/128-byte swizzle applied to the shared-memory address bits as the
  hardware does (tiles 1024-byte aligned), then the bytes completed on the barrier;
* wgmma with both operands in shared memory, K-major and 128-byte swizzled (the descriptor of
  `ts_wgmma_desc`), or A from registers (the warpgroup's threads exchange their A fragments
  first): each thread adds its own accumulator fragment (float32 sums of the fp16 or bf16
  products) at once; `wgmma_fence` and `wgmma_wait` are warpgroup barriers (the
  instructions are warpgroup-collective), which is all a wait must promise once it is done;
* `setmaxnreg` moves registers between a block's threads: each starts with what a launch of
  its size gets (65536 / threads, at most 255, in eights), an increase waits for registers
  others released and aborts when none come (on the GPU the block would hang);
* mma.sync m16n8k16: the warp's lanes exchange their fragments, then each adds its own;
  stmatrix likewise, each lane then writing the row it addresses;
* shared memory is each block's own arena, filled with 0x7F bytes (an fp16 read of a byte no
  one wrote is NaN); a cluster's blocks (along x) run together: `cluster_sync` is a barrier of
  all their threads and `load_cluster` reads another block's arena at the same offset;
* cp.async copies at once (zero fill when not taken), so its commits and waits do nothing;
* fences do nothing (host memory is coherent under the barriers' lock);
* `reduce_add` and `ticket` add under the same lock;
* flags (`signal_flag` / `wait_flag`) are words under the same lock; a wait for a flag that no
  block run before it set fails after 20 s (blocks run last first, so a block may wait on
  higher-numbered ones, which the GPU runs at the same time in a persistent grid).

It is not a CUDA emulator: kernels using anything else (ldmatrix, the MN-major wgmma, im2col
maps) fail to build, which says so; a copy read before its wait is not caught
(the copies are synchronous).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HOST_PRELUDE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>
struct ts_dim3 { int x, y, z; };
static thread_local ts_dim3 ts_thread_idx, ts_block_idx, ts_grid_dim, ts_block_dim;
struct ts_host_barrier {  // `count` threads meet: a warp's 32 lanes, or a whole block
  std::mutex m; std::condition_variable cv; int count = 32, waiting = 0, phase = 0;
  void wait() {
    std::unique_lock<std::mutex> lock(m);
    int p = phase;
    if (++waiting == count) { waiting = 0; ++phase; cv.notify_all(); } else cv.wait(lock, [&] { return phase != p; });
  }
};
static thread_local ts_host_barrier* ts_barrier;
static thread_local ts_host_barrier* ts_block_barrier;
static thread_local ts_host_barrier* ts_warpgroup_barrier;
static inline void ts_host_syncwarp() { ts_barrier->wait(); }
static inline void ts_host_syncthreads() { ts_block_barrier->wait(); }
static inline void ts_grid_dependency_sync() {}
template <int N> static inline void ts_copy_vector(void* dst, const void* src) { std::memcpy(dst, src, N); }
static inline uint32_t ts_lop3_and_or(uint32_t a, uint32_t b, uint32_t c) { return (a & b) | c; }
static inline uint32_t ts_prmt(uint32_t a, uint32_t b, uint32_t s) {
  uint64_t x = a | ((uint64_t)b << 32); uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= (uint32_t)((x >> (8 * ((s >> 4 * i) & 7))) & 0xFF) << (8 * i);
  return r;
}
static void ts_host_fail(const char* what) { std::fprintf(stderr, "host model: %s\n", what); std::fflush(stderr); std::abort(); }
// mbarrier word: pending arrivals [0, 16), expected arrivals [16, 32), phase bit 32, transaction bytes [33, 64)
static std::mutex ts_mb_lock;
static std::condition_variable ts_mb_cv;
static inline void ts_mb_settle(uint64_t* w) {  // (locked) the phase completes once nothing is pending
  uint64_t v = *w, expected = (v >> 16) & 0xFFFF;
  if ((v & 0xFFFF) == 0 && (v >> 33) == 0) { *w = expected | (expected << 16) | ((((v >> 32) & 1) ^ 1) << 32); ts_mb_cv.notify_all(); }
}
static inline void ts_mb_arrive(void* bar, uint64_t tx) {
  std::lock_guard<std::mutex> lock(ts_mb_lock);
  uint64_t* w = static_cast<uint64_t*>(bar);
  if ((*w & 0xFFFF) == 0) ts_host_fail("mbarrier arrival past its count");
  *w = *w - 1 + (tx << 33);
  ts_mb_settle(w);
}
static inline void ts_mbarrier_init(void* bar, uint32_t count) {
  std::lock_guard<std::mutex> lock(ts_mb_lock);
  *static_cast<uint64_t*>(bar) = (uint64_t)count | ((uint64_t)count << 16);
}
static std::mutex ts_reg_lock;
static std::condition_variable ts_reg_cv;
static thread_local int* ts_reg_pool;  // registers the block's threads released and did not claim again
static thread_local int ts_regs;
static inline void ts_host_setmaxnreg(int regs) {
  std::unique_lock<std::mutex> lock(ts_reg_lock);
  int more = regs - ts_regs;
  if (!ts_reg_cv.wait_for(lock, std::chrono::seconds(20), [&] { return *ts_reg_pool >= more; }))
    ts_host_fail("setmaxnreg.inc waits for registers the block never releases (the GPU would hang)");
  *ts_reg_pool -= more; ts_regs = regs; ts_reg_cv.notify_all();
}
static inline void ts_fence_mbarrier_init() {}
static inline void ts_fence_proxy_async() {}
static inline void ts_mbarrier_arrive(void* bar) { ts_mb_arrive(bar, 0); }
static inline void ts_mbarrier_arrive_expect_tx(void* bar, uint32_t bytes) { ts_mb_arrive(bar, bytes); }
static inline void ts_mbarrier_wait(void* bar, uint32_t parity) {  // until the phase of `parity` completed
  std::unique_lock<std::mutex> lock(ts_mb_lock);
  uint64_t* w = static_cast<uint64_t*>(bar);
  ts_mb_cv.wait(lock, [&] { return ((*w >> 32) & 1) != parity; });
}
struct CUtensorMap { const char* base; int rank; int64_t dims[5], strides[5]; int box[5], elem, swizzle; };
static inline uintptr_t ts_host_swizzle(uintptr_t a, int swizzle) {  // 16-byte chunks XOR 128-byte rows
  int bits = swizzle == 128 ? 3 : swizzle == 64 ? 2 : swizzle == 32 ? 1 : 0;
  return a ^ (((a >> 7) & ((1u << bits) - 1)) << 4);
}
// Element i of a box at coordinates c (innermost first): visit(i, byte offset in the tensor, inside it).
template <class F> static inline int64_t ts_host_tma_box(const CUtensorMap* map, const int32_t* c, F visit) {
  int64_t total = 1;
  for (int d = 0; d < map->rank; ++d) total *= map->box[d];
  for (int64_t i = 0; i < total; ++i) {
    int64_t rest = i, offset = 0; bool inside = true;
    for (int d = 0; d < map->rank; ++d) {
      int64_t x = c[d] + rest % map->box[d]; rest /= map->box[d];
      inside = inside && x >= 0 && x < map->dims[d]; offset += x * map->strides[d];
    }
    visit(i, offset, inside);
  }
  return total;
}
static inline char* ts_host_box_element(const void* box, int64_t i, const CUtensorMap* map) {  // element i, swizzled
  return reinterpret_cast<char*>(ts_host_swizzle(reinterpret_cast<uintptr_t>(box) + i * map->elem, map->swizzle));
}
static inline int64_t ts_host_tma_copy(void* dst, const CUtensorMap* map, const int32_t* c) {  // the box's bytes
  return map->elem * ts_host_tma_box(map, c, [&](int64_t i, int64_t offset, bool inside) {
    char* to = ts_host_box_element(dst, i, map);
    if (inside) std::memcpy(to, map->base + offset, map->elem); else std::memset(to, 0, map->elem);
  });
}
// A TMA store: the box written at once (its parts past the tensor's edges dropped); nothing is
// left in flight, so the wait for its source to be read does nothing.
static inline void ts_host_tma_store(const CUtensorMap* map, const void* src, const int32_t* c) {
  ts_host_tma_box(map, c, [&](int64_t i, int64_t offset, bool inside) {
    if (inside) std::memcpy(const_cast<char*>(map->base) + offset, ts_host_box_element(src, i, map), map->elem);
  });
}
template <int N> static inline void ts_tma_store_wait() {}
static inline void ts_host_tma(void* dst, const CUtensorMap* map, void* bar, const int32_t* c) {
  int64_t total = ts_host_tma_copy(dst, map, c) / map->elem;
  std::lock_guard<std::mutex> lock(ts_mb_lock);
  uint64_t* w = static_cast<uint64_t*>(bar);
  if ((uint64_t)(total * map->elem) > (*w >> 33)) ts_host_fail("TMA bytes beyond the barrier's expected transaction");
  *w -= (uint64_t)(total * map->elem) << 33;
  ts_mb_settle(w);
}
static inline void ts_tma_load_1d(void* d, const CUtensorMap* m, void* b, int32_t c0) { int32_t c[] = {c0}; ts_host_tma(d, m, b, c); }
static inline void ts_tma_load_2d(void* d, const CUtensorMap* m, void* b, int32_t c0, int32_t c1) { int32_t c[] = {c0, c1}; ts_host_tma(d, m, b, c); }
static inline void ts_tma_load_3d(void* d, const CUtensorMap* m, void* b, int32_t c0, int32_t c1, int32_t c2) {
  int32_t c[] = {c0, c1, c2}; ts_host_tma(d, m, b, c);
}
static inline void ts_tma_load_4d(void* d, const CUtensorMap* m, void* b, int32_t c0, int32_t c1, int32_t c2, int32_t c3) {
  int32_t c[] = {c0, c1, c2, c3}; ts_host_tma(d, m, b, c);
}
static inline void ts_tma_load_5d(void* d, const CUtensorMap* m, void* b, int32_t c0, int32_t c1, int32_t c2, int32_t c3, int32_t c4) {
  int32_t c[] = {c0, c1, c2, c3, c4}; ts_host_tma(d, m, b, c);
}
static inline float ts_host_float(half x) { return __half2float(x); }
static inline float ts_host_float(__nv_bfloat16 x) { return __bfloat162float(x); }
// An element of a K-major tile in 128-byte swizzled rows (wgmma's shared-memory operands).
template <class T> static inline float ts_host_at(const void* p, int row, int k) {
  uintptr_t x = ts_host_swizzle(reinterpret_cast<uintptr_t>(p) + row * 128 + k * 2, 128);
  return ts_host_float(*reinterpret_cast<const T*>(x));
}
// wgmma m64nNk16 with B [N, 16] K-major in shared memory: this thread's accumulator (warp w of
// the warpgroup: rows 16w.., register 4j + e at row g + 8 (e / 2), column 8j + 2 (lane % 4) +
// e % 2) gets its 16 products, A's elements from A(row, k).
template <int N, class T, class FA> static inline void ts_host_wgmma_of(float* d, FA A, const void* b) {
  int lane = ts_thread_idx.x % 128, w = lane / 32, l = lane % 32;
  for (int i = 0; i < N / 2; ++i) {
    int r = 16 * w + l / 4 + 8 * ((i / 2) % 2), c = 8 * (i / 4) + 2 * (l % 4) + i % 2;
    float s = 0.0f;
    for (int k = 0; k < 16; ++k) s += A(r, k) * ts_host_at<T>(b, c, k);
    d[i] += s;
  }
}
// ... with A [64, 16] K-major in shared memory too
template <int N, class T> static inline void ts_host_wgmma(float* d, const void* a, const void* b) {
  ts_host_wgmma_of<N, T>(d, [a](int row, int k) { return ts_host_at<T>(a, row, k); }, b);
}
// ... with A from registers (`_rs`): the warpgroup's threads hand in their four A-fragment
// registers (warp w, lane l = 4g + t: register i holds row 16w + g + 8 (i % 2), columns
// 2t + 8 (i / 2) + {0, 1}) first.
struct ts_group_exchange { uint32_t a[128][4]; };
static thread_local ts_group_exchange* ts_group_a;
template <int N, class T> static inline void ts_host_wgmma_rs(float* d, const void* a, const void* b) {
  ts_warpgroup_barrier->wait();  // everyone has read the previous exchange
  std::memcpy(ts_group_a->a[ts_thread_idx.x % 128], a, 16);
  ts_warpgroup_barrier->wait();
  ts_host_wgmma_of<N, T>(d, [](int row, int k) {
    const uint32_t* regs = ts_group_a->a[32 * (row / 16) + (row % 8) * 4 + (k % 8) / 2];
    return ts_host_float(reinterpret_cast<const T*>(&regs[(row % 16) / 8 + 2 * (k / 8)])[k % 2]);
  }, b);
}
// mma.sync m16n8k16 (row.col, float32 accumulators): the warp's lanes hand in their A and B
// fragments, then each adds its own 4 accumulators (rows g, g + 8, columns 2t, 2t + 1).
struct ts_warp_exchange { uint32_t a[32][4], b[32][2]; };
static thread_local ts_warp_exchange* ts_exchange;
template <class T> static inline void ts_host_mma(float* c, const void* a, const void* b) {
  int l = ts_thread_idx.x % 32, g = l / 4, t = l % 4;
  ts_barrier->wait();  // everyone has read the previous exchange
  std::memcpy(ts_exchange->a[l], a, 16); std::memcpy(ts_exchange->b[l], b, 8);
  ts_barrier->wait();
  auto A = [](int row, int k) {  // register (row >= 8) + 2 (k >= 8) of lane (row % 8, k % 8 / 2)
    return ts_host_float(reinterpret_cast<const T*>(&ts_exchange->a[row % 8 * 4 + k % 8 / 2][row / 8 + 2 * (k / 8)])[k % 2]);
  };
  auto B = [](int k, int col) {  // register k >= 8 of lane (col, k % 8 / 2)
    return ts_host_float(reinterpret_cast<const T*>(&ts_exchange->b[col * 4 + k % 8 / 2][k / 8])[k % 2]);
  };
  for (int i = 0; i < 4; ++i) {
    int row = g + 8 * (i / 2), col = 2 * t + i % 2;
    float s = 0.0f;
    for (int k = 0; k < 16; ++k) s += A(row, k) * B(k, col);
    c[i] += s;
  }
}
// stmatrix: the warp's lanes hand in their registers (register q: lane 4g + t's two values of
// row g, columns 2t, 2t + 1 of matrix q), then lane 8q + r writes row r of stored matrix q to
// its own address: that row of matrix q, or with TRANS its column r.
template <int NUM, bool TRANS> static inline void ts_stmatrix(void* dst, const void* src) {
  int l = ts_thread_idx.x % 32, q = l / 8, r = l % 8;
  ts_barrier->wait();  // everyone has read the previous exchange
  std::memcpy(ts_exchange->a[l], src, 4 * NUM);
  ts_barrier->wait();
  if (q >= NUM) return;
  uint16_t* row = reinterpret_cast<uint16_t*>(dst);
  for (int c = 0; c < 8; ++c) {
    int lane = TRANS ? 4 * c + r / 2 : 4 * r + c / 2, half = TRANS ? r % 2 : c % 2;
    row[c] = reinterpret_cast<const uint16_t*>(&ts_exchange->a[lane][q])[half];
  }
}
static inline void ts_mma_m16n8k16_f16(float* c, const void* a, const void* b) { ts_host_mma<half>(c, a, b); }
static inline void ts_mma_m16n8k16_bf16(float* c, const void* a, const void* b) { ts_host_mma<__nv_bfloat16>(c, a, b); }
// cp.async: copied at once (src-size 0: zero fill), so commits and waits have nothing to do.
template <int N> static inline void ts_copy_async(void* dst, const void* src, bool pred) {
  if (pred) std::memcpy(dst, src, N); else std::memset(dst, 0, N);
}
static inline void ts_copy_async_commit() {}
template <int N> static inline void ts_copy_async_wait() {}
// wgmma's fence and wait are warpgroup-collective (.sync.aligned): the 128 threads meet there,
// so that once past the wait no thread of the warpgroup still reads the stages its wgmmas read.
static inline void ts_wgmma_fence() { ts_warpgroup_barrier->wait(); }
static inline void ts_wgmma_commit() {}
template <int N> static inline void ts_wgmma_wait() { ts_warpgroup_barrier->wait(); }
template <int N, class T> static inline void ts_fence_registers(T*) {}  // (the wgmmas already finished)
static std::vector<char> ts_read(const char* path) {
  FILE* f = std::fopen(path, "rb"); std::vector<char> out;
  if (!f) { std::perror(path); std::exit(2); }
  char buf[1 << 16]; size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) out.insert(out.end(), buf, buf + n);
  std::fclose(f); return out;
}
// Shared memory: each block's own arena (filled with 0x7F: an fp16 read of a byte nobody wrote
// is NaN); a cluster's blocks run together and read each other's arenas (load_cluster).
static thread_local char* ts_block_smem;
static thread_local char** ts_cluster_smem;
static thread_local ts_host_barrier* ts_cluster_barrier;
static inline void ts_cluster_sync() { ts_cluster_barrier->wait(); }
static inline char* ts_host_in_block(const void* p, uint32_t rank) {  // the same shared-memory offset in block `rank`
  return ts_cluster_smem[rank] + (static_cast<const char*>(p) - ts_block_smem);
}
static inline void ts_mbarrier_arrive_cluster(void* bar, uint32_t rank) { ts_mb_arrive(ts_host_in_block(bar, rank), 0); }
// Flags between blocks: blocks run one after another here (the last first: see ts_launch), so a
// flag must have been set by a block that ran before the waiter; a wait for any other fails.
static inline void ts_signal_flag(void* flag, uint32_t value) {
  std::lock_guard<std::mutex> lock(ts_mb_lock);
  *static_cast<uint32_t*>(flag) = value;
  ts_mb_cv.notify_all();
}
static inline void ts_wait_flag(const void* flag, uint32_t value) {
  std::unique_lock<std::mutex> lock(ts_mb_lock);
  if (!ts_mb_cv.wait_for(lock, std::chrono::seconds(20), [&] { return *static_cast<const uint32_t*>(flag) == value; }))
    ts_host_fail("wait_flag: no block that ran before this one (the host model runs the last block first) set the flag");
}
// Sums between blocks (reduce_add, ticket): under the same lock, in the order the blocks run.
template <int N> static inline void ts_reduce_add(float* dst, const float* src) {
  std::lock_guard<std::mutex> lock(ts_mb_lock);
  for (int i = 0; i < N / 4; ++i) dst[i] += src[i];
}
static inline void ts_ticket(void* counter, uint32_t add, void* old) {
  std::lock_guard<std::mutex> lock(ts_mb_lock);
  uint32_t* c = static_cast<uint32_t*>(counter);
  *static_cast<uint32_t*>(old) = *c;
  *c += add;
}
// Multicast: the box lands in each block of the mask and completes its bytes on that block's barrier,
// which may not have announced them yet (another block's producer can be ahead): the transaction
// count goes below zero until its own arrive.expect_tx, as on the GPU.
static inline void ts_host_tma_multicast(void* dst, const CUtensorMap* map, void* bar, uint32_t mask, const int32_t* c) {
  for (uint32_t rank = 0; rank < 16; ++rank) {
    if (!(mask >> rank & 1)) continue;
    int64_t bytes = ts_host_tma_copy(ts_host_in_block(dst, rank), map, c);
    std::lock_guard<std::mutex> lock(ts_mb_lock);
    uint64_t* w = reinterpret_cast<uint64_t*>(ts_host_in_block(bar, rank));
    *w -= (uint64_t)bytes << 33;
    ts_mb_settle(w);
  }
}
template <int N> static inline void ts_load_cluster(void* dst, const void* src, uint32_t rank) {
  std::memcpy(dst, ts_cluster_smem[rank] + (static_cast<const char*>(src) - ts_block_smem), N);
}
struct ts_host_block {
  ts_host_barrier block;
  std::vector<std::unique_ptr<ts_host_barrier>> warps, groups;
  std::vector<ts_warp_exchange> exchanges;
  std::vector<ts_group_exchange> group_a;
  std::vector<char> arena;
  char* smem;
  int pool = 0;
  explicit ts_host_block(int threads) : exchanges(threads / 32), group_a((threads + 127) / 128), arena(ARENA_BYTES + 1024, 0x7F) {
    block.count = threads;
    for (int w = 0; w < threads / 32; ++w) warps.emplace_back(new ts_host_barrier);
    for (int g = 0; g < threads; g += 128) { groups.emplace_back(new ts_host_barrier); groups.back()->count = std::min(128, threads - g); }
    smem = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(arena.data()) + 1023) & ~uintptr_t(1023));
  }
};
template <class F> static void ts_launch(int gx, int gy, int gz, int threads, int cluster, F kernel) {
  int blocks = gx * gy * gz, regs = std::min(255, 65536 / threads) / 8 * 8;
  // from the last block (or cluster) to the first: a block that waits for a flag waits for a later one
  for (int first = (blocks - 1) / cluster * cluster; first >= 0; first -= cluster) {
    int n = std::min(cluster, blocks - first);
    std::vector<std::unique_ptr<ts_host_block>> group;
    std::vector<char*> arenas;
    for (int i = 0; i < n; ++i) { group.emplace_back(new ts_host_block(threads)); arenas.push_back(group.back()->smem); }
    ts_host_barrier together; together.count = n * threads;
    std::vector<std::thread> all;
    for (int i = 0; i < n; ++i)
      for (int t = 0; t < threads; ++t)
        all.emplace_back([&, i, t] {
          int b = first + i;
          ts_host_block* me = group[i].get();
          ts_block_idx = {b % gx, b / gx % gy, b / (gx * gy)}; ts_thread_idx = {t, 0, 0};
          ts_grid_dim = {gx, gy, gz}; ts_block_dim = {threads, 1, 1}; ts_regs = regs; ts_reg_pool = &me->pool;
          ts_barrier = me->warps[t / 32].get(); ts_exchange = &me->exchanges[t / 32]; ts_block_barrier = &me->block;
          ts_warpgroup_barrier = me->groups[t / 128].get(); ts_group_a = &me->group_a[t / 128]; ts_block_smem = me->smem; ts_cluster_smem = arenas.data();
          ts_cluster_barrier = &together; kernel();
        });
    for (auto& t : all) t.join();
  }
}
"""

# one-line helpers of the generated prelude that are plain C (integer division, min and max)
_PLAIN = re.compile(r"^__device__ __forceinline__ (int32_t|int64_t|uint32_t|uint64_t) (ts_\w+)\(.*\}$")
_SIGNATURE = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(?:__cluster_dims__\([^)]*\) )?'
                        r"(\w+)\(([^)]*)\)")
_SHARED = re.compile(r"(extern )?__shared__ __align__\((\d+)\) (\w+) (\w+)\[([^\]]*)\];")
_ELEMENT_BYTES = {"half": 2, "__nv_bfloat16": 2, "float": 4, "double": 8, "uint8_t": 1, "int8_t": 1, "uint16_t": 2,
                  "int16_t": 2, "uint32_t": 4, "int32_t": 4, "uint64_t": 8, "int64_t": 8}  # fmt: skip
POOL_BYTES = 233472  # the dynamic pool at its largest (227 KiB + 1 KiB)
ARENA_BYTES = 256 * 1024  # each block's shared memory (the host program's ARENA_BYTES too)


def _block_shared(kernel: str) -> str:
    """Shared memory as each block's own: every `__shared__` array becomes a pointer at its
    offset in the block's arena (ts_block_smem, ARENA_BYTES each, 1024-byte aligned), so the
    blocks of a cluster, which run together, keep theirs apart."""
    offset = 0

    def place(m: re.Match) -> str:
        nonlocal offset
        align, ctype, name, count = int(m.group(2)), m.group(3), m.group(4), m.group(5)
        offset = -(-offset // align) * align
        at = offset
        size = POOL_BYTES if m.group(1) else eval(count, {"__builtins__": {}}) * _ELEMENT_BYTES[ctype]  # noqa: S307
        offset += size
        if offset > ARENA_BYTES:
            raise NotImplementedError(f"the host model's shared memory holds {ARENA_BYTES} bytes per block")
        return f"{ctype}* {name} = reinterpret_cast<{ctype}*>(ts_block_smem + {at});"

    return _SHARED.sub(place, kernel)


# where the kernel's own instruction helpers start (after the shared prelude)
_OWN_HELPER = re.compile(r"\n(?=__device__ __forceinline__ void (ts_dequant_|ts_wgmma_m64n|ts_tma_load_im2col_|ts_tma_load_multicast_|ts_tma_store_))")
_WGMMA = re.compile(r"void (ts_wgmma_m64n(\d+)k16_(f16|bf16)(_rs)?)\(")
_SETMAXNREG = re.compile(r'asm volatile\("setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32 (\d+);\\n"\);')


@dataclass(frozen=True)
class HostTensorMap:
    """A TMA map parameter: over the array given as parameter `array`, viewed as `shape`
    (outermost first, row-major), read in boxes of `box` elements, `swizzle` bytes."""

    array: str
    shape: tuple[int, ...]
    box: tuple[int, ...]
    swizzle: int = 128


def _host_helper(chunk: str) -> str:
    """A kernel's own helper as host code: `dequant`'s as they are, wgmma's modelled."""
    m = _WGMMA.match(chunk.split("\n", 1)[0].removeprefix("__device__ __forceinline__ "))
    if m:
        element = "half" if m.group(3) == "f16" else "__nv_bfloat16"
        return (f"static inline void {m.group(1)}(float* d, const void* a, const void* b) "
                f"{{ ts_host_wgmma{m.group(4) or ''}<{m.group(2)}, {element}>(d, a, b); }}")  # fmt: skip
    # TMA helpers with a rank in their name: the host's, with the coordinates gathered innermost first
    for name, params, call in (("ts_tma_load_multicast", "void* d, const CUtensorMap* m, void* b, uint32_t mask",
                                "ts_host_tma_multicast(d, m, b, mask, c)"),
                               ("ts_tma_store", "const CUtensorMap* m, const void* s", "ts_host_tma_store(m, s, c)")):  # fmt: skip
        tma = re.match(rf"__device__ __forceinline__ void ({name}_(\d)d)\(", chunk)
        if tma:
            rank = int(tma.group(2))
            coords, values = ", ".join(f"int32_t c{i}" for i in range(rank)), ", ".join(f"c{i}" for i in range(rank))
            return f"static inline void {tma.group(1)}({params}, {coords}) {{ int32_t c[] = {{{values}}}; {call}; }}"
    if not chunk.startswith("__device__ __forceinline__ void ts_dequant_"):
        raise NotImplementedError(f"the host model does not run {chunk.split('(', 1)[0].split()[-1]}")
    return chunk.replace("__device__ __forceinline__", "static inline")


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
        own = _OWN_HELPER.search(src, 0, end)
        for chunk in re.split(r"\n(?=__device__ __forceinline__ )", src[own.end() if own else end : end]):
            chunk = chunk.strip()
            if chunk:
                helpers.setdefault(chunk.split("(", 1)[0], _host_helper(chunk))
        kernel = src[end:]
        m = _SIGNATURE.search(kernel)
        params = [p.strip().split()[-1].rstrip("_") for p in m.group(2).split(",")]
        kernels.append((m.group(1), params))
        kernel = _SIGNATURE.sub(lambda m: f"static void {m.group(1)}({m.group(2)})", kernel, count=1)
        kernel = _block_shared(kernel)
        kernel = _SETMAXNREG.sub(r"ts_host_setmaxnreg(\1);", kernel.replace("__grid_constant__ ", ""))
        for cuda, host in (("threadIdx", "ts_thread_idx"), ("blockIdx", "ts_block_idx"), ("gridDim", "ts_grid_dim"),
                           ("blockDim", "ts_block_dim")):  # fmt: skip
            kernel = kernel.replace(cuda, host)
        kernel = kernel.replace("__syncwarp()", "ts_host_syncwarp()").replace("__syncthreads()", "ts_host_syncthreads()")
        bodies.setdefault(m.group(1), kernel)
    used, text = [], "\n".join(bodies.values())
    while True:  # the plain helpers the kernels call, and those that these call
        more = [name for name in plain if name not in used and re.search(rf"\b{name}\(", text)]
        if not more:
            break
        used += more
        text = "\n".join(plain[name] for name in more)
    parts = [f"#define ARENA_BYTES {ARENA_BYTES}", HOST_PRELUDE, *(plain[n] for n in plain if n in used),
             *helpers.values(), *bodies.values()]
    return "\n".join(parts), kernels


_CTYPES = {np.dtype(np.uint32): "uint32_t", np.dtype(np.float16): "half", np.dtype(np.float32): "float",
           np.dtype(np.int32): "int32_t"}  # fmt: skip


def _tensor_map(i: int, p: str, v: HostTensorMap, values: dict) -> str:
    """The declaration of map parameter `p` of case `i` over its array's host copy."""
    item = values[v.array].dtype.itemsize
    dims = list(reversed(v.shape))
    strides = [item * int(np.prod(dims[:j], dtype=np.int64)) for j in range(len(dims))]
    pad = lambda xs: "{" + ", ".join(str(int(x)) for x in [*xs, *[0] * (5 - len(xs))]) + "}"  # noqa: E731
    return (f"  CUtensorMap c{i}_{p} = {{c{i}_{v.array}.data(), {len(dims)}, {pad(dims)}, {pad(strides)}, "
            f"{pad(list(reversed(v.box)))}, {item}, {v.swizzle}}};")  # fmt: skip


def launch_dims(kernel, values: dict) -> tuple[tuple[int, int, int], int]:
    """The (grid, threads per block) the kernel's launch config gives for these values (its
    scalar parameters and shape symbols by name; the arrays' shapes bind the symbols)."""
    from tessera.ir.evaluate import evaluate

    func = kernel.ir
    env = {k: v for k, v in values.items() if isinstance(v, (int, np.integer))}
    for p in func.params:
        v = values.get(p.name)
        if isinstance(v, np.ndarray) and hasattr(p.type, "shape"):
            env.update({d.name: n for d, n in zip(p.type.shape, v.shape) if hasattr(d, "name")})
    grid = [int(evaluate(d, env)) for d in func.launch.grid] + [1, 1]
    block = [int(evaluate(d, env)) for d in func.launch.block] + [1, 1]
    if block[1] != 1 or block[2] != 1:
        raise NotImplementedError("the host model runs one-dimensional blocks")
    return (grid[0], grid[1], grid[2]), block[0]


def _cluster(kernel) -> int:
    """Blocks per cluster (along x; the host model runs no other shape)."""
    func = getattr(kernel, "ir", None)  # (a plan's source alone: no clusters)
    dims = tuple(int(getattr(d, "value", d)) for d in (func.launch.cluster or ())) if func is not None else ()
    if any(d != 1 for d in dims[1:]):
        raise NotImplementedError("the host model runs clusters along x only")
    return dims[0] if dims else 1


def run_on_host(tmp_path: Path, cases: list[tuple], timeout: float = 600) -> list[np.ndarray]:
    """cases: (kernel, {parameter: numpy array, HostTensorMap or int}, output parameter, blocks,
    threads), blocks an int or (x, y, z), or None for both (`launch_dims`); builds every kernel
    into one host program, runs each case, returns each output array (the input arrays'
    copies: the kernels write them).  The output parameter may be a tuple of parameters: that
    case's result is then the tuple of their arrays after the one run."""
    src, kernels = host_source([c[0].source_full for c in cases])
    main = ["int main() {"]
    outs = []
    for i, ((kernel, values, out, blocks, threads), (name, params)) in enumerate(zip(cases, kernels)):
        if blocks is None:
            blocks, threads = launch_dims(kernel, values)
        gx, gy, gz = (blocks, 1, 1) if isinstance(blocks, int) else blocks
        args, decls = [], []
        for p in params:
            v = values[p]
            if isinstance(v, np.ndarray):
                path = tmp_path / f"c{i}_{p}.bin"
                np.ascontiguousarray(v).tofile(path)
                decls.append(f'  std::vector<char> c{i}_{p} = ts_read("{path}");')
                args.append(f"reinterpret_cast<{_CTYPES[v.dtype]}*>(c{i}_{p}.data())")
            elif not isinstance(v, HostTensorMap):
                args.append(str(int(v)))
        for p in params:  # (after the arrays they map)
            if isinstance(values[p], HostTensorMap):
                decls.append(_tensor_map(i, p, values[p], values))
                args.insert(params.index(p), f"c{i}_{p}")
        main += [*decls, f"  ts_launch({gx}, {gy}, {gz}, {threads}, {_cluster(kernel)}, [&] {{ {name}({', '.join(args)}); }});"]
        for j, o in enumerate((out,) if isinstance(out, str) else out):
            main.append(f'  {{ FILE* f = std::fopen("{tmp_path / f"o{i}_{j}.bin"}", "wb"); '
                        f"std::fwrite(c{i}_{o}.data(), 1, c{i}_{o}.size(), f); std::fclose(f); }}")  # fmt: skip
        outs.append([(tmp_path / f"o{i}_{j}.bin", values[o]) for j, o in enumerate((out,) if isinstance(out, str) else out)])
    (tmp_path / "host.cu").write_text(src + "\n" + "\n".join(main) + "\n  return 0;\n}\n")
    built = subprocess.run(["nvcc", "-std=c++17", "-O1", "-w", "-o", str(tmp_path / "host"), str(tmp_path / "host.cu")],
                           capture_output=True, text=True)  # fmt: skip
    if built.returncode:
        raise RuntimeError(f"nvcc could not build {tmp_path / 'host.cu'} for the host:\n{built.stderr[-3000:]}")
    ran = subprocess.run([str(tmp_path / "host")], capture_output=True, text=True, timeout=timeout)
    if ran.returncode:
        raise RuntimeError(f"{tmp_path / 'host'} failed ({ran.returncode}):\n{ran.stderr[-3000:]}")
    got = [tuple(np.fromfile(path, like.dtype).reshape(like.shape) for path, like in case) for case in outs]
    return [g if isinstance(c[2], tuple) else g[0] for g, c in zip(got, cases)]
