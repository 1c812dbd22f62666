"""PackedTensor: a tensor of a low-bit type stored densely (ceil(numel * bits / 8) bytes).

Kernels take it wherever a parameter is annotated with a storage type (`W: int3["N", "K"]`):
the runtime reads its logical shape and dtype through `__tessera_view__`, and generated code
extracts the fields (tessera.quant.codecs describes the bit order).
"""

from __future__ import annotations

from math import prod
from typing import Any

import numpy as np

from tessera.errors import ArgumentError
from tessera.ir.dtypes import DataType
from tessera.quant import codecs
from tessera.runtime.tensor import ArrayView


class PackedTensor:
    """`numel` fields of `dtype` packed into a flat uint8 buffer (numpy or torch, any device)."""

    def __init__(self, data: Any, dtype: DataType | str, shape: tuple[int, ...]):
        self.dtype = codecs.weight_type(dtype)
        self.shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in self.shape):
            raise ArgumentError(f"PackedTensor shape {self.shape} has a negative dimension")
        need = codecs.packed_nbytes(prod(self.shape), self.dtype.nbits)
        if str(getattr(data, "dtype", "")).removeprefix("torch.") != "uint8" or len(getattr(data, "shape", ())) != 1:
            raise ArgumentError(f"PackedTensor data must be a 1-D uint8 array, got {getattr(data, 'dtype', type(data))}")
        if data.shape[0] != need:
            raise ArgumentError(f"{prod(self.shape)} {self.dtype} values take {need} packed bytes, got {data.shape[0]}")
        self.data = data

    @classmethod
    def from_values(cls, values: Any, dtype: DataType | str) -> PackedTensor:
        """Encode and pack `values` (numpy-convertible; floats round to the type, ints must fit)."""
        t = codecs.weight_type(dtype)
        values = np.asarray(values)
        return cls(codecs.pack_bits(codecs.encode(values, t), t.nbits), t, values.shape)

    @classmethod
    def from_codes(cls, codes: Any, dtype: DataType | str) -> PackedTensor:
        """Pack raw codes (unsigned, < 2**bits)."""
        t = codecs.weight_type(dtype)
        codes = np.asarray(codes)
        return cls(codecs.pack_bits(codes, t.nbits), t, codes.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.shape[0])

    def _host_bytes(self) -> np.ndarray:
        d = self.data
        if not isinstance(d, np.ndarray):
            d = d.detach().cpu().numpy()
        return d

    def codes(self) -> np.ndarray:
        """The unsigned codes, shaped like the tensor (numpy uint8)."""
        return codecs.unpack_bits(self._host_bytes(), self.dtype.nbits, prod(self.shape)).reshape(self.shape)

    def numpy(self) -> np.ndarray:
        """The decoded values: int64 for integer types, float64 for floats."""
        return codecs.decode(self.codes(), self.dtype)

    def to(self, device: str) -> PackedTensor:
        """A copy with its bytes on `device` ("cpu" gives numpy, "cuda" a torch tensor)."""
        if device == "cpu":
            return PackedTensor(np.array(self._host_bytes()), self.dtype, self.shape)
        import torch

        return PackedTensor(torch.as_tensor(self._host_bytes()).to(device), self.dtype, self.shape)

    def __tessera_view__(self) -> ArrayView:
        d = self.data
        if isinstance(d, np.ndarray):
            if not d.flags.c_contiguous:
                raise ArgumentError("PackedTensor data must be contiguous")
            return ArrayView(d.ctypes.data, self.shape, self.dtype, "cpu", True, d, bool(d.flags.writeable))
        device = "cuda" if d.is_cuda else "cpu"
        return ArrayView(d.data_ptr(), self.shape, self.dtype, device, d.is_contiguous(), d)

    def __repr__(self) -> str:
        return f"PackedTensor({self.dtype}, shape={self.shape}, {self.nbytes} bytes)"
