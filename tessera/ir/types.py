"""Value types of the IR: scalars (a DataType), pointers and tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from tessera.ir.dtypes import DataType, register_tensor_annotation

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
class VectorType:
    """A SIMD register of `lanes` elements of `dtype` (CPU kernels: `f32x16` is one AVX-512
    register, `f32x8` one AVX2 register).  Values of this type come from the vector
    intrinsics (tessera.ir.vector); they live in variables and register tensors."""

    dtype: DataType
    lanes: int

    @property
    def is_storage_only(self) -> bool:
        """Vectors hold computable lanes, never packed sub-byte fields (the DataType property
        of the same name, so code that handles both kinds of type can ask either)."""
        return False

    def __str__(self) -> str:
        return f"{self.dtype.short}x{self.lanes}"


@dataclass(frozen=True)
class VoidType:
    """The type of an intrinsic call evaluated for its effect only."""

    def __str__(self) -> str:
        return "void"


VOID = VoidType()


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
            if isinstance(d, int) and not 0 < d < 2**31:  # index arithmetic is int32
                raise TypeError(f"tensor dimension must be positive and below 2**31, got {d}")
        return TensorType(dtype, tuple(shape), GLOBAL)

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        scope = "" if self.scope == GLOBAL else f", {self.scope}"
        swizzle = "" if self.swizzle is None else f", {self.swizzle}"
        return f"{self.dtype}[{dims}{scope}{swizzle}]"


@dataclass(frozen=True)
class TensorMapType:
    """A TMA tensor map (CUDA's CUtensorMap) passed by value as a kernel parameter.

    It describes a row-major global tensor of `dtype` with `len(box)` dimensions, read in
    boxes of `box` elements (outermost dimension first, like tensor indices) into shared
    memory laid out with a `swizzle`-byte swizzle (0, 32, 64 or 128).  The host builds the
    map (tessera.runtime.tensor_map.TensorMap); kernels name it in `tma_load`.

    An im2col map (`im2col_rank` 3, 4 or 5: an N[D][H]WC tensor) is read by `tma_load_im2col`:
    `box` is then (pixels, channels), one row of `channels` channels for each of `pixels`
    consecutive positions of a convolution's sliding window (the TMA im2col mode).
    """

    dtype: DataType
    box: tuple[int, ...]
    swizzle: int = 128
    im2col_rank: int = 0

    @property
    def rank(self) -> int:
        """The rank of the tensor the map describes (coordinates of one load)."""
        return self.im2col_rank or len(self.box)

    @property
    def box_bytes(self) -> int:
        """Bytes one load writes into shared memory (the whole box, zero-filled past the edges)."""
        n = self.dtype.nbytes
        for b in self.box:
            n *= b
        return n

    def __str__(self) -> str:
        kind = f", im2col rank {self.im2col_rank}" if self.im2col_rank else ""
        return f"tensor_map[{self.dtype}, box={list(self.box)}, swizzle={self.swizzle}{kind}]"


def tensor_map(dtype: DataType, box: tuple[int, ...] | list[int], swizzle: int = 128) -> TensorMapType:
    """Annotation for a tensor-map parameter: `tma_a: ts.tensor_map(f16, (1, 128, 64))`."""
    box = tuple(box)
    if not isinstance(dtype, DataType) or dtype.is_subbyte:
        raise TypeError(f"tensor_map() needs a byte-sized dtype, got {dtype!r}")
    if not 1 <= len(box) <= 5 or not all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= 256 for b in box):
        raise TypeError(f"tensor_map() box needs 1 to 5 dimensions of 1..256 elements, got {box!r}")
    if swizzle not in (0, 32, 64, 128):
        raise TypeError(f"tensor_map() swizzle must be 0, 32, 64 or 128 bytes, got {swizzle!r}")
    if box[-1] * dtype.nbytes % 16:
        raise TypeError(f"tensor_map() inner box dimension must span a multiple of 16 bytes, got {box[-1]} x {dtype}")
    if swizzle and box[-1] * dtype.nbytes > swizzle:
        raise TypeError(f"tensor_map() inner box dimension ({box[-1] * dtype.nbytes} bytes) exceeds the {swizzle}-byte swizzle span")
    return TensorMapType(dtype, box, swizzle)


def tensor_map_im2col(dtype: DataType, pixels: int, channels: int, rank: int = 4, swizzle: int = 128) -> TensorMapType:
    """Annotation for an im2col tensor-map parameter over a rank-`rank` N[D][H]WC tensor: each
    `tma_load_im2col` writes `pixels` rows of `channels` channels (a [pixels, channels] tile)."""
    if rank not in (3, 4, 5):
        raise TypeError(f"tensor_map_im2col() describes a rank 3, 4 or 5 tensor (NWC, NHWC, NDHWC), got rank {rank!r}")
    t = tensor_map(dtype, (pixels, channels), swizzle)
    return TensorMapType(t.dtype, t.box, t.swizzle, rank)


Type = Union[DataType, PointerType, TensorType, TensorMapType, VectorType, VoidType]

register_tensor_annotation(TensorType.from_annotation)  # float32["M", "N"]

