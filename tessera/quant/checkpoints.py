"""Loaders for int4 checkpoint formats: GPTQ (AutoGPTQ / GPTQModel) and AWQ (AutoAWQ GEMM).

Both store, per linear layer `<prefix>`, 4-bit codes packed eight to an int32 word, float16
scales [G, N] and packed zero points [G, N / 8], with W[n, k] = (q - z) * s for k in group g:
* GPTQ: `qweight` int32 [K / 8, N], value k = 8i + j of column n in bits 4j..4j+3 of word [i, n];
  `qzeros` int32 [G, N / 8], zero of column 8c + j in bits 4j.. of word [g, c], stored minus one
  in the original format (`zero_offset=1`; GPTQ v2 checkpoints store it as is: 0); `g_idx`
  int32 [K] (group of each input; only k // group_size, i.e. no act-order, is taken).
* AWQ: `qweight` int32 [K, N / 8] packing eight columns per word in the order 0, 2, 4, 6, 1, 3,
  5, 7 (nibble i holds column 8c + AWQ_ORDER[i]); `qzeros` the same over [G, N / 8].
Every loader returns a QuantizedWeight of uint4 codes with zero points.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tessera.errors import ArgumentError, UnsupportedError
from tessera.quant.packed import PackedTensor
from tessera.quant.quantize import QuantizedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _np(a: Any, name: str) -> np.ndarray:
    if hasattr(a, "detach"):
        a = a.detach().cpu().numpy()
    a = np.asarray(a)
    if a.size == 0:
        raise ArgumentError(f"checkpoint tensor '{name}' is empty")
    return a


def _nibbles(words: np.ndarray) -> np.ndarray:
    """int32 words [..., W] -> their eight 4-bit fields [..., W, 8], lowest first."""
    u = words.astype(np.int64) & 0xFFFFFFFF
    return ((u[..., None] >> (4 * np.arange(8))) & 0xF).astype(np.int32)


def _check_scales(scales: np.ndarray, n: int, k: int) -> tuple[np.ndarray, int]:
    if scales.ndim != 2 or scales.shape[1] != n:
        raise ArgumentError(f"scales must be [groups, {n}], got {list(scales.shape)}")
    g = scales.shape[0]
    if k % g:
        raise ArgumentError(f"{k} inputs do not split into {g} groups of equal size")
    return scales.astype(np.float16), k // g


def from_gptq(qweight: Any, qzeros: Any, scales: Any, g_idx: Any = None, bits: int = 4,
              zero_offset: int = 1) -> QuantizedWeight:  # fmt: skip
    """A QuantizedWeight from GPTQ tensors (see the module docstring)."""
    if bits != 4:
        raise UnsupportedError(f"only 4-bit GPTQ checkpoints are supported, got bits={bits}")
    qw, qz, sc = _np(qweight, "qweight"), _np(qzeros, "qzeros"), _np(scales, "scales")
    if qw.ndim != 2 or qw.dtype not in (np.int32, np.uint32):
        raise ArgumentError(f"GPTQ qweight must be int32 [K / 8, N], got {qw.dtype} {list(qw.shape)}")
    k, n = qw.shape[0] * 8, qw.shape[1]
    sc, group = _check_scales(sc, n, k)
    codes = _nibbles(qw).transpose(0, 2, 1).reshape(k, n).T  # [N, K]
    if qz.shape != (sc.shape[0], n // 8):
        raise ArgumentError(f"GPTQ qzeros must be [{sc.shape[0]}, {n // 8}], got {list(qz.shape)}")
    zeros = (_nibbles(qz).reshape(sc.shape[0], n) + zero_offset).T  # [N, G]
    if g_idx is not None:
        gi = _np(g_idx, "g_idx").astype(np.int64)
        if gi.shape != (k,) or not np.array_equal(gi, np.arange(k) // group):
            raise UnsupportedError("GPTQ act-order checkpoints (g_idx other than k // group_size) are not supported "
                                   "yet; re-export without desc_act")  # fmt: skip
    if zeros.max() > 15:
        raise ArgumentError(f"GPTQ zero points exceed 15 with zero_offset={zero_offset}; is this a GPTQ v2 checkpoint "
                            "(zero_offset=0)?")  # fmt: skip
    return QuantizedWeight(PackedTensor.from_codes(codes, "uint4"), np.ascontiguousarray(sc.T), zeros.astype(np.int32),
                           group)  # fmt: skip


def from_awq(qweight: Any, qzeros: Any, scales: Any) -> QuantizedWeight:
    """A QuantizedWeight from AutoAWQ GEMM tensors (see the module docstring)."""
    qw, qz, sc = _np(qweight, "qweight"), _np(qzeros, "qzeros"), _np(scales, "scales")
    if qw.ndim != 2 or qw.dtype not in (np.int32, np.uint32):
        raise ArgumentError(f"AWQ qweight must be int32 [K, N / 8], got {qw.dtype} {list(qw.shape)}")
    k, n = qw.shape[0], qw.shape[1] * 8
    sc, group = _check_scales(sc, n, k)
    order = np.argsort(AWQ_ORDER)  # column j of a word sits in nibble order[j]

    def columns(words: np.ndarray) -> np.ndarray:
        nib = _nibbles(words)  # [rows, N / 8, 8] by nibble
        return nib[..., order].reshape(words.shape[0], -1)

    if qz.shape != (sc.shape[0], n // 8):
        raise ArgumentError(f"AWQ qzeros must be [{sc.shape[0]}, {n // 8}], got {list(qz.shape)}")
    codes = columns(qw).T  # [N, K]
    zeros = columns(qz).T  # [N, G]
    return QuantizedWeight(PackedTensor.from_codes(codes, "uint4"), np.ascontiguousarray(sc.T), zeros.astype(np.int32),
                           group)  # fmt: skip


def load_quantized_linears(model: Any, state_dict: Mapping[str, Any], format: str, **options: Any) -> Any:
    """Replace, in place, every nn.Linear of `model` whose `<name>.qweight` is in `state_dict`
    with a QuantizedLinear loaded in `format` ("gptq" or "awq"); `<name>.bias` is kept when
    present.  Returns the model."""
    import torch

    from tessera.quant.torch_quantize import QuantizedLinear

    if format not in ("gptq", "awq"):
        raise ArgumentError(f"format must be 'gptq' or 'awq', got {format!r}")
    loaded = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if not isinstance(child, torch.nn.Linear) or f"{full}.qweight" not in state_dict:
                continue
            get = lambda key, full=full: state_dict[f"{full}.{key}"]  # noqa: E731
            if format == "gptq":
                w = from_gptq(get("qweight"), get("qzeros"), get("scales"), state_dict.get(f"{full}.g_idx"), **options)
            else:
                w = from_awq(get("qweight"), get("qzeros"), get("scales"))
            if w.shape != (child.out_features, child.in_features):
                raise ArgumentError(f"{full}: checkpoint weight is {list(w.shape)} but the layer is "
                                    f"[{child.out_features}, {child.in_features}]")  # fmt: skip
            bias = state_dict.get(f"{full}.bias", child.bias)
            setattr(module, child_name, QuantizedLinear(w, torch.as_tensor(bias) if bias is not None else None))
            loaded += 1
    if not loaded:
        raise ArgumentError(f"no layer of the model has '<name>.qweight' in the {format} state dict")
    return model
