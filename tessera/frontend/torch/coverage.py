"""The status of every core ATen op (`torch.Tag.core`) in the torch front end, and the
generated table docs/aten_ops.md.

    python -m tessera.frontend.torch.coverage [docs/aten_ops.md]

Statuses:
- lowered: a rule in aten_math.py / aten_nn.py / aten_shape.py turns it into tessera ops;
- decomposed: the decomposition table (`decompositions.py`) replaces it by other ATen ops
  before tessera sees it;
- metadata: a size query; its value comes from torch's shape metadata (symbolic if dynamic);
- falls back: runs in torch inside the compiled graph (logged once), for the reason given;
- functionalized: an out= variant, which functionalization replaces by the functional op;
- breaks: dynamo ends the graph before it (data-dependent output shape or Python value).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from tessera.frontend.torch import aten_math, aten_nn, aten_shape  # noqa: F401  (register the rules)
from tessera.frontend.torch.convert import rule_for
from tessera.frontend.torch.decompositions import KEEP, decomposition_table

_TRAINING = "a backward op: training graphs only (tessera compiles inference)"
_NO_OP_YET = "no tessera operator for it yet"

# core ops without a lowering, and why
REASONS: dict[str, tuple[str, str]] = {
    "aten.nonzero.default": ("breaks", "output shape depends on the data; dynamo breaks the graph"),
    "aten._local_scalar_dense.default": ("breaks", "`.item()`: a Python value from tensor data; dynamo breaks "
                                                   "the graph when control flow reads it"),
    "aten.rand.default": ("falls back", "random numbers: torch's generator keeps results equal to eager"),
    "aten.randn.default": ("falls back", "random numbers: torch's generator keeps results equal to eager"),
    "aten.randperm.default": ("falls back", "random numbers: torch's generator keeps results equal to eager"),
    "aten.sort.default": ("falls back", "no sort kernel yet (torch's on the same device)"),
    "aten.topk.default": ("falls back", "no top-k kernel yet (torch's on the same device)"),
    "aten._native_batch_norm_legit.default": ("falls back", "batch norm in training mode (batch statistics)"),
    "aten._native_batch_norm_legit.no_stats": ("falls back", "batch norm in training mode (batch statistics)"),
    "aten._adaptive_avg_pool3d.default": ("falls back", _NO_OP_YET),
    "aten.avg_pool3d.default": ("falls back", _NO_OP_YET),
    "aten.max_pool3d_with_indices.default": ("falls back", _NO_OP_YET),
    "aten.grid_sampler_2d.default": ("falls back", _NO_OP_YET),
    "aten._cdist_forward.default": ("falls back", _NO_OP_YET),
    "aten._pdist_forward.default": ("falls back", _NO_OP_YET),
    "aten._embedding_bag.default": ("falls back", _NO_OP_YET),
    "aten._fft_r2c.default": ("falls back", "FFTs: complex results (tessera has no complex dtype)"),
    "aten._fft_c2r.default": ("falls back", "FFTs: complex inputs (tessera has no complex dtype)"),
}  # fmt: skip
for _op in ("_adaptive_avg_pool2d_backward", "avg_pool2d_backward", "convolution_backward",
            "max_pool2d_with_indices_backward"):  # fmt: skip
    REASONS[f"aten.{_op}.default"] = ("falls back", _TRAINING)


_REFERENCE = " (to `scatter_elements`, which has no generated kernel yet: it runs its numpy reference, on the host)"
NOTES = {f"aten.{n}": _REFERENCE for n in ("scatter.src", "scatter.value", "scatter_add.default", "scatter_reduce.two")}


def core_ops() -> list[torch._ops.OpOverload]:
    """Every ATen overload tagged core, sorted by name (from the dispatcher's registry: the
    attributes of torch.ops.aten appear only once accessed)."""
    out = []
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, name = qualified.partition("::")
        if namespace != "aten":
            continue
        packet_name, _, overload = name.partition(".")
        try:
            op = getattr(getattr(torch.ops.aten, packet_name), overload or "default")
        except (AttributeError, RuntimeError):
            continue
        if torch.Tag.core in op.tags:
            out.append(op)
    return sorted(set(out), key=str)


def status(op: torch._ops.OpOverload) -> tuple[str, str]:
    """(status, why) for one op."""
    name = str(op)
    if any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments):
        return "functionalized", "an out= or in-place variant: functionalization replaces it by the functional op"
    if name.startswith("aten.sym_"):
        return "metadata", "a size: taken from torch's shape metadata"
    if op in decomposition_table():
        return "decomposed", "torch's core decomposition into other ATen ops"
    if op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd):
        return "decomposed", "CompositeImplicit: torch decomposes it while tracing"
    rule = rule_for(op)
    if rule is not None:
        module = rule.__module__.rsplit(".", 1)[-1]
        return "lowered", f"`{module}.{rule.__name__}`" + NOTES.get(name, "")
    if name in REASONS:
        return REASONS[name]
    return "falls back", "no lowering yet"


def table() -> str:
    """docs/aten_ops.md."""
    rows = [(str(op), *status(op)) for op in core_ops()]
    counts: dict[str, int] = {}
    for _, s, _ in rows:
        counts[s] = counts.get(s, 0) + 1
    lines = [
        "# Core ATen ops in the torch front end",
        "",
        f"Generated by `python -m tessera.frontend.torch.coverage` (torch {torch.__version__.split('+')[0]}); "
        "tests/test_aten_coverage.py checks it is up to date.",
        "",
        "The torch front end lowers dynamo's graphs through AOTAutograd to the core ATen op set "
        "(`torch.Tag.core`), plus the high-level ops kept whole (second table). " +
        ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) + ".",
        "",
        "| op | status | how / why |",
        "|---|---|---|",
    ]
    lines += [f"| `{name}` | {s} | {why} |" for name, s, why in rows]
    lines += ["", "## Kept whole (not decomposed, lowered to one tessera operator)", "",
              "| op | lowering | why kept |", "|---|---|---|"]  # fmt: skip
    for name, why in KEEP.items():
        packet, overload = name.split(".")[1:]
        rule = rule_for(getattr(getattr(torch.ops.aten, packet), overload))
        how = f"`{rule.__module__.rsplit('.', 1)[-1]}.{rule.__name__}`" if rule else "missing"
        lines.append(f"| `{name}` | {how} | {why} |")
    lines += ["", "CUDA's attention ops (`_scaled_dot_product_efficient_attention`, `_flash_attention`, "
              "`_cudnn_attention`) are not in torch's decomposition table and lower to the same "
              "`scaled_dot_product_attention` (`aten_nn._sdpa_cuda`).", ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    path = Path(argv[0]) if argv else Path(__file__).resolve().parents[3] / "docs" / "aten_ops.md"
    path.write_text(table())
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
