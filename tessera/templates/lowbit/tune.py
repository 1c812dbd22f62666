"""Tuning the low-bit decode kernel per shape (tessera.templates.lowbit.decode) for the graph's
lowbit_linear anchor.

`DecodeConfig.default` is a rule fitted to one shape (K=4096, N=12288).  A model's projections
are smaller (the 1.1B Llama's are 2048-11264 rows of 2048-5632), where the kernel's fixed
costs weigh more and the best split, ring and register budget differ.  With `tune` (the graph
compiler's default) the anchor times `DecodeConfig.candidates` for its shape with the generic
tuner (tessera.tune.tuner): each candidate is built, checked against the default config's
result on random words, then timed inside a CUDA graph on enough copies of the weights that
every call reads them from HBM, as a model's layers do.  The winner is recorded per shape,
weight type, group, zero points and GPU, so a later compile reuses it without timing.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from tessera import settings
from tessera.errors import TuningError
from tessera.ir.dtypes import DataType
from tessera.ir.lowbit import FRAGMENT_SPAN
from tessera.quant import codecs
from tessera.quant.layout import pack_units
from tessera.runtime import cuda
from tessera.runtime.cuda import multiprocessor_count
from tessera.target import SM90
from tessera.templates.gemm import tma as gemm_tma
from tessera.templates.lowbit import decode as lowbit_decode
from tessera.templates.lowbit import decode_config as lowbit_decode_config
from tessera.templates.lowbit import dequant as lowbit_dequant
from tessera.templates.lowbit import gemm as lowbit_gemm
from tessera.templates.lowbit import gemm_rs as lowbit_gemm_rs
from tessera.templates.lowbit.decode import make_decode
from tessera.templates.lowbit.decode_config import DecodeConfig
from tessera.templates.lowbit.dequant import dequantize_words, make_dequant_units
from tessera.templates.lowbit.gemm_rs_config import CONFIGS, STREAM_K_CONFIGS, RegisterAConfig, problems
from tessera.tune import tuner
from tessera.tune.timing import COLD_FACTOR, check_result, graph_bench

log = logging.getLogger("tessera")

MAX_COPIES = 64  # weight copies the timed graph cycles through (small weights: L2 is 50-60 MB)


def decode_candidates(bits: int, m: int, n: int, k: int, sms: int, span: int) -> list[DecodeConfig]:
    """The sweep's candidates that read words packed in the k order `span` (a graph holds one)."""
    default = DecodeConfig.default(bits, m, n, k, sms)
    if default.span != span:
        default = dataclasses.replace(default, span=span, fold=False)
    out = [default]
    others = [*DecodeConfig.candidates(bits, m, n, k, sms).values(),
              *(dataclasses.replace(default, split=s) for s in (2, 4, 8)),  # the split and the block size
              *(dataclasses.replace(default, warps=w, min_blocks=0) for w in (2, 8))]  # fmt: skip
    for c in others:
        if c.span == span and c not in out and not c.problems() and (c.x_units == 0 or c.x_units >= -(-k // 256 // c.split)):
            out.append(c)
    return out


def finite_words(wtype: DataType, span: int, words: int) -> Any:
    """An int32 mask [words] that, ANDed into random words, leaves only finite codes: the
    exponent's top bit cleared in every e4m3 / e5m2 field (their inf and NaN codes have it
    set); all ones for the other types.  Every unit of the layout has the same fields."""
    import numpy as np
    import torch

    if wtype.name not in ("e4m3", "e5m2"):
        return torch.full((words,), -1, dtype=torch.int32)
    keep = (1 << wtype.nbits) - 1 & ~(1 << (wtype.nbits - 2))  # (floats are stored as their codes)
    unit = pack_units(np.full((16, 256), keep), wtype, span).view(np.int32)
    return torch.from_numpy(np.resize(unit, words))


def random_operands(wtype: DataType, span: int, m: int, n: int, k: int, words: int, scales: tuple[int, int],
                    biases: tuple[int, int]) -> tuple[Any, Any, Any, Any, Any]:  # fmt: skip
    """(words, scales, biases, x [m, k], y [m, n]) on the GPU to tune with: random codes (finite
    ones: `finite_words`), scales around 1/64, biases in the codes' range, fp16 activations."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    wq = torch.randint(-(2**31), 2**31 - 1, (words,), generator=gen, device="cuda", dtype=torch.int32)
    wq = (wq & finite_words(wtype, span, words).to("cuda")).view(torch.uint32)
    sc = (torch.rand(scales, generator=gen, device="cuda") / 64 + 1 / 128).half()
    bz = torch.randint(0, 1 << wtype.nbits, biases, generator=gen, device="cuda").half()
    x = torch.randn((m, k), generator=gen, device="cuda").half()
    return wq, sc, bz, x, torch.empty((m, n), dtype=torch.float16, device="cuda")


def _sources(*modules: Any) -> str:
    return "\n".join(Path(m.__file__).read_text(errors="replace") for m in modules)


def template_source() -> str:
    """The decode kernel and config sources: their hash keys the records (an edit re-tunes)."""

    return _sources(lowbit_decode, lowbit_decode_config)


def tuned_decode_config(wtype: DataType, group: int, has_bias: bool, span: int, m: int, n: int, k: int,
                        words: int, scales: tuple[int, int], biases: tuple[int, int]) -> DecodeConfig:  # fmt: skip
    """The fastest correct decode config for x [m, k] and these operand sizes on the current GPU
    (`words` uint32 words, float16 scales and biases of the given shapes), from the tuning
    record when one exists."""
    import torch

    sms = multiprocessor_count()
    candidates = decode_candidates(wtype.nbits, m, n, k, sms, span)
    kt = -(-k // 256)
    k_whole = k % 256 == 0
    gpu = torch.cuda.get_device_name()
    key = f"lowbit_decode|{wtype.name}|g{group}|{'z' if has_bias else 'nz'}|span{span}|m{m}|n{n}|k{k}|{gpu}"
    wq, sc, bz, x, y = random_operands(wtype, span, m, n, k, words, scales, biases)
    ref: list[Any] = []
    per_call = words * 4 + sc.numel() * 2
    copies = min(MAX_COPIES, max(1, -(-COLD_FACTOR * cuda.device_properties().l2_bytes // per_call)))
    sets: list[tuple[Any, Any]] = []

    def kernel(c: DecodeConfig) -> Any:
        return make_decode(wtype, group, has_bias, c, k_whole)

    def check(c: DecodeConfig, _: Any) -> str | None:
        if not ref:
            out = torch.empty_like(y)
            kernel(candidates[0])(x, wq, sc, bz, out, kt)
            ref.append(out.float())
        kernel(c)(x, wq, sc, bz, y, kt)
        torch.cuda.synchronize()
        return check_result(y, ref[0])

    def bench(c: DecodeConfig, _: Any) -> float:
        if not sets:
            sets.extend([(wq, sc)] + [(wq.clone(), sc.clone()) for _ in range(copies - 1)])
        kern = kernel(c)
        return graph_bench(lambda i: kern(x, *sets[i % copies], bz, y, kt), max(copies, 20))

    record = tuner.tune(key, candidates, build=lambda c: kernel(c).build(), bench=bench, check=check,
                  template=template_source())  # fmt: skip
    if not record.from_cache:
        log.info("tessera: lowbit_linear %s m=%d n=%d k=%d: %s (default %s: %.1f us, tuned %.1f us)", wtype.name, m, n,
                 k, record.best, candidates[0], record.times_us.get(str(candidates[0]), float("nan")),
                 record.times_us.get(str(record.best), float("nan")))  # fmt: skip
    return record.best


# ---- prefill: the fused kernels against dequantising first -------------------------------------------------------
DEQUANT_THEN_GEMM = "dequant_then_gemm"  # the two-pass path: words -> fp16 W (lowbit_dequant), then the fp16 GEMM


def is_register_a(choice: Any) -> bool:
    """Whether a prefill choice is a config of the register-A kernel (tessera.templates.lowbit.gemm_rs)."""

    return isinstance(choice, RegisterAConfig)


def prefill_choice(wtype: DataType, group: int, has_bias: bool, span: int, m: int, n: int, k: int, words: int,
                   scales: tuple[int, int], biases: tuple[int, int], tune: bool,
                   register_a: bool = False) -> Any:  # fmt: skip
    """How m rows run past the decode sizes: DEQUANT_THEN_GEMM or a fused kernel's config, by
    $TESSERA_LOWBIT_PREFILL (with 'auto', `tuned_prefill` when `tune`, else the two passes);
    `register_a`: the caller can give the words in FRAGMENT_SPAN too (see prefill_candidates).
    A forced kernel that cannot serve the weights (another k order, not SM90, too many
    registers), or tuning that fails, falls back to the two passes with a warning."""
    mode = settings.lowbit_prefill()
    if mode == "dequant" or (mode == "auto" and not tune):
        return DEQUANT_THEN_GEMM
    candidates = prefill_candidates(wtype, group, has_bias, span, register_a)
    if mode in ("fused", "register"):
        forced = [c for c in candidates[1:] if is_register_a(c) == (mode == "register")]
        if not forced:
            log.warning("tessera: %s=%s: that kernel cannot run %s g%d%s words here (k order %d%s); dequantising "
                        "first", settings.LOWBIT_PREFILL.name, mode, wtype.name, group, " with zero points" if has_bias else "", span,
                        "" if register_a else ", no fragment-order copy")  # fmt: skip
        return forced[0] if forced else DEQUANT_THEN_GEMM

    try:
        return tuned_prefill(wtype, group, has_bias, span, m, n, k, words, scales, biases, register_a)
    except TuningError as exc:  # (every candidate failed: the two passes, which the tests check)
        log.warning("tessera: lowbit_linear prefill %s m=%d n=%d k=%d: tuning failed (%s); dequantising first",
                    wtype.name, m, n, k, exc)  # fmt: skip
        return DEQUANT_THEN_GEMM


def prefill_candidates(wtype: DataType, group: int, has_bias: bool, span: int, register_a: bool = False) -> list[Any]:
    """DEQUANT_THEN_GEMM first (the default, measured path), then on SM90 the fused kernel's
    tiles (tessera.templates.lowbit.gemm) when the words are in its k order (span 2), and the
    register-A kernel's configs (tessera.templates.lowbit.gemm_rs) when `register_a`: the caller
    holds (or makes) the words in FRAGMENT_SPAN too, as PreparedWeight.words_for does."""

    out: list[Any] = [DEQUANT_THEN_GEMM]
    if cuda.device_properties().capability != SM90.capability:
        return out
    if span == lowbit_gemm.SPAN:
        out += lowbit_gemm.buildable_configs(wtype, group, has_bias)
    if register_a:
        out += [c for c in CONFIGS if not problems(wtype, group, has_bias, c)]
    return out


def stream_k_candidates(wtype: DataType, group: int, has_bias: bool, m: int, n: int, k: int,
                        sms: int | None = None) -> list[Any]:  # fmt: skip
    """The register-A kernel's stream-K configs that cut every tile at this shape (fewer tiles
    than `sms`, the GPU's SMs by default: a short prompt).  Not where only a partial last round
    is shared: on the H200 at M=4096, N=12288 the shares' float32 adds at the L2 cost ~20 us
    (plain stores in their place, results wrong, ran 552 against 573 us) of the ~16 a balanced
    last round saves, where at M=128 they cost ~0.7 of 14.5 us
    (bench/results/2026-11-29-h200-lowbit-stream-k.md).  None while torch's deterministic
    algorithms are on: the shares' adds meet in a different order from run to run, which can
    move a result by float32 rounding (a last fp16 bit)."""

    if _deterministic():
        return []
    if sms is None:
        sms = multiprocessor_count()
    return [c for c in STREAM_K_CONFIGS
            if not problems(wtype, group, has_bias, c) and c.cut_tiles(m, n, k, sms) == c.tiles(m, n) > 0]  # fmt: skip


def _deterministic() -> bool:
    """Whether torch's deterministic algorithms are on (torch.use_deterministic_algorithms)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.are_deterministic_algorithms_enabled()


def host_codes_words(wtype: DataType, n: int, k: int, spans: tuple[int, ...]) -> list[Any]:
    """Random codes (finite ones for the floats) packed in each k order of `spans`: uint32
    words on the GPU holding the same weights, for checking kernels that read different orders."""
    import numpy as np
    import torch

    codes = np.random.default_rng(0).integers(0, 1 << wtype.nbits, size=(n, k), dtype=np.uint8)
    if wtype.is_float:
        table = np.isfinite(codecs.decode(np.arange(1 << wtype.nbits, dtype=np.uint8), wtype))
        codes = np.where(table[codes], codes, 0).astype(np.uint8)
    return [torch.from_numpy(pack_units(codes, wtype, span)).cuda() for span in spans]


def tuned_prefill(wtype: DataType, group: int, has_bias: bool, span: int, m: int, n: int, k: int,
                  words: int, scales: tuple[int, int], biases: tuple[int, int], register_a: bool = False) -> Any:  # fmt: skip
    """DEQUANT_THEN_GEMM or a fused kernel's config (prefill_candidates), whichever computes
    x [m, k] @ W^T fastest on the current GPU with these operand sizes, checked against the
    two-pass result first (a candidate that differs is skipped with a warning, never chosen);
    from the tuning record when one exists.  The two passes are timed as the eager path runs
    them (the dequantiser, then cuBLAS through torch; tessera's fp16 GEMM runs at its speed);
    the register-A kernel reads the same codes packed in FRAGMENT_SPAN."""
    import torch

    # (the register-A configs as a launch with this N runs them: see RegisterAConfig.for_output;
    # with them the stream-K ones that cut tiles at this shape)
    candidates = prefill_candidates(wtype, group, has_bias, span, register_a)
    if any(map(is_register_a, candidates)):
        candidates += stream_k_candidates(wtype, group, has_bias, m, n, k)
    candidates = list(dict.fromkeys(c.for_output(n) if is_register_a(c) else c for c in candidates))
    if len(candidates) == 1:
        return candidates[0]
    gpu = torch.cuda.get_device_name()
    key = (f"lowbit_prefill|{wtype.name}|g{group}|{'z' if has_bias else 'nz'}|span{span}{'+ra' if register_a else ''}"
           f"|m{m}|n{n}|k{k}|{gpu}{'|det' if _deterministic() else ''}")  # fmt: skip
    wq, sc, bz, x, y = random_operands(wtype, span, m, n, k, words, scales, biases)
    if any(map(is_register_a, candidates)):  # the same weights in both orders: one reference checks all
        wq, wq_fragment = host_codes_words(wtype, n, k, (span, FRAGMENT_SPAN))
    w16 = torch.empty((n, k), dtype=torch.float16, device="cuda")

    def run(c: Any) -> None:
        if c == DEQUANT_THEN_GEMM:
            dequantize_words(wq, sc, bz, w16, wtype, group, has_bias, span)
            torch.matmul(x, w16.T, out=y)
        elif is_register_a(c):
            lowbit_gemm_rs.lowbit_gemm_rs(x, wq_fragment, sc, bz, y, wtype, group, has_bias, c)
        else:
            lowbit_gemm.lowbit_gemm(x, wq, sc, bz, y, wtype, group, has_bias, c)

    ref: list[Any] = []

    def check(c: Any, _: Any) -> str | None:
        if not ref:
            run(DEQUANT_THEN_GEMM)
            ref.append(y.float())
        y.fill_(float("nan"))
        run(c)
        torch.cuda.synchronize()
        return check_result(y, ref[0])

    record = tuner.tune(key, candidates, build=lambda c: prefill_kernel(wtype, group, has_bias, span, c).build(),
                  bench=lambda c, _: graph_bench(lambda i: run(c), 10), check=check, template=prefill_source())  # fmt: skip
    if not record.from_cache:
        log.info("tessera: lowbit_linear prefill %s m=%d n=%d k=%d: %s (%s)", wtype.name, m, n, k, record.best,
                 ", ".join(f"{name} {us:.1f} us" for name, us in record.times_us.items()))  # fmt: skip
    return record.best


def prefill_kernel(wtype: DataType, group: int, has_bias: bool, span: int, choice: Any) -> Any:
    """The kernel a prefill candidate launches (for DEQUANT_THEN_GEMM, its dequantiser): what
    tuning builds, and what a benchmark may build ahead for many shapes at once."""

    if choice == DEQUANT_THEN_GEMM:
        return make_dequant_units(wtype, group, has_bias, span)
    if is_register_a(choice):
        return lowbit_gemm_rs.make_lowbit_gemm_rs(wtype, group, has_bias, choice)
    return lowbit_gemm.make_lowbit_gemm(wtype, group, has_bias, choice)


def prefill_source() -> str:
    """The prefill candidates' sources (the fused kernels with the GEMM and decode pieces they
    use, the dequantiser): their hash keys the prefill records."""

    return _sources(lowbit_gemm, lowbit_gemm_rs, gemm_tma, lowbit_decode, lowbit_dequant)
