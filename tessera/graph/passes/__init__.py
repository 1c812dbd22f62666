"""Graph passes, one per module, and the default pipeline.

Each pass rewrites a FlowGraph in place and returns how many rewrites it made.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.passes.attention_gqa import fold_repeat_kv
from tessera.graph.passes.attention_masks import simplify_attention_masks
from tessera.graph.passes.constant_folding import fold_constants
from tessera.graph.passes.dead_code import eliminate_dead_code
from tessera.graph.passes.drop_reshapes import drop_reshapes
from tessera.graph.passes.fold_batchnorm import fold_batchnorm
from tessera.graph.passes.fuse_attention import fuse_attention
from tessera.graph.passes.fuse_gelu import fuse_gelu
from tessera.graph.passes.fuse_rms_norm import fuse_rms_norm
from tessera.graph.passes.head_views import head_views
from tessera.graph.passes.linear_bias import fold_linear_bias
from tessera.graph.passes.matmul_to_linear import matmul_to_linear
from tessera.graph.passes.merge_qkv import merge_parallel_projections
from tessera.graph.passes.sink_anchors import sink_anchors_to_epilogues

Pass = Callable[[FlowGraph], int]

DEFAULT_PASSES: tuple[Pass, ...] = (
    fold_constants,
    eliminate_dead_code,
    fold_batchnorm,
    fuse_gelu,
    fuse_rms_norm,
    matmul_to_linear,
    fold_linear_bias,
    drop_reshapes,
    fuse_attention,
    simplify_attention_masks,
    fold_repeat_kv,
    merge_parallel_projections,
    head_views,
    eliminate_dead_code,
    sink_anchors_to_epilogues,
)

_log = logging.getLogger("tessera")


def optimize(graph: FlowGraph, passes: Sequence[Pass] = DEFAULT_PASSES, verify: bool = True) -> FlowGraph:
    """Run passes over graph in order (verifying after each when verify) and return it."""
    for p in passes:
        n = p(graph)
        if n:
            _log.debug("pass %s: %d rewrites on %s", p.__name__, n, graph.name)
        if verify:
            graph.verify()
    return graph


__all__ = ["DEFAULT_PASSES", "Pass", "optimize", "fold_constants", "eliminate_dead_code", "fold_batchnorm",
           "fuse_gelu", "fuse_rms_norm", "matmul_to_linear", "fold_linear_bias", "drop_reshapes",
           "fuse_attention", "simplify_attention_masks", "merge_parallel_projections", "head_views", "fold_repeat_kv",
           "sink_anchors_to_epilogues"]  # fmt: skip
