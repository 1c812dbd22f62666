"""The `torch.compile(model, backend="tessera")` backend.

Why torch-level FX graphs (dynamo's output) and not aten graphs from AOTAutograd: the
torch-level graph keeps the operators tessera schedules as anchors -- `linear`,
`scaled_dot_product_attention`, `layer_norm`, `conv2d`, `batch_norm` -- whereas the aten
graph has already broken them into `t`/`addmm`/`view`, device-specific attention kernels
and `_native_batch_norm_legit_no_training`, which the graph passes (batchnorm folding, QKV
merging) and post-scheduling fusion would have to reassemble.  tessera compiles for
inference, so it needs none of AOTAutograd's joint forward/backward tracing.

How a graph is compiled:
1. Every node is translated (probing): an op that tessera lacks, or an argument pattern a
   rule does not handle, marks that node unsupported, with the reason.
2. With no unsupported node the whole graph becomes one FlowGraph.  Otherwise the nodes
   are cut into segments -- maximal runs of supported nodes in program order -- and each
   segment becomes a FlowGraph, while unsupported nodes run in torch eagerly between them.
   Every unsupported node is logged (logger "tessera", level WARNING) with its reason.
3. Module parameters and buffers become constants of the FlowGraph (so constant folding,
   batchnorm folding and QKV merging can use them).  Each call checks that the same
   tensors arrive with the same version counters; after an in-place update or a swap the
   graph is rebuilt, so a changed weight is never silently ignored.
4. Each segment is compiled by tessera.graph.compiler (kernels for the segment's device; on
   the GPU, CUDA-graph replay).  `torch.compile(..., options={...})` takes the options of
   tessera.graph.compiler.options (tune, cuda_graph, progress; `"executor": "reference"` runs
   the numpy references instead, for debugging); an unknown option raises ArgumentError.
   `tessera.explain(compiled_model)` reports what each graph became (`CompiledGraph.report`).
5. Sizes that dynamo marks dynamic (`dynamic=True` or automatic dynamic shapes) stay
   symbolic in the FlowGraph, so a new batch size reuses the same graph.

Calls that need autograd (grad mode on and an input that requires grad) run the original
graph in torch: tessera's result would carry no gradient.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tessera.errors import TesseraError, UnsupportedError
from tessera.frontend.torch import handlers, handlers_shape  # noqa: F401  (register the rules)
from tessera.frontend.torch.convert import Converter, Opaque, is_tensor_meta, scalar_from_meta, target_key
from tessera.graph import Executor, FlowGraph, Tensor
from tessera.graph.compiler import CompiledGraph as TesseraCompiledGraph
from tessera.graph.compiler import compile_graph
from tessera.graph.compiler.options import CompileOptions, parse_options
from tessera.graph.passes import optimize
from tessera.graph.symbolic import Sym, contains_sym
from tessera.ops.compiled import numpy_to_torch, torch_to_numpy
from tessera.progress import progress as show_progress

log = logging.getLogger("tessera")

stats = {"graphs": 0, "builds": 0, "segments": 0, "eager_nodes": 0, "kernels": 0, "reference_ops": 0}


def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, options: Mapping[str, Any] | None = None,
            mode: str | None = None, **direct: Any) -> Callable[..., Any]:  # fmt: skip
    """The dynamo backend: compiles one FX graph and returns the callable that runs it.

    `options` and `mode` are torch.compile's (tessera.graph.compiler.options lists the options;
    mode "max-autotune" tunes); options may also come as keywords when the backend is called
    directly.  An unknown option or mode raises ArgumentError."""
    from tessera.frontend.torch import report

    opts = parse_options({**(options or {}), **direct}, mode=mode, where='torch.compile(backend="tessera")')
    stats["graphs"] += 1
    compiled = CompiledGraph(gm, list(example_inputs), opts)
    report.record(compiled)
    return compiled


def _meta(node: torch.fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _is_module_state(node: torch.fx.Node, value: Any) -> bool:
    """Parameters, buffers and tensor attributes of modules: values fixed between calls."""
    if isinstance(value, torch.nn.Parameter):
        return True
    grapharg = node.meta.get("grapharg")
    source = repr(getattr(grapharg, "source", "")) if grapharg is not None else ""
    return any(s in source for s in ("ParamBuffer", "NNModule", "_parameters", "_buffers"))


SMALL_STATE = 16  # module state up to this many elements is compared by value on each call


def _version(t: torch.Tensor) -> int | None:
    """t's version counter (bumped by every in-place update); None for inference tensors,
    which torch does not version."""
    return None if t.is_inference() else t._version


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    a = torch_to_numpy(t)
    return np.ascontiguousarray(a) if a.ndim else a  # ascontiguousarray makes a 0-d array 1-d


def _leaves(value: Any) -> list:
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _leaves(v)]
    return [value]


class _Segment:
    """A run of supported nodes compiled into one FlowGraph."""

    def __init__(self, nodes: list[torch.fx.Node]):
        self.nodes = nodes
        self.inputs: list[torch.fx.Node] = []
        self.outputs: list[torch.fx.Node] = []
        self.output_structure: list[Any] = []  # per output node: its value with tensors as leaf indices
        self.graph: FlowGraph | None = None
        self.executor: Executor | TesseraCompiledGraph | None = None
        self.on_device = False  # a CUDA graph: torch tensors in and out
        self.devices: list[torch.device] = []
        self.sym_inputs: dict[str, int] = {}  # symbol name -> index of a SymInt placeholder


class CompiledGraph:
    """The callable handed back to dynamo."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list[Any],
                 options: CompileOptions | Mapping[str, Any] | None = None, **direct: Any):  # fmt: skip
        self.gm = gm
        self.options = parse_options(options if options is not None else direct, where="tessera CompiledGraph")
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self._warned_grad = False
        self._build(example_inputs)

    # ---- building ---------------------------------------------------------------------------
    def _build(self, example_inputs: list[Any]) -> None:
        stats["builds"] += 1
        # index -> (tensor, version, copy of its value if tiny); see __call__.  Module state
        # becomes constants of the graph, so each call must be able to tell that it did not
        # change: by version counter, or for tiny tensors by value.  Inference tensors (made
        # under torch.inference_mode) have no version counter, so large ones stay graph inputs.
        self.static = {i: (v, _version(v), v.detach().clone() if v.numel() <= SMALL_STATE else None)
                       for i, (n, v) in enumerate(zip(self.placeholders, example_inputs))
                       if isinstance(v, torch.Tensor) and _is_module_state(n, v)
                       and (_version(v) is not None or v.numel() <= SMALL_STATE)}  # fmt: skip
        unversioned = [n.name for n, v in zip(self.placeholders, example_inputs) if isinstance(v, torch.Tensor)
                       and _is_module_state(n, v) and v.numel() > SMALL_STATE and _version(v) is None]  # fmt: skip
        if unversioned:
            log.info("tessera: module state %s are inference tensors (no version counter to guard them): they are "
                     "read as graph inputs on every call, not folded as constants", unversioned)  # fmt: skip
        self.fallback_reason: str | None = None
        self.graph_breaks: list[tuple[str, str]] = []  # (node, why it runs in torch), for report()
        start = time.perf_counter()
        try:
            with show_progress(self.options.progress):
                self.steps = self._plan(example_inputs)
        except Exception as e:  # noqa: BLE001  (any failure here must leave torch's result intact)
            self.fallback_reason = f"{type(e).__name__}: {e}"
            log.warning("tessera: running the whole graph in torch: %s", self.fallback_reason)
            self.steps = []
        self.build_seconds = time.perf_counter() - start

    def _seed(self, cv: Converter, example_inputs: list[Any], only: set | None = None) -> None:
        """Placeholder values: constants for module state, graph inputs for the rest."""
        for i, (n, v) in enumerate(zip(self.placeholders, example_inputs)):
            meta = _meta(n)
            if isinstance(v, torch.Tensor):
                if i in self.static:
                    cv.env[n] = Tensor.constant(_to_numpy(v), name=n.name)
                elif only is None or n in only:
                    cv.env[n] = cv.add_input(n, meta if is_tensor_meta(meta) else v)
            else:
                cv.env[n] = scalar_from_meta(meta if meta is not None else v)

    def _plan(self, example_inputs: list[Any]) -> list:
        gm = self.gm
        cv = Converter(self.gm.__class__.__name__)
        self._seed(cv, example_inputs)
        unsupported: dict[torch.fx.Node, str] = {}
        scalar: set[torch.fx.Node] = set()
        for n in gm.graph.nodes:
            if n.op in ("placeholder", "output"):
                continue
            meta = _meta(n)
            if n.op == "get_attr":
                cv.env[n] = Tensor.constant(_to_numpy(getattr(gm, n.target)), name=n.name)
                continue
            try:
                cv.env[n] = cv.convert_node(n)
                if n.op == "call_module":
                    raise UnsupportedError(f"module call {n.target}")
                if meta is not None and not any(isinstance(x, torch.Tensor) for x in _leaves(meta)):
                    scalar.add(n)
            except Exception as e:  # noqa: BLE001
                reason = str(e) if isinstance(e, TesseraError) else f"{type(e).__name__}: {e}"
                unsupported[n] = reason
                self.graph_breaks.append((f"{n.name} ({target_key(n)})", reason))
                log.warning("tessera: graph break at %s (%s): %s; it runs in torch", n.name, target_key(n), reason)
                cv.env[n] = self._stand_in(cv, n, meta, reason)
        output = next(n for n in gm.graph.nodes if n.op == "output")
        if not unsupported:
            seg = _Segment([n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")])
            seg.inputs = [n for n in self.placeholders if isinstance(cv.env.get(n), Tensor) and not cv.env[n].is_constant]
            seg.outputs = [output]
            self._finish(seg, cv, [output.args[0]], example_inputs)
            stats["segments"] += 1
            return [seg]
        stats["eager_nodes"] += len(unsupported)
        return self._segments(unsupported, scalar, output, example_inputs)

    def _stand_in(self, cv: Converter, n: torch.fx.Node, meta: Any, reason: str) -> Any:
        if isinstance(meta, torch.Tensor):
            return cv.add_input(n, meta)
        if isinstance(meta, (tuple, list)) and all(isinstance(m, torch.Tensor) for m in meta):
            return tuple(cv.add_input(n, m) for m in meta)
        return Opaque(f"uses the result of {n.name}, which runs in torch ({reason})")

    def _segments(self, unsupported, scalar, output, example_inputs) -> list:
        gm = self.gm
        calls = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
        # Scalar nodes that eager code or the output reads must run in the interpreter too.
        needed: set[torch.fx.Node] = set()
        for n in reversed(list(gm.graph.nodes)):
            if n in unsupported or n is output or n in needed:
                needed.update(a for a in n.all_input_nodes if a in scalar)
        steps: list[Any] = []
        current: list[torch.fx.Node] = []
        for n in calls:
            if n in unsupported:
                if current:
                    steps.append(_Segment(current))
                    current = []
                steps.append(n)
            elif n in scalar:
                if n in needed:
                    steps.append(n)
            else:
                current.append(n)
        if current:
            steps.append(_Segment(current))
        # Every value a segment defines and anything outside it reads is a segment output.
        outside_users: dict[torch.fx.Node, set] = {}
        for step in steps:
            for n in step.nodes if isinstance(step, _Segment) else [step]:
                outside_users[n] = set()
        for step in steps:
            members = set(step.nodes) if isinstance(step, _Segment) else {step}
            for n in members:
                for u in n.users:
                    if u not in members:
                        outside_users.setdefault(n, set()).add(u)
        static_nodes = {self.placeholders[i] for i in self.static}
        for step in steps:
            if not isinstance(step, _Segment):
                continue
            members = set(step.nodes)
            step.outputs = [n for n in step.nodes if outside_users.get(n) and any(
                isinstance(x, torch.Tensor) for x in _leaves(_meta(n)))]  # fmt: skip
            ins: dict[torch.fx.Node, None] = {}
            for n in step.nodes:
                for a in n.all_input_nodes:
                    if a in members or a.op == "get_attr" or a in scalar or a in static_nodes:
                        continue
                    if a.op == "placeholder" and not isinstance(_meta(a), torch.Tensor):
                        continue  # a SymInt: its value comes from metadata (symbolic)
                    ins[a] = None
            step.inputs = list(ins)
            cv = Converter(f"{gm.__class__.__name__}_segment{stats['segments']}")
            self._seed(cv, example_inputs, only={a for a in step.inputs if a.op == "placeholder"})
            for a in step.inputs:
                if a.op != "placeholder":
                    cv.env[a] = self._stand_in(cv, a, _meta(a), "")
            for n in gm.graph.nodes:
                if n.op == "get_attr":
                    cv.env[n] = Tensor.constant(_to_numpy(getattr(gm, n.target)), name=n.name)
                elif n in scalar:
                    cv.env[n] = scalar_from_meta(_meta(n))
            for n in step.nodes:
                cv.env[n] = cv.convert_node(n)
            # Inputs in the order the graph lists them: placeholders first as seeded, then stand-ins.
            order = {t: i for i, t in enumerate(cv.inputs)}
            step.inputs.sort(key=lambda a: min(order[t] for t in _leaves(cv.env[a]) if isinstance(t, Tensor)))
            self._finish(step, cv, [n for n in step.outputs], example_inputs)
            stats["segments"] += 1
        return steps

    def _finish(self, seg: _Segment, cv: Converter, values: list[Any], example_inputs: list[Any]) -> None:
        """Build, optimize and prepare the segment's FlowGraph; record how outputs map back."""
        outs: list[Tensor] = []

        def index(value: Any) -> Any:
            if isinstance(value, torch.fx.Node):
                value = cv.env[value]
            if isinstance(value, (tuple, list)):
                return type(value)(index(v) for v in value)
            if isinstance(value, Tensor):
                outs.append(value)
                return ("tensor", len(outs) - 1)
            if value is None or isinstance(value, (bool, int, float)):
                return ("const", value)
            raise UnsupportedError(f"graph output of type {type(value).__name__}")

        seg.output_structure = [index(v) for v in values]
        graph = cv.build(outs)
        optimize(graph)
        for op in graph.operators:
            if contains_sym(list(op.attrs.values())):
                names = {n for v in _leaves(list(op.attrs.values())) if isinstance(v, Sym) for n in v.names}
                bound = set(graph.symbols()) | set(self._sym_placeholders())
                if names - bound:
                    raise UnsupportedError(f"{op.kind} depends on sizes {sorted(names - bound)} that no input carries")
        seg.graph = graph
        seg.devices = [torch.device(t.device) for t in outs]
        if self.options.executor == "reference":
            seg.executor = Executor(graph)
        else:
            target = "cuda" if any(t.device == "cuda" for t in [*graph.inputs, *outs]) else "cpu"
            seg.executor = compile_graph(graph, target, optimize=False, cuda_graph=self.options.cuda_graph,
                                         tune=self.options.tune, progress=self.options.progress)  # fmt: skip
            seg.on_device = target == "cuda"
            summary = seg.executor.summary()
            stats["kernels"] += summary["kernels"]
            stats["reference_ops"] += len(summary["reference_ops"])
        seg.sym_inputs = self._sym_placeholders()

    def _sym_placeholders(self) -> dict[str, int]:
        out = {}
        for i, n in enumerate(self.placeholders):
            m = _meta(n)
            if isinstance(m, torch.SymInt) and m.node.expr.is_Symbol:
                out[str(m.node.expr)] = i
        return out

    # ---- reporting --------------------------------------------------------------------------
    def report(self) -> Any:
        """A CompileReport: each compiled segment's graph report (tessera.graph.compiler.report),
        the nodes left to torch and why, and the build time (FX translation and compile)."""
        from tessera.graph.compiler.report import CompileReport

        report = CompileReport(f"FX graph {self.gm.__class__.__name__}")
        report.outside = list(self.graph_breaks)
        if self.fallback_reason is not None:
            report.outside.append(("the whole graph", self.fallback_reason))
        segments = [s for s in self.steps if isinstance(s, _Segment)]
        report.graphs = [s.executor.report() for s in segments if hasattr(s.executor, "report")]
        if self.options.executor == "reference":
            report.notes.append("executor='reference': the segments run in the numpy references, no kernels")
        report.notes.append(f"FX graph of {len(self.placeholders)} inputs -> {len(segments)} tessera segment(s), built "
                            f"in {self.build_seconds:.2f} s (translation and compile)")  # fmt: skip
        return report

    # ---- running ----------------------------------------------------------------------------
    def __call__(self, *args: Any) -> Any:
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            if not self._warned_grad:
                log.info("tessera: autograd is needed (grad mode on, inputs require grad); running in torch")
                self._warned_grad = True
            return self.gm(*args)
        for i, (t, version, value) in self.static.items():
            a = args[i]
            if a is t and version is not None and _version(a) == version:
                continue
            # Python numbers held by modules (eps, momentum) arrive as fresh 0-d tensors each call.
            if value is not None and a.shape == value.shape and a.dtype == value.dtype and torch.equal(a, value):
                self.static[i] = (a, _version(a), value)
                continue
            log.info("tessera: module state %s changed; rebuilding the graph", self.placeholders[i].name)
            self._build(list(args))
            break
        if self.fallback_reason is not None:
            return self.gm(*args)
        values: dict[torch.fx.Node, Any] = dict(zip(self.placeholders, args))
        for step in self.steps:
            if isinstance(step, _Segment):
                self._run_segment(step, values, args)
            else:
                values[step] = self._run_node(step, values)
        output = next(n for n in self.gm.graph.nodes if n.op == "output")
        if len(self.steps) == 1 and isinstance(self.steps[0], _Segment) and self.steps[0].outputs == [output]:
            return values[output]
        return torch.fx.node.map_arg(output.args[0], lambda n: values[n])

    def _run_segment(self, seg: _Segment, values: dict, args: tuple) -> None:
        arrays = []
        for n in seg.inputs:
            for v in _leaves(values[n]):
                if isinstance(v, torch.Tensor):
                    arrays.append(v if seg.on_device else _to_numpy(v))
        symbols = {name: int(args[i]) for name, i in seg.sym_inputs.items()}
        results = seg.executor.execute(arrays, symbols)
        if seg.on_device:
            tensors = list(results)
        else:
            tensors = [numpy_to_torch(r).to(d) for r, d in zip(results, seg.devices)]

        def rebuild(s: Any) -> Any:
            if isinstance(s, list):
                return [rebuild(x) for x in s]
            if isinstance(s, tuple) and len(s) == 2 and s[0] in ("tensor", "const"):
                return tensors[s[1]] if s[0] == "tensor" else s[1]
            if isinstance(s, tuple):
                return tuple(rebuild(x) for x in s)
            return s

        for n, s in zip(seg.outputs, seg.output_structure):
            values[n] = rebuild(s)

    def _run_node(self, n: torch.fx.Node, values: dict) -> Any:
        args = torch.fx.node.map_arg(n.args, lambda a: values[a])
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: values[a])
        if n.op == "call_function":
            return n.target(*args, **kwargs)
        if n.op == "call_method":
            return getattr(args[0], n.target)(*args[1:], **kwargs)
        if n.op == "call_module":
            return self.gm.get_submodule(n.target)(*args, **kwargs)
        raise TesseraError(f"cannot run node {n.op} {n.target}")


