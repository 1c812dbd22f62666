"""lowbit_linear: y = x @ W^T with W held as low-bit codes in the tensor-core layout.

Inputs: x [..., K] (float16, bfloat16 or float32; the output [..., N] has x's dtype: the
kernels read x's rows as one [M, K] matrix, M the product of the leading sizes), words uint32
(tessera.quant.layout.pack_units of the codes in the k order `span`, 16 or 2:
tessera.ir.lowbit.lane_value_position),
scales float16 [N, G] and biases float16 [N, G] (or [1, 1] when `has_bias` is False), in the
terms of the `dequant` instruction: W[n, k] = (u - bias[n, g]) * scale[n, g], g = k //
group_size, u the layout code (offset binary for signed ints; for the small floats u stands
for decode(code) * 2**-float_shift).  Attributes: wtype, n, k, group_size, has_bias, span (16
when absent, as in graphs saved before it existed).  An optional fifth input holds the same
codes packed in mma's own k order (tessera.ir.lowbit.FRAGMENT_SPAN), as many words: the
register-A prefill kernel reads those (tessera.templates.lowbit.fragment_words adds them for
Hopper GPUs); the decode kernels and the reference read `words`.
It is an anchor (tessera.templates.lowbit.plan, the epilogue fused into its stores): on the GPU the
decode kernel for float16 x, on the CPU the row kernel (tessera.templates.lowbit.cpu_kernels) for float32
x; other dtypes on a target run on the reference (the torch front end casts to the target's).
"""

from __future__ import annotations

import numpy as np

from tessera.graph.registry import REQUIRED, register
from tessera.graph.symbolic import ShapeError
from tessera.ir import dtypes, lowbit
from tessera.quant import codecs
from tessera.quant.layout import unpack_units

ACTIVATION_DTYPES = (dtypes.float16, dtypes.bfloat16, dtypes.float32)


def _infer(xs, a):
    x, words, scales, biases = xs[:4]
    if x.ndim < 1:
        raise ShapeError(f"lowbit_linear takes x [..., K], got a scalar {x.shape}")
    if isinstance(x.shape[-1], int) and x.shape[-1] != a["k"]:
        raise ShapeError(f"lowbit_linear: x has {x.shape[-1]} features but the weight has {a['k']}")
    if x.dtype not in ACTIVATION_DTYPES:
        names = "/".join(d.name for d in ACTIVATION_DTYPES)
        raise ShapeError(f"lowbit_linear takes {names} activations, got {x.dtype}")
    if words.dtype != dtypes.uint32 or scales.dtype != dtypes.float16 or biases.dtype != dtypes.float16:
        raise ShapeError("lowbit_linear takes uint32 words and float16 scales and biases")
    if len(xs) == 5 and (xs[4].dtype != dtypes.uint32 or tuple(xs[4].shape) != tuple(words.shape)):
        raise ShapeError(f"lowbit_linear: the fragment-order words must be uint32 {list(words.shape)} like the words, "
                         f"got {xs[4].dtype} {list(xs[4].shape)}")  # fmt: skip
    if a["has_bias"] and dtypes.dtype(a["wtype"]).is_float:  # (as tessera.quant.QuantizedWeight)
        raise ShapeError(f"lowbit_linear: {a['wtype']} weights take no zero points; set has_bias=False")
    return [((*x.shape[:-1], a["n"]), x.dtype)]


def dequantized_weight(words: np.ndarray, scales: np.ndarray, biases: np.ndarray, a: dict) -> np.ndarray:
    """The float64 [N, K] weights the operator's constants stand for."""
    t = dtypes.dtype(a["wtype"])
    n, k, gs = a["n"], a["k"], a["group_size"]
    u = unpack_units(words, t, n, k, a.get("span", 16)).astype(np.int64)
    cols = np.arange(k) // gs
    s = scales.astype(np.float64)[:, cols]
    if t.is_float:
        return codecs.decode(u, t) * 2.0 ** -lowbit.float_shift(t) * s
    bias = biases.astype(np.float64)[:, cols] if a["has_bias"] else (1 << (t.nbits - 1) if t.kind == "int" else 0)
    return (u - bias) * s


def _reference(xs, a):
    x, words, scales, biases = xs[:4]
    w = dequantized_weight(words, scales, biases, a)
    return [(x.astype(np.float64) @ w.T).astype(x.dtype)]


register("lowbit_linear", infer=_infer, reference=_reference, category="anchor", num_inputs=(4, 5),
         attrs={"wtype": REQUIRED, "n": REQUIRED, "k": REQUIRED, "group_size": REQUIRED, "has_bias": REQUIRED,
                "span": 16},
         doc="x @ W^T with low-bit W in the tensor-core layout (tessera.quant); see the module docstring")  # fmt: skip
