"""ONNX control flow whose decisions are known at import time, unrolled into the graph.

tessera's graphs have no subgraphs.  An `If` whose condition is known imports the chosen
branch; a `Loop` whose trip count and condition are known, and a `Scan` over a static
sequence length, import their body once per iteration (each in its own scope: body names
are local, outer names visible), slicing the scanned inputs and stacking the scanned
outputs.  A condition or trip count computed from graph inputs raises ShapeInputError, so
`tessera.onnx.compile` specialises on those inputs; one that depends on computed data is
refused.  Function bodies use this too (AffineGrid's If, LinearAttention's Scan).
"""

from __future__ import annotations

import numpy as np

from tessera.errors import UnsupportedError
from tessera.frontend.onnx.importer import rule
from tessera.graph import Tensor

MAX_UNROLL = 4096  # iterations of one Loop or Scan


@rule("If", attrs=("then_branch", "else_branch"))
def _if(im, node, args, attrs):
    cond = im.const_array(args[0], "If condition")
    if cond.size != 1:
        raise UnsupportedError(f"If condition of {cond.size} elements")
    branch = attrs["then_branch"] if bool(cond.reshape(-1)[0]) else attrs["else_branch"]
    return im.import_subgraph(branch, [])


@rule("Loop", attrs=("body",))
def _loop(im, node, args, attrs):
    body = attrs["body"]
    trip = args[0] if args else None
    cond = args[1] if len(args) > 1 else None
    carried = list(args[2:])
    limit = int(im.const_array(trip, "Loop trip count").reshape(-1)[0]) if trip is not None else None
    keep_going = bool(im.const_array(cond, "Loop condition").reshape(-1)[0]) if cond is not None else True
    n_carried = len(carried)
    scans: list[list[Tensor]] = [[] for _ in range(len(body.output) - 1 - n_carried)]
    i = 0
    while keep_going and (limit is None or i < limit):
        if i >= MAX_UNROLL:
            raise UnsupportedError(f"Loop of more than {MAX_UNROLL} iterations (tessera unrolls loops)")
        it = Tensor.constant(np.array(i, np.int64))
        flag = Tensor.constant(np.array(keep_going))
        outs = im.import_subgraph(body, [it, flag, *carried])
        keep_going = bool(im.const_array(outs[0], "Loop condition (computed by the body)").reshape(-1)[0])
        carried = outs[1 : 1 + n_carried]
        for k, v in enumerate(outs[1 + n_carried :]):
            scans[k].append(im.op("unsqueeze", v, axes=[0]))
        i += 1
    if scans and i == 0:
        raise UnsupportedError("Loop with zero iterations and scan outputs (their shape is unknown)")
    return carried + [im.op("concat", *parts, axis=0) if len(parts) > 1 else parts[0] for parts in scans]


@rule("Scan", attrs=("body", "num_scan_inputs", "scan_input_axes", "scan_input_directions", "scan_output_axes",
                     "scan_output_directions"))  # fmt: skip
def _scan(im, node, args, attrs):
    body = attrs["body"]
    m = int(attrs["num_scan_inputs"])
    states, xs = list(args[: len(args) - m]), [im.tensor(a) for a in args[len(args) - m :]]
    in_axes = [int(a) for a in attrs.get("scan_input_axes", [0] * m)]
    in_dirs = [int(a) for a in attrs.get("scan_input_directions", [0] * m)]
    k = len(body.output) - len(states)
    out_axes = [int(a) for a in attrs.get("scan_output_axes", [0] * k)]
    out_dirs = [int(a) for a in attrs.get("scan_output_directions", [0] * k)]
    in_axes = [a % x.ndim for a, x in zip(in_axes, xs)]
    lengths = {x.shape[a] for x, a in zip(xs, in_axes)}
    if len(lengths) != 1 or not isinstance(next(iter(lengths)), int):
        raise UnsupportedError(f"Scan over sequence lengths {sorted(map(str, lengths))} (one static length is needed)")
    steps = next(iter(lengths))
    if steps > MAX_UNROLL:
        raise UnsupportedError(f"Scan of {steps} steps (more than {MAX_UNROLL}; tessera unrolls scans)")
    scans: list[list[Tensor]] = [[] for _ in range(k)]
    for t in range(steps):
        slices = []
        for x, a, d in zip(xs, in_axes, in_dirs):
            pos = steps - 1 - t if d else t
            slices.append(im.op("squeeze", im.op("slice", x, axes=[a], starts=[pos], ends=[pos + 1], steps=[1]),
                                axes=[a]))  # fmt: skip
        outs = im.import_subgraph(body, [*states, *slices])
        states = outs[: len(states)]
        for j, v in enumerate(outs[len(states) :]):
            scans[j].append(im.tensor(v))
    results = []
    for j, parts in enumerate(scans):
        if out_dirs[j]:
            parts = parts[::-1]
        axis = out_axes[j] % (parts[0].ndim + 1) if parts else 0
        stacked = [im.op("unsqueeze", p, axes=[axis]) for p in parts]
        results.append(im.op("concat", *stacked, axis=axis) if len(stacked) > 1 else stacked[0])
    return states + results
