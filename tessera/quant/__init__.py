"""Low-bit weights: types int1..int8, uint1..uint8, e2m1, e2m3, e3m2, e4m3, e5m2.

* `codecs` — the numpy reference: value codes and dense bit packing;
* `packed` — `PackedTensor`, what kernels take for parameters of those types;
"""

from tessera.quant.codecs import WEIGHT_TYPES, decode, encode, pack_bits, unpack_bits, weight_type
from tessera.quant.packed import PackedTensor

__all__ = ["WEIGHT_TYPES", "PackedTensor", "decode", "encode", "pack_bits", "unpack_bits", "weight_type"]
