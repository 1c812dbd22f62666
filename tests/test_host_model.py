"""tests/cuda_on_host.py's model on kernels whose results are known: the warp-specialised TMA
GEMM (tessera.templates.gemm.tma) against numpy, the low-bit decode kernel (mma.sync, cp.async)
against its reference; a broken barrier protocol and an impossible register split caught."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from cuda_on_host import HostTensorMap, run_on_host

import tessera as ts
from tessera import f16, u64
from tessera.templates.gemm.tma import TmaConfig, make_gemm_tma, tensor_map_boxes

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


@pytest.mark.parametrize("config", [TmaConfig(128, 128, 3, 2, epilogue="staged"), TmaConfig(64, 64, 2, 1),
                                    TmaConfig(64, 64, 4, 1, split_k=3, persistent=False, split_reduce="cluster")],
                         ids=str)  # fmt: skip
@pytest.mark.slow
def test_tma_gemm_on_the_host_matches_numpy(rng, tmp_path, config):
    """Odd M, N and K (TMA's zero fill past the edges), several tiles per block (persistent), or
    split-k over a cluster whose blocks add their partial tiles through distributed shared memory."""
    cases, refs = [], []
    for m, n, k in ((70, 136, 200), (130, 64, 72)):
        a = rng.standard_normal((1, m, k)).astype(np.float16)
        b = rng.standard_normal((1, n, k)).astype(np.float16)
        boxes = tensor_map_boxes(config, "nk")
        ctas = 2 if config.persistent else config.grid(m, n, 1, 132)
        values = {"A": a, "B": b, "C": np.full((1, m, n), np.nan, np.float16), "split": config.split_k, "ctas": ctas,
                  "batch": 1,
                  "M": m, "K": k, "N": n, "zdim": 1, "tma_a": HostTensorMap("A", (1, m, k), boxes[0]),
                  "tma_b": HostTensorMap("B", (1, n, k), boxes[1])}  # fmt: skip
        cases.append((make_gemm_tma(f16, config, "nk"), values, "C", ctas, config.threads))
        refs.append(a[0].astype(np.float32) @ b[0].astype(np.float32).T)
    for got, ref in zip(run_on_host(tmp_path, cases), refs):
        assert np.abs(got[0] - ref).max() <= 2e-3 * np.abs(ref).max()


@pytest.mark.slow
def test_an_arrival_past_the_count_is_reported(tmp_path):
    @ts.kernel(target="cuda")
    def arrives_twice(Out: f16["n"]):
        ts.attrs.grid = 1
        ts.attrs.block = 32
        bar = ts.shared_tensor(u64, [1])
        if ts.thread_idx.x == 0:
            ts.mbarrier_init(bar[0], 1)
            ts.mbarrier_arrive_expect_tx(bar[0], 64)  # the one arrival, the phase now waits for 64 bytes
            ts.mbarrier_arrive(bar[0])  # a second arrival in the same phase: a protocol bug
        Out[ts.thread_idx.x] = 1.0

    with pytest.raises(RuntimeError, match="arrival past its count"):
        run_on_host(tmp_path, [(arrives_twice, {"Out": np.zeros(32, np.float16), "n": 32}, "Out", 1, 32)])


@pytest.mark.slow
def test_a_register_increase_beyond_the_block_is_reported(tmp_path):
    """384 threads start with 168 registers each: 96 + 2 x 208 per warpgroup needs more than
    the block has, so the consumers' setmaxnreg.inc would wait forever on the GPU."""

    @ts.kernel(target="cuda")
    def oversubscribed(Out: f16["n"]):
        ts.attrs.grid = 1
        ts.attrs.block = 384
        ts.attrs.min_blocks = 1
        if ts.thread_idx.x // 128 == 0:
            ts.setmaxnreg(96, False)
        else:
            ts.setmaxnreg(208, True)
        Out[ts.thread_idx.x] = 1.0

    with pytest.raises(RuntimeError, match="never releases"):
        run_on_host(tmp_path, [(oversubscribed, {"Out": np.zeros(384, np.float16), "n": 384}, "Out", 1, 384)])


def decode_values(c: dict, x: np.ndarray) -> dict:
    """The decode kernel's arguments for test_lowbit_prefill.random_case `c` and x [M, K]."""
    (m, k), n = x.shape, c["shape"][0]
    return {"X": x, "Wq": c["words"], "S": c["scales"], "B": c["biases"], "Y": np.full((m, n), np.nan, np.float16),
            "KT": -(-k // 256), "M": m, "K": k, "W": c["words"].size, "NS": n, "G": c["scales"].shape[1],
            "NB": c["biases"].shape[0], "GB": c["biases"].shape[1], "N": n}  # fmt: skip


@pytest.mark.parametrize("name, group, bias, m, path", [
    ("int4", 128, False, 1, "default"), ("uint3", 32, True, 5, "default"), ("e4m3", 64, False, 16, "default"),
    ("int8", None, True, 40, "default"), ("int2", 128, False, 1, "r16"), ("e2m1", 32, False, 3, "r16"),
])  # fmt: skip
@pytest.mark.slow
def test_decode_kernel_on_the_host_matches_the_reference(rng, tmp_path, name, group, bias, m, path):
    """The low-bit decode kernel (mma.sync, cp.async, dequant) without split-k (the model runs
    no clusters): the default config at M = 1, 5, 16 and 40 (the register path with folded
    offsets, the weight ring) and the span-16 register path, odd N and K, two calls with fresh
    activations, against float32 products of the fp16 weights."""
    import dataclasses

    from test_lowbit_prefill import kernel_group, random_case

    from tessera.templates.lowbit.decode import DecodeConfig, make_decode

    t = ts.dtype(name)
    n, k = (72, 520) if m < 16 else (40, 1000)
    config = DecodeConfig.default(t.nbits, m, n, k, 132) if path == "default" else DecodeConfig.register_path(t.nbits, m, n, k, 132)
    config = dataclasses.replace(config, split=1)
    c = random_case(rng, t, n, k, group, bias, config.span)
    kernel = make_decode(t, kernel_group(group, k), bias, config)
    cases, refs = [], []
    for _ in range(2):
        x = (rng.standard_normal((m, k)) * 0.5).astype(np.float16)
        cases.append((kernel, decode_values(c, x), "Y", None, None))
        refs.append(x.astype(np.float32) @ c["ref"].astype(np.float32).T)
    for got, ref in zip(run_on_host(tmp_path, cases), refs):
        assert np.abs(got - ref).max() <= 3e-3 * np.abs(ref).max(), (name, str(config))


@pytest.mark.parametrize("name, m", [("int4", 1), ("uint3", 16)])
@pytest.mark.slow
def test_decode_kernel_split_over_a_cluster_on_the_host(rng, tmp_path, name, m):
    """The decode kernel's default config as it runs in models: split-k over a cluster of 2-4
    blocks whose partial tiles are added through distributed shared memory."""
    from test_lowbit_prefill import random_case

    from tessera.templates.lowbit.decode import DecodeConfig, make_decode

    t = ts.dtype(name)
    n, k = 72, 1040
    config = DecodeConfig.default(t.nbits, m, n, k, 132)
    assert config.split > 1
    c = random_case(rng, t, n, k, 128, False, config.span)
    x = (rng.standard_normal((m, k)) * 0.5).astype(np.float16)
    (got,) = run_on_host(tmp_path, [(make_decode(t, 128, False, config), decode_values(c, x), "Y", None, None)])
    ref = x.astype(np.float32) @ c["ref"].astype(np.float32).T
    assert np.abs(got - ref).max() <= 3e-3 * np.abs(ref).max(), str(config)
