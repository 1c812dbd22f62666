"""Low-bit linear layers: y = x @ W^T with W a QuantizedWeight, on CUDA (the decode kernel,
tessera.templates.lowbit.decode) and on the CPU (tessera.templates.lowbit.cpu_kernels, the reference path).

`PreparedWeight` holds what the CUDA kernels read, made once per weight: the words in the
pack-time layout, float16 scales (times 2**float_shift for the small floats) and float16
biases (zero point + the signed types' offset).  The decode kernel and the prefill path's
dequantiser (tessera.templates.lowbit.dequant) read the same words: the codes live on the device
once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tessera import settings
from tessera.errors import ArgumentError, TuningError, UnsupportedError
from tessera.ir import lowbit
from tessera.quant.layout import pack_units, padded_shape
from tessera.quant.quantize import QuantizedWeight
from tessera.runtime.cuda import multiprocessor_count
from tessera.templates.lowbit.cpu_kernels import make_linear_cpu
from tessera.templates.lowbit.decode import DecodeConfig, group_ok, make_decode, unit_scales
from tessera.templates.lowbit.decode_config import DECODE_MAX_M
from tessera.templates.lowbit.dequant import dequantize_words
from tessera.templates.lowbit.gemm import SPAN, lowbit_gemm
from tessera.templates.lowbit.gemm_rs import lowbit_gemm_rs
from tessera.templates.lowbit.tune import DEQUANT_THEN_GEMM, is_register_a, prefill_choice, tuned_decode_config

log = logging.getLogger("tessera")

# The k order `PreparedWeight.words` holds: the one the default decode configs (DecodeConfig.default),
# the dequantiser and the fused prefill kernel read, so an eager model keeps one copy of its words.
PREPARED_SPAN = 2


@dataclass
class PreparedWeight:
    """A QuantizedWeight laid out for the CUDA kernels (torch tensors on one device)."""

    weight: QuantizedWeight
    words: Any  # uint32 [padded N * padded K * bits / 32], k order PREPARED_SPAN
    scales: Any  # float16 [N, G]
    biases: Any  # float16 [N, G], or a [1, 1] placeholder when there are no zero points
    k_tiles: int
    kernel_group: int  # the group size the kernel is built for (padded K when per channel)
    cache: dict = field(default_factory=dict)

    def words_for(self, span: int) -> Any:
        """The words packed in the k order `span` (tessera.ir.lowbit.ORDERS): `words` for
        PREPARED_SPAN; another is packed on first use (a tuned span-16 config, the register-A
        prefill kernel's FRAGMENT_SPAN) and kept."""
        if span == PREPARED_SPAN:
            return self.words
        got = self.cache.get(("words", span))
        if got is None:
            import torch

            packed = pack_units(self.weight.codes.codes(), self.weight.dtype, span)
            got = self.cache[("words", span)] = torch.from_numpy(packed).to(self.words.device)
        return got

    def unit_scaled(self) -> tuple[Any, Any]:
        """(scales, biases) laid out per unit for the span-2 kernels (lowbit_decode.unit_scales),
        made on first use and kept; biases stay the [1, 1] placeholder without zero points."""
        got = self.cache.get("unit_scales")
        if got is None:
            import torch

            def lay(t: Any) -> Any:
                return torch.from_numpy(unit_scales(t.cpu().numpy(), self.kernel_group, self.k_tiles)).to(t.device)

            got = self.cache["unit_scales"] = (lay(self.scales), lay(self.biases) if self.weight.zeros is not None
                                               else self.biases)  # fmt: skip
        return got


def kernel_scales_and_biases(w: QuantizedWeight) -> tuple[np.ndarray, np.ndarray | None]:
    """float16 scales and biases in the dequant instruction's terms: W = (u - bias) * scale."""
    t = w.dtype
    if t.is_float:
        s = w.scales.astype(np.float64) * 2.0 ** lowbit.float_shift(t)
        s16 = s.astype(np.float16)
        if not np.all(np.isfinite(s16)):
            raise UnsupportedError(f"a scale times 2**{lowbit.float_shift(t)} overflows float16 for {t}; the CUDA "
                                   "kernel cannot take weights this large (rescale them, or run on the CPU)")  # fmt: skip
        return s16, None
    if w.zeros is None:
        return w.scales, None
    offset = 1 << (t.nbits - 1) if t.kind == "int" else 0
    return w.scales, (w.zeros.astype(np.float64) + offset).astype(np.float16)


def prepare(w: QuantizedWeight, device: str = "cuda") -> PreparedWeight:
    import torch

    n, k = w.shape
    _, kpad = padded_shape(n, k)
    words = pack_units(w.codes.codes(), w.dtype, PREPARED_SPAN)
    scales, biases = kernel_scales_and_biases(w)
    to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)  # noqa: E731
    group = kpad if w.group_size >= k else w.group_size
    return PreparedWeight(w, to(words), to(scales), to(biases if biases is not None else np.zeros((1, 1), np.float16)),
                          kpad // lowbit.UNIT_K, group)  # fmt: skip


def cpu_matmul(x: np.ndarray, w: QuantizedWeight) -> np.ndarray:
    """x [M, K] float32 @ W^T -> [M, N] float32 with the tessera CPU kernel (packed loads)."""

    x = np.ascontiguousarray(x, dtype=np.float32)
    n, k = w.shape
    if x.ndim != 2 or x.shape[1] != k:
        raise ArgumentError(f"x must be [M, {k}], got {list(x.shape)}")
    zeros = w.zeros if w.zeros is not None else np.zeros((1, 1), np.int32)
    y = np.empty((x.shape[0], n), np.float32)
    if not x.shape[0]:  # an empty batch (the kernel refuses empty arguments)
        return y
    make_linear_cpu(w.dtype, w.zeros is not None)(x, w.codes, w.scales, np.ascontiguousarray(zeros, np.int32), y,
                                                  w.group_size)  # fmt: skip
    return y




def prefill_matmul(x: Any, p: PreparedWeight, out: Any = None) -> Any:
    """Prefill sizes, by `_prefill_choice`: one of the fused kernels, one launch (the
    register-A kernel, tessera.templates.lowbit.gemm_rs, dequantising into wgmma's A registers
    from a second copy of the words in FRAGMENT_SPAN, packed on first use and kept: bits/16 of
    the fp16 weights' memory; or tessera.templates.lowbit.gemm, dequantising into shared memory
    in the TMA GEMM's mainloop), or the weights dequantised to fp16 from the words the decode
    kernel reads (tessera.templates.lowbit.dequant: one pass, words in, W16 out), then
    x @ W16^T on the tensor cores (cuBLAS through torch).  W16 is a workspace of each call,
    from torch's caching allocator (keeping it per weight would hold 16 / bits times the
    weights' memory for every layer)."""
    import torch

    w = p.weight
    choice = _prefill_choice(p, x.shape[0])
    if is_register_a(choice):
        y = out if out is not None else torch.empty((x.shape[0], w.shape[0]), dtype=torch.float16, device=x.device)
        lowbit_gemm_rs(x.contiguous(), p.words_for(lowbit.FRAGMENT_SPAN), p.scales, p.biases, y, w.dtype,
                       p.kernel_group, w.zeros is not None, choice)  # fmt: skip
        return y
    if choice != DEQUANT_THEN_GEMM:
        y = out if out is not None else torch.empty((x.shape[0], w.shape[0]), dtype=torch.float16, device=x.device)
        lowbit_gemm(x.contiguous(), p.words_for(SPAN), p.scales, p.biases, y, w.dtype, p.kernel_group,
                    w.zeros is not None, choice)  # fmt: skip
        return y
    w16 = torch.empty(w.shape, dtype=torch.float16, device=x.device)
    dequantize_words(p.words, p.scales, p.biases, w16, w.dtype, p.kernel_group, w.zeros is not None, PREPARED_SPAN)
    return torch.matmul(x, w16.T, out=out) if out is not None else x @ w16.T


def _prefill_choice(p: PreparedWeight, m: int) -> Any:
    """DEQUANT_THEN_GEMM or a fused kernel's config for m rows of this weight
    (tessera.templates.lowbit.tune.prefill_choice with tuning per $TESSERA_TUNE, at m rounded up to a
    power of two: one record per shape and GPU), kept per bucket."""

    key = _prefill_key(m)
    choice = p.cache.get(key)
    if choice is None:
        w = p.weight
        n, k = w.shape
        choice = p.cache[key] = prefill_choice(w.dtype, p.kernel_group, w.zeros is not None, PREPARED_SPAN, key[1], n,
                                               k, p.words.numel(), tuple(p.scales.shape), tuple(p.biases.shape),
                                               key[3], register_a=True)  # fmt: skip
    return choice


def _prefill_key(m: int) -> tuple:
    """Where a weight keeps its prefill choice for m rows: per power-of-two bucket, mode and tuning."""
    return ("prefill", 1 << (m - 1).bit_length(), settings.lowbit_prefill(), settings.tune())


def _decode_key(m: int) -> tuple:
    """Where a weight keeps its decode config for m rows (one for m <= 8, one beyond)."""
    return ("config", m <= 8)


def chosen_kernel(p: PreparedWeight, m: int) -> Any:
    """What cuda_matmul ran for m rows of this weight (a prefill choice past DECODE_MAX_M, else
    a decode config), as it keeps it; None before its first such call."""
    return p.cache.get(_prefill_key(m) if m > DECODE_MAX_M else _decode_key(m))


def _decode_config(p: PreparedWeight, m: int) -> Any:
    """The decode config for calls of m tokens: tuned for the weight's shape when tuning is on
    ($TESSERA_TUNE; at 1 token for m <= 8, at 16 beyond, one record per shape and GPU:
    tessera.templates.lowbit.tune), else DecodeConfig.default."""

    n, k = p.weight.shape
    config = DecodeConfig.default(p.weight.dtype.nbits, m, n, k, multiprocessor_count())
    if not settings.tune():
        return config

    try:
        return tuned_decode_config(p.weight.dtype, p.kernel_group, p.weight.zeros is not None, config.span,
                                   1 if m <= 8 else 16, n, k, p.words.numel(), tuple(p.scales.shape),
                                   tuple(p.biases.shape))  # fmt: skip
    except TuningError as exc:  # (every candidate failed: the default, which the tests check)
        log.warning("tessera: low-bit decode %s %dx%d: tuning failed (%s); using %s", p.weight.dtype.name, n, k, exc,
                    config)  # fmt: skip
        return config


def cuda_matmul(x: Any, p: PreparedWeight, config: Any = None, out: Any = None) -> Any:
    """x [M, K] float16 (CUDA) @ W^T -> [M, N] float16, with the decode kernel."""
    import torch

    n, k = p.weight.shape
    if x.dtype != torch.float16 or x.dim() != 2 or x.shape[1] != k:
        raise ArgumentError(f"the low-bit CUDA kernel takes float16 x [M, {k}], got {x.dtype} {list(x.shape)}")
    if k % 8:
        raise UnsupportedError(f"the low-bit CUDA kernel needs K % 8 == 0 (16-byte activation rows), got K = {k}")
    if not group_ok(p.kernel_group):
        raise UnsupportedError(f"group size {p.kernel_group} is not one the CUDA kernel takes")
    m = x.shape[0]
    if m > DECODE_MAX_M and config is None:
        return prefill_matmul(x, p, out)
    if config is None:
        key = _decode_key(m)
        config = p.cache.get(key)
        if config is None:
            config = p.cache[key] = _decode_config(p, m)
    if config.x_units and config.x_units < -(-p.k_tiles // config.split):
        raise ArgumentError(f"config {config} stages {config.x_units} units of activations, but a block of split "
                            f"{config.split} reads {-(-p.k_tiles // config.split)} of K = {k}")  # fmt: skip
    unit = config.span == 2 and p.kernel_group % 32 == 0  # one scale load per unit (lowbit_decode.unit_scales)
    kern = make_decode(p.weight.dtype, p.kernel_group, p.weight.zeros is not None, config, k % 256 == 0, unit)
    y = out if out is not None else torch.empty((m, n), dtype=torch.float16, device=x.device)
    scales, biases = p.unit_scaled() if unit else (p.scales, p.biases)
    kern(x.contiguous(), p.words_for(config.span), scales, biases, y, p.k_tiles)
    return y
