"""`tessera.quantize(model, weight="int4", group_size=128, ...)`: low-bit weights for torch modules.

Every `nn.Linear` (but those `skip` names) becomes a `QuantizedLinear` holding a
`QuantizedWeight` (round-to-nearest, tessera.quant.quantize).  Its forward is the custom op
`tessera::lowbit_linear` wherever it is traced (eagerly it runs the op's body directly), which
runs tessera's low-bit kernels: on CUDA the decode kernel
(M <= 64 rows) or dequantise + tensor-core GEMM (prefill), on the CPU the tessera CPU kernel.
`torch.compile(quantized, backend="tessera")` turns the op into the graph operator lowbit_linear
(tessera.graph.opdefs.lowbit): the decode kernel on the GPU (float16), the CPU row kernel
(float32; float16 and bfloat16 cast there and back), so the model compiles whole.
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from tessera.backend.isa import vector_lanes
from tessera.eager.lowbit import cpu_matmul, cuda_matmul, kernel_scales_and_biases, prepare
from tessera.errors import ArgumentError, UnsupportedError
from tessera.quant import codecs
from tessera.quant.layout import layout_codes, pack_rows, pack_units
from tessera.quant.quantize import QuantizedWeight, quantize_weight
from tessera.quant.quantize_torch import quantize_weight_torch
from tessera.templates.lowbit.plan_cpu import cpu_kernels_take, cpu_linear

log = logging.getLogger("tessera")

_REGISTRY: dict[int, QuantizedLinear] = {}  # the op's integer handle -> layer (weights are not tensors)
_IDS = itertools.count(1)
_LOCK = threading.Lock()


@torch.library.custom_op("tessera::lowbit_linear", mutates_args=())
def lowbit_linear(x: torch.Tensor, handle: int) -> torch.Tensor:
    """x [M, K] @ W^T for the QuantizedLinear registered under `handle` (no bias)."""
    return layer_of(handle).matmul(x)


@lowbit_linear.register_fake
def _(x: torch.Tensor, handle: int) -> torch.Tensor:
    layer = _REGISTRY[handle]
    return x.new_empty((x.shape[0], layer.out_features))


def _runs_eagerly(x: torch.Tensor) -> bool:
    """Whether forward may call the layer's matmul itself instead of the custom op: a plain
    tensor (no fake or traced one), nothing compiling, and no gradient asked for."""
    return type(x) is torch.Tensor and not torch.compiler.is_compiling() and not (
        x.requires_grad and torch.is_grad_enabled())


class QuantizedLinear(torch.nn.Module):
    """y = x @ W^T + bias with W stored as low-bit codes, scales and zero points."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight_q = weight
        self.out_features, self.in_features = weight.shape
        self.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self._prepared: dict[str, Any] = {}
        with _LOCK:
            self.handle = next(_IDS)
            _REGISTRY[self.handle] = self

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, weight: str = "int4", group_size: int | None = 128,
                    zero_point: bool | None = None) -> QuantizedLinear:  # fmt: skip
        if linear.weight.is_cuda:  # round on the GPU: the same bits as the numpy reference, seconds faster per layer
            return cls(quantize_weight_torch(linear.weight, weight, group_size, zero_point), linear.bias)
        w = linear.weight.detach().float().cpu().numpy()
        return cls(quantize_weight(w, weight, group_size, zero_point), linear.bias)

    def _kernel_operands(self) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
        """The kernels' float16 scales and biases (a [1, 1] placeholder without biases) and the
        lowbit_linear attributes, which the graph operator and the eager CPU path share;
        UnsupportedError where a small float's scale overflows float16 in the kernels' terms."""

        w = self.weight_q
        scales, biases = kernel_scales_and_biases(w)
        attrs = {"wtype": w.dtype.name, "n": self.out_features, "k": self.in_features,
                 "group_size": w.group_size, "has_bias": biases is not None}  # fmt: skip
        return (np.ascontiguousarray(scales),
                np.ascontiguousarray(biases) if biases is not None else np.zeros((1, 1), np.float16), attrs)  # fmt: skip

    def graph_operands(self) -> tuple[list[np.ndarray], dict[str, Any]]:
        """The lowbit_linear graph operator's constants (words, scales, biases) and attributes."""
        if "graph" not in self._prepared:
            w = self.weight_q
            scales, biases, attrs = self._kernel_operands()
            span = 2  # the decode kernels' k order by default (DecodeConfig.default): scales after the mma
            self._prepared["graph"] = ([pack_units(w.codes.codes(), w.dtype, span), scales, biases],
                                       {**attrs, "span": span})  # fmt: skip
        return self._prepared["graph"]

    def _cpu_operands(self) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, Any]] | None, str]:
        """((row-layout words, scales, biases, attributes) for tessera.templates.lowbit.plan_cpu.cpu_linear,
        or None where the SIMD kernels cannot run the layer, and why), made on first use."""
        if "cpu_rows" not in self._prepared:
            w, operands, why = self.weight_q, None, ""
            if not cpu_kernels_take(w.group_size, self.in_features):
                why = ("this CPU has no AVX2" if vector_lanes() == 1 else
                       f"they take groups of 8 to 256 that divide 256, multiples of 256 and per-channel scales, "
                       f"not group size {w.group_size} over K = {self.in_features}")  # fmt: skip
            else:
                try:
                    scales, biases, attrs = self._kernel_operands()
                    operands = (pack_rows(layout_codes(w.codes.codes(), w.dtype), w.dtype), scales, biases, attrs)
                except UnsupportedError as exc:  # a small float's kernel scale overflows float16
                    why = str(exc)
            self._prepared["cpu_rows"] = (operands, why)
        return self._prepared["cpu_rows"]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ArgumentError(f"QuantizedLinear takes [M, {self.in_features}] inputs, got {list(x.shape)}")
        if x.is_cuda:
            key = str(x.device)
            p = self._prepared.get(key)
            if p is None:
                p = self._prepared[key] = prepare(self.weight_q, key)
            y = cuda_matmul(x.to(torch.float16).contiguous(), p)
            return y.to(x.dtype)
        x32 = x.detach().float().numpy()
        rows, why = self._cpu_operands()
        if rows is not None:
            y = cpu_linear(x32, *rows)
        else:
            _log_reference_once(why)
            y = cpu_matmul(x32, self.weight_q)
        return torch.from_numpy(y).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if _runs_eagerly(x2):  # the op's dispatch alone took ~50 us of host time a call on the H200 machine
            y = self.matmul(x2)
        else:  # what torch.compile, export and FX trace (and autograd sees: the op has no backward)
            y = lowbit_linear(x2, self.handle)
        y = y.reshape(*lead, self.out_features)
        return y + self.bias.to(y.dtype) if self.bias is not None else y

    def extra_repr(self) -> str:
        w = self.weight_q
        g = "per channel" if w.group_size >= self.in_features else f"group {w.group_size}"
        return f"{self.in_features} -> {self.out_features}, {w.dtype}, {g}, zeros={w.zeros is not None}"


_REFERENCE_LOGGED: set[str] = set()  # the reasons logged, each once a process


def _log_reference_once(why: str) -> None:
    if why not in _REFERENCE_LOGGED:
        _REFERENCE_LOGGED.add(why)
        log.warning("tessera: QuantizedLinear runs the scalar reference kernel on the CPU (tessera.templates.lowbit.cpu_kernels."
                    "make_linear_cpu), many times slower than the SIMD kernels: %s", why)  # fmt: skip


def quantize(model: torch.nn.Module, weight: str = "int4", group_size: int | None = 128,
             zero_point: bool | None = None, skip: Iterable[str] = (), inplace: bool = False) -> torch.nn.Module:  # fmt: skip
    """A copy of `model` (or `model` itself with inplace=True) whose nn.Linear layers hold
    `weight` codes (any of tessera.quant.WEIGHT_TYPES) with a float16 scale per `group_size`
    inputs (None: per output channel) and, for integer types, optional zero points (default: uint
    types have them).  Layers whose qualified name is in `skip` stay as they are."""
    codecs.weight_type(weight)
    skip = set(skip)
    target = model if inplace else copy.deepcopy(model)
    replaced = 0
    for name, module in list(target.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, torch.nn.Linear) and full not in skip:
                setattr(module, child_name, QuantizedLinear.from_linear(child, weight, group_size, zero_point))
                replaced += 1
    if not replaced:
        raise ArgumentError("quantize() found no nn.Linear layer to quantize in the model")
    return target


def layer_of(handle: int) -> QuantizedLinear:
    layer = _REGISTRY.get(handle)
    if layer is None:
        raise ArgumentError(f"no QuantizedLinear is registered under handle {handle}")
    return layer


def dequantized_linear_weight(layer: QuantizedLinear) -> np.ndarray:
    """The float32 weights the layer's codes stand for (the reference)."""
    return layer.weight_q.dequantize()
