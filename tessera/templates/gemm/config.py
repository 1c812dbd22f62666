"""The GEMM schedule of one shape: the cost model's pick, or the tuner's winner over the
schedule space (every candidate compiled, checked and timed on the device through
`GemmLaunch`, a launcher of one candidate on torch CUDA tensors).

The schedule space is hardware-centric (Hidet): a fixed list of block/warp tiles, k-depths,
pipeline stages and split-k factors that suit an SM90 GPU, pruned only where a shape makes a
candidate pointless (a 256-row tile for M = 16, split-k when there are already several waves
of tiles).  Every surviving candidate is compiled in parallel, checked once against torch.matmul, timed
on the device, and the winner is cached per (dtype, layout, shape, GPU, template source) by
tessera.tune.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

from tessera.errors import UnsupportedError
from tessera.ir.dtypes import DataType, torch_name
from tessera.runtime.cuda import ensure_current, torch_stream
from tessera.runtime.tensor_map import TensorMap
from tessera.target import SM90
from tessera.templates.gemm import mma as gemm
from tessera.templates.gemm import tma as gemm_tma
from tessera.templates.gemm import wgmma as gemm_sm90
from tessera.templates.gemm.mma import make_gemm, make_split_k_reduce

# The schedule space, the split-k rule and the cost model live in one place (space.py);
# these names are re-exported for the callers that tune or inspect it.
from tessera.templates.gemm.space import Config, device, families, heuristic_config, schedule_space, tma_space  # noqa: E402,F401
from tessera.templates.gemm.tma import TmaConfig, make_gemm_tma, tensor_map_boxes
from tessera.templates.gemm.wgmma import WgmmaConfig, make_gemm_wgmma
from tessera.tune import tune
from tessera.tune.timing import GRAPH_CALLS, check_result, graph_bench, operand_sets


def _torch() -> Any:
    try:
        import torch  # optional: torch
    except ImportError:  # pragma: no cover - the GPU machine has torch
        raise UnsupportedError("tessera.templates.gemm.config works on torch CUDA tensors; install torch") from None
    return torch


@functools.cache
def make_kernel(dtype: Any, cfg: Any, layout: str, vector: bool) -> Any:
    """The compiled-on-demand kernel of one candidate (mma.sync, wgmma or TMA)."""
    if isinstance(cfg, TmaConfig):
        if not vector:
            raise UnsupportedError(f"{cfg} needs 16-byte aligned rows (TMA); use an mma.sync configuration")
        return make_gemm_tma(dtype, cfg, layout)
    if isinstance(cfg, WgmmaConfig):
        return make_gemm_wgmma(dtype, cfg, vector)
    return make_gemm(dtype, cfg, layout, vector)


_WORK: dict[tuple, Any] = {}  # split-k float32 partials per (device, stream, size)


@functools.cache
def template_source() -> str:
    """The source the GEMM candidates are generated and launched from: its hash is part of
    every GEMM tuning record's key, so an edited template is re-tuned, never given a stale winner."""
    modules = (gemm, gemm_sm90, gemm_tma, sys.modules[__name__])
    parts = [Path(m.__file__).read_text(errors="replace") for m in modules if m.__file__]
    return "\n".join(parts)


def config_for_shape(dtype: DataType, layout: str, batch: int, m: int, n: int, k: int, vector: bool, *, tune: bool,
                     tma: bool = True, wgmma: bool = True) -> Config:  # fmt: skip
    """The GEMM schedule for one shape, what every GEMM caller goes through: the tuner's winner
    over the best family's space (tessera.templates.gemm.space) when `tune` (compiles and times
    every candidate on first use, then cached on disk; needs a GPU), else the cost model's pick.
    `tma`/`wgmma` = False keep those families out (callers whose operands must be remapped
    cannot use TMA)."""
    fams = families(layout, vector, tma=tma, wgmma=wgmma)
    if tune:
        return tuned_for_shape(dtype, layout, batch, m, n, k, vector, tma="tma" in fams, wgmma="wgmma" in fams)
    return heuristic_config(m, n, k, batch, fams[0], layout)


def tuned_for_shape(dtype: Any, layout: str, batch: int, m: int, n: int, k: int, vector: bool, *, tma: bool,
                    wgmma: bool) -> Any:  # fmt: skip
    """The tuner's winner for a GEMM shape, timed on fresh random operands on the current GPU."""
    torch = _torch()
    tdt = getattr(torch, torch_name(dtype))
    a = torch.empty((batch, m, k), dtype=tdt, device="cuda")
    b = torch.empty((batch, k, n) if layout == "kn" else (batch, n, k), dtype=tdt, device="cuda")
    return _tuned(a, b, layout, dtype, batch, m, n, k, vector, tma=tma, wgmma=wgmma)


def _tuned(a: Any, b: Any, layout: str, dtype: Any, batch: int, m: int, n: int, k: int, vector: bool,
           tma: bool = False, wgmma: bool = True) -> Any:  # fmt: skip
    """The tuned configuration over space.schedule_space: the TMA GEMM's space with `tma`
    (on SM90 with aligned rows), else mma.sync and (with `wgmma`) the warpgroup GEMM.

    Candidates run on fresh random operands of a's and b's shapes (the caller's data may hold
    inf or NaN); each is checked once against torch.matmul in float32 before it is timed."""
    torch = _torch()
    gpu = torch.cuda.get_device_name(a.device)
    sm90 = vector and torch.cuda.get_device_capability(a.device) == SM90.capability
    tma = tma and sm90
    key = f"gemm|{dtype}|{layout}|{'vec' if vector else 'scalar'}|b{batch}|m{m}|n{n}|k{k}|{gpu}{'|tma' if tma else ''}"
    gen = torch.Generator(device=a.device).manual_seed(0)
    a3 = torch.randn((batch, m, k), generator=gen, device=a.device).to(a.dtype)
    b3 = torch.randn((batch, *b.shape[-2:]), generator=gen, device=a.device).to(a.dtype)
    c3 = torch.empty((batch, m, n), dtype=a.dtype, device=a.device)
    ref: list[Any] = []  # computed on the first check: a recorded winner needs none
    wgmma = wgmma and sm90 and layout == "nk" and not tma
    candidates = schedule_space(m, n, k, batch, layout, wgmma, tma)

    def plan(cfg: Any) -> GemmLaunch:
        return GemmLaunch(cfg, dtype, layout, vector, a3, b3, c3, True)

    def check(cfg: Any, _: Any) -> str | None:
        if not ref:
            ref.append(torch.matmul(a3.float(), b3.float() if layout == "kn" else b3.float().transpose(1, 2)))
        out = plan(cfg)(a3, b3)
        torch.cuda.synchronize()
        return check_result(out, ref[0])

    sets: list[tuple[Any, Any]] = []  # made on the first timing: a recorded winner needs none

    def bench(cfg: Any, _: Any) -> float:
        if not sets:
            sets.extend(operand_sets(a3, b3))
        p = plan(cfg)
        return graph_bench(lambda i: p(*sets[i % len(sets)]), GRAPH_CALLS)

    record = tune(key, candidates, build=lambda cfg: make_kernel(dtype, cfg, layout, vector).compile(), bench=bench,
                  check=check, template=template_source())  # fmt: skip
    return record.best


class GemmLaunch:
    """One matmul call signature (shapes, dtype, layout, device, config), resolved once.

    Calls with the same signature skip validation and tuning and launch through bound kernel
    launches (tessera.runtime.cuda.BoundLaunch): per call only the output allocation, the data
    pointers, the tensor maps (cached by address) and the launches remain."""

    def __init__(self, cfg: Any, dtype: Any, layout: str, vector: bool, a3: Any, b3: Any, c3: Any, rank3: bool):
        torch = _torch()
        batch, m, n = c3.shape
        self.cfg, self.vector, self.layout = cfg, vector, layout
        self.out_shape = (batch, m, n) if rank3 else (m, n)
        self.a_shape, self.b_shape = tuple(a3.shape), tuple(b3.shape)
        self.device = c3.device
        in_kernel = getattr(cfg, "cluster", False)  # split-k added up inside the kernel
        self.work_numel = batch * cfg.split_k * m * n if cfg.split_k > 1 and not in_kernel else 0
        work = self._work(torch, torch_stream(c3)).view(batch * cfg.split_k, m, n) if self.work_numel else c3
        kernel = make_kernel(dtype, cfg, layout, vector).compile()
        self.tma = isinstance(cfg, TmaConfig)
        if self.tma:
            self.dtype, self.boxes = dtype, tensor_map_boxes(cfg, layout)
            self.maps: tuple[dict, dict] = ({}, {})
            a_map = TensorMap.from_pointer(a3.data_ptr(), dtype, self.a_shape, self.boxes[0])
            b_map = TensorMap.from_pointer(b3.data_ptr(), dtype, self.b_shape, self.boxes[1])
            args = (a3, b3, work, a_map, b_map, cfg.split_k, cfg.grid(m, n, batch, device().sms))
        else:
            args = (a3, b3, work, cfg.split_k)
        self.gemm = kernel.bind(args)
        self.reduce = make_split_k_reduce(dtype, cfg.split_k).compile().bind((work, c3)) if self.work_numel else None

    def _work(self, torch: Any, stream: int) -> Any:
        """This signature's float32 split-k partials on `stream` (one buffer per stream)."""
        key = (self.device, stream, self.work_numel)
        buf = _WORK.get(key)
        if buf is None:
            buf = _WORK[key] = torch.empty(self.work_numel, dtype=torch.float32, device=self.device)
        return buf

    def _map(self, which: int, ptr: int) -> bytes:
        """The tensor map's bytes for operand `which` (0: A, 1: B) at address `ptr`."""
        cache = self.maps[which]
        raw = cache.get(ptr)
        if raw is None:
            shape = self.a_shape if which == 0 else self.b_shape
            if len(cache) >= 32:
                cache.pop(next(iter(cache)))
            raw = cache[ptr] = TensorMap.from_pointer(ptr, self.dtype, shape, self.boxes[which]).raw
        return raw

    def __call__(self, a: Any, b: Any) -> Any:
        torch = _torch()
        c = torch.empty(self.out_shape, dtype=a.dtype, device=a.device)
        stream = torch_stream(c)
        ensure_current()
        ap, bp, cp = a.data_ptr(), b.data_ptr(), c.data_ptr()
        out = self._work(torch, stream).data_ptr() if self.work_numel else cp
        if self.tma:
            self.gemm((ap, bp, out), (self._map(0, ap), self._map(1, bp)), stream)
        else:
            self.gemm((ap, bp, out), (), stream)
        if self.reduce is not None:
            self.reduce((out, cp), (), stream)
        return c
