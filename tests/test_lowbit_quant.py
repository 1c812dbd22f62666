"""Low-bit weights above the language: round-to-nearest quantisation of every type, the CPU
linear kernel, `tessera.quantize` on torch modules (eager and torch.compile), GPTQ and AWQ
checkpoints the tests write; the CUDA kernels against the same references (GPU tier)."""

from __future__ import annotations

import importlib
import shutil

import numpy as np
import pytest
from lowbit_cases import rotated

import tessera as ts
from tessera.eager.checkpoints import load_quantized_linears
from tessera.eager.lowbit import cpu_matmul
from tessera.errors import ArgumentError, UnsupportedError
from tessera.ir import lowbit
from tessera.quant import WEIGHT_TYPES
from tessera.quant.checkpoints import AWQ_ORDER, from_awq, from_gptq
from tessera.quant.quantize import quantize_weight
from tessera.templates.lowbit.decode import DecodeConfig

IDS = [t.name for t in WEIGHT_TYPES]
# relative error of RTN at group 16 on normal weights: loose bounds that still catch a broken codec
BOUND = {1: 1.0, 2: 0.8, 3: 0.3, 4: 0.15, 5: 0.07, 6: 0.04, 7: 0.02, 8: 0.01}
FLOAT_BOUND = {"e2m1": 0.15, "e2m3": 0.05, "e3m2": 0.08, "e4m3": 0.05, "e5m2": 0.08}


@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=IDS)
def test_quantize_weight_semantics(rng, t):
    w = rng.normal(size=(7, 45)) * 0.1
    for group, zp in ((16, None), (None, None), (45, False), (7, True)):
        if zp and t.is_float:
            with pytest.raises(ArgumentError, match="take no zero points"):
                quantize_weight(w, t, group, zp)
            continue
        q = quantize_weight(w, t, group, zp)
        gs = 45 if group is None else group
        assert q.group_size == gs and q.scales.shape == (7, -(-45 // gs)) and q.scales.dtype == np.float16
        d = q.dequantize()
        codes = q.codes.numpy()
        assert codes.min() >= t.min_value and codes.max() <= t.max_value
        if t.is_integer and t.nbits > 1:  # RTN: within a step of the grid (1 bit is degenerate)
            step = q.scales.astype(np.float64)[:, np.arange(45) // gs]
            assert np.all(np.abs(d - w) <= step * 1.0 + 1e-6)
        bound = BOUND[t.nbits] if t.is_integer else FLOAT_BOUND[t.name]
        assert np.linalg.norm(d - w) / np.linalg.norm(w) < bound * (2 if group is None else 1.3)


def _same_quantized(a, b):
    assert a.dtype == b.dtype and a.group_size == b.group_size and a.shape == b.shape
    assert np.array_equal(a.codes.data, b.codes.data)
    assert np.array_equal(a.scales.view(np.uint16), b.scales.view(np.uint16))  # the same float16 bits
    assert (a.zeros is None) == (b.zeros is None)
    if a.zeros is not None:
        assert np.array_equal(a.zeros, b.zeros)


def _torch_rtn_matches_numpy(rng, device):
    torch = pytest.importorskip("torch")
    from tessera.quant.quantize_torch import quantize_weight_torch

    for t in [t for t in WEIGHT_TYPES if t.is_integer] + [WEIGHT_TYPES[-1]]:  # every integer type, a float one
        for n, k in ((7, 45), (1, 1), (3, 130)):
            # float16 weights (what a model holds), two draws: odd sizes, size-1 dims, short last groups
            for scale in (0.1, 3.0):
                w = torch.from_numpy(rng.normal(size=(n, k)) * scale).half()
                for group, zp in ((16, None), (None, None), (45, False), (7, True), (1, None)):
                    if zp and t.is_float:
                        continue
                    ref = quantize_weight(w.float().numpy(), t, group, zp)
                    _same_quantized(quantize_weight_torch(w.to(device), t, group, zp), ref)


def test_torch_rtn_matches_the_numpy_reference(rng):
    _torch_rtn_matches_numpy(rng, "cpu")


@pytest.mark.cuda
def test_torch_rtn_on_the_gpu_matches_the_numpy_reference(rng):
    import torch

    _torch_rtn_matches_numpy(rng, "cuda")
    model = _mlp(torch).half()  # tessera.quantize of a model on the GPU takes that path: the same layers
    for a, b in zip(ts.quantize(model.cuda(), "int3", 16), ts.quantize(model.cpu(), "int3", 16)):
        if hasattr(a, "weight_q"):
            _same_quantized(a.weight_q, b.weight_q)


def test_torch_rtn_refuses_bad_inputs():
    torch = pytest.importorskip("torch")
    from tessera.quant.quantize_torch import quantize_weight_torch

    with pytest.raises(ArgumentError, match="inf or NaN"):
        quantize_weight_torch(torch.tensor([[1.0, float("nan")]]), "int4")
    with pytest.raises(ArgumentError, match="not a low-bit weight type"):
        quantize_weight_torch(torch.ones(2, 2), "int9")
    with pytest.raises(ArgumentError, match=r"\[N, K\] matrix"):
        quantize_weight_torch(torch.ones(4), "int4")
    with pytest.raises(ArgumentError, match="group_size must be positive"):
        quantize_weight_torch(torch.ones(2, 4), "int4", 0)
    with pytest.raises(ArgumentError, match="overflows float16"):
        quantize_weight_torch(torch.full((2, 4), 1e300, dtype=torch.float64), "int2")


def test_quantize_weight_refuses_bad_inputs():
    with pytest.raises(ArgumentError, match="inf or NaN"):
        quantize_weight(np.array([[1.0, np.nan]]), "int4")
    with pytest.raises(ArgumentError, match="not a low-bit weight type"):
        quantize_weight(np.ones((2, 2)), "int9")
    with pytest.raises(ArgumentError, match=r"\[N, K\] matrix"):
        quantize_weight(np.ones(4), "int4")
    with pytest.raises(ArgumentError, match="group_size must be positive"):
        quantize_weight(np.ones((2, 4)), "int4", 0)


@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=IDS)
def test_cpu_linear_kernel_matches_reference(rng, t):
    for m, n, k, group in ((1, 5, 37, 16), (3, 1, 64, None), (2, 9, 1, 1)):
        q = quantize_weight(rng.normal(size=(n, k)), t, group)
        for _ in range(2):
            x = rng.normal(size=(m, k)).astype(np.float32)
            y = cpu_matmul(x, q)
            ref = x.astype(np.float64) @ q.dequantize().astype(np.float64).T
            assert np.allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def _mlp(torch):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(37, 29), torch.nn.GELU(), torch.nn.Linear(29, 11, bias=False))


def _reference(torch, q, x):
    w0 = torch.from_numpy(q[0].weight_q.dequantize())
    w2 = torch.from_numpy(q[2].weight_q.dequantize())
    return torch.nn.functional.gelu(x @ w0.T + q[0].bias) @ w2.T


@pytest.mark.parametrize("weight", ["int4", "uint3", "e2m1", "int8"])
@pytest.mark.slow
def test_quantize_torch_module_eager_and_compiled(weight):
    torch = pytest.importorskip("torch")
    model = _mlp(torch)
    q = ts.quantize(model, weight=weight, group_size=16)
    torch._dynamo.reset()
    assert isinstance(model[0], torch.nn.Linear)  # not in place
    assert type(q[0]).__name__ == "QuantizedLinear" and q[0].weight_q.dtype.name == weight
    compiled = torch.compile(q, backend="tessera")
    for shape in ((5, 37), (1, 37), (2, 3, 37)):
        x = torch.randn(*shape)
        ref = _reference(torch, q, x)
        assert torch.allclose(q(x), ref, rtol=1e-4, atol=1e-5)
        assert torch.allclose(compiled(x), ref, rtol=1e-4, atol=1e-5)


def test_quantize_refuses_bad_arguments():
    torch = pytest.importorskip("torch")
    with pytest.raises(ArgumentError, match="not a low-bit weight type"):
        ts.quantize(_mlp(torch), weight="int12")
    with pytest.raises(ArgumentError, match="no nn.Linear"):
        ts.quantize(torch.nn.ReLU())
    q = ts.quantize(_mlp(torch), skip=["2"])
    assert isinstance(q[2], torch.nn.Linear) and type(q[0]).__name__ == "QuantizedLinear"
    with pytest.raises(ArgumentError, match=r"takes \[M, 37\] inputs"):
        q[0].matmul(torch.randn(2, 36))


def _pack_gptq(codes, zeros, zero_offset):
    """codes [N, K], zeros [N, G] (0..15) -> GPTQ qweight [K/8, N], qzeros [G, N/8] (independent packer)."""
    n, k = codes.shape
    qweight = np.zeros((k // 8, n), np.uint32)
    for j in range(8):
        qweight |= codes.T[j::8].astype(np.uint32) << (4 * j)
    z = (zeros.T - zero_offset).astype(np.uint32)  # [G, N]
    qzeros = np.zeros((z.shape[0], n // 8), np.uint32)
    for j in range(8):
        qzeros |= z[:, j::8] << (4 * j)
    return qweight.view(np.int32), qzeros.view(np.int32)


def _pack_awq(codes_kn):
    """[R, N] 4-bit values -> AWQ words [R, N/8]: nibble i holds column 8c + AWQ_ORDER[i]."""
    r, n = codes_kn.shape
    out = np.zeros((r, n // 8), np.uint32)
    for i, col in enumerate(AWQ_ORDER):
        out |= codes_kn[:, col::8].astype(np.uint32) << (4 * i)
    return out.view(np.int32)


@pytest.mark.parametrize("fmt", ["gptq", "gptq-v2", "awq"])
@pytest.mark.slow
def test_int4_checkpoints_load(rng, fmt):
    torch = pytest.importorskip("torch")
    n, k, group = 24, 64, 16
    codes = rng.integers(0, 16, size=(n, k)).astype(np.uint8)
    zeros = rng.integers(1, 16, size=(n, k // group))
    scales = rng.uniform(0.01, 0.1, size=(k // group, n)).astype(np.float16)
    if fmt == "awq":
        qweight, qzeros = _pack_awq(codes.T), _pack_awq(zeros.T)
        w = from_awq(qweight, qzeros, scales)
        options = {}
    else:
        offset = 1 if fmt == "gptq" else 0
        qweight, qzeros = _pack_gptq(codes, zeros, offset)
        w = from_gptq(qweight, qzeros, scales, np.arange(k) // group, zero_offset=offset)
        options = {"zero_offset": offset}
    assert np.array_equal(w.codes.codes(), codes) and np.array_equal(w.zeros, zeros)
    ref = (codes.astype(np.float64) - np.repeat(zeros, group, axis=1)) * np.repeat(scales.T.astype(np.float64), group, axis=1)
    assert np.allclose(w.dequantize(), ref, rtol=1e-6)
    # a tiny model written as a checkpoint, loaded into a fresh one
    model = torch.nn.Sequential(torch.nn.Linear(k, n))
    state = {"0.qweight": torch.from_numpy(qweight), "0.qzeros": torch.from_numpy(qzeros),
             "0.scales": torch.from_numpy(scales), "0.bias": torch.randn(n)}  # fmt: skip
    if fmt != "awq":
        state["0.g_idx"] = torch.arange(k, dtype=torch.int32) // group
    load_quantized_linears(model, state, "awq" if fmt == "awq" else "gptq", **options)
    x = torch.randn(3, k)
    expect = x.double() @ torch.from_numpy(ref).T + state["0.bias"].double()
    assert torch.allclose(model(x).double(), expect, rtol=1e-4, atol=1e-4)


def test_checkpoint_errors():
    q = np.zeros((8, 16), np.int32)
    with pytest.raises(UnsupportedError, match="act-order"):
        from_gptq(q, np.zeros((2, 2), np.int32), np.ones((2, 16), np.float16), np.arange(64) % 2)
    with pytest.raises(ArgumentError, match="qzeros must be"):
        from_gptq(q, np.zeros((2, 3), np.int32), np.ones((2, 16), np.float16))
    with pytest.raises(ArgumentError, match="do not split"):
        from_awq(np.zeros((10, 2), np.int32), np.zeros((3, 2), np.int32), np.ones((3, 16), np.float16))
    with pytest.raises(UnsupportedError, match="only 4-bit"):
        from_gptq(q, np.zeros((2, 2), np.int32), np.ones((2, 16), np.float16), bits=3)


# ---- GPU ---------------------------------------------------------------------------------
GROUPS = (128, 32, 64, None, 8)


def _odd_size_weights(torch, rng, t):
    """(group, zero points, K, prepared weight, dequantised float64 weight on the GPU) for every
    group size, with and without zero points, at odd sizes (N % 16, K % 256 != 0)."""
    from tessera.eager.lowbit import prepare

    for i, group in enumerate(GROUPS):
        for zp in ((None, True) if t.is_integer else (None,)):
            n, k = (40, 520) if i % 2 else (100, 1000)
            q = quantize_weight(rng.normal(size=(n, k)) * 0.05, t, group, zp)
            yield group, zp, k, prepare(q), torch.from_numpy(q.dequantize()).cuda().double()


@pytest.mark.cuda
@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=IDS)
def test_cuda_decode_kernel_every_type_group_and_layout(rng, t):
    """Odd sizes (N not a multiple of 16, K not of 256), M from 1 to 16 and past it (grid.y),
    every group size, with and without zero points, several configs (split-K in clusters)."""
    torch = pytest.importorskip("torch")
    from tessera.eager.lowbit import cuda_matmul

    configs = (None, DecodeConfig(4, 1, 1, 1, 1, 4), DecodeConfig(2, 8, 2, 2, 2), DecodeConfig(8, 2, 4, 1, 4, 2),
               DecodeConfig(4, 2, 1, 2, 1))
    for group, zp, k, p, w in _odd_size_weights(torch, rng, t):
        for m, config in zip((1, 3, 13, 40, 9), configs):
            x = torch.randn(m, k, dtype=torch.float16, device="cuda")
            y = cuda_matmul(x, p, config)
            ref = x.double() @ w.T
            assert float((y.double() - ref).norm() / ref.norm()) < 2e-3, (t, group, zp, m, config)


# cp.async weight-ring configs (stages > 0): deep and shallow rings, x from global memory or
# staged (x_units >= the units of a block at K = 1000 or 520), several splits, rows and tiles,
# both k orders (span 2: scales applied after the mma from groups of 32 on)
PIPELINED = (DecodeConfig(4, 2, 1, 1, 1, 0, 2), DecodeConfig(2, 8, 1, 2, 2, 0, 4, 2),
             DecodeConfig(8, 1, 1, 1, 2, 4, 3, 2), DecodeConfig(4, 4, 1, 2, 1, 1, 8),
             DecodeConfig(4, 1, 1, 2, 2, 0, 6, 2))  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=IDS)
def test_cuda_decode_pipelined_variants(rng, t):
    """The weight-ring variants at odd sizes (N % 16, K % 256 != 0), every group size, with
    and without zero points, M from 1 past 16 (grid.y), two calls with fresh activations; each
    config meets two of the (group, zero point) weights, rotated over the types."""
    torch = pytest.importorskip("torch")
    from tessera.eager.lowbit import cuda_matmul

    for j, config, (group, zp, k, p, w) in rotated(list(_odd_size_weights(torch, rng, t)), PIPELINED, t):
        m = (1, 16, 5, 40, 9)[j]
        for _ in range(2):
            x = torch.randn(m, k, dtype=torch.float16, device="cuda")
            ref = x.double() @ w.T
            err = float((cuda_matmul(x, p, config).double() - ref).norm() / ref.norm())
            assert err < 2e-3, (t, group, zp, m, config)


# span 2 on the register path (scales after the mma) and fold (raw dequant, the offsets
# subtracted by a second mma) on both paths; group 8 and 16 fall back to scaling in the dequant
# (and prefetch: the register path's next units loaded before this one's math, activations too
# unless staged in shared memory)
FOLDED = (DecodeConfig(4, 2, 2, 1, 1, 0, 0, 2), DecodeConfig(4, 4, 1, 1, 1, 0, 0, 2, True),
          DecodeConfig(2, 8, 2, 2, 2, 0, 0, 2, True), DecodeConfig(4, 2, 1, 2, 2, 0, 2, 2, True),
          DecodeConfig(8, 1, 1, 1, 1, 4, 0, 2, True), DecodeConfig(4, 4, 1, 1, 1, 0, 0, 2, True, True),
          DecodeConfig(4, 2, 2, 1, 2, 0, 0, 2, True, True), DecodeConfig(4, 1, 1, 2, 1, 4, 0, 2, True, True))  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("t", WEIGHT_TYPES, ids=IDS)
def test_cuda_decode_folded_variants(rng, t):
    """The span-2 register path and the folded offsets at odd sizes, every group size, with and
    without zero points, M from 1 past 16 (grid.y), two calls with fresh activations (each config
    meets two of the weights, rotated over the types); and K a multiple of 256 (k_whole) with the
    default config too."""
    torch = pytest.importorskip("torch")
    from tessera.eager.lowbit import cuda_matmul, prepare

    whole = []  # K a multiple of 256: the activation loads without bound checks (k_whole)
    for group, zp in ((128, None), (64, True if t.is_integer else None)):
        q = quantize_weight(rng.normal(size=(72, 768)) * 0.05, t, group, zp)
        whole.append((group, zp, 768, prepare(q), torch.from_numpy(q.dequantize()).cuda().double()))
    for j, config, (group, zp, k, p, w) in rotated([*_odd_size_weights(torch, rng, t), *whole], FOLDED, t):
        m = (1, 16, 5, 40, 9, 1, 3, 13)[j]
        for _ in range(2):
            x = torch.randn(m, k, dtype=torch.float16, device="cuda")
            ref = x.double() @ w.T
            err = float((cuda_matmul(x, p, config).double() - ref).norm() / ref.norm())
            assert err < 2e-3, (t, group, zp, m, config)
    for group, zp, k, p, w in whole:
        for m in (1, 7, 16, 33):
            x = torch.randn(m, k, dtype=torch.float16, device="cuda")
            err = float((cuda_matmul(x, p).double() - x.double() @ w.T).norm() / (x.double() @ w.T).norm())
            assert err < 2e-3, (t, group, zp, m, "default")


@pytest.mark.parametrize("t, group, bias, config", [
    ("int1", 128, False, FOLDED[1]), ("int2", 64, True, FOLDED[2]), ("int4", 128, True, FOLDED[1]),
    ("uint3", 32, False, FOLDED[3]), ("e4m3", 128, False, FOLDED[2]), ("int8", 8, True, FOLDED[1]),
    ("uint7", 1024, True, FOLDED[4]), ("int4", 128, False, FOLDED[0]), ("int4", 128, True, FOLDED[5]),
    ("e4m3", 64, False, FOLDED[6]), ("int3", 32, True, FOLDED[7])])  # fmt: skip
@pytest.mark.slow
def test_decode_folded_variants_build_with_nvcc(t, group, bias, config):
    """The folded kernels dequantise raw (no HSUB2/HMUL2 in the loop) and add a second mma per
    step where there is something to subtract (integers, zero points); group 8 keeps the
    subtraction in the dequantisation; the span-2 register path scales after the mma."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    from tessera.templates.lowbit.decode import make_decode

    t = ts.dtype(t)
    kernel = make_decode(t, group, bias, config, False, group % 32 == 0)  # unit scales where the span allows
    src = kernel.source_full
    folds = config.fold and group % 32 == 0
    assert ("_raw(" in src) == folds and ("_n(" in src or "_n_raw(" in src or "_b_n(" in src) == (group % 32 == 0)
    calls = src.count("ts_mma_m16n8k16_f16(")  # the 16 steps are spelled out (twice with prefetch: two register sets)
    assert calls == 16 * (2 if folds and (t.is_integer or bias) else 1) * (2 if config.prefetch else 1)
    assert kernel.build()


@pytest.mark.parametrize("t, group, bias, config", [
    ("int3", 32, True, PIPELINED[1]), ("uint4", 128, True, PIPELINED[2]), ("e2m1", 64, False, PIPELINED[3]),
    ("int8", 1024, False, PIPELINED[4]), ("e5m2", 8, False, PIPELINED[0])])  # fmt: skip
@pytest.mark.slow
def test_decode_pipelined_variants_build_with_nvcc(t, group, bias, config):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not installed")
    from tessera.templates.lowbit.decode import make_decode

    kernel = make_decode(ts.dtype(t), group, bias, config)
    assert "cp.async" in kernel.source_full and kernel.build()


def test_unit_scales_follow_the_span2_k_order(rng):
    """unit_scales' row (tile, unit, g), column (run q, half h) holds the value of row
    tile * 16 + g + 8h for the group of every k that lane (g, t) meets in run q of the unit, in
    the span-2 k order of tessera.ir.lowbit (0 past N, the last group past K)."""
    from tessera.templates.lowbit.decode import scale_slots, unit_scales

    for n, k, group in ((40, 520, 64), (16, 256, 256), (37, 1000, 32), (20, 768, 1024)):
        g_count = -(-k // group)
        values = rng.normal(size=(n, g_count)).astype(np.float16)
        kt = -(-k // 256)
        got = unit_scales(values, group, kt).reshape(-(-n // 16), kt, 8, -1, 2)
        spq, nq, _ = scale_slots(2, group)
        for tile in range(got.shape[0]):
            for u in range(kt):
                for lane in range(32):
                    g = lane // 4
                    for v in range(128):
                        row, kk = lowbit.lane_value_position(lane, v, 2)
                        q, h = (v // 8) // spq, row // 8
                        n_row, grp = tile * 16 + g + 8 * h, min((u * 256 + kk) // group, g_count - 1)
                        want = values[n_row, grp] if n_row < n else 0
                        assert got[tile, u, g, q, h] == want, (n, k, group, tile, u, lane, v)
    with pytest.raises(UnsupportedError, match="groups of 32"):
        unit_scales(np.zeros((4, 4), np.float16), 16, 1)


def test_decode_candidates_are_valid_configs():
    from tessera.templates.lowbit.decode import make_decode

    for bits in (1, 3, 4, 8):
        for m in (1, 16):
            cands = DecodeConfig.candidates(bits, m, 12288, 4096, 132)
            assert cands["reg"] == DecodeConfig.default(bits, m, 12288, 4096, 132)
            assert any(c.stages for c in cands.values())
            for c in cands.values():
                assert not c.problems() and c.smem_bytes(bits) <= 160 * 1024
    with pytest.raises(UnsupportedError, match="stages"):
        make_decode(ts.int4, 128, False, DecodeConfig(stages=5))
    with pytest.raises(UnsupportedError, match="prefetch is for the register path"):
        make_decode(ts.int4, 128, False, DecodeConfig(4, 2, 4, 1, 1, 0, 0, 2, True, True))
    with pytest.raises(UnsupportedError, match="unit scales need span 2"):
        make_decode(ts.int4, 128, False, DecodeConfig(), False, True)
    with pytest.raises(UnsupportedError, match="shared memory"):
        make_decode(ts.int8, 128, False, DecodeConfig(8, 1, 1, 2, 4, 0, 8))


@pytest.mark.cuda
def test_cuda_prefill_path_and_compiled_module(rng):
    torch = pytest.importorskip("torch")
    import tessera.frontend.torch  # noqa: F401  (registers the backend without an installed entry point)
    from tessera.eager.lowbit import cuda_matmul, prepare

    for t in ("int4", "uint3", "e4m3"):
        q = quantize_weight(rng.normal(size=(72, 264)) * 0.05, t, 64)
        x = torch.randn(130, 264, dtype=torch.float16, device="cuda")
        y = cuda_matmul(x, prepare(q))
        ref = x.double() @ torch.from_numpy(q.dequantize()).cuda().double().T
        assert float((y.double() - ref).norm() / ref.norm()) < 2e-3
    model = _mlp(torch)
    q = ts.quantize(model, weight="int4", group_size=16).cuda().half()
    compiled = torch.compile(q, backend="tessera")
    x = torch.randn(4, 37, device="cuda", dtype=torch.float16)
    out = compiled(x).float().cpu()  # before the reference: Module.float()/.cpu() move q in place
    ref = _reference(torch, q.float().cpu(), x.float().cpu())
    assert torch.allclose(out, ref, rtol=2e-2, atol=2e-2)


# ---- the graph operator ------------------------------------------------------------------
@pytest.mark.parametrize("t", ["int1", "int5", "uint7", "e3m2", "e5m2"])
def test_layout_unpack_inverts_pack(rng, t):
    """unpack_units inverts pack_units in every k order, and repack_units between two orders
    gives what packing in the second one gives."""
    from tessera.ir.lowbit import ORDERS
    from tessera.quant.layout import layout_codes, pack_units, repack_units, unpack_units

    dt = ts.dtype(t)
    for n, k in ((1, 1), (17, 300), (16, 256), (40, 520)):
        codes = rng.integers(0, 1 << dt.nbits, size=(n, k))
        for span in ORDERS:
            words = pack_units(codes, dt, span)
            assert words.size * 4 == -(-n // 16) * 16 * -(-k // 256) * 256 * dt.nbits // 8
            assert np.array_equal(unpack_units(words, dt, n, k, span), layout_codes(codes, dt))
            for new_span in ORDERS:
                assert np.array_equal(repack_units(words, dt, n, k, span, new_span), pack_units(codes, dt, new_span))
    codes = rng.integers(0, 1 << dt.nbits, size=(16, 256))
    assert not np.array_equal(pack_units(codes, dt, 2), pack_units(codes, dt, 16))


def test_prepared_weight_packs_each_span_once(rng):
    pytest.importorskip("torch")
    from tessera.eager.lowbit import prepare
    from tessera.quant.layout import pack_units, unpack_units

    q = quantize_weight(rng.normal(size=(20, 300)) * 0.05, "int3", 32)
    p = prepare(q, "cpu")
    assert p.words_for(2) is p.words  # (PREPARED_SPAN: the default decode configs' and the prefill kernels' order)
    w16 = p.words_for(16)
    assert w16 is p.words_for(16) and np.array_equal(w16.numpy(), pack_units(q.codes.codes(), q.dtype, 16))
    assert np.array_equal(unpack_units(w16.numpy(), q.dtype, 20, 300), unpack_units(p.words.numpy(), q.dtype, 20, 300, 2))


def test_layout_spans_cover_the_unit_once():
    """Each span's positions are a permutation of the 16 x 256 tile; a span-2 step's 16 k lie
    in 32 consecutive k (one scale group from 32 on); a span-16 step spans the unit."""
    from tessera.ir import lowbit

    for span, width in ((16, 256), (2, 32)):
        pos = {lowbit.lane_value_position(lane, v, span) for lane in range(32) for v in range(128)}
        assert pos == {(r, k) for r in range(16) for k in range(256)}
        for s in range(16):
            ks = {lowbit.lane_value_position(lane, v, span)[1] for lane in range(32) for v in range(8 * s, 8 * s + 8)}
            assert len(ks) == 16 and max(ks) // width == min(ks) // width
    with pytest.raises(ValueError, match="span"):
        lowbit.lane_value_position(0, 0, 4)


@pytest.mark.parametrize("weight", ["int4", "uint3", "e2m1"])
@pytest.mark.slow
def test_compiled_float16_model_uses_the_lowbit_graph_operator(weight, monkeypatch):
    """float16 activations: torch.compile turns the layers into lowbit_linear operators (the CUDA
    anchor on a GPU; on the CPU the row kernel in float32, cast there and back as the eager op
    does, never the operator's reference), close to the eager layers (tessera's CPU kernel)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 40), torch.nn.ReLU(), torch.nn.Linear(40, 24))
    q = ts.quantize(model, weight=weight, group_size=32).half()
    torch._dynamo.reset()  # a fresh cache: earlier tests' recompilations count towards dynamo's limit
    from tessera.graph.opdefs import lowbit as lowbit_op

    calls = []
    dequantized = lowbit_op.dequantized_weight
    monkeypatch.setattr(lowbit_op, "dequantized_weight", lambda *c: calls.append(c[-1]["wtype"]) or dequantized(*c))
    compiled = torch.compile(q, backend="tessera")
    tb = importlib.import_module("tessera.frontend.torch.backend")  # the module (the package exports the function)
    before = dict(tb.stats)
    for m in (3, 1):
        x = torch.randn(m, 64, dtype=torch.float16)
        y = compiled(x)
        assert y.dtype == torch.float16
        torch.testing.assert_close(y, q(x), rtol=2e-3, atol=2e-3)
    assert not calls  # the CPU kernel ran, not the operator's numpy reference, nor torch
    assert tb.stats["reference_ops"] == before["reference_ops"] and tb.stats["eager_nodes"] == before["eager_nodes"]


def test_graph_operator_reference_matches_quantized_weight(rng):
    from tessera.eager.quantize import QuantizedLinear
    from tessera.graph.opdefs.lowbit import dequantized_weight

    for t in ("int3", "uint6", "e4m3"):
        w = quantize_weight(rng.normal(size=(20, 70)), t, 16)
        consts, attrs = QuantizedLinear(w).graph_operands()
        assert np.allclose(dequantized_weight(*consts, attrs), w.dequantize(), rtol=1e-6, atol=1e-9)


@pytest.mark.skipif(__import__("shutil").which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.slow
def test_lowbit_anchor_with_fused_epilogue_builds():
    from tessera.ir import dtypes
    from tessera.ir import expr as E
    from tessera.ir.compute import Placeholder, compute
    from tessera.templates.epilogue import Epilogue
    from tessera.templates.lowbit.plan import plan_lowbit_linear

    acc = Placeholder("acc", (5, 40), dtypes.float32)
    bias = Placeholder("bias", (40,), dtypes.float16)
    out = compute((5, 40), lambda i, j: E.Cast(acc[(i, j)] + E.Cast(bias[(j,)], dtypes.float32), dtypes.float16),
                  "bias_add", dtypes.float16)  # fmt: skip
    for span in (16, 2):  # graphs saved before the span attribute, and tessera.quantize's (span 2: folded)
        attrs = {"wtype": "int3", "n": 40, "k": 264, "group_size": 64, "has_bias": True, "span": span}
        plan = plan_lowbit_linear((5, 264), attrs, 3 * 2 * 3 * 128, (40, 5), (40, 5), Epilogue(acc, out, [bias]))
        assert "ep0_bias" in plan.source and ("_raw(" in plan.source) == (span == 2)
        plan.build()


@pytest.mark.cuda
def test_cuda_compiled_model_runs_the_lowbit_anchor_with_fused_bias(rng):
    torch = pytest.importorskip("torch")
    import tessera.frontend.torch  # noqa: F401  (registers the backend without an installed entry point)

    torch.manual_seed(2)
    tb = importlib.import_module("tessera.frontend.torch.backend")  # (the package's `backend` is a function)

    model = torch.nn.Sequential(torch.nn.Linear(264, 72), torch.nn.GELU(), torch.nn.Linear(72, 40))
    for weight in ("int4", "uint3", "e2m1"):
        q = ts.quantize(model, weight=weight, group_size=64).cuda().half()
        torch._dynamo.reset()
        compiled = torch.compile(q, backend="tessera")
        before = dict(tb.stats)
        for m in (1, 5, 17):
            x = torch.randn(m, 264, dtype=torch.float16, device="cuda")
            ref = q(x).float()
            got = compiled(x).float()
            assert float((got - ref).norm() / ref.norm()) < 5e-3
        assert tb.stats["eager_nodes"] == before["eager_nodes"], "a node ran in torch (a graph break)"
        assert tb.stats["reference_ops"] == before["reference_ops"], "lowbit_linear ran on its numpy reference"


@pytest.mark.slow
def test_quantized_linear_calls_the_custom_op_only_where_it_is_traced(monkeypatch):
    """Eager forward runs the layer's matmul itself (the op's dispatch cost ~50 us a call); with
    a gradient asked for, under torch.compile or on a fake tensor it is the custom op, and every
    path gives the same result."""
    torch = pytest.importorskip("torch")
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tessera.eager import quantize as torch_quantize

    q = ts.quantize(torch.nn.Sequential(torch.nn.Linear(37, 19)), weight="int4", group_size=16)[0]
    calls = []
    real = torch_quantize.lowbit_linear
    monkeypatch.setattr(torch_quantize, "lowbit_linear", lambda x, h: calls.append(x.shape) or real(x, h))
    x = torch.randn(3, 5, 37)
    eager = q(x)
    assert calls == [] and eager.shape == (3, 5, 19)
    with torch.no_grad():
        assert torch.equal(q(x.requires_grad_()), eager) and calls == []
    assert torch.equal(q(x).detach(), eager) and calls == [(15, 37)]  # requires grad: the op
    plain = x.detach()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:  # (the layer's bias is a real tensor)
        assert q(mode.from_tensor(plain)).shape == (3, 5, 19) and len(calls) == 2
    torch._dynamo.reset()
    compiled = torch.compile(q, backend="eager")
    assert torch.allclose(compiled(plain), eager, rtol=1e-5, atol=1e-6) and len(calls) == 3
