"""The x86 GEMM kernels (tessera.templates.cpu.gemm_kernel) against numpy in float64, odd sizes and tails."""

import numpy as np
import pytest

from tessera.backend.isa import supports_lanes
from tessera.errors import ArgumentError
from tessera.templates.cpu.gemm_kernel import CpuGemmConfig, make_gemm, make_pack_b

CONFIGS = [c for c in (CpuGemmConfig(6, 2, 16, 2), CpuGemmConfig(5, 1, 16, 3), CpuGemmConfig(4, 2, 8, 2))
           if supports_lanes(c.lanes)]  # fmt: skip
SHAPES = [(1, 1, 1, 1), (2, 7, 33, 5), (1, 13, 64, 17), (3, 6, 31, 40), (1, 1, 97, 3)]


def _run(cfg, src, a, b, rc, full_rows=False, panel_major=False):
    batch, m, k = a.shape
    n = b.shape[2]
    c = np.full((batch, m, n), np.nan, np.float32)
    if src == "packed":
        p = np.full((batch, -(-n // cfg.nr), k, cfg.nr), np.nan, np.float32)
        make_pack_b(cfg.nr, "kn")(b, p)
        make_gemm(cfg, src, full_rows, panel_major)(a, p, c, rc)
    else:
        w = np.full((cfg.threads, k * cfg.nr), np.nan, np.float32)
        operand = b if src == "kn" else np.ascontiguousarray(b.transpose(0, 2, 1))
        make_gemm(cfg, src, full_rows, panel_major)(a, operand, c, w, rc)
    return c


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("src", ["kn", "nk", "packed"])
@pytest.mark.slow
def test_gemm_matches_numpy(cfg, src):
    rng = np.random.default_rng(0)
    for batch, m, n, k in SHAPES:
        for rc in (1, 3):
            a = rng.standard_normal((batch, m, k)).astype(np.float32)
            b = rng.standard_normal((batch, k, n)).astype(np.float32)
            got = _run(cfg, src, a, b, rc)
            np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("src", ["kn", "packed"])
@pytest.mark.slow
def test_full_rows_shifts_the_last_row_tile(cfg, src):
    """With full_rows (M >= MR) the last row tile ends at row M: M = MR, a multiple of MR and
    ragged M, over several row chunks (chunks meet inside the shifted tile's rows)."""
    rng = np.random.default_rng(2)
    for batch, m, n, k in [(1, cfg.mr, 5, 3), (2, 3 * cfg.mr, 33, 17), (3, 2 * cfg.mr + 1, 7, 40), (1, 5 * cfg.mr - 1, 1, 9)]:
        for rc in (1, 2, 5):
            a = rng.standard_normal((batch, m, k)).astype(np.float32)
            b = rng.standard_normal((batch, k, n)).astype(np.float32)
            got = _run(cfg, src, a, b, rc, full_rows=True)
            np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
@pytest.mark.parametrize("src", ["kn", "nk", "packed"])
@pytest.mark.slow
def test_panel_major_work_order(cfg, src):
    """Work units ordered column panel first cover every tile once: several batches and
    panels, ragged rows and columns, with and without full_rows, several row chunks."""
    rng = np.random.default_rng(3)
    for batch, m, n, k in [(3, cfg.mr + 2, 2 * cfg.nr + 3, 11), (1, 1, 5, 7), (4, 2 * cfg.mr, cfg.nr, 5)]:
        for rc in (1, 3):
            a = rng.standard_normal((batch, m, k)).astype(np.float32)
            b = rng.standard_normal((batch, k, n)).astype(np.float32)
            got = _run(cfg, src, a, b, rc, full_rows=m >= cfg.mr, panel_major=True)
            np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4 * np.sqrt(k))


@pytest.mark.slow
def test_pack_nk_matches_transpose():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 37, 9)).astype(np.float32)  # [batch, N, K]
    p = np.full((2, 2, 9, 32), np.nan, np.float32)
    make_pack_b(32, "nk")(w, p)
    padded = np.zeros((2, 64, 9), np.float32)
    padded[:, :37] = w
    np.testing.assert_array_equal(p, padded.reshape(2, 2, 32, 9).transpose(0, 1, 3, 2))


def test_config_checks_registers():
    with pytest.raises(ArgumentError, match="vector registers"):
        CpuGemmConfig(16, 2, 16, 1)
    with pytest.raises(ArgumentError, match="lanes"):
        CpuGemmConfig(4, 1, 4, 1)
    with pytest.raises(ArgumentError, match="b_source"):
        make_gemm(CpuGemmConfig(4, 1, 8, 1), "mn")


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.slow
def test_pad2d_matches_numpy(threads):
    """Zero padding for the CPU conv: asymmetric and zero margins, size-1 dims, more workers than
    rows; the output starts as NaN, so every element must be written; fresh inputs per call."""
    from tessera.templates.cpu.pad_kernel import make_pad2d

    rng = np.random.default_rng(4)
    for nc, h, w, (top, left, bottom, right) in [(6, 5, 7, (1, 2, 0, 3)), (1, 1, 1, (3, 3, 3, 3)), (2, 4, 9, (0, 0, 2, 1)),
                                                 (3, 2, 1, (1, 0, 0, 0))]:  # fmt: skip
        for _ in range(2):
            x = rng.standard_normal((nc, h, w)).astype(np.float32)
            p = np.full((nc, h + top + bottom, w + left + right), np.nan, np.float32)
            make_pad2d(top, left, threads)(x, p)
            np.testing.assert_array_equal(p, np.pad(x, ((0, 0), (top, bottom), (left, right))))
    with pytest.raises(ArgumentError, match="top and left"):
        make_pad2d(-1, 0, 1)
