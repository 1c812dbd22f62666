"""Lowering rules for ATen's matrix products, convolution, normalization, attention, pooling
and embedding: the anchors tessera schedules.

AOTAutograd breaks `F.linear` into `permute(weight) + addmm` (or `mm`) between reshapes of the
input to 2-D; `matmul` on batched operands into `expand + reshape + bmm`.  The rules here
recognise those shapes and emit tessera's `linear` and N-d `matmul` on the original
operands, so the graph passes (QKV merging, batchnorm folding) and the GEMM anchors with
fused epilogues see the same operators as before.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from tessera.eager.quantize import layer_of
from tessera.errors import UnsupportedError
from tessera.frontend.torch.convert import Converter, Opaque, lowers
from tessera.graph import Tensor
from tessera.graph.symbolic import dim_mul
from tessera.ir import dtypes

_TRAINING_ONLY = "an auxiliary output (statistics for the backward pass) that inference does not compute"


# ---- matrix products ----------------------------------------------------------------------
def _producer(t: Tensor, kind: str) -> Any:
    op = t.producer
    return op if op is not None and op.kind == kind else None


def transposed_weight(t: Tensor) -> Tensor | None:
    """W when t is permute(W, [1, 0]) of a 2-D W (how `F.linear` passes its weight)."""
    op = _producer(t, "permute")
    if op is not None and t.ndim == 2 and list(op.attrs["perm"]) == [1, 0]:
        return op.inputs[0]
    return None


def unflattened(cv: Converter, t: Tensor) -> Tensor:
    """An N-d tensor [*lead, K] when the 2-D GEMM operand t is reshape(x, [prod(lead), K]) of
    an x whose leading dims multiply to prod(lead): the operand AOTAutograd flattened."""
    op = _producer(t, "reshape")
    if op is None or t.ndim != 2:
        return t
    x = op.inputs[0]
    lead: Any = 1
    for k, d in enumerate(x.shape[:-1]):
        lead = dim_mul(lead, d)
        if lead == t.shape[0]:
            return x if k == x.ndim - 2 else reshape(cv, x, [*x.shape[: k + 1], t.shape[1]])
    return t


def reshape(cv: Converter, x: Tensor, shape: list) -> Tensor:
    """x reshaped; a reshape of a reshape reads the original, and a no-op returns x."""
    shape = list(shape)
    while (op := _producer(x, "reshape")) is not None:
        x = op.inputs[0]
    if tuple(x.shape) == tuple(shape):
        return x
    syms = [i for i, d in enumerate(shape) if not isinstance(d, int)]
    if len(syms) == 1 and -1 not in shape:  # inferred at run time without needing its symbols bound
        shape[syms[0]] = -1
    return cv.op("reshape", x, shape=shape)


def _linear(cv: Converter, x2: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """linear(x, w, bias) on the un-flattened input, reshaped to the 2-D result the graph expects."""
    x = unflattened(cv, x2)
    y = cv.op("linear", *([x, w] if bias is None else [x, w, bias]))
    return y if x is x2 else reshape(cv, y, [x2.shape[0], w.shape[0]])


def _scaled(cv: Converter, x: Tensor, factor: Any) -> Tensor:
    return x if factor == 1 else cv.op("mul", x, cv.tensor(factor, x.dtype))


@lowers("aten.mm")
def _mm(cv, a):
    x, m = a["self"], a["mat2"]
    w = transposed_weight(m)
    if w is not None:
        return _linear(cv, x, w, None)
    return cv.op("matmul", x, m)


@lowers("aten.addmm")
def _addmm(cv, a):
    bias, x, m = a["self"], a["mat1"], a["mat2"]
    w = transposed_weight(m)
    if w is not None and a["alpha"] == 1 and a["beta"] == 1 and bias.ndim == 1:
        return _linear(cv, x, w, cv.cast(bias, x.dtype))
    prod = _scaled(cv, cv.op("matmul", x, m), a["alpha"])
    return cv.op("add", prod, _scaled(cv, cv.cast(bias, prod.dtype), a["beta"]))


def _batched(t: Tensor) -> Tensor:
    """x when t is reshape(x, [prod(x.shape[:-2]), m, n]): bmm's flattened batch operand."""
    op = _producer(t, "reshape")
    if op is None or t.ndim != 3:
        return t
    x = op.inputs[0]
    if x.ndim < 3 or tuple(x.shape[-2:]) != tuple(t.shape[1:]):
        return t
    lead = 1
    for d in x.shape[:-2]:
        lead = dim_mul(lead, d)
    return x if lead == t.shape[0] else t


@lowers("aten.bmm")
def _bmm(cv, a):
    x, y = a["self"], a["mat2"]
    bx, by = _batched(x), _batched(y)
    if bx is not x and by is not y and tuple(bx.shape[:-2]) == tuple(by.shape[:-2]):
        out = cv.op("matmul", bx, by)
        return reshape(cv, out, [x.shape[0], x.shape[1], y.shape[2]])
    return cv.op("matmul", x, y)


@lowers("aten.baddbmm")
def _baddbmm(cv, a):
    prod = _scaled(cv, cv.op("matmul", a["batch1"], a["batch2"]), a["alpha"])
    return cv.op("add", prod, _scaled(cv, cv.cast(a["self"], prod.dtype), a["beta"]))


# ---- convolution ----------------------------------------------------------------------------
def _ints(v: Any, n: int) -> list:
    v = list(v) if isinstance(v, (list, tuple)) else [v]
    return v * n if len(v) == 1 else v


@lowers("aten.convolution")
def _convolution(cv, a):
    x, w, b = a["input"], a["weight"], a["bias"]
    if a["transposed"]:
        raise UnsupportedError("transposed convolution has no tessera lowering yet")
    nd = w.ndim - 2
    if nd not in (1, 2):
        raise UnsupportedError(f"{nd}-d convolution has no tessera lowering (1-d and 2-d do)")
    stride, pad, dil = (_ints(a[k], nd) for k in ("stride", "padding", "dilation"))
    if nd == 1:  # as a 2-d convolution over a height of 1
        x, w = cv.op("unsqueeze", x, axes=[2]), cv.op("unsqueeze", w, axes=[2])
        stride, pad, dil = [1, *stride], [0, *pad], [1, *dil]
    ins = [x, w] + ([cv.cast(b, x.dtype)] if b is not None else [])
    y = cv.op("conv2d", *ins, stride=stride, padding=[pad[0], pad[1], pad[0], pad[1]], dilation=dil,
              groups=int(a["groups"]))  # fmt: skip
    return cv.op("squeeze", y, axes=[2]) if nd == 1 else y


# ---- normalization --------------------------------------------------------------------------
def _ones(cv: Converter, shape: list, dt: Any) -> Tensor:
    return cv.op("full", shape=list(shape), value=1.0, dtype=dt.name)


@lowers("aten._native_batch_norm_legit_no_training")
def _batch_norm(cv, a):
    x, mean, var = a["input"], a["running_mean"], a["running_var"]
    w = a["weight"] if a["weight"] is not None else _ones(cv, mean.shape, mean.dtype)
    b = a["bias"] if a["bias"] is not None else cv.op("full", shape=list(mean.shape), value=0.0, dtype=mean.dtype.name)
    y = cv.op("batch_norm", x, mean, var, w, b, eps=float(a["eps"]))
    return (y, Opaque(_TRAINING_ONLY), Opaque(_TRAINING_ONLY))


@lowers("aten.native_layer_norm")
def _layer_norm(cv, a):
    x, w, b = a["input"], a["weight"], a["bias"]
    n = len(a["normalized_shape"])
    ins = [x]
    if w is not None or b is not None:
        ins.append(w if w is not None else _ones(cv, x.shape[x.ndim - n :], x.dtype))
    if b is not None:
        ins.append(b)
    y = cv.op("layer_norm", *ins, num_axes=n, eps=float(a["eps"]))
    return (y, Opaque(_TRAINING_ONLY), Opaque(_TRAINING_ONLY))


@lowers("aten._fused_rms_norm")
def _rms_norm(cv, a):
    x, w = a["input"], a["weight"]
    eps = a["eps"] if a["eps"] is not None else float(torch.finfo(cv.arg_meta("input").dtype).eps)
    ins = [x] + ([w] if w is not None else [])
    return (cv.op("rms_norm", *ins, num_axes=len(a["normalized_shape"]), eps=float(eps)), Opaque(_TRAINING_ONLY))


@lowers("aten.native_group_norm")
def _group_norm(cv, a):
    x, w, b, g = a["input"], a["weight"], a["bias"], int(a["group"])
    n, c = x.shape[0], x.shape[1]
    grouped = reshape(cv, x, [n, g, -1])
    y = reshape(cv, cv.op("layer_norm", grouped, num_axes=1, eps=float(a["eps"])), list(x.shape))
    per_channel = [c] + [1] * (x.ndim - 2)
    if w is not None:
        y = cv.op("mul", y, reshape(cv, w, per_channel))
    if b is not None:
        y = cv.op("add", y, reshape(cv, b, per_channel))
    return (y, Opaque(_TRAINING_ONLY), Opaque(_TRAINING_ONLY))


# ---- attention ------------------------------------------------------------------------------
def _attention(cv: Converter, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
               scale: Any) -> Tensor:  # fmt: skip
    if mask is not None and causal:
        raise UnsupportedError("attention with both a mask and is_causal")  # torch rejects it too
    if mask is not None and not mask.dtype.is_bool:
        mask = cv.cast(mask, q.dtype)
    ins = [q, k, v] + ([mask] if mask is not None else [])
    return cv.op("scaled_dot_product_attention", *ins, causal=bool(causal), scale=scale)


@lowers("aten._scaled_dot_product_flash_attention_for_cpu")
def _sdpa_cpu(cv, a):
    if a["dropout_p"]:
        raise UnsupportedError("attention dropout")
    out = _attention(cv, a["query"], a["key"], a["value"], a["attn_mask"], a["is_causal"], a["scale"])
    return (out, Opaque(_TRAINING_ONLY))


@lowers("aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_cudnn_attention")  # fmt: skip
def _sdpa_cuda(cv, a):
    if a["dropout_p"]:
        raise UnsupportedError("attention dropout")
    out = _attention(cv, a["query"], a["key"], a["value"], a.get("attn_bias"), a["is_causal"], a["scale"])
    return (out, *[Opaque(_TRAINING_ONLY)] * (len(cv.meta) - 1))


@lowers("tessera.attention")
def _sdpa_kept(cv, a):
    """F.scaled_dot_product_attention kept whole on the GPU (frontend/torch/keep_attention.py)."""
    q, k = a["query"], a["key"]
    if not a["enable_gqa"] and q.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        raise UnsupportedError("query and key/value head counts differ without enable_gqa")  # torch raises
    return _attention(cv, q, k, a["value"], a["attn_mask"], a["is_causal"], a["scale"])


# ---- pooling and resampling -------------------------------------------------------------------
@lowers("aten.max_pool2d_with_indices")
def _max_pool(cv, a):
    k = _ints(a["kernel_size"], 2)
    stride = _ints(a["stride"], 2) if a["stride"] not in (None, [], ()) else None
    ph, pw = _ints(a["padding"], 2)
    y = cv.op("max_pool2d", a["self"], kernel=k, stride=stride, padding=[ph, pw, ph, pw],
              dilation=_ints(a["dilation"], 2), ceil_mode=bool(a["ceil_mode"]))  # fmt: skip
    return (y, Opaque("max pooling indices have no tessera lowering"))


@lowers("aten.avg_pool2d")
def _avg_pool(cv, a):
    if a["divisor_override"] is not None:
        raise UnsupportedError("avg_pool2d with divisor_override")
    ph, pw = _ints(a["padding"], 2)
    stride = _ints(a["stride"], 2) if a["stride"] not in (None, [], ()) else None
    return cv.op("avg_pool2d", a["self"], kernel=_ints(a["kernel_size"], 2), stride=stride, padding=[ph, pw, ph, pw],
                 ceil_mode=bool(a["ceil_mode"]), count_include_pad=bool(a["count_include_pad"]))  # fmt: skip


@lowers("aten._adaptive_avg_pool2d")
def _adaptive(cv, a):
    return cv.op("adaptive_avg_pool2d", a["self"], output_size=[int(s) for s in a["output_size"]])


def _nearest_index(cv: Converter, n_in: int, n_out: int, scale: float | None) -> Tensor:
    # torch: src = floor(dst * (in / out)) (or 1/scale when given), clamped to in - 1
    ratio = (1.0 / scale) if scale else n_in / n_out
    idx = [min(int(math.floor(i * ratio)), n_in - 1) for i in range(n_out)]
    return Tensor.constant(np.asarray(idx, dtype=np.int64))


@lowers("aten.upsample_nearest2d")
def _upsample_nearest(cv, a):
    x = a.get("input", a.get("self"))
    out = cv.meta.shape[-2:]
    scales = a.get("scale_factors") or [a.get("scales_h"), a.get("scales_w")]
    for axis, n_out, s in zip((2, 3), out, scales):
        if not isinstance(x.shape[axis], int) or not isinstance(n_out, int):
            raise UnsupportedError("nearest upsampling of a symbolic size")
        x = cv.op("take", x, _nearest_index(cv, x.shape[axis], int(n_out), s), axis=axis)
    return x


@lowers("aten.upsample_bilinear2d")
def _upsample_bilinear(cv, a):
    x = a.get("input", a.get("self"))
    out = cv.meta.shape[-2:]
    scales = a.get("scale_factors") or [a.get("scales_h"), a.get("scales_w")]
    for axis, n_out, s in zip((2, 3), out, scales):
        n_in = x.shape[axis]
        if not isinstance(n_in, int) or not isinstance(n_out, int):
            raise UnsupportedError("bilinear upsampling of a symbolic size")
        n_out = int(n_out)
        m = np.zeros((n_in, n_out), np.float64)  # out = x @ m along the axis (torch's index rules)
        for o in range(n_out):
            if a["align_corners"]:
                src = o * (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
            else:
                ratio = (1.0 / s) if s else n_in / n_out
                src = max((o + 0.5) * ratio - 0.5, 0.0)
            i0 = min(int(math.floor(src)), n_in - 1)
            i1 = min(i0 + 1, n_in - 1)
            f = src - i0
            m[i0, o] += 1 - f
            m[i1, o] += f
        perm = list(range(x.ndim))
        perm[axis], perm[-1] = perm[-1], perm[axis]
        xt = cv.op("permute", x, perm=perm) if axis != x.ndim - 1 else x
        y = cv.op("matmul", xt, cv.tensor(Tensor.constant(m.astype(np.float32)), x.dtype))
        x = cv.op("permute", y, perm=perm) if axis != x.ndim - 1 else y
    return x


# ---- embedding --------------------------------------------------------------------------------
@lowers("aten.embedding")
def _embedding(cv, a):
    return cv.op("take", a["weight"], a["indices"], axis=0)


@lowers("aten.native_dropout")
def _dropout(cv, a):
    if a["train"] is not False and a["p"]:
        raise UnsupportedError("dropout in training mode (random)")
    return (a["input"], cv.op("full", shape=list(a["input"].shape), value=True, dtype="bool"))


# ---- torch.nn's fused transformer fast paths --------------------------------------------------
def _mha(cv: Converter, q_in: Tensor, k_in: Tensor, v_in: Tensor, heads: int, qkv_w: Tensor, qkv_b: Tensor,
         proj_w: Tensor, proj_b: Tensor, mask: Tensor | None) -> Tensor:  # fmt: skip
    """Multi-head attention over [B, L, E] inputs with packed in-projection weights [3E, E]."""
    if q_in.ndim != 3:
        raise UnsupportedError("fused multi-head attention on unbatched inputs")
    e = q_in.shape[-1]
    if not isinstance(e, int):  # symbolic under dynamic=True: the weights fix it ([3E, E])
        e = qkv_w.shape[-1]
    if not isinstance(e, int) or e % heads:
        raise UnsupportedError(f"embedding size {e} for {heads} heads")
    d = e // heads
    w_parts = cv.op_multi("split", qkv_w, axis=0, sizes=[e, e, e])
    b_parts = cv.op_multi("split", qkv_b, axis=0, sizes=[e, e, e])
    projected = []
    for x, w, b in zip((q_in, k_in, v_in), w_parts, b_parts):
        y = cv.op("linear", x, w, b)
        y = reshape(cv, y, [y.shape[0], y.shape[1], heads, d])
        projected.append(cv.op("permute", y, perm=[0, 2, 1, 3]))
    if mask is not None:
        if not mask.dtype.is_bool:
            raise UnsupportedError("fused attention with a float mask")
        mask = cv.op("logical_not", mask)  # torch's masks mark what to ignore; tessera's what to keep
        if mask.ndim == 2 and tuple(mask.shape) == (q_in.shape[0], k_in.shape[1]):  # key padding [B, S]
            mask = reshape(cv, mask, [mask.shape[0], 1, 1, mask.shape[1]])
    o = _attention(cv, *projected, mask, False, None)
    o = reshape(cv, cv.op("permute", o, perm=[0, 2, 1, 3]), [q_in.shape[0], q_in.shape[1], e])
    return cv.op("linear", o, proj_w, proj_b)


@lowers("aten._native_multi_head_attention")
def _native_mha(cv, a):
    if a["need_weights"]:
        raise UnsupportedError("multi-head attention returning its weights")
    if a["mask"] is not None and a["mask_type"] not in (None, 0, 1):
        raise UnsupportedError(f"fused attention mask type {a['mask_type']}")
    out = _mha(cv, a["query"], a["key"], a["value"], int(a["num_head"]), a["qkv_weight"], a["qkv_bias"],
               a["proj_weight"], a["proj_bias"], a["mask"])  # fmt: skip
    return (out, Opaque("attention weights are not computed"))


@lowers("aten._transformer_encoder_layer_fwd")
def _encoder_layer(cv, a):
    if a["mask"] is not None:
        # with a padding mask the fast path returns zeros at padded positions (nested tensors)
        raise UnsupportedError("the fast path of TransformerEncoderLayer with a mask")
    x, eps = a["src"], float(a["eps"])

    def norm(h, k):
        return cv.op("layer_norm", h, a[f"norm_weight_{k}"], a[f"norm_bias_{k}"], num_axes=1, eps=eps)

    def attention(h):
        return _mha(cv, h, h, h, int(a["num_heads"]), a["qkv_weight"], a["qkv_bias"], a["proj_weight"],
                    a["proj_bias"], None)  # fmt: skip

    def ffn(h):
        h = cv.op("linear", h, a["ffn_weight_1"], a["ffn_bias_1"])
        h = cv.op("gelu", h) if a["use_gelu"] else cv.op("relu", h)
        return cv.op("linear", h, a["ffn_weight_2"], a["ffn_bias_2"])

    if a["norm_first"]:
        x = cv.op("add", x, attention(norm(x, 1)))
        return cv.op("add", x, ffn(norm(x, 2)))
    x = norm(cv.op("add", x, attention(x)), 1)
    return norm(cv.op("add", x, ffn(x)), 2)


@lowers("tessera.lowbit_linear")
def _lowbit_linear(cv, a):
    """tessera.quantize's layers (the custom op tessera::lowbit_linear): the lowbit_linear anchor,
    on the GPU for float16 activations (the decode kernel; others run in torch, which casts
    them to float16 too), on the CPU in float32 (the row kernel; float16 and bfloat16 are cast
    to float32 and back, as the eager op does)."""
    x = cv.tensor(a["x"])
    want = dtypes.float16 if x.device == "cuda" else dtypes.float32
    if x.dtype != want and (x.device == "cuda" or x.dtype not in (dtypes.float16, dtypes.bfloat16)):
        raise UnsupportedError(f"lowbit_linear on {x.dtype} activations ({x.device}) runs in torch")
    consts, attrs = layer_of(int(a["handle"])).graph_operands()
    weights = [Tensor.constant(np.ascontiguousarray(c), dtypes.dtype(d))
               for c, d in zip(consts, ("uint32", "float16", "float16"))]  # fmt: skip
    if x.dtype == want:
        return cv.op("lowbit_linear", x, *weights, **attrs)
    y = cv.op("lowbit_linear", cv.cast(x, want.name), *weights, **attrs)
    return cv.cast(y, x.dtype.name)


@lowers("tessera.fused_moe")
def _fused_moe(cv, a):
    """A mixture-of-experts block kept whole (frontend/torch/keep_moe.py): the fused_moe anchor,
    in float32 on the CPU (float16 and bfloat16 activations are cast to float32 and back); the
    shared expert's gate and up weights become one [2S, H] constant, a choice bias an attribute."""
    x = cv.tensor(a["x"])
    if x.device == "cuda" or x.dtype not in (dtypes.float32, dtypes.float16, dtypes.bfloat16):
        raise UnsupportedError(f"fused_moe on {x.dtype} activations ({x.device}) runs in torch")
    names = ("router", "gate_up", "down", "shared_gate_proj", "shared_up_proj", "shared_down_proj", "shared_gate",
             "choice_bias")  # fmt: skip
    given = {k: a[k] for k in names if a[k] is not None}
    if not all(isinstance(t, Tensor) and t.is_constant for t in given.values()):
        raise UnsupportedError("fused_moe takes constant weights (module parameters)")
    data = {k: np.asarray(t.data, np.float32) for k, t in given.items()}
    weights = [data["router"], data["gate_up"], data["down"]]
    if "shared_down_proj" in data:
        weights += [np.concatenate([data["shared_gate_proj"], data["shared_up_proj"]]), data["shared_down_proj"]]
        weights += [data["shared_gate"]] if "shared_gate" in data else []
    consts = [Tensor.constant(np.ascontiguousarray(w), dtypes.float32) for w in weights]
    bias = [float(b) for b in data["choice_bias"]] if "choice_bias" in data else None
    y = cv.op("fused_moe", cv.cast(x, "float32"), *consts, top_k=int(a["top_k"]), scoring=a["scoring"],
              normalize=bool(a["normalize"]), scale=float(a["scale"]), shared_gated="shared_gate" in data,
              groups=int(a["groups"]), topk_group=int(a["topk_group"]), choice_bias=bias)  # fmt: skip
    return cv.cast(y, x.dtype.name)
