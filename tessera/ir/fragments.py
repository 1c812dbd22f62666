"""Register-fragment layouts of tensor-core instructions, as task mappings over the 32 lanes.

`for k, (i, j) in enumerate(MMA_M16N8K16_C.on(lane))` gives each lane the (row, column) of
its k-th accumulator register, so kernels never hand-compute lane arithmetic.  The layouts
follow the PTX ISA's figures for mma.m16n8k16 and ldmatrix (g = lane // 4, t = lane % 4).
"""

from __future__ import annotations

from tessera.ir.mapping import repeat, spatial

# Accumulator C/D (16 x 8, float32): c0,c1 = (g, 2t..2t+1), c2,c3 = (g+8, 2t..2t+1).
MMA_M16N8K16_C = repeat(2, 1) * spatial(8, 4) * repeat(1, 2)
# Operand A (16 x 16, row-major): a0..a7 = (g, 2t..), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..).
MMA_M16N8K16_A = repeat(2, 2, ranks=(1, 0)) * spatial(8, 4) * repeat(1, 2)
# Operand B (16 x 8 as [k, n]): b0,b1 = (2t..2t+1, g), b2,b3 = (2t+8..2t+9, g).
MMA_M16N8K16_B = repeat(2, 1) * spatial(4, 8, ranks=(1, 0)) * repeat(2, 1)

# Row addresses for ldmatrix.x4 over a 16 x 16 tile of 16-bit elements, as (row, 8-column
# block): lane l reads row l % 16 of column block l // 16.  Loading A (row-major [m, k]) this
# way gives the A fragment; loading B stored as [k, n] with trans=True gives the B fragments
# of two neighbouring n8 tiles (registers 0-1 and 2-3).
LDMATRIX_X4 = spatial(16, 2, ranks=(1, 0))
# Row addresses for ldmatrix.x4 (no trans) over B stored as [n, k] (a linear layer's weight):
# (n row, 8-column k block); registers 0-1 and 2-3 are the B fragments of n rows 0-7 and 8-15.
LDMATRIX_X4_NK = spatial(2, 1) * spatial(8, 2, ranks=(1, 0))


def wgmma_m64_c(n: int):
    """Accumulator of wgmma m64n{n}k16 over the 128 threads of a warpgroup: warp w owns rows
    16w..16w+15, and within them each n8 column block is laid out like MMA_M16N8K16_C
    (register 4j + k holds block j's k-th element)."""
    return spatial(4, 1) * repeat(1, n // 8) * MMA_M16N8K16_C
