"""The `torch.compile(model, backend="tessera")` backend.

The front end takes graphs at the ATen level, as Inductor does:
1. dynamo's FX graph (torch functions) goes through AOTAutograd for inference
   (`aot_module_simplified`: functionalized, with `decompositions.decomposition_table()`), which
   gives a graph of core ATen ops plus the few high-level ops tessera keeps whole (KEEP in
   `decompositions.py`).  The op set is finite, so every model is covered by construction.
   In-place updates become functional ops; updates of graph inputs (a KV cache's
   `index_copy_`, a buffer's `add_`) stay as `copy_(input, new_value)` at the end
   (`keep_inference_input_mutations`), and the compiled graph performs them itself: the new
   value is a graph output written into the input tensor on its device.
2. Every ATen node is lowered by the rules of `aten_math.py`, `aten_nn.py` and `aten_shape.py`
   (`convert.py` holds the registry).  A node without a lowering (`sort`, random numbers,
   data-dependent results) runs in torch inside the compiled graph, logged once per op with
   its reason; the lowered runs around it become separate FlowGraphs.  Graph breaks remain
   only where dynamo makes them (data-dependent output shapes: `nonzero`, boolean masks,
   `.item()` into Python control flow); each is logged once.
3. Module parameters and buffers (AOTAutograd passes them as inputs, in dynamo's order)
   become constants of the FlowGraph, so constant folding, batchnorm folding and QKV merging
   can use them.  Each call checks that the same tensors arrive with the same version
   counters; after an in-place update or a swap the graph is rebuilt.
4. Each FlowGraph is compiled by tessera.graph.compiler (kernels for its device; on the GPU,
   CUDA-graph replay).  `torch.compile(..., options={...})` takes the options of
   tessera.graph.compiler.options (tune, cuda_graph, progress; `"executor": "reference"` runs
   the numpy references instead, for debugging); an unknown option raises ArgumentError.
   `tessera.explain(compiled_model)` reports what each graph became (`CompiledAtenGraph.report`).
5. Sizes that dynamo marks dynamic stay symbolic (`symbols.dim_from_sym`).

Calls that need autograd (grad mode on and an input that requires grad) run dynamo's graph
in torch: tessera compiles inference only.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tessera.errors import TesseraError, UnsupportedError
from tessera.frontend.torch import aten_math, aten_nn, aten_shape  # noqa: F401  (register the rules)
from tessera.frontend.torch import report as torch_report
from tessera.frontend.torch.convert import (
    Converter,
    NodeError,
    Opaque,
    has_tensor,
    meta_of,
    op_name,
    scalar_from_meta,
)
from tessera.frontend.torch.decompositions import decomposition_table
from tessera.frontend.torch.keep_attention import keep_attention_whole
from tessera.frontend.torch.keep_moe import keep_moe_whole
from tessera.frontend.torch.segment import (
    STORAGE_READERS,
    Segment,
    in_place_slots,
    is_input_mutation,
    leaves,
    same_memory,
    state_constant,
    tensor_slots,
    to_numpy,
    with_traced_layout,
)
from tessera.graph import Executor, FlowGraph, Tensor
from tessera.graph.compiler import compile_graph
from tessera.graph.compiler.options import CompileOptions, parse_options
from tessera.graph.compiler.report import CompileReport
from tessera.graph.passes import optimize
from tessera.graph.symbolic import Sym, bind_shapes, contains_sym
from tessera.ir.symbolic import evaluate_dim
from tessera.ops.compiled import numpy_to_torch
from tessera.progress import progress as show_progress

log = logging.getLogger("tessera")

stats = {"graphs": 0, "builds": 0, "segments": 0, "eager_nodes": 0, "kernels": 0, "reference_ops": 0,
         "whole_graph_fallbacks": 0}
_logged: set[str] = set()


def log_once(message: str, seen: set[str] = _logged) -> None:
    """Log message (WARNING, logger "tessera") unless `seen` already holds it."""
    if message not in seen:
        seen.add(message)
        log.warning("tessera: %s", message)


def _log_graph_breaks() -> None:
    """dynamo's graph breaks since the last call, each reason logged once: its first line and
    dynamo's debug context (which names the op)."""
    from torch._dynamo.utils import counters

    for reason in list(counters.get("graph_break", {})):
        lines = [x.strip() for x in reason.splitlines() if x.strip()]
        context = next((x.removeprefix("Developer debug context:").strip() for x in lines
                        if x.startswith("Developer debug context:")), "")  # fmt: skip
        log_once(f"graph break (dynamo): {lines[0] if lines else reason}" + (f" [{context}]" if context else ""))


def _is_module_state(node: torch.fx.Node, value: Any) -> bool:
    """Parameters, buffers and tensor attributes of modules: values fixed between calls."""
    if isinstance(value, torch.nn.Parameter):
        return True
    grapharg = node.meta.get("grapharg")
    source = repr(getattr(grapharg, "source", "")) if grapharg is not None else ""
    return any(s in source for s in ("ParamBuffer", "NNModule", "_parameters", "_buffers"))


# Backend keywords that are not compile options: `collect` (a list that receives each
# CompiledAtenGraph, for tests and tools) and `backends` (Executor backends, for debugging).
_TOOL_KEYWORDS = ("collect", "backends")


def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, options: Mapping[str, Any] | None = None,
            mode: str | None = None, **direct: Any) -> Callable[..., Any]:  # fmt: skip
    """The dynamo backend: lowers one FX graph through AOTAutograd and compiles the ATen graph.

    `options` and `mode` are torch.compile's (tessera.graph.compiler.options lists the options;
    mode "max-autotune" tunes); options may also come as keywords when the backend is called
    directly.  An unknown option or mode raises ArgumentError."""
    from torch._functorch.aot_autograd import aot_module_simplified

    given = {**(options or {}), **direct}
    tools = {k: given.pop(k) for k in _TOOL_KEYWORDS if k in given}
    opts = parse_options(given, mode=mode, where='torch.compile(backend="tessera")')

    _log_graph_breaks()
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs):
        log.info("tessera: autograd is needed (grad mode on, inputs require grad); running in torch")
        return gm.forward
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    lifted = [*dict(gm.named_parameters(remove_duplicate=False)).values(),
              *dict(gm.named_buffers(remove_duplicate=False)).values()]  # fmt: skip
    real = [*lifted, *example_inputs]
    is_state = [True] * len(lifted) + [isinstance(v, torch.Tensor) and _is_module_state(n, v)
                                       for n, v in zip(placeholders, example_inputs)]  # fmt: skip

    def fw_compiler(aten_gm: torch.fx.GraphModule, aot_inputs: Sequence[Any]) -> CompiledAtenGraph:
        stats["graphs"] += 1
        n = sum(1 for x in aten_gm.graph.nodes if x.op == "placeholder")
        # AOTAutograd passes the same arguments unless it deduplicated them or made synthetic
        # bases; then no input is known to be module state (they all stay graph inputs).
        state = {i: real[i] for i in range(n) if is_state[i]} if n == len(real) else {}
        # inputs the caller keeps at one address (torch._dynamo.mark_static_address: a StaticCache's tensors)
        static = {i for i in range(n) if getattr(real[i], "_dynamo_static_input_type", None)} if n == len(real) else set()
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # AOTAutograd calls this under its fake mode; constants are real
            compiled = CompiledAtenGraph(aten_gm, state, name=gm.__class__.__name__, options=opts, static_inputs=static,
                                     **tools)  # fmt: skip
        if tools.get("collect") is not None:
            tools["collect"].append(compiled)
        torch_report.record(compiled)
        return compiled

    if any(isinstance(x, torch.Tensor) and x.is_cuda for x in real):
        keep_attention_whole(gm)
    else:  # (no CUDA MoE template yet: on the GPU the blocks stay as traced)
        keep_moe_whole(gm)
    return aot_module_simplified(gm, list(example_inputs), fw_compiler=fw_compiler,
                                 decompositions=decomposition_table(), keep_inference_input_mutations=True)  # fmt: skip


SMALL_STATE = 16  # module state up to this many elements is compared by value on each call


_VERSION_OF = operator.attrgetter("_version")


def _version(t: torch.Tensor) -> int | None:
    """t's version counter (bumped by every in-place update); None for inference tensors,
    which torch does not version."""
    return None if t.is_inference() else t._version


class CompiledAtenGraph:
    """The compiled ATen graph: the callable AOTAutograd's runtime wrapper calls with
    (module state..., user inputs...)."""

    def __init__(self, gm: torch.fx.GraphModule, state: dict[int, torch.Tensor], name: str = "torch_graph",
                 options: CompileOptions | Mapping[str, Any] | None = None, backends: Any = None,
                 collect: Any = None, static_inputs: set[int] | frozenset[int] = frozenset()):  # fmt: skip
        self.gm = gm
        self.name = name
        self.options = parse_options(options, where="tessera CompiledAtenGraph")
        self.backends = backends
        self.graph_breaks: list[tuple[str, str]] = []  # (node, why it runs in torch), for report()
        self.build_seconds = 0.0
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.output = next(n for n in gm.graph.nodes if n.op == "output")
        index = {n: i for i, n in enumerate(self.placeholders)}
        # (input index, copy_ node): the graph's updates of its inputs.  The copy_ nodes lower
        # like aten.copy (the new value, cast and broadcast to the input); the call writes it.
        self.mutations = [(index[n.args[0]], n) for n in gm.graph.nodes if is_input_mutation(n)]
        self.static_inputs = frozenset(static_inputs)  # placeholder indices kept at one address by the caller
        mutated = {i for i, _ in self.mutations}
        self._state = {i: t for i, t in state.items() if i not in mutated}
        self._logged: set[str] = set()  # each op that runs in torch is logged once per graph
        self._build([state.get(i) for i in range(len(self.placeholders))])

    # ---- building ---------------------------------------------------------------------------
    def _build(self, values: list[Any]) -> None:
        stats["builds"] += 1
        # index -> (tensor, version, copy of its value if tiny); see __call__.  Module state
        # becomes constants of the graph, so each call must be able to tell that it did not
        # change: by version counter, or for tiny tensors by value.  Inference tensors (made
        # under torch.inference_mode) have no version counter, so large ones stay graph inputs.
        self.static = {i: (v, _version(v), v.detach().clone() if v.numel() <= SMALL_STATE else None)
                       for i, v in enumerate(values) if i in self._state and isinstance(v, torch.Tensor)
                       and (_version(v) is not None or v.numel() <= SMALL_STATE)}  # fmt: skip
        # (pick the folded tensors from args, those tensors, their versions) for _state_unchanged,
        # rebuilt lazily; False while some state has no version counter.
        self._versioned: tuple | bool | None = None
        unversioned = [self.placeholders[i].name for i in self._state if i not in self.static]
        if unversioned:
            log.info("tessera: module state %s are inference tensors (no version counter to guard them): they are "
                     "read as graph inputs on every call, not folded as constants", unversioned)  # fmt: skip
        self.fallback_reason: str | None = None
        self.graph_breaks = []
        start = time.perf_counter()
        try:
            with show_progress(self.options.progress):
                self.steps = self._plan(values)
        except Exception as e:  # noqa: BLE001  (any failure here must leave torch's result intact)
            self.fallback_reason = f"{type(e).__name__}: {e}"
            stats["whole_graph_fallbacks"] += 1
            log.warning("tessera: running the whole graph in torch: %s", self.fallback_reason)
            log.debug("tessera: whole-graph fallback", exc_info=True)
            self.steps = []
        self.build_seconds = time.perf_counter() - start

    def _seed(self, cv: Converter, values: list[Any], only: set | None = None) -> None:
        """Placeholder values: constants for module state, graph inputs for the rest."""
        for i, n in enumerate(self.placeholders):
            meta = meta_of(n)
            if isinstance(meta, torch.Tensor):
                if i in self.static:
                    cv.env[n] = state_constant(values[i], n.name)
                elif only is None or n in only:
                    cv.env[n] = cv.add_input(n.name, meta)
            else:
                cv.env[n] = scalar_from_meta(meta)

    def _plan(self, values: list[Any]) -> list:
        """The steps: lowered segments and nodes that run in torch.  A node whose lowering makes
        its segment uncompilable (a size no input carries) joins the nodes that run in torch."""
        forced: dict[torch.fx.Node, str] = {}
        for _ in range(len(self.gm.graph.nodes)):
            try:
                return self._plan_once(values, forced)
            except NodeError as e:
                if e.node in forced:
                    raise
                reason = str(e)
                forced[e.node] = reason
                log_once(f"{op_name(e.node.target)} runs in torch: {reason}", self._logged)
        return self._plan_once(values, forced)

    def _plan_once(self, values: list[Any], forced: dict[torch.fx.Node, str]) -> list:
        gm = self.gm
        cv = Converter(self.name)
        self._seed(cv, values)
        unsupported: dict[torch.fx.Node, str] = {}
        scalar: set[torch.fx.Node] = set()
        for n in gm.graph.nodes:
            if n.op in ("placeholder", "output"):
                continue
            if n in forced:
                unsupported[n] = forced[n]
                cv.env[n] = self._stand_in(cv, n, meta_of(n), forced[n])
                continue
            meta = meta_of(n)
            if n.op == "get_attr":
                cv.env[n] = state_constant(getattr(gm, n.target), n.name)
                continue
            try:
                cv.env[n] = cv.convert_node(n)
                if meta is not None and not has_tensor(meta):
                    scalar.add(n)
            except Exception as e:  # noqa: BLE001
                reason = str(e) if isinstance(e, TesseraError) else f"{type(e).__name__}: {e}"
                unsupported[n] = reason
                self.graph_breaks.append((f"{n.name} ({op_name(n.target)})", reason))
                log_once(f"{op_name(n.target)} runs in torch: {reason}", self._logged)
                cv.env[n] = self._stand_in(cv, n, meta, reason)
        results = [self.output.args[0], *(v for _, v in self.mutations)]
        # symbolic sizes among the outputs are computed by running their FX nodes (segmented path)
        sym_outputs = any(isinstance(cv.env.get(x), Sym) for x in leaves(self.output.args[0]))
        if not unsupported and not sym_outputs:
            seg = Segment([n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")])
            seg.inputs = [n for n in self.placeholders if isinstance(cv.env.get(n), Tensor) and not cv.env[n].is_constant]
            seg.outputs = [self.output, *(v for _, v in self.mutations)]
            self._finish(seg, cv, results, {1 + k: self.placeholders[i] for k, (i, _) in enumerate(self.mutations)})
            user = set(tensor_slots(seg.output_structure[0]))
            seg.borrow = frozenset(j for s in seg.output_structure[1:] for j in tensor_slots(s) if j not in user)
            stats["segments"] += 1
            return [seg]
        steps = self._segments(unsupported, scalar, values)
        stats["eager_nodes"] += len(unsupported)
        return steps

    def _stand_in(self, cv: Converter, n: torch.fx.Node, meta: Any, reason: str) -> Any:
        if isinstance(meta, torch.Tensor):
            return cv.add_input(n.name, meta)
        if isinstance(meta, (tuple, list)) and all(isinstance(m, torch.Tensor) for m in meta):
            return tuple(cv.add_input(f"{n.name}_{i}", m) for i, m in enumerate(meta))
        return Opaque(f"uses the result of {n.name}, which runs in torch ({reason})")

    def _segments(self, unsupported: dict, scalar: set, values: list[Any]) -> list:
        gm, output = self.gm, self.output
        calls = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
        mutation_sources = {v for _, v in self.mutations}
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
                    steps.append(Segment(current))
                    current = []
                steps.append(n)
            elif n in scalar:
                if n in needed:
                    if current and set(n.all_input_nodes) & set(current):  # it reads the open segment
                        steps.append(Segment(current))
                        current = []
                    steps.append(n)
            else:
                current.append(n)
        if current:
            steps.append(Segment(current))
        # Every value a segment defines and anything outside it reads is a segment output.
        outside_users: dict[torch.fx.Node, set] = {}
        for step in steps:
            members = set(step.nodes) if isinstance(step, Segment) else {step}
            for n in members:
                for u in n.users:
                    if u not in members:
                        outside_users.setdefault(n, set()).add(u)
        static_nodes = {self.placeholders[i] for i in self.static}
        for step in steps:
            if not isinstance(step, Segment):
                continue
            members = set(step.nodes)
            step.outputs = [n for n in step.nodes if (outside_users.get(n) or n in mutation_sources)
                            and any(isinstance(x, torch.Tensor) for x in leaves(meta_of(n)))]  # fmt: skip
            ins: dict[torch.fx.Node, None] = {}
            for n in step.nodes:
                for a in n.all_input_nodes:
                    if a in members or a.op == "get_attr" or a in scalar or a in static_nodes:
                        continue
                    if a.op == "placeholder" and not isinstance(meta_of(a), torch.Tensor):
                        continue  # a SymInt: its value comes from metadata (symbolic)
                    ins[a] = None
            step.inputs = list(ins)
            cv = Converter(f"{self.name}_segment{stats['segments']}")
            self._seed(cv, values, only={a for a in step.inputs if a.op == "placeholder"})
            for a in step.inputs:
                if a.op != "placeholder":
                    cv.env[a] = self._stand_in(cv, a, meta_of(a), "")
            for n in gm.graph.nodes:
                if n.op == "get_attr":
                    cv.env[n] = state_constant(getattr(gm, n.target), n.name)
                elif n in scalar:
                    cv.env[n] = scalar_from_meta(meta_of(n))
            for n in step.nodes:
                cv.env[n] = cv.convert_node(n)
            # Inputs in the order the graph lists them: placeholders first as seeded, then stand-ins.
            order = {t: i for i, t in enumerate(cv.inputs)}
            step.inputs.sort(key=lambda a: min(order[t] for t in leaves(cv.env[a]) if isinstance(t, Tensor)))
            updated = {v: self.placeholders[i] for i, v in self.mutations}
            self._finish(step, cv, list(step.outputs), {k: updated[n] for k, n in enumerate(step.outputs)
                                                        if n in updated and updated[n] in step.inputs})  # fmt: skip
            stats["segments"] += 1
        return steps

    def _finish(self, seg: Segment, cv: Converter, values: list[Any],
                updates: dict[int, torch.fx.Node] | None = None) -> None:  # fmt: skip
        """Build, optimize and prepare the segment's FlowGraph; record how outputs map back.
        `updates`: index in `values` -> the placeholder that value is written back into (an
        input mutation), which the compiled graph computes in place where it can."""
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
            if isinstance(value, Sym):  # a size (dynamic shapes): evaluated from the bindings of each call
                return ("size", value)
            raise UnsupportedError(f"graph output of type {type(value).__name__}")

        seg.output_structure = [index(v) for v in values]
        graph = cv.build(outs)
        optimize(graph)
        sizes = [v for v in leaves(seg.output_structure) if isinstance(v, Sym)]
        unbound = {n for v in sizes for n in v.names} - set(graph.symbols()) - set(self._sym_placeholders())
        if unbound:
            raise UnsupportedError(f"graph outputs sizes over {sorted(unbound)}, which no input carries")
        seg.size_outputs = bool(sizes)
        bound = set(graph.symbols()) | set(self._sym_placeholders())
        for op in graph.operators:
            if contains_sym(list(op.attrs.values())):
                names = {n for v in leaves(list(op.attrs.values())) if isinstance(v, Sym) for n in v.names}
                if names - bound:
                    reason = f"{op.kind} depends on sizes {sorted(names - bound)} that no input carries"
                    raise NodeError(cv.origin[op], reason) if op in cv.origin else UnsupportedError(reason)
        seg.graph = graph
        seg.devices = [torch.device(t.device) for t in outs]
        if self.backends is not None or self.options.executor == "reference":
            seg.executor = Executor(graph, self.backends)
        else:
            target = "cuda" if any(t.device == "cuda" for t in [*graph.inputs, *outs]) else "cpu"
            seg.executor = compile_graph(graph, target, optimize=False, cuda_graph=self.options.cuda_graph,
                                         tune=self.options.tune, progress=self.options.progress,
                                         arrays="torch" if target == "cuda" else "auto",
                                         in_place=in_place_slots(seg.output_structure, updates or {}, cv, graph),
                                         static_inputs=self._static_graph_inputs(cv, graph))  # fmt: skip
            seg.on_device = target == "cuda"
            summary = seg.executor.summary()
            stats["kernels"] += summary["kernels"]
            stats["reference_ops"] += len(summary["reference_ops"])
        seg.sym_inputs = self._sym_placeholders()

    def _static_graph_inputs(self, cv: Converter, graph: FlowGraph) -> set[int]:
        """Indices among graph.inputs of the placeholders the caller keeps at one address."""
        tensors = [cv.env.get(self.placeholders[i]) for i in self.static_inputs]
        return {graph.inputs.index(t) for t in tensors if isinstance(t, Tensor) and t in graph.inputs}

    def _sym_placeholders(self) -> dict[str, int]:
        out = {}
        for i, n in enumerate(self.placeholders):
            m = meta_of(n)
            if isinstance(m, torch.SymInt) and m.node.expr.is_Symbol:
                out[str(m.node.expr)] = i
        return out

    @property
    def graphs(self) -> list[FlowGraph]:
        """The FlowGraphs of the lowered segments."""
        return [s.graph for s in self.steps if isinstance(s, Segment) and s.graph is not None]

    # ---- reporting --------------------------------------------------------------------------
    def report(self) -> Any:
        """A CompileReport: each compiled segment's graph report (tessera.graph.compiler.report),
        the nodes left to torch and why, and the build time (ATen translation and compile)."""
        report = CompileReport(f"ATen graph {self.name}")
        report.outside = list(self.graph_breaks)
        if self.fallback_reason is not None:
            report.outside.append(("the whole graph", self.fallback_reason))
        segments = [s for s in self.steps if isinstance(s, Segment)]
        report.graphs = [s.executor.report() for s in segments if hasattr(s.executor, "report")]
        if self.options.executor == "reference":
            report.notes.append("executor='reference': the segments run in the numpy references, no kernels")
        report.notes.append(f"ATen graph of {len(self.placeholders)} inputs -> {len(segments)} tessera segment(s), "
                            f"built in {self.build_seconds:.2f} s (translation and compile)")  # fmt: skip
        return report

    # ---- running ----------------------------------------------------------------------------
    def _state_unchanged(self, args: tuple) -> bool:
        """The per-call fast path of the module-state check: every folded tensor is the same
        object at the same version.  A few hundred parameters per call, so the loops run in C
        (itemgetter, map): about 3x faster than a Python loop over them."""
        if self._versioned is None:
            entries = [(i, t, v) for i, (t, v, _) in self.static.items() if v is not None]
            if len(entries) != len(self.static):  # state without a version counter: compared by value
                self._versioned = False
            else:
                indices = tuple(i for i, _, _ in entries)  # itemgetter returns a tuple from 2 indices on
                pick = operator.itemgetter(*indices) if len(indices) > 1 else lambda a: tuple(a[i] for i in indices)
                self._versioned = (pick, [t for _, t, _ in entries], [v for _, _, v in entries])
        if self._versioned is False:
            return False
        pick, tensors, versions = self._versioned
        now = pick(args)
        # Identity first (and short-circuit): only the same tensors are asked for their versions.
        return all(map(operator.is_, now, tensors)) and list(map(_VERSION_OF, now)) == versions

    def __call__(self, *args: Any) -> Any:
        if self._state_unchanged(args):
            return self._run(args)
        self._versioned = None
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
        return self._run(args)

    def _run(self, args: tuple) -> Any:
        if self.fallback_reason is not None:
            return self.gm(*args)
        values: dict[torch.fx.Node, Any] = dict(zip(self.placeholders, args))
        for step in self.steps:
            if isinstance(step, Segment):
                self._run_segment(step, values, args)
            else:
                values[step] = self._run_node(step, values)
        for i, n in self.mutations:
            # A copy_ that ran in torch, or an update computed in place, has written it already.
            if values[n] is not args[i] and not same_memory(values[n], args[i]):
                args[i].copy_(values[n])  # on the input's device: no round trip through the host
        if self.output in values:  # the whole graph was one segment
            return values[self.output]
        return torch.fx.node.map_arg(self.output.args[0], lambda n: values[n])

    def _run_segment(self, seg: Segment, values: dict, args: tuple) -> None:
        arrays = []
        for n in seg.inputs:
            for v in leaves(values[n]):
                if isinstance(v, torch.Tensor):
                    arrays.append(v if seg.on_device else to_numpy(v))
        symbols = {name: int(args[i]) for name, i in seg.sym_inputs.items()}
        results = seg.executor.execute(arrays, symbols, borrow=seg.borrow)
        if seg.size_outputs:
            bind_shapes(symbols, [(t.shape, tuple(a.shape), t.name) for t, a in zip(seg.graph.inputs, arrays)])
        if seg.on_device:
            tensors = list(results)
        else:
            tensors = [numpy_to_torch(r).to(d) for r, d in zip(results, seg.devices)]

        def rebuild(s: Any) -> Any:
            if isinstance(s, list):
                return [rebuild(x) for x in s]
            if isinstance(s, tuple) and len(s) == 2 and s[0] in ("tensor", "const", "size"):
                return tensors[s[1]] if s[0] == "tensor" else s[1] if s[0] == "const" else evaluate_dim(s[1], symbols)
            if isinstance(s, tuple):
                return tuple(rebuild(x) for x in s)
            return s

        for n, s in zip(seg.outputs, seg.output_structure):
            values[n] = rebuild(s)

    def _run_node(self, n: torch.fx.Node, values: dict) -> Any:
        args = torch.fx.node.map_arg(n.args, lambda a: values[a])
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: values[a])
        if n.op == "call_function" and str(n.target).startswith(STORAGE_READERS) and isinstance(n.args[0], torch.fx.Node):
            args = (with_traced_layout(args[0], n.args[0].meta.get("val")), *args[1:])
        if n.op == "call_function":
            return n.target(*args, **kwargs)
        raise TesseraError(f"cannot run node {n.op} {n.target}")
