"""The fused low-bit prefill GEMM (tessera.templates.lowbit.gemm): the dequantisation inside the TMA
GEMM's mainloop, its graph anchor (tessera.templates.lowbit.plan._plan_fused) and the prefill choice.

CPU tier (nvcc): the generated CUDA run on the host through tests/cuda_on_host.py's SM90 model
(mbarriers, TMA, wgmma) at odd sizes for types, groups, zero points and every tile, called twice
with fresh activations; the anchor with an epilogue; ptxas spills; refusals.  GPU tier (`cuda`):
every type x groups x zero points x tiles against float32 products of the fp16 weights, the
anchor, and the tuned choice against the two passes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from test_lowbit_prefill import SIZES, kernel_group, random_case, reference

import tessera as ts
from tessera.errors import UnsupportedError
from tessera.quant import WEIGHT_TYPES
from tessera.templates.lowbit import gemm as lg
from tessera.templates.lowbit import gemm_rs as rs

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


def host_values(c: dict, x: np.ndarray, config) -> dict:
    from cuda_on_host import HostTensorMap

    m, k = x.shape[-2:]
    n = c["shape"][0]
    return {"A": x.reshape(1, m, k), "Wq": c["words"], "S": c["scales"], "Z": c["biases"],
            "C": np.full((1, m, n), np.nan, np.float16), "tma_a": HostTensorMap("A", (1, m, k), (1, config.block_m, 64)),
            "ctas": config.grid(m, n, 1, 3), "batch": 1, "M": m, "K": k, "W": c["words"].size, "NS": n,
            "G": c["scales"].shape[1], "NB": c["biases"].shape[0], "GB": c["biases"].shape[1], "zdim": 1,
            "N": n}  # fmt: skip


def gemm_case(rng, t, n: int, k: int, group: int | None, bias: bool) -> dict:
    """random_case in span 2 with weights of at most 1024 in magnitude: its scales in [-2, 2]
    take e5m2's codes (up to 57344) past fp16's range, and a product of such weights is inf or
    NaN in any kernel, so they are divided by powers of two (exactly) until the weights fit."""
    c = random_case(rng, t, n, k, group, bias, 2)
    while not np.abs(c["ref"].astype(np.float32)).max() <= 1024:
        c["scales"] = (c["scales"] / np.float16(16)).astype(np.float16)
        with np.errstate(over="ignore"):
            c["ref"] = reference(c["words"], c["scales"], c["biases"], *c["key"][:1], n, k, *c["key"][1:])
    return c


def product(x: np.ndarray, w16: np.ndarray) -> np.ndarray:
    return x.astype(np.float32) @ w16.astype(np.float32).T


def close(got: np.ndarray, ref: np.ndarray) -> float:
    """Largest error relative to the reference's largest magnitude (fp16 output rounding: ~5e-4)."""
    return float(np.abs(got.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-6))


@needs_nvcc
@pytest.mark.slow
def test_fused_kernel_run_on_the_host_matches_the_reference(rng, tmp_path):
    """Types, group sizes (32, 128, 8, per channel), zero points and every tile rotated over odd
    shapes (M past a tile, N not a multiple of 16 or 8, K not of 256), two calls each."""
    from cuda_on_host import run_on_host

    specs = [("int4", 128, False, 77), ("uint3", 32, True, 130), ("e4m3", None, False, 5), ("int8", 8, False, 64),
             ("e2m1", 64, False, 300), ("int1", 32, False, 17), ("uint6", None, True, 1)]  # fmt: skip
    cases, refs = [], []
    for i, (name, group, bias, m) in enumerate(specs):
        t = ts.dtype(name)
        n, k = SIZES[i % len(SIZES)] if i % 2 else (203, 520)
        c = gemm_case(rng, t, n, k, group, bias)
        configs = lg.buildable_configs(t, kernel_group(group, k), bias)
        config = configs[i % len(configs)]  # (rotated: tiles and store orders)
        kernel = lg.make_lowbit_gemm(t, kernel_group(group, k), bias, config)
        for _ in range(2):  # fresh activations each call
            x = (rng.standard_normal((m, k)) * 0.5).astype(np.float16)
            values = host_values(c, x, config)
            cases.append((kernel, values, "C", values["ctas"], 384))
            refs.append((name, group, bias, config, product(x, c["ref"])))
    for (name, group, bias, config, ref), got in zip(refs, run_on_host(tmp_path, cases)):
        assert not np.isnan(got).any() and close(got[0], ref) < 2e-3, (name, group, bias, str(config))


class _Source:
    """An anchor plan's single kernel as run_on_host takes kernels (its full source)."""

    def __init__(self, source: str):
        self.source_full = source


@needs_nvcc
@pytest.mark.slow
def test_fused_anchor_with_an_epilogue_run_on_the_host(rng, tmp_path):
    """plan_lowbit_linear past DECODE_MAX_M with prefill=<tile>: x [2, 35, K] read through its
    tensor map, residual + silu fused into the staged stores, one launch, no temporaries."""
    from cuda_on_host import HostTensorMap, run_on_host

    from tessera import ops
    from tessera.ir import dtypes
    from tessera.templates.epilogue import Epilogue
    from tessera.templates.lowbit.plan import plan_lowbit_linear

    t, n, k, group = ts.dtype("int4"), 136, 264, 64
    c = random_case(rng, t, n, k, group, True, 2)
    shape = (2, 35, n)
    acc, res = ops.placeholder(shape, "float32", "acc"), ops.placeholder(shape, "float16", "res")
    silu = ops.silu(ops.add(acc, ops.cast(res, dtypes.float32)))
    attrs = {"wtype": t.name, "n": n, "k": k, "group_size": group, "has_bias": True, "span": 2}
    config = lg.prefill_config(spread=True)
    plan = plan_lowbit_linear((2, 35, k), attrs, c["words"].size, c["scales"].shape, c["biases"].shape,
                              Epilogue(acc, ops.cast(silu, dtypes.float16), [res]), False, config)  # fmt: skip
    assert len(plan.launches) == 1 and not plan.temporaries and plan.config == config
    params = [p.name for p in plan.launches[0].func.params]
    assert params[:6] == ["A", "Wq", "S", "Z", "C", "tma_a"] and len(params) == 7
    x = (rng.standard_normal((2, 35, k)) * 0.5).astype(np.float16)
    r = rng.standard_normal(shape).astype(np.float16)
    values = {"A": x, "Wq": c["words"], "S": c["scales"], "Z": c["biases"], "C": np.full(shape, np.nan, np.float16),
              "tma_a": HostTensorMap("A", (1, 70, k), (1, config.block_m, 64)), params[6]: r}  # fmt: skip
    (got,) = run_on_host(tmp_path, [(_Source(plan.source), values, "C", plan.launches[0].func.launch.grid[0].value, 384)])
    y = product(x.reshape(70, k), c["ref"]).reshape(shape).astype(np.float16).astype(np.float32) + r
    with np.errstate(over="ignore"):
        ref = y / (1 + np.exp(-y))
    assert close(got, ref) < 3e-3


def test_register_split_fits_the_register_file():
    for bits in range(1, 9):
        for tile in lg.TILES:
            for group, bias in ((128, False), (32, True), (4096, False)):
                p, c = lg.register_split(bits, tile[1], group, bias)
                assert p % 8 == 0 and c % 8 == 0 and 128 * p + 256 * c <= 168 * 384 and c >= 168
                assert p >= min(168, lg.producer_registers(bits, tile[1], group, bias))


def test_bad_configurations_are_refused_with_the_reason():
    with pytest.raises(UnsupportedError, match="group size 96"):
        lg.make_lowbit_gemm(ts.int4, 96, False, lg.prefill_config())
    with pytest.raises(UnsupportedError, match="block_n must be a multiple of 64"):
        lg.make_lowbit_gemm(ts.int4, 128, False, lg.prefill_config(128, 96, 4))
    with pytest.raises(UnsupportedError, match="more than the 168 registers"):
        lg.make_lowbit_gemm(ts.int8, 128, False, lg.prefill_config(128, 256, 3))
    with pytest.raises(UnsupportedError, match="two consumer warpgroups"):
        from tessera.templates.gemm.tma import TmaConfig

        lg.make_lowbit_gemm(ts.int4, 128, False, TmaConfig(128, 128, 4, 2))  # (the scalar epilogue)
    assert lg.problems(ts.int4, 128, False, lg.prefill_config()) == []


def test_prefill_candidates_start_with_the_two_passes():
    from tessera.templates.lowbit.tune import DEQUANT_THEN_GEMM, prefill_candidates

    got = prefill_candidates(ts.int4, 128, False, 2)
    assert got[0] == DEQUANT_THEN_GEMM and got[1:] == lg.buildable_configs(ts.int4, 128, False)
    assert {(c.block_m, c.block_n, c.stages) for c in got[1:]} == set(lg.TILES) and len({str(c) for c in got}) == len(got)
    assert prefill_candidates(ts.int4, 128, False, 16) == [DEQUANT_THEN_GEMM]  # the fused kernel reads span 2
    assert all(c.block_n == 128 for c in prefill_candidates(ts.int8, 32, True, 2)[1:])  # (registers)
    # with the words in FRAGMENT_SPAN at hand too: the register-A kernel's configs after the fused tiles
    assert prefill_candidates(ts.int4, 128, False, 2, register_a=True) == got + list(rs.CONFIGS)
    assert prefill_candidates(ts.int4, 128, False, 16, register_a=True) == [DEQUANT_THEN_GEMM, *rs.CONFIGS]
    assert prefill_candidates(ts.int6, 16, True, 16, register_a=True) == [DEQUANT_THEN_GEMM, rs.CONFIGS[1]]  # (spills)


def test_prefill_mode_picks_the_path(monkeypatch, caplog):
    """$TESSERA_LOWBIT_PREFILL: 'dequant' and 'auto' without tuning take the two passes,
    'fused' the kernel's first config (a plan of one launch, no temporary), 'register' the
    register-A kernel's where the caller has fragment-order words, or the two passes with a
    warning where the forced kernel cannot run; anything else is refused."""
    from tessera.errors import ArgumentError
    from tessera.templates.lowbit.plan import plan_lowbit_linear
    from tessera.templates.lowbit.tune import DEQUANT_THEN_GEMM, prefill_choice

    args = (ts.int4, 128, False, 2, 140, 96, 512, 96 * 512 // 8, (96, 4), (1, 1))
    for mode, tune, want in (("dequant", True, DEQUANT_THEN_GEMM), ("auto", False, DEQUANT_THEN_GEMM),
                             ("", False, DEQUANT_THEN_GEMM), ("fused", False, lg.prefill_config())):  # fmt: skip
        monkeypatch.setenv("TESSERA_LOWBIT_PREFILL", mode)
        assert prefill_choice(*args, tune) == want, mode
    monkeypatch.setenv("TESSERA_LOWBIT_PREFILL", "fused")
    attrs = {"wtype": "int4", "n": 96, "k": 512, "group_size": 128, "has_bias": False, "span": 2}
    plan = plan_lowbit_linear((2, 70, 512), attrs, *args[7:])
    assert len(plan.launches) == 1 and not plan.temporaries and plan.name.startswith("lowbit_prefill_int4_tma")
    with caplog.at_level("WARNING", logger="tessera"):
        assert prefill_choice(ts.int4, 128, False, 16, *args[4:], False) == DEQUANT_THEN_GEMM
    assert "cannot run int4 g128 words here (k order 16" in caplog.text
    monkeypatch.setenv("TESSERA_LOWBIT_PREFILL", "register")
    assert prefill_choice(*args, False, register_a=True) == rs.CONFIGS[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="tessera"):  # (the graph's anchor has no fragment-order words)
        assert prefill_choice(*args, False) == DEQUANT_THEN_GEMM
    assert "register: that kernel cannot run" in caplog.text and "no fragment-order copy" in caplog.text
    monkeypatch.setenv("TESSERA_LOWBIT_PREFILL", "always")
    with pytest.raises(ArgumentError, match="TESSERA_LOWBIT_PREFILL='always'"):
        prefill_choice(*args, False)


@pytest.mark.parametrize("spread", [False, True])
def test_the_dequantisers_store_order_and_bank_conflicts(spread):
    """A stage's 16-byte stores (lane (g, t) writes chunk 4s + t, or 4 (s ^ g % 2) + t spread,
    of rows g and g + 8 of its unit, the B tile swizzled per 128-byte row): each row's 8 chunks
    are written once over the two stores, and a quarter warp meets a bank twice exactly when
    not spread."""
    for h in (0, 1):
        written = {}
        for s in (0, 1):
            for quarter in range(4):
                banks = set()
                for lane in range(8 * quarter, 8 * quarter + 8):
                    g, t = divmod(lane, 4)
                    chunk = 4 * ((s ^ g % 2) if spread else s) + t
                    row = g + 8 * h
                    banks.add(chunk ^ row % 8)
                    written.setdefault(row, []).append(chunk)
                assert len(banks) == (8 if spread else 4)
        assert all(sorted(c) == list(range(8)) for c in written.values())


@needs_nvcc
@pytest.mark.toolchain
@pytest.mark.slow
def test_no_register_spills_at_the_common_groups(tmp_path):
    """ptxas spills nothing for the default tile at group 128 and per channel, int1 to int8 and
    the small floats (measured at 32 with zero points too: 7 and 8 bits spill <= 16 bytes)."""
    names = ("int1", "int3", "int4", "int5", "int8", "e2m1", "e4m3")

    def spills(args) -> str:
        name, group = args
        kernel = lg.make_lowbit_gemm(ts.dtype(name), group, False, lg.prefill_config())
        src = tmp_path / f"{name}_g{group}.cu"  # the source kernel.build() compiles, built once here with -v
        src.write_text(kernel.source)
        out = subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-O3", "-std=c++17", "-Xptxas", "-v", "-o", os.devnull,
                              src], capture_output=True, text=True).stderr  # fmt: skip
        return ";".join(re.findall(r"(\d+) bytes spill stores", out))

    with ThreadPoolExecutor(2) as ex:
        got = list(ex.map(spills, [(n, g) for n in names for g in (128, 4096)]))
    assert all(s and set(s.split(";")) == {"0"} for s in got), got


# ---- GPU tier ----------------------------------------------------------------------------
@pytest.mark.cuda
def test_cuda_fused_kernel_every_type_group_zero_point_and_tile(rng):
    """Every type x groups 128, 32, 64, per channel (zero points on the integers at 32 and per
    channel) x every tile it builds with, odd N and K, M of 65 and 300, two calls with fresh
    activations, against float32 products of the exact fp16 weights."""
    torch = pytest.importorskip("torch")

    cases = []
    for i, t in enumerate(WEIGHT_TYPES):
        for j, group in enumerate((128, 32, 64, None)):
            bias = t.is_integer and j in (1, 3)
            n, k = SIZES[(i + j) % 3]
            c = gemm_case(rng, t, n, k, group, bias)
            for config in lg.buildable_configs(t, kernel_group(group, k), bias):
                cases.append((c, t, kernel_group(group, k), bias, config))
    with ThreadPoolExecutor(min(32, os.cpu_count() or 4)) as ex:
        list(ex.map(lambda a: lg.make_lowbit_gemm(*a[1:]).build(), cases))
    bad = []
    for c, t, group, bias, config in cases:
        n, k = c["shape"]
        dev = [torch.from_numpy(c[name]).cuda() for name in ("words", "scales", "biases")]
        w16 = torch.from_numpy(c["ref"]).cuda().float()
        for m in (65, 300):
            x = torch.randn(m, k, dtype=torch.float16, device="cuda")
            y = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
            lg.lowbit_gemm(x, *dev, y, t, group, bias, config)
            ref = x.float() @ w16.T
            err = float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
            if not err < 2e-3:
                bad.append((t.name, group, bias, str(config), m, err))
    assert not bad, bad


@pytest.mark.cuda
def test_cuda_fused_anchor_and_tuned_choice(rng, monkeypatch):
    """The anchor with prefill=<each tile> equals the two-pass anchor's result on x [3, 50, K]
    (two calls, fresh inputs); tuned_prefill returns a candidate (with and without the
    register-A kernel); eager prefill_matmul, tuned and forced to either fused kernel, agrees
    with float64 on the quantized weight's dequantisation."""
    torch = pytest.importorskip("torch")
    from tessera.templates.lowbit.plan import plan_lowbit_linear
    from tessera.templates.lowbit.tune import DEQUANT_THEN_GEMM, prefill_candidates, stream_k_candidates, tuned_prefill

    t, n, k, group = ts.dtype("uint4"), 520, 1000, 128
    c = random_case(rng, t, n, k, group, True, 2)
    attrs = {"wtype": t.name, "n": n, "k": k, "group_size": group, "has_bias": True, "span": 2}
    dev = [torch.from_numpy(c[name]).cuda() for name in ("words", "scales", "biases")]
    sizes = (c["words"].size, c["scales"].shape, c["biases"].shape)
    two = plan_lowbit_linear((3, 50, k), attrs, *sizes, None, False, DEQUANT_THEN_GEMM).load()
    for config in lg.buildable_configs(t, group, True):
        fused = plan_lowbit_linear((3, 50, k), attrs, *sizes, None, False, config).load()
        for _ in range(2):
            x = torch.randn(3, 50, k, dtype=torch.float16, device="cuda")
            a, b = (torch.empty(3, 50, n, dtype=torch.float16, device="cuda") for _ in range(2))
            two([x, *dev], a, [], [torch.empty(n, k, dtype=torch.float16, device="cuda")])  # (its W16 temporary)
            fused([x, *dev], b, [])
            assert float((a.float() - b.float()).abs().max() / a.float().abs().max()) < 2e-3, str(config)
    choice = tuned_prefill(t, group, True, 2, 150, n, k, *sizes)
    assert choice in prefill_candidates(t, group, True, 2)
    choice = tuned_prefill(t, group, True, 2, 150, n, k, *sizes, register_a=True)  # (5 tiles: the stream-K ones too)
    assert choice in prefill_candidates(t, group, True, 2, register_a=True) + stream_k_candidates(t, group, True, 150, n, k)
    assert len(stream_k_candidates(t, group, True, 150, n, k)) == 3  # (not for a partial last round, nor with nothing to cut)
    assert not stream_k_candidates(t, group, True, 4096, 12288, 4096) and not stream_k_candidates(t, group, True, 8192, 16384, 128)

    from tessera.eager.lowbit import prefill_matmul, prepare
    from tessera.quant.quantize import quantize_weight

    q = quantize_weight(rng.normal(size=(n, k)) * 0.05, t, group, True)
    p = prepare(q)
    w = torch.from_numpy(q.dequantize()).cuda().double()
    monkeypatch.setenv("TESSERA_TUNE", "1")
    for mode in ("auto", "fused", "register"):
        monkeypatch.setenv("TESSERA_LOWBIT_PREFILL", mode)
        for m in (65, 300):
            x = torch.randn(m, k, dtype=torch.float16, device="cuda")
            ref = x.double() @ w.T
            err = float((prefill_matmul(x, p).double() - ref).norm() / ref.norm())
            assert err < 2e-3, (mode, m, err)
    assert p.cache[("prefill", 512, "fused", True)] != DEQUANT_THEN_GEMM
    assert p.cache[("prefill", 512, "register", True)] == rs.CONFIGS[0] and ("words", 1) in p.cache
