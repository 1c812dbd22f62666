"""The compile report: what the graph compiler made of a graph, kernel by kernel.

`CompiledGraph.report()` returns a `GraphReport`; `tessera.explain(compiled)` and
`tessera run --explain` print it.  Front ends that compile several graphs (torch.compile's
graph breaks, ONNX specialisations) gather their graphs' reports in a `CompileReport`, with
what they left outside tessera and why.  Both print as short text and convert to plain dicts
(`to_dict()`, JSON-ready) for tools.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tessera.templates import refusals

PHASES = ("translate", "optimize", "partition", "lower", "build", "plan", "anchors")


@dataclass
class KernelInfo:
    """One step's kernel(s): `ops` are the graph operators computed in it ("kind name")."""

    step: int
    kind: str  # "fused", "anchor" or "reference"
    kernels: list[str]
    ops: list[str]
    how: str  # the ops scheduler's schedule, the template, or why it is not compiled
    config: str | None = None
    tuned: bool | None = None  # anchors: True if the tuner chose the config, False if the cost model did
    shape: str | None = None  # anchors are prepared per input shape
    shared_with: int | None = None  # the step whose kernels these are (identical groups build once)

    def lines(self, first: bool) -> list[str]:
        """Printed lines: the step's number before its first kernel only."""
        head = f"{self.step:>3}." if first else "    "
        names = ", ".join(self.kernels) if self.kernels else "(no kernel)"
        detail = [self.how]
        if self.config:
            detail.append(f"config {self.config} ({'tuned' if self.tuned else 'cost model'})")
        if self.shape:
            detail.append(f"shapes {self.shape}")
        if self.shared_with is not None:
            detail.append(f"same kernels as step {self.shared_with}")
        return [f"{head} {names}  [{'; '.join(detail)}]", f"       <- {', '.join(self.ops) or '(nothing)'}"]


@dataclass
class PlanInfo:
    """The memory plan of one set of symbol values: one arena for every intermediate."""

    sizes: dict[str, int]
    arena_bytes: int
    unshared_bytes: int


@dataclass
class GraphReport:
    """What `compile_graph` made of one graph."""

    name: str
    target: str
    operators: int
    options: dict[str, Any]
    kernels: list[KernelInfo] = field(default_factory=list)
    reference: list[tuple[str, str]] = field(default_factory=list)  # (operator, why it is not compiled)
    views: list[str] = field(default_factory=list)  # operators that compute nothing (a reshape of an input)
    plans: list[PlanInfo] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    cuda_graph: bool = False
    in_place: list[str] = field(default_factory=list)  # outputs written into their input (compiler/in_place.py)
    declined: list[tuple[str, str]] = field(default_factory=list)  # (operator, why no template took it)

    @property
    def num_kernels(self) -> int:
        return sum(len(k.kernels) for k in self.kernels if k.shared_with is None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        counts: dict[str, int] = {}
        for k in {k.step: k for k in self.kernels}.values():
            counts[k.kind] = counts.get(k.kind, 0) + 1
        steps = ", ".join(f"{n} {kind}" for kind, n in counts.items())
        opts = " ".join(f"{k}={v}" for k, v in self.options.items())
        lines = [f'graph "{self.name}" on {self.target}: {self.operators} operators -> {self.num_kernels} kernels '
                 f"in {sum(counts.values())} step{'s' if sum(counts.values()) != 1 else ''} ({steps or 'none'})",
                 f"  options: {opts}" + (", replayed as a CUDA graph" if self.cuda_graph else "")]  # fmt: skip
        for i, k in enumerate(self.kernels):
            lines += ["  " + text for text in k.lines(i == 0 or self.kernels[i - 1].step != k.step)]
        if self.views:
            lines.append(f"  views (no kernel needed): {', '.join(self.views)}")
        if self.in_place:
            lines.append(f"  written into their inputs, nothing copied back ({len(self.in_place)}): "
                         + ", ".join(self.in_place))  # fmt: skip
        if self.declined:
            lines.append(f"  on generic kernels, no template took them ({len(self.declined)}):")
            lines += [f"    {op}: {why}" for op, why in self.declined]
        if self.reference:
            lines.append(f"  left to the numpy reference ({len(self.reference)}):")
            lines += [f"    {op}: {why}" for op, why in self.reference]
        if not self.plans:
            lines.append("  memory plan: none yet (one per set of input sizes, made on the first call)")
        for p in self.plans:
            sizes = ", ".join(f"{k}={v}" for k, v in p.sizes.items()) or "static shapes"
            lines.append(f"  memory plan ({sizes}): arena {_bytes(p.arena_bytes)} "
                         f"(without reuse {_bytes(p.unshared_bytes)})")  # fmt: skip
        lines.append("  compile time: " + _times(self.timings))
        return "\n".join(lines)

    __repr__ = __str__


@dataclass
class CompileReport:
    """Reports of several graphs compiled for one model, and what ran outside tessera."""

    title: str
    graphs: list[GraphReport] = field(default_factory=list)
    outside: list[tuple[str, str]] = field(default_factory=list)  # (what, why) left to the front end's framework
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        lines = [f"{self.title}: {len(self.graphs)} graph{'s' if len(self.graphs) != 1 else ''} compiled by tessera"]
        lines += self.notes
        if self.outside:
            lines.append(f"left outside tessera ({len(self.outside)}):")
            lines += [f"  {what}: {why}" for what, why in self.outside]
        for g in self.graphs:
            lines.append(str(g))
        return "\n".join(lines)

    __repr__ = __str__


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _times(timings: dict[str, float]) -> str:
    if not timings:
        return "not measured"
    order = [p for p in PHASES if p in timings] + [p for p in timings if p not in PHASES]
    parts = ", ".join(f"{p} {timings[p]:.2f} s" for p in order)
    return f"{parts}; total {sum(timings.values()):.2f} s"


def _op(op: Any) -> str:
    return f"{op.kind} ({op.name})"


def graph_report(compiled: Any) -> GraphReport:
    """The report of a CompiledGraph (see CompiledGraph.report)."""
    opts = {k: compiled.options[k] for k in ("tune", "cuda_graph") if k in compiled.options}
    report = GraphReport(compiled.graph.name, compiled.target, len(compiled.graph.operators), opts,
                         timings=dict(compiled.timings), cuda_graph=compiled.use_cuda_graph)  # fmt: skip
    first_step: dict[int, int] = {}  # id(CompiledOp) -> the step that lists its kernels
    for i, step in enumerate(compiled.steps, 1):
        if step.kind == "reference":
            report.reference.append((_op(step.op), step.group.reason))
            report.kernels.append(KernelInfo(i, "reference", [], [_op(step.op)], "numpy reference: " + step.group.reason))
        elif step.kind == "fused":
            for op in step.group.ops:
                reasons = refusals(op, compiled.target)
                if reasons:
                    report.declined.append((_op(op), "; ".join(f"{name}: {why}" for name, why in reasons)))
            shared = first_step.setdefault(id(step.compiled), i)
            _fused(report, i, step, shared if shared != i else None)
        else:
            _anchor(report, i, step)
    g = compiled.graph
    report.in_place = [f"{g.inputs[i].name} (in place)" for i in compiled.in_place.values()]
    report.in_place += [f"{g.inputs[i].name} (copied at the end)" for i in compiled.copy_back.values()]
    for key, plan in compiled._plans.items():
        report.plans.append(PlanInfo({k: int(v) for k, v in key}, plan.arena_bytes, plan.unshared_bytes))
    return report


def _fused(report: GraphReport, index: int, step: Any, shared_with: int | None) -> None:
    if not step.op_nodes:  # built without the operator map: the group as a whole
        names = [k.name for k in step.compiled.kernels]
        report.kernels.append(KernelInfo(index, "fused", names, [_op(op) for op in step.group.ops], "fused",
                                         shared_with=shared_with))  # fmt: skip
        return
    placed: set[int] = set()
    for spec, ops in step.kernel_ops():
        placed.update(id(op) for op in ops)
        report.kernels.append(KernelInfo(index, "fused", [spec.name], [_op(op) for op in ops],
                                         f"fused, schedule {spec.schedule}", shared_with=shared_with))  # fmt: skip
    report.views += [_op(op) for op in step.group.ops if id(op) not in placed]


def _shapes(shapes: list[tuple]) -> str:
    """Input shapes of an anchor's calls: `[a] x [b]` per call, the first few of many."""
    texts = [" x ".join(str(list(s)) for s in shape) for shape in shapes[:3]]
    more = f"; and {len(shapes) - 3} more" if len(shapes) > 3 else ""
    return "; ".join(texts) + more


def _anchor(report: GraphReport, index: int, step: Any) -> None:
    ops = [_op(op) for op in step.group.members]
    prepared = step.prepared_by_shape()
    if not prepared:
        report.kernels.append(KernelInfo(index, "anchor", [], ops, f"{step.anchor.kind} template, prepared per shape "
                                                                   "on the first call (none yet)"))  # fmt: skip
    # Shapes that run the same loaded kernel (a template generic in the sizes) are listed together.
    by_kernel: dict[int, list[tuple[tuple, Any]]] = {}
    for shape, kernel in prepared:
        template = getattr(kernel, "kernel", None)
        key = id(template) if template is not None and hasattr(template, "kernels") else id(kernel)
        by_kernel.setdefault(key, []).append((shape, kernel))
    for same in by_kernel.values():
        shape, kernel = same[0]
        shape_text = _shapes([s for s, _ in same])
        template = getattr(kernel, "kernel", None)
        if template is not None and hasattr(template, "kernels"):
            report.kernels.append(KernelInfo(index, "anchor", list(template.kernels), ops, f"{step.anchor.kind} template",
                                             config=str(template.config) if template.config is not None else None,
                                             tuned=bool(getattr(kernel, "tuning", None)), shape=shape_text))  # fmt: skip
        else:
            compiled = getattr(kernel, "compiled", None)
            names = [k.name for k in compiled.kernels] if compiled is not None else []
            why = getattr(kernel, "no_template", "")
            report.kernels.append(KernelInfo(index, "anchor", names, ops, "ops scheduler, no template"
                                             + (f": {why}" if why else ""), shape=shape_text))  # fmt: skip
