"""Low-bit types in the kernel language: packed global tensors of every width (loads, fields
crossing bytes), small-float decoding, the `dequant` register instruction, against the numpy
codecs (tessera.quant.codecs); bad uses refused.  CUDA builds with nvcc where installed."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import tessera as ts
from tessera.errors import ArgumentError, KernelSyntaxError
from tessera.ir import lowbit
from tessera.quant import WEIGHT_TYPES, PackedTensor, codecs
from tessera.quant.layout import layout_codes, pack_units

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
IDS = [t.name for t in WEIGHT_TYPES]


def random_values(rng, t, shape):
    if t.is_integer:
        return rng.integers(t.min_value, t.max_value + 1, size=shape)
    return rng.normal(size=shape) * t.max_value / 3


def random_codes(rng, t, shape):
    """Codes of finite values (no NaN/inf codes)."""
    codes = rng.integers(0, 1 << t.nbits, size=shape).astype(np.uint8)
    if t.is_float:
        codes = np.where(np.isfinite(codecs.decode(codes, t)), codes, 0).astype(np.uint8)
    return codes


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_bits_is_dense_and_round_trips(rng, bits):
    for count in (1, 7, 13, 64, 101):
        codes = rng.integers(0, 1 << bits, size=count)
        packed = codecs.pack_bits(codes, bits)
        assert packed.size == (count * bits + 7) // 8
        assert np.array_equal(codecs.unpack_bits(packed, bits, count), codes)
        bit_string = "".join(format(int(c), f"0{bits}b")[::-1] for c in codes)  # LSB first, element after element
        bit_string += "0" * (8 * packed.size - len(bit_string))
        assert bytes(packed) == bytes(int(bit_string[i:i + 8][::-1], 2) for i in range(0, len(bit_string), 8))


def test_float_codecs_match_torch_float8():
    torch = pytest.importorskip("torch")
    for name, tt in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        t = ts.dtype(name)
        codes = np.arange(256, dtype=np.uint8)
        ref = torch.from_numpy(codes).view(tt).float().numpy()
        assert np.array_equal(codecs.decode(codes, t).astype(np.float32), ref, equal_nan=True)
        x = np.random.default_rng(3).normal(size=4000) * t.max_value / 4
        x = np.concatenate([x, (codecs.float_table(t)[:100] + codecs.float_table(t)[1:101]) / 2])  # ties
        x = x[np.isfinite(x)]
        mine = codecs.encode(x, t)
        theirs = torch.from_numpy(x).float().to(tt).view(torch.uint8).numpy()
        assert np.array_equal(mine, theirs)


def test_small_float_encoding_rounds_to_nearest_and_saturates():
    t = ts.dtype("e2m1")
    table = codecs.float_table(t)
    assert list(table[:8]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert list(codecs.decode(codecs.encode(np.array([0.74, 0.76, 2.5, 3.5, 5.0, 100.0, -7.0]), t), t)) == [
        0.5, 1.0, 2.0, 4.0, 4.0, 6.0, -6.0]  # ties to the even code: 2.5 -> 2, 3.5 -> 4, 5 -> 4


@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=IDS)
@pytest.mark.slow
def test_packed_loads_at_odd_sizes(rng, t):
    for n, k in ((1, 1), (3, 37), (5, 1), (2, 129)):
        values = random_values(rng, t, (n, k))
        w = PackedTensor.from_values(values, t)
        assert w.nbytes == (n * k * t.nbits + 7) // 8

        @ts.kernel(target="cpu")
        def widen(W: t["N", "K"], out: ts.f32["N", "K"], bias: ts.int32):
            for i in ts.parallel(N):
                for j in range(K):
                    x = W[i, j]  # a local of a storage type computes in int32 / float32
                    out[i, j] = ts.cast(x, ts.f32) + ts.cast(bias, ts.f32)

        for bias in (0, 3):
            out = np.full((n, k), np.nan, np.float32)
            widen(w, out, bias)
            assert np.array_equal(out, w.numpy().astype(np.float32) + bias)
            if t.is_float:
                assert np.array_equal(w.numpy(), codecs.decode(codecs.encode(values, t), t))
            else:
                assert np.array_equal(w.numpy(), values)


def test_sub_byte_arithmetic_promotes_like_c():
    @ts.kernel(target="cpu")
    def arith(W: ts.int3["N"], U: ts.uint2["N"], out: ts.i32["N"]):
        for i in range(N):
            out[i] = W[i] * 100 + (U[i] << 4) - W[i] * U[i]

    rng = np.random.default_rng(0)
    w, u = rng.integers(-4, 4, size=11), rng.integers(0, 4, size=11)
    out = np.zeros(11, np.int32)
    arith(PackedTensor.from_values(w, "int3"), PackedTensor.from_values(u, "uint2"), out)
    assert np.array_equal(out, w * 100 + (u << 4) - w * u)


def _dequant_kernel(t, words, starts):
    @ts.kernel(target="cpu")
    def unpack(Wd: ts.u32["L", "WW"], S: ts.f16[2], B: ts.f16[2], out: ts.f16["L", 128]):
        for lane in range(L):
            w = ts.register_tensor(ts.u32, [words])
            for i in range(words):
                w[i] = Wd[lane, i]
            s = ts.register_tensor(ts.f16, [2])
            bb = ts.register_tensor(ts.f16, [2])
            for i in range(2):
                s[i] = S[i]
                bb[i] = B[i]
            d = ts.register_tensor(ts.f16, [128])
            for i in range(128):
                d[i] = 0.0
            for start, count, biased, scaled, raw in starts:  # compile-time list: unrolled
                if raw:
                    ts.dequant(d[start], w[0], wtype=t, start=start, count=count, raw=True)
                elif biased and scaled:
                    ts.dequant(d[start], w[0], s[0], bb[0], wtype=t, start=start, count=count)
                elif scaled:
                    ts.dequant(d[start], w[0], s[0], wtype=t, start=start, count=count)
                elif biased:
                    ts.dequant(d[start], w[0], bias=bb[0], wtype=t, start=start, count=count)
                else:
                    ts.dequant(d[start], w[0], wtype=t, start=start, count=count)
            for i in range(128):
                out[lane, i] = d[i]

    return unpack


@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=IDS)
@pytest.mark.slow
def test_dequant_instruction_matches_reference(rng, t):
    """Every lane's 128 values, unpacked with the bit tricks, equal (code - bias) * scale
    rounded once to fp16 (offset binary for signed ints, value * 2**-float_shift for floats)."""
    b = t.nbits
    codes = random_codes(rng, t, (16, 256))
    words = pack_units(codes, t).reshape(b, 32, 4).transpose(1, 0, 2).reshape(32, 4 * b)
    rows = np.array([[lowbit.lane_value_position(lane, v)[0] for v in range(128)] for lane in range(32)])
    ks = np.array([[lowbit.lane_value_position(lane, v)[1] for v in range(128)] for lane in range(32)])
    c = codes[rows, ks]
    row = (np.arange(128) // 2) % 2
    # instructions over the unit: unbiased, biased, biased without scale, then one register
    # neither biased nor scaled (unscaled values are code - bias, exact)
    plan = [(0, 48, False, True, False), (48, 30, True, True, False), (78, 48, True, False, False),
            (126, 2, False, False, False)]  # fmt: skip
    kernel = _dequant_kernel(t, 4 * b, plan)
    for _ in range(2):  # two calls, fresh scales and biases
        scale = rng.uniform(-2, 2, size=2).astype(np.float16)
        bias = rng.integers(0, 1 << b, size=2).astype(np.float16)
        out = np.zeros((32, 128), np.float16)
        kernel(np.ascontiguousarray(words), scale, bias, out)
        if t.is_integer:
            u = layout_codes(c, t).astype(np.float64)
            plain = u - ((1 << (b - 1)) if t.kind == "int" else 0)
        else:
            u = codecs.decode(c, t) * 2.0 ** -lowbit.float_shift(t)
            plain = u
        biased = u - bias.astype(np.float64)[row]
        v = np.arange(128)
        value = np.where((v >= 48) & (v < 126), biased, plain)
        ref = np.where(v < 78, value * scale.astype(np.float64)[row], value).astype(np.float16)
        assert np.array_equal(out, ref, equal_nan=True)


def _raw_reference(t, codes, lane_values):
    """The halves of a raw dequant of layout values `lane_values` (lowbit.raw_magic)."""
    v = np.arange(lane_values.shape[-1])
    if t.is_integer:
        magic = np.array([lowbit.raw_magic(t, i // 2) for i in v])
        return (layout_codes(lane_values, t).astype(np.float64) + magic).astype(np.float16)
    return (codecs.decode(lane_values, t) * 2.0 ** -lowbit.raw_shift(t)).astype(np.float16)


@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=IDS)
def test_raw_dequant_is_code_plus_raw_magic(rng, t):
    """raw=True: the bits alone, u + lowbit.raw_magic (the CUDA displacement's magic for the
    integers, value * 2**-raw_shift for the floats) for every code, on the C target."""
    b = t.nbits
    for _ in range(2):
        codes = random_codes(rng, t, (16, 256))
        words = pack_units(codes, t).reshape(b, 32, 4).transpose(1, 0, 2).reshape(32, 4 * b)
        rows = np.array([[lowbit.lane_value_position(lane, v)[0] for v in range(128)] for lane in range(32)])
        ks = np.array([[lowbit.lane_value_position(lane, v)[1] for v in range(128)] for lane in range(32)])
        out = np.zeros((32, 128), np.float16)
        _dequant_kernel(t, 4 * b, [(0, 64, False, False, True), (64, 64, False, False, True)])(
            np.ascontiguousarray(words), np.ones(2, np.float16), np.zeros(2, np.float16), out)
        assert np.array_equal(out.view(np.uint16), _raw_reference(t, codes, codes[rows, ks]).view(np.uint16))
    if t.is_integer:  # every code of the width in every register position
        for reg in range(64):
            for u in range(1 << b):
                assert float(np.float16(lowbit.raw_magic(t, reg) + u)) == lowbit.raw_magic(t, reg) + u


def _prmt(a: int, b: int, selector: int) -> int:
    data = a | (b << 32)
    return sum(((data >> (8 * ((selector >> 4 * i) & 7))) & 0xFF) << (8 * i) for i in range(4))


@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=IDS)
def test_byte_permutations_give_the_register_bits(rng, t):
    """Where the CUDA lowering builds a register with one PRMT (whole bytes: the 8-bit integers
    and e5m2, every register), the PRMT's bits equal the shift-and-mask terms' for any word."""
    from tessera.backend.codegen_lowbit import byte_permutation

    found = 0
    for reg in range(64):
        perm = byte_permutation(t, reg)
        if perm is None:
            continue
        found += 1
        word, selector, constant = perm
        d = lowbit.int_displacement(t, reg) if t.is_integer else 0
        for w in [*rng.integers(0, 2**32, size=200, dtype=np.uint64).tolist(), 0, 2**32 - 1]:
            words = [0] * (4 * t.nbits)
            words[word] = w
            pattern = lowbit.int_magic(d) * 0x10001 if t.is_integer else 0
            for wd, shift, mask in lowbit.register_terms(t, reg, d):
                pattern |= ((words[wd] << shift) if shift >= 0 else (words[wd] >> -shift)) & mask & 0xFFFFFFFF
            assert _prmt(w, constant, selector) == pattern, (reg, hex(w))
    assert found == (64 if t.name in ("int8", "uint8", "e5m2") else 0)


@pytest.mark.parametrize("t", [t for t in WEIGHT_TYPES if t.is_integer], ids=[t.name for t in WEIGHT_TYPES if t.is_integer])
def test_cuda_integer_displacements_rebuild_the_codes(rng, t):
    """The CUDA dequant's register plan (lowbit.int_displacement): each register's terms OR-ed
    into int_magic(d) give two halves equal to 2**(10 - d) + code, exactly."""
    from tessera.quant.layout import lane_unit

    b = t.nbits
    codes = random_codes(rng, t, (16, 256))
    words = pack_units(codes, t)
    shifts = set()  # distinct (word, shift) pairs: one SHF each
    for lane in (0, 13, 31):
        w = lane_unit(words, t, 0, 0, 1, lane).astype(np.uint64)
        c = np.array([layout_codes(codes[lowbit.lane_value_position(lane, v)], t) for v in range(128)])
        for reg in range(64):
            d = lowbit.int_displacement(t, reg)
            assert 0 <= d <= 10 - b
            pattern = lowbit.int_magic(d) * 0x10001
            for word, shift, mask in lowbit.register_terms(t, reg, d):
                moved = (w[word] << np.uint64(shift)) if shift >= 0 else (w[word] >> np.uint64(-shift))
                pattern |= int(moved) & mask & 0xFFFFFFFF
                if shift:
                    shifts.add((word, shift))
            halves = np.array([pattern & 0xFFFF, pattern >> 16], np.uint16).view(np.float16).astype(np.float64)
            assert np.array_equal(halves - 2.0 ** (10 - d), c[2 * reg:2 * reg + 2]), (reg, d)
    if b in (1, 2, 4, 8):  # shifts shared by a word's fields: one per word, three for 1-bit words
        assert len(shifts) <= 4 * b * (3 if b == 1 else 1)
    else:  # leftover bits: no more distinct shifts than with d = 0 everywhere (stage_plan chose the d's)
        at_zero = {(w, sh) for reg in range(64) for w, sh, _ in lowbit.register_terms(t, reg, 0) if sh}
        assert len(shifts) <= len(at_zero)
    # the magics of a register depend only on its place in the A fragment (reg % 4)
    assert all(lowbit.int_displacement(t, reg) == lowbit.int_displacement(t, reg % 4) for reg in range(64))


@pytest.mark.parametrize("bits", range(1, 9))
def test_unit_layout_whole_fields_and_stage_words(bits):
    """lowbit.stage_plan: every bit of a unit's words holds one code bit of one register, each
    stage's registers read only that stage's words (they die with it), the first 16 // bits *
    bits registers of a stage are whole fields (one piece), and the LOP3 + SHF a stage takes to
    build its integer registers stay at what the whole-field layout was chosen for (the
    earlier planes of 8, 4, 2 and 1 bits took 59 for 5 bits and 87 for 7, SASS-counted)."""
    from tessera.templates.lowbit.gemm import word_loads

    owner = {}
    for reg in range(64):
        stage, local = divmod(reg, 16)
        pieces = lowbit.register_pieces(bits, reg)
        assert sum(width for *_, width in pieces) == bits
        if local < (16 // bits) * bits:
            assert len(pieces) == 1
        for word, pos, low, width in pieces:
            assert word in lowbit.stage_words(bits, stage)
            for i in range(width):
                for half in (0, 1):
                    assert owner.setdefault((word, 16 * half + pos + i), (reg, low + i)) == (reg, low + i)
    assert len(owner) == 32 * lowbit.unit_words(bits)
    loaded = [[w + i for w, nbytes in stage for i in range(nbytes // 4)] for stage in word_loads(bits)[1]]
    assert loaded == [list(lowbit.stage_words(bits, b)) for b in range(4)]
    assert all(nbytes in (4, 8, 16) and w % (nbytes // 4) == 0 for stage in word_loads(bits)[1] for w, nbytes in stage)
    plan, ds = lowbit.stage_plan(bits)
    assert lowbit._instructions(plan, ds) <= {3: 25, 5: 29, 6: 33, 7: 37}.get(bits, 24)


@needs_nvcc
@pytest.mark.slow
def test_cuda_dequant_helpers_match_reference_on_the_host(rng, tmp_path):
    """The generated CUDA dequant helpers (tessera.backend.codegen_lowbit.cuda_helper), built
    for the host by nvcc (cuda_fp16's half2 arithmetic runs there too): every type, every step,
    biased or not, scaled or not, equal to (code - bias) rounded to fp16, times the scale
    rounded again (HSUB2 then HMUL2)."""
    import subprocess

    from tessera.backend.codegen_lowbit import cuda_helper, helper_name

    lanes, src, expect = (0, 5, 18, 31), [], []
    src.append("#include <cuda_fp16.h>\n#include <cstdio>\n#include <cstdint>")
    src.append("inline uint32_t ts_lop3_and_or(uint32_t a, uint32_t b, uint32_t c) { return (a & b) | c; }")
    src.append("inline uint32_t ts_prmt(uint32_t a, uint32_t b, uint32_t s) { uint64_t x = a | ((uint64_t)b << 32); "
               "uint32_t r = 0; for (int i = 0; i < 4; ++i) r |= (uint32_t)((x >> (8 * ((s >> 4 * i) & 7))) & 0xFF) << (8 * i); "
               "return r; }")  # fmt: skip
    main = ["int main() {", "  half out[8];"]
    for ti, t in enumerate(WEIGHT_TYPES):
        b = t.nbits
        codes = random_codes(rng, t, (16, 256))
        words = pack_units(codes, t).reshape(b, 32, 4).transpose(1, 0, 2).reshape(32, 4 * b)
        scale = rng.uniform(-2, 2, size=2).astype(np.float16)
        bias = rng.integers(0, 1 << b, size=2).astype(np.float16)
        src.append(f"static const uint32_t W{ti}[32][{4 * b}] = {{"
                   + ",".join("{" + ",".join(f"{int(x)}u" for x in row) + "}" for row in words) + "};")
        src.append(f"static const half S{ti}[2] = {{__ushort_as_half({scale.view(np.uint16)[0]}), "
                   f"__ushort_as_half({scale.view(np.uint16)[1]})}};")
        src.append(f"static const half B{ti}[2] = {{__ushort_as_half({bias.view(np.uint16)[0]}), "
                   f"__ushort_as_half({bias.view(np.uint16)[1]})}};")
        for biased, scaled, raw in ((False, True, False), (False, False, False), (True, True, False),
                                    (True, False, False), (False, False, True)):  # fmt: skip
                for step in range(16):
                    attrs = {"wtype": t, "start": 8 * step, "count": 8, "has_bias": biased, "has_scale": scaled, "raw": raw}
                    src.append(cuda_helper(attrs).replace("__device__ __forceinline__", "inline"))
                    for lane in lanes:
                        main.append(f"  {helper_name(attrs)}(out, W{ti}[{lane}], S{ti}, B{ti}); "
                                    'for (int i = 0; i < 8; ++i) printf("%04x\\n", __half_as_ushort(out[i]));')
                        c = np.array([codes[lowbit.lane_value_position(lane, v)] for v in range(8 * step, 8 * step + 8)])
                        row = (np.arange(8 * step, 8 * step + 8) // 2) % 2
                        if raw:
                            expect.append(_raw_reference(t, codes, np.concatenate([np.zeros(8 * step, np.uint8), c]))[8 * step:])
                            continue
                        if t.is_integer:
                            u = layout_codes(c, t).astype(np.float64)
                            off = bias.astype(np.float64)[row] if biased else (1 << (b - 1)) * (t.kind == "int")
                        else:
                            u = codecs.decode(c, t) * 2.0 ** -lowbit.float_shift(t)
                            off = bias.astype(np.float64)[row] if biased else 0.0
                        v = (u - off).astype(np.float16)
                        if scaled:
                            with np.errstate(over="ignore"):  # e5m2's largest values overflow fp16, in CUDA too
                                v = (v.astype(np.float64) * scale.astype(np.float64)[row]).astype(np.float16)
                        expect.append(v)
    (tmp_path / "d.cu").write_text("\n".join(src + main + ["}"]) + "\n")
    subprocess.run(["nvcc", "-o", str(tmp_path / "d"), str(tmp_path / "d.cu")], check=True, capture_output=True)
    out = subprocess.run([str(tmp_path / "d")], check=True, capture_output=True, text=True).stdout.split()
    got = np.array([int(x, 16) for x in out], np.uint16).view(np.float16)
    assert np.array_equal(got, np.concatenate(expect), equal_nan=True)


def test_bad_low_bit_uses_are_refused():
    with pytest.raises(KernelSyntaxError, match="packed int4 values, which kernels only read"):
        @ts.kernel(target="cpu")
        def store(W: ts.int4["N"]):
            W[0] = 1

        store.source  # noqa: B018
    with pytest.raises(KernelSyntaxError, match="storage type"):
        @ts.kernel(target="cpu")
        def to_int4(x: ts.f32["N"], y: ts.f32["N"]):
            y[0] = ts.cast(ts.cast(x[0], ts.int4), ts.f32)

        to_int4.source  # noqa: B018
    with pytest.raises(KernelSyntaxError, match="storage type"):
        @ts.kernel(target="cpu")
        def regs(y: ts.f32["N"]):
            r = ts.register_tensor(ts.e2m1, [4])
            y[0] = r[0]

        regs.source  # noqa: B018
    with pytest.raises(KernelSyntaxError, match="wtype"):
        @ts.kernel(target="cpu")
        def wrong(y: ts.f16["N"]):
            w = ts.register_tensor(ts.u32, [4])
            d = ts.register_tensor(ts.f16, [8])
            ts.dequant(d[0], w[0], d[0], wtype=ts.f16)
            y[0] = d[0]

        wrong.source  # noqa: B018

    @ts.kernel(target="cpu")
    def read(W: ts.int4["N"], y: ts.f32["N"]):
        for i in range(N):
            y[i] = ts.cast(W[i], ts.f32)

    y = np.zeros(6, np.float32)
    with pytest.raises(ArgumentError, match="dtype uint8, expected int4"):
        read(np.zeros(3, np.uint8), y)
    with pytest.raises(ArgumentError, match="dtype int3, expected int4"):
        read(PackedTensor.from_values(np.zeros(6), "int3"), y)
    with pytest.raises(ArgumentError, match="take 3 packed bytes, got 4"):
        PackedTensor(np.zeros(4, np.uint8), "int4", (6,))
    with pytest.raises(ArgumentError, match="not a low-bit weight type"):
        PackedTensor.from_values(np.zeros(6), "float16")
    with pytest.raises(ArgumentError, match="do not fit int4"):
        PackedTensor.from_values(np.array([8]), "int4")


@needs_nvcc
@pytest.mark.slow
def test_low_bit_cuda_kernels_build_with_nvcc():
    @ts.kernel(target="cuda")
    def widen(W: ts.e3m2["N"], U: ts.int5["N"], out: ts.f32["N"]):
        ts.attrs.grid = ts.ceil_div(N, 128)
        ts.attrs.block = 128
        i = ts.block_idx.x * 128 + ts.thread_idx.x
        if i < N:
            out[i] = W[i] + ts.cast(U[i], ts.f32)

    widen.build()
    for t in (ts.int3, ts.uint4, ts.e2m1, ts.e4m3, ts.int8):
        _unpack_cuda(t).build()


def _unpack_cuda(t):
    @ts.kernel(target="cuda")
    def unpack(Wd: ts.u32["WW"], out: ts.f16["X"]):
        ts.attrs.grid = 1
        ts.attrs.block = 32
        w = ts.register_tensor(ts.u32, [4 * t.nbits])
        for i in ts.unroll(4 * t.nbits):
            w[i] = Wd[ts.thread_idx.x * 4 * t.nbits + i]
        s = ts.register_tensor(ts.f16, [2])
        s[0] = 1.0
        s[1] = 2.0
        d = ts.register_tensor(ts.f16, [8])
        ts.dequant(d[0], w[0], s[0], s[0], wtype=t, start=8, count=8)
        for i in ts.unroll(8):
            out[ts.thread_idx.x * 8 + i] = d[i]

    return unpack


@pytest.mark.cuda
@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=IDS)
def test_cuda_raw_dequant_on_the_gpu(rng, t):
    """The raw dequant as the GPU runs it (e4m3 through cvt.rn.f16x2.e4m3x2 on sm_89+, the
    others through PRMT/LOP3): every lane's 128 values bit-identical to the reference."""
    torch = pytest.importorskip("torch")
    b = t.nbits

    @ts.kernel(target="cuda")
    def raw(Wd: ts.u32["L", "WW"], out: ts.f16["L", 128]):
        ts.attrs.grid = 1
        ts.attrs.block = 32
        lane = ts.thread_idx.x
        w = ts.register_tensor(ts.u32, [4 * b])
        for i in ts.unroll(4 * b):
            w[i] = Wd[lane, i]
        d = ts.register_tensor(ts.f16, [128])
        for s in STEPS16:
            ts.dequant(d[8 * s], w[0], wtype=t, start=8 * s, count=8, raw=True)
        for i in ts.unroll(128):
            out[lane, i] = d[i]

    for _ in range(2):
        codes = random_codes(rng, t, (16, 256))
        words = pack_units(codes, t).reshape(b, 32, 4).transpose(1, 0, 2).reshape(32, 4 * b)
        rows = np.array([[lowbit.lane_value_position(lane, v)[0] for v in range(128)] for lane in range(32)])
        ks = np.array([[lowbit.lane_value_position(lane, v)[1] for v in range(128)] for lane in range(32)])
        out = torch.zeros((32, 128), dtype=torch.float16, device="cuda")
        raw(torch.from_numpy(np.ascontiguousarray(words)).cuda(), out)
        got = out.cpu().numpy().view(np.uint16)
        assert np.array_equal(got, _raw_reference(t, codes, codes[rows, ks]).view(np.uint16))


STEPS16 = tuple(range(16))
