"""The built-in operator vocabulary; importing this package registers every op kind."""

from tessera.graph.opdefs import creation, elementwise, linalg, lowbit, moe, nn, reduce, shape

__all__ = ["creation", "elementwise", "linalg", "lowbit", "moe", "nn", "reduce", "shape"]
