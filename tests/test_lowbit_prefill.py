"""The prefill path of low-bit weights on CUDA: the dequantiser of the tensor-core words
(tessera.templates.lowbit.dequant) against the graph operator's reference bit for bit, and
`cuda_matmul` past DECODE_MAX_M (dequantise, then torch.matmul) against float64.

CPU tier: the layout facts the kernel relies on, the generated kernel run on the host
(tests/cuda_on_host.py: every weight type once, nvcc needed) and built for sm_90a.  GPU tier
(`cuda`): every type x group sizes x zero points x both k orders at odd sizes, exactly, and the
prefill matmul; its ~140 kernels are built in parallel before anything runs.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import tessera as ts
from tessera.errors import UnsupportedError
from tessera.graph.opdefs.lowbit import dequantized_weight
from tessera.ir import lowbit
from tessera.quant import WEIGHT_TYPES, codecs
from tessera.quant.layout import pack_units, padded_shape, unpack_units
from tessera.quant.quantize import quantize_weight
from tessera.templates.lowbit.dequant import CHUNK_HALVES, lane_chunk, make_dequant_units, swizzle

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
SIZES = ((40, 520), (100, 1000), (33, 776), (16, 256), (50, 8))  # (N, K): N % 16 and K % 256 mostly not 0


def kernel_group(group: int | None, k: int) -> int:
    """The group the kernel takes: per channel (None) is the padded K."""
    return padded_shape(1, k)[1] if group is None else group


def random_case(rng, t, n: int, k: int, group: int | None, bias: bool, span: int) -> dict:
    """Random codes (finite floats), scales in [-2, 2] and integer biases in code range, as the
    words, scales and biases the kernel reads; 'ref' the float16 weights they stand for."""
    gs = kernel_group(group, k)
    g_count = -(-k // gs)
    codes = rng.integers(0, 1 << t.nbits, size=(n, k)).astype(np.uint8)
    if t.is_float:
        codes = np.where(np.isfinite(codecs.decode(codes, t)), codes, 0).astype(np.uint8)
    words = pack_units(codes, t, span)
    scales = rng.uniform(-2, 2, size=(n, g_count)).astype(np.float16)
    biases = (rng.integers(0, 1 << t.nbits, size=(n, g_count)) if bias else np.zeros((1, 1))).astype(np.float16)
    return {"words": words, "scales": scales, "biases": biases, "key": (t, gs, bias, span), "shape": (n, k),
            "ref": reference(words, scales, biases, t, n, k, gs, bias, span)}  # fmt: skip


def reference(words, scales, biases, t, n: int, k: int, gs: int, bias: bool, span: int) -> np.ndarray:
    """float16 weights: the graph operator's (dequantized_weight) rounded once; for a small float
    with zero points (which dequantized_weight ignores) the dequant instruction's own terms,
    fp16(fp16(value - bias) * scale), as the decode kernel computes them too."""
    attrs = {"wtype": t.name, "n": n, "k": k, "group_size": gs, "has_bias": bias, "span": span}
    with np.errstate(over="ignore"):  # e5m2's largest values times 2 overflow fp16, in CUDA too
        if not (t.is_float and bias):
            return dequantized_weight(words, scales, biases, attrs).astype(np.float16)
        cols = np.arange(k) // gs
        v = codecs.decode(unpack_units(words, t, n, k, span), t) * 2.0 ** -lowbit.float_shift(t)
        v = (v - biases.astype(np.float64)[:, cols]).astype(np.float16)
        return (v.astype(np.float64) * scales.astype(np.float64)[:, cols]).astype(np.float16)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint16), b.view(np.uint16))


# ---- CPU tier ----------------------------------------------------------------------------
@pytest.mark.parametrize("span", lowbit.SPANS)
def test_a_lanes_pair_of_steps_is_one_chunk_of_two_rows(span):
    """After steps 2j and 2j + 1, halves CHUNK_HALVES[h] of lane l are k 8c .. 8c + 7 (in order)
    of row g + 8h, c = lane_chunk(span, l, j): 16 bytes the kernel stores at once."""
    for lane in range(32):
        for j in range(8):
            for h in (0, 1):
                pos = [lowbit.lane_value_position(lane, 16 * j + i, span) for i in CHUNK_HALVES[h]]
                c = lane_chunk(span, lane, j)
                assert pos == [(lane // 4 + 8 * h, 8 * c + e) for e in range(8)], (span, lane, j, h)


def test_the_tile_swizzle_avoids_bank_conflicts():
    """swizzle permutes each row's 32 chunks within 128-byte groups; the 8 lanes of a quarter
    warp (one 16-byte access wavefront) meet 8 different bank groups, writing (either span)
    and reading (chunk `lane` of one row)."""
    for row in range(16):
        assert sorted(swizzle(c, row) for c in range(32)) == list(range(32))
        assert all(swizzle(c, row) // 8 == c // 8 for c in range(32))
    for quarter in range(4):
        lanes = range(8 * quarter, 8 * quarter + 8)
        for row in range(16):
            assert len({swizzle(lane, row) % 8 for lane in lanes}) == 8
        for span in lowbit.SPANS:
            for j in range(8):
                for h in (0, 1):
                    banks = {swizzle(lane_chunk(span, lane, j), lane // 4 + 8 * h) % 8 for lane in lanes}
                    assert len(banks) == 8, (span, j, h, quarter)


@needs_nvcc
@pytest.mark.slow
def test_dequantiser_run_on_the_host_matches_the_reference(rng, tmp_path):
    """The generated CUDA run on the host (tests/cuda_on_host.py): every weight type once, the
    group size, zero points, k order, block size and shape rotated over the types, bit for bit."""
    from cuda_on_host import run_on_host

    groups = (128, 32, None, 8, 64, 4, 16, 1024, 192)
    cases, host = [], []
    for i, t in enumerate(WEIGHT_TYPES):
        n, k = SIZES[i % len(SIZES)]
        c = random_case(rng, t, n, k, groups[i % len(groups)], bool(i % 2), lowbit.SPANS[(i // 2) % 2])
        warps = (4, 1, 8, 2)[i % 4]
        kernel = make_dequant_units(*c["key"], warps)
        units = -(-n // 16) * -(-k // 256)
        out = np.full((n, k), np.nan, np.float16)
        values = {"Wq": c["words"], "S": c["scales"], "B": c["biases"], "Out": out, "W": c["words"].size,
                  "NS": n, "G": c["scales"].shape[1], "NB": c["biases"].shape[0], "GB": c["biases"].shape[1],
                  "N": n, "K": k}  # fmt: skip
        cases.append(c)
        host.append((kernel, values, "Out", -(-units // warps), 32 * warps))
    for c, got in zip(cases, run_on_host(tmp_path, host)):
        assert same_bits(got, c["ref"]), (c["key"], c["shape"])


@needs_nvcc
@pytest.mark.parametrize("t, group, bias, span", [("int4", 128, False, 16), ("int3", 32, True, 2),
                                                  ("e4m3", 1024, False, 16), ("uint8", 4, True, 16)])  # fmt: skip
def test_dequantiser_builds_with_nvcc(t, group, bias, span):
    kernel = make_dequant_units(ts.dtype(t), group, bias, span)
    src = kernel.source_full
    assert src.count(f"ts_dequant_{t}_s") >= 16 and "__syncwarp()" in src and kernel.build()


def test_bad_dequantiser_arguments_are_refused():
    from tessera.templates.lowbit.dequant import dequantize_words

    with pytest.raises(UnsupportedError, match="takes int1"):
        make_dequant_units(ts.float16, 128, False)
    with pytest.raises(UnsupportedError, match="group size 96"):
        make_dequant_units(ts.int4, 96, False)
    with pytest.raises(UnsupportedError, match="span 4"):
        make_dequant_units(ts.int4, 128, False, 4)
    with pytest.raises(UnsupportedError, match="K % 8"):
        dequantize_words(None, None, None, np.zeros((4, 12), np.float16), ts.int4, 128, False)


# ---- GPU tier ----------------------------------------------------------------------------
def _build_all(keys) -> None:
    """Build every kernel first, in parallel (nvcc processes): ~140 kernels take ~10 s on 16 cores."""
    with ThreadPoolExecutor(min(32, os.cpu_count() or 4)) as ex:
        list(ex.map(lambda key: make_dequant_units(*key).build(), sorted(set(keys), key=str)))


@pytest.mark.cuda
def test_cuda_dequantiser_every_type_group_and_zero_point(rng):
    """Every type x groups 128, 32 and per channel x with and without zero points (small floats
    too: the instruction subtracts them) in span 16, plus one span-2 case per type (groups 8,
    64, 1024, 4 rotated), odd N and K: the fp16 matrix equals the reference bit for bit."""
    torch = pytest.importorskip("torch")
    from tessera.templates.lowbit.dequant import dequantize_words

    cases = []
    for i, t in enumerate(WEIGHT_TYPES):
        for j, group in enumerate((128, 32, None)):
            for bias in (False, True):
                n, k = SIZES[(i + j) % 2]
                cases.append(random_case(rng, t, n, k, group, bias, 16))
        cases.append(random_case(rng, t, 33, 776, (8, 64, 1024, 4)[i % 4], bool(i % 2), 2))
    _build_all(c["key"] for c in cases)
    bad = []
    for c in cases:
        out = torch.full(c["shape"], float("nan"), dtype=torch.float16, device="cuda")
        dev = [torch.from_numpy(c[name]).cuda() for name in ("words", "scales", "biases")]
        dequantize_words(*dev, out, *c["key"])
        got = out.cpu().numpy()
        if not same_bits(got, c["ref"]):
            differ = got.view(np.uint16) != c["ref"].view(np.uint16)
            bad.append((c["key"], c["shape"], int(differ.sum()), np.argwhere(differ)[:3].tolist()))
    assert not bad, bad


@pytest.mark.cuda
def test_cuda_prefill_matmul_every_type(rng):
    """cuda_matmul at M = 65 and 130 (past DECODE_MAX_M: dequantise + torch.matmul) on quantised
    weights (group 128 or per channel, zero points on every other integer type), two calls with
    fresh activations each, against float64; the prepared weight's fp16 matrix is the
    QuantizedWeight's dequantisation rounded once, and no codes are copied to the device."""
    torch = pytest.importorskip("torch")
    from tessera.eager.lowbit import DECODE_MAX_M, PREPARED_SPAN, cuda_matmul, prepare
    from tessera.templates.lowbit.dequant import dequantize_words

    assert 65 > DECODE_MAX_M
    weights = []
    for i, t in enumerate(WEIGHT_TYPES):
        n, k = SIZES[i % 2]
        q = quantize_weight(rng.normal(size=(n, k)) * 0.05, t, 128 if i % 3 else None, bool(i % 2) and t.is_integer)
        weights.append((q, prepare(q)))
    _build_all((p.weight.dtype, p.kernel_group, p.weight.zeros is not None, PREPARED_SPAN) for _, p in weights)
    for q, p in weights:
        w = torch.from_numpy(q.dequantize()).cuda()
        w16 = torch.empty(q.shape, dtype=torch.float16, device="cuda")
        dequantize_words(p.words, p.scales, p.biases, w16, q.dtype, p.kernel_group, q.zeros is not None, PREPARED_SPAN)
        assert torch.equal(w16, w.half()), q.dtype
        for m in (65, 130):
            for _ in range(2):
                x = torch.randn(m, q.shape[1], dtype=torch.float16, device="cuda")
                ref = x.double() @ w.double().T
                err = float((cuda_matmul(x, p).double() - ref).norm() / ref.norm())
                assert err < 2e-3, (q.dtype, q.group_size, q.zeros is not None, m, err)
        assert not any(key == "codes" or key == "zeros" for key in p.cache), list(p.cache)
