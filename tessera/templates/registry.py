"""The template registry: which kernel template computes a graph operator, on which target.

Each family (`tessera.templates.<family>/`) registers `Template` objects when its package is
imported; `tessera.templates` imports every family.  A template says, for an operator:

- whether it takes it, or why not (`refuse`: None, or a reason that `explain` prints);
- whether it folds an elementwise tail into its stores (`takes_epilogue`);
- its tuning space for the operator's shapes on the target (`space`);
- its plan, loaded: the kernel a compiled graph's step calls (`prepare`), per concrete shape,
  or, for a group with symbolic sizes, kernels that serve every size (`generic`).

A family may also contribute graph passes that must run before partitioning on its target
(`passes`: the GPU's channels-last layout, the low-bit kernels' fragment-ordered words).
The graph compiler asks `choose(op, target)` instead of branching on op kind and target.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tessera import ops
from tessera.errors import ArgumentError, UnsupportedError
from tessera.graph.flow_graph import FlowGraph
from tessera.graph.lowering import dim_expr, lower_operator
from tessera.graph.operator import Operator
from tessera.graph.tensor import Tensor
from tessera.templates.epilogue import Epilogue

TARGETS = ("cpu", "cuda")
Shape = tuple[int, ...]
GraphPass = Callable[[FlowGraph, bool], Any]  # (graph, tune) -> anything; rewrites the graph in place


class AnchorSite(Protocol):
    """What a template prepares: the graph compiler's anchor group (compiler/partition.py)."""

    inputs: list[Tensor]
    outputs: list[Tensor]
    prologue: list[Operator]

    @property
    def anchor(self) -> Operator: ...

    @property
    def epilogue(self) -> list[Operator]: ...


class SizeGeneric(Protocol):
    """A template's kernels for one anchor group generic in its symbolic sizes (Template.generic)."""

    def bind(self, shapes: Mapping[Tensor, Shape]) -> StepKernel:
        """The step's kernel at these concrete shapes (built kernels reused)."""
        ...

    @property
    def artifacts(self) -> list[str]:
        """Every artifact built so far, for every size (what a saved compiled graph ships)."""
        ...


class Template:
    """One kernel template as the graph compiler sees it.  Subclasses set `name`, `kinds`
    (graph operator kinds) and `target`, and implement `refuse` and `plan`."""

    name: str = ""
    kinds: tuple[str, ...] = ()
    target: str = "cuda"
    epilogue: bool = True  # folds an elementwise tail into its stores

    def refuse(self, op: Operator) -> str | None:
        """None when the template computes `op` (at whatever sizes its tensors take), else why not."""
        raise NotImplementedError

    def takes_epilogue(self, op: Operator) -> bool:
        """Whether the elementwise chain after `op` can fold into this template's stores."""
        return self.epilogue

    def space(self, op: Operator, shapes: Sequence[Shape]) -> list[Any]:
        """The candidate schedules tuning times for `op` at these input shapes (one entry: a
        template without choices)."""
        return [None]

    def views(self, op: Operator, consumers: Mapping[Tensor, list[Operator]],
              outputs: set[Tensor]) -> tuple[list[Operator], list[Operator]]:  # fmt: skip
        """View operators the template reads its operands through (before) and writes its
        output through (after), in place; none unless the template overrides this."""
        return [], []

    def plan(self, op: Operator, shapes: list[Shape], epilogue: Epilogue | None, tune: bool) -> Any:
        """The loaded kernel for `op` at input `shapes`: called `kernel(operands, output, extras)`."""
        raise NotImplementedError

    def generic(self, site: AnchorSite, tune: bool) -> SizeGeneric | None:
        """Kernels for an anchor group with symbolic sizes that serve every size it takes (built
        once, not per shape), or None: the group is then prepared per shape (`prepare`)."""
        return None

    def prepare(self, site: AnchorSite, shapes: Mapping[Tensor, Shape], tune: bool) -> StepKernel:
        """The kernel of an anchor group at concrete shapes, called on the group's arrays."""
        op = site.anchor
        epilogue, extra_t = anchor_epilogue(site, shapes)
        position = {t: i for i, t in enumerate(site.inputs)}
        kernel = self.plan(op, [shapes[t] for t in op.inputs], epilogue, tune)
        return StepKernel(kernel, [position[t] for t in op.inputs], [position[t] for t in extra_t])

    def __repr__(self) -> str:
        return f"<template {self.name} ({self.target}: {', '.join(self.kinds)})>"


@dataclass(frozen=True)
class FamilyPass:
    """A graph pass a family needs before partitioning on `target`."""

    name: str
    target: str
    run: GraphPass


_TEMPLATES: list[Template] = []
_PASSES: list[FamilyPass] = []


def register(template: Template) -> Template:
    """Add a template (earlier registrations are asked first)."""
    if template.target not in TARGETS or not template.kinds or not template.name:
        raise ArgumentError(f"a template needs a name, operator kinds and a target in {TARGETS}: {template!r}")
    if any(t.name == template.name and t.target == template.target for t in _TEMPLATES):
        raise ArgumentError(f"template {template.name!r} for {template.target} is registered twice")
    _TEMPLATES.append(template)
    return template


def register_pass(name: str, target: str, run: GraphPass) -> None:
    """Add a graph pass that runs before partitioning when compiling for `target`."""
    _PASSES.append(FamilyPass(name, target, run))


def templates(target: str | None = None) -> list[Template]:
    """The registered templates, for one target or all, in the order they are asked."""
    return [t for t in _TEMPLATES if target is None or t.target == target]


def passes(target: str) -> list[FamilyPass]:
    return [p for p in _PASSES if p.target == target]


def choose(op: Operator, target: str) -> Template | None:
    """The first template of `target` that takes `op`, or None."""
    for t in _TEMPLATES:
        if t.target == target and op.kind in t.kinds and t.refuse(op) is None:
            return t
    return None


def refusals(op: Operator, target: str) -> list[tuple[str, str]]:
    """(template, reason) for each template of `target` that covers op's kind but refuses it."""
    found = []
    for t in _TEMPLATES:
        if t.target == target and op.kind in t.kinds:
            reason = t.refuse(op)
            if reason is not None:
                found.append((t.name, reason))
    return found


def chosen(op: Operator, target: str) -> Template:
    """`choose`, raising UnsupportedError with every template's reason when none takes `op`."""
    t = choose(op, target)
    if t is None:
        why = "; ".join(f"{name}: {reason}" for name, reason in refusals(op, target)) or "no template covers it"
        raise UnsupportedError(f"no kernel template for {op.kind} on {target} ({why})")
    return t


def anchor_epilogue(site: AnchorSite, shapes: Mapping[Tensor, Sequence[Any]],
                    symbols: dict[str, Any] | None = None) -> tuple[Epilogue | None, list[Tensor]]:  # fmt: skip
    """The anchor's elementwise tail as an Epilogue over its accumulator, and the tensors it reads.
    `shapes` are concrete, or int32 expressions over the shape symbols in `symbols` (by name)."""
    if not site.epilogue:
        return None, []
    acc_t = site.anchor.outputs[0]
    extra_t = epilogue_inputs(site)
    acc = ops.placeholder(shapes[site.outputs[0]], acc_t.dtype, "acc")
    extras = [ops.placeholder(shapes[t], t.dtype, f"e{i}") for i, t in enumerate(extra_t)]
    env: dict[Tensor, Any] = {acc_t: acc, **dict(zip(extra_t, extras))}
    for op in site.epilogue:
        env[op.outputs[0]] = lower_operator(op, [env[t] for t in op.inputs], symbols if symbols is not None else {})[0]
    return Epilogue(acc, env[site.outputs[0]], extras), extra_t


def symbolic_epilogue(site: AnchorSite) -> tuple[Epilogue | None, tuple[Any, ...]]:
    """`anchor_epilogue` over the graph's own symbolic shapes (a kernel generic in its sizes,
    whose epilogue symbols become shape parameters), and the output's symbolic shape."""
    symbols: dict[str, Any] = {}
    shapes = {t: tuple(dim_expr(d, symbols) for d in t.shape) for t in [*site.outputs, *epilogue_inputs(site)]}
    return anchor_epilogue(site, shapes, symbols)[0], shapes[site.outputs[0]]


def epilogue_inputs(site: AnchorSite) -> list[Tensor]:
    """The tensors the anchor's epilogue reads besides the anchor's result, in the order its
    kernel takes them as extras."""
    acc_t = site.anchor.outputs[0]
    chain_outputs = {op.outputs[0] for op in site.epilogue}
    return list(dict.fromkeys(t for op in site.epilogue for t in op.inputs if t is not acc_t and t not in chain_outputs))


class StepKernel:
    """A template kernel called on a compiled step's arrays (the group's input order):
    `kernel(operands, output, extras)` with the operands and extras picked by position."""

    def __init__(self, kernel: Any, operands: list[int], extras: list[int]):
        self.kernel = kernel
        self.operands, self.extras = operands, extras

    @property
    def temporaries(self) -> list[tuple[Shape, Any]]:
        """(shape, dtype) of the buffers the kernel takes per call (AnchorKernel.temporaries):
        the graph compiler places them in its arena for the step's duration."""
        return list(getattr(self.kernel, "temporaries", ()))

    def __call__(self, arrays: Any, outputs: Any, temps: Any = ()) -> None:
        operands, extras = [arrays[i] for i in self.operands], [arrays[i] for i in self.extras]
        if temps:
            self.kernel(operands, outputs[0], extras, temps)
        else:
            self.kernel(operands, outputs[0], extras)

    def sibling(self, *, workspaces: bool = True) -> StepKernel | None:
        """The kernel for another group of the same structure and shapes (loaded kernels shared,
        workspaces its own; see AnchorKernel.sibling), or None when the kernel cannot be shared."""
        make = getattr(self.kernel, "sibling", None)
        return None if make is None else StepKernel(make(workspaces=workspaces), self.operands, self.extras)


def static(*tensors: Tensor) -> bool:
    """Whether every size of these tensors is a number (templates specialised to their shapes)."""
    return all(isinstance(d, int) for t in tensors for d in t.shape)
