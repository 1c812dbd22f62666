"""RNN, GRU and LSTM, unrolled over their (static) sequence length into matmuls and
elementwise gates -- what the compiled graph fuses well for the short sequences these ops
see in inference models.

The input projection of every step is one matmul over the whole sequence; each step adds the
recurrent matmul, the gates (with `clip` and the named activations) and, with
`sequence_lens`, masks: past a sequence's end its state stops changing and its outputs are
zero (a reverse direction reverses each sequence within its length).
"""

from __future__ import annotations

import numpy as np

from tessera.errors import UnsupportedError
from tessera.frontend.onnx.importer import rule
from tessera.graph import Tensor

_COMMON = ("activation_alpha", "activation_beta", "activations", "clip", "direction", "hidden_size", "layout")


class _Activations:
    """The activation functions by name, with their alpha/beta taken in order from the lists."""

    def __init__(self, im, names: list[bytes], alphas: list[float], betas: list[float]):
        self.im, self.names = im, [n.decode() if isinstance(n, bytes) else n for n in names]
        self.alphas, self.betas = list(alphas), list(betas)

    def fn(self, k: int):
        name = self.names[k]
        needs_alpha = name in ("Affine", "LeakyRelu", "ThresholdedRelu", "ScaledTanh", "HardSigmoid", "Elu")
        needs_beta = name in ("Affine", "ScaledTanh", "HardSigmoid")
        alpha = self.alphas.pop(0) if needs_alpha and self.alphas else None
        beta = self.betas.pop(0) if needs_beta and self.betas else None
        im = self.im

        def apply(x: Tensor) -> Tensor:
            def s(v):
                return im.scalar(v, x)

            if name == "Tanh":
                return im.op("tanh", x)
            if name == "Sigmoid":
                return im.op("sigmoid", x)
            if name == "Relu":
                return im.op("relu", x)
            if name == "Affine":
                return im.op("add", im.op("mul", x, s(alpha)), s(beta))
            if name == "LeakyRelu":
                return im.op("leaky_relu", x, negative_slope=0.01 if alpha is None else alpha)
            if name == "ThresholdedRelu":
                return im.op("where", im.op("gt", x, s(1.0 if alpha is None else alpha)), x, s(0.0))
            if name == "ScaledTanh":
                return im.op("mul", im.op("tanh", im.op("mul", x, s(beta))), s(alpha))
            if name == "HardSigmoid":
                a, b = (0.2 if alpha is None else alpha), (0.5 if beta is None else beta)
                return im.op("clamp", im.op("add", im.op("mul", x, s(a)), s(b)), min=0.0, max=1.0)
            if name == "Elu":
                return im.op("elu", x, alpha=1.0 if alpha is None else alpha)
            if name == "Softsign":
                return im.op("div", x, im.op("add", im.op("abs", x), s(1.0)))
            if name == "Softplus":
                return im.op("softplus", x)
            raise UnsupportedError(f"attribute activations={self.names} names {name!r}, which is not supported")

        return apply


def _split(im, t: Tensor, parts: int, axis: int) -> list[Tensor]:
    n = t.shape[axis] // parts
    return im.op_multi("split", t, axis=axis, sizes=[n] * parts)


def _opt(args, k):
    return args[k] if len(args) > k and args[k] is not None else None


def _recurrent(im, node, args, attrs, gates: int, default_acts: list[str], step):
    """The shared frame: layouts, directions, biases, initial states, sequence_lens, outputs.
    `step(x_proj, states, r, rb, acts, p) -> new states` runs one time step of one direction."""
    x, w, r = im.tensor(args[0]), im.tensor(args[1]), im.tensor(args[2])
    layout = int(attrs.get("layout", 0))
    if layout:
        x = im.op("permute", x, perm=[1, 0, 2])  # [seq, batch, input]
    steps, batch = x.shape[0], x.shape[1]
    if not isinstance(steps, int):
        raise UnsupportedError("a symbolic sequence length (tessera unrolls recurrences)")
    hidden = int(attrs.get("hidden_size", r.shape[-1]))
    direction = attrs.get("direction", b"forward").decode()
    dirs = 2 if direction == "bidirectional" else 1
    b = _opt(args, 3)
    lens = _opt(args, 4)
    n_states = 2 if node.op_type == "LSTM" else 1
    inits = [_opt(args, 5), _opt(args, 6) if n_states == 2 else None][:n_states]
    p = _opt(args, 7) if node.op_type == "LSTM" else None
    names = list(attrs.get("activations", [a.encode() for a in default_acts] * dirs))
    acts = _Activations(im, names, list(attrs.get("activation_alpha", [])), list(attrs.get("activation_beta", [])))
    per_dir = len(default_acts)
    clip = attrs.get("clip")
    mask = None
    if lens is not None:  # [seq, batch, 1]: step t of sequence b is inside it
        t = im.op("reshape", im.op("arange", start=0, end=steps, step=1, dtype="int64"), shape=[steps, 1, 1])
        mask = im.op("lt", t, im.op("reshape", im.op("cast", lens, dtype="int64"), shape=[1, -1, 1]))
    ys, finals = [], [[] for _ in range(n_states)]
    for d in range(dirs):
        reverse = direction == "reverse" or d == 1
        wd, rd = _take(im, w, d), _take(im, r, d)
        bias = _take(im, b, d) if b is not None else Tensor.constant(np.zeros(2 * gates * hidden), w.dtype.name)
        wb, rb = _split(im, bias, 2, 0)
        xd = _reverse(im, x, lens, steps) if reverse else x
        proj = im.op("add", im.op("matmul", xd, im.op("permute", wd, perm=[1, 0])), wb)  # [seq, batch, G*hidden]
        states = [_take(im, s, d) if s is not None else im.op("full", shape=[batch, hidden], value=0.0,
                                                              dtype=x.dtype.name) for s in inits]  # fmt: skip
        fns = [acts.fn(d * per_dir + k) for k in range(per_dir)]
        pd = _take(im, p, d) if p is not None else None
        outs = []
        for t in range(steps):
            xt = im.op("squeeze", im.op("slice", proj, axes=[0], starts=[t], ends=[t + 1], steps=[1]), axes=[0])
            new = step(xt, states, rd, rb, fns, pd, clip)
            if mask is not None:
                m = im.op("squeeze", im.op("slice", mask, axes=[0], starts=[t], ends=[t + 1], steps=[1]), axes=[0])
                outs.append(im.op("where", m, new[0], im.scalar(0.0, new[0])))
                new = [im.op("where", m, a, s) for a, s in zip(new, states)]
            else:
                outs.append(new[0])
            states = new
        y = im.op("concat", *[im.op("unsqueeze", o, axes=[0]) for o in outs], axis=0)  # [seq, batch, hidden]
        ys.append(_reverse(im, y, lens, steps) if reverse else y)
        for k in range(n_states):
            finals[k].append(im.op("unsqueeze", states[k], axes=[0]))
    y = im.op("concat", *[im.op("unsqueeze", v, axes=[1]) for v in ys], axis=1)  # [seq, dirs, batch, hidden]
    hs = [im.op("concat", *f, axis=0) if len(f) > 1 else f[0] for f in finals]  # [dirs, batch, hidden]
    if layout:
        y = im.op("permute", y, perm=[2, 0, 1, 3])
        hs = [im.op("permute", h, perm=[1, 0, 2]) for h in hs]
    return [y, *hs]


def _take(im, t: Tensor, d: int) -> Tensor:
    t = im.tensor(t)
    return im.op("squeeze", im.op("slice", t, axes=[0], starts=[d], ends=[d + 1], steps=[1]), axes=[0])


def _reverse(im, x: Tensor, lens, steps: int) -> Tensor:
    """x [seq, batch, ...] reversed in time, within each sequence's length when lens is given."""
    if lens is None:
        return im.op("flip", x, axes=[0])
    t = im.op("reshape", im.op("arange", start=0, end=steps, step=1, dtype="int64"), shape=[steps, 1, 1])
    n = im.op("reshape", im.op("cast", lens, dtype="int64"), shape=[1, -1, 1])
    src = im.op("where", im.op("lt", t, n), im.op("sub", im.op("sub", n, im.scalar(1, n)), t), t)
    return im.op("gather_elements", x, im.op("expand", src, shape=list(x.shape)), axis=0)


def _clip(im, x: Tensor, clip) -> Tensor:
    return x if clip is None else im.op("clamp", x, min=-float(clip), max=float(clip))


def _recur(im, h: Tensor, r: Tensor) -> Tensor:
    return im.op("matmul", h, im.op("permute", r, perm=[1, 0]))


@rule("RNN", attrs=_COMMON)
def _rnn(im, node, args, attrs):
    def step(xt, states, r, rb, fns, p, clip):
        return [fns[0](_clip(im, im.op("add", im.op("add", xt, _recur(im, states[0], r)), rb), clip))]

    return _recurrent(im, node, args, attrs, 1, ["Tanh"], step)


@rule("GRU", attrs=(*_COMMON, "linear_before_reset"))
def _gru(im, node, args, attrs):
    linear = bool(attrs.get("linear_before_reset", 0))

    def step(xt, states, r, rb, fns, p, clip):
        (h,) = states
        f, g = fns
        x_z, x_r, x_h = _split(im, xt, 3, 1)
        r_z, r_r, r_h = _split(im, r, 3, 0)
        b_z, b_r, b_h = _split(im, rb, 3, 0)
        z = f(_clip(im, im.op("add", im.op("add", x_z, _recur(im, h, r_z)), b_z), clip))
        rt = f(_clip(im, im.op("add", im.op("add", x_r, _recur(im, h, r_r)), b_r), clip))
        if linear:
            cand = im.op("add", x_h, im.op("mul", rt, im.op("add", _recur(im, h, r_h), b_h)))
        else:
            cand = im.op("add", im.op("add", x_h, _recur(im, im.op("mul", rt, h), r_h)), b_h)
        ht = g(_clip(im, cand, clip))
        one = im.scalar(1.0, z)
        return [im.op("add", im.op("mul", im.op("sub", one, z), ht), im.op("mul", z, h))]

    return _recurrent(im, node, args, attrs, 3, ["Sigmoid", "Tanh"], step)


@rule("LSTM", attrs=(*_COMMON, "input_forget"))
def _lstm(im, node, args, attrs):
    coupled = bool(attrs.get("input_forget", 0))

    def step(xt, states, r, rb, fns, p, clip):
        h, c = states
        f, g, hf = fns
        gates = im.op("add", im.op("add", xt, _recur(im, h, r)), rb)
        i, o, fg, cand = _split(im, gates, 4, 1)
        pi, po, pf = _split(im, p, 3, 0) if p is not None else (None, None, None)

        def peep(v, pv, cell):
            return v if pv is None else im.op("add", v, im.op("mul", pv, cell))

        it = f(_clip(im, peep(i, pi, c), clip))
        ft = im.op("sub", im.scalar(1.0, it), it) if coupled else f(_clip(im, peep(fg, pf, c), clip))
        ct = im.op("add", im.op("mul", ft, c), im.op("mul", it, g(_clip(im, cand, clip))))
        ot = f(_clip(im, peep(o, po, ct), clip))
        return [im.op("mul", ot, hf(ct)), ct]

    return _recurrent(im, node, args, attrs, 4, ["Sigmoid", "Tanh", "Tanh"], step)
