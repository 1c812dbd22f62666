"""Window geometry: the one reading of kernel/stride/dilation pairs, paddings and sliding-window
output sizes, shared by every layer that convolves or pools.

Convolution and pooling take their geometry in several spellings: an int for both spatial axes,
an (h, w) pair, torch's symmetric padding (h, w), ONNX's (top, left, bottom, right).  The ops
library (`ops/nn.py`), graph shape inference and lowering (`graph/opdefs/nn.py`,
`graph/lowering/nn.py`), the kernel templates (`templates/conv`, `templates/cpu`) and the front
ends normalise them here, so they accept the same values and agree on every output size.

- `pair(value, what, op)`: (h, w) from an int or a sequence of one or two ints.
- `pads(padding, op)`: (top, left, bottom, right) from 1, 2 or 4 ints.
- `window_output(size, kernel, stride, pad_before, pad_after, dilation, ceil_mode)`: how many
  windows slide along one axis, torch's rule, for an int size or a symbolic one (`Sym`).
- `window_span`, `window_fits`, `check_window`: a window's extent and whether the padded input
  holds one.

Bad values raise `ArgumentError` naming the operator (`op`) and the argument (`what`); callers
that report problems as another error type pass `error=` (graph shape inference raises
`ShapeError`, and passes op="" because `Operator.create` already puts the op's name in front).
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import overload

from tessera.errors import ArgumentError, TesseraError
from tessera.ir.symbolic import Dim, floordiv, sym_min

__all__ = ["check_window", "pads", "pair", "window_fits", "window_output", "window_span"]


def _prefix(op: str) -> str:
    return f"{op}: " if op else ""


def _is_int(value: object) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _ints(value: object) -> tuple[object, ...] | None:
    """The entries of a sequence (a list, a tuple, a 1-D array), None for anything else."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return None
    try:
        return tuple(value)
    except TypeError:
        return None


def pair(value: int | Iterable[int], what: str, op: str, *,
         error: type[TesseraError] = ArgumentError) -> tuple[int, int]:  # fmt: skip
    """(h, w) from an int (both axes) or a sequence of one or two ints (kernel, stride, dilation,
    symmetric padding, an output size).

    Bools, floats and other lengths raise `error` (ArgumentError) saying "{op}: {what} must be an
    int or a pair of ints"; an empty `op` leaves the prefix off."""
    if _is_int(value):
        v = int(value)  # type: ignore[call-overload]
        return v, v
    vals = _ints(value)
    if vals is None or len(vals) not in (1, 2) or not all(_is_int(x) for x in vals):
        raise error(f"{_prefix(op)}{what} must be an int or a pair of ints, got {value!r}")
    h, w = (vals[0], vals[0]) if len(vals) == 1 else vals
    return int(h), int(w)  # type: ignore[call-overload]


def pads(padding: int | Iterable[int], op: str, *, allow_negative: bool = False,
         error: type[TesseraError] = ArgumentError) -> tuple[int, int, int, int]:  # fmt: skip
    """(top, left, bottom, right) from one int (every side), two ((h, w): top = bottom = h, left =
    right = w, torch's symmetric padding) or four (ONNX's begins then ends).

    The entries must be non-negative ints (`allow_negative`: any ints, for the graph, whose
    ONNX pooling crops with negative pads); otherwise `error` (ArgumentError), prefixed "{op}: "."""
    vals = _ints(padding)
    if vals is None:  # one int for every side (or a bad scalar, reported below)
        vals = (padding,)
    if len(vals) not in (1, 2, 4):
        raise error(f"{_prefix(op)}padding must have 1, 2 or 4 entries, got {padding!r}")
    if not all(_is_int(x) and (allow_negative or x >= 0) for x in vals):  # type: ignore[operator]
        kind = "ints" if allow_negative else "non-negative ints"
        raise error(f"{_prefix(op)}padding must be {kind} (top, left, bottom, right), got {padding!r}")
    p = [int(x) for x in vals]  # type: ignore[call-overload]
    if len(p) == 1:
        return p[0], p[0], p[0], p[0]
    if len(p) == 2:
        return p[0], p[1], p[0], p[1]
    return p[0], p[1], p[2], p[3]


def window_span(kernel: int, dilation: int = 1) -> int:
    """The input elements a window of `kernel` taps, `dilation` apart, spans: d * (k - 1) + 1."""
    return dilation * (kernel - 1) + 1


@overload
def window_output(size: int, kernel: int, stride: int = 1, pad_before: int = 0, pad_after: int = 0,
                  dilation: int = 1, ceil_mode: bool = False) -> int: ...  # fmt: skip
@overload
def window_output(size: Dim, kernel: int, stride: int = 1, pad_before: int = 0, pad_after: int = 0,
                  dilation: int = 1, ceil_mode: bool = False) -> Dim: ...  # fmt: skip
def window_output(size: Dim, kernel: int, stride: int = 1, pad_before: int = 0, pad_after: int = 0,
                  dilation: int = 1, ceil_mode: bool = False) -> Dim:  # fmt: skip
    """How many windows slide along an axis of `size` elements padded by (pad_before, pad_after):
    torch's (and ONNX's) output size.

    floor((size + pad_before + pad_after - span) / stride) + 1 windows, span = window_span(kernel,
    dilation); ceil_mode rounds the division up but keeps only windows that start inside the
    input or its left padding (a last window starting in the right padding is dropped), i.e. at
    most floor((size + pad_before - 1) / stride) + 1 of them.

    `size` is an int or a symbolic size (`tessera.ir.symbolic.Dim`), giving an int or the
    canonical symbolic expression.  The result is 0 or less (floor mode) when the padded input is
    shorter than one window: callers check `window_fits` or the result, with their own message.
    kernel, stride and dilation are at least 1."""
    out = floordiv(size + pad_before + pad_after - window_span(kernel, dilation) + (stride - 1 if ceil_mode else 0),
                   stride) + 1  # fmt: skip
    if ceil_mode:
        out = sym_min(out, floordiv(size + pad_before - 1, stride) + 1)
    return out


def window_fits(size: int, kernel: int, pad_before: int = 0, pad_after: int = 0, dilation: int = 1) -> bool:
    """Whether the padded input (an int size) holds at least one whole window."""
    return size + pad_before + pad_after >= window_span(kernel, dilation)


def check_window(size: Dim, kernel: int, pad_before: int, pad_after: int, dilation: int, op: str, *,
                 error: type[TesseraError] = ArgumentError) -> None:  # fmt: skip
    """Raise `error` (ArgumentError), prefixed "{op}: ", when a static `size` padded by
    (pad_before, pad_after) is shorter than one window; a symbolic size (or kernel) is not checked."""
    if isinstance(size, int) and isinstance(kernel, int) and not window_fits(size, kernel, pad_before, pad_after, dilation):
        raise error(f"{_prefix(op)}the window ({window_span(kernel, dilation)}: kernel {kernel}, dilation {dilation}) "
                    f"does not fit the padded input ({size + pad_before + pad_after}: size {size}, padding "
                    f"{pad_before}+{pad_after})")  # fmt: skip
