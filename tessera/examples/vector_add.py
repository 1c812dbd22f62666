"""c = a + b, elementwise."""

from __future__ import annotations

import tessera as ts
from tessera import f32


def make_vector_add(target: str = "cpu", block: int = 256) -> ts.Kernel:
    """Vector add for `target`; the CUDA version uses one thread per element."""
    if target == "cpu":

        @ts.kernel(target="cpu")
        def vector_add(a: f32["n"], b: f32["n"], c: f32["n"]):
            for i in ts.parallel(a.shape[0]):
                c[i] = a[i] + b[i]

        return vector_add

    @ts.kernel(target="cuda")
    def vector_add_cuda(a: f32["n"], b: f32["n"], c: f32["n"]):
        n = a.shape[0]
        ts.attrs.grid = ts.ceil_div(n, block)
        ts.attrs.block = block
        i = ts.block_idx.x * block + ts.thread_idx.x
        if i < n:
            c[i] = a[i] + b[i]

    return vector_add_cuda
