"""`compile_graph`: optimize, partition, lower and build a FlowGraph into a CompiledGraph.

All fused groups of a graph are built with ONE compiler run (`ops.build_many`), after
identical groups (same operators, attributes and input types) are merged.  A group that
fails to lower or compile is not fatal: its operators fall back to their numpy references,
and the user is told why on the "tessera" logger.  A missing or broken compiler, and target
"cuda" without a usable GPU, are fatal: no group could build or run.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tessera.errors import (
    ArgumentError,
    BrokenCompilerError,
    CompilerNotFoundError,
    DeviceError,
    TesseraError,
    UnsupportedError,
)
from tessera.graph.compiler.anchors import is_anchor, prepare_anchor, takes_epilogue
from tessera.graph.compiler.compiled_graph import CompiledGraph
from tessera.graph.compiler.partition import Group, partition
from tessera.graph.compiler.steps import AnchorStep, FusedStep, ReferenceStep, group_signature, lower_group
from tessera.graph.flow_graph import FlowGraph
from tessera.graph.tensor import Tensor
from tessera.tune.tuner import recording

log = logging.getLogger("tessera")


def compile_graph(graph: FlowGraph, target: str = "cpu", *, optimize: bool = True, cuda_graph: bool = True,
                  tune: bool = False, arch: str | None = None) -> CompiledGraph:  # fmt: skip
    """Compile `graph` for "cpu" or "cuda".

    optimize: run the graph passes (constant folding, batchnorm folding, QKV merging) first.
    cuda_graph: capture each shape's run into a CUDA graph and replay it.
    tune: time the GEMM schedule space per shape (slow the first time, cached) instead of
    choosing a GEMM schedule by heuristic."""
    from tessera.graph.lowering import lowering_error
    from tessera.graph.passes import optimize as run_passes

    if target not in ("cpu", "cuda"):
        raise ArgumentError(f"target must be 'cpu' or 'cuda', got {target!r}")
    if target == "cuda":
        _require_gpu()
    if optimize:
        run_passes(graph)
    options = {"cuda_graph": cuda_graph, "tune": tune, "optimize": optimize}
    groups = partition(graph, lowering_error, lambda op: target == "cuda" and is_anchor(op), takes_epilogue)
    symbols: dict[str, Any] = {}
    steps: list[Any] = []
    fused = [g for g in groups if g.kind == "fused"]
    built = _build_fused(fused, symbols, target, arch)
    for g in groups:
        if g.kind == "reference":
            log.warning("tessera: %s (%s) runs in its numpy reference: %s", g.ops[0].name, g.ops[0].kind, g.reason)
            steps.append(ReferenceStep(g))
        elif g.kind == "anchor":
            steps.append(AnchorStep(g, _anchor_preparer(target, arch, tune, symbols)))
        elif built.get(id(g)) is not None:
            steps.append(FusedStep(g, built[id(g)]))
        else:
            for op in g.ops:
                steps.append(ReferenceStep(_single(op)))
    return CompiledGraph(graph, target, steps, options)


def _require_gpu() -> None:
    """Refuse target "cuda" at once on a machine that cannot run it (rather than falling back
    group by group and failing at the first call)."""
    from tessera.runtime import cuda

    try:
        cuda.context()
    except DeviceError as exc:
        raise DeviceError(f"compile_graph(..., 'cuda') needs a CUDA GPU and driver: {exc}") from None
    try:
        import torch
    except ImportError:
        raise DeviceError("compile_graph(..., 'cuda') needs torch with CUDA (compiled graphs run on torch CUDA "
                          "tensors); install torch, or compile for target='cpu'") from None  # fmt: skip
    if not torch.cuda.is_available():
        raise DeviceError(f"compile_graph(..., 'cuda'): torch {torch.__version__} cannot use the GPU "
                          "(torch.cuda.is_available() is False; a CPU-only build?); install a CUDA build of torch, "
                          "or compile for target='cpu'")  # fmt: skip


def _build_fused(groups: list[Group], symbols: dict[str, Any], target: str, arch: str | None) -> dict[int, Any]:
    """CompiledOps of the fused groups (None where a group fails), one compiler run overall."""
    from tessera import ops

    by_signature: dict[str, list[Group]] = {}
    for g in groups:
        by_signature.setdefault(group_signature(g), []).append(g)
    lowered: list[tuple[list[Group], Any]] = []
    for members in by_signature.values():
        try:
            lowered.append((members, lower_group(members[0], symbols)))
        except (TesseraError, NotImplementedError, ValueError, TypeError) as exc:
            log.warning("tessera: could not lower %s: %s; its operators run in their numpy references", members[0], exc)
    result: dict[int, Any] = {}
    if not lowered:
        return result
    try:
        compiled = ops.build_many([lw for _, lw in lowered], target, name="g", arch=arch)
    except (CompilerNotFoundError, BrokenCompilerError):
        raise  # the compiler, not the code: every group would fail the same way
    except TesseraError as exc:
        log.warning("tessera: building the fused groups together failed (%s); building them one by one", exc)
        compiled = []
        for members, lw in lowered:
            try:
                compiled.append(ops.build(*lw, target=target, name="g", arch=arch))
            except (CompilerNotFoundError, BrokenCompilerError):
                raise
            except TesseraError as inner:
                log.warning("tessera: %s failed to build: %s; its operators run in their numpy references", members[0], inner)
                compiled.append(None)
    for (members, _), op in zip(lowered, compiled):
        for g in members:
            result[id(g)] = op
    return result


def _single(op: Any) -> Group:
    # Every output of a fallback operator is materialised: it may feed the next fallback.
    return Group("reference", [op], list(dict.fromkeys(op.inputs)), list(op.outputs), reason="its fused group did not build")


def _anchor_preparer(target: str, arch: str | None, tune: bool, symbols: dict[str, Any]) -> Any:
    """prepare(group, shapes) -> kernel(arrays, outputs) for an AnchorStep; the kernel carries
    `.artifacts` (its built cubins) and `.tuning` (the tuning records that chose its schedule),
    which a saved compiled graph ships."""

    def prepare(group: Group, shapes: Mapping[Tensor, tuple[int, ...]]) -> Any:
        with recording() as tuning:
            try:
                kernel = prepare_anchor(group, shapes, tune=tune)
                kernel.artifacts = list(getattr(kernel.kernel, "artifacts", None) or [kernel.kernel.artifact])
            except UnsupportedError as exc:
                log.info("tessera: %s runs without its template (%s)", group.anchor.name, exc)
                kernel = _generic_anchor(group, shapes, target, arch, symbols)
        kernel.tuning = list(tuning)
        return kernel

    return prepare


def _generic_anchor(group: Group, shapes: Mapping[Tensor, tuple[int, ...]], target: str, arch: str | None,
                    symbols: dict[str, Any]) -> Any:  # fmt: skip
    """The anchor group through the ops auto-scheduler, for shapes no template takes."""
    from tessera import ops

    outs, ins = lower_group(group, symbols, concrete={t: shapes[t] for t in group.inputs})
    compiled = ops.build(outs, ins, target=target, name="a", arch=arch)

    def run(arrays: Any, outputs: Any) -> None:
        compiled.run(arrays, outputs)

    run.artifacts = [compiled.artifact]  # type: ignore[attr-defined]
    return run
