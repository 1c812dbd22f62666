"""fused_moe on the CPU: the kernels of tessera.templates.moe.cpu, called in order on one call's arrays.

`MoeProblem` is the operator as the kernels see it (sizes and routing flags); `CpuMoeKernel` is
what a compiled graph's anchor step calls: it owns the per-call buffers for its token count
(routing, slots, the experts' intermediate rows), allocated once, and launches route, group,
the grouped up and down GEMMs (and the shared expert's dense ones) and the combine.  The
kernels take the token count at run time, so every token count shares one build.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import tessera as ts
from tessera.errors import ArgumentError
from tessera.jit import build_source, generate_source, load_function
from tessera.templates.moe.cpu import (
    SERIAL_WORK,
    make_combine,
    make_expert_down,
    make_expert_up,
    make_group,
    make_route,
)


@dataclass(frozen=True)
class MoeProblem:
    """A fused_moe operator's sizes and routing: E experts of intermediate size I over hidden size
    H, top k, softmax (else sigmoid) scores, normalised top-k weights times `scale`; a shared
    expert of intermediate size S (0: none), `gated` by a sigmoid."""

    experts: int
    hidden: int
    inter: int
    top_k: int
    softmax: bool
    normalize: bool
    scale: float
    shared: int = 0
    gated: bool = False
    groups: int = 1
    topk_group: int = 1
    choice_bias: tuple[float, ...] | None = None

    @staticmethod
    def of(attrs: dict[str, Any], shapes: Sequence[Sequence[int]]) -> MoeProblem:
        """The problem of a fused_moe operator with these attributes and input shapes."""
        e, two_i, h = shapes[2]
        return MoeProblem(int(e), int(h), int(two_i) // 2, int(attrs["top_k"]), attrs["scoring"] == "softmax",
                          bool(attrs["normalize"]), float(attrs["scale"]), int(shapes[4][0]) // 2 if len(shapes) > 4 else 0,
                          bool(attrs["shared_gated"]), int(attrs.get("groups", 1)), int(attrs.get("topk_group", 1)),
                          None if attrs.get("choice_bias") is None else tuple(float(b) for b in attrs["choice_bias"]))  # fmt: skip

    def active_macs(self, tokens: int) -> int:
        """Multiply-adds of one call over `tokens` tokens (only the chosen experts count)."""
        routed = tokens * self.top_k * 3 * self.hidden * self.inter
        return tokens * self.experts * self.hidden + routed + tokens * 3 * self.hidden * self.shared


@functools.cache
def _library(kernels: tuple[ts.Kernel, ...]) -> tuple[Path, tuple[Any, ...]]:
    """The kernels of one problem built as one library (one gcc run) and loaded."""
    path = build_source(generate_source([k.lowered for k in kernels], "cpu"), "cpu")
    return path, tuple(load_function(k.ir, path, "cpu") for k in kernels)


class CpuMoeKernel:
    """fused_moe on float32 arrays for one token count: `kernel(inputs, out, extras)` with inputs
    (x [..., H], router, gate_up, down[, shared_gate_up, shared_down[, shared_gate]]) in the
    operator's order.  Owns its buffers: one CpuMoeKernel must not run in two threads at once."""

    def __init__(self, problem: MoeProblem, tokens: int):
        p, t = problem, int(tokens)
        if t < 1:
            raise ArgumentError(f"fused_moe: a kernel for {t} tokens")
        self.problem, self.tokens = p, t
        par = p.active_macs(t) >= SERIAL_WORK
        k, e, h = p.top_k, p.experts, p.hidden
        self._route = make_route(e, h, k, p.softmax, p.normalize, par, p.groups, p.topk_group)
        self._group = make_group(e, k)
        self._up = make_expert_up(e, h, p.inter, False, par)
        self._down = make_expert_down(e, h, p.inter, False, par)
        self._combine = make_combine(h, k, p.shared > 0, p.gated, par)
        steps = [self._route, self._group, self._up, self._down]
        if p.shared:
            self._shared_up = make_expert_up(1, h, p.shared, True, par)
            self._shared_down = make_expert_down(1, h, p.shared, True, par)
            steps += [self._shared_up, self._shared_down]
        self._steps = [*steps, self._combine]
        self._library, loaded = _library(tuple(self._steps))
        self._run = dict(zip(self._steps, loaded))
        f32, i32 = np.float32, np.int32
        self._ti, self._tw = np.empty((t, k), i32), np.empty((t, k), f32)
        self._sgv = np.zeros(t, f32)
        self._off, self._row, self._pos = np.empty(e + 1, i32), np.empty(t * k, i32), np.empty((t, k), i32)
        self._hs, self._ys = np.empty((t * k, p.inter), f32), np.empty((t * k, h), f32)
        shared_rows = t if p.shared else 1
        self._hsh, self._ysh = np.empty((shared_rows, max(p.shared, 1)), f32), np.zeros((shared_rows, h), f32)
        self._no_gate = np.zeros((1, h), f32)
        self._choice_bias = np.array(p.choice_bias or [0.0] * e, f32)
        self._dense_off, self._dense_row = np.array([0, t], i32), np.zeros(t, i32)  # (not read: dense)
        self.config = (e, k, "softmax" if p.softmax else "sigmoid", "parallel" if par else "serial")
        self.out_shape: tuple[int, ...] = ()

    @property
    def kernels(self) -> list[str]:
        """The launched kernels' names, in order."""
        return [k.__name__ for k in self._steps]

    @property
    def artifacts(self) -> list[str]:
        """The built library (in the artifact cache)."""
        return [str(self._library)]

    def _call(self, kernel: ts.Kernel, *args: Any) -> None:
        self._run[kernel](args)

    def __call__(self, inputs: Sequence[Any], out: Any, extras: Sequence[Any] = ()) -> None:
        p, t = self.problem, self.tokens
        want = 6 + p.gated if p.shared else 4
        if len(inputs) != want or extras:
            raise ArgumentError(f"fused_moe: takes {want} inputs and no epilogue, got {len(inputs)} and {len(extras)}")
        x = np.asarray(inputs[0]).reshape(t, p.hidden)
        router, gate_up, down = (np.asarray(a) for a in inputs[1:4])
        y = np.asarray(out)
        if not y.flags.c_contiguous or y.size != t * p.hidden:
            raise ArgumentError(f"fused_moe: the output must be a contiguous array of {t} x {p.hidden} floats")
        y = y.reshape(t, p.hidden)  # (a view: the kernels write the caller's memory)
        gate = np.asarray(inputs[6]) if p.gated else self._no_gate
        self._call(self._route, x, router, gate, self._choice_bias, self._ti, self._tw, self._sgv, p.scale)
        self._call(self._group, self._ti, self._off, self._row, self._pos)
        self._call(self._up, x, gate_up, self._off, self._row, self._hs)
        self._call(self._down, self._hs, down, self._off, self._ys)
        if p.shared:
            sgu, sd = (np.asarray(a) for a in inputs[4:6])
            self._call(self._shared_up, x, sgu.reshape(1, *sgu.shape), self._dense_off, self._dense_row, self._hsh)
            self._call(self._shared_down, self._hsh, sd.reshape(1, *sd.shape), self._dense_off, self._ysh)
        self._call(self._combine, self._ys, self._tw, self._pos, self._ysh, self._sgv, y)


def prepare_moe_cpu(attrs: dict[str, Any], shapes: Sequence[Sequence[int]]) -> CpuMoeKernel:
    """The fused_moe kernel for input `shapes` (x's leading sizes give the token count)."""
    problem = MoeProblem.of(attrs, shapes)
    kernel = CpuMoeKernel(problem, int(np.prod(shapes[0][:-1], dtype=np.int64)))
    kernel.out_shape = tuple(shapes[0])
    return kernel


def moe_cpu(x: np.ndarray, weights: Sequence[np.ndarray], attrs: dict[str, Any]) -> np.ndarray:
    """fused_moe of float32 x [..., H] on the CPU kernels, weights in the operator's input order
    after x (router, gate_up, down[, shared_gate_up, shared_down[, shared_gate]])."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    weights = [np.ascontiguousarray(w, dtype=np.float32) for w in weights]
    y = np.empty_like(x)
    if x.size:
        prepare_moe_cpu(attrs, [x.shape, *(w.shape for w in weights)])([x, *weights], y)
    return y
