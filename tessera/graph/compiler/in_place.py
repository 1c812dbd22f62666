"""Graph outputs computed in the memory of the graph input they replace (a KV-cache update).

A front end that writes an output back into an input after the call (the torch backend's input
mutations: a static KV cache's `index_copy_`) may ask `compile_graph` to compute it there
(`in_place={output index: input index}`).  An update is taken when the output is an
`index_copy` of that input itself and nothing else reads the input (nor is it an output): the
operator is then marked `in_place`, its kernel writes the indexed slices alone into the input's
memory (no copy of the rest), the compiled graph binds the output to the caller's input array
(CUDA graphs capture that address rather than a static copy), and returns that array, so the
write-back is no copy at all.  Updates of other forms are computed as usual and written back
by the caller -- or, for inputs the caller declares static (it keeps them at one address from
call to call, as torch's `mark_static_address` says), copied into the input by the run's last
step (`copy_back`), inside the CUDA graph, and returned as the input.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping

from tessera.errors import ArgumentError
from tessera.graph.flow_graph import FlowGraph

log = logging.getLogger("tessera")

IN_PLACE_KINDS = ("index_copy",)


def plan_in_place(graph: FlowGraph, requested: Mapping[int, int] | None,
                  static_inputs: Collection[int] = ()) -> tuple[dict[int, int], dict[int, int]]:  # fmt: skip
    """The requested (output index -> input index) updates that are computed in place (their
    operators are marked `in_place`), and those copied back at the end of the run (updates of
    `static_inputs` computed apart).  Indices out of range raise ArgumentError."""
    for op in graph.operators:  # the mark is the compiler's alone (a saved graph may carry an old one)
        if op.kind in IN_PLACE_KINDS:
            op.attrs["in_place"] = False
    if not requested:
        return {}, {}
    consumers = graph.consumers()
    taken: dict[int, int] = {}
    copied: dict[int, int] = {}
    for j, i in requested.items():
        if not (0 <= j < len(graph.outputs)) or not (0 <= i < len(graph.inputs)):
            raise ArgumentError(f"in_place={{{j}: {i}}}: graph {graph.name} has {len(graph.outputs)} outputs and "
                                f"{len(graph.inputs)} inputs")  # fmt: skip
        out, inp = graph.outputs[j], graph.inputs[i]
        op = out.producer
        if inp in graph.outputs or graph.outputs.count(out) != 1 or i in [*taken.values(), *copied.values()]:
            why = "the input or the output is returned more than once"
        elif tuple(out.shape) != tuple(inp.shape) or out.dtype != inp.dtype:
            why = "the output's shape or dtype differs from the input's"
        elif op is None:
            why = "no operator computes the output"
        elif op.kind in IN_PLACE_KINDS and op.inputs[0] is inp and all(c is op for c in consumers.get(inp, [])):
            op.attrs["in_place"] = True
            taken[j] = i
            continue
        elif i in static_inputs:
            copied[j] = i  # computed apart, written into the static input at the end of the run
            continue
        else:
            why = (f"it is not an {' / '.join(IN_PLACE_KINDS)} of the input read by nothing else, and the input is "
                   "not static")  # fmt: skip
        log.debug("tessera: output %d of %s is not computed in input %r: %s", j, graph.name, inp.name, why)
    return taken, copied
