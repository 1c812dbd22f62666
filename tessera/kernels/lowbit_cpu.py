"""Low-bit linear layers on the CPU, and dequantisation to fp16 on CUDA, written in tessera with
packed-tensor loads (any type: the generated code extracts each field, tessera.quant.codecs).

* `make_linear_cpu(wtype, has_zeros)`: Y[m, n] = sum_k X[m, k] * (W[n, k] - Z[n, g]) * S[n, g]
  in float32 (the CPU path of the quantized-linear op and the reference for the GPU kernels);
* `make_dequant_cuda(wtype, has_zeros)`: W16[n, k] = fp16((W[n, k] - Z[n, g]) * S[n, g]), the
  first half of the prefill path (dequantise, then a tensor-core fp16 GEMM).
"""

from __future__ import annotations

import functools

import tessera as ts
from tessera import f16, f32, i32
from tessera.ir.dtypes import DataType


@functools.cache
def make_linear_cpu(wtype: DataType, has_zeros: bool) -> ts.Kernel:
    T = wtype

    @ts.kernel(target="cpu", name=f"lowbit_linear_{T.name}{'_z' if has_zeros else ''}")
    def linear(X: f32["M", "K"], W: T["N", "K"], S: f16["N", "G"], Z: i32["NZ", "GZ"], Y: f32["M", "N"],
               group: ts.int32):  # fmt: skip
        for n in ts.parallel(N):
            for m in range(M):
                total = 0.0
                for g in range(G):
                    part = 0.0
                    for k in range(g * group, min(g * group + group, K)):
                        if has_zeros:
                            part += X[m, k] * ts.cast(W[n, k] - Z[n, g], f32)
                        else:
                            part += X[m, k] * ts.cast(W[n, k], f32)
                    total += part * ts.cast(S[n, g], f32)
                Y[m, n] = total

    return linear


@functools.cache
def make_dequant_cuda(wtype: DataType, has_zeros: bool) -> ts.Kernel:
    T = wtype

    @ts.kernel(target="cuda", name=f"lowbit_dequant_{T.name}{'_z' if has_zeros else ''}")
    def dequant(W: T["N", "K"], S: f16["N", "G"], Z: i32["NZ", "GZ"], Out: f16["N", "K"], group: ts.int32):
        ts.attrs.grid = (ts.ceil_div(K, 256), N)
        ts.attrs.block = 256
        n = ts.block_idx.y
        k = ts.block_idx.x * 256 + ts.thread_idx.x
        if k < K:
            g = k // group
            if has_zeros:
                Out[n, k] = ts.cast(ts.cast(W[n, k] - Z[n, g], f32) * ts.cast(S[n, g], f32), f16)
            else:
                Out[n, k] = ts.cast(ts.cast(W[n, k], f32) * ts.cast(S[n, g], f32), f16)

    return dequant
