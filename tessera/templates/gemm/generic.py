"""GPU GEMM anchors generic in their row count: one build serves every sequence length and batch.

Under dynamic shapes (`torch.compile(..., dynamic=True)`, a serving engine's token counts) a
linear layer's rows M = prod(x.shape[:-1]) change from call to call while K, N and the weight
stay.  The tensor-core templates (mma.py, wgmma.py, tma.py) read M only in their bounds checks,
their grid and the TMA map of A, so the kernel here leaves M a free shape symbol, bound from the
arrays at call time: the grid (`ceil_div(M, BM)` blocks, or a persistent kernel's
`min(tiles, SMs)`) is evaluated per call and A's tensor map is encoded per (address, rows).

Schedules: on the first call the site builds, in parallel, the cost model's best unsplit
schedule for each bucket of a fixed ladder of row counts (LADDER) plus the first bucket's own
(tuned, with tuning on); a bucket (M rounded up to a power of two) then takes the built kernel
the cost model rates best for it, so a new size never waits for nvcc or the tuner.  Split-k is
left out (its float32 partials would need a workspace sized by M); row counts up to SMALL_ROWS
(decode steps, where split-k matters most) are planned per shape instead, as static sites are.

The epilogue keeps the graph's symbolic shapes (a residual [batch, seq, N], a bias [N]): their
symbols become shape parameters of the kernel too.  `rows_refusal` and `bucket` are the rules
the CPU's row-generic GEMM (tessera.templates.cpu.gemm_rows) shares.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from math import prod
from typing import Any

from tessera.errors import TesseraError
from tessera.graph.operator import Operator
from tessera.graph.tensor import Tensor
from tessera.ir import expr as E
from tessera.templates.epilogue import fuse_epilogue, identity_epilogue
from tessera.templates.gemm import space as gemm_space
from tessera.templates.gemm.config import config_for_shape, families, make_kernel
from tessera.templates.gemm.plan import with_bias
from tessera.templates.gemm.space import Config, estimate_us, schedule_space
from tessera.templates.gemm.tma import TmaConfig, tensor_map_boxes
from tessera.templates.kernel import EXTRA, INPUT, OUTPUT, AnchorKernel, AnchorPlan, Launch, MapSpec, Slot, build_all
from tessera.templates.registry import AnchorSite, Shape, StepKernel, epilogue_inputs, static, symbolic_epilogue
from tessera.templates.rewrite import i32, remap_operand, rename, retype_operand, specialize, unravel

log = logging.getLogger("tessera")


def rows_refusal(op: Operator) -> str | None:
    """Why a linear/matmul with symbolic sizes cannot run generic in its rows (None when it can):
    every size but the first operand's leading dimensions must be a number."""
    a, b = op.inputs[0], op.inputs[1]
    if b.ndim != 2 or not static(b, *op.inputs[2:]) or a.ndim < 2 or not isinstance(a.shape[-1], int):
        return "symbolic sizes beyond the rows: the GEMM templates are generic in their row count only"
    return None


def bucket(m: int) -> int:
    """The size bucket of m rows: the next power of two."""
    return 1 << max(0, m - 1).bit_length()


def unsplit(cfg: Config) -> Config:
    """`cfg` without split-k (a generic kernel has no workspace sized by its rows)."""
    if cfg.split_k == 1:
        return cfg
    return replace(cfg, split_k=1, split_reduce="launch") if isinstance(cfg, TmaConfig) else replace(cfg, split_k=1)


LADDER = (32, 256, 2048, 16384)  # row counts whose best schedules the first call builds
SMALL_ROWS = 16  # row counts at or below this are planned per shape (split-k, tuned per shape)


def unsplit_config(m: int, n: int, k: int, family: str, layout: str) -> Config:
    """The cost model's best schedule without split-k for m rows (as heuristic_config, 2% ties)."""
    space = [c for c in schedule_space(m, n, k, 1, layout, wgmma=family == "wgmma", tma=family == "tma")
             if c.split_k == 1]  # fmt: skip
    best, best_t = space[0], estimate_us(space[0], m, n, k)
    for cfg in space[1:]:
        t = estimate_us(cfg, m, n, k)
        if t < best_t * 0.98:
            best, best_t = cfg, t
    return best


class RowGenericGpuGemm:
    """The kernels of one fp16/bf16 linear/matmul anchor site for every row count.

    `bind(shapes)` gives the step's kernel for concrete shapes: per shape (`per_shape`) up to
    SMALL_ROWS rows, else a kernel of the schedules built on the first call."""

    def __init__(self, site: AnchorSite, tune: bool, per_shape: Callable[[Mapping[Tensor, Shape]], StepKernel]):
        op = site.anchor
        self.site, self.tune, self.per_shape = site, tune, per_shape
        self.dtype = op.outputs[0].dtype
        w = op.inputs[1]
        self.layout = "nk" if op.kind == "linear" else "kn"
        self.n, self.k = (w.shape[0], w.shape[1]) if self.layout == "nk" else (w.shape[1], w.shape[0])
        self.bias = op.kind == "linear" and len(op.inputs) == 3
        # 16-byte rows of A and B: cp.async / TMA loads (B's rows are N long in the "kn" layout)
        self.vector = self.k % 8 == 0 and (self.layout == "nk" or self.n % 8 == 0)
        self.families = families(self.layout, self.vector, tma=self.vector)
        self._extras = epilogue_inputs(site)
        position = {t: i for i, t in enumerate(site.inputs)}
        self._operands = [position[t] for t in op.inputs]
        self._extra_positions = [position[t] for t in self._extras]
        self._kernels: dict[Config, AnchorKernel] = {}
        self._configs: dict[int, Config] = {}  # bucket -> its schedule

    @property
    def kernels(self) -> dict[Config, AnchorKernel]:
        """The kernels built so far, by schedule."""
        return dict(self._kernels)

    @property
    def artifacts(self) -> list[str]:
        """The cubins of every schedule built so far (what a saved graph ships)."""
        return [str(k.artifact) for k in self._kernels.values()]

    def bind(self, shapes: Mapping[Tensor, Shape]) -> StepKernel:
        """The step's kernel at these concrete shapes."""
        m = prod(shapes[self.site.anchor.inputs[0]][:-1])
        if m <= SMALL_ROWS:
            return self.per_shape(shapes)
        if not self._kernels:
            self._build(bucket(m))
        return StepKernel(self._kernels[self.config(m)], self._operands, self._extra_positions)

    def config(self, m: int) -> Config:
        """The schedule for m rows: the built one the cost model rates best for its bucket."""
        b = bucket(m)
        cfg = self._configs.get(b)
        if cfg is None:
            cfg = self._configs[b] = min(self._kernels, key=lambda c: estimate_us(c, b, self.n, self.k))
        return cfg

    def schedules(self, first: int) -> list[Config]:
        """What the first call (m rows in bucket `first`) builds: that bucket's schedule (tuned with
        tuning on) and the cost model's best unsplit one for each bucket of LADDER."""
        own = unsplit(config_for_shape(self.dtype, self.layout, 1, first, self.n, self.k, self.vector, tune=self.tune,
                                       tma="tma" in self.families, wgmma="wgmma" in self.families))  # fmt: skip
        ladder = [unsplit_config(b, self.n, self.k, self.families[0], self.layout) for b in LADDER]
        return list(dict.fromkeys([own, *ladder]))

    def _build(self, first: int) -> None:
        """Plan the first call's schedules, compile them in parallel, load them.  A schedule whose
        template cannot take this epilogue gives way to mma.sync's (logged), as for static sites."""
        plans: dict[Config, AnchorPlan] = {}
        schedules = self.schedules(first)
        for cfg in schedules:
            try:
                plans[cfg] = self.plan(cfg)
            except TesseraError as exc:
                fallback = unsplit_config(first, self.n, self.k, "mma", self.layout)
                log.warning("tessera: %s: %s cannot take this epilogue/operand mapping (%s); using %s",
                            self.site.anchor.name, cfg, exc, fallback)  # fmt: skip
                plans[fallback] = self.plan(fallback)
        self._kernels = dict(zip(plans, build_all(list(plans.values()))))
        if schedules[0] in self._kernels:  # the first bucket's own (tuned) schedule
            self._configs[first] = schedules[0]

    def plan(self, cfg: Config) -> AnchorPlan:
        """The uncompiled plan of schedule `cfg` with the row count free (inspect `.source`)."""
        op, n, k = self.site.anchor, self.n, self.k
        f = make_kernel(self.dtype, cfg, self.layout, self.vector).ir
        m = next(s for s in f.shape_params if s.name == "M")
        b_shape = (1, n, k) if self.layout == "nk" else (1, k, n)
        w_shape = (n, k) if self.layout == "nk" else (k, n)
        scalars: dict[str, Any] = {"split": 1}
        tma = isinstance(cfg, TmaConfig)
        if tma:
            tiles = (m + i32(cfg.block_m - 1)) // i32(cfg.block_m) * i32(-(-n // cfg.block_n))
            sms = i32(gemm_space.device().sms)
            scalars["ctas"] = E.Select(tiles < sms, tiles, sms) if cfg.persistent else tiles
        f = specialize(f, {"A": (1, None, k), "B": b_shape, "C": (1, None, n)}, scalars)
        plan = AnchorPlan(op.kind, [], (), self.dtype, 3 if self.bias else 2, len(self._extras))
        map_slots: list[Slot] = []
        if tma:
            a_box, b_box = tensor_map_boxes(cfg, self.layout)
            f = retype_operand(f, "B", w_shape)
            map_slots = [plan.tensor_map(MapSpec((INPUT, 0), self.dtype, (1, -1, k), a_box)),
                         plan.tensor_map(MapSpec((INPUT, 1), self.dtype, (1, *w_shape), b_box))]  # fmt: skip
        else:
            f = remap_operand(f, "B", w_shape, lambda bi, r, c: (r, c))
        ep, out_shape = symbolic_epilogue(self.site)
        if self.bias:
            ep = with_bias(ep, out_shape, self.dtype, -1)
        ep = ep or identity_epilogue(out_shape, self.dtype)
        lead = out_shape[:-1]
        f = fuse_epilogue(f, "C", lambda z, r, c: (*unravel(r, lead), c), ep, row_major=True)
        f = rename(f, f"{op.kind}_gemm_{str(cfg).replace('-', '_')}_rows")
        slots: list[Slot] = [(INPUT, 0), (INPUT, 1), (OUTPUT, 0), *map_slots]
        slots += [(INPUT, 2)] if self.bias else []
        slots += [(EXTRA, j) for j in range(len(self._extras))]
        plan.out_dtype, plan.config, plan.aligned_output = ep.output.dtype, cfg, True
        plan.aligned_inputs = [0, 1] if self.vector else []
        plan.launches.append(Launch(f, slots, generic=True))
        return plan


def row_generic(site: AnchorSite, tune: bool,
                per_shape: Callable[[Mapping[Tensor, Shape]], StepKernel]) -> RowGenericGpuGemm | None:  # fmt: skip
    """The row-generic kernels of an fp16/bf16 linear/matmul site whose only symbolic sizes are
    its rows (its epilogue's tensors may have any), or None for a static site; `per_shape`
    prepares the site at concrete shapes (small row counts)."""
    if rows_refusal(site.anchor) is not None or static(*site.inputs, *site.outputs):
        return None
    return RowGenericGpuGemm(site, tune, per_shape)
