"""tessera.transforms.plan_shared_memory: where each shared tensor starts in the dynamic pool."""

from __future__ import annotations

import tessera as ts
from tessera import f16, u64
from tessera.transforms.plan_shared_memory import pool_layout, shared_buffer_offsets


def test_small_unswizzled_tensors_pack_at_128_bytes_the_rest_at_1024():
    # a barrier array, a swizzled tile, two more barrier arrays, a plain 1 KiB tile
    offsets, total = pool_layout([(32, False), (4096, True), (40, False), (24, False), (1024, False)])
    assert offsets == [0, 1024, 5120, 5248, 6144] and total == 7168
    assert pool_layout([(8, False)]) == ([0], 128)
    assert pool_layout([(100, True), (8, False)]) == ([0, 128], 256)  # a small swizzled tile still starts at 1024


def test_a_kernels_pool_follows_the_layout():
    @ts.kernel(target="cuda")
    def k(X: f16[64]):
        ts.attrs.grid = 1
        ts.attrs.block = 32
        tile = ts.shared_tensor(f16, [256, 64], swizzle=ts.Swizzle(3, 3, 3))
        bars = ts.shared_tensor(u64, [4])
        more = ts.shared_tensor(u64, [4])
        big = ts.shared_tensor(f16, [8, 1024])
        tile[0, 0] = X[0]
        bars[0] = 0
        more[0] = 0
        big[0, 0] = X[0]

    offsets, total = shared_buffer_offsets(k.ir)
    assert sorted(offsets.values()) == [0, 32768, 32896, 33792] and total == 33792 + 16384
