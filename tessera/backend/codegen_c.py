"""C code generation for CPU kernels (built with gcc; parallel() loops use OpenMP).

Every kernel takes one parameter after its own: `int32_t* ts_status`, which it sets to 1 when
an integer division by zero happened (see SHARED_HELPERS); runtime.cpu passes a fresh word per
call and raises DivisionByZeroError when it is set.

float16 and bfloat16 live in memory as 16-bit patterns and are computed in float: each
load widens, each store and each cast to them rounds to nearest even.
"""

from __future__ import annotations

from tessera.backend.codegen_c_like import STATUS, CLikeCodegen, shared_helpers, symbol_name
from tessera.errors import UnsupportedError
from tessera.ir import stmt as S
from tessera.ir.func import CPU_KERNEL, Function
from tessera.ir.types import TensorType

C_PRELUDE = r"""
#include <stdint.h>
#include <stdbool.h>
#include <string.h>
#include <math.h>

static inline float ts_h2f(uint16_t h) {
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
  if (absx >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0));
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
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
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
{helpers}
"""


class CCodegen(CLikeCodegen):
    target = "c"

    def emit_declare_buffer(self, var, t: TensorType) -> None:
        if t.scope != "register":
            raise UnsupportedError(f"{t.scope} tensors are not available on the CPU")
        self.emit(f"{self.storage_type(t.dtype)} {self.name_of(var)}[{self.expr(t.shape[0])}];")

    def status_argument(self) -> str:
        return f", {STATUS}"

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


def generate_c(funcs: list[Function]) -> str:
    """C source for a list of lowered CPU kernels."""
    parts = [C_PRELUDE.strip().replace("{helpers}", shared_helpers("static inline", status=True))]
    for f in funcs:
        parts.append(CCodegen().function(f))
    return "\n\n".join(parts) + "\n"
