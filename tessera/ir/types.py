"""Value types of the IR: scalars (a DataType), pointers and tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from tessera.ir.dtypes import DataType

# Memory scopes a tensor can live in.
GLOBAL, SHARED, REGISTER = "global", "shared", "register"
SCOPES = (GLOBAL, SHARED, REGISTER)


@dataclass(frozen=True)
class PointerType:
    """A raw pointer to elements of `dtype` (indexed with one index)."""

    dtype: DataType

    def __str__(self) -> str:
        return f"ptr[{self.dtype}]"


@dataclass(frozen=True)
class Swizzle:
    """XOR swizzle of a shared tensor's element offsets (CUTLASS's Swizzle<B, M, S>), applied to
    the row-major offset within each trailing 2-D tile (the last two dimensions).

    offset ^ (((offset >> (base + shift)) & (2**bits - 1)) << base): groups of 2**base elements
    (one 16-byte vector for `base` = log2(16 / element bytes)) move together, so vector accesses
    stay contiguous, while rows that would hit the same banks are spread over 2**bits groups.
    """

    bits: int
    base: int
    shift: int

    def __post_init__(self) -> None:
        for name in ("bits", "base", "shift"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise TypeError(f"Swizzle.{name} must be a non-negative int, got {v!r}")
        if self.shift < self.bits:
            raise TypeError(f"Swizzle needs shift >= bits (got bits={self.bits}, shift={self.shift}): "
                            "the source and target bit ranges would overlap")  # fmt: skip

    def apply(self, offset: int) -> int:
        """The swizzled offset (reference semantics for tests and tools)."""
        mask = (1 << self.bits) - 1
        return offset ^ (((offset >> (self.base + self.shift)) & mask) << self.base)

    def __str__(self) -> str:
        return f"swizzle({self.bits}, {self.base}, {self.shift})"


@dataclass(frozen=True, eq=False)
class TensorType:
    """A dense row-major tensor: element type, shape and memory scope.

    Shape entries are IR expressions (constants or integer variables).  Annotations may
    give plain ints or names; names are resolved by the front end into variables.
    """

    dtype: DataType
    shape: tuple[Any, ...]
    scope: str = GLOBAL
    # Shared tensors only: permutes element offsets to avoid bank conflicts.
    swizzle: Swizzle | None = None

    @staticmethod
    def from_annotation(dtype: DataType, shape: tuple[Any, ...]) -> TensorType:
        for d in shape:
            if not isinstance(d, (int, str)) or isinstance(d, bool):
                raise TypeError(f"tensor dimension must be an int or a symbol name, got {d!r}")
            if isinstance(d, int) and d <= 0:
                raise TypeError(f"tensor dimension must be positive, got {d}")
        return TensorType(dtype, tuple(shape), GLOBAL)

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        scope = "" if self.scope == GLOBAL else f", {self.scope}"
        swizzle = "" if self.swizzle is None else f", {self.swizzle}"
        return f"{self.dtype}[{dims}{scope}{swizzle}]"


Type = Union[DataType, PointerType, TensorType]

