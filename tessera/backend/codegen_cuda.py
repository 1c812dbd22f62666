"""CUDA C++ code generation for GPU kernels (built with nvcc into a cubin).

float16 and bfloat16 values use CUDA's `half` and `nv_bfloat16` types and their native
arithmetic; math intrinsics on them are computed in float.
"""

from __future__ import annotations

from math import prod

from tessera.backend.codegen_c_like import SHARED_HELPERS, CLikeCodegen, symbol_name
from tessera.errors import UnsupportedError
from tessera.ir import dtypes
from tessera.ir import stmt as S
from tessera.ir.dtypes import DataType
from tessera.ir.expr import Const
from tessera.ir.func import CUDA_KERNEL, Function
from tessera.ir.types import TensorType

CUDA_PRELUDE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

{helpers}
"""

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
        return self.scalar_type(t)

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
        if t.name in _NARROW:  # compute in float, round back
            wide = [f"(float)({a})" for a in args]
            return f"{_NARROW[t.name]}({super().math_call(name, wide, dtypes.float32)})"
        if name == "rsqrt" and t == dtypes.float32:
            return f"rsqrtf({args[0]})"
        return super().math_call(name, args, t)

    def hardware_index(self, name: str) -> str:
        reg, axis = name.split(".")
        return f"((int32_t){_HW[reg]}.{axis})"

    def emit_barrier(self) -> None:
        self.emit("__syncthreads();")

    def loop_pragma(self, kind: str) -> str | None:
        if kind == S.PARALLEL:
            raise UnsupportedError("parallel() loops are for CPU kernels")
        return "#pragma unroll" if kind == S.UNROLL else None

    def emit_declare_buffer(self, var, t: TensorType) -> None:
        size = self.expr(t.shape[0])
        prefix = "__shared__ __align__(16) " if t.scope == "shared" else ""
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
        self.emit(f'extern "C" __global__ void {bounds}{symbol_name(func)}({params}) {{')
        self.depth += 1
        self.visit(func.body)
        self.depth -= 1
        self.emit("}")
        return "\n".join(self.lines)


def generate_cuda(funcs: list[Function]) -> str:
    """CUDA source for a list of lowered CUDA kernels."""
    parts = [CUDA_PRELUDE.strip().replace("{helpers}", SHARED_HELPERS.format(q="__device__ __forceinline__").strip())]
    for f in funcs:
        parts.append(CudaCodegen().function(f))
    return "\n\n".join(parts) + "\n"
