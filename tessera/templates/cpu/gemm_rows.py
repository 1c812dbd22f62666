"""CPU GEMM anchors generic in their row count: one build serves every sequence length and batch.

Under dynamic shapes (`torch.compile(..., dynamic=True)`, a serving engine's token counts) a
linear layer's rows M = prod(x.shape[:-1]) change from call to call while K, N and the weight
stay.  The x86 micro-kernel (gemm_kernel.py) reads M only in its loop bounds and row
addresses, so the kernel here leaves M a free shape symbol, bound from the arrays at call time,
and computes its row chunks from it: a new length launches a kernel that exists.

Per size bucket (M rounded up to a power of two) a register tile and thread count are chosen
(`RowGenericGemm._choose`): the site's first bucket is tuned (with tuning on), and the first
call also builds the cost model's pick for the other thread count (one thread for small GEMMs,
all for large); later buckets take a kernel that is built already, so a new size waits neither
for tuning nor for gcc.  The constant weight is packed once per panel width.

The epilogue keeps the graph's symbolic shapes (a residual [batch, seq, N], a bias [N], a
[seq, N] table): their symbols become shape parameters of the kernel too, and the store maps
the kernel's row to the output's leading indices.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod

import numpy as np

from tessera.graph.tensor import Tensor
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.templates.cpu.gemm import estimate, heuristic_config, pack_weight, recorded_config, tuned_config
from tessera.templates.cpu.gemm_kernel import CpuGemmConfig, make_gemm
from tessera.templates.epilogue import fuse_epilogue, identity_epilogue
from tessera.templates.gemm.generic import bucket, rows_refusal
from tessera.templates.gemm.plan import with_bias
from tessera.templates.kernel import (
    CONSTANT,
    EXTRA,
    INPUT,
    OUTPUT,
    AnchorPlan,
    CpuAnchorKernel,
    Launch,
    Slot,
    build_all,
)
from tessera.templates.registry import AnchorSite, Shape, StepKernel, epilogue_inputs, static, symbolic_epilogue
from tessera.templates.rewrite import i32, rename, specialize, unravel


class RowGenericGemm:
    """The kernels of one linear/matmul anchor site for every row count.

    `bind(shapes)` gives the step's kernel for concrete shapes; kernels of one configuration are
    built once and shared by every row count that picks it."""

    def __init__(self, site: AnchorSite, tune: bool):
        op = site.anchor
        self.site, self.tune = site, tune
        w = op.inputs[1]
        self.layout = "nk" if op.kind == "linear" else "kn"
        self.n, self.k = (w.shape[0], w.shape[1]) if self.layout == "nk" else (w.shape[1], w.shape[0])
        self.bias = op.kind == "linear" and len(op.inputs) == 3
        self.weight = w.data if w.is_constant else None
        self.source = "packed" if self.weight is not None else self.layout
        self._extras = epilogue_inputs(site)
        position = {t: i for i, t in enumerate(site.inputs)}
        self._operands = [position[t] for t in op.inputs]
        self._extra_positions = [position[t] for t in self._extras]
        self._packed: dict[int, np.ndarray] = {}  # panel width -> the weight packed for it
        self._kernels: dict[CpuGemmConfig, CpuAnchorKernel] = {}
        self._configs: dict[int, CpuGemmConfig] = {}  # bucket -> its configuration

    @property
    def artifacts(self) -> list[str]:
        """The libraries of every kernel built so far (what a saved graph ships)."""
        return [a for k in self._kernels.values() for a in k.artifacts]

    def config(self, m: int) -> CpuGemmConfig:
        """The configuration for m rows: its bucket's, chosen on the bucket's first call."""
        b = bucket(m)
        cfg = self._configs.get(b)
        if cfg is None:
            cfg = self._configs[b] = self._choose(b, bool(self._extras) or self.bias)
        return cfg

    def _choose(self, b: int, extras: bool) -> CpuGemmConfig:
        """A new bucket's configuration.  The first bucket gets the tuned one (with tuning on) or
        the cost model's; a later one takes its tuning record or the cost model's pick where that
        kernel is built already, else the best-rated built kernel of the same thread count: only a
        bucket needing another thread count builds (once), so a new size does not wait for gcc."""
        args = (b, self.n, self.k, 1, self.source, extras)
        if self.tune:
            cfg = recorded_config(*args) or (None if self._kernels else tuned_config(*args))
            if cfg is not None and (not self._kernels or cfg in self._kernels):
                return cfg
        pick = heuristic_config(b, self.n, self.k, 1, extras)
        same_team = [c for c in self._kernels if c.threads == pick.threads]
        if pick in self._kernels or not same_team:
            return pick
        return min(same_team, key=lambda c: estimate(c, b, self.n, self.k, 1))

    def bind(self, shapes: Mapping[Tensor, Shape]) -> StepKernel:
        """The step's kernel at these concrete shapes."""
        m = prod(shapes[self.site.anchor.inputs[0]][:-1])
        first = not self._kernels
        cfg = self.config(m)
        if first:
            self._build_first(cfg)
        kernel = self._kernels.get(cfg)
        if kernel is None:
            kernel = self._kernels[cfg] = self._plan(cfg).load()
        return StepKernel(kernel, self._operands, self._extra_positions)

    def _build_first(self, cfg: CpuGemmConfig) -> None:
        """The first call's kernels: its own configuration and the cost model's pick for a size on
        the other side of the one-thread / all-threads line (GEMMs under MIN_PARALLEL_MACS run
        on one thread), compiled at once, so that later sizes find a kernel of their team built."""
        extras = bool(self._extras) or self.bias
        other = [c for c in (heuristic_config(b, self.n, self.k, 1, extras) for b in (1, 1 << 20))
                 if c.threads != cfg.threads][:1]  # fmt: skip
        configs = [cfg, *other]
        self._kernels.update(zip(configs, build_all([self._plan(c) for c in configs])))

    def _packed_weight(self, nr: int, plan: AnchorPlan) -> np.ndarray:
        packed = self._packed.get(nr)
        if packed is None:
            packed = self._packed[nr] = pack_weight(self.weight, nr, self.layout, plan)
        return packed

    def _plan(self, cfg: CpuGemmConfig) -> AnchorPlan:
        """The uncompiled plan of configuration `cfg` with the row count free."""
        op, n, k, nr = self.site.anchor, self.n, self.k, cfg.nr
        f = make_gemm(cfg, self.source).ir
        m = next(s for s in f.shape_params if s.name == "M")
        plan = AnchorPlan(op.kind, [], (), dtypes.float32, 3 if self.bias else 2, len(self._extras), target="cpu")
        shapes: dict[str, tuple[int | None, ...]] = {"A": (1, None, k), "C": (1, None, n)}
        if self.weight is not None:
            plan.constants.append(self._packed_weight(nr, plan))
            b_slot: Slot = (CONSTANT, 0)
            shapes["B"] = (1, *plan.constants[0].shape[1:])
        else:
            b_slot = (INPUT, 1)
            shapes["B"] = (1, n, k) if self.layout == "nk" else (1, k, n)
            shapes["W"] = (cfg.threads, k * nr)
        f = specialize(f, shapes, {"RC": _row_chunks(cfg, m, n)})
        ep, out_shape = symbolic_epilogue(self.site)
        if self.bias:
            ep = with_bias(ep, out_shape, dtypes.float32, -1)
        ep = ep or identity_epilogue(out_shape, dtypes.float32)
        lead = out_shape[:-1]
        f = fuse_epilogue(f, "C", lambda b, r, c: (*unravel(r, lead), c), ep)
        f = rename(f, f"{op.kind}_gemm_{cfg}_rows")
        slots: list[Slot] = [(INPUT, 0), b_slot, (OUTPUT, 0)]
        if self.weight is None:
            slots.append(plan.workspace((cfg.threads, k * nr), dtypes.float32))
        slots += [(INPUT, 2)] if self.bias else []
        slots += [(EXTRA, j) for j in range(len(self._extras))]
        plan.out_dtype, plan.config = ep.output.dtype, cfg
        plan.launches.append(Launch(f, slots, generic=True))
        return plan


def _row_chunks(cfg: CpuGemmConfig, m: E.Var, n: int) -> E.Expr:
    """gemm.row_chunks as an expression of the free row count: split each column panel's row
    tiles until every worker has about four work units."""
    panels, want = -(-n // cfg.nr), 4 * cfg.threads
    if panels >= want:
        return i32(1)
    tiles = (m + i32(cfg.mr - 1)) // i32(cfg.mr)
    most = i32(-(-want // panels))
    return E.Select(tiles < most, tiles, most)


def row_generic(site: AnchorSite, tune: bool) -> RowGenericGemm | None:
    """The row-generic kernels of a linear/matmul site whose only symbolic sizes are its rows
    (its epilogue's tensors may have any), or None for a static site."""
    if rows_refusal(site.anchor) is not None or static(*site.inputs, *site.outputs):
        return None
    return RowGenericGemm(site, tune)
