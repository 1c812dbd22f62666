"""conv2d on the CPU: an implicit GEMM on the x86 micro-kernel (tessera.templates.cpu.gemm_kernel), float32,
with the epilogue (bias, batchnorm folded into it, activation, residual) fused into the tile stores.

Rows of the GEMM are output pixels, columns output channels, K runs over (input channel,
kernel row, kernel column); the im2col matrix is never written: the micro-kernel's A operand
reads the zero-padded input through an index map, the pixel's offset plus the column's from a
constant table of K offsets.  Two row layouts:

* "rows": one GEMM batch per output row (image, y), its M the row's `ow` pixels.  A row tile's
  pixels are consecutive along x, so tile row r reads `base + r * stride_w + KOFF[k]`: one base
  register plus constant offsets (with the kernel's `full_rows`, no clamp).  Used when a row is
  at least one register tile long.
* "pixels": M = all output pixels of all images (short rows: 7x7 late-stage convs, where the
  per-row tiles would mostly be padding).  A tile may straddle output rows, so each tile row
  has its own base (kept in MR registers).

The constant weight is packed once into panels shared by every batch.  The register tile and
with it the layout are timed on the convolution itself (`tune=True`, cached per geometry).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from tessera.backend.isa import cpu_isa
from tessera.errors import ArgumentError
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.dtypes import DataType
from tessera.ir.types import GLOBAL, TensorType
from tessera.ops.geometry import window_output
from tessera.templates.cpu import gemm_kernel as cpu_gemm_template
from tessera.templates.cpu.gemm import (
    TILES,
    check_f32,
    cpu_threads,
    estimate,
    gemm_threads,
    lanes_or_refuse,
    plan_cpu_gemm,
    spill_free,
    tuning_probes,
)
from tessera.templates.cpu.gemm_kernel import CpuGemmConfig
from tessera.templates.cpu.pad_kernel import make_pad2d
from tessera.templates.epilogue import Epilogue
from tessera.templates.gemm.plan import GemmProblem, Operand, check_shape
from tessera.templates.kernel import INPUT, AnchorPlan, Launch, Slot
from tessera.templates.rewrite import i32, specialize, unravel
from tessera.tune import tuner

Geometry = tuple[tuple[int, int], tuple[int, int, int, int], tuple[int, int]]  # stride, padding, dilation


def _output_size(x_shape: Sequence[int], w_shape: Sequence[int], geo: Geometry) -> tuple[int, int]:
    """(OH, OW) of an NCHW x and OIHW weight (tessera.ops.geometry.window_output; <= 0: empty)."""
    (sh, sw), (pt, pl, pb, pr), (dh, dw) = geo
    return window_output(x_shape[2], w_shape[2], sh, pt, pb, dh), window_output(x_shape[3], w_shape[3], sw, pl, pr, dw)


def row_layout(cfg: CpuGemmConfig, ow: int) -> bool:
    """Whether a conv with `ow` output columns runs one GEMM batch per output row on this tile."""
    return ow >= cfg.mr


# Tiles of 7 rows besides the GEMM's: a 7-pixel output row (ResNet's last stage) is one tile,
# no padding rows (14-row tiles over its 49 pixels compute 56; measured 12% slower).
CONV_TILES = {16: [*TILES[16], (7, 2)], 8: [*TILES[8], (7, 1)]}


def conv_space(x_shape: Sequence[int], w_shape: Sequence[int], geo: Geometry) -> list[CpuGemmConfig]:
    n, o, k = x_shape[0], w_shape[0], int(np.prod(w_shape[1:]))
    oh, ow = _output_size(x_shape, w_shape, geo)
    lanes, threads = lanes_or_refuse(), gemm_threads(n * oh * ow, o, k, 1)
    return [CpuGemmConfig(mr, nv, lanes, threads) for mr, nv in CONV_TILES[lanes]]


def _conv_cost(cfg: CpuGemmConfig, x_shape: Sequence[int], w_shape: Sequence[int], geo: Geometry) -> float:
    n, o, k = x_shape[0], w_shape[0], int(np.prod(w_shape[1:]))
    oh, ow = _output_size(x_shape, w_shape, geo)
    if row_layout(cfg, ow):
        return estimate(cfg, ow, o, k, n * oh)
    return estimate(cfg, n * oh * ow, o, k, 1) * 1.25  # per-row bases in registers: measured slower


def tuned_conv_config(x_shape: Sequence[int], w_shape: Sequence[int], geo: Geometry, extras: bool) -> CpuGemmConfig:
    """The fastest register tile (and with it the row layout) for this convolution, timed once on
    this machine with a packed weight (and a bias when `extras`) and cached by tessera.tune.

    Candidates are timed on one thread in that thread's CPU time: the ranking of tiles is a
    property of the core, and CPU time is what other processes on a shared machine inflate
    least (wall time with a team of threads jumps by whole scheduler slices under load).  The
    winner runs with the threads the convolution's size gets.

    Every tile is a candidate: unlike a plain GEMM's, a conv's epilogue operands do not make
    the larger tiles spill in its K loop (14 x 32 with bias + residual + ReLU is the fastest on
    ResNet-18's 3x3s with AVX-512), and the timing includes a bias."""
    import inspect

    threads = conv_space(x_shape, w_shape, geo)[0].threads
    cands = [replace(c, threads=1) for c in conv_space(x_shape, w_shape, geo)]
    stride, padding, dilation = geo

    @functools.cache
    def data() -> tuple[list[np.ndarray], np.ndarray]:  # random operands and the float64 reference
        rng = np.random.default_rng(0)
        x = rng.standard_normal(tuple(x_shape)).astype(np.float32)
        w = rng.standard_normal(tuple(w_shape)).astype(np.float32)
        bias = rng.standard_normal(w_shape[0]).astype(np.float32)
        ref = reference_conv2d(x, w, bias if extras else None, geo)
        return ([x, w, bias] if extras else [x, w]), ref

    def build(cfg: CpuGemmConfig) -> Any:
        return plan_cpu_conv2d(x_shape, w_shape, stride=stride, padding=padding, dilation=dilation, bias=extras,
                               weight=data()[0][1], config=cfg).load()  # fmt: skip

    check, bench = tuning_probes(data, time.thread_time)
    key = (f"cpu_conv2d|x={tuple(x_shape)},w={tuple(w_shape)},geometry={geo}|isa={cpu_isa()}|"
           f"timed on 1 thread|{','.join(map(str, cands))}" + ("|bias" if extras else ""))  # fmt: skip
    best = tuner.tune(key, cands, build, bench, check=check, template=inspect.getsource(cpu_gemm_template), workers=cpu_threads()).best
    return replace(best, threads=threads)


def reference_conv2d(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, geo: Geometry) -> np.ndarray:
    """conv2d in float64 with numpy (NCHW, OIHW, groups 1): the tuner's check."""
    (sh, sw), (pt, pl, pb, pr), (dh, dw) = geo
    oh, ow = _output_size(x.shape, w.shape, geo)
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    kh, kw = w.shape[2:]
    out = np.zeros((x.shape[0], w.shape[0], oh, ow))
    for i in range(kh):
        for j in range(kw):
            patch = xp[:, :, i * dh: i * dh + sh * (oh - 1) + 1: sh, j * dw: j * dw + sw * (ow - 1) + 1: sw]
            out += np.einsum("nchw,oc->nohw", patch, w[:, :, i, j].astype(np.float64))
    return out if bias is None else out + bias.astype(np.float64)[:, None, None]


def plan_cpu_conv2d(x_shape: Sequence[int], w_shape: Sequence[int], dtype: DataType | str = "float32", *,
                    stride: tuple[int, int] = (1, 1), padding: tuple[int, int, int, int] = (0, 0, 0, 0),
                    dilation: tuple[int, int] = (1, 1), bias: bool = False, epilogue: Epilogue | None = None,
                    weight: np.ndarray | None = None, config: CpuGemmConfig | None = None,
                    tune: bool = False) -> AnchorPlan:  # fmt: skip
    """NCHW conv2d (groups 1) as an implicit GEMM (see the module's docstring): inputs [x, w] or
    [x, w, bias]; `weight`: w's constant data, packed once.  The register tile is `config`, else
    the tuned one (`tune`), else the cost model's.  Padding costs one copy of the input
    (tessera.templates.cpu.pad_kernel)."""
    dt = check_f32(dtype, "conv2d")
    x_shape, w_shape = check_shape(x_shape, "x", "conv2d"), check_shape(w_shape, "weight", "conv2d")
    if len(x_shape) != 4 or len(w_shape) != 4 or x_shape[1] != w_shape[1]:
        raise ArgumentError(f"conv2d: x must be NCHW and the weight OIHW with the same C, got {x_shape} and {w_shape}")
    geo: Geometry = (tuple(stride), tuple(padding), tuple(dilation))  # type: ignore[assignment]
    n, c, h, w = x_shape
    o, _, kh, kw = w_shape
    (sh, sw), (pt, pl, pb, pr), (dh, dw) = geo
    oh, ow = _output_size(x_shape, w_shape, geo)
    if oh <= 0 or ow <= 0:
        raise ArgumentError(f"conv2d: the output would be empty ({oh}x{ow}) for input {x_shape} and weight {w_shape}")
    k = c * kh * kw
    extras = bias or bool(epilogue and epilogue.extras)
    if config is None:
        if tune:
            config = tuned_conv_config(x_shape, w_shape, geo, extras)
        else:
            cands = conv_space(x_shape, w_shape, geo)
            if extras:
                cands = [cf for cf in cands if spill_free(cf)] or cands  # untimed: the cautious rule of plain GEMMs
            config = min(cands, key=lambda cf: _conv_cost(cf, x_shape, w_shape, geo))
    plan = AnchorPlan("conv2d", [], (n, o, oh, ow), dt, 3 if bias else 2, 0, target="cpu")
    x_slot: Slot = (INPUT, 0)
    hp, wp = h + pt + pb, w + pl + pr
    if pt or pl or pb or pr:
        x_slot = plan.workspace((n, c, hp, wp), dt)
        pad = specialize(make_pad2d(pt, pl, config.threads).ir, {"X": (n * c, h, w), "P": (n * c, hp, wp)})
        plan.launches.append(Launch(pad, [(INPUT, 0), x_slot]))
    # Column q of the im2col matrix (channel, kernel row, kernel column) is a fixed offset into
    # the padded input, the same for every pixel: a table of K offsets, read once per k of the
    # micro-kernel, replaces the division and remainders that decompose q (1.75x on ResNet's 3x3s).
    q = np.arange(k)
    koff = (q // (kh * kw)) * (hp * wp) + (q // kw % kh) * (dh * wp) + (q % kw) * dw
    koff_var = E.Var("KOFF", TensorType(dtypes.int32, (i32(k),), GLOBAL))
    image = i32(c * hp * wp)

    if row_layout(config, ow):
        def col(bi: E.Expr, x0: E.Expr, qi: E.Expr) -> tuple[E.Expr, ...]:
            img, y = unravel(bi, (n, oh))
            return (img * image + y * i32(sh * wp) + x0 * i32(sw) + E.Load(koff_var, (qi,)),)

        def out_map(z: E.Expr, x0: E.Expr, ch: E.Expr) -> tuple[E.Expr, ...]:
            img, y = unravel(z, (n, oh))
            return (img, ch, y, x0)

        batch, m = n * oh, ow
    else:
        def col(bi: E.Expr, row: E.Expr, qi: E.Expr) -> tuple[E.Expr, ...]:
            img, pix = unravel(row, (n, oh * ow))
            base = img * image + pix // i32(ow) * i32(sh * wp) + pix % i32(ow) * i32(sw)
            return (base + E.Load(koff_var, (qi,)),)

        def out_map(z: E.Expr, row: E.Expr, ch: E.Expr) -> tuple[E.Expr, ...]:
            img, pix = unravel(row, (n, oh * ow))
            return (img, ch, pix // i32(ow), pix % i32(ow))

        batch, m = 1, n * oh * ow
    # Columns are the output channels: the weight is B, [O, K] in OIHW's own memory ("nk"),
    # packed once when it is constant.  A is the padded input as one flat array.
    a = Operand(x_slot, (n * c * hp * wp,), col)
    b = Operand((INPUT, 1), (o, k), lambda bi, r, qi: (r, qi))
    p = GemmProblem(dt, "nk", batch, m, o, k, a, b, out_map, False)
    return plan_cpu_gemm("conv2d", p, (n, o, oh, ow), plan.num_inputs, epilogue, (INPUT, 2) if bias else None, 1,
                         weight=None if weight is None else np.asarray(weight).reshape(o, k),
                         config=config, plan=plan, tables=[(koff_var, koff)])  # fmt: skip
