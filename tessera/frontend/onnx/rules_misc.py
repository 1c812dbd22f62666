"""Rules for ONNX's signal processing (DFT, STFT, MelWeightMatrix), image ops (Col2Im,
MaxUnpool, NonMaxSuppression), TensorScatter and BitCast.

A DFT along an axis is a linear map of the (real, imaginary) input: the importer builds its
matrices by applying numpy's FFT (the definition ONNX refers to) to unit vectors, and the
graph computes it as matmuls.  Col2Im is a grouped ConvTranspose with a one-hot kernel.
NonMaxSuppression's output shape depends on the scores: it is evaluated at import time,
so a compiled model specialises on its inputs.
"""

from __future__ import annotations

import numpy as np

from tessera.errors import UnsupportedError
from tessera.frontend.onnx.importer import ONNX_DTYPES, rule
from tessera.frontend.onnx.rules_nn import conv_transpose_nd
from tessera.graph import Tensor
from tessera.ops.geometry import window_output


# ---- Fourier transforms ------------------------------------------------------------------------------------------
def _dft_matrices(length: int, n: int, inverse: bool, onesided: bool) -> tuple[np.ndarray, np.ndarray, bool]:
    """(from_real, from_imag) complex matrices [length, out] of the transform of `length` input
    values, and whether the output is real (an inverse of a one-sided spectrum)."""

    def transform(v: np.ndarray) -> np.ndarray:
        if inverse:
            return np.fft.irfft(v, n=n) if onesided else np.fft.ifft(v, n=n)
        y = np.fft.fft(v, n=n)
        return y[: n // 2 + 1] if onesided else y

    eye = np.eye(length)
    from_real = np.stack([transform(e.astype(complex)) for e in eye])
    from_imag = np.stack([transform(1j * e) for e in eye])
    return from_real, from_imag, bool(inverse and onesided)


def dft(im, x: Tensor, axis: int, n: int, inverse: bool, onesided: bool) -> Tensor:
    """ONNX's DFT of x [..., signal..., 1 or 2] along axis; the result ends in 2 (or 1)."""
    rank = x.ndim
    axis %= rank
    if axis == rank - 1:
        raise UnsupportedError("DFT along the last axis (it holds the real and imaginary parts)")
    length = x.shape[axis]
    if not isinstance(length, int):
        raise UnsupportedError("DFT along a symbolic axis")
    from_real, from_imag, real_out = _dft_matrices(length, n, inverse, onesided)
    ct = "float64"  # a direct DFT sums `length` products: float32 would lose ONNX's 1e-7 tolerance near zero
    perm = [i for i in range(rank - 1) if i != axis] + [axis, rank - 1]
    moved = im.op("permute", x, perm=perm)  # [..., length, 1|2]
    parts = [im.op("squeeze", im.op("slice", moved, axes=[rank - 1], starts=[c], ends=[c + 1], steps=[1]),
                   axes=[rank - 1]) for c in range(x.shape[-1])]  # fmt: skip
    parts = [p if p.dtype.name == ct else im.op("cast", p, dtype=ct) for p in parts]

    def apply(m: np.ndarray) -> Tensor:
        y = im.op("matmul", parts[0], Tensor.constant(m[0].astype(ct)))
        if len(parts) > 1:
            y = im.op("add", y, im.op("matmul", parts[1], Tensor.constant(m[1].astype(ct))))
        return y

    real = apply((from_real.real, from_imag.real))
    outs = [real] if real_out else [real, apply((from_real.imag, from_imag.imag))]
    y = im.op("concat", *[im.op("unsqueeze", o, axes=[rank - 1]) for o in outs], axis=rank - 1)
    back = [0] * rank
    for i, p in enumerate(perm):
        back[p] = i
    y = im.op("permute", y, perm=back)
    return y if y.dtype == x.dtype else im.op("cast", y, dtype=x.dtype.name)


@rule("DFT", attrs=("axis", "inverse", "onesided"))
def _dft(im, node, args, attrs):
    x = im.tensor(args[0])
    inverse, onesided = bool(attrs.get("inverse", 0)), bool(attrs.get("onesided", 0))
    if len(args) > 2 and args[2] is not None:  # opset 20: the axis is an input
        axis = int(im.static_ints(args[2], "DFT axis")[0])
    else:
        axis = int(attrs.get("axis", 1 if im.node_opset < 20 else -2))
    axis %= x.ndim
    if len(args) > 1 and args[1] is not None:
        n = int(im.static_ints(args[1], "DFT dft_length")[0])
    else:
        n = 2 * (x.shape[axis] - 1) if inverse and onesided else x.shape[axis]
    return dft(im, x, axis, n, inverse, onesided)


@rule("STFT", attrs=("onesided",))
def _stft(im, node, args, attrs):
    x = im.tensor(args[0])  # [batch, length, 1|2]
    (step,) = im.static_ints(args[1], "STFT frame_step")
    window = im.tensor(args[2]) if len(args) > 2 and args[2] is not None else None
    if len(args) > 3 and args[3] is not None:
        (frame,) = im.static_ints(args[3], "STFT frame_length")
    else:
        frame = window.shape[0] if window is not None else x.shape[-2]
    length = x.shape[-2]
    frames = 1 + (length - frame) // step
    index = np.arange(frames)[:, None] * step + np.arange(frame)[None, :]  # always inside: frames fit
    y = im.op("take", x, Tensor.constant(index.astype(np.int64)), axis=1)  # [batch, frames, frame, 1|2]
    if window is not None:
        y = im.op("mul", y, im.op("reshape", im.op("cast", window, dtype=x.dtype.name), shape=[1, 1, frame, 1]))
    return dft(im, y, 2, frame, False, bool(attrs.get("onesided", 1)))


@rule("MelWeightMatrix", attrs=("output_datatype",))
def _mel_weight_matrix(im, node, args, attrs):
    """Triangular mel filters [dft_length // 2 + 1, num_mel_bins], as ONNX's reference builds them."""
    n_mel, dft_length = (int(im.const_array(a, "MelWeightMatrix input").item()) for a in args[:2])
    rate = int(im.const_array(args[2], "MelWeightMatrix sample_rate").item())
    lower, upper = (float(im.const_array(a, "MelWeightMatrix edge").item()) for a in args[3:5])
    bins = np.arange(0, n_mel + 2)
    low_mel = 2595 * np.log1p(lower / 700) / np.log(10)
    high_mel = 2595 * np.log1p(upper / 700) / np.log(10)
    freqs = 700 * np.expm1((bins * (high_mel - low_mel) / len(bins) + low_mel) / 2595 * np.log(10))
    points = (((dft_length + 1) * freqs) // rate).astype(int)
    out = np.zeros((dft_length // 2 + 1, n_mel))
    for i in range(n_mel):
        left, center, right = points[i], points[i + 1], points[i + 2]
        if center == left:
            out[center, i] = 1
        else:
            for j in range(left, center + 1):
                out[j, i] = (j - left) / (center - left)
        for j in range(center, right):
            out[j, i] = (right - j) / (right - center)
    return Tensor.constant(out, ONNX_DTYPES[attrs.get("output_datatype", 1)])


# ---- images -------------------------------------------------------------------------------------------------------
@rule("Col2Im", attrs=("dilations", "pads", "strides"))
def _col2im(im, node, args, attrs):
    """Blocks [N, C*prod(block), L] summed back into images: a ConvTranspose, one group per
    channel, whose kernel puts block entry k at its position."""
    x = im.tensor(args[0])
    image = im.static_ints(args[1], "Col2Im image_shape")
    block = im.static_ints(args[2], "Col2Im block_shape")
    n = len(image)
    k = int(np.prod(block))
    channels = x.shape[1] // k
    strides = list(attrs.get("strides", [1] * n))
    dil = list(attrs.get("dilations", [1] * n))
    pads = list(attrs.get("pads", [0] * 2 * n))
    blocks = [window_output(image[i], block[i], strides[i], pads[i], pads[n + i], dil[i]) for i in range(n)]
    if int(np.prod(blocks)) != x.shape[2]:
        raise UnsupportedError(f"Col2Im: {x.shape[2]} blocks given, the image and block shapes make {blocks}")
    w = np.zeros((channels * k, 1, *block), dtype=np.float64)
    for c in range(channels):
        for j, pos in enumerate(np.ndindex(*block)):
            w[(c * k + j, 0, *pos)] = 1.0
    grid = im.op("reshape", x, shape=[x.shape[0], channels * k, *blocks])
    return conv_transpose_nd(im, grid, Tensor.constant(w, x.dtype.name), None, strides, dil, pads[:n], image,
                             channels)  # fmt: skip


@rule("MaxUnpool", attrs=("kernel_shape", "pads", "strides"))
def _max_unpool(im, node, args, attrs):
    """Values written at their (flat) indices into zeros of the output shape."""
    x, idx = im.tensor(args[0]), im.tensor(args[1])
    k = list(attrs["kernel_shape"])
    n = len(k)
    strides = list(attrs.get("strides", [1] * n))
    pads = list(attrs.get("pads", [0] * 2 * n))
    inferred = [*x.shape[:2], *[(x.shape[2 + i] - 1) * strides[i] + k[i] - pads[i] - pads[n + i] for i in range(n)]]
    total = int(np.prod(inferred))
    zeros = im.op("full", shape=[total], value=0, dtype=x.dtype.name)
    flat = im.op("scatter_elements", zeros, im.op("reshape", idx, shape=[-1]), im.op("reshape", x, shape=[-1]), axis=0)
    y = im.op("reshape", flat, shape=inferred)
    if len(args) > 2 and args[2] is not None:  # the indices address the inferred shape; then zeros at the end
        shape = im.static_ints(args[2], "MaxUnpool output_shape")
        y = im.op("pad", y, pads=[v for d, s in zip(inferred, shape) for v in (0, s - d)], value=0.0)
    return y


@rule("NonMaxSuppression", attrs=("center_point_box",))
def _nms(im, node, args, attrs):
    boxes = im.const_array(args[0], "NonMaxSuppression boxes (the output shape depends on them)")
    scores = im.const_array(args[1], "NonMaxSuppression scores (the output shape depends on them)")

    def scalar(k, what, default):
        if len(args) > k and args[k] is not None and im.tensor(args[k]).numel != 0:
            return im.const_array(args[k], what).reshape(-1)[0]
        return default

    limit = max(int(scalar(2, "NonMaxSuppression max_output_boxes_per_class", 0)), 0)
    iou = float(scalar(3, "NonMaxSuppression iou_threshold", 0.0))
    threshold = scalar(4, "NonMaxSuppression score_threshold", None)
    return Tensor.constant(non_max_suppression(boxes, scores, limit, iou, threshold, int(attrs.get("center_point_box", 0))))


def non_max_suppression(boxes, scores, limit, iou_threshold, score_threshold, center_point_box) -> np.ndarray:
    """Greedy NMS per batch and class: (batch, class, box) rows, highest scores first."""
    if center_point_box:
        c, half = boxes[..., :2], boxes[..., 2:] / 2
        lo, hi = c - half, c + half  # (x, y)
        lo, hi = lo[..., ::-1], hi[..., ::-1]  # as (y, x)
    else:
        lo, hi = np.minimum(boxes[..., :2], boxes[..., 2:]), np.maximum(boxes[..., :2], boxes[..., 2:])
    selected = []
    for b in range(boxes.shape[0]):
        area = np.prod(hi[b] - lo[b], axis=-1)
        for c in range(scores.shape[1]):
            s = scores[b, c]
            cand = [i for i in range(len(s)) if score_threshold is None or s[i] > score_threshold]
            cand.sort(key=lambda i: (-s[i], i))
            keep: list[int] = []
            for i in cand:
                if len(keep) >= limit:
                    break
                inter = np.prod(np.clip(np.minimum(hi[b, i], hi[b, keep]) - np.maximum(lo[b, i], lo[b, keep]), 0, None),
                                axis=-1) if keep else np.zeros(0)  # fmt: skip
                union = area[i] + area[keep] - inter
                ok = (inter > 0) & (area[i] > 0) & (area[keep] > 0) & (union > 0)
                if not np.any(ok & (inter / np.where(union > 0, union, 1) > iou_threshold)):
                    keep.append(i)
                    selected.append((b, c, i))
    return np.array(selected, dtype=np.int64).reshape(-1, 3)


# ---- caches and bit casts -----------------------------------------------------------------------------------------
@rule("TensorScatter", attrs=("axis", "mode"))
def _tensor_scatter(im, node, args, attrs):
    """past_cache with update written at write_indices[b] (+ i, wrapping in circular mode) along axis."""
    cache, update = im.tensor(args[0]), im.tensor(args[1])
    axis = int(attrs.get("axis", -2)) % cache.ndim
    if axis == 0:
        raise UnsupportedError("attribute axis=0 (the batch axis) is not allowed")
    steps, size = update.shape[axis], cache.shape[axis]
    pos = im.op("reshape", im.op("arange", start=0, end=steps, step=1, dtype="int64"),
                shape=[steps if i == axis else 1 for i in range(cache.ndim)])  # fmt: skip
    if len(args) > 2 and args[2] is not None:
        start = im.op("reshape", im.op("cast", args[2], dtype="int64"), shape=[-1] + [1] * (cache.ndim - 1))
        pos = im.op("add", pos, start)
    if attrs.get("mode", b"linear") == b"circular":
        pos = im.op("remainder", pos, im.scalar(size, pos))
    idx = im.op("expand", pos, shape=list(update.shape))
    return im.op("scatter_elements", cache, idx, update, axis=axis)


@rule("BitCast", attrs=("to",))
def _bitcast(im, node, args, attrs):
    x = im.tensor(args[0])
    to = ONNX_DTYPES.get(attrs["to"])
    if to is None:
        raise UnsupportedError(f"attribute to={attrs['to']} (an element type tessera does not compute with)")
    return x if to == x.dtype.name else im.op("bitcast", x, dtype=to)
