"""matmul and linear anchors: the tensor-core GEMM template with the epilogue folded into its stores.

The template computes C[z, m, n] over [batch, M, K] x [batch, K, N] ("kn") or [batch, N, K]
("nk") operands.  A `GemmProblem` describes one call site at that level: where each operand
comes from, with an index map from the template's (batch, row, column) to the operand's own
shape (broadcast batch dimensions, batch dimensions folded into M, NCHW pixels), and the
map from (z, m, n) to the anchor's logical output index.  The template's IR is then
specialised to the shapes, its operands remapped and its stores replaced by the epilogue
(tessera.templates.rewrite and .epilogue), so one kernel reads the caller's tensors in
place and writes the caller's output; with split-k, the epilogue goes into the reduce kernel.

On SM90, a problem whose operands are plain row-major [batch, rows, K-or-N] tensors (a linear
layer, a matmul without broadcast batches, an im2col buffer) and whose output is the template's
row-major layout runs on the warp-specialised TMA GEMM (tessera.templates.gemm.tma): the
operands are read through tensor maps encoded at call time, and the epilogue is fused into its
staged stores (each 16-byte row segment goes through the epilogue in registers and is written
back with one vector store).  There the epilogue sees the accumulator rounded to the GEMM's
dtype (the staging buffer's type), also for a bias.  Other problems use the mma.sync/wgmma
templates, whose operands can be remapped.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

import numpy as np

from tessera.errors import ArgumentError, TesseraError, UnsupportedError
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.compute import Placeholder, compute
from tessera.ir.dtypes import DataType
from tessera.runtime.tensor_map import Im2colWindow
from tessera.templates.epilogue import Epilogue, EpilogueError, compose, fuse_epilogue, identity_epilogue
from tessera.templates.gemm import space as gemm_space
from tessera.templates.gemm.config import config_for_shape, make_kernel
from tessera.templates.gemm.mma import make_split_k_reduce
from tessera.templates.gemm.space import Config
from tessera.templates.gemm.tma import BLOCK_K, ConvWindow, TmaConfig, make_gemm_tma, tensor_map_boxes
from tessera.templates.kernel import EXTRA, INPUT, OUTPUT, AnchorKernel, AnchorPlan, Launch, MapSpec, Slot
from tessera.templates.rewrite import IndexMap, i32, remap_operand, rename, retype_operand, specialize, unravel

ANCHOR_DTYPES = (dtypes.float16, dtypes.bfloat16)


@dataclass
class Operand:
    """Where a GEMM operand comes from and how the template's index reaches it."""

    slot: Slot
    shape: tuple[int, ...]
    index: IndexMap  # (bi, row, col) -> index into `shape`
    plain: bool = False  # `shape` in row-major order IS the template's operand: TMA can read it whole


@dataclass
class GemmProblem:
    dtype: DataType
    layout: str  # "kn" or "nk": B as [batch, K, N] or [batch, N, K]
    batch: int
    m: int
    n: int
    k: int
    a: Operand
    b: Operand
    out_map: IndexMap  # (z, m, n) -> logical output index
    vector: bool  # 16-byte cp.async loads (rows of A and B 16-byte aligned)
    row_major_out: bool = False  # the output's row-major layout is the template's [batch, M, N]
    conv: ConvWindow | None = None  # A is an NHWC image read through an im2col map (TMA only)

    @property
    def tma(self) -> bool:
        """Whether the TMA GEMM can run this problem: operands read whole through tensor maps."""
        return self.vector and self.a.plain and self.b.plain and self.row_major_out

    @property
    def a_shape(self) -> tuple[int, ...]:
        """A as the template reads it: [batch, M, K], or the image of an implicit convolution."""
        return self.a.shape if self.conv else (self.batch, self.m, self.k)


def check_dtype(dtype: DataType | str, op: str) -> DataType:
    dt = dtypes.dtype(dtype)
    if dt not in ANCHOR_DTYPES:
        raise UnsupportedError(f"{op}: the tensor-core templates take float16 or bfloat16, not {dt}; "
                               "use the generic path for other dtypes")  # fmt: skip
    return dt


def check_shape(shape: Sequence[int], what: str, op: str) -> tuple[int, ...]:
    try:
        out = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise ArgumentError(f"{op}: {what} shape must be a sequence of ints, got {shape!r}") from None
    if any(d <= 0 for d in out) or any(isinstance(d, bool) for d in shape):
        raise ArgumentError(f"{op}: {what} shape {out} must have positive sizes")
    return out


def choose_config(p: GemmProblem, tune: bool, wgmma: bool | None = None) -> Config:
    """config.config_for_shape for this problem.  `wgmma` False keeps the Hopper templates (TMA,
    warpgroup) out; None lets the GPU decide (the planning defaults without one)."""
    hopper = wgmma is not False
    return config_for_shape(p.dtype, p.layout, p.batch, p.m, p.n, p.k, p.vector, tune=tune,
                            tma=hopper and p.tma, wgmma=hopper)  # fmt: skip


def _template(p: GemmProblem, cfg: Config):  # -> tessera.Kernel
    if p.conv is not None:
        if not isinstance(cfg, TmaConfig):
            raise UnsupportedError(f"an implicit-GEMM convolution runs on the TMA GEMM only, not {cfg}")
        return make_gemm_tma(p.dtype, cfg, p.layout, p.conv)
    return make_kernel(p.dtype, cfg, p.layout, p.vector)


def _tma_operands(plan: AnchorPlan, f, p: GemmProblem, cfg: TmaConfig):  # -> (Function, slots of tma_a, tma_b)
    """The TMA template reads A and B through tensor maps: the parameters take the caller's
    tensors as they are, and the maps (encoded at call time) describe them as [batch, rows, cols]."""
    b_shape = (p.batch, p.k, p.n) if p.layout == "kn" else (p.batch, p.n, p.k)
    boxes = tensor_map_boxes(cfg, p.layout)
    slots = []
    for name, op, shape, box in (("A", p.a, (p.batch, p.m, p.k), boxes[0]), ("B", p.b, b_shape, boxes[1])):
        f = retype_operand(f, name, op.shape)
        if name == "A" and p.conv is not None:
            spec = MapSpec(op.slot, p.dtype, op.shape, (cfg.block_m, BLOCK_K), conv_window(p.conv, op.shape))
        else:
            spec = MapSpec(op.slot, p.dtype, shape, box)
        slots.append(plan.tensor_map(spec))
    return f, slots


def conv_window(conv: ConvWindow, x_shape: tuple[int, ...]) -> Im2colWindow:
    """The im2col map's window over the NHWC image `x_shape`: the output pixels' filter origins."""
    return Im2colWindow.convolution(x_shape[1:3], conv.stride, conv.pad, conv.out_hw)


def gemm_launches(plan: AnchorPlan, p: GemmProblem, cfg: Config, ep: Epilogue, ep_slots: list[Slot], prefix: str,
                  out_slot: Slot = (OUTPUT, 0)) -> list[Launch]:  # fmt: skip
    """The GEMM's launches with `ep` fused into its final stores into `out_slot` (workspaces and
    tensor maps added to `plan`)."""
    f = _template(p, cfg).ir
    split = cfg.split_k
    b_shape = (p.batch, p.k, p.n) if p.layout == "kn" else (p.batch, p.n, p.k)
    tma = isinstance(cfg, TmaConfig)
    scalars = {"split": split}
    if tma:
        if not p.tma:
            raise UnsupportedError(f"{cfg} reads its operands through tensor maps; this problem's operands are not "
                                   "plain row-major tensors")  # fmt: skip
        scalars["ctas"] = cfg.grid(p.m, p.n, p.batch, gemm_space.device().sms)
    f = specialize(f, {"A": p.a_shape, "B": b_shape, "C": (p.batch * split, p.m, p.n)}, scalars)
    extra_slots: list[Slot] = []
    if tma:
        f, extra_slots = _tma_operands(plan, f, p, cfg)
    else:
        for name, op in (("A", p.a), ("B", p.b)):
            f = remap_operand(f, name, op.shape, op.index)
    label = str(cfg).replace("-", "_")
    if split == 1:
        f = rename(fuse_epilogue(f, "C", p.out_map, ep, row_major=p.row_major_out), f"{prefix}_gemm_{label}")
        plan.aligned_output = plan.aligned_output or (p.row_major_out and out_slot == (OUTPUT, 0))
        return [Launch(f, [p.a.slot, p.b.slot, out_slot, *extra_slots, *ep_slots])]
    ws = plan.workspace((p.batch * split, p.m, p.n), dtypes.float32)
    f = rename(f, f"{prefix}_gemm_{label}")
    red = make_split_k_reduce(p.dtype, split).ir
    red = specialize(red, {"W": (p.batch * split, p.m, p.n), "C": (p.batch, p.m, p.n)})
    red = rename(fuse_epilogue(red, "C", p.out_map, ep), f"{prefix}_split_k_reduce_{split}")
    return [Launch(f, [p.a.slot, p.b.slot, ws, *extra_slots]), Launch(red, [ws, out_slot, *ep_slots])]


def with_bias(ep: Epilogue | None, out_shape: tuple[int, ...], dtype: DataType, channel_axis: int) -> Epilogue:
    """The anchor's bias (added to the float32 accumulator, then rounded to `dtype`) followed by `ep`."""
    acc = Placeholder("acc", out_shape, dtypes.float32)
    bias = Placeholder("bias", (out_shape[channel_axis],), dtype)
    biased = compute(out_shape, lambda *i: acc[i] + E.Cast(bias[(i[channel_axis],)], dtypes.float32), "bias_add", dtype)
    inner = Epilogue(acc, biased, [bias])
    return inner if ep is None else compose(inner, ep)


def check_epilogue(ep: Epilogue | None, out_shape: tuple[int, ...], op: str) -> None:
    if ep is None:
        return
    if not isinstance(ep, Epilogue):
        raise ArgumentError(f"{op}: epilogue must be an Epilogue, got {type(ep).__name__}")
    shape = tuple(int(d.value) if isinstance(d, E.Const) else None for d in ep.acc.shape)
    if shape != out_shape:
        raise EpilogueError(f"{op}: the epilogue's acc has shape {shape} but the anchor's output is {out_shape}")


def build_gemm(plan: AnchorPlan, p: GemmProblem, ep: Epilogue, ep_slots: list[Slot], name: str, tune: bool,
               wgmma: bool | None = None, config: Config | None = None, out_slot: Slot = (OUTPUT, 0)) -> Config:  # fmt: skip
    """Append the GEMM's launches to `plan` (falling back from a warpgroup configuration the rewrites
    cannot handle to mma.sync); return the configuration used."""
    cfg = config or choose_config(p, tune, wgmma)
    maps, aligned = len(plan.tensor_maps), plan.aligned_output
    try:
        launches = gemm_launches(plan, p, cfg, ep, ep_slots, name, out_slot)
    except TesseraError as exc:
        if config is not None or gemm_space.family(cfg) == "mma" or p.conv is not None:
            raise
        # The Hopper template could not be built or rewritten for this epilogue or operand
        # mapping: the mma.sync template always can.
        warnings.warn(f"tessera: {name}: {cfg} cannot take this epilogue/operand mapping ({exc}); using mma.sync",
                      stacklevel=3)  # fmt: skip
        del plan.tensor_maps[maps:]
        plan.aligned_output = aligned
        cfg = gemm_space.heuristic_config(p.m, p.n, p.k, p.batch, "mma", p.layout)
        launches = gemm_launches(plan, p, cfg, ep, ep_slots, name, out_slot)
    plan.launches += launches
    if p.vector:
        plan.aligned_inputs += [i for s, i in (p.a.slot, p.b.slot) if s == INPUT and i not in plan.aligned_inputs]
    return cfg


def plan_gemm(name: str, p: GemmProblem, out_shape: tuple[int, ...], num_inputs: int, epilogue: Epilogue | None,
              bias_slot: Slot | None, channel_axis: int, tune: bool, wgmma: bool | None = None,
              config: Config | None = None, plan: AnchorPlan | None = None) -> AnchorPlan:  # fmt: skip
    """The plan of a GEMM anchor: the epilogue (with the bias, if any, in front) fused into the GEMM.

    With `plan`, the GEMM's launches are appended to it (after the producers of its operands)."""
    check_epilogue(epilogue, out_shape, name)
    ep = epilogue
    ep_slots: list[Slot] = []
    if bias_slot is not None:
        ep = with_bias(ep, out_shape, p.dtype, channel_axis)
        ep_slots.append(bias_slot)
    elif ep is None:
        ep = identity_epilogue(out_shape, p.dtype)
    ep_slots += [(EXTRA, j) for j in range(len(epilogue.extras) if epilogue else 0)]
    if plan is None:
        plan = AnchorPlan(name, [], out_shape, dtypes.float16, num_inputs, 0)
    plan.out_dtype, plan.num_extras = ep.output.dtype, len(epilogue.extras) if epilogue else 0
    plan.config = build_gemm(plan, p, ep, ep_slots, name, tune, wgmma, config)
    return plan


# ---- matmul ------------------------------------------------------------------------------------------------------
def _batch_index(bi_idx: list[E.Expr], x_batch: tuple[int, ...], out_batch: tuple[int, ...]) -> list[E.Expr]:
    """Indices into x's (right-aligned, broadcast) batch dimensions from the output's batch indices."""
    off = len(out_batch) - len(x_batch)
    return [i32(0) if d == 1 else bi_idx[j + off] for j, d in enumerate(x_batch)]


def matmul_problem(a_shape: tuple[int, ...], b_shape: tuple[int, ...], dtype: DataType, b_layout: str
                   ) -> tuple[GemmProblem, tuple[int, ...]]:  # fmt: skip
    """numpy matmul semantics (1-D operands, broadcast batch dimensions) as a template GEMM."""
    if b_layout not in ("kn", "nk"):
        raise ArgumentError(f"matmul: b_layout must be 'kn' or 'nk', got {b_layout!r}")
    a_vec, b_vec = len(a_shape) == 1, len(b_shape) == 1
    m, k = (1, a_shape[0]) if a_vec else a_shape[-2:]
    if b_vec:
        kb, n = b_shape[0], 1
    else:
        kb, n = b_shape[-2:] if b_layout == "kn" else (b_shape[-1], b_shape[-2])
    if kb != k:
        raise ArgumentError(f"matmul: inner dimensions differ: a {a_shape} has K={k}, b {b_shape} (b_layout={b_layout!r}) has {kb}")
    a_batch, b_batch = tuple(a_shape[:-2]), tuple(b_shape[:-2])
    try:
        out_batch = tuple(np.broadcast_shapes(a_batch, b_batch))
    except ValueError:
        raise ArgumentError(f"matmul: batch dimensions {a_batch} and {b_batch} cannot be broadcast together") from None
    out_shape = (*out_batch, *(() if a_vec else (m,)), *(() if b_vec else (n,)))
    layout = "nk" if b_vec else b_layout  # a vector b is [K]: K-major, as an "nk" operand with N = 1

    def out_index(rows: list[E.Expr], col: E.Expr) -> tuple[E.Expr, ...]:
        return (*rows, *(() if b_vec else (col,)))

    if prod(b_batch) == 1 and not a_vec:
        # b is shared by every batch: fold a's batch dimensions into M (one GEMM, longer columns).
        lead = (*out_batch, m)
        fm = prod(lead)
        a = Operand((INPUT, 0), a_shape, lambda bi, r, c: (*unravel(r, a_shape[:-1]), c), plain=True)
        b = Operand((INPUT, 1), b_shape, _b_map(b_shape, b_layout, b_vec, lambda bi: [i32(0)] * len(b_batch)), plain=True)
        out_map = lambda z, r, c: out_index(unravel(r, lead), c)  # noqa: E731
        batch, m_eff = 1, fm
    else:
        batch, m_eff = prod(out_batch), m

        def bidx(x_batch: tuple[int, ...]):
            return lambda bi: _batch_index(unravel(bi, out_batch), x_batch, out_batch)

        a_b = bidx(a_batch)
        a = Operand((INPUT, 0), a_shape, (lambda bi, r, c: (c,)) if a_vec else (lambda bi, r, c: (*a_b(bi), r, c)),
                    plain=not a_vec and a_batch == out_batch)  # fmt: skip
        b = Operand((INPUT, 1), b_shape, _b_map(b_shape, b_layout, b_vec, bidx(b_batch)),
                    plain=not b_vec and b_batch == out_batch)  # fmt: skip
        out_map = lambda z, r, c: out_index([*unravel(z, out_batch), *(() if a_vec else (r,))], c)  # noqa: E731
    row_b = n if layout == "kn" else k
    vector = k % 8 == 0 and row_b % 8 == 0
    return GemmProblem(dtype, layout, batch, m_eff, n, k, a, b, out_map, vector, row_major_out=True), out_shape


def _b_map(b_shape: tuple[int, ...], layout: str, b_vec: bool, batch_idx) -> IndexMap:
    if b_vec:
        return lambda bi, r, c: (c,)  # "nk" with N = 1: (bi, n, k) -> k
    return lambda bi, r, c: (*batch_idx(bi), r, c)


def plan_matmul(a_shape: Sequence[int], b_shape: Sequence[int], dtype: DataType | str, *, b_layout: str = "kn",
                epilogue: Epilogue | None = None, tune: bool = False, wgmma: bool | None = None,
                config: Config | None = None) -> AnchorPlan:  # fmt: skip
    """The uncompiled plan of prepare_matmul (inspect `.source`, `.config`; `.load()` it)."""
    dt = check_dtype(dtype, "matmul")
    a_shape, b_shape = check_shape(a_shape, "a", "matmul"), check_shape(b_shape, "b", "matmul")
    if not a_shape or not b_shape:
        raise ArgumentError("matmul: operands must have at least one dimension")
    p, out_shape = matmul_problem(a_shape, b_shape, dt, b_layout)
    return plan_gemm("matmul", p, out_shape, 2, epilogue, None, -1, tune, wgmma, config)


def prepare_matmul(a_shape: Sequence[int], b_shape: Sequence[int], dtype: DataType | str, *, b_layout: str = "kn",
                   epilogue: Epilogue | None = None, tune: bool = False) -> AnchorKernel:  # fmt: skip
    """a @ b with numpy matmul semantics on tensor cores (float32 accumulation), epilogue fused.

    a is [..., M, K]; b is [..., K, N] (b_layout="kn") or [..., N, K] ("nk"); batch dimensions
    broadcast; 1-D operands as in numpy.  Call the result as ``kernel([a, b], out, extras)``;
    `out` has the kernel's `out_shape` and `out_dtype` (the epilogue's dtype, else `dtype`).
    `tune=False` picks the schedule by a cost model (one compilation); `tune=True` times the
    schedule space once per shape (cached).  float16/bfloat16 only: others raise UnsupportedError.
    """
    return plan_matmul(a_shape, b_shape, dtype, b_layout=b_layout, epilogue=epilogue, tune=tune).load()


# ---- linear ------------------------------------------------------------------------------------------------------
def plan_linear(x_shape: Sequence[int], w_shape: Sequence[int], dtype: DataType | str, *, bias: bool = False,
                epilogue: Epilogue | None = None, tune: bool = False, wgmma: bool | None = None,
                config: Config | None = None) -> AnchorPlan:  # fmt: skip
    """The uncompiled plan of prepare_linear."""
    dt = check_dtype(dtype, "linear")
    x_shape, w_shape = check_shape(x_shape, "x", "linear"), check_shape(w_shape, "weight", "linear")
    if len(w_shape) != 2:
        raise ArgumentError(f"linear: weight must be 2-D [out_features, in_features], got {w_shape}")
    if not x_shape or x_shape[-1] != w_shape[1]:
        raise ArgumentError(f"linear: x {x_shape} has {x_shape[-1] if x_shape else 0} features, weight {w_shape} expects {w_shape[1]}")
    n, k = w_shape
    lead = x_shape[:-1]
    out_shape = (*lead, n)
    a = Operand((INPUT, 0), x_shape, lambda bi, r, c: (*unravel(r, lead), c), plain=True)
    b = Operand((INPUT, 1), w_shape, lambda bi, r, c: (r, c), plain=True)
    p = GemmProblem(dt, "nk", 1, prod(lead), n, k, a, b, lambda z, r, c: (*unravel(r, lead), c), k % 8 == 0,
                    row_major_out=True)  # fmt: skip
    return plan_gemm("linear", p, out_shape, 3 if bias else 2, epilogue, (INPUT, 2) if bias else None, -1, tune,
                     wgmma, config)  # fmt: skip


def prepare_linear(x_shape: Sequence[int], w_shape: Sequence[int], dtype: DataType | str, *, bias: bool = False,
                   epilogue: Epilogue | None = None, tune: bool = False) -> AnchorKernel:  # fmt: skip
    """x @ w.T (+ bias) with x [..., K], w [N, K], out [..., N], epilogue fused.

    Inputs at call time: ``[x, w]`` or ``[x, w, bias]`` (bias [N], added to the float32
    accumulator before rounding, as torch does); the epilogue's `acc` is the linear's output.
    """
    return plan_linear(x_shape, w_shape, dtype, bias=bias, epilogue=epilogue, tune=tune).load()
