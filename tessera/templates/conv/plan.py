"""conv2d anchor (NCHW input, OIHW weight): im2col into a workspace, then the GEMM template with the
output written straight into NCHW by the store index map, epilogue fused.

Two forms:

* 1x1, stride 1, no padding, 16-byte aligned rows (C and H*W multiples of 8): no copy at all.
  Per image, out[o, p] = W[o, :] @ x[:, p] is a "kn" GEMM whose B operand is x itself and whose
  A operand is the weight, broadcast over the batch by the operand's index map; the [O, H*W]
  result of image n is exactly out[n] in NCHW.
* everything else: an im2col kernel (a tessera.ops compute definition, one thread per element)
  writes col[N*OH*OW, Kp] with K = C*KH*KW padded to Kp, a multiple of 8, so the rows suit
  16-byte copies; out[pixel, o] = col @ W.T is an "nk" GEMM (the wgmma template's layout) whose
  stores unravel the pixel into (n, oh, ow).  When K is not a multiple of 8 (the RGB stem), a
  second kernel copies the weight into a zero-padded [O, Kp] workspace.

With layout "NHWC" (x [N, H, W, C], weight OHWI [O, kh, kw, C], out [N, OH, OW, O]: what the
GPU layout pass gives convolutions) every form is one plain row-major GEMM over all pixels,
so it runs on the TMA GEMM: out[pixel, o] = x[pixel, :] @ W[o, :] for a 1x1 stride-1 conv
(no copy); every other conv with C a multiple of 8 is an implicit GEMM: the TMA GEMM's producer
reads the rows of col[pixel, (u, v, c)] straight from x through an im2col tensor map (TMA's
im2col mode: one load per tap and 64-channel block, the hardware walks the output pixels and
zero-fills the padding), and OHWI is already [O, kh*kw*C] in memory.  Where that cannot run
(C not a multiple of 8, e.g. the RGB stem; a GPU without TMA; TESSERA_IMPLICIT_CONV=0) col is
materialised: each im2col row is the kh*kw taps' C channels, dense, written with 16-byte stores
(tessera.templates.conv.im2col).
"""

from __future__ import annotations

from collections.abc import Sequence

from tessera import settings
from tessera.errors import ArgumentError, UnsupportedError
from tessera.ir import expr as E
from tessera.ir.compute import Placeholder, compute
from tessera.ir.dtypes import DataType
from tessera.ops.geometry import pads, pair, window_output
from tessera.templates.conv.im2col import col_width, make_im2col_nhwc
from tessera.templates.epilogue import Epilogue
from tessera.templates.gemm.plan import (
    GemmProblem,
    Operand,
    check_dtype,
    check_shape,
    choose_config,
    conv_window,
    plan_gemm,
)
from tessera.templates.gemm.space import Config
from tessera.templates.gemm.tma import ConvWindow, TmaConfig
from tessera.templates.kernel import INPUT, WORKSPACE, AnchorKernel, AnchorPlan, Launch, Slot, ops_launches
from tessera.templates.rewrite import i32, rename, specialize, unravel


def _nchw(pixel: list[E.Expr], channel: E.Expr) -> tuple[E.Expr, ...]:
    return (pixel[0], channel, pixel[1], pixel[2])


def _im2col_launches(plan: AnchorPlan, x_shape: tuple[int, ...], w_shape: tuple[int, ...], dt: DataType,
                     geo: dict[str, int], kp: int) -> tuple[Slot, Slot]:  # fmt: skip
    """Add the im2col (and weight padding) launches; return the col and weight operands' slots."""
    n, c, h, w = x_shape
    o, _, kh, kw = w_shape
    oh, ow, k = geo["oh"], geo["ow"], c * kh * kw
    sh, sw, pt, pl, dh, dw = geo["sh"], geo["sw"], geo["pt"], geo["pl"], geo["dh"], geo["dw"]
    x = Placeholder("x", x_shape, dt)
    wt = Placeholder("w", w_shape, dt)
    zero = E.Const(0, dt)

    def col_value(p: E.Expr, q: E.Expr) -> E.Expr:
        img, rem = p // i32(oh * ow), p % i32(oh * ow)
        y, xx = rem // i32(ow), rem % i32(ow)
        ci, u, v = q // i32(kh * kw), (q // i32(kw)) % i32(kh), q % i32(kw)
        hi, wi = y * i32(sh) + u * i32(dh) - i32(pt), xx * i32(sw) + v * i32(dw) - i32(pl)
        conds = [hi >= i32(0), hi < i32(h), wi >= i32(0), wi < i32(w)] + ([q < i32(k)] if kp != k else [])
        inside = conds[0]
        for cnd in conds[1:]:
            inside = E.Binary("&&", inside, cnd)
        return E.Select(inside, x[img, ci, hi, wi], zero)  # short-circuit: no read outside x

    col = compute((n * oh * ow, kp), col_value, "im2col", dt)
    outputs, inputs, slots = [col], [x], {x: (INPUT, 0)}
    col_slot = plan.workspace((n * oh * ow, kp), dt)
    slots[col] = col_slot
    w_slot: Slot = (INPUT, 1)
    if kp != k:
        wpad = compute((o, kp), lambda r, q: E.Select(q < i32(k), wt[r, q // i32(kh * kw), (q // i32(kw)) % i32(kh), q % i32(kw)], zero),
                       "weight_pad", dt)  # fmt: skip
        outputs.append(wpad)
        inputs.append(wt)
        slots[wt] = (INPUT, 1)
        w_slot = plan.workspace((o, kp), dt)
        slots[wpad] = w_slot
    ops_launches(plan, outputs, inputs, slots, "conv2d")
    return col_slot, w_slot


def conv_geometry(x_hw: tuple[int, int], k_hw: tuple[int, int], stride, padding, dilation) -> dict[str, int]:
    """Output size, stride, padding (top, left, bottom, right) and dilation of a static conv2d
    (tessera.ops.geometry reads them)."""
    (sh, sw), (dh, dw) = pair(stride, "stride", "conv2d"), pair(dilation, "dilation", "conv2d")
    if min(sh, sw, dh, dw) < 1:
        raise ArgumentError(f"conv2d: stride and dilation must be >= 1, got {stride!r} and {dilation!r}")
    pt, pl, pb, pr = pads(padding, "conv2d")
    (h, w), (kh, kw) = x_hw, k_hw
    oh = window_output(h, kh, sh, pt, pb, dh)
    ow = window_output(w, kw, sw, pl, pr, dw)
    if oh <= 0 or ow <= 0:
        raise ArgumentError(f"conv2d: the output would be empty ({oh}x{ow}) for an input of {h}x{w} and a {kh}x{kw} kernel")
    return dict(oh=oh, ow=ow, sh=sh, sw=sw, pt=pt, pl=pl, pb=pb, pr=pr, dh=dh, dw=dw)


def pointwise(k_hw: Sequence[int], geo: dict[str, int]) -> bool:
    """A 1x1, stride-1, unpadded conv: a GEMM over x itself."""
    return tuple(k_hw) == (1, 1) and geo["sh"] == geo["sw"] == 1 and not any(geo[p] for p in ("pt", "pl", "pb", "pr"))


def _nhwc_im2col(plan: AnchorPlan, x_shape: tuple[int, ...], w_shape: tuple[int, ...], dt: DataType,
                 geo: dict[str, int]) -> tuple[Slot, Slot, int]:  # fmt: skip
    """col[N*OH*OW, Kp] (tessera.templates.conv.im2col: dense (tap, channel) columns, Kp = K rounded up
    to a multiple of 8) and the weight as [O, Kp] in the same column order (OHWI itself when
    Kp == K, else a zero-padded copy); return both slots and Kp."""
    n, h, w, c = x_shape
    o, kh, kw, _ = w_shape
    oh, ow = geo["oh"], geo["ow"]
    k, kp = kh * kw * c, col_width(c, kh * kw)
    col_slot = plan.workspace((n * oh * ow, kp), dt)
    f = make_im2col_nhwc(dt, c, (kh, kw), (geo["sh"], geo["sw"]), (geo["dh"], geo["dw"]), (geo["pt"], geo["pl"]),
                         (oh, ow)).ir  # fmt: skip
    f = rename(specialize(f, {"X": x_shape, "Col": (n * oh * ow, kp)}), "conv2d_im2col")
    plan.launches.append(Launch(f, [(INPUT, 0), col_slot]))
    if c % 8 == 0:  # read with vector copies
        plan.aligned_inputs += [] if 0 in plan.aligned_inputs else [0]
    if kp == k:
        return col_slot, (INPUT, 1), kp
    wt = Placeholder("w", w_shape, dt)

    def padded(r: E.Expr, q: E.Expr) -> E.Expr:
        return E.Select(q < i32(k), wt[r, q // i32(kw * c), (q // i32(c)) % i32(kw), q % i32(c)], E.Const(0, dt))

    wpad = compute((o, kp), padded, "weight_pad", dt)
    w_slot = plan.workspace((o, kp), dt)
    ops_launches(plan, [wpad], [wt], {wt: (INPUT, 1), wpad: w_slot}, "conv2d")
    return col_slot, w_slot, kp


def _implicit_problem(x_shape: tuple[int, ...], w_shape: tuple[int, ...], dt: DataType, geo: dict[str, int]
                      ) -> GemmProblem | None:  # fmt: skip
    """The implicit-GEMM form of an NHWC conv (the TMA GEMM reads x through an im2col map: no col
    buffer), or None where it does not apply (channels not a multiple of 8; a window TMA cannot
    encode; TESSERA_IMPLICIT_CONV=0)."""
    n, h, w, c = x_shape
    o, kh, kw, _ = w_shape
    window = ConvWindow(c, (kh, kw), (geo["oh"], geo["ow"]), (geo["sh"], geo["sw"]), (geo["pt"], geo["pl"]),
                        (geo["dh"], geo["dw"]))  # fmt: skip
    if window.problems() or conv_window(window, x_shape).problems(2) or not settings.implicit_conv():
        return None
    pixels = (n, geo["oh"], geo["ow"])
    a = Operand((INPUT, 0), x_shape, lambda bi, r, q: (*unravel(r, pixels), q), plain=True)  # (TMA reads it)
    b = Operand((INPUT, 1), w_shape, lambda bi, r, q: (r, q // i32(kw * c), (q // i32(c)) % i32(kw), q % i32(c)),
                plain=True)  # fmt: skip
    return GemmProblem(dt, "nk", 1, n * geo["oh"] * geo["ow"], o, kh * kw * c, a, b,
                       lambda z, r, col: (*unravel(r, pixels), col), True, row_major_out=True, conv=window)  # fmt: skip


def _nhwc_problem(plan: AnchorPlan, x_shape: tuple[int, ...], w_shape: tuple[int, ...], dt: DataType,
                  geo: dict[str, int]) -> GemmProblem:  # fmt: skip
    n, _, _, c = x_shape
    o, kh, kw, _ = w_shape
    oh, ow = geo["oh"], geo["ow"]
    pixels = (n, oh, ow)
    if pointwise((kh, kw), geo) and c % 8 == 0:  # x itself is the [pixels, C] operand
        a = Operand((INPUT, 0), x_shape, lambda bi, r, q: (*unravel(r, pixels), q), plain=True)
        b = Operand((INPUT, 1), w_shape, lambda bi, r, q: (r, i32(0), i32(0), q), plain=True)
        kp = c
    else:
        col_slot, w_slot, kp = _nhwc_im2col(plan, x_shape, w_shape, dt, geo)
        a = Operand(col_slot, (n * oh * ow, kp), lambda bi, r, q: (r, q), plain=True)
        if w_slot[0] == WORKSPACE:
            b = Operand(w_slot, (o, kp), lambda bi, r, q: (r, q), plain=True)
        else:
            b = Operand(w_slot, w_shape, lambda bi, r, q: (r, q // i32(kw * c), (q // i32(c)) % i32(kw), q % i32(c)),
                        plain=True)  # fmt: skip
    return GemmProblem(dt, "nk", 1, n * oh * ow, o, kp, a, b, lambda z, r, col: (*unravel(r, pixels), col), True,
                       row_major_out=True)  # fmt: skip


def plan_conv2d(x_shape: Sequence[int], w_shape: Sequence[int], dtype: DataType | str, *, stride: int | Sequence[int] = 1,
                padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, groups: int = 1, bias: bool = False,
                epilogue: Epilogue | None = None, tune: bool = False, wgmma: bool | None = None,
                config: Config | None = None, layout: str = "NCHW") -> AnchorPlan:  # fmt: skip
    """The uncompiled plan of prepare_conv2d."""
    dt = check_dtype(dtype, "conv2d")
    x_shape, w_shape = check_shape(x_shape, "x", "conv2d"), check_shape(w_shape, "weight", "conv2d")
    if layout not in ("NCHW", "NHWC"):
        raise ArgumentError(f"conv2d: layout must be 'NCHW' or 'NHWC', got {layout!r}")
    nhwc = layout == "NHWC"
    if len(x_shape) != 4 or len(w_shape) != 4:
        what = "x must be NHWC and the weight OHWI" if nhwc else "x must be NCHW and the weight OIHW"
        raise ArgumentError(f"conv2d: {what} (4-D), got {x_shape} and {w_shape}")
    if groups != 1:
        raise UnsupportedError(f"conv2d: the GEMM template handles groups=1 only, got groups={groups}")
    if nhwc:
        if w_shape[3] != x_shape[3]:
            raise ArgumentError(f"conv2d: x (NHWC) has {x_shape[3]} channels but the weight {w_shape} (OHWI) expects "
                                f"{w_shape[3]}")  # fmt: skip
        geo = conv_geometry(x_shape[1:3], w_shape[1:3], stride, padding, dilation)
        out_shape = (x_shape[0], geo["oh"], geo["ow"], w_shape[0])
        plan = AnchorPlan("conv2d", [], out_shape, dt, 3 if bias else 2, 0)
        bias_slot = (INPUT, 2) if bias else None
        implicit = None if pointwise(w_shape[1:3], geo) else _implicit_problem(x_shape, w_shape, dt, geo)
        if implicit is not None:
            cfg = config or choose_config(implicit, tune, wgmma)
            if isinstance(cfg, TmaConfig):  # else (no SM90 TMA, a tiny problem's mma tile) the col buffer
                return plan_gemm("conv2d", implicit, out_shape, plan.num_inputs, epilogue, bias_slot, 3, tune, wgmma,
                                 cfg, plan)  # fmt: skip
        p = _nhwc_problem(plan, x_shape, w_shape, dt, geo)
        return plan_gemm("conv2d", p, out_shape, plan.num_inputs, epilogue, bias_slot, 3, tune, wgmma, config, plan)
    n, c, h, w = x_shape
    o, cw, kh, kw = w_shape
    if cw != c:
        raise ArgumentError(f"conv2d: x has {c} channels but the weight {w_shape} expects {cw}")
    geo = conv_geometry((h, w), (kh, kw), stride, padding, dilation)
    oh, ow = geo["oh"], geo["ow"]
    out_shape = (n, o, oh, ow)
    plan = AnchorPlan("conv2d", [], out_shape, dt, 3 if bias else 2, 0)
    bias_slot = (INPUT, 2) if bias else None
    if pointwise((kh, kw), geo) and c % 8 == 0 and (h * w) % 8 == 0:
        p = GemmProblem(dt, "kn", n, o, h * w, c,
                        Operand((INPUT, 1), w_shape, lambda bi, r, q: (r, q, i32(0), i32(0))),
                        Operand((INPUT, 0), x_shape, lambda bi, q, col: (bi, q, col // i32(w), col % i32(w))),
                        lambda z, r, col: (z, r, col // i32(ow), col % i32(ow)), True)  # fmt: skip
    else:
        k = c * kh * kw
        kp = -(-k // 8) * 8
        col_slot, w_slot = _im2col_launches(plan, x_shape, w_shape, dt, geo, kp)
        if w_slot[0] == WORKSPACE:
            b = Operand(w_slot, (o, kp), lambda bi, r, q: (r, q))
        else:  # OIHW is [O, K] in memory
            b = Operand(w_slot, w_shape, lambda bi, r, q: (r, q // i32(kh * kw), (q // i32(kw)) % i32(kh), q % i32(kw)))
        p = GemmProblem(dt, "nk", 1, n * oh * ow, o, kp, Operand(col_slot, (n * oh * ow, kp), lambda bi, r, q: (r, q)), b,
                        lambda z, r, col: _nchw(unravel(r, (n, oh, ow)), col), True)  # fmt: skip
    return plan_gemm("conv2d", p, out_shape, plan.num_inputs, epilogue, bias_slot, 1, tune, wgmma, config, plan)


def prepare_conv2d(x_shape: Sequence[int], w_shape: Sequence[int], dtype: DataType | str, *, stride: int | Sequence[int] = 1,
                   padding: int | Sequence[int] = 0, dilation: int | Sequence[int] = 1, groups: int = 1, bias: bool = False,
                   epilogue: Epilogue | None = None, tune: bool = False, layout: str = "NCHW") -> AnchorKernel:  # fmt: skip
    """2-D convolution (cross-correlation, zero padding) on tensor cores.

    layout "NCHW": x [N, C, H, W], weight OIHW, output [N, O, OH, OW]; layout "NHWC": x
    [N, H, W, C], weight OHWI [O, kh, kw, C], output [N, OH, OW, O] (one GEMM over all pixels).
    `padding` is (top, left, bottom, right) (an int or a (h, w) pair also work).  Inputs at
    call time: ``[x, w]`` or ``[x, w, bias]`` (bias [O], added to the float32 accumulator).
    groups > 1 raises UnsupportedError.
    """
    return plan_conv2d(x_shape, w_shape, dtype, stride=stride, padding=padding, dilation=dilation, groups=groups,
                       bias=bias, epilogue=epilogue, tune=tune, layout=layout).load()  # fmt: skip
