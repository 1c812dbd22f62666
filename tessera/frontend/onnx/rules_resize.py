"""Resize and Upsample: interpolation is separable, so each resized axis is one linear map.

For every axis whose size or coordinates change, the importer computes (in float64, from the
static sizes and the scales/sizes/roi values) the [out, in] matrix that ONNX's definition
applies along that axis: nearest, linear or cubic coefficients, antialiasing, exclude_outside,
every coordinate_transformation_mode.  A nearest-neighbour map is a gather (`take`, exact for
every dtype); the others are a matmul with the constant matrix, then the extrapolated
positions of tf_crop_and_resize get extrapolation_value.  Integer results are rounded half to
even and saturated, as ONNX's reference does.  Scales or sizes fed as graph inputs make
`tessera.onnx.compile` specialise on their values.
"""

from __future__ import annotations

import math

import numpy as np

from tessera.errors import UnsupportedError
from tessera.frontend.onnx.importer import rule
from tessera.graph import Tensor


def _nearest(mode: str):
    def coeffs(ratio: float, scale: float) -> np.ndarray:
        if float(ratio).is_integer():
            return np.array([0.0, 1.0])
        pick_right = {"round_prefer_floor": ratio > 0.5, "round_prefer_ceil": ratio >= 0.5, "floor": False,
                      "ceil": True}[mode]  # fmt: skip
        return np.array([0.0, 1.0]) if pick_right else np.array([1.0, 0.0])

    return coeffs


def _linear(antialias: bool):
    def coeffs(ratio: float, scale: float) -> np.ndarray:
        if not antialias:
            return np.array([1 - ratio, ratio])
        scale = min(scale, 1.0)
        start = int(np.floor(-1 / scale) + 1)
        args = (np.arange(start, start + 2 - 2 * start) - ratio) * scale
        c = np.clip(1 - np.abs(args), 0, 1)
        return c / c.sum()

    return coeffs


def _cubic(a: float, antialias: bool):
    def kernel(x: float) -> float:
        x = abs(x)
        if x <= 1:
            return (a + 2) * x**3 - (a + 3) * x**2 + 1
        if x < 2:
            return a * x**3 - 5 * a * x**2 + 8 * a * x - 4 * a
        return 0.0

    def coeffs(ratio: float, scale: float) -> np.ndarray:
        if not antialias:
            return np.array([kernel(ratio + 1), kernel(ratio), kernel(1 - ratio), kernel(2 - ratio)])
        scale = min(scale, 1.0)
        start = int(np.floor(-2 / scale) + 1)
        c = np.array([kernel(scale * (i - ratio)) for i in range(start, 2 - start)])
        return c / c.sum()

    return coeffs


def _source_coords(mode: str, out: int, size: int, scale: float, roi: tuple[float, float] | None):
    """Each output position's coordinate in the input, and which ones are extrapolated."""
    y = np.arange(out, dtype=np.float64)
    width = scale * size
    extrapolated = None
    if mode == "align_corners":
        x = np.zeros(out) if width == 1 else y * (size - 1) / (width - 1)
    elif mode == "asymmetric":
        x = y / scale
    elif mode == "tf_crop_and_resize":
        lo, hi = roi if roi is not None else (0.0, 1.0)
        x = np.full(out, (hi - lo) * (size - 1) / 2) if width == 1 else y * (hi - lo) * (size - 1) / (width - 1)
        x = x + lo * (size - 1)
        extrapolated = (x < 0) | (x > size - 1)
    elif mode == "pytorch_half_pixel":
        x = np.full(out, -0.5) if width == 1 else (y + 0.5) / scale - 0.5
    elif mode == "half_pixel":
        x = (y + 0.5) / scale - 0.5
    elif mode == "half_pixel_symmetric":
        offset = size / 2 * (1 - out / width)
        x = offset + (y + 0.5) / scale - 0.5
    else:
        raise UnsupportedError(f"attribute coordinate_transformation_mode={mode!r} is not supported")
    return x, extrapolated


def interpolation_matrix(size: int, out: int, scale: float, coeffs, mode: str, roi, exclude_outside: bool):
    """W [out, size] with resized = W @ x along the axis, and the extrapolated rows (or None)."""
    x, extrapolated = _source_coords(mode, out, size, scale, roi)
    base = np.floor(x).astype(np.int64)
    ratios = np.where(x == base, 1.0, x - base)  # the pixel left of x is preferred
    w = np.zeros((out, size))
    for i in range(out):
        c = np.asarray(coeffs(float(ratios[i]), scale), dtype=np.float64)
        n = len(c)
        pad = int(np.ceil(n / 2))
        xp = x[i] + pad
        p = int(np.floor(xp))
        frac = xp - p
        if n % 2 == 0:
            offset = -(n // 2) if frac == 0 else -(n // 2) + 1
        else:
            offset = -((n - 1) // 2) + (0 if frac <= 0.5 else 1)
        idx = p + offset + np.arange(n) - pad
        if exclude_outside:
            c = np.where((idx < 0) | (idx >= size), 0.0, c)
            c = c / (c.sum() or 1.0)
        np.add.at(w[i], np.clip(idx, 0, size - 1), c)
    if extrapolated is not None:
        w[extrapolated] = 0.0
        if not extrapolated.any():
            extrapolated = None
    return w, extrapolated


def resize(im, x: Tensor, sizes: list[int], scales: list[float], mode: str, coords: str, nearest_mode: str,
           cubic_a: float, exclude_outside: bool, antialias: bool, extrapolation_value: float,
           roi: list[float] | None) -> Tensor:  # fmt: skip
    """x resized to `sizes` (one entry per axis) with the per-axis `scales`."""
    if mode == "nearest":
        if antialias:
            raise UnsupportedError("attribute antialias=1 with mode 'nearest' is not defined")
        coeffs = _nearest(nearest_mode)
    elif mode == "linear":
        coeffs = _linear(antialias)
    elif mode == "cubic":
        coeffs = _cubic(cubic_a, antialias)
    else:
        raise UnsupportedError(f"attribute mode={mode!r} is not supported")
    dtype = x.dtype
    rank = x.ndim
    y = x
    for axis in range(rank):
        size, out = x.shape[axis], sizes[axis]
        axis_roi = None if roi is None else (roi[axis], roi[axis + rank])
        if not isinstance(size, int):
            if size == out and math.isclose(scales[axis], 1.0):
                continue
            raise UnsupportedError(f"Resize of a symbolic size along axis {axis}")
        if out == size and math.isclose(scales[axis], 1.0) and (axis_roi is None or axis_roi == (0.0, 1.0)):
            continue
        w, extrapolated = interpolation_matrix(size, out, scales[axis], coeffs, coords, axis_roi, exclude_outside)
        one_hot = np.all(np.isclose(w, 0) | np.isclose(w, 1), axis=1) & np.isclose(w.sum(1), 1)
        if one_hot.all():
            y = im.op("take", y, Tensor.constant(np.argmax(w, axis=1).astype(np.int64)), axis=axis)
        else:
            y = _apply_along(im, y, axis, w)
        if extrapolated is not None:
            mask = Tensor.constant(extrapolated.reshape([out if i == axis else 1 for i in range(rank)]))
            y = im.op("where", mask, im.scalar(extrapolation_value, y), y)
    if y.dtype != dtype:
        if dtype.is_float:
            y = im.op("cast", y, dtype=dtype.name)
        else:
            info = np.iinfo(dtype.name)
            y = im.op("cast", im.op("clamp", im.op("round", y), min=float(info.min), max=float(info.max)), dtype=dtype.name)
    return y


def _apply_along(im, x: Tensor, axis: int, w: np.ndarray) -> Tensor:
    """The matrix w [out, in] applied along axis of x (float32, float64 for integer inputs)."""
    ct = "float64" if not x.dtype.is_float or x.dtype.name == "float64" else "float32"
    if x.dtype.name != ct:
        x = im.op("cast", x, dtype=ct)
    rank = x.ndim
    perm = [i for i in range(rank) if i != axis] + [axis]
    moved = im.op("permute", x, perm=perm) if axis != rank - 1 else x
    y = im.op("matmul", moved, Tensor.constant(np.ascontiguousarray(w.T).astype(ct)))
    if axis == rank - 1:
        return y
    back = [0] * rank
    for i, p in enumerate(perm):
        back[p] = i
    return im.op("permute", y, perm=back)


@rule("Resize", attrs=("antialias", "axes", "coordinate_transformation_mode", "cubic_coeff_a", "exclude_outside",
                       "extrapolation_value", "keep_aspect_ratio_policy", "mode", "nearest_mode"))  # fmt: skip
def _resize(im, node, args, attrs):
    x = im.tensor(args[0])
    rank = x.ndim
    roi_in = args[1] if len(args) > 1 and args[1] is not None else None
    scales_in = args[2] if len(args) > 2 and args[2] is not None else None
    sizes_in = args[3] if len(args) > 3 and args[3] is not None else None
    axes = [int(a) % rank for a in attrs.get("axes", range(rank))]
    roi = None
    if roi_in is not None and im.tensor(roi_in).numel != 0:
        r = [float(v) for v in im.const_array(roi_in, "Resize roi").reshape(-1)]
        roi = [0.0] * rank + [1.0] * rank
        for i, a in enumerate(axes):
            roi[a], roi[rank + a] = r[i], r[len(axes) + i]
    sizes = list(x.shape)
    scales = [1.0] * rank
    if sizes_in is not None and im.tensor(sizes_in).numel != 0:
        wanted = im.static_ints(sizes_in, "Resize sizes")
        for i, a in enumerate(axes):
            sizes[a] = wanted[i]
        _fit_sizes(x, sizes, scales, axes, attrs.get("keep_aspect_ratio_policy", b"stretch").decode())
    elif scales_in is not None:
        factors = [float(v) for v in im.const_array(scales_in, "Resize scales").reshape(-1)]
        for i, a in enumerate(axes):
            scales[a] = factors[i]
            if not isinstance(x.shape[a], int):
                raise UnsupportedError(f"Resize scales of a symbolic size along axis {a}")
            sizes[a] = int(math.floor(x.shape[a] * factors[i]))
    else:
        raise UnsupportedError("Resize needs scales or sizes")
    return resize(im, x, sizes, scales, attrs.get("mode", b"nearest").decode(),
                  attrs.get("coordinate_transformation_mode", b"half_pixel").decode(),
                  attrs.get("nearest_mode", b"round_prefer_floor").decode(), float(attrs.get("cubic_coeff_a", -0.75)),
                  bool(attrs.get("exclude_outside", 0)), bool(attrs.get("antialias", 0)),
                  float(attrs.get("extrapolation_value", 0.0)), roi)  # fmt: skip


def _fit_sizes(x: Tensor, sizes: list[int], scales: list[float], axes: list[int], policy: str) -> None:
    """Scales from the wanted sizes, and keep_aspect_ratio_policy's adjusted sizes (in place)."""
    for a in axes:
        if not isinstance(x.shape[a], int):
            raise UnsupportedError(f"Resize sizes of a symbolic size along axis {a}")
        scales[a] = sizes[a] / x.shape[a]
    if policy == "stretch":
        return
    if policy not in ("not_larger", "not_smaller"):
        raise UnsupportedError(f"attribute keep_aspect_ratio_policy={policy!r} is not supported")
    pick = min if policy == "not_larger" else max
    s = pick(scales[a] for a in axes)
    for a in axes:
        scales[a] = s
        sizes[a] = int(s * x.shape[a] + 0.5)


@rule("Upsample", attrs=("mode", "scales"))
def _upsample(im, node, args, attrs):
    """The deprecated Upsample (opsets 7-9): asymmetric coordinates, nearest rounds down."""
    x = im.tensor(args[0])
    if "scales" in attrs:  # opset 7
        factors = [float(v) for v in attrs["scales"]]
    else:
        factors = [float(v) for v in im.const_array(args[1], "Upsample scales").reshape(-1)]
    if not x.is_static:
        raise UnsupportedError("Upsample of a symbolic shape is not supported")
    sizes = [int(math.floor(d * f)) for d, f in zip(x.shape, factors)]
    mode = attrs.get("mode", b"nearest").decode()
    return resize(im, x, sizes, factors, "linear" if mode in ("linear", "bilinear") else mode, "asymmetric", "floor",
                  -0.75, False, False, 0.0, None)  # fmt: skip
