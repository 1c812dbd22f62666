"""GEMM anchors on the CPU: linear, matmul and conv2d on the x86 micro-kernel (tessera.templates.cpu.gemm_kernel),
float32, with the epilogue (bias, activation, residual, ...) fused into the tile stores.

The problem is described as on the GPU (`GemmProblem`: operands with index maps from the
kernel's (batch, row, column) to the caller's tensors, and the map from the kernel's output
index to the anchor's logical output), so the same rewrites adapt the kernel to each call site:
`specialize` binds the shapes, `remap_operand` reads the caller's tensors in place (a
convolution's B operand is im2col *by index map*, gathered while the kernel packs its panels),
`fuse_epilogue` replaces the stores.  A constant weight is packed into panels once, at plan
time (`weight=`), so calls read it contiguously and never repack it.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections.abc import Callable, Sequence
from math import prod
from typing import Any

import numpy as np

from tessera.backend.isa import cpu_isa, vector_lanes
from tessera.errors import ArgumentError, UnsupportedError
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.dtypes import DataType
from tessera.ir.func import Function
from tessera.templates.cpu import gemm_kernel as cpu_gemm_template
from tessera.templates.cpu.gemm_kernel import CpuGemmConfig, make_gemm, make_pack_b
from tessera.templates.epilogue import Epilogue, fuse_epilogue, identity_epilogue
from tessera.templates.gemm.plan import GemmProblem, Operand, check_epilogue, check_shape, matmul_problem, with_bias
from tessera.templates.kernel import CONSTANT, EXTRA, INPUT, OUTPUT, AnchorPlan, Launch, Slot, aligned_empty
from tessera.templates.rewrite import i32, remap_operand, rename, specialize, unravel
from tessera.tune import tuner

# (mr, nv) register tiles by vector width: MR x NV accumulators + NV B vectors + 1 broadcast fit the registers.
TILES = {16: [(8, 3), (14, 2), (6, 2), (4, 4), (12, 2), (4, 6)], 8: [(6, 2), (4, 3), (3, 3)]}


# GEMMs below this many multiply-adds run on one thread: an OpenMP team's start and join cost
# more than the work (tens of microseconds when quiet, milliseconds on a loaded machine).
MIN_PARALLEL_MACS = 1 << 22


def gemm_threads(m: int, n: int, k: int, batch: int) -> int:
    """Workers for a GEMM of this size: all of cpu_threads(), or 1 for a small one."""
    return cpu_threads() if batch * m * n * k >= MIN_PARALLEL_MACS else 1


def cpu_threads() -> int:
    """OpenMP workers for the CPU kernels: OMP_NUM_THREADS if set, else the CPUs this process may use."""
    env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def lanes_or_refuse() -> int:
    """float32 lanes of this machine's vectors (16 or 8); UnsupportedError without AVX2."""

    lanes = vector_lanes()
    if lanes == 1:
        raise UnsupportedError(f"the CPU GEMM needs AVX2 or AVX-512; this machine offers {cpu_isa()}")
    return lanes


def estimate(cfg: CpuGemmConfig, m: int, n: int, k: int, batch: int) -> float:
    """Relative cost of a configuration: the padded FMA work, plus operand loads and broadcasts
    per FMA (1/NV and 1/MR of them), plus the tile stores."""
    pm, pn = -(-m // cfg.mr) * cfg.mr, -(-n // cfg.nr) * cfg.nr
    return batch * pm * pn * (k * (1 + 1 / cfg.nv + 2 / cfg.mr) + 8)


def spill_free(cfg: CpuGemmConfig) -> bool:
    """Whether the tile leaves registers for an epilogue's per-column operands.  gcc hoists an
    epilogue's loads that do not change with the row tile (a bias slice: NV vectors) out of the
    row-tile loop and keeps them in registers across the K loop, next to the MR x NV
    accumulators, NV B vectors and the A broadcast; past regs - 4 of those (measured with gcc
    12 on AVX-512: 8 x 48 and 12 x 32 tiles) it spills the B vectors and the K loop's FMAs read
    the stack (8 x 48 with a bias: 65 GFLOP/s instead of 109)."""
    regs = 32 if cfg.lanes == 16 else 16
    return cfg.mr * cfg.nv + 2 * cfg.nv + 2 <= regs - 4


def heuristic_config(m: int, n: int, k: int, batch: int = 1, extras: bool = False) -> CpuGemmConfig:
    """The best-scored register tile for this problem at this machine's vector width; with an
    epilogue that reads other tensors (`extras`), among the tiles that leave it registers."""
    cands = gemm_space(m, n, k, batch)
    if extras:
        cands = [c for c in cands if spill_free(c)] or cands
    return min(cands, key=lambda c: (estimate(c, m, n, k, batch), -c.mr * c.nv))


def tuning_probes(data: Callable[[], tuple[list[np.ndarray], np.ndarray]], clock: Callable[[], float]
                  ) -> tuple[Callable[[Any, Any], str | None], Callable[[Any, Any], float]]:  # fmt: skip
    """The `check` and `bench` callbacks of tessera.tune for a CPU kernel called as
    kernel(operands, out), where `data()` gives (operands, float64 reference) and is called
    only when a candidate runs (a recorded winner needs neither): the relative error against
    the reference, and the fastest of five calls in microseconds by `clock` (other processes
    only add time: the minimum is the least distorted)."""

    def check(cfg: Any, kernel: Any) -> str | None:
        operands, ref = data()
        out = np.empty(ref.shape, np.float32)
        kernel(operands, out)
        err = float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))
        return None if err < 1e-4 else f"relative error {err:.2e}"

    def bench(cfg: Any, kernel: Any) -> float:
        operands, ref = data()
        out = np.empty(ref.shape, np.float32)
        kernel(operands, out)
        times = []
        for _ in range(5):
            t0 = clock()
            kernel(operands, out)
            times.append(clock() - t0)
        return min(times) * 1e6

    return check, bench


def gemm_space(m: int, n: int, k: int, batch: int) -> list[CpuGemmConfig]:
    """The register tiles tuning times for one GEMM on this machine (its vector width and threads)."""
    lanes, threads = lanes_or_refuse(), gemm_threads(m, n, k, batch)
    return [CpuGemmConfig(mr, nv, lanes, threads) for mr, nv in TILES[lanes]]


def tuned_config(m: int, n: int, k: int, batch: int, b_source: str, extras: bool = False) -> CpuGemmConfig:
    """The fastest register tile for this GEMM, timed once on this machine and cached.

    Every candidate of the schedule space (register tiles x this machine's vector width x its
    threads) is compiled (in parallel), checked against numpy, timed (fastest of a few calls)
    and the winner recorded by tessera.tune under a key of the shape, the B source, the ISA and
    the threads, and the hash of the kernel template's source.  With `extras` (the epilogue
    reads other tensors) the candidates are timed with a bias added in their store: such an
    epilogue changes which tiles spill registers (see `spill_free`)."""
    cands = gemm_space(m, n, k, batch)
    if extras:
        cands = [c for c in cands if spill_free(c)] or cands

    @functools.cache
    def arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # A, B [batch, K, N], bias
        rng = np.random.default_rng(0)
        a = rng.standard_normal((batch, m, k)).astype(np.float32)
        b = rng.standard_normal((batch, k, n)).astype(np.float32)
        return a, b, rng.standard_normal(n).astype(np.float32)

    @functools.cache
    def data() -> tuple[list[np.ndarray], np.ndarray]:  # the kernel's operands and the float64 reference
        a, b, bias = arrays()
        b_arg = b if b_source == "kn" else np.ascontiguousarray(b.transpose(0, 2, 1))
        ref = a.astype(np.float64) @ b + (bias if extras else 0.0)
        return ([a, b_arg, bias] if extras else [a, b_arg]), ref

    def build(cfg: CpuGemmConfig) -> Any:
        p, _ = matmul_problem((batch, m, k), (batch, k, n), dtypes.float32, "kn")
        if b_source == "nk":
            p.layout, p.b = "nk", Operand((INPUT, 1), (batch, n, k), lambda bi, r, c: (bi, r, c))
        packed = b_source == "packed" and batch == 1
        weight = arrays()[1][0] if packed else None
        bias_slot = (INPUT, 2) if extras else None
        return plan_cpu_gemm("tune", p, (batch, m, n), 2 + extras, None, bias_slot, -1, weight=weight, config=cfg).load()

    check, bench = tuning_probes(data, time.perf_counter)
    return tuner.tune(tuning_key(m, n, k, batch, b_source, extras), cands, build, bench, check=check,
                      template=inspect.getsource(cpu_gemm_template), workers=cpu_threads()).best  # fmt: skip


def tuning_key(m: int, n: int, k: int, batch: int, b_source: str, extras: bool) -> str:
    """The tuner's key of one GEMM problem on this machine (its ISA and threads)."""
    threads = gemm_threads(m, n, k, batch)
    return f"cpu_gemm|{b_source}|batch={batch},m={m},n={n},k={k}|isa={cpu_isa()}|threads={threads}" + ("|bias" if extras else "")


def recorded_config(m: int, n: int, k: int, batch: int, b_source: str, extras: bool = False) -> CpuGemmConfig | None:
    """The register tile tuning recorded for this GEMM on this machine, or None (nothing is tuned)."""
    return tuner.recorded(tuning_key(m, n, k, batch, b_source, extras), gemm_space(m, n, k, batch),
                          inspect.getsource(cpu_gemm_template))  # fmt: skip


def row_chunks(cfg: CpuGemmConfig, m: int, n: int, batch: int) -> int:
    """Split each column panel's rows into chunks until there are work units for every worker."""
    panels = batch * -(-n // cfg.nr)
    tiles_m = -(-m // cfg.mr)
    want = 4 * cfg.threads
    return 1 if panels >= want else max(1, min(tiles_m, -(-want // panels)))


def pack_weight(weight: np.ndarray, nr: int, layout: str, plan: AnchorPlan | None = None) -> np.ndarray:
    """A constant 2-D weight ([K, N] "kn", or [N, K] "nk") packed into zero-padded NR-wide
    panels [1, NP, K, NR] by tessera's pack kernel (whose artifact `plan` then lists)."""

    w = np.ascontiguousarray(weight, dtype=np.float32)
    k, n = w.shape if layout == "kn" else w.shape[::-1]
    packed = aligned_empty((1, -(-n // nr), k, nr), np.float32)
    packer = make_pack_b(nr, layout)
    packer(w.reshape(1, *w.shape), packed)
    if plan is not None:
        plan.helpers.append(packer.build())
    return packed


def plan_cpu_gemm(name: str, p: GemmProblem, out_shape: tuple[int, ...], num_inputs: int, epilogue: Epilogue | None,
                  bias_slot: Slot | None, channel_axis: int, *, weight: np.ndarray | None = None,
                  config: CpuGemmConfig | None = None, plan: AnchorPlan | None = None, tune: bool = False,
                  tables: Sequence[tuple[E.Var, np.ndarray]] = ()) -> AnchorPlan:  # fmt: skip
    """The plan of a CPU GEMM anchor with `epilogue` (after the bias, if any) fused into its stores.

    `weight`: the constant data of operand B as a 2-D array in `p.layout` ([K, N] or [N, K]);
    it is packed once here and the plan never reads B's slot.  The register tile is `config`,
    else the tuned one (`tune`: timed once per shape and cached), else the cost model's."""
    check_epilogue(epilogue, out_shape, name)
    if p.dtype != dtypes.float32:
        raise UnsupportedError(f"{name}: the CPU GEMM computes float32, not {p.dtype}")
    ep = epilogue
    ep_slots: list[Slot] = []
    if bias_slot is not None:
        ep = with_bias(ep, out_shape, p.dtype, channel_axis)
        ep_slots.append(bias_slot)
    elif ep is None:
        ep = identity_epilogue(out_shape, p.dtype)
    ep_slots += [(EXTRA, j) for j in range(len(epilogue.extras) if epilogue else 0)]
    if plan is None:
        plan = AnchorPlan(name, [], out_shape, dtypes.float32, num_inputs, 0, target="cpu")
    plan.out_dtype, plan.num_extras = ep.output.dtype, len(epilogue.extras) if epilogue else 0
    plan.config = add_cpu_gemm(plan, p, ep, ep_slots, name, weight=weight, config=config, tune=tune, tables=tables)
    return plan


def add_cpu_gemm(plan: AnchorPlan, p: GemmProblem, ep: Epilogue, ep_slots: list[Slot], name: str, *,
                 weight: np.ndarray | None = None, config: CpuGemmConfig | None = None, tune: bool = False,
                 out_slot: Slot = (OUTPUT, 0), tables: Sequence[tuple[E.Var, np.ndarray]] = ()) -> CpuGemmConfig:  # fmt: skip
    """Append the GEMM's launch to `plan`, `ep` fused into its stores into `out_slot`; the config used.

    `tables`: constant int32 arrays (and the tensor variables the operands' index maps read them
    through), passed to the kernel as extra parameters: an index computed once per plan instead
    of per multiply-add (the conv's im2col offsets).  A constant `weight` is the B of every batch."""
    extras = bool(ep.extras)
    if config is None and tune:
        config = tuned_config(p.m, p.n, p.k, p.batch, "packed" if weight is not None else p.layout, extras)
    cfg = config or heuristic_config(p.m, p.n, p.k, p.batch, extras)
    rc = row_chunks(cfg, p.m, p.n, p.batch)
    shapes: dict[str, tuple[int, ...]] = {"A": (p.batch, p.m, p.k), "C": (p.batch, p.m, p.n)}
    full_rows = p.m >= cfg.mr  # the last row tile shifts back: no row clamp in the K loop
    # Workers split the columns when every batch shares a weight larger than A: each then
    # streams half of it through its cache instead of all of it (a conv's deep layers).
    panel_major = weight is not None and p.batch > 1 and weight.size > prod(p.a.shape)
    if weight is not None:
        if weight.shape != ((p.k, p.n) if p.layout == "kn" else (p.n, p.k)):
            raise ArgumentError(f"{name}: the constant weight {weight.shape} does not fit the GEMM "
                                f"(K={p.k}, N={p.n}, layout {p.layout})")  # fmt: skip
        plan.constants.append(pack_weight(weight, cfg.nr, p.layout, plan))
        b_slot: Slot = (CONSTANT, len(plan.constants) - 1)
        f = make_gemm(cfg, "packed", full_rows, panel_major).ir
        packed_shape = plan.constants[-1].shape
        shapes["B"] = (p.batch, *packed_shape[1:])
    else:
        b_slot = p.b.slot
        f = make_gemm(cfg, p.layout, full_rows).ir
        shapes["B"] = (p.batch, p.k, p.n) if p.layout == "kn" else (p.batch, p.n, p.k)
        shapes["W"] = (cfg.threads, p.k * cfg.nr)
    f = specialize(f, shapes, {"RC": rc})
    f = remap_operand(f, "A", p.a.shape, p.a.index)
    if weight is None:
        f = remap_operand(f, "B", p.b.shape, p.b.index)
    elif p.batch != 1:  # one packed weight for every batch
        f = remap_operand(f, "B", packed_shape, lambda bi, jt, k, j: (i32(0), jt, k, j))
    f = rename(fuse_epilogue(f, "C", p.out_map, ep), f"{name}_gemm_{cfg}" + "_pm" * panel_major)
    slots = [p.a.slot, b_slot, out_slot]
    if weight is None:
        slots.append(plan.workspace(shapes["W"], dtypes.float32))
    slots += ep_slots
    if tables:
        f = Function(f.name, [*f.params, *(var for var, _ in tables)], f.body, f.kind, f.launch, list(f.shape_params),
                     f.source_file, f.source_line)  # fmt: skip
        for _, data in tables:
            plan.constants.append(np.ascontiguousarray(data, dtype=np.int32))
            slots.append((CONSTANT, len(plan.constants) - 1))
    plan.launches.append(Launch(f, slots))
    return cfg


def check_f32(dtype: DataType | str, op: str) -> DataType:
    dt = dtypes.dtype(dtype)
    if dt != dtypes.float32:
        raise UnsupportedError(f"{op}: the CPU GEMM template takes float32, not {dt}; use the generic path")
    return dt


def plan_cpu_linear(x_shape: Sequence[int], w_shape: Sequence[int], dtype: DataType | str = "float32", *,
                    bias: bool = False, epilogue: Epilogue | None = None, weight: np.ndarray | None = None,
                    config: CpuGemmConfig | None = None, tune: bool = False) -> AnchorPlan:  # fmt: skip
    """x @ w.T (+ bias) on the CPU: inputs [x, w] or [x, w, bias]; x [..., K], w [N, K].
    With `weight` (w's constant data) the weight is packed once and its input is never read."""
    dt = check_f32(dtype, "linear")
    x_shape, w_shape = check_shape(x_shape, "x", "linear"), check_shape(w_shape, "weight", "linear")
    if len(w_shape) != 2 or not x_shape or x_shape[-1] != w_shape[1]:
        raise ArgumentError(f"linear: x {x_shape} and weight {w_shape} do not fit ([..., K] and [N, K])")
    n, k = w_shape
    lead = x_shape[:-1]
    m = prod(lead)
    a = Operand((INPUT, 0), (m, k), lambda bi, r, c: (r, c))  # x viewed as [M, K]
    b = Operand((INPUT, 1), w_shape, lambda bi, r, c: (r, c))
    p = GemmProblem(dt, "nk", 1, m, n, k, a, b, lambda z, r, c: (*unravel(r, lead), c), False)
    return plan_cpu_gemm("linear", p, (*lead, n), 3 if bias else 2, epilogue, (INPUT, 2) if bias else None, -1,
                         weight=weight, config=config, tune=tune)  # fmt: skip


def plan_cpu_matmul(a_shape: Sequence[int], b_shape: Sequence[int], dtype: DataType | str = "float32", *,
                    epilogue: Epilogue | None = None, weight: np.ndarray | None = None,
                    config: CpuGemmConfig | None = None, tune: bool = False) -> AnchorPlan:  # fmt: skip
    """a @ b with numpy matmul semantics on the CPU (b as [..., K, N]); `weight`: b's constant data (2-D)."""
    dt = check_f32(dtype, "matmul")
    a_shape, b_shape = check_shape(a_shape, "a", "matmul"), check_shape(b_shape, "b", "matmul")
    if not a_shape or not b_shape:
        raise ArgumentError("matmul: operands must have at least one dimension")
    p, out_shape = matmul_problem(a_shape, b_shape, dt, "kn")
    if weight is not None and (len(b_shape) != 2 or p.batch != 1):
        weight = None  # only a plain 2-D weight is packed ahead
    return plan_cpu_gemm("matmul", p, out_shape, 2, epilogue, None, -1, weight=weight, config=config, tune=tune)
