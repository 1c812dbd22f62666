"""tessera.ops.geometry: pairs, paddings and sliding-window output sizes, against torch's formula
written out by hand (and torch's own pooling shapes where torch is installed), and the errors
every layer that uses them reports."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tessera import ops
from tessera.errors import ArgumentError, ShapeError
from tessera.graph import Operator, Tensor
from tessera.ir.symbolic import Sym, evaluate_dim
from tessera.ops.geometry import check_window, pads, pair, window_fits, window_output, window_span
from tessera.templates.conv.plan import conv_geometry


def torch_output_size(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """ATen's pooling_output_shape (symmetric padding p): div_rtn, then one step back when the
    last ceil-mode window would start in the right padding."""
    num = size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)
    out = int(np.floor(num / s)) + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def counted_windows(size: int, k: int, s: int, before: int, after: int, d: int, ceil_mode: bool) -> int:
    """Windows counted one by one: a floor-mode window lies inside the padded input; a ceil-mode
    window may hang over its end by less than a stride but must start inside the input or the
    left padding."""
    padded, span, n = size + before + after, d * (k - 1) + 1, 0
    while True:
        start = n * s
        if ceil_mode:
            counted = start + span - s < padded and start < size + before
        else:
            counted = start + span <= padded
        if not counted:
            return n
        n += 1


# ---- pair -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,expected", [(3, (3, 3)), (np.int64(2), (2, 2)), ([5], (5, 5)), ((1, 4), (1, 4)),
                                            ([np.int32(7), 0], (7, 0)), (np.array([2, 3]), (2, 3))])  # fmt: skip
def test_pair_reads_ints_and_one_or_two_entries(value, expected):
    got = pair(value, "stride", "conv2d")
    assert got == expected and all(type(v) is int for v in got)


@pytest.mark.parametrize("value", [True, [1, False], 2.0, [1.0, 2], (1, 2, 3), (), "22", None, [[1, 2]]])
def test_pair_refuses_bools_floats_and_other_lengths(value):
    with pytest.raises(ArgumentError, match=r"^max_pool2d: kernel_size must be an int or a pair of ints, got"):
        pair(value, "kernel_size", "max_pool2d")


def test_pair_error_type_and_prefix_are_the_callers():
    with pytest.raises(ShapeError, match=r"^dilation must be an int or a pair of ints, got \(1, 2, 3\)$"):
        pair((1, 2, 3), "dilation", "", error=ShapeError)


# ---- pads -----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,expected", [(0, (0, 0, 0, 0)), (2, (2, 2, 2, 2)), ([3], (3, 3, 3, 3)),
                                            ((1, 2), (1, 2, 1, 2)), ([1, 2, 3, 4], (1, 2, 3, 4)),
                                            (np.array([0, 1, 2, 3]), (0, 1, 2, 3)), (np.int64(1), (1, 1, 1, 1))])  # fmt: skip
def test_pads_from_one_two_or_four_ints(value, expected):
    got = pads(value, "conv2d")
    assert got == expected and all(type(v) is int for v in got)


@pytest.mark.parametrize("value", [(1, 2, 3), (), (1, 2, 3, 4, 5)])
def test_pads_refuses_other_lengths(value):
    with pytest.raises(ArgumentError, match=r"^conv2d: padding must have 1, 2 or 4 entries, got"):
        pads(value, "conv2d")


@pytest.mark.parametrize("value", [-1, (0, -1), (0, 0, 0, -2), True, (1, 2.0), (1, None), None, "1", 1.0, [[1, 2]]])
def test_pads_refuses_negative_or_non_int_entries(value):
    with pytest.raises(ArgumentError, match=r"^conv2d: padding must be non-negative ints \(top, left, bottom, right\)"):
        pads(value, "conv2d")


def test_pads_may_allow_negative_entries_and_raise_another_error():
    assert pads((1, -1, 0, -2), "", allow_negative=True) == (1, -1, 0, -2)
    with pytest.raises(ShapeError, match=r"^padding must be ints"):
        pads((1, 0.5), "", allow_negative=True, error=ShapeError)


# ---- window output sizes --------------------------------------------------------------------------------------------
SIZES = (1, 2, 3, 5, 7, 8, 11, 13, 16, 17, 31)


def test_window_output_is_torchs_formula():
    """Every geometry torch's pooling takes (padding at most half the kernel) on odd and even sizes."""
    checked = 0
    for size, k, s, d, ceil_mode in itertools.product(SIZES, range(1, 6), range(1, 5), range(1, 4), (False, True)):
        for p in range(0, k // 2 + 1):
            if not window_fits(size, k, p, p, d):
                continue
            out = window_output(size, k, s, p, p, d, ceil_mode)
            assert out == torch_output_size(size, k, s, p, d, ceil_mode), (size, k, s, p, d, ceil_mode)
            assert out == counted_windows(size, k, s, p, p, d, ceil_mode)
            assert out >= 1 and (out - 1) * s < size + p  # the last window starts inside the input or left padding
            checked += 1
    assert checked > 1000


@pytest.mark.parametrize("size,k,s,p,floor_out,ceil_out", [
    (5, 2, 2, 0, 2, 3),   # ceil mode adds the window over the last element
    (6, 2, 2, 0, 3, 3),   # exact: both modes agree
    (4, 2, 3, 1, 2, 2),   # ceil's extra window would start in the right padding: dropped
    (7, 3, 2, 1, 4, 4),
    (8, 3, 2, 1, 4, 5),
    (1, 1, 2, 0, 1, 1),
    (13, 5, 4, 2, 4, 4),
    (11, 3, 3, 1, 4, 4),
    (10, 3, 3, 0, 3, 4),
    (10, 3, 3, 1, 4, 4),
])  # fmt: skip
def test_ceil_mode_edge_cases(size, k, s, p, floor_out, ceil_out):
    assert window_output(size, k, s, p, p, 1, False) == floor_out
    assert window_output(size, k, s, p, p, 1, True) == ceil_out
    assert (floor_out, ceil_out) == (torch_output_size(size, k, s, p, 1, False), torch_output_size(size, k, s, p, 1, True))


def test_window_output_with_asymmetric_padding():
    """ONNX's pads: each window counted by hand; ceil-mode windows never start in the right padding."""
    for size, k, s, d, ceil_mode in itertools.product((1, 3, 6, 9, 14), range(1, 5), range(1, 4), (1, 2), (False, True)):
        for before, after in itertools.product(range(4), range(6)):
            if window_fits(size, k, before, after, d):
                got = window_output(size, k, s, before, after, d, ceil_mode)
                assert got == counted_windows(size, k, s, before, after, d, ceil_mode), (size, k, s, before, after, d)


def test_window_output_when_the_window_does_not_fit():
    assert not window_fits(2, 5) and window_fits(2, 5, 1, 2) and not window_fits(3, 3, 0, 0, 2)
    assert window_span(3, 2) == 5 and window_span(1, 4) == 1
    assert window_output(2, 5) <= 0 and window_output(3, 3, 1, 0, 0, 2) <= 0
    with pytest.raises(ArgumentError, match=r"^avg_pool2d: the window \(5: kernel 3, dilation 2\) does not fit the "
                                            r"padded input \(4: size 2, padding 1\+1\)"):  # fmt: skip
        check_window(2, 3, 1, 1, 2, "avg_pool2d")
    with pytest.raises(ShapeError, match=r"^the window"):
        check_window(1, 2, 0, 0, 1, "", error=ShapeError)
    check_window(Sym.var("n"), 7, 0, 0, 1, "conv2d")  # a symbolic size is not checked
    check_window(3, 3, 0, 0, 1, "conv2d")


@pytest.mark.parametrize("ceil_mode", [False, True])
@pytest.mark.parametrize("k,s,before,after,d", [(3, 2, 1, 1, 1), (2, 3, 1, 1, 1), (5, 1, 0, 3, 2), (4, 4, 2, 1, 1)])
def test_symbolic_sizes_follow_the_same_rule(k, s, before, after, d, ceil_mode):
    n = Sym.var("n")
    out = window_output(n, k, s, before, after, d, ceil_mode)
    for size in range(1, 40):
        if window_fits(size, k, before, after, d):
            assert evaluate_dim(out, {"n": size}) == window_output(size, k, s, before, after, d, ceil_mode), size


def test_window_output_matches_torch_pooling_shapes():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    for size, k, s, p, d, ceil_mode in [(7, 3, 2, 1, 1, True), (4, 2, 3, 1, 1, True), (13, 5, 3, 2, 2, True),
                                        (9, 4, 3, 2, 1, True), (10, 3, 3, 0, 1, True), (11, 2, 2, 0, 1, False),
                                        (17, 3, 2, 1, 3, False), (5, 5, 1, 2, 1, True)]:  # fmt: skip
        x = torch.zeros(1, 1, size, size + 2)
        y = F.max_pool2d(x, k, s, p, d, ceil_mode=ceil_mode)
        assert y.shape[2:] == (window_output(size, k, s, p, p, d, ceil_mode), window_output(size + 2, k, s, p, p, d, ceil_mode))


# ---- the layers that use it -----------------------------------------------------------------------------------------
def test_graph_shape_inference_reports_shape_errors():
    x, w = Tensor([1, 2, 8, 8], "float32"), Tensor([4, 2, 3, 3], "float32")
    with pytest.raises(ShapeError, match=r"^conv2d: stride must be an int or a pair of ints, got \[1, 2, 3\]$"):
        Operator.create("conv2d", [x, w], {"stride": [1, 2, 3]})
    with pytest.raises(ShapeError, match=r"^conv2d: padding must have 1, 2 or 4 entries, got \[1, 2, 3\]$"):
        Operator.create("conv2d", [x, w], {"padding": [1, 2, 3]})
    with pytest.raises(ShapeError, match=r"^max_pool2d: the window \(9: kernel 9"):
        Operator.create("max_pool2d", [x], {"kernel": [9, 9]})
    op = Operator.create("max_pool2d", [x], {"kernel": 3, "stride": 2, "padding": [1, 1, 0, 0], "ceil_mode": True})
    assert op.outputs[0].shape == (1, 2, 4, 4)
    n = Sym.var("n")
    op = Operator.create("avg_pool2d", [Tensor([1, 2, n, 8], "float32")], {"kernel": [3, 3], "stride": [2, 2],
                                                                           "padding": [1], "ceil_mode": True})  # fmt: skip
    assert evaluate_dim(op.outputs[0].shape[2], {"n": 9}) == torch_output_size(9, 3, 2, 1, 1, True)


def test_ops_and_templates_report_argument_errors():
    x = ops.placeholder((1, 2, 8, 8), "float32", "x")
    w = ops.placeholder((4, 2, 3, 3), "float32", "w")
    with pytest.raises(ArgumentError, match=r"^conv2d: stride must be an int or a pair of ints"):
        ops.conv2d(x, w, stride=(1, 2, 3))
    with pytest.raises(ArgumentError, match=r"^max_pool2d: the window \(9: kernel 9"):
        ops.max_pool2d(x, 9)
    assert [int(d.value) for d in ops.max_pool2d(x, 3, 2, 1, ceil_mode=True).shape[2:]] == [5, 5]
    with pytest.raises(ArgumentError, match=r"^conv2d: padding must be non-negative ints"):
        conv_geometry((8, 8), (3, 3), 1, (1, -1), 1)
    with pytest.raises(ArgumentError, match="output would be empty"):
        conv_geometry((2, 2), (3, 3), 1, 0, 1)
    assert conv_geometry((11, 9), (3, 2), (2, 1), (1, 0, 1, 0), (1, 2)) == dict(oh=6, ow=7, sh=2, sw=1, pt=1, pl=0,
                                                                                 pb=1, pr=0, dh=1, dw=2)  # fmt: skip
