"""Lowerings of the `dequant` instruction (tessera.ir.lowbit describes the register layout).

Both targets rebuild each half2 register with the same shift-and-mask terms
(`lowbit.register_terms`); CUDA then subtracts and scales with half2 arithmetic (HSUB2, HMUL2),
C with float arithmetic rounded once to fp16, which gives the same bits (the difference of two
small integers is exact, and a product of two halves is exact in float).
"""

from __future__ import annotations

from typing import Any

from tessera.ir import lowbit
from tessera.ir.dtypes import DataType


def _term(word: int, shift: int, mask: int, w: str) -> str:
    moved = f"({w}[{word}] << {shift})" if shift > 0 else f"({w}[{word}] >> {-shift})" if shift < 0 else f"{w}[{word}]"
    return f"({moved} & {mask:#x}u)"


def register_expr(t: DataType, reg: int, w: str) -> str:
    """The uint32 bit pattern (two halves) of register `reg` of a unit held in words `w`."""
    terms = [_term(*term, w) for term in lowbit.register_terms(t, reg)]
    if t.is_integer:
        terms.insert(0, f"{lowbit.INT_MAGIC:#x}u")
    return " | ".join(terms)


def _moved(word: int, shift: int, w: str) -> str:
    return f"({w}[{word}] << {shift})" if shift > 0 else f"({w}[{word}] >> {-shift})" if shift < 0 else f"{w}[{word}]"


def raw_register_expr(t: DataType, reg: int, w: str) -> str:
    """The uint32 bit pattern of register `reg` of a raw dequant (lowbit.raw_magic): integers at
    the CUDA displacement, OR-ed into int_magic(d); small floats as register_expr."""
    if not t.is_integer:
        return register_expr(t, reg, w)
    d = lowbit.int_displacement(t, reg)
    terms = [_term(*term, w) for term in lowbit.register_terms(t, reg, d)]
    return " | ".join([f"{lowbit.int_magic(d) * 0x10001:#x}u", *terms])


def byte_permutation(t: DataType, reg: int) -> tuple[int, int, int] | None:
    """(word, selector, constant) when register `reg` is whole bytes of one word and bytes of
    the magic constant: then one PRMT (`ts_prmt(w[word], constant, selector)`) builds it
    (the 8-bit integers and e5m2: two values per instruction, no shift, no mask)."""
    d = lowbit.int_displacement(t, reg) if t.is_integer else 0
    magic = lowbit.int_magic(d) * 0x10001 if t.is_integer else 0
    terms = lowbit.register_terms(t, reg, d)
    if len({word for word, _, _ in terms}) != 1:
        return None
    selector = 0
    for byte in range(4):
        sources = [(shift, (mask >> 8 * byte) & 0xFF) for _, shift, mask in terms if (mask >> 8 * byte) & 0xFF]
        if not sources:
            pick = 4 + byte  # the constant's own byte
        elif len(sources) == 1 and sources[0][1] == 0xFF and sources[0][0] % 8 == 0 and not (magic >> 8 * byte) & 0xFF:
            pick = byte - sources[0][0] // 8
            if not 0 <= pick < 4:
                return None
        else:
            return None
        selector |= pick << 4 * byte
    return terms[0][0], selector, magic


def cuda_register_expr(t: DataType, reg: int, w: str) -> str:
    """register_expr for CUDA: one PRMT where the register is whole bytes (byte_permutation);
    otherwise integers at their displacement (lowbit.int_displacement: no shift for most
    fields), the magic and first field through one `lop3` ((a & mask) | magic); from C,
    ptxas emits an AND and an OR (LOP3 takes one immediate).  The same bits as
    raw_register_expr."""
    perm = byte_permutation(t, reg)
    if perm is not None:
        word, selector, constant = perm
        return f"ts_prmt({w}[{word}], {constant:#x}u, {selector:#x}u)"
    if not t.is_integer:
        return register_expr(t, reg, w)
    d = lowbit.int_displacement(t, reg)
    (word, shift, mask), *rest = lowbit.register_terms(t, reg, d)
    magic = lowbit.int_magic(d) * 0x10001
    first = f"ts_lop3_and_or({_moved(word, shift, w)}, {mask:#x}u, {magic:#x}u)"
    return " | ".join([first, *(_term(*term, w) for term in rest)])


def helper_name(attrs: dict[str, Any]) -> str:
    t: DataType = attrs["wtype"]
    flags = f"{'_b' if attrs['has_bias'] else ''}{'' if attrs.get('has_scale', True) else '_n'}{'_raw' if attrs.get('raw') else ''}"
    return f"ts_dequant_{t.name}_s{attrs['start']}_c{attrs['count']}{flags}"


def cuda_helper(attrs: dict[str, Any]) -> str:
    t: DataType = attrs["wtype"]
    first, last = attrs["start"] // 2, (attrs["start"] + attrs["count"]) // 2
    lines = [
        f"__device__ __forceinline__ void {helper_name(attrs)}(void* dst, const void* src, const void* scale, const void* bias) {{",
        "  const uint32_t* w = reinterpret_cast<const uint32_t*>(src);",
        "  half2* d = reinterpret_cast<half2*>(dst);",
        "  const half* s = reinterpret_cast<const half*>(scale);",
        "  const half* b = reinterpret_cast<const half*>(bias);",
    ]  # fmt: skip
    scaled = attrs.get("has_scale", True)
    if attrs.get("raw"):  # the bits alone (lowbit.raw_magic): the kernel subtracts and scales
        if t.name in lowbit.HARDWARE_FLOATS:  # one byte per half (8-bit fields): gather, convert
            assert t.nbits == 8, t  # register r: byte r % 2 of each 16-bit half of word r // 2
            lines.append("#if __CUDA_ARCH__ >= 890")
            for reg in range(first, last):
                lines.append(f"  {{ uint32_t r = ts_cvt_{t.name}x2(ts_prmt(w[{reg // 2}], 0u, {0x20 + 0x11 * (reg % 2):#x}u)); "
                             f"d[{reg - first}] = *reinterpret_cast<half2*>(&r); }}")  # fmt: skip
            lines.append("#else")
            unit = 2.0 ** (lowbit.float_shift(t) - lowbit.raw_shift(t))
            for reg in range(first, last):
                lines.append(f"  {{ uint32_t r = {register_expr(t, reg, 'w')}; "
                             f"d[{reg - first}] = __hmul2(*reinterpret_cast<half2*>(&r), __float2half2_rn({unit!r}f)); }}")
            lines.append("#endif")
        else:
            for reg in range(first, last):
                lines.append(f"  {{ uint32_t r = {cuda_register_expr(t, reg, 'w')}; d[{reg - first}] = *reinterpret_cast<half2*>(&r); }}")
        return "\n".join([*lines, "}"])
    if scaled:
        lines.append("  const half2 s0 = __half2half2(s[0]), s1 = __half2half2(s[1]);")
    subtract = True
    offsets = {}  # (row, displacement) -> the half2 the register subtracts: magic + bias (or offset)
    if t.is_integer:
        for reg in range(first, last):
            row, d = reg % 2, lowbit.int_displacement(t, reg)
            if (row, d) in offsets:
                continue
            name = offsets[(row, d)] = f"o{row}_{d}"
            if attrs["has_bias"]:
                lines.append(f"  const half2 {name} = __hadd2(__half2half2(b[{row}]), __float2half2_rn({2.0 ** (10 - d)!r}f));")
            else:
                lines.append(f"  const half2 {name} = __float2half2_rn({2.0 ** (10 - d) + lowbit.code_offset(t)!r}f);")
    elif attrs["has_bias"]:
        lines.append("  const half2 o0 = __half2half2(b[0]), o1 = __half2half2(b[1]);")
        offsets = {(0, 0): "o0", (1, 0): "o1"}
    else:
        subtract = False
    hardware = t.name in lowbit.HARDWARE_FLOATS  # sm_89+: a PRMT and a cvt per register, not shifts and masks
    for converted in (True, False) if hardware else (False,):
        if hardware:
            lines.append("#if __CUDA_ARCH__ >= 890" if converted else "#else")
        for reg in range(first, last):
            row = reg % 2
            value = "*reinterpret_cast<half2*>(&r)"
            if converted:  # the value itself, then * 2**-float_shift (exact): the same half as the shifts give
                lines.append(f"  {{ uint32_t r = ts_cvt_{t.name}x2(ts_prmt(w[{reg // 2}], 0u, {0x20 + 0x11 * (reg % 2):#x}u));")
                value = f"__hmul2({value}, __float2half2_rn({2.0 ** -lowbit.float_shift(t)!r}f))"
            else:
                lines.append(f"  {{ uint32_t r = {cuda_register_expr(t, reg, 'w')};")
            if subtract:
                value = f"__hsub2({value}, {offsets[(row, lowbit.int_displacement(t, reg))]})"
            lines.append(f"    d[{reg - first}] = {f'__hmul2({value}, s{row})' if scaled else value}; }}")
    if hardware:
        lines.append("#endif")
    lines.append("}")
    return "\n".join(lines)


def c_statements(attrs: dict[str, Any], dst: str, src: str, scale: str, bias: str) -> list[str]:
    """C lines (one block) for one dequant instruction; halves are uint16_t patterns."""
    t: DataType = attrs["wtype"]
    first, last = attrs["start"] // 2, (attrs["start"] + attrs["count"]) // 2
    out = ["{",
           f"  const uint32_t* ts_w = (const uint32_t*)({src}); uint16_t* ts_d = (uint16_t*)({dst});",
           f"  const uint16_t* ts_s = (const uint16_t*)({scale}); const uint16_t* ts_b = (const uint16_t*)({bias});",
           "  uint32_t ts_r; (void)ts_b;"]  # fmt: skip
    for reg in range(first, last):
        row = reg % 2
        if attrs.get("raw"):
            out.append(f"  ts_r = {raw_register_expr(t, reg, 'ts_w')};")
            i = 2 * (reg - first)
            if t.is_float and lowbit.raw_shift(t) != lowbit.float_shift(t):  # the value itself: exact in float
                unit = 2.0 ** (lowbit.float_shift(t) - lowbit.raw_shift(t))
                out.append(f"  ts_d[{i}] = ts_f2h(ts_h2f((uint16_t)ts_r) * {unit!r}f); "
                           f"ts_d[{i + 1}] = ts_f2h(ts_h2f((uint16_t)(ts_r >> 16)) * {unit!r}f);")  # fmt: skip
            else:
                out.append(f"  ts_d[{i}] = (uint16_t)ts_r; ts_d[{i + 1}] = (uint16_t)(ts_r >> 16);")
            continue
        if t.is_integer:
            off = f"(1024.0f + ts_h2f(ts_b[{row}]))" if attrs["has_bias"] else f"{1024 + lowbit.code_offset(t)}.0f"
        else:
            off = f"ts_h2f(ts_b[{row}])" if attrs["has_bias"] else "0.0f"
        out.append(f"  ts_r = {register_expr(t, reg, 'ts_w')};")
        for half, bits in ((0, "(uint16_t)ts_r"), (1, "(uint16_t)(ts_r >> 16)")):
            i = 2 * (reg - first) + half
            scale = f" * ts_h2f(ts_s[{row}])" if attrs.get("has_scale", True) else ""
            out.append(f"  ts_d[{i}] = ts_f2h((ts_h2f({bits}) - {off}){scale});")
    out.append("}")
    return out
