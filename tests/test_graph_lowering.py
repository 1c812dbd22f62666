"""graph.lowering: every registered op kind lowered to tessera.ops compute definitions and built,
against the op's numpy reference (FlowGraph.run); symbolic sizes in shapes and attributes; the
test models' whole graphs; coverage of the registry; the reasons given for what is not lowered."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from tessera import ops
from tessera.graph import GraphBuilder, Operator, Tensor
from tessera.graph.lowering import (
    LOWERINGS,
    NOT_LOWERED,
    LoweringError,
    dim_expr,
    lower_graph,
    lower_operator,
    lowering_error,
)
from tessera.graph.registry import all_ops
from tessera.graph.symbolic import Sym
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.dtypes import numpy_dtype

SIZES = {"b": 3, "s": 5}  # symbolic sizes and the values they take in a run (odd, never 1)
SIZES2 = {"b": 2, "s": 7}  # the same builds run again at other sizes


def inp(*shape, dt="float32", dom="any"):
    return (tuple(shape), dt, dom)


def const(array):
    return ("const", np.asarray(array))


F, POS, UNIT = (lambda *s: inp(*s)), (lambda *s: inp(*s, dom="pos")), (lambda *s: inp(*s, dom="unit"))
I32 = lambda *s: inp(*s, dt="int32", dom="int")  # noqa: E731
BOOL = lambda *s: inp(*s, dt="bool", dom="bool")  # noqa: E731
BIND = lambda *s: inp(*s, dom="bind")  # noqa: E731  (a graph input the op does not read: it binds sizes)

# (label, kind, inputs, attrs): one single-operator graph each; "b" and "s" are symbolic sizes.
CASES = [
    *[(k, k, [F("b", 5, 7)], {}) for k in ("exp", "sin", "cos", "tanh", "sigmoid", "silu", "erf", "softplus",
                                          "expm1", "mish", "hardsigmoid", "hardswish", "neg", "abs", "relu",
                                          "sign", "floor", "ceil", "round", "identity", "isnan")],  # fmt: skip
    *[(k, k, [POS("b", 5, 7)], {}) for k in ("log", "sqrt", "rsqrt", "reciprocal")],
    *[(k, k, [UNIT("b", 9)], {}) for k in ("tan", "log1p")],
    ("abs_int", "abs", [I32("b", 4)], {}),
    ("exp_int", "exp", [inp("b", 4, dt="int32", dom="small")], {}),
    ("logical_not", "logical_not", [BOOL("b", 6)], {}),
    ("split_heads", "split_heads", [F("b", "s", 23)], {"heads": 3, "head_dim": 4, "offset": 7}),
    ("merge_heads", "merge_heads", [F("b", 3, "s", 5)], {}),
    ("gelu", "gelu", [F("b", 11)], {}),
    ("gelu_tanh", "gelu", [F("b", 11)], {"approximate": "tanh"}),
    ("leaky_relu", "leaky_relu", [F("b", 11)], {"negative_slope": 0.2}),
    ("elu", "elu", [F("b", 11)], {"alpha": 0.7}),
    ("clamp", "clamp", [F("b", 11)], {"min": -0.5, "max": 1.25}),
    ("clamp_min_int", "clamp", [I32("b", 11)], {"min": 2.7}),
    ("cast_f2i", "cast", [F("b", 6)], {"dtype": "int32"}),
    ("cast_i2f", "cast", [I32("b", 6)], {"dtype": "float32"}),
    ("cast_f2b", "cast", [F("b", 6)], {"dtype": "bool"}),
    ("add_bcast", "add", [F("b", 5, 7), F(5, 1)], {}),
    ("add_int_float", "add", [I32("b", 7), F(7)], {}),
    ("add_const", "add", [F("b", 7), const(np.float32(1.5))], {}),
    ("sub", "sub", [F(5, 7), F("b", 1, 7)], {}),
    ("mul", "mul", [F("b", 5, 7), F(7)], {}),
    ("maximum", "maximum", [F("b", 7), F("b", 7)], {}),
    ("minimum", "minimum", [F("b", 7), F(1)], {}),
    ("pow", "pow", [POS("b", 7), F(7)], {}),
    ("pow_const", "pow", [F("b", 7), const(np.float32(2.0))], {}),
    ("remainder", "remainder", [F("b", 7), F(7)], {}),
    ("remainder_int", "remainder", [I32("b", 7), I32(7)], {}),
    ("bitwise_and", "bitwise_and", [I32("b", 7), I32(7)], {}),
    ("bitwise_or", "bitwise_or", [BOOL("b", 7), BOOL(7)], {}),
    ("div", "div", [F("b", 7), F(7)], {}),
    ("div_int", "div", [I32("b", 7), I32(7)], {}),
    ("div_floor", "div", [F("b", 7), F(7)], {"rounding": "floor"}),
    ("div_trunc", "div", [F("b", 7), F(7)], {"rounding": "trunc"}),
    ("div_trunc_int", "div", [I32("b", 7), I32(7)], {"rounding": "trunc"}),
    ("div_floor_int", "div", [I32("b", 7), I32(7)], {"rounding": "floor"}),
    *[(k, k, [inp("b", 6, dt="int32", dom="small"), inp(6, dt="int32", dom="small")], {})
      for k in ("eq", "ne", "lt", "le", "gt", "ge")],  # fmt: skip
    ("lt_float", "lt", [F("b", 6), F("b", 6)], {}),
    *[(k, k, [BOOL("b", 6), BOOL(6)], {}) for k in ("logical_and", "logical_or", "logical_xor")],
    ("where", "where", [BOOL("b", 1, 6), F(5, 6), F("b", 5, 1)], {}),
    ("where_int_cond", "where", [I32("b", 6), F(6), I32("b", 6)], {}),
    *[(k, k, [F("b", 4, 6)], {"axes": [1]}) for k in ("reduce_sum", "reduce_mean", "reduce_max", "reduce_min")],
    ("reduce_prod", "reduce_prod", [UNIT("b", 4, 6)], {"axes": [0, 2], "keepdim": True}),
    ("reduce_sum_all", "reduce_sum", [F("b", 4, 6)], {}),
    ("reduce_sum_int", "reduce_sum", [I32("b", 9)], {"axes": [-1], "keepdim": True}),
    ("reduce_mean_int", "reduce_mean", [I32("b", 9)], {"axes": [0]}),
    ("reduce_max_bool", "reduce_max", [BOOL("b", 9)], {"axes": [1]}),
    ("argmax", "argmax", [F("b", 5, 7)], {"axis": 1}),
    ("argmin", "argmin", [F("b", 5, 7)], {"axis": -1, "keepdim": True}),
    ("cumsum", "cumsum", [F("b", 9)], {"axis": 1}),
    ("cumsum_rev_excl", "cumsum", [F("b", 9)], {"axis": 0, "reverse": True, "exclusive": True}),
    ("cumsum_int", "cumsum", [I32("b", 9)], {"axis": -1}),
    ("softmax", "softmax", [F("b", 5, 7)], {"axis": 1}),
    ("log_softmax", "log_softmax", [F("b", 5, 7)], {"axis": -1}),
    ("layer_norm", "layer_norm", [F("b", "s", 12), F(12), F(12)], {"eps": 1e-5}),
    ("layer_norm_2d", "layer_norm", [F("b", 3, 10)], {"num_axes": 2}),
    ("rms_norm", "rms_norm", [F("b", "s", 12), F(12)], {"eps": 1e-6}),
    ("rms_norm_plain", "rms_norm", [F("b", 12)], {}),
    ("batch_norm", "batch_norm", [F("b", 4, 5, 3), F(4), POS(4), F(4), F(4)], {"eps": 1e-3}),
    ("matmul", "matmul", [F("b", 3, 5, 7), F(7, 4)], {}),
    ("matmul_bcast", "matmul", [F(1, 5, 7), F("b", 1, 7, 4)], {}),
    ("matmul_vec", "matmul", [F(7), F("b", 7, 3)], {}),
    ("matmul_int", "matmul", [I32("b", 5), I32(5, 3)], {}),
    ("linear", "linear", [F("b", "s", 9), const(np.linspace(-1, 1, 45, dtype=np.float32).reshape(5, 9)), F(5)], {}),
    ("linear_nobias", "linear", [F("b", 9), F(6, 9)], {}),
    ("conv2d", "conv2d", [F("b", 4, 9, 8), F(6, 2, 3, 3), F(6)],
     {"stride": [2, 1], "padding": [1, 2, 1, 2], "dilation": [1, 2], "groups": 2}),
    ("conv2d_asym_pad", "conv2d", [F("b", 3, 7, 6), F(5, 3, 2, 2)], {"padding": [0, 1, 1, 0]}),
    ("max_pool2d", "max_pool2d", [F("b", 2, 9, 8)], {"kernel": [3, 3], "stride": [2, 2], "padding": [1, 1, 1, 1]}),
    ("max_pool2d_ceil", "max_pool2d", [F("b", 2, 9, 8)], {"kernel": [2, 3], "stride": [2, 2], "ceil_mode": True}),
    ("avg_pool2d", "avg_pool2d", [F("b", 2, 9, 8)],
     {"kernel": [3, 2], "stride": [2, 2], "padding": [1, 1, 1, 1], "count_include_pad": False, "ceil_mode": True}),
    ("adaptive_avg_pool2d", "adaptive_avg_pool2d", [F("b", 2, 9, 8)], {"output_size": [3, 4]}),
    ("global_avg_pool_sym", "adaptive_avg_pool2d", [F(2, 3, "s", "b")], {"output_size": [1, 1]}),
    ("sdpa_causal_gqa", "scaled_dot_product_attention", [F("b", 4, 5, 8), F("b", 2, 7, 8), F("b", 2, 7, 6)],
     {"causal": True}),
    ("sdpa_bool_mask", "scaled_dot_product_attention", [F("b", 2, "s", 8), F("b", 2, "s", 8), F("b", 2, "s", 8),
                                                        inp("b", 1, 1, "s", dt="bool", dom="mask")], {"scale": 0.3}),
    ("sdpa_float_mask", "scaled_dot_product_attention", [F(2, 5, 8), F(2, 7, 8), F(2, 7, 4), F(5, 7)], {}),
    ("reshape_sym", "reshape", [F("b", "s", 12)], {"shape": [Sym.var("b"), Sym.var("s"), 4, 3]}),
    ("reshape_flat", "reshape", [F("b", "s", 12)], {"shape": [-1, 12]}),
    ("reshape_merge", "reshape", [F("b", 4, "s")], {"shape": [Sym.var("b"), -1]}),
    ("flatten", "flatten", [F("b", 3, 4, 5)], {"start": 1, "end": 2}),
    ("permute", "permute", [F("b", 3, 4, 5)], {"perm": [2, 0, 3, 1]}),
    ("squeeze", "squeeze", [F("b", 1, 4, 1)], {"axes": [1, 2]}),
    ("squeeze_all", "squeeze", [F(1, "b", 1, 4)], {}),
    ("unsqueeze", "unsqueeze", [F("b", 4)], {"axes": [0, 3]}),
    ("expand", "expand", [F("b", 1, 4)], {"shape": [2, -1, 3, 4]}),
    ("expand_sym", "expand", [F(1, 4), BIND("b")], {"shape": [Sym.var("b"), 4]}),
    ("tile", "tile", [F("b", 3)], {"repeats": [2, 1, 3]}),
    ("flip", "flip", [F("b", 3, 4)], {"axes": [0, -1]}),
    ("tril", "tril", [F("b", 4, 6)], {"diagonal": 1}),
    ("triu", "triu", [F("b", 6, 4)], {"diagonal": -1}),
    ("slice", "slice", [F("b", 9, 8)], {"axes": [1, 2], "starts": [1, -2], "ends": [2**62, 1], "steps": [3, -2]}),
    ("slice_sym_end", "slice", [F(12, 4), BIND("s")], {"axes": [0], "starts": [0], "ends": [Sym.var("s")]}),
    ("slice_sym_axis", "slice", [F("b", "s", 4)], {"axes": [1], "starts": [1], "ends": [-1]}),
    ("concat", "concat", [F("b", 2), I32("b", 3), F("b", 1)], {"axis": 1}),
    ("concat_sym", "concat", [F("s", 3), F("b", 3)], {"axis": 0}),
    ("split", "split", [F("b", 9)], {"axis": -1, "sizes": [2, 4, 3]}),
    ("pad", "pad", [F("b", 5, 6)], {"pads": [0, 0, 1, 2, -1, 3], "value": 0.5}),
    ("take", "take", [F(10, 3), inp("b", 4, dt="int64", dom="idx10")], {"axis": 0}),
    ("take_axis1", "take", [F("b", 6, 2), inp(5, dt="int32", dom="idx6")], {"axis": 1}),
    ("gather_elements", "gather_elements", [F("b", 6), inp("b", 4, dt="int64", dom="gidx6")], {"axis": 1}),
    ("full", "full", [], {"shape": [3, 4], "value": 1.5, "dtype": "float32"}),
    ("full_int", "full", [], {"shape": [2], "value": 7, "dtype": "int64"}),
    ("arange", "arange", [], {"start": 2, "end": 11, "step": 3, "dtype": "int64"}),
    ("arange_float", "arange", [], {"start": 0.5, "end": 3.0, "step": 0.5, "dtype": "float32"}),
    ("full_sym", "full", [BIND("b", 2)], {"shape": [Sym.var("b"), 4], "value": 2, "dtype": "float32"}),
    ("arange_sym", "arange", [BIND("s")], {"end": Sym.var("s"), "dtype": "int64"}),
    ("arange_sym_step", "arange", [BIND("b", "s")], {"start": 1, "end": Sym.var("b") * Sym.var("s"), "step": 2,
                                                     "dtype": "float32"}),
    # operators of the ONNX front end
    *[(k, k, [UNIT("b", 7)], {}) for k in ("asin", "acos", "atan", "sinh", "cosh", "asinh", "atanh")],
    ("acosh", "acosh", [inp("b", 7, dom="ge1")], {}),
    ("fmod", "fmod", [F("b", 7), F(7)], {}),
    ("fmod_int", "fmod", [I32("b", 7), I32(7)], {}),
    ("bitwise_xor", "bitwise_xor", [I32("b", 7), I32(7)], {}),
    ("bitwise_xor_bool", "bitwise_xor", [BOOL("b", 7), BOOL(7)], {}),
    ("bitshift", "bitshift", [inp("b", 7, dt="uint8", dom="shift"), inp(7, dt="uint8", dom="shift")], {"left": True}),
    ("bitshift_right", "bitshift", [inp("b", 7, dt="uint8", dom="shift"), inp(7, dt="uint8", dom="shift")],
     {"left": False}),
    ("gather_nd", "gather_nd", [F(4, 6, "b"), inp("s", 2, dt="int64", dom="idx4")], {}),
    ("gather_nd_batch", "gather_nd", [F(3, 4, 5), inp(3, 2, 1, dt="int32", dom="idx4")], {"batch_dims": 1}),
    ("cumprod", "cumprod", [UNIT("b", 9)], {"axis": 1, "reverse": True, "exclusive": True}),
    ("cumprod_int", "cumprod", [inp("b", 6, dt="int32", dom="small")], {"axis": -1}),
    ("bitcast", "bitcast", [F("b", 7)], {"dtype": "int32"}),
    ("pow_int", "pow", [I32("b", 5), inp(5, dt="int32", dom="shift")], {}),
    # written as statements (tessera.ops.programs); repeated indices included
    ("scatter_elements_add", "scatter_elements", [F("b", 5), inp("b", 3, dt="int64", dom="idx5"), F("b", 3)],
     {"axis": 1, "reduction": "add"}),
    ("scatter_elements", "scatter_elements", [F(4, "s"), inp(2, "s", dt="int32", dom="idx4"), F(2, "s")], {}),
    ("index_copy", "index_copy", [F("b", 6, 3), inp(4, dt="int64", dom="idx6"), F("b", 4, 3)], {"axis": 1}),
    ("index_copy_symbolic", "index_copy", [F(5, "s"), inp("b", dt="int32", dom="idx5"), F("b", "s")], {"axis": 0}),
    ("scatter_nd_mul", "scatter_nd", [F(4, "b", 3), inp(5, 1, dt="int64", dom="idx4"), F(5, "b", 3)],
     {"reduction": "mul"}),
    ("scatter_nd_max", "scatter_nd", [F(4, 3), inp("s", 2, dt="int64", dom="idx3"), F("s")], {"reduction": "max"}),
    ("topk", "topk", [F("b", 9)], {"k": 4, "axis": 1}),
    ("topk_smallest", "topk", [F(7, "b")], {"k": 3, "axis": 0, "largest": False}),
    ("det", "det", [F("b", 4, 4)], {}),
    ("max_pool_with_indices", "max_pool_with_indices", [F("b", 2, 7, 6)],
     {"kernel": [3, 2], "stride": [2, 1], "pads": [1, 0, 1, 1], "dilation": [1, 2], "storage_order": 1}),
]  # fmt: skip


def _dim(d):
    return Sym.var(d) if isinstance(d, str) else d


def make_graph(kind, specs, attrs, dtype=None):
    """A one-operator graph; `dtype` replaces float32 in the input specs."""
    b = GraphBuilder(kind)
    ins = []
    for k, s in enumerate(specs):
        if s[0] == "const":
            ins.append(b.constant(s[1], f"c{k}"))
        else:
            shape, dt, _ = s
            t = b.input(f"in{k}", [_dim(d) for d in shape], dtype if dtype and dt == "float32" else dt)
            if s[2] != "bind":
                ins.append(t)
    b.output(*b.op_multi(kind, *ins, **attrs))
    return b.build()


def make_arrays(rng, graph, specs, sizes):
    arrays = []
    specs = [s for s in specs if s[0] != "const"]
    for t, (_, _, dom) in zip(graph.inputs, specs):
        shape = tuple(sizes[d.names[0]] if isinstance(d, Sym) else d for d in t.shape)
        x = rng.standard_normal(shape) * 2
        x = x + np.sign(x) * 0.05  # never zero
        if dom == "pos":
            x = np.abs(x) + 0.2
        elif dom == "unit":
            x = rng.uniform(0.1, 0.9, shape) * rng.choice([-1, 1], shape)
        elif dom == "int":
            x = rng.integers(1, 10, shape) * rng.choice([-1, 1], shape)
        elif dom == "small":
            x = rng.integers(-2, 3, shape)
        elif dom == "ge1":
            x = np.abs(x) + 1.0
        elif dom == "shift":
            x = rng.integers(0, 9, shape)
        elif dom in ("bool", "mask"):
            x = rng.random(shape) > 0.4
            if dom == "mask":
                x[..., 0] = True  # no fully masked row
        elif dom.startswith("idx"):
            n = int(dom[3:])
            x = rng.integers(-n, n, shape)
        elif dom.startswith("gidx"):
            x = rng.integers(0, int(dom[4:]), shape)
        arrays.append(np.asarray(x).astype(numpy_dtype(t.dtype)))
    return arrays


def compare(out, ref, label, rtol):
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.shape == ref.shape, (label, out.shape, ref.shape)
    assert out.dtype == ref.dtype, (label, out.dtype, ref.dtype)
    if ref.dtype.kind in "biu":
        np.testing.assert_array_equal(out, ref, err_msg=label)
        return
    o, r = out.astype(np.float64), ref.astype(np.float64)
    scale = np.abs(r[np.isfinite(r)]).max(initial=1.0)
    np.testing.assert_allclose(o, r, rtol=rtol, atol=rtol * scale, equal_nan=True, err_msg=label)


def build_and_check(rng, cases, dtype=None, rtol=2e-5, target="cpu", sizes=(SIZES, SIZES2)):
    """Lower each case, build all of them with ONE compiler run, and compare with the references."""
    graphs = [make_graph(kind, specs, attrs, dtype) for _, kind, specs, attrs in cases]
    lowered = [lower_graph(g) for g in graphs]
    compiled = ops.build_many([(lg.outputs, lg.placeholders) for lg in lowered], target)
    for (label, _, specs, _), g, lg, f in zip(cases, graphs, lowered, compiled):
        for sz in sizes:
            arrays = make_arrays(rng, g, specs, sz)
            refs = g.run(*arrays)
            args = lg.arrays(arrays)
            if target == "cuda":
                import torch

                args = [torch.from_numpy(np.array(a)).cuda() for a in args]
            outs = f(*args)
            outs = list(outs) if isinstance(outs, tuple) else [outs]
            if target == "cuda":
                outs = [o.cpu().numpy() for o in outs]
            for k, (o, r) in enumerate(zip(outs, refs)):
                compare(o, r, f"{label}[{k}] at {sz}", rtol)


# ---- every kind, float32 and friends, on the CPU ----------------------------------------------------------------------
def test_every_lowerable_kind_has_a_case():
    covered = {kind for _, kind, _, _ in CASES}
    assert set(LOWERINGS) - covered == set()


@pytest.mark.parametrize("part", [0, 1])
@pytest.mark.slow
def test_cases_match_references(rng, part):
    half = len(CASES) // 2
    build_and_check(rng, CASES[:half] if part == 0 else CASES[half:])


HALF_CASES = ["exp", "gelu_tanh", "silu", "add_bcast", "div", "softmax", "layer_norm", "rms_norm", "reduce_sum",
              "matmul", "linear", "conv2d", "sdpa_causal_gqa", "avg_pool2d", "cumsum", "concat"]  # fmt: skip


def test_float16_cases(rng):
    """A handful in float16: computed in float32 and rounded once, like the references."""
    build_and_check(rng, [c for c in CASES if c[0] in HALF_CASES], dtype="float16", rtol=2e-3)


def test_every_registered_kind_is_lowered_or_explained():
    kinds = set(all_ops())
    assert kinds == set(LOWERINGS) | set(NOT_LOWERED), sorted(kinds ^ (set(LOWERINGS) | set(NOT_LOWERED)))
    assert not set(LOWERINGS) & set(NOT_LOWERED)
    assert all(NOT_LOWERED.values())


# ---- sizes ---------------------------------------------------------------------------------------------------------------
def test_dim_expr():
    symbols = {}
    assert isinstance(dim_expr(7, symbols), E.Const) and dim_expr(7, symbols).value == 7
    b = dim_expr(Sym.var("batch"), symbols)
    assert isinstance(b, E.Var) and symbols == {"batch": b}
    e = dim_expr(Sym.var("batch") * Sym.var("seq") * Sym.var("seq") * 4, symbols)
    assert set(symbols) == {"batch", "seq"} and symbols["batch"] is b
    from tessera.ir.evaluate import evaluate

    assert evaluate(e, {symbols["batch"]: 3, symbols["seq"]: 5}) == 300
    with pytest.raises(TypeError):
        dim_expr(2.5, symbols)


def test_concrete_placeholders_for_symbolic_graph(rng):
    """The graph compiler may lower with int shapes (anchor epilogues per shape): symbolic
    attributes then resolve from the inputs' actual sizes."""
    b = GraphBuilder("g")
    x = b.input("x", ["b", "s", 12])
    y = b.op("reshape", x, shape=[Sym.var("b"), Sym.var("s"), 3, 4])
    z = b.op("slice", b.op("permute", y, perm=[0, 2, 1, 3]), axes=[2], starts=[0], ends=[Sym.var("s")])
    w = b.op("expand", b.op("reduce_sum", x, axes=[1], keepdim=True), shape=[Sym.var("b"), Sym.var("s"), 12])
    b.output(b.op("add", b.op("reshape", z, shape=[Sym.var("b"), -1]), b.op("flatten", w, start=1)))
    g = b.build()
    symbols = {}
    env = {x: ops.placeholder((2, 5, 12), "float32", "x")}
    for op in g.operators:
        env.update(zip(op.outputs, lower_operator(op, [env[t] for t in op.inputs], symbols)))
    out = env[g.outputs[0]]
    assert [d.value for d in out.shape] == [2, 60]
    # The expand names s, which its own input does not carry: it comes from `symbols`.
    assert list(symbols) == ["s"]
    xv = rng.standard_normal((2, 5, 12)).astype(np.float32)
    compare(ops.build([out], [env[x]])(xv, symbols={"s": 5}), g.run(xv)[0], "concrete", 1e-6)
    symbols = {"s": E.Const(5, dtypes.int32)}  # or the caller knows it
    for op in g.operators:
        env.update(zip(op.outputs, lower_operator(op, [env[t] for t in op.inputs], symbols)))
    compare(ops.build([env[g.outputs[0]]], [env[x]])(xv), g.run(xv)[0], "concrete", 1e-6)


def test_inline_scalars_folds_rank0_constants():
    b = GraphBuilder("g")
    x = b.input("x", ["n", 4])
    b.output(b.op("pow", x, b.constant(np.float32(2.0))))
    g = b.build()
    plain = lower_graph(g)
    folded = lower_graph(g, inline_scalars=True)
    assert "powf(" in ops.generate(plain.outputs, plain.placeholders).source
    assert "powf(" not in ops.generate(folded.outputs, folded.placeholders).source  # x * x
    xv = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    for lg in (plain, folded):
        compare(ops.build(lg.outputs, lg.placeholders)(*lg.arrays([xv])), xv * xv, "pow", 1e-6)


# ---- what is not lowered, and why ------------------------------------------------------------------------------------
def _op(kind, *inputs, **attrs):
    return Operator.create(kind, list(inputs), attrs)


@pytest.mark.parametrize("make,reason", [
    (lambda: _op("relu", Tensor([4], "int4")), "dtype int4"),
    (lambda: _op("max_pool2d", Tensor([1, 2, 9, 9], "float32"), kernel=[3, 3], dilation=[2, 2]), "dilation"),
    (lambda: _op("max_pool2d", Tensor([1, 2, 9, 9], "float32"), kernel=[3, 3], padding=[1, 0, 0, 1]), "asymmetric"),
    (lambda: _op("gelu", Tensor([4], "float32"), approximate="sigmoid"), "approximate"),
    (lambda: _op("pow", Tensor([4], "bool"), Tensor([4], "bool")), "pow of bool"),
    (lambda: _op("det", Tensor(["n", "n"], "float32")), "symbolic size"),
    (lambda: _op("det", Tensor([65, 65], "float32")), "at most 64x64"),
    (lambda: _op("conv2d", Tensor([1, "c", 5, 5], "float32"), Tensor([2, 3, 3, 3], "float32")), "symbolic channel"),
    (lambda: _op("adaptive_avg_pool2d", Tensor([1, 2, "h", 5], "float32"), output_size=[2, 2]), "symbolic spatial"),
    (lambda: _op("tile", Tensor([3], "float32"), repeats=[Sym.var("n")]), "symbolic repeats"),
    (lambda: _op("leaky_relu", Tensor([3], "int32")), "int32"),
    (lambda: _op("relu", Tensor([0, 3], "float32")), "empty"),
])  # fmt: skip
def test_lowering_error_reasons(make, reason):
    op = make()
    msg = lowering_error(op)
    assert msg is not None and reason in msg, msg
    nodes = [ops.placeholder([1] * t.ndim, "float32") for t in op.inputs]
    with pytest.raises(LoweringError, match=reason):
        lower_operator(op, nodes, {})


def test_bad_input_nodes_raise_lowering_errors():
    op = _op("add", Tensor(["n", 3], "float32"), Tensor([3], "float32"))
    with pytest.raises(LoweringError, match="inputs"):
        lower_operator(op, [ops.placeholder((2, 3), "float32")], {})
    with pytest.raises(LoweringError, match="rank"):
        lower_operator(op, [ops.placeholder((2, 3), "float32"), ops.placeholder((1, 3), "float32")], {})
    with pytest.raises(LoweringError, match="size 4"):  # a static size that contradicts the graph
        lower_operator(op, [ops.placeholder((2, 4), "float32"), ops.placeholder((3,), "float32")], {})


# ---- the test models: every operator they produce lowers, and the whole graph builds ----------------------------------
MODEL_CASES = {
    "cnn": ("SmallCNN", lambda b, s, g, torch: (torch.randn(b, 3, 13 + s, 19 - s, generator=g),)),
    "resnet18": ("ResNet18", lambda b, s, g, torch: (torch.randn(b, 3, 30 + s, 33, generator=g),)),
    "bert": ("BertLayer", lambda b, s, g, torch: (torch.randint(0, 50, (b, s), generator=g),
                                                  (torch.rand(b, s, generator=g) > 0.2).long())),
    "gpt2": ("GPT2Block", lambda b, s, g, torch: (torch.randn(b, s, 40, generator=g),)),
    "llama": ("LlamaBlock", lambda b, s, g, torch: (torch.randn(b, s, 48, generator=g),)),
    "llama_gqa": ("LlamaGQABlock", lambda b, s, g, torch: (torch.randn(b, s, 48, generator=g),)),
}  # fmt: skip


def model_graphs(name):
    """The FlowGraphs the torch front end makes of a test model (dynamic batch and sizes)."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(Path(__file__).parent))
    import models as M

    from tessera.frontend.torch import backend

    cls, make_inputs = MODEL_CASES[name]
    torch.manual_seed(0)
    model = getattr(M, cls)()
    if name in ("cnn", "resnet18"):
        M.randomize_batchnorm(model)
    model.eval()
    captured = []

    def capture(gm, example_inputs):
        return backend(gm, example_inputs, executor="reference", collect=captured)

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        torch.compile(model, backend=capture, dynamic=True)(*make_inputs(2, 11, g, torch))
    torch._dynamo.reset()
    graphs = [g for cg in captured for g in cg.graphs]
    assert graphs, f"{name}: the front end made no graph"
    return graphs, lambda b, s: [t.numpy() for t in make_inputs(b, s, g, torch)]


@pytest.mark.parametrize("name", list(MODEL_CASES))
@pytest.mark.slow
def test_model_graphs_lower_and_match(name):
    graphs, make_inputs = model_graphs(name)
    assert len(graphs) == 1  # the whole model is one graph (no graph break)
    graph = graphs[0]
    reasons = {op.kind: r for op in graph.operators if (r := lowering_error(op)) is not None}
    assert not reasons, reasons
    lg = lower_graph(graph)
    f = ops.build(lg.outputs, lg.placeholders)
    for b, s in ((2, 11), (3, 6)):  # new batch and sequence/image sizes reuse the build
        arrays = make_inputs(b, s)
        compare(f(*lg.arrays(arrays)), graph.run(*arrays)[0], f"{name} b={b} s={s}", 2e-5)


# ---- GPU tier ------------------------------------------------------------------------------------------------------
GPU_CASES = ["gelu", "gelu_tanh", "silu", "exp", "add_bcast", "where", "div_trunc", "softmax", "log_softmax",
             "layer_norm", "rms_norm", "reduce_sum", "reduce_max", "argmax", "cumsum", "matmul", "linear", "conv2d",
             "max_pool2d", "avg_pool2d", "sdpa_causal_gqa", "sdpa_bool_mask", "reshape_sym", "permute", "slice",
             "concat", "split", "pad", "take", "expand", "tile", "arange_sym", "tan", "log1p", "expm1", "mish", "elu",
             "isnan", "flip", "gather_elements", "argmin", "div_trunc_int", "cumsum_rev_excl", "index_copy",
             "index_copy_symbolic"]  # fmt: skip


@pytest.mark.cuda
def test_float16_cases_on_cuda(rng):
    """A selection built for "cuda" in float16 (one nvcc run), against the numpy references."""
    pytest.importorskip("torch")
    build_and_check(rng, [c for c in CASES if c[0] in GPU_CASES], dtype="float16", rtol=3e-3, target="cuda")


BF16_CASES = ["gelu", "silu", "add_bcast", "softmax", "layer_norm", "rms_norm", "reduce_sum", "matmul", "linear",
              "conv2d", "sdpa_causal_gqa", "cumsum", "take"]  # fmt: skip


def check_bfloat16(rng, target):
    """bfloat16 graphs (numpy has no bfloat16 without ml_dtypes: torch tensors in and out) against the
    float32 reference on the same, bfloat16-representable, values."""
    torch = pytest.importorskip("torch")
    cases = [c for c in CASES if c[0] in BF16_CASES]
    lowered = [lower_graph(make_graph(kind, specs, attrs, "bfloat16")) for _, kind, specs, attrs in cases]
    compiled = ops.build_many([(lg.outputs, lg.placeholders) for lg in lowered], target)
    device = "cuda" if target == "cuda" else "cpu"
    for (label, kind, specs, attrs), lg, f in zip(cases, lowered, compiled):
        g32 = make_graph(kind, specs, attrs)
        arrays = make_arrays(rng, g32, specs, SIZES)
        arrays = [torch.from_numpy(a).bfloat16().float().numpy() if a.dtype == np.float32 else a for a in arrays]
        refs = g32.run(*arrays)
        args = [torch.from_numpy(np.array(a)).to(device) for a in arrays]
        args = [a.bfloat16() if a.dtype == torch.float32 and t.dtype.name == "bfloat16" else a
                for a, t in zip(args, lg.tensors)]  # fmt: skip
        args += [torch.from_numpy(np.array(t.data)).to(device) for t in lg.tensors[len(arrays):]]
        out = f(*args)
        assert out.dtype == getattr(torch, lg.graph.outputs[0].dtype.name), label
        compare(out.float().cpu().numpy() if out.dtype == torch.bfloat16 else out.cpu().numpy(), refs[0], label, 2e-2)


def test_bfloat16_cases_cpu(rng):
    check_bfloat16(rng, "cpu")


@pytest.mark.cuda
def test_bfloat16_cases_on_cuda(rng):
    check_bfloat16(rng, "cuda")
