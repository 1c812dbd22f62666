"""Kernel templates written in tessera for the anchor operators (CUDA).

Each `make_*` returns a Kernel specialised for a dtype and a schedule; the operator layer
(later) chooses among them.
"""

from tessera.kernels.reduce import make_layernorm, make_rmsnorm, make_row_reduce, make_softmax

__all__ = ["make_layernorm", "make_rmsnorm", "make_row_reduce", "make_softmax"]
