"""`matmul`: the tuned tensor-core GEMM on torch CUDA tensors.

The schedule space is hardware-centric (Hidet): a fixed list of block/warp tiles, k-depths,
pipeline stages and split-k factors that suit an SM90 GPU, pruned only where a shape makes a
candidate pointless (a 256-row tile for M = 16, split-k when there are already several waves
of tiles).  Every surviving candidate is compiled in parallel, checked once against torch.matmul, timed
on the device, and the winner is cached per (dtype, layout, shape, GPU, template source) by
tessera.tune.
"""

from __future__ import annotations

import functools
import statistics
import sys
from pathlib import Path
from typing import Any

from tessera.errors import ArgumentError, UnsupportedError
from tessera.ir import dtypes
from tessera.ir.dtypes import DataType
from tessera.kernels import gemm, gemm_sm90, gemm_tma
from tessera.kernels.gemm import GemmConfig, make_gemm, make_split_k_reduce
from tessera.kernels.gemm_sm90 import WgmmaConfig, make_gemm_wgmma

# The schedule space, the split-k rule and the cost model live in one place (gemm_space);
# these names are re-exported for the callers that tune or inspect it.
from tessera.kernels.gemm_space import Config, device, families, heuristic_config, schedule_space, tma_space  # noqa: E402,F401
from tessera.kernels.gemm_tma import TmaConfig, make_gemm_tma, tensor_map_boxes
from tessera.runtime.cuda import ensure_current, torch_stream
from tessera.runtime.tensor_map import TensorMap
from tessera.target import SM90
from tessera.tune import tune


def _torch() -> Any:
    try:
        import torch
    except ImportError:  # pragma: no cover - the GPU machine has torch
        raise UnsupportedError("tessera.kernels.matmul works on torch CUDA tensors; install torch") from None
    return torch


_TORCH_DTYPES = {"float16": dtypes.float16, "bfloat16": dtypes.bfloat16}


def _check(a: Any, b: Any, b_layout: str) -> tuple[Any, int, int, int, int]:
    torch = _torch()
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        raise ArgumentError("matmul takes torch tensors")
    if not (a.is_cuda and b.is_cuda) or a.device != b.device:
        raise ArgumentError(f"matmul needs both operands on one CUDA device, got {a.device} and {b.device}")
    name = str(a.dtype).removeprefix("torch.")
    if name not in _TORCH_DTYPES or a.dtype != b.dtype:
        raise UnsupportedError(f"matmul takes float16 or bfloat16 operands of one dtype, got {a.dtype} and {b.dtype}")
    if a.dim() not in (2, 3) or b.dim() != a.dim():
        raise ArgumentError(f"matmul takes two 2-D or two 3-D (batched) tensors, got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    batch = a.shape[0] if a.dim() == 3 else 1
    m, k = a.shape[-2:]
    kb, n = b.shape[-2:] if b_layout == "kn" else (b.shape[-1], b.shape[-2])
    if kb != k or (a.dim() == 3 and b.shape[0] != batch):
        raise ArgumentError(f"matmul shapes do not match: A {tuple(a.shape)}, B {tuple(b.shape)} (b_layout={b_layout!r})")
    if min(m, n, k, batch) == 0:
        raise ArgumentError(f"matmul of empty tensors: A {tuple(a.shape)}, B {tuple(b.shape)}")
    return _TORCH_DTYPES[name], batch, m, n, k


def _vector_ok(a: Any, b: Any, n: int, k: int, b_layout: str) -> bool:
    """cp.async moves 16-byte chunks: rows must start 16-byte aligned."""
    row_b = n if b_layout == "kn" else k
    return k % 8 == 0 and row_b % 8 == 0 and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0


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


GRAPH_CALLS = 20  # launches per captured graph: a candidate's time is a replay's / GRAPH_CALLS
GRAPH_REPLAYS = 7  # timed replays; the median is taken
COLD_FACTOR = 2  # rotated operand sets read this many times L2 per replay (operands come from HBM)


def operand_sets(a: Any, b: Any) -> list[tuple[Any, Any]]:
    """(a, b) and enough copies that GRAPH_CALLS calls taking them in turn read COLD_FACTOR
    times L2: each call then reads its operands from HBM, as a model's weights are read,
    without an L2 flush inside the timed region."""
    per_call = a.numel() * a.element_size() + b.numel() * b.element_size()
    count = min(GRAPH_CALLS, max(1, -(-COLD_FACTOR * device().l2_bytes // max(per_call, 1))))
    return [(a, b)] + [(a.clone(), b.clone()) for _ in range(count - 1)]


def _bench(run: Any) -> float:
    return graph_bench(run, GRAPH_CALLS)


def graph_bench(run: Any, calls: int) -> float:
    """A candidate's time (µs): `calls` calls `run(i)` (i = 0, 1, ...: the operand set to use)
    captured in one CUDA graph, the median of GRAPH_REPLAYS replays divided by the calls.

    Launched one by one from Python and timed with an event pair each, a GEMM of a few µs
    measured its host's launch path more than itself (H200: event times of 10-60 µs for a
    5 µs kernel, run to run; tuned picks were chance, and resnet50 bs16 ran 0.84-1.09 ms with
    different picks).  Replayed from a graph, the calls run back to back, with programmatic
    launch where tessera uses it, as they do inside a compiled model's graph."""
    torch = _torch()
    stream = _capture_stream(torch)
    stream.wait_stream(torch.cuda.current_stream())  # (the operands were made there)
    with torch.cuda.stream(stream):  # (on the capture stream: what a kernel keeps per stream is made now)
        run(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            run(i)
    graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(GRAPH_REPLAYS)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    del graph
    return statistics.median(start.elapsed_time(end) for start, end in events) * 1e3 / calls


_CAPTURE_STREAMS: dict = {}


def _capture_stream(torch: Any) -> Any:
    """One stream per device for graph_bench's captures: a warm-up call on it first makes what a
    kernel keeps per stream (the register-A GEMM's stream-K sums), which a capture cannot."""
    device = torch.cuda.current_device()
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


@functools.cache
def template_source() -> str:
    """The source the GEMM candidates are generated and launched from: its hash is part of
    every GEMM tuning record's key, so an edited template is re-tuned, never given a stale winner."""
    modules = (gemm, gemm_sm90, gemm_tma, sys.modules[__name__])
    parts = [Path(m.__file__).read_text(errors="replace") for m in modules if m.__file__]
    return "\n".join(parts)


def check_result(out: Any, ref: Any) -> str | None:
    """None when `out` matches the float32 reference `ref` elementwise (within fp16/bf16
    rounding and float32 accumulation-order error), else what is wrong."""
    torch = _torch()
    out, ref = out.float(), ref.float()
    if out.shape != ref.shape:
        return f"shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    err = (out - ref).abs()
    bad = ~(err <= 1e-2 * ref.abs() + 1e-3 * scale)  # NaN counts as bad
    if bool(bad.any()):
        worst = float(torch.nan_to_num(err, nan=float("inf")).max())
        return f"{int(bad.sum())} of {out.numel()} elements differ from torch.matmul in float32 (max error {worst:.3g})"
    return None


def choose_config(a: Any, b: Any, b_layout: str = "kn") -> Any:
    """The tuned configuration for these operands' shape (tunes on first use, then cached):
    `config_for_shape` on the operands' shape, dtype and alignment."""
    dtype, batch, m, n, k = _check(a, b, b_layout)
    return config_for_shape(dtype, b_layout, batch, m, n, k, _vector_ok(a, b, n, k, b_layout), tune=True)


def config_for_shape(dtype: DataType, layout: str, batch: int, m: int, n: int, k: int, vector: bool, *, tune: bool,
                     tma: bool = True, wgmma: bool = True) -> Config:  # fmt: skip
    """The GEMM schedule for one shape, what every GEMM caller goes through: the tuner's winner
    over the best family's space (tessera.kernels.gemm_space) when `tune` (compiles and times
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
    tdt = getattr(torch, dtype.name)
    a = torch.empty((batch, m, k), dtype=tdt, device="cuda")
    b = torch.empty((batch, k, n) if layout == "kn" else (batch, n, k), dtype=tdt, device="cuda")
    return _tuned(a, b, layout, dtype, batch, m, n, k, vector, tma=tma, wgmma=wgmma)


def _tuned(a: Any, b: Any, layout: str, dtype: Any, batch: int, m: int, n: int, k: int, vector: bool,
           tma: bool = False, wgmma: bool = True) -> Any:  # fmt: skip
    """The tuned configuration over gemm_space.schedule_space: the TMA GEMM's space with `tma`
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

    def plan(cfg: Any) -> _CallPlan:
        return _CallPlan(cfg, dtype, layout, vector, a3, b3, c3, True)

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
        return _bench(lambda i: p(*sets[i % len(sets)]))

    record = tune(key, candidates, build=lambda cfg: make_kernel(dtype, cfg, layout, vector).compile(), bench=bench,
                  check=check, template=template_source())  # fmt: skip
    return record.best


class _CallPlan:
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


_PLANS: dict[tuple, _CallPlan] = {}


def matmul(a: Any, b: Any, *, b_layout: str = "kn", config: GemmConfig | WgmmaConfig | TmaConfig | None = None) -> Any:
    """A @ B on tensor cores for float16/bfloat16 torch CUDA tensors, float32 accumulation.

    `a` is [M, K] or [batch, M, K]; `b` is [K, N] (b_layout="kn") or [N, K] ("nk", as a
    linear layer's weight), with the same batch.  Without `config` the schedule is tuned for
    this shape on first use and cached.  Returns a new tensor of a's dtype.

    The first call with a signature (shapes, dtypes, devices, layout, config) checks the
    operands and resolves the kernel; later calls with contiguous, 16-byte aligned operands of
    that signature go straight to the launches (a few µs of host time).
    """
    torch = _torch()
    key = None
    if type(a) is torch.Tensor and type(b) is torch.Tensor:
        key = (b_layout, config, a.dtype, b.dtype, a.get_device(), b.get_device(), a.shape, b.shape)
        plan = _PLANS.get(key)
        if plan is not None and a.is_contiguous() and b.is_contiguous():
            if not plan.vector or not (a.data_ptr() | b.data_ptr()) & 15:
                return plan(a, b)
    if b_layout not in ("kn", "nk"):
        raise ArgumentError(f"b_layout must be 'kn' or 'nk', got {b_layout!r}")
    dtype, batch, m, n, k = _check(a, b, b_layout)
    a, b = a.contiguous(), b.contiguous()
    vector = _vector_ok(a, b, n, k, b_layout)
    cfg = config or choose_config(a, b, b_layout)
    if isinstance(cfg, WgmmaConfig) and (b_layout != "nk" or not vector):
        raise UnsupportedError(f"{cfg} needs b_layout='nk' and 16-byte aligned rows (K % 8 == 0)")
    if isinstance(cfg, TmaConfig) and not vector:
        raise UnsupportedError(f"{cfg} needs 16-byte aligned rows and operands (K and, for 'kn', N multiples of 8)")
    c3 = torch.empty((batch, m, n), dtype=a.dtype, device=a.device)
    a3, b3 = a.reshape(batch, m, k), b.reshape(batch, *b.shape[-2:])
    plan = _CallPlan(cfg, dtype, b_layout, vector, a3, b3, c3, a.dim() == 3)
    if key is not None:
        if len(_PLANS) >= 1024:
            _PLANS.pop(next(iter(_PLANS)))
        _PLANS[key] = plan
    return plan(a, b)
