"""The one source of truth for GEMM schedules: the hardware-centric space, the split-k rule and a
cost model.  Every GEMM caller (tessera.templates.gemm.config, the graph's anchors in
tessera.templates) picks a schedule through `tessera.templates.gemm.config.config_for_shape`, which
takes the tuner's winner over this space or the cost model's pick (`heuristic_config`).

The space is Hidet's: a fixed list of tiles, pipeline depths and split-k factors that suit the
GPU (multiprocessors and shared memory read from the driver, `runtime.cuda.device_properties`),
pruned only where a shape makes a candidate pointless (a 256-row tile for M = 16; split-k when
there is already a wave of tiles).  Three template families serve it:

* "tma": the warp-specialised TMA GEMM (tessera.templates.gemm.tma), SM90 only, operands with
  16-byte aligned rows read whole through tensor maps;
* "wgmma": the warpgroup GEMM without TMA (SM90, B as [N, K]); its operands may be remapped;
* "mma": mma.sync with cp.async or element loads; runs on any GPU and any alignment.

`config_for_shape(..., tune=True)` times the family's space once per shape (tessera.tune; the
winner is cached on disk); `tune=False` ranks the same space with `estimate_us`, no GPU needed.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Union

from tessera.runtime.cuda import PLANNING_DEVICE, device_properties
from tessera.target import SM90, Target
from tessera.templates.gemm.mma import GemmConfig
from tessera.templates.gemm.tma import TmaConfig
from tessera.templates.gemm.wgmma import WgmmaConfig

Config = Union[GemmConfig, WgmmaConfig, TmaConfig]
__all__ = ["PLANNING_DEVICE", "Config", "estimate_us", "heuristic_config", "schedule_space", "splits"]
FAMILIES = ("tma", "wgmma", "mma")

SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)
# mma.sync (block_m, block_n, warp_m, warp_n): 4 or 8 warps, warp tiles from 16x32 to 64x64.
MMA_TILES = [
    (256, 128, 64, 64), (128, 256, 64, 64), (128, 128, 64, 64), (128, 128, 32, 64), (128, 128, 64, 32),
    (128, 64, 64, 32), (64, 128, 32, 64), (64, 64, 32, 32), (64, 256, 32, 64), (32, 128, 32, 32),
    (32, 256, 32, 64), (16, 128, 16, 32), (16, 256, 16, 64), (16, 64, 16, 16),
]  # fmt: skip
MMA_BLOCK_KS = (32, 64)
MMA_STAGES = (3, 4, 5)
WGMMA_TILES = [(128, 256), (128, 128), (64, 256), (64, 128), (128, 64), (64, 64)]
# Warp-specialised TMA GEMM: (block_m, block_n, consumer warpgroups); the deepest two pipelines that fit.
TMA_TILES = [(128, 256, 2), (256, 128, 2), (128, 128, 2), (128, 64, 2), (64, 256, 1), (64, 128, 1), (64, 64, 1)]
TMA_STAGES = (3, 4, 5, 6, 8, 12, 16)
# Narrow tiles for M <= 64 with B as [N, K]: one wave of blocks over N without split-k.
TMA_NARROW = (32, 48, 64, 96, 112, 128, 160, 192, 224, 256)
# Wave-fitting tiles: block_n between the power-of-two tiles, tried when one of them fills the
# last wave of blocks better (llama's N=5632 at M=512: 128x256 runs 88 tiles on 132 SMs, 128x192 120).
TMA_FIT_N = (160, 192, 224)
TMA_FIT_MIN = 0.85  # a fitting tile must keep at least this share of the SMs busy ...
TMA_FIT_GAIN = 0.05  # ... and beat the standard tiles of its height by this much


def wave_efficiency(tiles: int, sms: int) -> float:
    """The share of SM slots busy over all the waves that `tiles` blocks take."""
    return tiles / (_cdiv(tiles, sms) * sms)


def wave_fitting_tiles(m: int, n: int, batch: int, b_layout: str, dev: Target) -> list[tuple[int, int, int]]:
    """(block_m, block_n, consumers) of TMA_FIT_N whose blocks fill the SMs' waves better than
    the standard tiles of the same height that bracket them (block_n 128 and 256, TMA_TILES)."""
    out = []
    for bm, cw in ((128, 2), (64, 1)):
        if bm > max(64, _m_cap(m)):
            continue
        standard = max(wave_efficiency(_cdiv(m, tm) * _cdiv(n, tn) * batch, dev.sms)
                       for tm, tn, _ in TMA_TILES if tm == bm and tn >= 128)  # fmt: skip
        for bn in TMA_FIT_N:
            if (b_layout == "kn" and bn % 64) or bn >= n:
                continue
            fit = wave_efficiency(_cdiv(m, bm) * _cdiv(n, bn) * batch, dev.sms)
            if fit >= TMA_FIT_MIN and fit >= standard + TMA_FIT_GAIN:
                out.append((bm, bn, cw))
    return out

# Cost model (per SM, µs): measured rates of each family on the H200 (bench/results/*-gemm*.md).
PEAK = {"tma": 5.6e6, "wgmma": 3.4e6, "mma": 2.5e6}  # FLOP per µs per SM
SM_BYTES = 45e3  # operand bytes per µs one SM pulls from L2 (cp.async families)
DRAM_BYTES = 3.5e6  # bytes per µs from HBM (measured copy: 4.2e6)
BLOCK_START = {"tma": 0.3, "wgmma": 1.0, "mma": 1.0}  # µs: pipeline fill and epilogue of one tile
LAUNCH = 2.5  # µs: one more kernel in the stream (split-k's reduce)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def device() -> Target:
    """The GPU the schedules are sized for (the driver's numbers; planning defaults without a GPU)."""
    return device_properties()


def family(cfg: Config) -> str:
    return "tma" if isinstance(cfg, TmaConfig) else "wgmma" if isinstance(cfg, WgmmaConfig) else "mma"


def splits(tiles: int, k_tiles: int, sms: int) -> list[int]:
    """Split-k factors worth trying: only below one wave of tiles, up to 4 waves of work items,
    each split at least 2 k-tiles deep."""
    return [s for s in SPLITS if s == 1 or (tiles < sms and tiles * s <= 4 * sms and k_tiles >= 2 * s)]


def _m_cap(m: int) -> int:
    return max(16, 1 << (max(m, 1) - 1).bit_length())  # smallest power of two >= m (>= 16)


def tma_space(m: int, n: int, k: int, batch: int = 1, b_layout: str = "nk", cluster: bool = False,
              dev: Target | None = None) -> list[TmaConfig]:  # fmt: skip
    """TMA GEMM candidates: the deepest two pipelines that fit each tile, persistent when
    there is more than one wave of tiles, split-k when there are too few tiles; for M <= 64
    and B [N, K] also the narrowest tiles that cover N in one wave; tiles of TMA_FIT_N
    columns where they fill the waves of blocks better (wave_fitting_tiles).

    `cluster` adds split-k reduced inside a thread-block cluster (split_reduce="cluster"); off by
    default: that variant has not run on a GPU yet, and the tuner must not meet an untried kernel."""
    dev = dev or device()
    out: list[TmaConfig] = []
    tiles = list(TMA_TILES)
    if m <= 64 and b_layout == "nk":
        narrow = [bn for bn in TMA_NARROW if -(-n // bn) * batch <= dev.sms]
        tiles += [(64, bn, 1) for bn in narrow[:2] if (64, bn, 1) not in tiles]
    tiles += [t for t in wave_fitting_tiles(m, n, batch, b_layout, dev) if t not in tiles]
    for bm, bn, cw in tiles:
        if (b_layout == "kn" and bn % 64) or bm > max(64, _m_cap(m)):
            continue
        fits = [s for s in TMA_STAGES if not TmaConfig(bm, bn, s, cw, epilogue="staged").problems(dev)]
        for stages in fits[-2:]:
            count = _cdiv(m, bm) * _cdiv(n, bn) * batch
            for split in splits(count, _cdiv(k, 64), dev.sms):
                cfg = TmaConfig(bm, bn, stages, cw, split, persistent=count * split > dev.sms, epilogue="staged")
                if not cfg.problems(dev):
                    out.append(cfg)
                clustered = replace(cfg, persistent=False, split_reduce="cluster")
                if cluster and split > 1 and not clustered.problems(dev):
                    out.append(clustered)
    return out


def wgmma_space(m: int, n: int, k: int, batch: int = 1, dev: Target | None = None) -> list[WgmmaConfig]:
    """Warpgroup GEMM candidates (B as [N, K])."""
    dev = dev or device()
    out = []
    for bm, bn in WGMMA_TILES:
        if bm > max(64, _m_cap(m)):
            continue
        for stages in MMA_STAGES:
            for split in splits(_cdiv(m, bm) * _cdiv(n, bn) * batch, _cdiv(k, 64), dev.sms):
                cfg = WgmmaConfig(bm, bn, stages, split)
                if not cfg.problems(dev):
                    out.append(cfg)
    return out


def mma_space(m: int, n: int, k: int, batch: int = 1, dev: Target | None = None,
              max_rows: int | None = None) -> list[GemmConfig]:  # fmt: skip
    """mma.sync candidates (tiles no taller than M, or than `max_rows`)."""
    dev = dev or device()
    out = []
    for bm, bn, wm, wn in MMA_TILES:
        if bm > (max_rows or _m_cap(m)):
            continue
        count = _cdiv(m, bm) * _cdiv(n, bn) * batch
        for bk in MMA_BLOCK_KS:
            for stages in MMA_STAGES:
                for split in splits(count, _cdiv(k, bk), dev.sms):
                    cfg = GemmConfig(bm, bn, bk, wm, wn, stages, split)
                    if not cfg.problems(dev):
                        out.append(cfg)
    return out


def schedule_space(m: int, n: int, k: int, batch: int = 1, b_layout: str = "kn", wgmma: bool = False,
                   tma: bool = False, dev: Target | None = None) -> list[Any]:  # fmt: skip
    """The candidates worth timing for one problem shape.

    With `tma` (an SM90 GPU, 16-byte aligned rows, either layout) the warp-specialised TMA
    GEMM's tiles, plus the 16-row mma.sync tiles at M <= 16, which time as well there (H200,
    2026-11-22); with `wgmma` (SM90, aligned rows, b_layout "nk") the warpgroup GEMM's tiles
    join the mma.sync ones; otherwise mma.sync alone."""
    if tma:
        out: list[Any] = list(tma_space(m, n, k, batch, b_layout, dev=dev))
        if m <= 16:
            out += [c for c in mma_space(m, n, k, batch, dev, max_rows=16) if c.block_k == 64 and c.stages in (3, 4)]
        return out
    out = list(wgmma_space(m, n, k, batch, dev)) if wgmma and b_layout == "nk" else []
    return out + mma_space(m, n, k, batch, dev)


def _resident(cfg: Config, dev: Target) -> int:
    """Blocks of this configuration one SM holds at once (shared memory, threads, registers)."""
    if isinstance(cfg, TmaConfig):
        return 1
    smem = cfg.smem_bytes()
    regs = cfg.block_n // 2 + 40 if isinstance(cfg, WgmmaConfig) else (cfg.warp_m // 16) * (cfg.warp_n // 8) * 4 + 64
    return max(1, min(dev.smem_per_block // max(smem, 1), dev.threads_per_sm // cfg.threads,
                      dev.registers_per_sm // (cfg.threads * regs), dev.blocks_per_sm))  # fmt: skip


def estimate_us(cfg: Config, m: int, n: int, k: int, batch: int = 1, dev: Target | None = None) -> float:
    """A rough time (µs) of the GEMM with this configuration, for ranking candidates: tensor-core
    time vs operand traffic for the tiles one SM runs (wave quantisation included), the DRAM floor
    of the whole problem, tile start-up and, for split-k, the reduce kernel."""
    dev = dev or device()
    fam = family(cfg)
    bk = cfg.block_k if isinstance(cfg, GemmConfig) else 64
    count = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n) * batch
    blocks = count * cfg.split_k
    depth = _cdiv(_cdiv(k, bk), cfg.split_k) * bk
    per_sm = _cdiv(blocks, dev.sms)
    together = min(per_sm, _resident(cfg, dev))
    threads = 256 if fam == "tma" else cfg.threads
    rate = PEAK[fam] * min(1.0, together * threads / 256) * (cfg.block_m / 128 if fam == "tma" and cfg.block_m < 128 else 1)
    compute = per_sm * 2 * cfg.block_m * cfg.block_n * depth / rate
    traffic = 0.0 if fam == "tma" else per_sm * (cfg.block_m + cfg.block_n) * depth * 2 / SM_BYTES
    split_reduce = cfg.split_k > 1 and not getattr(cfg, "cluster", False)
    out_bytes = m * n * batch * (4 * cfg.split_k if split_reduce else 2)
    floor = ((m + n) * k * batch * 2 + out_bytes) / DRAM_BYTES
    t = max(compute, traffic, floor) + _cdiv(per_sm, together) * BLOCK_START[fam]
    if split_reduce:
        t += LAUNCH + m * n * batch * (4 * cfg.split_k + 2) / DRAM_BYTES
    return t


def families(layout: str, vector: bool, dev: Target | None = None, *, tma: bool = True,
             wgmma: bool = True) -> tuple[str, ...]:  # fmt: skip
    """The template families that can run a GEMM: TMA and wgmma need SM90 and 16-byte aligned
    rows (wgmma also B as [N, K]); mma.sync runs everything."""
    dev = dev or device()
    sm90 = dev.capability == SM90.capability and vector
    out = []
    if tma and sm90:
        out.append("tma")
    if wgmma and sm90 and layout == "nk":
        out.append("wgmma")
    return (*out, "mma")


def heuristic_config(m: int, n: int, k: int, batch: int = 1, family: str = "mma", layout: str = "nk",
                     dev: Target | None = None) -> Config:  # fmt: skip
    """The candidate of `family`'s space with the lowest estimated time (no compilation, no timing).

    A later candidate wins only by a clear margin (2%): ties keep the earlier, larger tile."""
    dev = dev or device()
    if family == "tma":
        space: list[Any] = schedule_space(m, n, k, batch, layout, tma=True, dev=dev)
    elif family == "wgmma":
        space = wgmma_space(m, n, k, batch, dev)
    else:
        space = mma_space(m, n, k, batch, dev)
    best: Config | None = None
    best_t = float("inf")
    for cfg in space:
        t = estimate_us(cfg, m, n, k, batch, dev)
        if t < best_t * 0.98:
            best, best_t = cfg, t
    if best is None:
        raise AssertionError(f"no {family} configuration fits M={m} N={n} K={k}")  # the 16x64 mma tile always fits
    return best


