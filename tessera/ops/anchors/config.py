"""Choosing a GEMM schedule for an anchor: a cheap cost model (no timing) or the tuner.

`heuristic_config` scores a short list of tile shapes with a roofline-style estimate per SM:
tensor-core time vs operand traffic for the blocks one SM runs (wave quantisation included),
the DRAM floor of the whole problem, block start-up latency and, for split-k, the extra
reduce kernel.  It needs no GPU, so a plan can be made (and its source compiled) anywhere.
`tuned_config` defers to tessera.kernels.matmul's tuner (compile all candidates, check each
once against torch.matmul, time the correct ones with L2 flushed, cache the winner), timing
the plain GEMM as a proxy for the fused one.
"""

from __future__ import annotations

from typing import Any, Union

from tessera.ir.dtypes import DataType
from tessera.kernels.gemm import GemmConfig
from tessera.kernels.gemm_sm90 import WgmmaConfig

Config = Union[GemmConfig, WgmmaConfig]

SMS = 132  # H100/H200
PEAK_MMA = 2.5e6  # FLOP per µs per SM reached by the mma.sync template (measured ~330 TFLOP/s)
PEAK_WGMMA = 3.4e6  # ... and by the wgmma template (~450 TFLOP/s)
SM_BYTES = 45e3  # operand bytes per µs one SM pulls from L2
DRAM_BYTES = 3.5e6  # bytes per µs from HBM (measured copy: 4.2e6)
BLOCK_START = 1.0  # µs: pipeline fill and epilogue of one block
LAUNCH = 2.5  # µs: one more kernel in the stream
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)
# (block_m, block_n, warp_m, warp_n), largest first: on a tie the larger tile wins.
MMA_TILES = [(128, 128, 64, 64), (128, 64, 64, 32), (64, 128, 32, 64), (64, 64, 32, 32), (32, 128, 32, 32),
             (16, 128, 16, 32), (16, 64, 16, 16)]  # fmt: skip
# No 128x256: the model favours it for its lower operand traffic, but on the H200 128x128 ran
# 1.4x faster at M=2048 (bench/results/2026-11-22-h200-anchors.md); the tuner still tries it.
WGMMA_TILES = [(128, 128), (128, 64), (64, 128), (64, 64)]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _resident(cfg: Config) -> int:
    """Blocks of this configuration one SM holds at once (shared memory, threads, registers)."""
    smem = cfg.smem_bytes()
    if isinstance(cfg, WgmmaConfig):
        regs = cfg.block_n // 2 + 40
    else:
        regs = (cfg.warp_m // 16) * (cfg.warp_n // 8) * 4 + 64
    return max(1, min(227 * 1024 // max(smem, 1), 2048 // cfg.threads, 65536 // (cfg.threads * regs), 32))


def estimate_us(cfg: Config, m: int, n: int, k: int, batch: int = 1) -> float:
    """A rough time (µs) of the GEMM with this configuration, for ranking candidates."""
    wgmma = isinstance(cfg, WgmmaConfig)
    bk = 64 if wgmma else cfg.block_k
    tiles = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n) * batch
    blocks = tiles * cfg.split_k
    depth = _cdiv(_cdiv(k, bk), cfg.split_k) * bk
    per_sm = _cdiv(blocks, SMS)
    together = min(per_sm, _resident(cfg))
    rate = (PEAK_WGMMA if wgmma else PEAK_MMA) * min(1.0, together * cfg.threads / 256)
    compute = per_sm * 2 * cfg.block_m * cfg.block_n * depth / rate
    traffic = per_sm * (cfg.block_m + cfg.block_n) * depth * 2 / SM_BYTES
    out_bytes = m * n * batch * (2 if cfg.split_k == 1 else 4 * cfg.split_k)
    floor = ((m + n) * k * batch * 2 + out_bytes) / DRAM_BYTES
    t = max(compute, traffic, floor) + _cdiv(per_sm, together) * BLOCK_START
    if cfg.split_k > 1:
        t += LAUNCH + m * n * batch * (4 * cfg.split_k + 2) / DRAM_BYTES
    return t


def candidates(m: int, n: int, k: int, batch: int, wgmma: bool) -> list[Config]:
    """The short list the heuristic ranks (every entry buildable)."""
    out: list[Config] = []
    m_cap = max(16, 1 << (max(m, 1) - 1).bit_length())
    if wgmma:
        for bm, bn in WGMMA_TILES:
            if bm > max(64, m_cap):
                continue
            tiles = _cdiv(m, bm) * _cdiv(n, bn) * batch
            for split in _splits(tiles, _cdiv(k, 64)):
                cfg = WgmmaConfig(bm, bn, 4 if bn == 256 else 3, split)
                if not cfg.problems():
                    out.append(cfg)
    for bm, bn, wm, wn in MMA_TILES:
        if bm > m_cap:
            continue
        big = bm * bn >= 128 * 128
        tiles = _cdiv(m, bm) * _cdiv(n, bn) * batch
        for bk in (32, 64) if big or k <= 32 else (64, 32):  # the other depth when a tile's copies do not split
            k_tiles = _cdiv(k, bk)
            stages = 4 if big or k_tiles >= 8 else 3
            fits = [c for c in (GemmConfig(bm, bn, bk, wm, wn, stages, s) for s in _splits(tiles, k_tiles)) if not c.problems()]
            if fits:
                out += fits
                break
    return out


def _splits(tiles: int, k_tiles: int) -> list[int]:
    return [s for s in SPLITS if s == 1 or (tiles < SMS and tiles * s <= 2 * SMS and k_tiles >= 2 * s)]


def heuristic_config(m: int, n: int, k: int, batch: int = 1, wgmma: bool = False) -> Config:
    """The candidate with the lowest estimated time (no compilation, no timing)."""
    best: Config | None = None
    best_t = float("inf")
    for cfg in candidates(m, n, k, batch, wgmma):
        t = estimate_us(cfg, m, n, k, batch)
        if t < best_t * 0.98:  # a clear win only: otherwise keep the earlier (larger) tile
            best, best_t = cfg, t
    assert best is not None, "the 16x64 tile always fits"
    return best


def tuned_config(dtype: DataType, layout: str, batch: int, m: int, n: int, k: int, vector: bool) -> Config:
    """The tuner's winner for this GEMM shape (compiles and times every candidate on first use;
    the record is shared with tessera.kernels.matmul.matmul)."""
    import torch

    from tessera.kernels import matmul as mm

    tdt = getattr(torch, dtype.name)
    a = torch.randn((batch, m, k), dtype=tdt, device="cuda")
    b = torch.randn((batch, k, n) if layout == "kn" else (batch, n, k), dtype=tdt, device="cuda")
    cfg: Any = mm._tuned(a, b, layout, dtype, batch, m, n, k, vector)
    return cfg
