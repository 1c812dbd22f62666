"""TMA im2col mode: `ts.tensor_map_im2col`, `ts.tma_load_im2col` and `TensorMap.im2col_from_pointer`.

The CPU tier checks the front end's rules, the generated PTX and an nvcc build; the GPU tier
loads windows of a random NHWC tensor and compares them with the documented traversal (the
pixels of the window from the start coordinates shifted by the offsets, W fastest, wrapping
to the next row and image; zeros outside the tensor), written here in numpy."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import tessera as ts
from tessera import f16, u64
from tessera.errors import ArgumentError, KernelSyntaxError
from tessera.ir.types import tensor_map_im2col
from tessera.runtime.tensor_map import Im2colWindow

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


def make_im2col_copy(pixels: int, channels: int):
    """One block: one im2col load of `pixels` x `channels` into shared memory, copied out to Y."""

    @ts.kernel(target="cuda")
    def im2col_copy(X: f16["N", "H", "W", "C"], Y: f16[pixels, channels],
                    tx: ts.tensor_map_im2col(f16, pixels, channels, 4, swizzle=0), n: ts.int32, h: ts.int32,
                    w: ts.int32, c: ts.int32, dh: ts.int32, dw: ts.int32):  # fmt: skip
        ts.attrs.grid = 1
        ts.attrs.block = 128
        tile = ts.shared_tensor(f16, [pixels, channels])
        bar = ts.shared_tensor(u64, [1])
        tid = ts.thread_idx.x
        if tid == 0:
            ts.mbarrier_init(bar[0], 1)
            ts.fence_mbarrier_init()
        ts.syncthreads()
        if tid == 0:
            ts.mbarrier_arrive_expect_tx(bar[0], pixels * channels * 2)
            ts.tma_load_im2col(tile[0, 0], tx, bar[0], n, h, w, c, dh, dw)
        ts.mbarrier_wait(bar[0], 0)
        for i in range(tid, pixels * channels, 128):
            Y[i // channels, i % channels] = tile[i // channels, i % channels]

    return im2col_copy


def reference(x: np.ndarray, window: Im2colWindow, start: tuple[int, int, int, int], offsets: tuple[int, int],
              pixels: int, channels: int) -> np.ndarray:  # fmt: skip
    """The documented traversal: from (n, h + dh, w + dw), W fastest in steps of the window's
    stride, wrapping to the window's first column (and row, and the next image)."""
    n_img, h_dim, w_dim, c_dim = x.shape
    (lo_h, lo_w), (up_h, up_w), (sh, sw) = window.lower, window.upper, window.strides
    dh, dw = offsets
    n, h, w, c0 = start[0], start[1] + dh, start[2] + dw, start[3]
    out = np.zeros((pixels, channels), np.float32)
    for p in range(pixels):
        if 0 <= n < n_img and 0 <= h < h_dim and 0 <= w < w_dim:
            for j in range(channels):
                if 0 <= c0 + j < c_dim:
                    out[p, j] = x[n, h, w, c0 + j]
        w += sw
        if w > w_dim - 1 + up_w + dw:
            w = lo_w + dw
            h += sh
            if h > h_dim - 1 + up_h + dh:
                h = lo_h + dh
                n += 1
    return out


def test_im2col_maps_are_typed_and_checked():
    t = tensor_map_im2col(f16, 128, 64)
    assert t.rank == 4 and t.box == (128, 64) and t.box_bytes == 128 * 64 * 2 and "im2col" in str(t)
    with pytest.raises(TypeError, match="rank 3, 4 or 5"):
        tensor_map_im2col(f16, 128, 64, rank=2)
    with pytest.raises(KernelSyntaxError, match="tma_load_im2col"):

        @ts.kernel(target="cuda")
        def wrong_map(X: f16["N", "C"], tx: ts.tensor_map(f16, (64, 64))):
            s = ts.shared_tensor(f16, [64, 64])
            bar = ts.shared_tensor(u64, [1])
            ts.tma_load_im2col(s[0, 0], tx, bar[0], 0, 0, 0, 0, 0, 0)

    with pytest.raises(KernelSyntaxError, match="4 coordinates and 2"):

        @ts.kernel(target="cuda")
        def too_few(X: f16["N", "C"], tx: ts.tensor_map_im2col(f16, 64, 64)):
            s = ts.shared_tensor(f16, [64, 64])
            bar = ts.shared_tensor(u64, [1])
            ts.tma_load_im2col(s[0, 0], tx, bar[0], 0, 0, 0, 0, 0)

    with pytest.raises(KernelSyntaxError, match="tma_load reads tiled maps"):

        @ts.kernel(target="cuda")
        def tiled_load(X: f16["N", "C"], tx: ts.tensor_map_im2col(f16, 64, 64)):
            s = ts.shared_tensor(f16, [64, 64])
            bar = ts.shared_tensor(u64, [1])
            ts.tma_load(s[0, 0], tx, bar[0], 0, 0, 0, 0)


def test_convolution_window():
    # 3x3, stride 2, pads (1, 1) top/left on 14 x 15 -> 7 x 7 outputs: origins -1, 1, .. 11
    win = Im2colWindow.convolution((14, 15), (2, 2), (1, 1), (7, 7))
    assert win == Im2colWindow((-1, -1), (11 - 13, 11 - 14), (2, 2))


def test_im2col_encoding_rejects_bad_windows():
    with pytest.raises(ArgumentError, match="needs 2 lower corners"):
        from tessera.runtime.tensor_map import TensorMap

        TensorMap.im2col_from_pointer(0x1000, f16, (1, 8, 8, 64), Im2colWindow((0,), (0,), (1,)), 64, 64)
    with pytest.raises(ArgumentError, match="strides must be 1..8"):
        TensorMap.im2col_from_pointer(0x1000, f16, (1, 8, 8, 64), Im2colWindow((0, 0), (0, 0), (9, 1)), 64, 64)
    with pytest.raises(ArgumentError, match="range TMA encodes"):
        TensorMap.im2col_from_pointer(0x1000, f16, (1, 8, 8, 64), Im2colWindow((0, -200), (0, 0), (1, 1)), 64, 64)
    with pytest.raises(ArgumentError, match="16-byte"):
        TensorMap.im2col_from_pointer(0x1000, f16, (1, 8, 8, 3), Im2colWindow((0, 0), (0, 0), (1, 1)), 64, 8)


@needs_nvcc
def test_im2col_copy_builds_with_nvcc():
    k = make_im2col_copy(32, 16)
    src = k.source
    assert "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes" in src
    assert '"h"((unsigned short)' in src  # the window offsets are 16-bit operands
    k.build()


CASES = [
    # x shape, window (lower, upper, strides), start (n, h, w, c), offsets (dh, dw), pixels, channels
    ((1, 4, 4, 8), ((0, 0), (0, 0), (1, 1)), (0, 0, 0, 0), (0, 0), 16, 8),  # the whole image in order
    ((1, 4, 4, 8), ((-1, -1), (-1, -1), (1, 1)), (0, -1, -1, 0), (0, 0), 16, 8),  # padding reads zeros
    ((2, 5, 6, 16), ((-1, -1), (-1, -1), (1, 1)), (0, 3, 2, 0), (1, 2), 32, 16),  # a tap offset, across images
    ((2, 9, 7, 24), ((-1, -1), (-2, -1), (2, 2)), (0, 1, 3, 8), (2, 0), 32, 8),  # stride 2, into image 1
    ((3, 5, 5, 72), ((0, 0), (-1, -1), (2, 2)), (1, 2, 0, 64), (0, 0), 16, 16),  # channels past the end
]


@pytest.mark.cuda
@pytest.mark.parametrize("shape,window,start,offsets,pixels,channels", CASES)
def test_im2col_loads_follow_the_window(shape, window, start, offsets, pixels, channels):
    torch = pytest.importorskip("torch")
    from tessera.runtime.tensor_map import TensorMap

    win = Im2colWindow(*window)
    kernel = make_im2col_copy(pixels, channels)
    for seed in range(2):  # two inputs through the same kernel and map shape
        x = torch.randn(shape, device="cuda", dtype=torch.float16, generator=torch.Generator("cuda").manual_seed(seed))
        y = torch.full((pixels, channels), float("nan"), device="cuda", dtype=torch.float16)
        tx = TensorMap.im2col_from_pointer(x.data_ptr(), f16, shape, win, pixels, channels, swizzle=0)
        kernel(x, y, tx, *start, *offsets)
        torch.cuda.synchronize()
        ref = reference(x.float().cpu().numpy(), win, start, offsets, pixels, channels)
        np.testing.assert_array_equal(y.float().cpu().numpy(), ref)
