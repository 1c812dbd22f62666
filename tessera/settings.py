"""Every TESSERA_* environment variable tessera reads: declared once here, read only here.

Each `Setting` names its variable, its kind, the values it allows, its default and what it
does; `value(name)` parses and validates it, and the typed accessors below are what the rest
of tessera calls.  Values are read at call time, so a change of the environment (e.g.
monkeypatch.setenv in tests) takes effect at the next call; the one reader that keeps a value
is tessera.runtime.cuda.programmatic_launch, which caches $TESSERA_PDL with the device query
for the process.  An empty variable counts as unset.  A value a setting cannot mean raises
ArgumentError naming the variable and the values it allows; a compiler that is not an
executable raises CompilerNotFoundError.

This module imports only the standard library and tessera.errors, so every layer may use it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from tessera.errors import ArgumentError, CompilerNotFoundError

_TRUE, _FALSE = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


@dataclass(frozen=True)
class Setting:
    """One environment variable.  kind: 'bool' (1/on/true/yes, 0/off/false/no), 'choice' (one of
    `choices`, any case), 'path', 'executable' (a path or a command name on PATH), or 'token'
    (printable ASCII without spaces, as an HTTP header value carries it)."""

    name: str
    kind: str
    default: bool | str | None
    doc: str
    choices: tuple[str, ...] = ()

    def allowed(self) -> str:
        """The values it takes, as an error message names them."""
        if self.kind == "bool":
            return "1/on/true/yes or 0/off/false/no"
        if self.kind == "choice":
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.kind == "token":
            return "printable ASCII characters without spaces"
        return "a path" if self.kind == "path" else "an executable's path or a command name on PATH"

    def parse(self, raw: str) -> bool | str:
        """The value of a set (non-empty) variable; raises when this setting cannot mean `raw`."""
        text = raw.strip()
        if self.kind == "bool" and text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        if self.kind == "choice" and text.lower() in self.choices:
            return text.lower()
        if self.kind == "path":
            return str(Path(text).expanduser())
        if self.kind == "token" and all("!" <= c <= "~" for c in text):
            return text
        if self.kind == "executable":
            path = shutil.which(text)
            if path:
                return path
            raise CompilerNotFoundError(f"${self.name} is set to {raw!r}, which is not an executable ({self.doc})")
        unset = "" if self.default is None else f"; unset: {_spelled(self.default)}"
        raise ArgumentError(f"${self.name}={raw!r}: use {self.allowed()} ({self.doc}{unset})")


def _spelled(default: bool | str) -> str:
    return ("on" if default else "off") if isinstance(default, bool) else repr(default)


TUNE = Setting("TESSERA_TUNE", "bool", True,
               "tune GEMM and attention schedules by timing them; off: choose them by the cost model")  # fmt: skip
PROGRESS = Setting("TESSERA_PROGRESS", "bool", None,
                   "show progress bars on stderr; unset: only when stderr is a terminal")  # fmt: skip
PDL = Setting("TESSERA_PDL", "bool", True, "launch kernels with programmatic dependent launch on SM90+ GPUs")
LOWBIT_PREFILL = Setting("TESSERA_LOWBIT_PREFILL", "choice", "auto",
                         "how low-bit GEMMs past the decode sizes run: 'auto' (with tuning, tuning picks a fused "
                         "kernel or dequantising first; without, dequantising first), 'fused' (the shared-memory "
                         "fused kernel), 'register' (the register-A kernel) or 'dequant' (dequantising first)",
                         ("auto", "fused", "register", "dequant"))  # fmt: skip
IMPLICIT_CONV = Setting("TESSERA_IMPLICIT_CONV", "bool", True,
                        "NHWC convolutions as an implicit GEMM on TMA GPUs; off: through an im2col buffer")  # fmt: skip
CACHE_DIR = Setting("TESSERA_CACHE_DIR", "path", "~/.cache/tessera", "the artifact cache's directory")
CC = Setting("TESSERA_CC", "executable", None, "the C compiler that builds CPU kernels; unset: gcc on PATH")
NVCC = Setting("TESSERA_NVCC", "executable", None, "the CUDA compiler that builds GPU kernels; unset: nvcc on PATH")
CPU_ISA = Setting("TESSERA_CPU_ISA", "choice", None,
                  "a cap on the C kernels' vector ISA, narrowest first; unset: the machine's widest",
                  ("scalar", "avx2", "avx512"))  # fmt: skip
API_KEY = Setting("TESSERA_API_KEY", "token", None,
                  "the key `tessera serve` requires on /v1 ('Authorization: Bearer KEY') when --api-key is not given; "
                  "unset: none")  # fmt: skip

DECLARED: dict[str, Setting] = {s.name: s for s in (TUNE, PROGRESS, PDL, LOWBIT_PREFILL, IMPLICIT_CONV, CACHE_DIR,
                                                    CC, NVCC, CPU_ISA, API_KEY)}  # fmt: skip


def value(name: str) -> bool | str | None:
    """The declared variable `name`'s value, validated; its default when unset or empty."""
    setting = DECLARED.get(name)
    if setting is None:
        raise ArgumentError(f"{name} is not a tessera setting; declared: {', '.join(DECLARED)}")
    raw = os.environ.get(name, "")
    return setting.parse(raw) if raw.strip() else setting.default


def tune() -> bool:
    """$TESSERA_TUNE: whether tuning is on by default (on unless 0/off)."""
    return bool(value(TUNE.name))


def progress() -> bool | None:
    """$TESSERA_PROGRESS: True/False, or None when unset (tessera.progress then asks the terminal)."""
    return value(PROGRESS.name)  # type: ignore[return-value]


def pdl() -> bool:
    """$TESSERA_PDL: whether programmatic dependent launch may be used (on unless 0/off)."""
    return bool(value(PDL.name))


def lowbit_prefill() -> str:
    """$TESSERA_LOWBIT_PREFILL: 'auto' (default), 'fused', 'register' or 'dequant'."""
    return str(value(LOWBIT_PREFILL.name))


def implicit_conv() -> bool:
    """$TESSERA_IMPLICIT_CONV: whether NHWC convs may run as an implicit GEMM (on unless 0/off)."""
    return bool(value(IMPLICIT_CONV.name))


def cache_dir() -> Path:
    """$TESSERA_CACHE_DIR, else ~/.cache/tessera."""
    return Path(str(value(CACHE_DIR.name))).expanduser()


def compiler(name: str) -> str | None:
    """The executable that $TESSERA_CC or $TESSERA_NVCC (`name`) names; None when unset."""
    if name not in (CC.name, NVCC.name):
        raise ArgumentError(f"{name} does not name a compiler; use {CC.name} or {NVCC.name}")
    return value(name)  # type: ignore[return-value]


def cpu_isa_cap() -> str | None:
    """$TESSERA_CPU_ISA: 'scalar', 'avx2' or 'avx512'; None (no cap) when unset."""
    return value(CPU_ISA.name)  # type: ignore[return-value]


def api_key() -> str | None:
    """$TESSERA_API_KEY: the key the server requires when its --api-key is not given; None when unset."""
    return value(API_KEY.name)  # type: ignore[return-value]
