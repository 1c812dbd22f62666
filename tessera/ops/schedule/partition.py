"""Partition the stages of a compute DAG into kernels.

Every materialised stage anchors a kernel.  A reduction is folded into the kernel of its
consumer (the reduction's *epilogue* fusion: softmax's normalisation, layernorm's scale)
when

* every stage that reads it belongs to that kernel, and
* every read is *aligned*: it indexes the reduction with the consumer's own axis variables
  (or 0 on a size-1 dimension), the same way each time, and all fused reductions of the
  kernel are indexed by the same set of the anchor's axes (the kernel's *outer* axes), and
* the reduction's sizes are the anchor's sizes on those axes: the kernel computes (and stores)
  the reduction once per outer index, so a concat or pad consumer that is larger than the
  reduction, or a slice that is smaller, keeps it in its own kernel.

Then one kernel computes, for each outer index, the reductions in order into local values,
and writes the anchor over the remaining (*inner*) axes: LayerNorm's mean, variance and
normalisation, or softmax's max, sum and division, are one kernel reading the row from memory
per pass and never storing the intermediate statistics.

A `Program` anchors a kernel of its own (its statements are the kernel's body) and absorbs
nothing; the reductions it reads are computed by their own kernels before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.ir import expr as E
from tessera.ir.compute import Program, ReduceCompute, TensorNode, reads_of
from tessera.ops.common import same_dim, static

Position = int | None  # an anchor axis, or None for the constant index 0


@dataclass(eq=False)
class KernelPlan:
    """What one kernel computes.

    `reductions` are the fused reductions in dependency order (the anchor is last when it is
    itself a reduction); `positions[r][d]` says which anchor axis indexes dimension d of r.
    `outer` lists the anchor axes the kernel parallelises over when it has reductions; an
    elementwise kernel (no reductions) has outer None.
    """

    anchor: TensorNode
    values: dict[TensorNode, E.Expr]
    reductions: list[ReduceCompute] = field(default_factory=list)
    positions: dict[ReduceCompute, tuple[Position, ...]] = field(default_factory=dict)
    outer: tuple[int, ...] | None = None
    stores: list[TensorNode] = field(default_factory=list)

    @property
    def members(self) -> list[TensorNode]:
        return [r for r in self.reductions if r is not self.anchor] + [self.anchor]


def _axes_positions(member: TensorNode, plan: KernelPlan) -> dict[E.Var, Position]:
    """Map a member's axis variables to anchor axes."""
    if member is plan.anchor:
        return {v: k for k, v in enumerate(member.axes)}
    return dict(zip(member.axes, plan.positions[member]))


def _aligned(red: ReduceCompute, member: TensorNode, plan: KernelPlan) -> tuple[Position, ...] | None:
    """The positions of `red` if every read of it in `member` is aligned, else None."""
    axes = _axes_positions(member, plan)
    found: tuple[Position, ...] | None = None
    for r in reads_of(plan.values[member]):
        if r.tensor is not red:
            continue
        pos: list[Position] = []
        for d, i in enumerate(r.indices):
            if isinstance(i, E.Var) and i in axes:
                pos.append(axes[i])
            elif isinstance(i, E.Const) and i.value == 0 and static(red.shape[d]) == 1:
                pos.append(None)
            else:
                return None
        used = [p for p in pos if p is not None]
        if len(set(used)) != len(used) or (found is not None and tuple(pos) != found):
            return None
        found = tuple(pos)
    return found


def _absorb(plan: KernelPlan, consumers: dict[TensorNode, set[TensorNode]], assigned: set[TensorNode]) -> None:
    """Fold aligned reductions read by the plan's members into the plan, to a fixed point."""
    changed = True
    while changed:
        changed = False
        members = set(plan.members)
        candidates = [r.tensor for m in plan.members for r in reads_of(plan.values[m])]
        for t in dict.fromkeys(candidates):
            if not isinstance(t, ReduceCompute) or t in members or t in assigned or not consumers[t] <= members:
                continue
            found = {_aligned(t, m, plan) for m in consumers[t]}
            if len(found) != 1 or None in found:
                continue  # unaligned, or indexed differently by different members
            pos = found.pop()
            if not all(p is None or same_dim(t.shape[d], plan.anchor.shape[p]) for d, p in enumerate(pos)):
                continue  # the consumer's domain is not the reduction's
            used = tuple(sorted(p for p in pos if p is not None))
            if plan.outer is None:
                plan.outer = used
            elif used != plan.outer:
                continue
            plan.positions[t] = pos
            plan.reductions.insert(0, t)
            members.add(t)
            changed = True
            break  # members changed: rescan


def _order_reductions(plan: KernelPlan, topo: dict[TensorNode, int]) -> None:
    plan.reductions.sort(key=lambda r: topo[r])


def partition(stages: list[TensorNode], values: dict[TensorNode, E.Expr], outputs: list[TensorNode]) -> list[KernelPlan]:
    """Group the stages into kernels, returned in execution order."""
    topo = {s: k for k, s in enumerate(stages)}
    consumers: dict[TensorNode, set[TensorNode]] = {s: set() for s in stages}
    for s in stages:
        for r in reads_of(values[s]):
            if r.tensor in consumers:
                consumers[r.tensor].add(s)
    assigned: set[TensorNode] = set()
    plans: list[KernelPlan] = []
    for anchor in reversed(stages):
        if anchor in assigned:
            continue
        plan = KernelPlan(anchor, values)
        if isinstance(anchor, ReduceCompute):
            plan.reductions = [anchor]
            plan.positions[anchor] = tuple(range(anchor.rank))
            plan.outer = tuple(range(anchor.rank))
        if not isinstance(anchor, Program):  # a program's kernel is its own statements
            _absorb(plan, consumers, assigned)
        _order_reductions(plan, topo)
        plan.stores = [m for m in plan.members if m is plan.anchor or m in outputs]
        assigned.update(plan.members)
        plans.append(plan)
    plans.sort(key=lambda p: topo[p.anchor])
    return plans
