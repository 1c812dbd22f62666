"""Normalisations: layer_norm, rms_norm (fused row kernels) and batch_norm in inference form.

Statistics are computed in float32 (float64 for float64 inputs).  LayerNorm uses the two-pass
variance mean((x - mean)^2), which does not cancel catastrophically for rows with a large
mean; the scheduler still fuses mean, variance and the normalisation into one kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

from tessera.errors import ArgumentError
from tessera.ir import expr as E
from tessera.ir.compute import Compute, TensorNode, as_shape, compute, fresh_name, reduce
from tessera.ops.common import check_float, check_tensor, compute_type, dim_str, normalize_axis, same_dim


def _check_param(p: TensorNode | None, shape: Sequence[E.Expr], op: str, what: str) -> None:
    if p is None:
        return
    check_tensor(p, op, what)
    if p.rank != len(shape) or not all(same_dim(a, b) for a, b in zip(p.shape, shape)):
        raise ArgumentError(f"{op}: {what} '{p.name}' has shape {dim_str(p.shape)}, expected {dim_str(shape)}")


def _normalized(x: TensorNode, ndim: int, op: str) -> tuple[int, list[E.Expr], list[E.Expr]]:
    check_tensor(x, op)
    check_float(x, op)
    if not 1 <= ndim <= x.rank:
        raise ArgumentError(f"{op}: normalizes over {ndim} trailing dimension(s) but '{x.name}' has rank {x.rank}")
    lead = x.rank - ndim
    return lead, list(x.shape[:lead]), list(x.shape[lead:])


def _norm_shape(x: TensorNode, normalized_shape: int | Sequence[E.Expr | int] | None, weight: TensorNode | None) -> int:
    """How many trailing dimensions are normalised (from normalized_shape, else the weight's rank, else 1)."""
    if normalized_shape is None:
        return weight.rank if weight is not None else 1
    if isinstance(normalized_shape, int):
        return 1
    return len(tuple(normalized_shape))


def layer_norm(x: TensorNode, weight: TensorNode | None = None, bias: TensorNode | None = None, eps: float = 1e-5,
               normalized_shape: int | Sequence[E.Expr | int] | None = None) -> Compute:  # fmt: skip
    """(x - mean) / sqrt(var + eps) * weight + bias over the trailing dims (biased variance, as torch)."""
    ndim = _norm_shape(x, normalized_shape, weight)
    lead, outer, inner = _normalized(x, ndim, "layer_norm")
    if normalized_shape is not None and not isinstance(normalized_shape, int):
        given = as_shape(normalized_shape)
        if not all(same_dim(a, b) for a, b in zip(given, inner)):
            raise ArgumentError(f"layer_norm: normalized_shape {dim_str(given)} does not match the trailing dims of '{x.name}' {dim_str(x.shape)}")
    _check_param(weight, inner, "layer_norm", "weight")
    _check_param(bias, inner, "layer_norm", "bias")
    ct = compute_type(x.dtype)

    def xv(o: Sequence[E.Expr], r: Sequence[E.Expr]) -> E.Expr:
        return E.Cast(x[(*o, *r)], ct)

    mu = reduce(outer, inner, lambda o, r: xv(o, r), "mean", fresh_name("ln_mean"), ct, ct)
    var = reduce(outer, inner, lambda o, r: (xv(o, r) - mu[tuple(o)]) * (xv(o, r) - mu[tuple(o)]), "mean",
                 fresh_name("ln_var"), ct, ct)  # fmt: skip

    def fn(*i: E.Var) -> E.Expr:
        o, r = i[:lead], i[lead:]
        y = (E.Cast(x[i], ct) - mu[o]) * E.Call("rsqrt", (var[o] + E.Const(eps, ct),), ct)
        if weight is not None:
            y = y * E.Cast(weight[r], ct)
        if bias is not None:
            y = y + E.Cast(bias[r], ct)
        return y

    return compute(x.shape, fn, fresh_name("layer_norm"), x.dtype)


def rms_norm(x: TensorNode, weight: TensorNode | None = None, eps: float = 1e-6, ndim: int | None = None) -> Compute:
    """x / sqrt(mean(x^2) + eps) * weight over the trailing `ndim` dims (default: the weight's rank, else 1)."""
    ndim = ndim if ndim is not None else (weight.rank if weight is not None else 1)
    lead, outer, inner = _normalized(x, ndim, "rms_norm")
    _check_param(weight, inner, "rms_norm", "weight")
    ct = compute_type(x.dtype)
    ms = reduce(outer, inner, lambda o, r: E.Cast(x[(*o, *r)], ct) * E.Cast(x[(*o, *r)], ct), "mean",
                fresh_name("rms_mean"), ct, ct)  # fmt: skip

    def fn(*i: E.Var) -> E.Expr:
        o, r = i[:lead], i[lead:]
        y = E.Cast(x[i], ct) * E.Call("rsqrt", (ms[o] + E.Const(eps, ct),), ct)
        return y * E.Cast(weight[r], ct) if weight is not None else y

    return compute(x.shape, fn, fresh_name("rms_norm"), x.dtype)


def batch_norm(x: TensorNode, running_mean: TensorNode, running_var: TensorNode, weight: TensorNode | None = None,
               bias: TensorNode | None = None, eps: float = 1e-5, axis: int = 1) -> Compute:  # fmt: skip
    """Inference batch norm: (x - mean[c]) / sqrt(var[c] + eps) * weight[c] + bias[c], c along `axis`."""
    check_tensor(x, "batch_norm")
    check_float(x, "batch_norm")
    a = normalize_axis(axis, x.rank, "batch_norm")
    channels = [x.shape[a]]
    for p, what in ((running_mean, "running_mean"), (running_var, "running_var"), (weight, "weight"), (bias, "bias")):
        _check_param(p, channels, "batch_norm", what)
    ct = compute_type(x.dtype)

    def fn(*i: E.Var) -> E.Expr:
        c = (i[a],)
        y = (E.Cast(x[i], ct) - E.Cast(running_mean[c], ct)) * E.Call("rsqrt", (E.Cast(running_var[c], ct) + E.Const(eps, ct),), ct)
        if weight is not None:
            y = y * E.Cast(weight[c], ct)
        if bias is not None:
            y = y + E.Cast(bias[c], ct)
        return y

    return compute(x.shape, fn, fresh_name("batch_norm"), x.dtype)
