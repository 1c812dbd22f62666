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


@dataclass(frozen=True, eq=False)
class TensorType:
    """A dense row-major tensor: element type, shape and memory scope.

    Shape entries are IR expressions (constants or integer variables).  Annotations may
    give plain ints or names; names are resolved by the front end into variables.
    """

    dtype: DataType
    shape: tuple[Any, ...]
    scope: str = GLOBAL

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
        return f"{self.dtype}[{dims}{scope}]"


Type = Union[DataType, PointerType, TensorType]

