"""Example kernels written in tessera: vector add, tiled matmul and row softmax.

Each `make_*` function returns a compiled-on-first-call Kernel for "cpu" or "cuda";
`reference` holds the numpy definitions they are checked against.
"""

from tessera.examples.matmul import make_matmul
from tessera.examples.softmax import make_softmax
from tessera.examples.vector_add import make_vector_add

__all__ = ["make_matmul", "make_softmax", "make_vector_add"]
