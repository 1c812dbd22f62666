"""The options of the model compiler, one definition for every way in:

    torch.compile(model, backend="tessera", options={"tune": True, "progress": False})
    torch.compile(model, backend="tessera", mode="max-autotune")     # = {"tune": True}
    tessera.onnx.compile("model.onnx", "cuda", tune=True)
    compile_graph(graph, "cuda", tune=True)

An unknown option, or a value of the wrong type, raises ArgumentError listing the options.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from tessera import settings
from tessera.errors import ArgumentError
from tessera.graph.compiler.memory import ARRAY_KINDS


@dataclass(frozen=True)
class CompileOptions:
    """What the compiler may do.  Each field is documented in OPTION_DOCS."""

    tune: bool = field(default_factory=settings.tune)
    cuda_graph: bool = True
    progress: bool | None = None
    executor: str = "compiled"
    arrays: str = "auto"


OPTION_DOCS = {
    "tune": "time the GEMM/attention schedule space per shape (slow the first time, cached on disk) instead of "
            "choosing a schedule by the cost model (default True; $TESSERA_TUNE=0 turns the default off)",
    "cuda_graph": "on the GPU, capture each shape's run into a CUDA graph and replay it (default True)",
    "progress": "progress bars on stderr: True, False, or None = $TESSERA_PROGRESS, else only on a terminal "
                "(default None)",
    "executor": "'compiled' (kernels, default) or 'reference' (the numpy references, for debugging; torch only)",
    "arrays": "GPU arrays: 'torch' (torch CUDA tensors), 'native' (tessera DeviceArrays, no torch needed) or "
              "'auto' (torch when it has CUDA; default)",
}  # fmt: skip
_TYPES: dict[str, tuple[type, ...]] = {"tune": (bool,), "cuda_graph": (bool,), "progress": (bool, type(None)),
                                       "executor": (str,), "arrays": (str,)}  # fmt: skip
_EXECUTORS = ("compiled", "reference")
# torch.compile's `mode` for backends other than inductor, read as these options.
MODES: dict[str | None, dict[str, Any]] = {
    None: {}, "default": {}, "reduce-overhead": {"cuda_graph": True}, "max-autotune": {"tune": True, "cuda_graph": True},
    "max-autotune-no-cudagraphs": {"tune": True, "cuda_graph": False},
}  # fmt: skip


def describe() -> str:
    """The options and what each does, one per line."""
    return "\n".join(f"  {name}: {doc}" for name, doc in OPTION_DOCS.items())


def parse_options(options: Mapping[str, Any] | CompileOptions | None = None, *, mode: str | None = None,
                  where: str = "tessera") -> CompileOptions:  # fmt: skip
    """CompileOptions from a mapping of option names (and torch.compile's `mode`); anything
    unknown or mistyped raises ArgumentError naming it and listing the options."""
    if mode not in MODES:
        raise ArgumentError(f"{where}: unknown mode {mode!r}; the modes are "
                            f"{', '.join(repr(m) for m in MODES if m is not None)}")  # fmt: skip
    base = replace(CompileOptions(), **MODES[mode])
    if options is None:
        return base
    if isinstance(options, CompileOptions):
        return options
    if not isinstance(options, Mapping):
        raise ArgumentError(f"{where}: options must be a dict of option names to values, got {type(options).__name__}")
    known = {f.name for f in fields(CompileOptions)}
    unknown = [k for k in options if k not in known]
    if unknown:
        raise ArgumentError(f"{where}: unknown option{'s' if len(unknown) > 1 else ''} "
                            f"{', '.join(repr(k) for k in unknown)}; the options are:\n{describe()}")  # fmt: skip
    for name, value in options.items():
        if not isinstance(value, _TYPES[name]):
            expected = " or ".join("None" if t is type(None) else t.__name__ for t in _TYPES[name])
            raise ArgumentError(f"{where}: option {name!r} must be {expected}, got {value!r}\n  {name}: {OPTION_DOCS[name]}")
    if options.get("executor", "compiled") not in _EXECUTORS:
        raise ArgumentError(f"{where}: option 'executor' must be one of {_EXECUTORS}, got {options['executor']!r}")
    if options.get("arrays", "auto") not in ARRAY_KINDS:
        raise ArgumentError(f"{where}: option 'arrays' must be one of {ARRAY_KINDS}, got {options['arrays']!r}")
    if mode in ("max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead") and any(
            k in options and options[k] != v for k, v in MODES[mode].items()):  # fmt: skip
        raise ArgumentError(f"{where}: mode {mode!r} sets {MODES[mode]}, which options={dict(options)} contradicts")
    return replace(base, **dict(options))
