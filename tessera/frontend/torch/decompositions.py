"""The decomposition table AOTAutograd traces with: torch's core ATen decompositions, minus
the high-level ops tessera keeps whole.

Everything AOTAutograd traces ends as core ATen ops (about 190, `torch.Tag.core`), plus the
ops listed in KEEP, which torch would otherwise break into several core ops.  They are kept
because tessera has one operator (and a dedicated kernel or fused schedule) for each.
CompositeImplicit ops (`F.linear`, `F.layer_norm`, `F.group_norm`) decompose while tracing
whatever the table says; their core results (`addmm`, `native_layer_norm`,
`native_group_norm`) are kept whole by not being in the table in the first place.
RMS norm arrives decomposed (pow, mean, add, rsqrt, mul: `_fused_rms_norm` has no fake kernel,
so tracing decomposes it whatever the table says; transformers writes it out by hand anyway);
the ops scheduler fuses the reduction with its prologue and epilogue into one kernel.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

# op -> why tessera keeps it whole instead of using torch's decomposition
KEEP: dict[str, str] = {
    "aten._scaled_dot_product_flash_attention_for_cpu.default":
        "attention is an anchor: one scaled_dot_product_attention kernel instead of bmm, softmax, bmm",
    "aten.silu.default": "one elementwise op instead of x * sigmoid(x)",
    "aten.hardswish.default": "one elementwise op instead of a clamp chain",
    "aten.hardsigmoid.default": "one elementwise op instead of a clamp chain",
    "aten.mish.default": "one elementwise op instead of x * tanh(softplus(x))",
    "aten.softplus.default": "one elementwise op (with torch's beta and threshold)",
    "aten.tril.default": "tril is one injective op, not an arange/compare/where chain",
    "aten.triu.default": "triu is one injective op, not an arange/compare/where chain",
    "aten.index_copy.default": "the KV-cache update: a compiled scatter along one axis (index_put is more general)",
}  # fmt: skip

# Core ATen ops that also count as decomposed here: tessera lowers them through torch's
# own decomposition into other core ops (none yet; every core op it supports has a rule).
EXTRA: dict[Any, Any] = {}


@functools.cache
def decomposition_table() -> dict[Any, Any]:
    """The table passed to AOTAutograd."""
    from torch._decomp import core_aten_decompositions

    table = {op: fn for op, fn in core_aten_decompositions().items() if str(op) not in KEEP}
    table.update(EXTRA)
    return table


def kept_ops() -> list[torch._ops.OpOverload]:
    out = []
    for name in KEEP:
        _, packet, overload = name.split(".")
        out.append(getattr(getattr(torch.ops.aten, packet), overload))
    return out
