"""Attention on the CPU generic in its sizes: one build serves every batch and length.

Under dynamic shapes (`torch.compile(..., dynamic=True)`) a model's attention sees a new query
and key length on nearly every call.  The CPU plan of `plan.py` (two GEMMs around a softmax over
a materialised [B, H, Sq, Sk] score buffer) is specialised to its shapes, so this kernel, written
in tessera (generated C, OpenMP), takes B, Sq and Sk at run time instead and never materialises
the scores: one worker item per (batch, KV head, tile of queries), whose tokens times the G query
heads sharing the KV head make 16 query rows at most; each key and value row is read once for
all of them (a block of keys transposed once, so each row's scores are vector FMAs along the
keys), and every row keeps an online softmax updated once per block of keys (as the paged
decode kernel does, `paged_attention/cpu.py`).  Everything accumulates in float32.

The kernel is specialised to what the graph fixes: head dims, the group size, the scale,
causal or not, and the mask's kind (bool keeps, float adds) and which of its dimensions are a
literal 1 (broadcast); the mask arrives as 4-D (ones prepended).  Only keys a row sees are read
(loop bounds, never conditions).  A row that sees no key gives NaN, as the operator's reference.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from math import prod

import numpy as np

import tessera as ts
from tessera import f32
from tessera.backend.isa import vector_lanes
from tessera.errors import ArgumentError
from tessera.graph.tensor import Tensor
from tessera.ir import dtypes
from tessera.ir.dtypes import DataType
from tessera.ir.vector import vector_type
from tessera.jit import Kernel
from tessera.templates.cpu.gemm import cpu_threads
from tessera.templates.kernel import CONSTANT, INPUT, OUTPUT, AnchorPlan, CpuAnchorKernel, Launch, Slot, build_all
from tessera.templates.paged_attention.cpu import SERIAL_WORK, cpu_tile
from tessera.templates.registry import AnchorSite, Shape, StepKernel

NEG_INF = float("-inf")
KEY_BLOCK = 32  # keys per online-softmax update


@functools.cache
def make_flash_attention_cpu(head_dim: int, value_dim: int, group: int, scale: float, causal: bool,
                             mask: tuple[DataType, tuple[bool, bool, bool, bool]] | None, lanes: int,
                             parallel: bool = True) -> Kernel:  # fmt: skip
    """kernel(Q [B, H, SQ, D], K [B, KVH, SK, D], V [B, KVH, SK, DV], M, Out [B, H, SQ, DV]),
    H = KVH * group, float32.  `mask`: (dtype, per dimension of [B, H, SQ, SK] whether the mask
    broadcasts over it), M 4-D with 1 there; without a mask M is any [1, 1, 1, 1] float32 array,
    never read.  `lanes`: float32 lanes of this machine's vectors (the scores of a row and its
    output run on them); `parallel` as in the paged kernel."""
    D, DV, G, QT, BS, L = head_dim, value_dim, group, cpu_tile(group), KEY_BLOCK, lanes
    if L not in (8, 16):
        raise ArgumentError(f"flash attention on the CPU: lanes must be 8 (AVX2) or 16 (AVX-512), got {L}")
    vt = vector_type(f32, L)
    kvecs, dvecs = tuple(range(BS // L)), tuple(range(DV // L))
    vector_pv = DV % L == 0
    R = QT * G
    masked = mask is not None
    boolean = masked and mask[0] == dtypes.boolean
    MT = mask[0] if masked else f32
    bb, bh, bq, bk = mask[1] if masked else (True, True, True, True)
    mdims = (1 if bb else "MB", 1 if bh else "MH", 1 if bq else "MQ", 1 if bk else "MK")
    items = ts.parallel if parallel else range
    tag = "" if not masked else f"_m{'b' if boolean else 'f'}{''.join('1' if x else 'n' for x in mask[1])}"
    name = f"flash_attention_cpu_d{D}_v{DV}_g{G}{'_causal' if causal else ''}{tag}{'' if parallel else '_serial'}"

    @ts.kernel(target="cpu", name=name)
    def attention(Q: f32["B", "H", "SQ", D], K: f32["B", "KVH", "SK", D], V: f32["B", "KVH", "SK", DV],
                  M: MT[mdims[0], mdims[1], mdims[2], mdims[3]], Out: f32["B", "H", "SQ", DV]):  # fmt: skip
        tiles = ts.ceil_div(SQ, QT)
        for item in items(B * KVH * tiles):
            b = item // (KVH * tiles)
            kvh = item // tiles % KVH
            q0 = item % tiles * QT
            rows = (min(q0 + QT, SQ) - q0) * G
            hi = min(q0 + QT, SK) if causal else SK  # keys the item's last row sees: [0, hi)
            qf = ts.register_tensor(f32, [R, D])
            acc = ts.register_tensor(f32, [R, DV])
            m = ts.register_tensor(f32, [R])
            den = ts.register_tensor(f32, [R])
            scores = ts.register_tensor(f32, [BS])
            kt = ts.register_tensor(f32, [D, BS])  # the block's keys, transposed
            sv = ts.register_tensor(vt, [BS // L])
            ov = ts.register_tensor(vt, [max(DV // L, 1)])
            for r in range(rows):
                m[r] = NEG_INF
                den[r] = 0.0
                for d in range(D):
                    qf[r, d] = Q[b, kvh * G + r % G, q0 + r // G, d] * scale
                for d in range(DV):
                    acc[r, d] = 0.0
            for blk in range(ts.ceil_div(hi, BS)):
                kn = min(hi - blk * BS, BS)
                for kk in range(kn):
                    for d in range(D):
                        kt[d, kk] = K[b, kvh, blk * BS + kk, d]
                for kk in range(kn, BS):
                    for d in range(D):
                        kt[d, kk] = 0.0
                for r in range(rows):
                    q = q0 + r // G
                    h = kvh * G + r % G
                    k1 = max(min(q + 1 - blk * BS, kn), 0) if causal else kn  # a row may see none of the block
                    # A row's scores for the whole block at once: vectors along the keys, no
                    # horizontal sums (the keys it does not see are computed and ignored).
                    for c in kvecs:
                        sv[c] = ts.vbroadcast(0.0, L)
                    for d in range(D):
                        a = ts.vbroadcast(qf[r, d], L)
                        for c in kvecs:
                            sv[c] = ts.vfma(a, ts.vload(kt[d, c * L], L), sv[c])
                    for c in kvecs:
                        ts.vstore(scores[c * L], sv[c])
                    top = NEG_INF
                    for kk in range(k1):
                        key = blk * BS + kk
                        dot = scores[kk]
                        if masked:
                            mv = M[0 if bb else b, 0 if bh else h, 0 if bq else q, 0 if bk else key]
                            if boolean:
                                dot = ts.select(mv, dot, NEG_INF)
                            else:
                                dot = dot + ts.cast(mv, f32)
                        scores[kk] = dot
                        top = max(top, dot)
                    for kk in range(k1, BS):
                        scores[kk] = NEG_INF
                    old = m[r]
                    new = max(old, top)
                    m[r] = new
                    # Shifted by 0 while nothing is seen (no key, or all masked so far): every
                    # exponential is then 0 and the state stays zero.  No conditions in the
                    # loops, so gcc vectorises the exponentials.
                    shift = ts.select(new == NEG_INF, 0.0, new)
                    alpha = ts.exp(old - shift)
                    total = 0.0
                    for kk in range(BS):
                        e = ts.exp(scores[kk] - shift)
                        scores[kk] = e
                        total += e
                    den[r] = den[r] * alpha + total
                    if vector_pv:  # the row's output in vector registers for the whole block
                        scale_v = ts.vbroadcast(alpha, L)
                        for c in dvecs:
                            ov[c] = ts.vmul(ts.vload(acc[r, c * L], L), scale_v)
                        for kk in range(k1):
                            p = ts.vbroadcast(scores[kk], L)
                            for c in dvecs:
                                ov[c] = ts.vfma(p, ts.vload(V[b, kvh, blk * BS + kk, c * L], L), ov[c])
                        for c in dvecs:
                            ts.vstore(acc[r, c * L], ov[c])
                    else:
                        for d in range(DV):
                            acc[r, d] = acc[r, d] * alpha
                        for kk in range(k1):
                            p = scores[kk]
                            for d in range(DV):
                                acc[r, d] += p * V[b, kvh, blk * BS + kk, d]
            for r in range(rows):
                inv = 1.0 / den[r]
                for d in range(DV):
                    Out[b, kvh * G + r % G, q0 + r // G, d] = acc[r, d] * inv

    return attention


class GenericCpuAttention:
    """The kernels of one CPU attention site with symbolic sizes, for every size: `bind(shapes)`
    gives the step's kernel (on one thread for small work, else the OpenMP one; both built on
    the first call, together)."""

    def __init__(self, site: AnchorSite):
        op = site.anchor
        q, k, v = op.inputs[:3]
        self.heads, self.kv_heads, self.head_dim, self.value_dim = q.shape[1], k.shape[1], q.shape[3], v.shape[3]
        scale = op.attrs.get("scale")
        self.scale = self.head_dim**-0.5 if scale is None else float(scale)
        self.causal = bool(op.attrs.get("causal", False))
        self.mask: tuple[DataType, tuple[bool, bool, bool, bool]] | None = None
        if len(op.inputs) == 4:
            m = op.inputs[3]
            padded = (1,) * (4 - m.ndim) + tuple(m.shape)
            self.mask = (m.dtype, tuple(d == 1 for d in padded))  # type: ignore[assignment]
        position = {t: i for i, t in enumerate(site.inputs)}
        self._operands = [position[t] for t in op.inputs]
        self._q, self._k = q, k
        self._kernels: dict[bool, CpuAnchorKernel] = {}

    @property
    def artifacts(self) -> list[str]:
        """The libraries of both variants once built (what a saved graph ships)."""
        return [a for k in self._kernels.values() for a in k.artifacts]

    def bind(self, shapes: Mapping[Tensor, Shape]) -> StepKernel:
        """The step's kernel for these concrete shapes."""
        q_shape, k_shape = shapes[self._q], shapes[self._k]
        work = prod(q_shape) * k_shape[2] * 2 // (2 if self.causal else 1)
        parallel = work >= SERIAL_WORK and cpu_threads() > 1
        if not self._kernels:  # both variants at once: a later size crossing the line finds its kernel built
            variants = [False, True] if cpu_threads() > 1 else [False]
            self._kernels = dict(zip(variants, build_all([self._plan(p) for p in variants])))
        return StepKernel(self._kernels[parallel], self._operands, [])

    def _plan(self, parallel: bool) -> AnchorPlan:
        f = make_flash_attention_cpu(self.head_dim, self.value_dim, self.heads // self.kv_heads, self.scale,
                                     self.causal, self.mask, vector_lanes(), parallel).ir  # fmt: skip
        plan = AnchorPlan("attention", [], (), dtypes.float32, 3 if self.mask is None else 4, 0, target="cpu")
        if self.mask is None:  # the kernel's mask parameter, never read
            plan.constants.append(np.zeros((1, 1, 1, 1), np.float32))
        m_slot: Slot = (INPUT, 3) if self.mask is not None else (CONSTANT, 0)
        plan.launches.append(Launch(f, [(INPUT, 0), (INPUT, 1), (INPUT, 2), m_slot, (OUTPUT, 0)], generic=True))
        plan.config = "flash, generic in the sizes" + ("" if parallel else ", one thread")
        return plan
