"""C code generation for CPU kernels (built with gcc; parallel() loops use OpenMP).

Every kernel takes one parameter after its own: `int32_t* ts_status`, which it sets to 1 when
an integer division by zero happened (see SHARED_HELPERS); runtime.cpu passes a fresh word per
call and raises DivisionByZeroError when it is set.

float16 and bfloat16 live in memory as 16-bit patterns and are computed in float: each
load widens, each store and each cast to them rounds to nearest even.
"""

from __future__ import annotations

import re

from tessera.backend.c_math import C_MATH_HELPERS, VECTOR_MATH
from tessera.backend.codegen_c_like import STATUS, CLikeCodegen, shared_helpers, symbol_name
from tessera.backend.isa import cpu_isa, supports_lanes
from tessera.backend.source_view import readable
from tessera.errors import UnsupportedError
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.func import CPU_KERNEL, Function
from tessera.ir.functor import IRVisitor
from tessera.ir.types import TensorType, VectorType
from tessera.ir.vector import VECTOR_CALLS

C_PRELUDE = r"""
#include <stdint.h>
#include <stdbool.h>
#include <string.h>
#include <math.h>
{intrinsics}

static inline float ts_h2f(uint16_t h) {
#if defined(__F16C__) && defined(TS_INTRINSICS)
  /* one vcvtph2ps, except for inf and NaN, whose payload (signalling bit included) is kept as is */
  if (__builtin_expect((h & 0x7c00u) != 0x7c00u, 1)) return _cvtsh_ss(h);
#endif
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0) {
    if (man == 0) { bits = sign; }
    else { int e = -1; do { e++; man <<= 1; } while (!(man & 0x400u)); bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13); }
  } else if (exp == 31) { bits = sign | 0x7f800000u | (man << 13); }
  else { bits = sign | ((exp + 112) << 23) | (man << 13); }
  float f; memcpy(&f, &bits, 4); return f;
}
static inline uint16_t ts_f2h(float f) {
  uint32_t x; memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u, absx = x & 0x7fffffffu;
  if (absx > 0x7f800000u) {  /* NaN: keep the payload's top bits, as numpy does (bitcasts round-trip) */
    uint32_t man = (absx & 0x7fffffu) >> 13;
    return (uint16_t)(sign | 0x7c00u | (man ? man : 1u));
  }
  if (absx == 0x7f800000u) return (uint16_t)(sign | 0x7c00u);
  if (absx >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  /* rounds to >= 65520: inf */
  if (absx < 0x38800000u) {  /* subnormal half or zero */
    if (absx < 0x33000000u) return (uint16_t)sign;
    uint32_t man = (absx & 0x7fffffu) | 0x800000u, sh = 126u - (absx >> 23);
    uint32_t q = man >> sh, rem = man & ((1u << sh) - 1u), half = 1u << (sh - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
  }
  uint32_t r = absx - 0x38000000u;  /* rebias exponent 127 -> 15 */
  uint32_t q = r >> 13, rem = r & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) q++;
  return (uint16_t)(sign | q);
}
static inline float ts_bf2f(uint16_t h) { uint32_t x = (uint32_t)h << 16; float f; memcpy(&f, &x, 4); return f; }
static inline uint16_t ts_f2bf(float f) {
  uint32_t x; memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | (((x >> 16) & 0x7fu) ? 0u : 0x40u));  /* NaN: payload kept */
  x += 0x7fffu + ((x >> 16) & 1u);
  return (uint16_t)(x >> 16);
}
/* double -> float rounding to odd: rounding that on to half or bfloat16 then rounds only once. */
static inline float ts_d2f_odd(double d) {
  float f = (float)d;
  if ((double)f != d && isfinite(f)) {
    uint32_t u; memcpy(&u, &f, 4);
    if (fabs((double)f) > fabs(d)) u -= 1;  /* rounded away from zero: step back towards it */
    u |= 1u; memcpy(&f, &u, 4);
  }
  return f;
}
/* The bits of a value and back (BitCast); 16-bit floats are computed in float and stored as bits. */
static inline uint32_t ts_bits_of_float32(float v) { uint32_t u; memcpy(&u, &v, 4); return u; }
static inline float ts_float32_of_bits(uint32_t u) { float v; memcpy(&v, &u, 4); return v; }
static inline uint64_t ts_bits_of_float64(double v) { uint64_t u; memcpy(&u, &v, 8); return u; }
static inline double ts_float64_of_bits(uint64_t u) { double v; memcpy(&v, &u, 8); return v; }
static inline uint16_t ts_bits_of_float16(float v) { return ts_f2h(v); }
static inline float ts_float16_of_bits(uint16_t u) { return ts_h2f(u); }
static inline uint16_t ts_bits_of_bfloat16(float v) { return ts_f2bf(v); }
static inline float ts_bfloat16_of_bits(uint16_t u) { return ts_bf2f(u); }
{helpers}
{math}
#if defined(__AVX2__) && defined(TS_INTRINSICS)
/* Lanes 0..n-1 of an 8 x int32 mask for the AVX2 masked loads and stores. */
static inline __m256i ts_mask8(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
/* The float16 bits in the low half of each of 8 int32 lanes, as 8 float32 (vcvtph2ps). */
static inline __m256 ts_half_lanes8(__m256i v) {
  const __m256i low = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1,
                                       0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1);
  return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, low), 0x08)));
}
static inline float ts_hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float ts_hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
#endif
"""

# Vector intrinsics by lane count: AVX-512 for 16 lanes, AVX2 + FMA for 8; float32 lanes in
# "type", int32 / uint32 lanes in "itype" (the whole register is "si").
_V = {
    16: {"type": "__m512", "itype": "__m512i", "si": "si512", "p": "_mm512_", "mask": "(__mmask16)((1u << ({n})) - 1u)"},
    8: {"type": "__m256", "itype": "__m256i", "si": "si256", "p": "_mm256_", "mask": "ts_mask8({n})"},
}
_V_BINARY = {"vadd": "add_ps", "vsub": "sub_ps", "vmul": "mul_ps", "vmax": "max_ps", "vmin": "min_ps"}
_V_INT_BINARY = {"vadd": "add_epi32", "vsub": "sub_epi32", "vand": "and_{si}", "vor": "or_{si}", "vxor": "xor_{si}"}


class CCodegen(CLikeCodegen):
    target = "c"

    def emit_declare_buffer(self, var, t: TensorType) -> None:
        if t.scope != "register":
            raise UnsupportedError(f"{t.scope} tensors are not available on the CPU")
        # 64-byte aligned: a cache line, and the alignment of a 16-lane vector.
        self.emit(f"{self.storage_type(t.dtype)} {self.name_of(var)}[{self.expr(t.shape[0])}] __attribute__((aligned(64)));")

    # ---- SIMD vectors (tessera.ir.vector) ------------------------------------------------
    def vector(self, t: VectorType) -> dict[str, str]:
        if not supports_lanes(t.lanes):
            raise UnsupportedError(f"{t} vectors need {'AVX-512' if t.lanes == 16 else 'AVX2'}, but the C kernels here "
                                   f"are built for {cpu_isa()} (tessera.backend.isa.vector_lanes() gives the width to use)")  # fmt: skip
        v = _V[t.lanes]
        return v if t.dtype == dtypes.float32 else {**v, "type": v["itype"]}

    def scalar_type(self, t) -> str:
        if isinstance(t, VectorType):
            return self.vector(t)["type"]
        return super().scalar_type(t)

    def storage_type(self, t) -> str:
        return self.scalar_type(t) if isinstance(t, VectorType) else super().storage_type(t)

    def operand(self, e: E.Expr, t, prec: int) -> str:
        if isinstance(e.type, VectorType) or isinstance(t, VectorType):
            return self.expr(e, prec)
        return super().operand(e, t, prec)

    def visit_DeclareVar(self, s: S.DeclareVar) -> None:
        if isinstance(s.var.type, VectorType):
            init = "" if s.init is None else f" = {self.expr(s.init)}"
            self.emit(f"{self.scalar_type(s.var.type)} {self.name_of(s.var)}{init};")
            return
        super().visit_DeclareVar(s)

    def visit_Call(self, e: E.Call) -> str:
        if e.func not in VECTOR_CALLS:
            return super().visit_Call(e)
        vt = e.type if isinstance(e.type, VectorType) else e.args[0].type
        v, p = self.vector(vt), self.vector(vt)["p"]
        args = e.args
        if e.func in ("vfloat", "vfloat16", "vbitcast", "vlookup", "vshl", "vshr") or vt.dtype != dtypes.float32:
            return self.integer_vector_call(e, v)
        if e.func == "vload":
            addr = self.expr(args[0])
            if len(args) == 1:
                return f"{p}loadu_ps({addr})"
            mask = v["mask"].format(n=self.expr(args[1]))
            return f"_mm512_maskz_loadu_ps({mask}, {addr})" if vt.lanes == 16 else f"_mm256_maskload_ps({addr}, {mask})"
        if e.func == "vbroadcast":
            return f"{p}set1_ps({self.expr(args[0])})"
        a = [self.expr(x) for x in args]
        if e.func == "vfma":
            return f"{p}fmadd_ps({a[0]}, {a[1]}, {a[2]})"
        if e.func in _V_BINARY:
            return f"{p}{_V_BINARY[e.func]}({a[0]}, {a[1]})"
        if e.func == "vsum":
            return f"_mm512_reduce_add_ps({a[0]})" if vt.lanes == 16 else f"ts_hsum8({a[0]})"
        if e.func == "vreduce_max":
            return f"_mm512_reduce_max_ps({a[0]})" if vt.lanes == 16 else f"ts_hmax8({a[0]})"
        raise UnsupportedError(f"{e.func}() is not available on the CPU")

    def integer_vector_call(self, e: E.Call, v: dict[str, str]) -> str:
        """The vector intrinsics of int32 / uint32 lanes, and those converting to and from them."""
        p, si, wide = v["p"], v["si"], v["p"] == "_mm512_"
        a = [self.expr(x) for x in e.args if not isinstance(x, E.Address)]
        if e.func == "vload":
            addr = self.expr(e.args[0])
            if len(e.args) == 1:
                return f"_mm512_loadu_si512((const void*)({addr}))" if wide else f"_mm256_loadu_si256((const __m256i*)({addr}))"
            mask = v["mask"].format(n=a[0])
            return f"_mm512_maskz_loadu_epi32({mask}, {addr})" if wide else f"_mm256_maskload_epi32((const int*)({addr}), {mask})"
        if e.func == "vbroadcast":
            return f"{p}set1_epi32((int32_t)({a[0]}))"
        if e.func in _V_INT_BINARY:
            return f"{p}{_V_INT_BINARY[e.func].format(si=si)}({a[0]}, {a[1]})"
        if e.func in ("vshl", "vshr"):
            op = "sll" if e.func == "vshl" else "srl" if e.args[0].type.dtype == dtypes.uint32 else "sra"
            if isinstance(e.args[1], E.Const):
                return f"{p}{op}i_epi32({a[0]}, {a[1]})"
            return f"{p}{op}_epi32({a[0]}, _mm_cvtsi32_si128((int)({a[1]})))"
        if e.func == "vfloat":
            return f"{p}cvtepi32_ps({a[0]})"
        if e.func == "vfloat16":  # each lane's low 16 bits, packed, then vcvtph2ps
            return f"_mm512_cvtph_ps(_mm512_cvtepi32_epi16({a[0]}))" if wide else f"ts_half_lanes8({a[0]})"
        if e.func == "vbitcast":
            src, dst = e.args[0].type.dtype, e.type.dtype
            if (src == dtypes.float32) == (dst == dtypes.float32):
                return f"({a[0]})"
            return f"{p}castps_{si}({a[0]})" if src == dtypes.float32 else f"{p}cast{si}_ps({a[0]})"
        if e.func == "vlookup":
            return f"_mm512_permutexvar_ps({a[1]}, {a[0]})" if wide else f"_mm256_permutevar8x32_ps({a[0]}, {a[1]})"
        raise UnsupportedError(f"{e.func}() takes float32 vectors")

    def visit_Instruction(self, s: S.Instruction) -> None:
        if s.name == "prefetch":
            self.emit(f"__builtin_prefetch({self.expr(s.operands[0])}, {int(s.attrs['write'])}, {s.attrs['locality']});")
            return
        if s.name != "vstore":
            super().visit_Instruction(s)
            return
        dst, value, *count = s.operands
        vt = value.type
        v = self.vector(vt)
        addr, val = self.expr(dst), self.expr(value)
        if vt.dtype != dtypes.float32:
            wide = vt.lanes == 16
            if not count:
                self.emit(f"_mm512_storeu_si512((void*)({addr}), {val});" if wide
                          else f"_mm256_storeu_si256((__m256i*)({addr}), {val});")  # fmt: skip
            else:
                mask = v["mask"].format(n=self.expr(count[0]))
                self.emit(f"_mm512_mask_storeu_epi32({addr}, {mask}, {val});" if wide
                          else f"_mm256_maskstore_epi32((int*)({addr}), {mask}, {val});")  # fmt: skip
            return
        if not count:
            self.emit(f"{v['p']}storeu_ps({addr}, {val});")
            return
        mask = v["mask"].format(n=self.expr(count[0]))
        if vt.lanes == 16:
            self.emit(f"_mm512_mask_storeu_ps({addr}, {mask}, {val});")
        else:
            self.emit(f"_mm256_maskstore_ps({addr}, {mask}, {val});")

    def visit_For(self, s: S.For) -> None:
        if s.kind == S.UNROLL and isinstance(s.start, E.Const) and isinstance(s.stop, E.Const):
            self.emit(f"#pragma GCC unroll {max(1, min(64, s.stop.value - s.start.value))}")
        if s.kind == S.SIMD:
            sums = _sum_accumulators(s.body)
            self.emit("#pragma omp simd" + (f" reduction(+:{', '.join(self.name_of(v) for v in sums)})" if sums else ""))
        super().visit_For(s)

    def status_argument(self) -> str:
        return f", {STATUS}"

    def math_call(self, name: str, args: list[str], t) -> str:
        # float32 exp/tanh/erf through the vectorisable helpers (backend/c_math.py); float64 through libm.
        if name in VECTOR_MATH and t.is_float and t.nbits <= 32:
            return f"{VECTOR_MATH[name]}({args[0]})"
        return super().math_call(name, args, t)

    def loop_pragma(self, kind: str) -> str | None:
        return "#pragma omp parallel for schedule(static)" if kind == S.PARALLEL else None

    def function(self, func: Function) -> str:
        if func.kind != CPU_KERNEL:
            raise UnsupportedError(f"the C backend compiles CPU kernels, not {func.kind}")
        self.prepare(func)
        params = ", ".join([*self.params(func), f"int32_t* {STATUS}"])
        self.emit(f"void {symbol_name(func)}({params}) {{")
        self.depth += 1
        self.visit(func.body)
        self.depth -= 1
        self.emit("}")
        return "\n".join(self.lines)


def _sum_accumulators(body: S.Stmt) -> list[E.Var]:
    """Scalar variables a SIMD loop body updates as `v = v + e` (its reductions)."""
    found: list[E.Var] = []

    class Finder(IRVisitor):
        def visit_Assign(self, a: S.Assign) -> None:
            v = a.value
            if isinstance(v, E.Binary) and v.op == "+" and v.a is a.var and a.var not in found:
                found.append(a.var)

    Finder().visit(body)
    return found


# <immintrin.h> costs gcc about half a second per build (most of a small kernel's build time), so
# the source includes it only where the kernels or the helpers they use need an intrinsic.
INTRINSICS_INCLUDE = """#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TS_INTRINSICS 1
#endif"""
_INTRINSIC = re.compile(r"\b(?:_mm\w*|__m(?:64|128|256|512)\w*|_cvtsh_ss|_cvtss_sh)\b")


def generate_c(funcs: list[Function]) -> str:
    """C source for a list of lowered CPU kernels."""
    prelude = C_PRELUDE.strip().replace("{helpers}", shared_helpers("static inline", status=True))
    prelude = prelude.replace("{math}", C_MATH_HELPERS.strip())
    bodies = [CCodegen().function(f) for f in funcs]
    source = "\n\n".join([prelude.replace("{intrinsics}", INTRINSICS_INCLUDE), *bodies]) + "\n"
    if _INTRINSIC.search(readable(source)):  # the kernels and the helpers they reach
        return source
    return "\n\n".join([prelude.replace("{intrinsics}\n", ""), *bodies]) + "\n"
