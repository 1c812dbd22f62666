"""The graph compiler's lowbit_linear anchor: the decode kernel with the epilogue fused into its
output stores (tessera.templates.epilogue), one launch per call.

Inputs at call time: [x [..., K] float16 (its rows read as one [M, K] matrix), words, scales,
biases] (tessera.graph.opdefs.lowbit); the epilogue's `acc` is the float32 product.  Up to
DECODE_MAX_M rows run on the decode kernel (tiles of 16 rows in grid.y), its config tuned per
shape when tuning is on.  More rows (`_plan_prefill`) run either the fused prefill kernel
(tessera.templates.lowbit.gemm: the dequantisation in the TMA GEMM's mainloop, one launch) or
dequantise into a temporary and run the fp16 GEMM template, or, where the operator carries its
codes in mma's k order too (a fifth input: tessera.templates.lowbit.fragment_words), the
register-A kernel (tessera.templates.lowbit.gemm_rs: dequantised straight into wgmma's A
registers); tuning picks (tessera.templates.lowbit.tune, checked against the two passes), the two passes
are the default without it.

On the CPU the kernels of tessera.templates.lowbit.cpu_kernels run it (tessera.templates.lowbit.plan_cpu).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

from tessera.errors import TuningError, UnsupportedError
from tessera.ir import dtypes, lowbit
from tessera.quant.layout import padded_shape
from tessera.runtime import cuda
from tessera.templates.epilogue import Epilogue, fuse_epilogue, identity_epilogue
from tessera.templates.gemm.plan import GemmProblem, Operand, plan_gemm
from tessera.templates.gemm.tma import BLOCK_K
from tessera.templates.kernel import EXTRA, INPUT, OUTPUT, AnchorKernel, AnchorPlan, Launch, MapSpec
from tessera.templates.lowbit import gemm_rs as rs
from tessera.templates.lowbit.decode import DecodeConfig, group_ok, make_decode
from tessera.templates.lowbit.decode_config import DECODE_MAX_M
from tessera.templates.lowbit.dequant import make_dequant_units
from tessera.templates.lowbit.gemm import make_lowbit_gemm
from tessera.templates.lowbit.tune import DEQUANT_THEN_GEMM, is_register_a, prefill_choice, tuned_decode_config
from tessera.templates.rewrite import remap_operand, rename, retype_operand, specialize, unravel

log = logging.getLogger("tessera")


def _sms() -> int:
    """The GPU's SM count from the driver (tessera.runtime.cuda.device_properties: the planning
    defaults without a GPU)."""
    return cuda.device_properties().sms


def matrix_rows(x_shape: tuple[int, ...], n: int, k: int) -> tuple[int, tuple[int, ...], Callable[..., tuple]]:
    """(M, the output shape [..., N], the kernel's (row, column) -> output index): the kernels
    read x [..., K] as the [M, K] matrix of its rows, M the product of the leading sizes."""
    if not x_shape or x_shape[-1] != k:
        raise UnsupportedError(f"lowbit_linear takes x [..., {k}], got {list(x_shape)}")
    lead = tuple(x_shape[:-1])
    return math.prod(lead), (*lead, n), lambda i, j: (*unravel(i, lead), j)


def plan_lowbit_linear(x_shape: tuple[int, ...], attrs: dict[str, Any], words: int, scales: tuple[int, int],
                       biases: tuple[int, int], epilogue: Epilogue | None = None, tune: bool = False,
                       prefill: Any = None, fragment: bool = False) -> AnchorPlan:  # fmt: skip
    """The decode kernel for x [..., K] with the epilogue in its stores; `tune` (on a GPU) times
    the candidate configs for this shape (tessera.templates.lowbit.tune), else DecodeConfig.default.  Past
    DECODE_MAX_M rows the prefill path (`_plan_prefill`; `prefill` picks it, else tuning).
    `fragment`: the call passes a fifth input, the codes in FRAGMENT_SPAN (as many words), which
    the register-A prefill kernel reads; the other kernels take it and leave it alone."""

    t = dtypes.dtype(attrs["wtype"])
    n, k, gs = attrs["n"], attrs["k"], attrs["group_size"]
    m, out_shape, rows_of = matrix_rows(x_shape, n, k)
    if k % 8:
        raise UnsupportedError(f"the low-bit kernel needs K % 8 == 0, got {k}")
    kpad = padded_shape(n, k)[1]
    group = kpad if gs >= k else gs
    if not group_ok(group):
        raise UnsupportedError(f"group size {gs} is not one the low-bit kernel takes")
    if m > DECODE_MAX_M:
        return _plan_prefill(x_shape, attrs, words, scales, biases, group, epilogue, tune, prefill, fragment)
    # the k order the graph's words were packed in (tessera.eager.quantize; 16 in older graphs)
    span = attrs.get("span", 16)
    config = DecodeConfig.default(t.nbits, m, n, k, _sms())
    if span != config.span:
        config = dataclasses.replace(config, span=span, fold=False)
    if tune and _on_gpu():
        try:
            config = tuned_decode_config(t, group, bool(attrs["has_bias"]), span, m, n, k, words, scales, biases)
        except TuningError as exc:  # (every candidate failed: the default, which the tests check)
            log.warning("tessera: lowbit_linear %s m=%d n=%d k=%d: tuning failed (%s); using %s", t.name, m, n, k,
                        exc, config)  # fmt: skip
    f = make_decode(t, group, bool(attrs["has_bias"]), config, k % lowbit.UNIT_K == 0).ir
    f = specialize(f, {"X": (m, k), "Wq": (words,), "S": scales, "B": biases, "Y": (m, n)},
                   {"KT": kpad // lowbit.UNIT_K})  # fmt: skip
    if len(x_shape) != 2:  # the caller's x [..., K] as it is: row i of the kernel is x's row unravel(i)
        f = remap_operand(f, "X", x_shape, lambda i, j: (*unravel(i, x_shape[:-1]), j))
    ep = epilogue if epilogue is not None else identity_epilogue(out_shape, dtypes.float32, dtypes.float16)
    f = rename(fuse_epilogue(f, "Y", rows_of, ep), f"lowbit_linear_{t.name}_{config}")
    slots = [(INPUT, 0), (INPUT, 1), (INPUT, 2), (INPUT, 3), (OUTPUT, 0), *((EXTRA, i) for i in range(len(ep.extras)))]
    inputs = 5 if fragment else 4
    return AnchorPlan(f.name, [Launch(f, slots)], out_shape, ep.output.dtype, inputs, len(ep.extras),
                      aligned_inputs=[0, 1], config=config)  # fmt: skip


def _plan_prefill(x_shape: tuple[int, ...], attrs: dict[str, Any], words: int, scales: tuple[int, int],
                  biases: tuple[int, int], group: int, epilogue: Epilogue | None, tune: bool,
                  prefill: Any = None, fragment: bool = False) -> AnchorPlan:  # fmt: skip
    """More than DECODE_MAX_M rows: `prefill` (else tessera.templates.lowbit.tune.prefill_choice: tuned on a
    GPU when tuning; $TESSERA_LOWBIT_PREFILL can force either) is a config of the fused kernel
    (tessera.templates.lowbit.gemm: the dequantisation in the GEMM's mainloop, the epilogue in its
    staged stores, one launch; the epilogue sees the product rounded to fp16, as the TMA GEMM's
    does) or DEQUANT_THEN_GEMM: the words dequantised to fp16 W [N, K] in a temporary (the graph
    compiler's arena: alive during the step, shared with other steps' buffers, so the model
    holds no fp16 copy of its weights), then the fp16 GEMM template with the epilogue in its
    stores (tessera.eager.lowbit.prefill_matmul's two steps, as one anchor); with `fragment`,
    the register-A kernel is a candidate too (`_plan_register_a`)."""

    t = dtypes.dtype(attrs["wtype"])
    n, k, has_bias, span = attrs["n"], attrs["k"], bool(attrs["has_bias"]), attrs.get("span", 16)
    lead = tuple(x_shape[:-1])
    out_shape = (*lead, n)
    if prefill is None:
        prefill = prefill_choice(t, group, has_bias, span, math.prod(lead), n, k, words, scales, biases,
                                 tune and _on_gpu(), register_a=fragment)  # fmt: skip
    if is_register_a(prefill):
        if not fragment:
            raise UnsupportedError(f"the register-A prefill kernel ({prefill}) reads the codes in mma's k order: "
                                   "give lowbit_linear its fifth input (tessera.templates.lowbit.fragment_words)")
        return _plan_register_a(x_shape, attrs, words, scales, biases, group, epilogue, prefill)
    inputs = 5 if fragment else 4
    if prefill != DEQUANT_THEN_GEMM:
        return _plan_fused(x_shape, attrs, words, scales, biases, group, epilogue, prefill, inputs)
    plan = AnchorPlan(f"lowbit_prefill_{t.name}", [], out_shape, dtypes.float16, inputs, 0, aligned_inputs=[0, 1])
    w16 = plan.temporary((n, k), dtypes.float16)
    f = make_dequant_units(t, group, has_bias, span).ir
    f = specialize(f, {"Wq": (words,), "S": scales, "B": biases, "Out": (n, k)})
    plan.launches.append(Launch(f, [(INPUT, 1), (INPUT, 2), (INPUT, 3), w16]))
    a = Operand((INPUT, 0), tuple(x_shape), lambda bi, r, c: (*unravel(r, lead), c), plain=True)
    b = Operand(w16, (n, k), lambda bi, r, c: (r, c), plain=True)
    problem = GemmProblem(dtypes.float16, "nk", 1, math.prod(lead), n, k, a, b, lambda z, r, c: (*unravel(r, lead), c),
                          k % 8 == 0, row_major_out=True)  # fmt: skip
    return plan_gemm("lowbit_prefill", problem, out_shape, inputs, epilogue, None, -1, tune, plan=plan)


def _with_epilogue(f: Any, x_shape: tuple[int, ...], out_shape: tuple[int, ...], rows_of: Any,
                   epilogue: Epilogue | None, name: str) -> tuple[Any, Epilogue]:  # fmt: skip
    """A prefill kernel's IR with A retyped to x's shape and the graph's epilogue (else the fp16
    identity) fused into its row-major stores of C, and that epilogue."""
    f = retype_operand(f, "A", x_shape)
    ep = epilogue if epilogue is not None else identity_epilogue(out_shape, dtypes.float32, dtypes.float16)
    return rename(fuse_epilogue(f, "C", lambda z, r, c: rows_of(r, c), ep, row_major=True), name), ep


def _plan_fused(x_shape: tuple[int, ...], attrs: dict[str, Any], words: int, scales: tuple[int, int],
                biases: tuple[int, int], group: int, epilogue: Epilogue | None, config: Any,
                inputs: int = 4) -> AnchorPlan:  # fmt: skip
    """The fused prefill kernel with x read through a tensor map as [1, M, K] and the epilogue
    in its staged (16-byte row segment) stores."""

    t = dtypes.dtype(attrs["wtype"])
    n, k = attrs["n"], attrs["k"]
    m, out_shape, rows_of = matrix_rows(x_shape, n, k)
    f = make_lowbit_gemm(t, group, bool(attrs["has_bias"]), config).ir
    f = specialize(f, {"A": (1, m, k), "Wq": (words,), "S": scales, "Z": biases, "C": (1, m, n)},
                   {"ctas": config.grid(m, n, 1, _sms())})  # fmt: skip
    f, ep = _with_epilogue(f, x_shape, out_shape, rows_of, epilogue, f"lowbit_prefill_{t.name}_{config}")
    plan = AnchorPlan(f.name, [], out_shape, ep.output.dtype, inputs, len(ep.extras), aligned_inputs=[0, 1],
                      aligned_output=True, config=config)  # fmt: skip
    tma_a = plan.tensor_map(MapSpec((INPUT, 0), dtypes.float16, (1, m, k), (1, config.block_m, BLOCK_K)))
    plan.launches.append(Launch(f, [(INPUT, 0), (INPUT, 1), (INPUT, 2), (INPUT, 3), (OUTPUT, 0), tma_a,
                                    *((EXTRA, i) for i in range(len(ep.extras)))]))  # fmt: skip
    return plan


def _plan_register_a(x_shape: tuple[int, ...], attrs: dict[str, Any], words: int, scales: tuple[int, int],
                     biases: tuple[int, int], group: int, epilogue: Epilogue | None, config: Any) -> AnchorPlan:  # fmt: skip
    """The register-A kernel (tessera.templates.lowbit.gemm_rs) reading the fifth input (the codes in
    FRAGMENT_SPAN) and x through tensor maps, the epilogue in its 16-byte row-segment stores.

    With an epilogue, a TMA-epilogue config runs the stmatrix epilogue: the TMA unit's stores have
    no place for the graph's epilogue (on the H200 the TMA epilogue was 3-4% faster at M=4096);
    without one it keeps it where TMA can write the output (RegisterAConfig.for_output).  Stream-K
    configs keep their sums and tickets in zeroed workspaces of the plan (each launch leaves them
    at zero; the plan's kernel runs on one stream at a time, as every AnchorKernel)."""

    t = dtypes.dtype(attrs["wtype"])
    n, k, has_bias = attrs["n"], attrs["k"], bool(attrs["has_bias"])
    m, out_shape, rows_of = matrix_rows(x_shape, n, k)
    if config.epilogue == "tma" and (epilogue is not None or config.for_output(n).epilogue != "tma"):
        config = dataclasses.replace(config, epilogue="stmatrix")
    sms = _sms()
    cut = config.cut_tiles(m, n, k, sms)
    if not cut:  # nothing shared at this shape: the plain kernel (see lowbit_gemm_rs.lowbit_gemm_rs)
        config = dataclasses.replace(config, stream_k=False)
    tma_out = config.epilogue == "tma"
    bad = rs.problems(t, group, has_bias, config)
    if bad:
        raise UnsupportedError(f"lowbit_linear prefill {t.name} g{group}: the register-A kernel {config}: {'; '.join(bad)}")
    sums, tickets = config.workspace(cut) if cut else (1, 1)
    f = rs.make_lowbit_gemm_rs(t, group, has_bias, config).ir
    f = specialize(f, {"A": (1, m, k), "Wq": (words,), "S": scales, "Z": biases, "C": (1, m, n), "P": (sums,), "F": (tickets,)},
                   {"ctas": config.grid(m, n, sms, k), "whole": config.whole_tiles(m, n, k, sms)})  # fmt: skip
    f, ep = _with_epilogue(f, x_shape, out_shape, rows_of, epilogue, f"lowbit_prefill_{t.name}_{config}")
    plan = AnchorPlan(f.name, [], out_shape, ep.output.dtype, 5, len(ep.extras), aligned_inputs=[0, 4],
                      aligned_output=True, config=config)  # fmt: skip
    tma_a = plan.tensor_map(MapSpec((INPUT, 0), dtypes.float16, (1, m, k), (1, config.block_t // config.cluster, BLOCK_K)))
    tma_w = plan.tensor_map(MapSpec((INPUT, 4), dtypes.uint32, rs.word_shape(words, k, t.nbits),
                                    (rs.ROWS // 16, 1, t.nbits, 128), swizzle=0))  # fmt: skip
    slab = (OUTPUT, 0) if tma_out else plan.workspace((config.block_t * 16,), dtypes.float16)  # (else never written)
    tma_c = plan.tensor_map(MapSpec(slab, dtypes.float16, (1, m, n) if tma_out else (1, config.block_t, 16),
                                    (1, config.block_t, 16), swizzle=0))  # fmt: skip
    sums_slot, tickets_slot = plan.workspace((sums,), dtypes.float32, zeroed=True), plan.workspace((tickets,), dtypes.uint32, zeroed=True)
    plan.launches.append(Launch(f, [(INPUT, 0), (INPUT, 4), (INPUT, 2), (INPUT, 3), (OUTPUT, 0), tma_a, tma_w, tma_c,
                                    sums_slot, tickets_slot, *((EXTRA, i) for i in range(len(ep.extras)))]))  # fmt: skip
    return plan


def _on_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def prepare_lowbit_linear(*args: Any, **kwargs: Any) -> AnchorKernel:
    return plan_lowbit_linear(*args, **kwargs).load()
