"""`compile_graph`: optimize, partition, lower and build a FlowGraph into a CompiledGraph.

All fused groups of a graph are built with ONE compiler run (`ops.build_many`), after
identical groups (same operators, attributes and input types) are merged.  A group that
fails to lower or compile is not fatal: its operators fall back to their numpy references,
and the user is told why on the "tessera" logger.  A missing or broken compiler, and target
"cuda" without a usable GPU, are fatal: no group could build or run.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Collection, Mapping
from typing import Any

from tessera import ops, settings
from tessera.errors import (
    ArgumentError,
    BrokenCompilerError,
    CompilerNotFoundError,
    DeviceError,
    TesseraError,
    UnsupportedError,
)
from tessera.graph import lowering
from tessera.graph.compiler.compiled_graph import CompiledGraph
from tessera.graph.compiler.in_place import plan_in_place
from tessera.graph.compiler.memory import choose_memory
from tessera.graph.compiler.options import CompileOptions, parse_options
from tessera.graph.compiler.partition import Group, partition_for
from tessera.graph.compiler.steps import AnchorStep, FusedStep, ReferenceStep, group_signature, lower_group
from tessera.graph.flow_graph import FlowGraph
from tessera.graph.passes import optimize as run_passes
from tessera.graph.tensor import Tensor
from tessera.progress import bar
from tessera.progress import progress as show_progress
from tessera.runtime import cuda
from tessera.templates import choose, chosen, passes
from tessera.tune.tuner import recording

log = logging.getLogger("tessera")


def compile_graph(graph: FlowGraph, target: str = "cpu", *, optimize: bool = True, cuda_graph: bool = True,
                  tune: bool | None = None, arch: str | None = None, progress: bool | None = None,
                  arrays: str = "auto", in_place: Mapping[int, int] | None = None,
                  static_inputs: Collection[int] = ()) -> CompiledGraph:  # fmt: skip
    """Compile `graph` for "cpu" or "cuda".

    optimize: run the graph passes (constant folding, batchnorm folding, QKV merging) first.
    cuda_graph: capture each shape's run into a CUDA graph and replay it.
    tune: time the GEMM schedule space once per shape (candidates compiled in parallel, each
    run once to check and timed; the winner cached on disk, so a warm compile times nothing)
    instead of ranking it with the cost model.  None: on, unless $TESSERA_TUNE=0.
    progress: progress bars (True/False; None: $TESSERA_PROGRESS, else only on a terminal).
    arrays (target "cuda"): "torch" runs on torch CUDA tensors, "native" on tessera's own
    DeviceArrays without torch (inputs from DLPack or host arrays), "auto" picks torch when it
    has CUDA (tessera.graph.compiler.memory).
    in_place: {output index: input index} of outputs the caller writes back into an input (a
    KV-cache update): those that are an index_copy of that input are computed in its memory
    (compiler/in_place.py; `compiled.in_place` lists them) and returned as the input itself.
    static_inputs: indices of inputs the caller keeps at one address (torch's mark_static_address):
    on the GPU with CUDA graphs, their other in_place updates are copied into them by the
    graph's last steps (`compiled.copy_back`), so no copy runs outside the CUDA graph.
    `compiled.report()` (or `tessera.explain(compiled)`) tells what was made of the graph."""
    given = {"cuda_graph": cuda_graph, "progress": progress, "arrays": arrays, **({} if tune is None else {"tune": tune})}
    opts = parse_options(given, where="compile_graph")
    if target not in ("cpu", "cuda"):
        raise ArgumentError(f"target must be 'cpu' or 'cuda', got {target!r}")
    with show_progress(opts.progress):
        return _compile(graph, target, optimize, opts, arch, in_place, static_inputs)


def _compile(graph: FlowGraph, target: str, optimize: bool, opts: CompileOptions, arch: str | None,
             in_place: Mapping[int, int] | None = None, static_inputs: Collection[int] = ()) -> CompiledGraph:  # fmt: skip
    if target == "cuda":
        _require_gpu()
        if opts.arrays == "torch":
            choose_memory(target, opts.arrays)  # refuses now, not after the build, when torch lacks CUDA
    timings: dict[str, float] = {}
    start = time.perf_counter()
    if optimize:
        run_passes(graph)
    for family_pass in passes(target):  # layout decisions the templates need, not optional rewrites
        family_pass.run(graph, opts.tune)  # (the GPU's GEMMs want NHWC, the register-A low-bit kernel its words)
    timings["optimize"] = time.perf_counter() - start
    # Before lowering: it changes the index_copy kernels.  Copies back only where a CUDA graph
    # holds them (the CPU's replay runs C kernels alone, and the caller's copy costs the same).
    captured = target == "cuda" and opts.cuda_graph
    aliases, copied = plan_in_place(graph, in_place, static_inputs if captured else ())
    options = {"cuda_graph": opts.cuda_graph, "tune": opts.tune, "optimize": optimize, "progress": opts.progress,
               "arrays": opts.arrays}  # fmt: skip
    start = time.perf_counter()

    def compilable(op: Any) -> str | None:  # an operator only a template computes (lowbit_linear) where one takes it
        reason = lowering.lowering_error(op)  # looked up per call: tests replace it
        return None if reason is not None and op.kind in lowering.NOT_LOWERED and choose(op, target) else reason

    groups = partition_for(graph, target, compilable)
    timings["partition"] = time.perf_counter() - start
    symbols: dict[str, Any] = {}
    steps: list[Any] = []
    fused = [g for g in groups if g.kind == "fused"]
    built = _build_fused(fused, symbols, target, arch, timings, graph.name)
    for g in groups:
        if g.kind == "reference":
            log.warning("tessera: %s (%s) runs in its numpy reference: %s", g.ops[0].name, g.ops[0].kind, g.reason)
            steps.append(ReferenceStep(g))
        elif g.kind == "anchor":
            steps.append(AnchorStep(g, _anchor_preparer(target, arch, opts.tune, symbols)))
        elif built.get(id(g)) is not None:
            steps.append(FusedStep(g, *built[id(g)]))
        else:
            for op in g.ops:
                steps.append(ReferenceStep(_single(op)))
    compiled = CompiledGraph(graph, target, steps, options, in_place=aliases, copy_back=copied)
    compiled.timings.update(timings)
    return compiled


def _require_gpu() -> None:
    """Refuse target "cuda" at once on a machine that cannot run it (rather than falling back
    group by group and failing at the first call)."""
    try:
        cuda.context()
    except DeviceError as exc:
        raise DeviceError(f"compile_graph(..., 'cuda') needs a CUDA GPU and driver: {exc}") from None


def _build_fused(groups: list[Group], symbols: dict[str, Any], target: str, arch: str | None,
                 timings: dict[str, float], name: str) -> dict[int, Any]:  # fmt: skip
    """(CompiledOp, output nodes per operator) of each fused group (None where a group
    fails), one compiler run overall; the seconds spent go into `timings`."""

    by_signature: dict[str, list[Group]] = {}
    for g in groups:
        by_signature.setdefault(group_signature(g), []).append(g)
    lowered: list[tuple[list[Group], Any, list]] = []
    start = time.perf_counter()
    compiler = "gcc" if target == "cpu" else "nvcc"
    with bar(total=len(by_signature) + 1, desc=f"{name}: lowering", unit="step") as progress_bar:
        for members in by_signature.values():
            nodes: list = []
            try:
                lowered.append((members, lower_group(members[0], symbols, nodes=nodes), nodes))
            except (TesseraError, NotImplementedError, ValueError, TypeError) as exc:
                log.warning("tessera: could not lower %s: %s; its operators run in their numpy references", members[0], exc)
            progress_bar.update()
        timings["lower"] = time.perf_counter() - start
        result: dict[int, Any] = {}
        if not lowered:
            return result
        progress_bar.set_description_str(f"tessera: {name}: building {len(lowered)} fused groups with {compiler}")
        start = time.perf_counter()
        try:
            compiled = _build_lowered(lowered, target, arch)
        finally:
            timings["build"] = time.perf_counter() - start
        progress_bar.update()
    for (members, _, nodes), op in zip(lowered, compiled):
        for g in members:
            result[id(g)] = (op, nodes) if op is not None else None
    return result


def _build_lowered(lowered: list[tuple[list[Group], Any, list]], target: str, arch: str | None) -> list[Any]:
    """ops.build_many over the lowered groups; one by one if that fails (None for a group that fails)."""
    try:
        return ops.build_many([lw for _, lw, _ in lowered], target, name="g", arch=arch)
    except (CompilerNotFoundError, BrokenCompilerError):
        raise  # the compiler, not the code: every group would fail the same way
    except TesseraError as exc:
        log.warning("tessera: building the fused groups together failed (%s); building them one by one", exc)
        compiled = []
        for members, lw, _ in lowered:
            try:
                compiled.append(ops.build(*lw, target=target, name="g", arch=arch))
            except (CompilerNotFoundError, BrokenCompilerError):
                raise
            except TesseraError as inner:
                log.warning("tessera: %s failed to build: %s; its operators run in their numpy references", members[0], inner)
                compiled.append(None)
        return compiled


def _single(op: Any) -> Group:
    # Every output of a fallback operator is materialised: it may feed the next fallback.
    return Group("reference", [op], list(dict.fromkeys(op.inputs)), list(op.outputs), reason="its fused group did not build")


# CUDA anchor kernels by (group structure, input shapes, tuning, arch), most recent last: the
# 22 equal layers of a Llama plan, generate and load their GEMMs once, and so does a recompile in
# the same process (dynamo's guards failing, torch._dynamo.reset()).  Templates hold no device
# memory; each step gets a sibling with workspaces of its own (AnchorKernel.sibling).
_SHARED_ANCHORS: OrderedDict[tuple, Any] = OrderedDict()
SHARED_ANCHORS_KEPT = 512


def _shared_anchor(key: tuple | None) -> Any:
    template = _SHARED_ANCHORS.get(key) if key is not None else None
    if template is None:
        return None
    _SHARED_ANCHORS.move_to_end(key)
    kernel = template.sibling()
    kernel.artifacts, kernel.tuning = template.artifacts, template.tuning
    return kernel


def _keep_anchor(key: tuple | None, kernel: Any) -> None:
    template = kernel.sibling(workspaces=False) if key is not None and hasattr(kernel, "sibling") else None
    if template is not None:
        template.artifacts, template.tuning = kernel.artifacts, kernel.tuning
        _SHARED_ANCHORS[key] = template
        while len(_SHARED_ANCHORS) > SHARED_ANCHORS_KEPT:
            _SHARED_ANCHORS.popitem(last=False)


def planning_settings() -> tuple[str, bool]:
    """The environment settings the anchors' planners read ($TESSERA_LOWBIT_PREFILL,
    $TESSERA_IMPLICIT_CONV): part of the shared anchors' key, so that a recompile under another
    setting plans anew rather than reusing the kernels planned under the first."""
    return settings.lowbit_prefill(), settings.implicit_conv()


def _anchor_preparer(target: str, arch: str | None, tune: bool, symbols: dict[str, Any]) -> Any:
    """prepare(group, shapes) -> kernel(arrays, outputs) for an AnchorStep; the kernel carries
    `.artifacts` (its built cubins) and `.tuning` (the tuning records that chose its schedule),
    which a saved compiled graph ships."""

    generic: list[Any] = []  # [the template's size-generic kernels or None], asked on the first call

    def prepare(group: Group, shapes: Mapping[Tensor, tuple[int, ...]]) -> Any:
        key = None
        if target == "cuda":  # CPU templates pack constant weights into the kernel: not shared
            key = (group_signature(group), tuple(shapes[t] for t in group.inputs), tune, arch, planning_settings())
            shared = _shared_anchor(key)
            if shared is not None:
                return shared
        with recording() as tuning:
            try:
                template = chosen(group.anchor, target)
                if not generic:
                    generic.append(template.generic(group, tune))
                if generic[0] is not None:  # one build serves every size: a new one launches kernels that exist
                    kernel = generic[0].bind(shapes)
                else:
                    kernel = template.prepare(group, shapes, tune)
                own = list(getattr(kernel.kernel, "artifacts", None) or [kernel.kernel.artifact])
                # A saved graph ships every kernel the generic site built, not only this shape's.
                kernel.artifacts = list(dict.fromkeys([*own, *getattr(generic[0], "artifacts", ())]))
            except UnsupportedError as exc:
                log.info("tessera: %s runs without its template (%s)", group.anchor.name, exc)
                kernel = _generic_anchor(group, shapes, target, arch, symbols)
                kernel.no_template = str(exc)  # type: ignore[attr-defined]  (the compile report says why)
        kernel.tuning = list(tuning)
        _keep_anchor(key, kernel)
        return kernel

    return prepare


def _generic_anchor(group: Group, shapes: Mapping[Tensor, tuple[int, ...]], target: str, arch: str | None,
                    symbols: dict[str, Any]) -> Any:  # fmt: skip
    """The anchor group through the ops auto-scheduler, for shapes no template takes."""
    outs, ins = lower_group(group, symbols, concrete={t: shapes[t] for t in group.inputs})
    compiled = ops.build(outs, ins, target=target, name="a", arch=arch)

    def run(arrays: Any, outputs: Any) -> None:
        compiled.run(arrays, outputs)

    run.artifacts = [compiled.artifact]  # type: ignore[attr-defined]
    run.compiled = compiled  # type: ignore[attr-defined]
    return run
