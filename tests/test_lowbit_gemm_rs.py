"""The register-A low-bit prefill GEMM (tessera.templates.lowbit.gemm_rs) and the words' fragment
k order it reads (tessera.ir.lowbit.FRAGMENT_SPAN).

CPU tier: the order is a permutation of a unit and each step is exactly mma's A fragment; the
generated CUDA run on the host (tests/cuda_on_host.py, register-A wgmma modelled) at odd sizes
over types, groups, zero points and every config, two calls with fresh activations; refusals.
GPU tier (`cuda`): every type x groups x zero points x config against float64.  (The host model
runs each wgmma at its issue, so it cannot see a fragment buffer or stage reused too early:
tests/test_wgmma_hazards.py scans the SASS for the first, the GPU tier covers both.)"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from test_lowbit_gemm import close, product
from test_lowbit_prefill import SIZES, kernel_group, random_case

import tessera as ts
from tessera.errors import UnsupportedError
from tessera.ir import lowbit
from tessera.quant import WEIGHT_TYPES
from tessera.templates.lowbit import gemm_rs as rs
from tessera.templates.lowbit import gemm_rs_config as rs_config

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


def test_the_fragment_order_is_mmas_own_a_fragment():
    """Step s of lane 4g + t holds, register r = value // 2 % 4, row g + 8 (r % 2) and k
    16s + 2t + 8 (r // 2) + value % 2: every (row, k) of the 16 x 256 unit exactly once."""
    seen = set()
    for lane in range(32):
        g, t = divmod(lane, 4)
        for v in range(lowbit.UNIT_VALUES):
            row, k = lowbit.lane_value_position(lane, v, lowbit.FRAGMENT_SPAN)
            s, r = divmod(v // 2, 4)
            assert (row, k) == (g + 8 * (r % 2), 16 * s + 2 * t + 8 * (r // 2) + v % 2)
            seen.add((row, k))
    assert len(seen) == 16 * 256
    with pytest.raises(ValueError, match="span"):
        lowbit.lane_value_position(0, 0, 4)


def host_values(c: dict, x: np.ndarray, config: rs.RegisterAConfig) -> dict:
    from cuda_on_host import HostTensorMap

    m, k = x.shape
    n = c["shape"][0]
    floats, flags = config.workspace(max(1, config.cut_tiles(m, n, k, 4)))
    return {"whole": config.whole_tiles(m, n, k, 4), "P": np.zeros(floats, np.float32), "F": np.zeros(flags, np.uint32),
            "PW": floats, "FW": flags,
            "A": x.reshape(1, m, k), "Wq": c["words"], "S": c["scales"], "Z": c["biases"],
            "C": np.full((1, m, n), np.nan, np.float16), "tma_a": HostTensorMap("A", (1, m, k), (1, config.block_t // config.cluster, 64)),
            "tma_w": HostTensorMap("Wq", (shape := rs.word_shape(c["words"].size, k, c["key"][0].nbits)),
                                   (rs.ROWS // 16, 1, *shape[2:]), swizzle=0),
            "tma_c": HostTensorMap("C", (1, m, n), (1, config.block_t, 16), swizzle=0),
            "ctas": config.grid(m, n, 4), "batch": 1, "M": m, "K": k, "W": c["words"].size, "NS": n,
            "G": c["scales"].shape[1], "NB": c["biases"].shape[0], "GB": c["biases"].shape[1], "zdim": 1, "N": n}  # fmt: skip


@needs_nvcc
@pytest.mark.slow
def test_register_a_kernel_run_on_the_host_matches_the_reference(rng, tmp_path):
    """Types, groups (128, 32, 16, 64, per channel), zero points and every config at odd shapes
    (M past a tile or 1, N not a multiple of 16, K not of 256), two calls each; the host's
    4 "SMs" give each block several tiles, so the next tile's prefetch runs too; the clusters'
    second blocks take weight tiles inside N and wholly past it."""
    from cuda_on_host import run_on_host

    specs = [("int4", 128, False, 130), ("uint3", 32, True, 77), ("e4m3", None, False, 5), ("int3", 32, False, 257),
             ("e2m1", 64, False, 300), ("int8", 16, False, 1), ("uint2", 64, True, 33), ("uint6", None, True, 64),
             ("int7", 128, False, 200)]  # (one a config: CONFIGS, then CLUSTER_CONFIGS)  # fmt: skip
    cases, refs = [], []
    for i, (name, group, bias, m) in enumerate(specs):
        t = ts.dtype(name)
        n, k = SIZES[i % len(SIZES)] if i % 2 else (203, 520)
        c = random_case(rng, t, n, k, group, bias, lowbit.FRAGMENT_SPAN)
        configs = rs.CONFIGS + rs_config.CLUSTER_CONFIGS
        config = configs[i % len(configs)]
        kernel = rs.make_lowbit_gemm_rs(t, kernel_group(group, k), bias, config)
        for _ in range(2):  # fresh activations each call
            x = (rng.standard_normal((m, k)) * 0.5).astype(np.float16)
            values = host_values(c, x, config)
            cases.append((kernel, values, "C", values["ctas"], 384))
            refs.append((name, group, bias, str(config), product(x, c["ref"])))
    for (name, group, bias, config, ref), got in zip(refs, run_on_host(tmp_path, cases)):
        assert not np.isnan(got).any() and close(got[0], ref) < 2e-3, (name, group, bias, config)


# the host test's own second config (global words) beside the module's opt-in ones
STREAM_K = (rs_config.STREAM_K_CONFIGS[0], rs.RegisterAConfig(256, 5, in_flight=3, stream_k=True), rs_config.STREAM_K_CONFIGS[2])


def test_stream_k_schedule_gives_out_the_last_rounds_units():
    """Whole rounds of tiles, then the rest's 256-k blocks, at least one a block; otherwise whole tiles."""
    sk, plain = STREAM_K[0], rs.CONFIGS[0]
    assert sk.whole_tiles(4096, 12288, 4096, 132) == 1452 and plain.whole_tiles(4096, 12288, 4096, 132) == 1536
    assert sk.whole_tiles(4096, 12672, 4096, 132) == 1584  # whole rounds: nothing to share
    # fewer tiles than SMs (a short prompt): every tile cut, a block per SM up to one per 256-k block
    assert sk.whole_tiles(200, 1000, 4096, 132) == 0 and sk.grid(200, 1000, 132, 4096) == 128
    assert sk.grid(200, 1000, 132) == 8 and plain.grid(200, 1000, 132, 4096) == 8  # (without k, or stream_k: whole)
    assert sk.whole_tiles(200, 300, 4096, 4) == 0 and sk.grid(200, 300, 4, 4096) == 4
    assert sk.whole_tiles(1, 300, 256, 132) == 3 and sk.grid(1, 300, 132, 256) == 3  # (one 256-k block: nothing to cut)
    assert sk.whole_tiles(300, 637, 256, 4) == 10  # 2 tiles left, 1 unit each: fewer units than blocks
    assert sk.whole_tiles(300, 637, 520, 4) == 8 and sk.workspace(4) == (4 * 128 * 256, 4 * 8)  # (4 cut tiles: sums, tickets)
    assert str(sk) == "rs_256x128_s4_et_sk"
    assert rs.RegisterAConfig(256, 4, cluster=2, stream_k=True).problems() == ["stream_k shares tiles between single blocks, not clusters"]


def test_stream_k_is_tuned_only_where_every_tile_is_cut_and_never_deterministic():
    """Tuning tries the stream-K configs at short prompts only (not for a partial last round,
    whose L2 adds cost what sharing saves; not with one 256-k block, where nothing is cut), the
    ones that fit the weights, and none under torch's deterministic algorithms."""
    torch = pytest.importorskip("torch")
    from tessera.templates.lowbit.tune import stream_k_candidates

    every = [str(c) for c in rs_config.STREAM_K_CONFIGS]
    assert [str(c) for c in stream_k_candidates(ts.int4, 128, False, 128, 2048, 2048, sms=132)] == every
    assert not stream_k_candidates(ts.int4, 128, False, 4096, 12288, 4096, sms=132)
    assert not stream_k_candidates(ts.int4, 128, False, 128, 2048, 256, sms=132)
    assert [str(c) for c in stream_k_candidates(ts.int6, 16, True, 128, 2048, 2048, sms=132)] == ["rs_128x128_s6_sk"]
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert not stream_k_candidates(ts.int4, 128, False, 128, 2048, 2048, sms=132)
    finally:
        torch.use_deterministic_algorithms(was)


@needs_nvcc
@pytest.mark.slow
def test_stream_k_kernel_run_on_the_host_matches_the_reference(rng, tmp_path):
    """The last round's tiles cut among the host's 4 "SMs": a tile in 4 shares (one 256-k block
    each, after a whole tile each), tiles in 2 and 3 shares with a block whose share holds a
    whole tile between two cut ones, and one token; fewer tiles than "SMs" (every tile cut: 2
    tiles in 2 shares each, and 3 tiles of 2 blocks in 4 shares, one crossing a tile's end);
    two calls with fresh activations; the tickets and sums at rest (zero) after."""
    from cuda_on_host import run_on_host

    specs = [("int4", 128, False, 200, 633, 984), ("uint3", 32, True, 300, 637, 520), ("e4m3", 64, False, 70, 883, 500),
             ("int8", 128, False, 1, 633, 984), ("int4", 128, False, 70, 200, 1000),
             ("uint2", 32, True, 5, 300, 500)]  # (one token; then fewer tiles than blocks)  # fmt: skip
    cases, refs = [], []
    for (name, group, bias, m, n, k), config in zip(specs, (*STREAM_K, STREAM_K[0], STREAM_K[0], STREAM_K[2])):
        t = ts.dtype(name)
        c = random_case(rng, t, n, k, group, bias, lowbit.FRAGMENT_SPAN)
        kernel = rs.make_lowbit_gemm_rs(t, kernel_group(group, k), bias, config)
        assert config.cut_tiles(m, n, k, 4), (name, config)
        for _ in range(2):  # fresh activations each call; each call's C, tickets and sums read after it
            x = (rng.standard_normal((m, k)) * 0.5).astype(np.float16)
            values = host_values(c, x, config)
            cases.append((kernel, values, ("C", "F", "P"), values["ctas"], 384))
            refs.append((name, str(config), product(x, c["ref"])))
    for (name, config, ref), (got, flags, sums) in zip(refs, run_on_host(tmp_path, cases)):
        assert not np.isnan(got).any() and close(got[0], ref) < 2e-3, (name, config)
        assert not flags.any() and not sums.any(), (name, config, "tickets or sums left set")


def test_bad_arguments_are_refused_with_the_reason():
    with pytest.raises(UnsupportedError, match="group size 8"):
        rs.make_lowbit_gemm_rs(ts.int4, 8, False, rs.CONFIGS[0])
    with pytest.raises(UnsupportedError, match="block_t"):
        rs.make_lowbit_gemm_rs(ts.int4, 128, False, rs.RegisterAConfig(96, 4))
    with pytest.raises(UnsupportedError, match="shared memory"):
        rs.make_lowbit_gemm_rs(ts.int4, 128, False, rs.RegisterAConfig(256, 7))
    with pytest.raises(UnsupportedError, match="block_t 128"):
        rs.make_lowbit_gemm_rs(ts.int6, 16, True, rs.RegisterAConfig(256, 4))
    assert not rs.problems(ts.int6, 16, True, rs.RegisterAConfig(128, 6))
    with pytest.raises(UnsupportedError, match="in_flight must be 1 or 3"):
        rs.make_lowbit_gemm_rs(ts.int4, 128, False, rs.RegisterAConfig(256, 4, in_flight=2))
    with pytest.raises(UnsupportedError, match="cluster must be 1 or 2"):
        rs.make_lowbit_gemm_rs(ts.int4, 128, False, rs.RegisterAConfig(256, 4, cluster=4))
    pair = rs.RegisterAConfig(256, 4, cluster=2)  # whole clusters, each a group of two weight tiles
    assert pair.grid(4096, 12288, 132) == 132 and pair.grid(300, 200, 132) == 4 and pair.grid(1, 16, 132) == 2 and pair.tiles(4096, 12288) == 16 * 48
    assert str(pair) == "rs_256x128_s4_c2"
    four_buffers = rs.RegisterAConfig(256, 5, in_flight=3)  # two more fragment buffers: spills from 2 bits
    assert rs.problems(ts.uint2, 16, True, four_buffers) and not rs.problems(ts.int1, 16, True, four_buffers)
    assert str(four_buffers) == "rs_256x128_s5_f3" and str(rs.CONFIGS[0]) == "rs_256x128_s4_et"
    # the TMA epilogue's 64 KiB slab (barriers packed): 3 stages beside the int8 word ring, 4 beside
    # the int4 one, not the int5 one; 5 with global words, not 6
    ring, ring4 = rs.RegisterAConfig(256, 3, words="tma", epilogue="tma"), rs.RegisterAConfig(256, 4, words="tma", epilogue="tma")
    assert not rs.problems(ts.int8, 128, False, ring) and not rs.problems(ts.int4, 128, False, ring4)
    assert "227 KiB" in rs.problems(ts.int5, 128, False, ring4)[0]
    assert not rs.RegisterAConfig(256, 5, epilogue="tma").problems()
    assert "227 KiB" in rs.problems(ts.int1, 128, False, rs.RegisterAConfig(256, 6, epilogue="tma"))[0]
    assert rs.RegisterAConfig(256, 4, epilogue="dma").problems() == ["epilogue must be 'stmatrix', 'scalar' or 'tma', got 'dma'"]
    # N % 8 != 0: TMA cannot write out's rows, the launch (and tuning) runs the stmatrix epilogue
    assert ring.for_output(12288) is ring and str(ring.for_output(12283)) == "rs_256x128_s3_wt"
    assert rs.CONFIGS[1].for_output(33) is rs.CONFIGS[1]
    assert rs.scale_runs(128) == (8, 2) and rs.scale_runs(16) == (1, 16) and rs.scale_runs(4096) == (16, 1)


# ---- GPU tier ----------------------------------------------------------------------------
@pytest.mark.cuda
def test_cuda_register_a_kernel_every_type_group_zero_point_and_config(rng):
    """Every type x groups 128, 32, 64, per channel (zero points on the unsigned types, and on
    the signed at 32 and per channel) x every config, odd N and K, M of 1, 65 and 300, two calls with fresh activations,
    against float64 products of the quantized weights (the configs each builds: the word ring's
    refuse the wider types at 5 stages)."""
    torch = pytest.importorskip("torch")
    from tessera.eager.lowbit import prepare
    from tessera.quant.quantize import quantize_weight

    cases = []
    for i, t in enumerate(WEIGHT_TYPES):
        for j, group in enumerate((128, 32, 64, None)):
            n, k = SIZES[(i + j) % 3]
            # zero points on the signed integers at 32 and per channel; the unsigned always have them
            p = prepare(quantize_weight(rng.normal(size=(n, k)) * 0.05, t, group, t.is_integer and j in (1, 3) or None))
            bias = p.weight.zeros is not None
            cases += [(p, t, bias, c) for c in rs.CONFIGS + rs_config.CLUSTER_CONFIGS if not rs.problems(t, p.kernel_group, bias, c)]
    with ThreadPoolExecutor(min(32, os.cpu_count() or 4)) as ex:  # (the kernels the launches run: for_output)
        list(ex.map(lambda a: rs.make_lowbit_gemm_rs(a[1], a[0].kernel_group, a[2], a[3].for_output(a[0].weight.shape[0])).build(), cases))
    bad = []
    for p, t, bias, config in cases:
        w = torch.from_numpy(p.weight.dequantize()).cuda().double()
        for m in (1, 65, 300):
            err = gpu_error(p, w, m, config)
            if not err < 2e-3:
                bad.append((t.name, p.weight.group_size, bias, str(config), m, err))
    assert not bad, bad


def gpu_error(p, w, m: int, config: rs.RegisterAConfig) -> float:
    """Relative error of one launch on fresh activations [m, K] against float64 on the dequantised weights w."""
    import torch

    n, k = p.weight.shape
    x = torch.randn(m, k, dtype=torch.float16, device="cuda")
    y = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
    rs.lowbit_gemm_rs(x, p.words_for(lowbit.FRAGMENT_SPAN), p.scales, p.biases, y, p.weight.dtype, p.kernel_group,
                      p.weight.zeros is not None, config)  # fmt: skip
    ref = x.double() @ w.T
    return float((y.double() - ref).norm() / ref.norm())


@pytest.mark.cuda
def test_cuda_register_a_kernel_persistent_tiles_and_tma_epilogue(rng):
    """More tiles than SMs, so that blocks take several (each TMA epilogue waits for its warp's
    slab to be read before writing the next tile's), M past a tile edge, N a multiple of 8
    past a tile edge (the TMA epilogue) and odd (its logged fallback to the stmatrix
    epilogue), every config and the stream-K ones (the last round shared), three calls each
    with fresh activations."""
    torch = pytest.importorskip("torch")
    from tessera.eager.lowbit import prepare
    from tessera.quant.quantize import quantize_weight

    bad = []
    for name, m, n, k in (("int4", 4100, 4104, 1000), ("int7", 2049, 9000, 776), ("e4m3", 4100, 4101, 520), ("uint3", 300, 40, 4096)):
        t = ts.dtype(name)
        p = prepare(quantize_weight(rng.normal(size=(n, k)) * 0.05, t, 128))
        bias = p.weight.zeros is not None
        w = torch.from_numpy(p.weight.dequantize()).cuda().double()
        for config in rs.CONFIGS + rs_config.STREAM_K_CONFIGS:
            if rs.problems(t, p.kernel_group, bias, config):
                continue
            for _ in range(3):
                err = gpu_error(p, w, m, config)
                if not err < 2e-3:
                    bad.append((name, m, n, k, str(config), err))
    assert not bad, bad


@pytest.mark.cuda
def test_cuda_stream_k_short_prompts_launcher_and_plan_leave_their_sums_at_rest(rng):
    """Fewer tiles than SMs (every tile cut into shares whose sums meet at the L2): each stream-K
    config through the launcher and through a loaded plan (its zeroed workspaces, the graph
    compiler's path), odd M and N, three calls with fresh activations; after them the sums and
    tickets are zero again (the next launch starts from them)."""
    torch = pytest.importorskip("torch")
    from tessera.eager.lowbit import PREPARED_SPAN, prepare
    from tessera.quant.quantize import quantize_weight
    from tessera.runtime.cuda import multiprocessor_count
    from tessera.templates.lowbit.plan import plan_lowbit_linear

    sms, bad = multiprocessor_count(), []
    for name, m, n, k in (("int4", 128, 2048, 2048), ("uint5", 77, 1000, 5640), ("e2m3", 300, 264, 4096)):
        t = ts.dtype(name)
        p = prepare(quantize_weight(rng.normal(size=(n, k)) * 0.05, t, 128))
        bias = p.weight.zeros is not None
        w = torch.from_numpy(p.weight.dequantize()).cuda().double()
        words = p.words_for(lowbit.FRAGMENT_SPAN)
        attrs = {"wtype": name, "n": n, "k": k, "group_size": 128, "has_bias": bias, "span": PREPARED_SPAN}
        for config in rs_config.STREAM_K_CONFIGS:
            if rs.problems(t, p.kernel_group, bias, config) or not config.cut_tiles(m, n, k, sms):
                continue
            plan = plan_lowbit_linear((m, k), attrs, p.words.numel(), tuple(p.scales.shape), tuple(p.biases.shape), None,
                                      False, config, fragment=True)  # fmt: skip
            anchor = plan.load()
            for _ in range(3):
                err = gpu_error(p, w, m, config)
                x = torch.randn(m, k, dtype=torch.float16, device="cuda")
                y = torch.full((m, n), float("nan"), dtype=torch.float16, device="cuda")
                anchor([x, p.words, p.scales, p.biases, words], y, [])
                ref = x.double() @ w.T
                plan_err = float((y.double() - ref).norm() / ref.norm())
                if not (err < 2e-3 and plan_err < 2e-3):
                    bad.append((name, m, n, k, str(config), err, plan_err))
            sums, tickets = rs.stream_k_workspace(x, config, config.cut_tiles(m, n, k, sms))
            at_rest = [torch.from_dlpack(anchor.workspaces[i]).count_nonzero().item() for i in plan.zeroed]
            if sums.count_nonzero().item() or tickets.view(torch.int32).count_nonzero().item() or any(at_rest):
                bad.append((name, str(config), "sums or tickets left set"))
    assert not bad, bad


@pytest.mark.cuda
def test_cuda_tma_epilogue_falls_back_where_tma_cannot_write(caplog):
    """N % 8 != 0 (rows not 16-byte aligned): the launch logs and runs the stmatrix epilogue."""
    torch = pytest.importorskip("torch")
    out = torch.empty(3, 20, dtype=torch.float16, device="cuda")
    assert rs.output_map(out, 256) is None and rs.output_map(torch.empty(3, 24, dtype=torch.float16, device="cuda"), 256)
    x = torch.randn(3, 256, dtype=torch.float16, device="cuda")
    words = torch.zeros(2 * 4 * 128, dtype=torch.int32, device="cuda").view(torch.uint32)  # 2 units of 16 rows x 256 k
    scales = torch.ones(20, 2, dtype=torch.float16, device="cuda")
    with caplog.at_level("INFO", logger=rs._log.name):
        rs.lowbit_gemm_rs(x, words, scales, scales, out, ts.int4, 128, False, rs.CONFIGS[0])
    assert "stmatrix epilogue instead" in caplog.text and not out.isnan().any()
