"""Shared code generation for C-family targets (C for CPUs, CUDA C++ for GPUs).

Input is a lowered Function (see transforms.pipeline): task mappings are loops and every
tensor access is one-dimensional.  Subclasses supply type names, intrinsics and the
target-specific statements.
"""

from __future__ import annotations

import math
import re

from tessera.backend.codegen_lowbit import c_statements
from tessera.errors import STATUS_DIVISION_BY_ZERO, STATUS_INDEX_OUT_OF_RANGE, STATUS_NEGATIVE_POWER, UnsupportedError
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.dtypes import DataType
from tessera.ir.func import Function
from tessera.ir.functor import IRVisitor
from tessera.ir.types import PointerType, TensorType

_C_INT = {"int8": "int8_t", "int16": "int16_t", "int32": "int32_t", "int64": "int64_t",
          "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t", "uint64": "uint64_t",
          "bool": "bool", "float32": "float", "float64": "double"}  # fmt: skip
_C_MATH = {"exp": "exp", "exp2": "exp2", "log": "log", "log2": "log2", "sqrt": "sqrt", "sin": "sin", "cos": "cos",
           "tanh": "tanh", "erf": "erf", "floor": "floor", "ceil": "ceil", "round": "nearbyint", "pow": "pow",
           "fma": "fma", "abs": "fabs", "max": "ts_max", "min": "ts_min", "fmod": "fmod", "fmax": "fmax", "asin": "asin", "acos": "acos",
           "atan": "atan", "sinh": "sinh", "cosh": "cosh", "asinh": "asinh", "acosh": "acosh", "atanh": "atanh"}  # fmt: skip
# Helpers both preludes need, with the target's function qualifier as {q}.  ts_max/ts_min
# propagate NaN like numpy and torch (fmax/fmin would drop it); the floor helpers give integer
# // and % and float % Python's semantics.
#
# Integer division semantics (C's `/` and `%` trap on x86 for a zero divisor and for
# INT_MIN / -1, which would kill the process): a `//` or `%` whose divisor is not provably
# safe (a positive size, a constant other than 0 and -1) goes through a checked helper.
# x // -1 and x % -1 wrap like two's complement (INT_MIN // -1 == INT_MIN, as numpy and torch).
# A zero divisor gives 0 (numpy's result) and, on the CPU, sets the kernel's status word
# (ts_status), from which the runtime raises DivisionByZeroError after the call, as torch does
# on the CPU; CUDA kernels have no status word and keep the 0.
# Integer max/min/abs are functions, not `a > b ? a : b` macros: an operand that is itself a
# max would be printed twice, and a chain of n of them 2**n times.  ts_ipow is exact integer
# exponentiation (wrapping like numpy); a negative exponent, which ONNX's and numpy's integer
# power refuse, sets the status word on the CPU; CUDA returns 1/a**-b truncated (1, -1 or 0).
SHARED_HELPERS = """
{q} float ts_maxf(float a, float b) {{ return (a != a || a > b) ? a : b; }}
{q} float ts_minf(float a, float b) {{ return (a != a || a < b) ? a : b; }}
{q} double ts_max(double a, double b) {{ return (a != a || a > b) ? a : b; }}
{q} double ts_min(double a, double b) {{ return (a != a || a < b) ? a : b; }}
{q} int32_t ts_floordiv(int32_t a, int32_t b) {{ int32_t q = a / b; return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q; }}
{q} int32_t ts_floormod(int32_t a, int32_t b) {{ int32_t r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }}
{q} int64_t ts_floordiv64(int64_t a, int64_t b) {{ int64_t q = a / b; return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q; }}
{q} int64_t ts_floormod64(int64_t a, int64_t b) {{ int64_t r = a % b; return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }}
{q} float ts_fmod_floorf(float a, float b) {{ float r = fmodf(a, b); return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }}
{q} double ts_fmod_floor(double a, double b) {{ double r = fmod(a, b); return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r; }}
{q} int32_t ts_floordiv_chk(int32_t a, int32_t b{sp}) {{ if (b == 0) {{ {flag}return 0; }} return b == -1 ? (int32_t)(0u - (uint32_t)a) : ts_floordiv(a, b); }}
{q} int32_t ts_floormod_chk(int32_t a, int32_t b{sp}) {{ if (b == 0) {{ {flag}return 0; }} return b == -1 ? 0 : ts_floormod(a, b); }}
{q} int64_t ts_floordiv64_chk(int64_t a, int64_t b{sp}) {{ if (b == 0) {{ {flag}return 0; }} return b == -1 ? (int64_t)(0ull - (uint64_t)a) : ts_floordiv64(a, b); }}
{q} int64_t ts_floormod64_chk(int64_t a, int64_t b{sp}) {{ if (b == 0) {{ {flag}return 0; }} return b == -1 ? 0 : ts_floormod64(a, b); }}
{q} uint32_t ts_udiv_chk(uint32_t a, uint32_t b{sp}) {{ if (b == 0) {{ {flag}return 0; }} return a / b; }}
{q} uint32_t ts_umod_chk(uint32_t a, uint32_t b{sp}) {{ if (b == 0) {{ {flag}return 0; }} return a % b; }}
{q} uint64_t ts_udiv64_chk(uint64_t a, uint64_t b{sp}) {{ if (b == 0) {{ {flag}return 0; }} return a / b; }}
{q} uint64_t ts_umod64_chk(uint64_t a, uint64_t b{sp}) {{ if (b == 0) {{ {flag}return 0; }} return a % b; }}
{q} int64_t ts_index_chk(int64_t i, int64_t n{sp}) {{ if (i < -n || i >= n) {{ {index_flag}return i < 0 ? 0 : n - 1; }} return i < 0 ? i + n : i; }}
{q} int32_t ts_max_i32(int32_t a, int32_t b) {{ return a > b ? a : b; }}
{q} int32_t ts_min_i32(int32_t a, int32_t b) {{ return a < b ? a : b; }}
{q} int64_t ts_max_i64(int64_t a, int64_t b) {{ return a > b ? a : b; }}
{q} int64_t ts_min_i64(int64_t a, int64_t b) {{ return a < b ? a : b; }}
{q} uint32_t ts_max_u32(uint32_t a, uint32_t b) {{ return a > b ? a : b; }}
{q} uint32_t ts_min_u32(uint32_t a, uint32_t b) {{ return a < b ? a : b; }}
{q} uint64_t ts_max_u64(uint64_t a, uint64_t b) {{ return a > b ? a : b; }}
{q} uint64_t ts_min_u64(uint64_t a, uint64_t b) {{ return a < b ? a : b; }}
{q} int32_t ts_abs_i32(int32_t a) {{ return a < 0 ? (int32_t)(0u - (uint32_t)a) : a; }}
{q} int64_t ts_abs_i64(int64_t a) {{ return a < 0 ? (int64_t)(0ull - (uint64_t)a) : a; }}
{q} uint64_t ts_upow(uint64_t a, uint64_t b) {{ uint64_t r = 1; while (b) {{ if (b & 1) r *= a; a *= a; b >>= 1; }} return r; }}
{q} int64_t ts_ipow(int64_t a, int64_t b{sp}) {{
  if (b < 0) {{ {pow_flag}return a == 1 ? 1 : a == -1 ? ((b & 1) ? -1 : 1) : 0; }}
  return (int64_t)ts_upow((uint64_t)a, (uint64_t)b);
}}
"""
# Packed tensors of storage types (tessera.quant): element i of a b-bit tensor occupies bits
# [i*b, i*b + b) of the byte stream, least significant bit first (dense, fields may cross
# bytes).  ts_bits reads the field as unsigned (touching the second byte only when the field
# crosses into it, so the last element never reads past the end), ts_sbits sign-extends it,
# ts_small_float decodes a small-float code: nan_rule 0 = finite only (e2m1, e2m3, e3m2),
# 1 = e4m3fn (S.1111.111 is NaN, no inf), 2 = IEEE (top exponent: inf/NaN; e5m2).
LOWBIT_HELPERS = """
{q} uint32_t ts_bits(const uint8_t* p, int64_t i, int b) {{
  int64_t bit = i * b; const uint8_t* c = p + (bit >> 3); int s = (int)(bit & 7);
  uint32_t v = c[0]; if (s + b > 8) v |= (uint32_t)c[1] << 8;
  return (v >> s) & ((1u << b) - 1u);
}}
{q} int32_t ts_sbits(const uint8_t* p, int64_t i, int b) {{ return (int32_t)(ts_bits(p, i, b) << (32 - b)) >> (32 - b); }}
{q} float ts_small_float(uint32_t v, int e, int m, int nan_rule) {{
  int sign = (v >> (e + m)) & 1, E = (v >> m) & ((1 << e) - 1), M = v & ((1 << m) - 1), bias = (1 << (e - 1)) - 1;
  float r;
  if (nan_rule == 2 && E == (1 << e) - 1) r = M ? NAN : INFINITY;
  else if (nan_rule == 1 && E == (1 << e) - 1 && M == (1 << m) - 1) r = NAN;
  else if (E == 0) r = ldexpf((float)M, 1 - bias - m);
  else r = ldexpf((float)((1 << m) | M), E - bias - m);
  return sign ? -r : r;
}}
"""


def small_float_rule(t: DataType) -> int:
    """ts_small_float's nan_rule for the small float `t`."""
    return {"e4m3": 1, "e5m2": 2}.get(t.name, 0)


STATUS = "ts_status"  # the CPU kernels' last parameter: int32_t*, set to a tessera.errors STATUS_* code


def shared_helpers(qualifier: str, status: bool) -> str:
    """SHARED_HELPERS for a target; with `status` the checked divisions report to ts_status."""
    lowbit = LOWBIT_HELPERS.format(q=qualifier).strip()
    if not status:
        return SHARED_HELPERS.format(q=qualifier, sp="", flag="", index_flag="", pow_flag="").strip() + "\n" + lowbit

    def flag(code: int) -> str:
        return f"__atomic_store_n({STATUS}, {code}, __ATOMIC_RELAXED); "

    return SHARED_HELPERS.format(q=qualifier, sp=f", int32_t* {STATUS}", flag=flag(STATUS_DIVISION_BY_ZERO),
                                 index_flag=flag(STATUS_INDEX_OUT_OF_RANGE),
                                 pow_flag=flag(STATUS_NEGATIVE_POWER)).strip() + "\n" + lowbit  # fmt: skip


# Generated code names every user identifier (kernels, parameters, locals, buffers) through
# `c_identifier` / `symbol_name`, never verbatim: a fixed scheme cannot clash with C or C++
# keywords, macros (INT32_MAX), the functions of math.h, CUDA or OpenMP (isgreater, normcdf,
# omp_get_thread_num) or the preludes' own `ts_` helpers, whatever the headers declare.
# Variables end in `_` (no keyword, macro or library function of those headers does);
# kernels are exported as `ts_kernel_<name>`, since an exported symbol also competes with
# every library loaded in the process (a kernel named omp_get_thread_num would replace
# libgomp's); the generated code's own names start with `ts_`, which no mangled name does.
KERNEL_PREFIX = "ts_kernel_"


def _sanitized(name: str) -> str:
    """`name` with non-identifier characters replaced; never empty, never in the reserved
    namespaces of C (leading `__` or `_` + capital) or of the generated code (`ts_`)."""
    name = re.sub(r"\W", "_", name, flags=re.ASCII) or "v"
    if name[0].isdigit() or name.startswith(("ts_", "_")):
        name = "v" + name
    return name


def c_identifier(name: str) -> str:
    """The C name of a variable called `name` in the kernel (a parameter, local or buffer)."""
    return _sanitized(name) + "_"


def symbol_name(func: Function) -> str:
    """The name of the generated C/CUDA function for `func` (what the runtime looks up)."""
    return KERNEL_PREFIX + _sanitized(func.name)


_PREC = {"||": 1, "&&": 2, "|": 3, "^": 4, "&": 5, "==": 6, "!=": 6, "<": 7, "<=": 7, ">": 7, ">=": 7,
         "<<": 8, ">>": 8, "+": 9, "-": 9, "*": 10, "/": 10, "%": 10}  # fmt: skip


class _Assigned(IRVisitor):
    """Collect variables that are assigned after their declaration."""

    def __init__(self) -> None:
        self.vars: set[E.Var] = set()

    def visit_Assign(self, s: S.Assign) -> None:
        self.vars.add(s.var)
        self.visit(s.value)


class CLikeCodegen(IRVisitor):
    """Emit one function.  `visit` on an expression returns a string; on a statement, emits lines."""

    target = "c"

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.depth = 0
        self.names: dict[E.Var, str] = {}
        self.used_names: set[str] = set()
        self.nonneg: set[E.Var] = set()
        self.positive: set[E.Var] = set()
        self.assigned: set[E.Var] = set()

    # ---- hooks for subclasses -----------------------------------------------------------
    def scalar_type(self, t: DataType) -> str:
        """The C type a value of dtype `t` is computed in."""
        if t.is_storage_only:  # packed-tensor values compute in int32 / float32
            return _C_INT[dtypes.compute_type(t).name]
        if t in (dtypes.float16, dtypes.bfloat16):
            return "float"
        return _C_INT[t.name]

    def storage_type(self, t: DataType) -> str:
        """The C type of a value of dtype `t` held in memory."""
        if t.is_storage_only:  # packed bytes (codegen reads fields with ts_bits)
            return "uint8_t"
        if t in (dtypes.float16, dtypes.bfloat16):
            return "uint16_t"
        return self.scalar_type(t)

    def load_value(self, t: DataType, text: str) -> str:
        if t == dtypes.float16:
            return f"ts_h2f({text})"
        if t == dtypes.bfloat16:
            return f"ts_bf2f({text})"
        return text

    def store_value(self, t: DataType, text: str) -> str:
        if t == dtypes.float16:
            return f"ts_f2h({text})"
        if t == dtypes.bfloat16:
            return f"ts_f2bf({text})"
        return text

    def cast(self, value: str, src: DataType, dst: DataType) -> str:
        if dst in (dtypes.float16, dtypes.bfloat16):  # round through the narrow format
            wide = f"ts_d2f_odd({value})" if src == dtypes.float64 else f"(float)({value})"  # round once, not twice
            return self.load_value(dst, self.store_value(dst, wide))
        return f"(({self.scalar_type(dst)})({value}))"

    def math_call(self, name: str, args: list[str], t: DataType) -> str:
        if name == "checked_index":
            return f"ts_index_chk((int64_t)({args[0]}), (int64_t)({args[1]}){self.status_argument()})"
        if t.is_integer or t.is_bool:
            if name in ("max", "min", "abs"):
                return self.integer_call(name, args, t)
        if name not in _C_MATH and name != "rsqrt":
            raise UnsupportedError(f"{name}() is not available on the {self.target} target")
        if name == "rsqrt":
            return f"(1.0f / sqrtf({args[0]}))" if t != dtypes.float64 else f"(1.0 / sqrt({args[0]}))"
        fn = _C_MATH[name]
        if t != dtypes.float64:
            fn += "f"
        return f"{fn}({', '.join(args)})"

    def integer_call(self, name: str, args: list[str], t: DataType) -> str:
        """max/min/abs of integers through the typed helpers (each operand printed once);
        types narrower than 32 bits compute in int32, as C promotes them, and convert back."""
        wide = t.nbits == 64
        suffix = ("u" if t.kind == "uint" and t.nbits >= 32 else "i") + ("64" if wide else "32")
        if name == "abs" and suffix.startswith("u"):
            return args[0]
        text = f"ts_{name}_{'i' + suffix[1:] if name == 'abs' else suffix}({', '.join(args)})"
        return text if t.nbits in (32, 64) else f"(({self.scalar_type(t)}){text})"

    def special_call(self, e: E.Call) -> str | None:
        """Intrinsics whose operands keep their own types: ipow (an integer exponent) and
        bitcast (the same bits as another type of the same width)."""
        if e.func == "ipow":
            t = e.type
            if t.kind == "uint":
                text = f"ts_upow((uint64_t)({self.expr(e.args[0])}), (uint64_t)({self.expr(e.args[1])}))"
            else:
                text = f"ts_ipow((int64_t)({self.expr(e.args[0])}), (int64_t)({self.expr(e.args[1])}){self.status_argument()})"
            return f"(({self.scalar_type(t)}){text})"
        if e.func == "bitcast":
            src, dst = e.args[0].dtype, e.type
            if src.nbits != dst.nbits:
                raise UnsupportedError(f"bitcast from {src} to {dst}: the widths differ")
            bits = self.to_bits(self.expr(e.args[0]), src)
            return self.from_bits(bits, dst)
        return None

    def to_bits(self, value: str, t: DataType) -> str:
        """An unsigned integer of t's width holding the bits of `value` (of dtype t)."""
        u = f"uint{max(t.nbits, 8)}_t"
        if t.is_float:
            return f"ts_bits_of_{t.name}({value})"
        return f"(({u})({value}))"

    def from_bits(self, bits: str, t: DataType) -> str:
        """The value of dtype t whose bits are the unsigned integer `bits`."""
        if t.is_float:
            return f"ts_{t.name}_of_bits({bits})"
        return f"(({self.scalar_type(t)})({bits}))"

    def const_float(self, value: float, t: DataType) -> str:
        if math.isnan(value):
            return "NAN"
        if math.isinf(value):
            return "INFINITY" if value > 0 else "(-INFINITY)"
        text = repr(float(value))
        return text if t == dtypes.float64 else text + "f"

    def pointer_param(self, var: E.Var) -> str:
        return f"{self.storage_type(var.type.dtype)}* __restrict__ {self.name_of(var)}"

    def emit_declare_buffer(self, var: E.Var, t: TensorType) -> None:
        raise NotImplementedError

    def emit_barrier(self) -> None:
        raise UnsupportedError(f"barriers are not available on the {self.target} target")

    def loop_pragma(self, kind: str) -> str | None:
        return None

    def hardware_index(self, name: str) -> str:
        raise UnsupportedError(f"{name} is not available on the {self.target} target")

    # ---- names -------------------------------------------------------------------------------
    def name_of(self, v: E.Var) -> str:
        if v not in self.names:
            name, k = c_identifier(v.name), 0
            while name in self.used_names:  # two variables of one name (e.g. two loops' `i`)
                k += 1
                name = c_identifier(f"{v.name}_{k}")
            self.used_names.add(name)
            self.names[v] = name
        return self.names[v]

    # ---- lines -----------------------------------------------------------------------------
    def emit(self, text: str) -> None:
        self.lines.append("  " * self.depth + text)

    def body_block(self, header: str, body: S.Stmt) -> None:
        self.emit(header + " {")
        self.depth += 1
        self.visit(body)
        self.depth -= 1
        self.emit("}")

    # ---- non-negativity, to emit plain / and % where floor semantics agree with C -------
    def is_nonneg(self, e: E.Expr) -> bool:
        if isinstance(e, E.Const):
            return e.value >= 0
        if isinstance(e, E.HardwareIndex):
            return True
        if isinstance(e.type, DataType) and e.type.kind == "uint":
            return True
        if isinstance(e, E.Var):
            return e in self.nonneg
        if isinstance(e, E.Binary) and e.op in ("+", "*", "//", "%", ">>", "&"):
            return self.is_nonneg(e.a) and self.is_nonneg(e.b)
        if isinstance(e, E.Call) and e.func in ("max", "min"):
            return all(self.is_nonneg(a) for a in e.args) or (e.func == "max" and any(self.is_nonneg(a) for a in e.args))
        if isinstance(e, E.Cast):
            return e.type.is_integer and isinstance(e.value.type, DataType) and e.value.type.is_integer and self.is_nonneg(e.value)
        return False

    def is_positive(self, e: E.Expr) -> bool:
        """True when the integer `e` is at least 1 whenever it is evaluated."""
        if isinstance(e, E.Const):
            return e.value > 0
        if isinstance(e, E.HardwareIndex):
            return e.name.startswith(("blockDim", "gridDim"))
        if isinstance(e, E.Var):
            return e in self.positive
        if isinstance(e, E.Binary) and e.op == "*":
            return self.is_positive(e.a) and self.is_positive(e.b)
        if isinstance(e, E.Binary) and e.op == "+":
            return (self.is_positive(e.a) and self.is_nonneg(e.b)) or (self.is_nonneg(e.a) and self.is_positive(e.b))
        if isinstance(e, E.Call) and e.func == "max":
            return any(self.is_positive(a) for a in e.args)
        if isinstance(e, E.Cast):  # a widening integer conversion keeps the value
            src = e.value.type
            return (isinstance(src, DataType) and src.is_integer and e.type.is_integer and e.type.nbits >= src.nbits
                    and self.is_positive(e.value))  # fmt: skip
        return False

    def safe_divisor(self, b: E.Expr, a: E.Expr) -> bool:
        """Whether `a // b` and `a % b` cannot trap: b is never 0, and never -1 with a possibly INT_MIN."""
        if self.is_positive(b):
            return True
        if isinstance(b, E.Const):
            return b.value not in (0, -1) or (b.value == -1 and self.is_nonneg(a))
        return False

    def checked_division(self, op: str, a: E.Expr, b: E.Expr, t: DataType) -> str:
        """`a op b` through the helper that defines a zero divisor and INT_MIN // -1 (SHARED_HELPERS)."""
        if t.kind == "uint" and t.nbits >= 32:
            fn = ("ts_udiv" if op == "//" else "ts_umod") + ("64" if t.nbits == 64 else "")
        else:  # narrower types compute in int32, as C promotes them
            fn = ("ts_floordiv" if op == "//" else "ts_floormod") + ("64" if t.nbits == 64 else "")
            t = t if t.nbits == 64 else dtypes.int32
        return f"{fn}_chk({self.operand(a, t, 0)}, {self.operand(b, t, 0)}{self.status_argument()})"

    def status_argument(self) -> str:
        """What the checked division helpers take after the operands (the CPU's status word)."""
        return ""

    # ---- expressions -------------------------------------------------------------------------
    def expr(self, e: E.Expr, parent: int = 0) -> str:
        if isinstance(e, E.Binary):
            return self.binary(e, parent)
        return self.visit(e)

    def operand(self, e: E.Expr, t: DataType, prec: int) -> str:
        """An operand converted to the operation's type `t`."""
        if e.dtype == t or (isinstance(e, E.Const) and not t.is_bool and not (e.dtype.is_float and not t.is_float)):
            if isinstance(e, E.Const) and e.dtype != t:
                return self.visit(E.Const(e.value, t))
            return self.expr(e, prec)
        return self.cast(self.expr(e), e.dtype, t)

    def binary(self, e: E.Binary, parent: int) -> str:
        op = e.op
        if op in E.COMPARE_OPS:
            t = dtypes.promote(e.a.dtype, e.b.dtype) if e.a.dtype != e.b.dtype else e.a.dtype
        elif op in E.LOGIC_OPS:
            t = dtypes.boolean
        else:
            t = e.type
        if op == "/" and t.is_integer:  # cannot happen: int / int is typed float
            raise UnsupportedError("integer '/' reached codegen")
        if op in ("//", "%") and (t.is_integer or t.is_bool) and not self.safe_divisor(e.b, e.a):
            return self.checked_division(op, e.a, e.b, t)
        if op in ("//", "%") and t.is_integer and not (self.is_nonneg(e.a) and self.is_nonneg(e.b)):
            fn = "ts_floordiv" if op == "//" else "ts_floormod"
            suffix = "64" if t.nbits == 64 else ""
            return f"{fn}{suffix}({self.operand(e.a, t, 0)}, {self.operand(e.b, t, 0)})"
        if op == "%" and t.is_float:
            fn = "ts_fmod_floor" if t == dtypes.float64 else "ts_fmod_floorf"
            return f"{fn}({self.operand(e.a, t, 0)}, {self.operand(e.b, t, 0)})"
        c_op = "/" if op == "//" else op
        p = _PREC[c_op]
        if op in ("<<", ">>"):
            text = f"{self.operand(e.a, e.type, p)} {c_op} {self.expr(e.b, p + 1)}"
        else:
            text = f"{self.operand(e.a, t, p)} {c_op} {self.operand(e.b, t, p + 1)}"
        return f"({text})" if p < parent or p <= 8 else text

    def visit_Var(self, e: E.Var) -> str:
        return self.name_of(e)

    def visit_Const(self, e: E.Const) -> str:
        t = e.type
        if t.is_bool:
            return "true" if e.value else "false"
        if t.is_float:
            return self.const_float(e.value, t)
        if t == dtypes.int64:
            return f"{e.value}LL"
        if t == dtypes.uint64:
            return f"{e.value}ULL"
        if t == dtypes.uint32:
            return f"{e.value}u"
        if t == dtypes.int32:
            return str(e.value) if e.value != -(2**31) else "(-2147483647 - 1)"
        return f"(({self.scalar_type(t)}){e.value})"

    def visit_HardwareIndex(self, e: E.HardwareIndex) -> str:
        return self.hardware_index(e.name)

    def visit_Unary(self, e: E.Unary) -> str:
        return f"({e.op}{self.operand(e.a, e.type if e.op != '!' else dtypes.boolean, 11)})"

    def visit_Cast(self, e: E.Cast) -> str:
        return self.cast(self.expr(e.value), e.value.dtype, e.type)

    def visit_Select(self, e: E.Select) -> str:
        return f"({self.expr(e.cond, 1)} ? {self.operand(e.a, e.type, 1)} : {self.operand(e.b, e.type, 1)})"

    def visit_Call(self, e: E.Call) -> str:
        special = self.special_call(e)
        if special is not None:
            return special
        args = [self.operand(a, e.type, 0) for a in e.args]
        return self.math_call(e.func, args, e.type)

    def visit_Load(self, e: E.Load) -> str:
        t = e.type
        if t.is_storage_only:
            return self.packed_load(t, self.name_of(e.buffer), self.expr(e.indices[0]))
        return self.load_value(e.type, f"{self.name_of(e.buffer)}[{self.expr(e.indices[0])}]")

    def packed_load(self, t: DataType, buf: str, index: str) -> str:
        """Element `index` of a packed tensor of the storage type `t`, in its compute type."""
        if t.is_integer:
            fn = "ts_sbits" if t.kind == "int" else "(int32_t)ts_bits"
            return f"{fn}({buf}, (int64_t)({index}), {t.nbits})"
        return (f"ts_small_float(ts_bits({buf}, (int64_t)({index}), {t.nbits}), {t.exponent_bits}, "
                f"{t.mantissa_bits}, {small_float_rule(t)})")  # fmt: skip

    def visit_Address(self, e: E.Address) -> str:
        if e.buffer.type.dtype.is_storage_only:
            raise UnsupportedError(f"'{e.buffer.name}' holds packed {e.buffer.type.dtype} values, which have no "
                                   "element addresses; pass the packed words as a uint32 tensor for vector loads")
        return f"(&{self.name_of(e.buffer)}[{self.expr(e.indices[0])}])"

    # ---- statements -------------------------------------------------------------------------
    def visit_Evaluate(self, s: S.Evaluate) -> None:
        self.emit(self.expr(s.expr) + ";")

    def visit_DeclareVar(self, s: S.DeclareVar) -> None:
        t = s.var.type
        if s.init is not None and s.var not in self.assigned and self.is_nonneg(s.init) and t.is_integer:
            self.nonneg.add(s.var)
            if self.is_positive(s.init):
                self.positive.add(s.var)
        init = "" if s.init is None else f" = {self.operand(s.init, t, 0)}"
        self.emit(f"{self.scalar_type(t)} {self.name_of(s.var)}{init};")

    def visit_Assign(self, s: S.Assign) -> None:
        self.emit(f"{self.name_of(s.var)} = {self.operand(s.value, s.var.type, 0)};")

    def visit_Store(self, s: S.Store) -> None:
        t = s.buffer.type.dtype
        value = self.store_value(t, self.operand(s.value, t, 0))
        self.emit(f"{self.name_of(s.buffer)}[{self.expr(s.indices[0])}] = {value};")

    def visit_DeclareBuffer(self, s: S.DeclareBuffer) -> None:
        self.emit_declare_buffer(s.var, s.var.type)

    def visit_For(self, s: S.For) -> None:
        if self.is_nonneg(s.start):  # loops count up (steps are positive)
            self.nonneg.add(s.var)
        if self.is_positive(s.start):
            self.positive.add(s.var)
        v = self.name_of(s.var)
        t = self.scalar_type(s.var.type)
        pragma = self.loop_pragma(s.kind)
        if pragma:
            self.emit(pragma)
        step = self.operand(s.step, s.var.type, 0)
        inc = f"++{v}" if isinstance(s.step, E.Const) and s.step.value == 1 else f"{v} += {step}"
        header = f"for ({t} {v} = {self.operand(s.start, s.var.type, 0)}; {v} < {self.operand(s.stop, s.var.type, 7)}; {inc})"
        self.body_block(header, s.body)

    def visit_ForMapping(self, s: S.ForMapping) -> None:
        raise UnsupportedError("task-mapping loops must be lowered before code generation")

    def visit_If(self, s: S.If) -> None:
        self.body_block(f"if ({self.expr(s.cond)})", s.then_body)
        if s.else_body is not None:
            self.body_block("else", s.else_body)

    def visit_While(self, s: S.While) -> None:
        self.body_block(f"while ({self.expr(s.cond)})", s.body)

    def visit_Break(self, s: S.Break) -> None:
        self.emit("break;")

    def visit_Continue(self, s: S.Continue) -> None:
        self.emit("continue;")

    def visit_Return(self, s: S.Return) -> None:
        self.emit("return;")

    def visit_Barrier(self, s: S.Barrier) -> None:
        self.emit_barrier()

    def visit_Instruction(self, s: S.Instruction) -> None:
        if s.name == "dequant":
            for line in c_statements(s.attrs, *(self.expr(x) for x in s.operands)):
                self.emit(line)
            return
        if s.name != "copy_vector":
            raise UnsupportedError(f"{s.name} is not available on the {self.target} target")
        dst, src = (self.expr(x) for x in s.operands)
        self.emit(f"memcpy({dst}, {src}, {s.attrs['bytes']});")

    def visit_Seq(self, s: S.Seq) -> None:
        for x in s.stmts:
            self.visit(x)

    # ---- function ---------------------------------------------------------------------------
    def params(self, func: Function) -> list[str]:
        out = []
        for p in func.all_params:
            if isinstance(p.type, PointerType):
                out.append(self.pointer_param(p))
            elif isinstance(p.type, DataType):
                out.append(f"{self.scalar_type(p.type)} {self.name_of(p)}")
            else:
                raise UnsupportedError(f"parameter '{p.name}' of type {p.type} reached codegen unflattened")
        for p in func.shape_params:
            self.nonneg.add(p)
        self.nonneg |= func.size_params
        self.positive |= func.size_params
        return out

    def prepare(self, func: Function) -> None:
        finder = _Assigned()
        finder.visit(func.body)
        self.assigned = finder.vars
