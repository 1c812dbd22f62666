"""Scaled-dot-product attention anchor from the GEMM template and a row softmax (not fused flash-style).

For q [B, H, Sq, D], k [B, Hk, Sk, D], v [B, Hk, Sk, Dv] with H a multiple of Hk (query head h
reads key/value head h // (H / Hk)):

1. scores = q @ k^T * scale (an "nk" GEMM over B*H batches; k's head is picked by the operand
   index map, so grouped heads are never repeated in memory), with the optional mask operand
   and the causal mask (top-left aligned, like torch: key j <= query i) in its epilogue, stored
   as float32.  The mask broadcasts to [B, H, Sq, Sk] through the epilogue's index map (read
   in place, never expanded): a bool mask keeps True entries (False -> -inf), a float mask is
   added to the scaled scores, as the graph op's reference does;
2. probs = softmax(scores) in `dtype` (a tessera.ops row kernel), rows padded with zeros to a
   multiple of 8 columns so the next GEMM reads them with 16-byte copies;
3. out = probs @ v (a "kn" GEMM; v's rows past Sk are clamped to its last row, whose weight is 0).

Both score workspaces are allocated once at prepare: B*H*Sq*Sk*(4 + 2) bytes.

A fully masked row has all scores -inf; its softmax is 0/0 = NaN, as in the reference
(`scaled_dot_product_attention`'s numpy definition), so such rows come out NaN.

On an SM90 GPU `prepare_attention` runs the fused flash-attention kernel instead
(tessera.templates.attention.flash: scores never in HBM, split-KV for decode) whenever it covers the
problem (head dim 64/80/96/128, v's head dim equal to q's); otherwise it logs why and
prepares the composition above.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from math import prod
from typing import Any

from tessera import ops
from tessera.errors import ArgumentError, UnsupportedError
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.compute import Placeholder, compute
from tessera.ir.dtypes import DataType
from tessera.runtime.cuda import current_stream, device_properties, ensure_current, multiprocessor_count
from tessera.target import SM90
from tessera.templates.attention.flash import HEAD_DIMS
from tessera.templates.attention.launch import AttentionShape, FlashPlan, choose_config, choose_splits, mask_spec
from tessera.templates.cpu.gemm import add_cpu_gemm
from tessera.templates.epilogue import Epilogue, identity_epilogue
from tessera.templates.gemm.plan import GemmProblem, Operand, build_gemm, check_dtype, check_shape
from tessera.templates.kernel import INPUT, AnchorPlan, ops_launches
from tessera.templates.rewrite import i32, unravel

log = logging.getLogger("tessera")
_MASK_DTYPES = (dtypes.boolean, dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64)


def _mask_operand(mask_shape: Sequence[int] | None, mask_dtype: DataType | str | None,
                  full: tuple[int, int, int, int]) -> Placeholder | None:  # fmt: skip
    """The mask as an epilogue placeholder, after checking that it broadcasts to `full`."""
    if mask_shape is None and mask_dtype is None:
        return None
    if mask_shape is None or mask_dtype is None:
        raise ArgumentError("attention: give both mask_shape and mask_dtype for a mask operand (or neither)")
    shape = check_shape(mask_shape, "mask", "attention")
    if not shape:  # a 0-d tensor argument has no rank-1 parameter to bind to
        raise UnsupportedError("attention: a scalar (0-d) mask is not supported; pass it with shape [1]")
    try:
        mdt = dtypes.dtype(mask_dtype)
    except ValueError:
        raise ArgumentError(f"attention: unknown mask dtype {mask_dtype!r}") from None
    if mdt not in _MASK_DTYPES:
        raise ArgumentError(f"attention: the mask must be bool (keep True) or floating point (added), not {mdt}")
    if len(shape) > 4 or any(m not in (1, f) for m, f in zip(reversed(shape), reversed(full))):
        raise ArgumentError(f"attention: mask shape {shape} does not broadcast to [B, H, Sq, Sk] = {list(full)}")
    return Placeholder("mask", shape, mdt)


def plan_attention(q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int], dtype: DataType | str, *,
                   causal: bool = False, scale: float | None = None, mask_shape: Sequence[int] | None = None,
                   mask_dtype: DataType | str | None = None, tune: bool = False,
                   wgmma: bool | None = None, target: str = "cuda") -> AnchorPlan:  # fmt: skip
    """The uncompiled plan of prepare_attention.  target="cpu": float32, the two GEMMs on the x86
    micro-kernel (tessera.templates.cpu.gemm) and the softmax as a CPU row kernel."""

    cpu = target == "cpu"
    if cpu:
        dt = dtypes.dtype(dtype)
        if dt != dtypes.float32:
            raise UnsupportedError(f"attention: the CPU template takes float32, not {dt}")
    else:
        dt = check_dtype(dtype, "attention")
    q_shape, k_shape, v_shape = (check_shape(s, w, "attention") for s, w in ((q_shape, "q"), (k_shape, "k"), (v_shape, "v")))
    if not len(q_shape) == len(k_shape) == len(v_shape) == 4:
        raise UnsupportedError(f"attention: the template takes [B, H, S, D] q, k and v, got {q_shape}, {k_shape}, {v_shape}")
    b, h, sq, d = q_shape
    bk, hk, sk, dk = k_shape
    if bk != b or v_shape[0] != b or dk != d or v_shape[1] != hk or v_shape[2] != sk:
        raise ArgumentError(f"attention: shapes do not match: q {q_shape}, k {k_shape}, v {v_shape}")
    if h % hk:
        raise ArgumentError(f"attention: {h} query heads are not a multiple of {hk} key/value heads")
    dv, rep = v_shape[3], h // hk
    scale = d**-0.5 if scale is None else float(scale)
    skp = sk if cpu else -(-sk // 8) * 8  # rows for 16-byte copies on the GPU
    mask = _mask_operand(mask_shape, mask_dtype, (b, h, sq, sk))
    plan = AnchorPlan("attention", [], (b, h, sq, dv), dt, 3 if mask is None else 4, 0, target=target)
    if cpu:
        def gemm(p, ep, ep_slots, name, out_slot=None):  # noqa: ANN001, ANN202
            kw = {} if out_slot is None else {"out_slot": out_slot}
            return add_cpu_gemm(plan, p, ep, ep_slots, name, tune=tune, **kw)
    else:

        def gemm(p, ep, ep_slots, name, out_slot=None):  # noqa: ANN001, ANN202
            kw = {} if out_slot is None else {"out_slot": out_slot}
            return build_gemm(plan, p, ep, ep_slots, name, tune, wgmma, **kw)

    def heads(bi: E.Expr) -> list[E.Expr]:
        return unravel(bi, (b, h))

    def kv_head(bi: E.Expr) -> list[E.Expr]:  # (batch, key/value head) of query batch-head bi
        bh = heads(bi)
        return [bh[0], bh[1] if rep == 1 else bh[1] // i32(rep)]

    # 1. masked, scaled scores in float32
    scores_slot = plan.workspace((b, h, sq, sk), dtypes.float32)
    acc = Placeholder("acc", (b, h, sq, sk), dtypes.float32)
    minus_inf = E.Const(float("-inf"), dtypes.float32)

    def scaled(*i: E.Expr) -> E.Expr:  # the reference's order: scale, causal, then the mask
        v = acc[i] * E.Const(scale, dtypes.float32)
        if causal:
            v = E.Select(E.Binary("<=", i[3], i[2]), v, minus_inf)
        if mask is not None:
            m = mask[tuple(i32(0) if d.value == 1 else x for d, x in zip(mask.shape, i[4 - mask.rank:]))]
            v = E.Select(m, v, minus_inf) if mask.dtype.is_bool else v + E.Cast(m, dtypes.float32)
        return v

    qk = GemmProblem(dt, "nk", b * h, sq, sk, d,
                     Operand((INPUT, 0), q_shape, lambda bi, r, c: (*heads(bi), r, c)),
                     Operand((INPUT, 1), k_shape, lambda bi, r, c: (*kv_head(bi), r, c)),
                     lambda z, r, c: (*heads(z), r, c), d % 8 == 0)  # fmt: skip
    ep = Epilogue(acc, compute(acc.shape, scaled, "scores", dtypes.float32), [] if mask is None else [mask])
    ep_slots = [] if mask is None else [(INPUT, 3)]
    cfg_qk = gemm(qk, ep, ep_slots, "attention_qk", scores_slot)

    # 2. softmax rows, zero-padded to skp columns
    probs_slot = plan.workspace((b, h, sq, skp), dt)
    sc = Placeholder("scores", (b, h, sq, sk), dtypes.float32)
    sm = ops.softmax(sc, -1)
    if skp == sk:
        probs = ops.cast(sm, dt)
    else:
        probs = compute((b, h, sq, skp), lambda *i: E.Select(i[3] < i32(sk), sm[(*i[:3], i[3])], E.Const(0, dtypes.float32)),
                        "probs", dt)  # fmt: skip
    ops_launches(plan, [probs], [sc], {sc: scores_slot, probs: probs_slot}, "attention_softmax", target=target)

    # 3. probs @ v
    last = i32(sk - 1)
    pv = GemmProblem(dt, "kn", b * h, sq, dv, skp,
                     Operand(probs_slot, (b, h, sq, skp), lambda bi, r, c: (*heads(bi), r, c)),
                     Operand((INPUT, 2), v_shape, lambda bi, r, c: (*kv_head(bi), r if skp == sk else E.Select(r < i32(sk), r, last), c)),
                     lambda z, r, c: (*heads(z), r, c), dv % 8 == 0)  # fmt: skip
    cfg_pv = gemm(pv, identity_epilogue((b, h, sq, dv), dt), [], "attention_pv")
    plan.config = (cfg_qk, cfg_pv)
    return plan


def _sm90() -> bool:
    """Whether this machine has a Hopper GPU (read from the driver; False without one)."""

    props = device_properties()
    return props.from_driver and props.capability == SM90.capability


def flash_unsupported(q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int],
                      mask_shape: Sequence[int] | None = None) -> str | None:  # fmt: skip
    """Why the fused flash kernel does not take these shapes on this machine (None when it does)."""

    if not _sm90():
        return "the fused kernel needs an SM90 GPU (TMA, wgmma)"
    if importlib.util.find_spec("torch") is None:
        return "the fused kernel's launcher allocates its workspaces through torch, which is not installed"
    d, dv = q_shape[-1], v_shape[-1]
    if d not in HEAD_DIMS:
        return f"head dim {d} is not one of the fused kernel's {HEAD_DIMS}"
    if dv != d:
        return f"v's head dim {dv} differs from q's {d}"
    if max(prod(q_shape), prod(k_shape), prod(mask_shape or ())) >= 2**31:
        return "operands of 2**31 elements or more (the kernel indexes in 32 bits)"
    if k_shape[0] * k_shape[1] > 65535:
        return f"batch x kv heads = {k_shape[0] * k_shape[1]} exceeds the grid's 65535 (y dimension)"
    return None


class FlashAnchorKernel:
    """The fused flash-attention kernel behind the anchor interface: `kernel(inputs, out, extras)`
    with inputs [q, k, v] or [q, k, v, mask] (contiguous, the prepared shapes), on torch's
    current stream, allocating nothing per call (its split-KV workspaces belong to it).

    `views` (one per q, k, v; None: the operand itself) reads an operand as heads of a
    [1, S, W] tensor: (first column, W), y[0, h, s, d] = x[0, s, first + h * D + d], the
    graph's `split_heads` (no copy: strided TMA maps, tessera.templates.attention.launch.FlashPlan).
    `heads_last` writes the output as [B, Sq, H * D], the graph's `merge_heads` of it."""

    def __init__(self, q_shape: tuple[int, ...], k_shape: tuple[int, ...], dtype: DataType, causal: bool, scale: float,
                 mask_shape: tuple[int, ...] | None, mask_dtype: DataType | None,
                 views: Sequence[tuple[int, int] | None] = (None, None, None), heads_last: bool = False):  # fmt: skip
        import torch

        b, h, sq, d = q_shape
        shape = AttentionShape(b, h, k_shape[1], sq, k_shape[2], d)
        spec = mask_spec(mask_shape, mask_dtype, (b, h, sq, k_shape[2])) if mask_shape is not None else None
        sms = multiprocessor_count()
        self.config = choose_config(shape, sms)
        splits = choose_splits(shape, self.config, sms, causal)
        ensure_current()
        device = torch.device("cuda", torch.cuda.current_device())
        self._views = tuple(views)
        self._heads = (h, k_shape[1], k_shape[1])
        self._plan = FlashPlan(shape, dtype, causal, scale, spec, self.config, splits, device,
                               row_strides=[w[1] if w else None for w in self._views], heads_last=heads_last)  # fmt: skip
        # operands as plain [B, H, S, D] tensors, for views at unaligned addresses (built when first needed)
        self._plain: Any = None
        self._plain_args = (shape, dtype, causal, scale, spec, self.config, splits, device)
        self.heads_last = heads_last
        self.out_shape: tuple[int, ...] = (b, sq, h * d) if heads_last else tuple(q_shape)
        self.out_dtype = dtype
        self._num_inputs = 3 if spec is None else 4

        self._kernels = self._plan.kernels
        self.artifacts = [k.build() for k in self._kernels]  # (cached: the plan built them)
        self.artifact = self.artifacts[0]

    @property
    def kernels(self) -> list[str]:
        return [k.ir.name for k in self._kernels]

    @property
    def source(self) -> str:
        return "\n".join(k.source for k in self._kernels)

    def __call__(self, inputs: Sequence[Any], out: Any, extras: Sequence[Any] = ()) -> None:
        if len(inputs) != self._num_inputs or extras:
            raise ArgumentError(f"attention: takes {self._num_inputs} inputs and no extras, got {len(inputs)} and {len(extras)}")
        mask = inputs[3] if self._num_inputs == 4 else None
        # tessera's current stream: the compiled graph's own under native arrays (the one it
        # captures), else torch's current stream for torch tensors.
        stream = current_stream((out,))
        nbytes = self.out_dtype.nbytes
        ptrs = [t.data_ptr() + (view[0] * nbytes if view else 0) for t, view in zip(inputs, self._views)]
        if all(p % 16 == 0 for p in ptrs):
            self._plan.launch(*ptrs, mask.data_ptr() if mask is not None else None, out.data_ptr(), stream)
            return
        # TMA reads from 16-byte aligned addresses: unaligned operands are copied (rare: planned buffers are aligned).
        q, k, v = (self._dense(t, view, heads) if view or t.data_ptr() % 16 else t
                   for t, view, heads in zip(inputs, self._views, self._heads))  # fmt: skip
        if self._plain is None:
            self._plain = FlashPlan(*self._plain_args, heads_last=self.heads_last)
        self._plain(q, k, v, mask, out, stream)

    def _dense(self, t: Any, view: tuple[int, int] | None, heads: int) -> Any:
        """A contiguous copy of an operand (of its heads when it is a view)."""
        if view is None:
            return t.clone()
        d = self._plan.shape.d
        b, s = t.shape[0], t.shape[1]
        dense = t[..., view[0] : view[0] + heads * d].reshape(b, s, heads, d).transpose(1, 2).contiguous()
        # contiguous() returns the view itself when its strides already qualify (one row and
        # one head), at the same unaligned address: then copy it
        return dense if dense.data_ptr() % 16 == 0 else dense.clone()

    def __repr__(self) -> str:
        return f"<FlashAnchorKernel attention -> {self.out_dtype}{list(self.out_shape)}: {', '.join(self.kernels)}>"


def prepare_attention(q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int], dtype: DataType | str, *,
                      causal: bool = False, scale: float | None = None, mask_shape: Sequence[int] | None = None,
                      mask_dtype: DataType | str | None = None, tune: bool = False,
                      views: Sequence[tuple[int, int] | None] = (None, None, None), heads_last: bool = False) -> Any:  # fmt: skip
    """softmax(q @ k^T * scale [causal] [mask]) @ v for [B, H, S, D] q and [B, Hk, S, D] k, v (grouped heads).

    Inputs at call time: ``[q, k, v]``, or ``[q, k, v, mask]`` when `mask_shape` and
    `mask_dtype` are given; the output is [B, H, Sq, Dv] in `dtype`; `scale` defaults to
    D ** -0.5; `causal` keeps key j <= query i (top-left aligned, as torch does).  The mask
    broadcasts to [B, H, Sq, Sk] (e.g. [B, 1, 1, Sk], [B, 1, Sq, Sk], [Sq, Sk]): a bool mask
    keeps True entries, a float mask (any float dtype) is added to the scaled scores; it
    combines with `causal`.  Fully masked rows give NaN, as the graph op's reference does.

    On an SM90 GPU the fused flash kernel runs (a FlashAnchorKernel); where it does not cover
    the problem the reason is logged and the GEMM + softmax + GEMM composition runs.

    `views` and `heads_last` (operands read as heads of a [1, S, W] tensor, the output written
    as [B, Sq, H * D]: see FlashAnchorKernel) need the fused kernel; without it they raise
    UnsupportedError.
    """
    reason = (flash_unsupported(q_shape, k_shape, v_shape, mask_shape) if len(q_shape) == len(k_shape) == len(v_shape) == 4
              else "not [B, H, S, D]")  # fmt: skip
    # The plan validates every argument (and is the fallback); tuned only when it will run.
    plan = plan_attention(q_shape, k_shape, v_shape, dtype, causal=causal, scale=scale, mask_shape=mask_shape,
                          mask_dtype=mask_dtype, tune=tune and reason is not None)  # fmt: skip
    if reason is None:
        q, k = tuple(int(x) for x in q_shape), tuple(int(x) for x in k_shape)
        mdt = dtypes.dtype(mask_dtype) if mask_dtype is not None else None
        mshape = tuple(int(x) for x in mask_shape) if mask_shape is not None else None
        return FlashAnchorKernel(q, k, dtypes.dtype(dtype), causal, q[-1] ** -0.5 if scale is None else float(scale),
                                 mshape, mdt, views, heads_last)  # fmt: skip
    if any(views) or heads_last:
        raise UnsupportedError(f"attention reads head views / writes heads last only on the fused kernel: {reason}")
    log.info("tessera: attention q %s, k %s, v %s runs as GEMM + softmax + GEMM: %s", list(q_shape), list(k_shape),
             list(v_shape), reason)  # fmt: skip
    return plan.load()
