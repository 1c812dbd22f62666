"""The ONNX importer on hand-built models: the semantics fixed for issue 14 (Flatten's negative
axis, AveragePool's dilations, Pow's dtype, Dropout's mask, Mod fmod), the new modes (1-D/3-D
pooling, MaxPool indices, Pad edge/reflect/wrap, ArgMax select_last_index, LayerNorm's
statistics), import-time folding, specialisation on shape-like inputs, opset conversion,
function bodies, unrolled control flow and the error messages."""

from __future__ import annotations

import logging

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

import tessera  # noqa: E402
from tessera.errors import FileFormatError, UnsupportedError  # noqa: E402
from tessera.frontend.onnx import ShapeInputError  # noqa: E402

F, I32, I64, B = TensorProto.FLOAT, TensorProto.INT32, TensorProto.INT64, TensorProto.BOOL


def model(nodes, inputs, outputs, opset=21, initializers=()):
    """A model from nodes and (name, elem_type, shape) inputs/outputs."""
    vi = [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs]
    vo = [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs]
    graph = helper.make_graph(nodes, "g", vi, vo, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def run(m, *args):
    """Through tessera.onnx.compile on the CPU (generated C)."""
    return tessera.onnx.compile(m, "cpu")(*args)


def reference(m, *args):
    from onnx.reference import ReferenceEvaluator

    names = [i.name for i in m.graph.input]
    return ReferenceEvaluator(m).run(None, dict(zip(names, args)))


# ---- wrong results and crashes of the old importer -----------------------------------------------------------------
@pytest.mark.parametrize("axis", [-1, -2, -3, 0, 3])
def test_flatten_negative_axis_counts_from_the_end(rng, axis):
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    m = model([helper.make_node("Flatten", ["x"], ["y"], axis=axis)], [("x", F, [2, 3, 4])], [("y", F, None)])
    (y,) = run(m, x)
    a = axis + 3 if axis < 0 else axis
    assert y.shape == (int(np.prod(x.shape[:a])), int(np.prod(x.shape[a:])))
    np.testing.assert_array_equal(y, x.reshape(y.shape))


def test_average_pool_honours_dilations(rng):
    x = rng.standard_normal((1, 2, 7, 7)).astype(np.float32)
    node = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[2, 2], dilations=[2, 2])
    m = model([node], [("x", F, [1, 2, 7, 7])], [("y", F, None)])
    (y,) = run(m, x)
    want = (x[:, :, :5, :5] + x[:, :, 2:7, :5] + x[:, :, :5, 2:7] + x[:, :, 2:7, 2:7]) / 4
    assert y.shape == (1, 2, 5, 5)
    np.testing.assert_allclose(y, want, rtol=1e-6)


def test_pow_of_an_integer_base_keeps_its_dtype():
    base = np.array([1, 2, 3, -4], np.int32)
    exp = np.array([2.0, 0.5, 3.0, 2.0], np.float32)
    m = model([helper.make_node("Pow", ["a", "b"], ["y"])], [("a", I32, [4]), ("b", F, [4])], [("y", I32, [4])])
    (y,) = run(m, base, exp)
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y, np.power(base, exp).astype(np.int32))


def test_dropout_mask_output_is_all_true(rng):
    x = rng.standard_normal((3, 4)).astype(np.float32)
    m = model([helper.make_node("Dropout", ["x"], ["y", "mask"])], [("x", F, [3, 4])], [("y", F, [3, 4]), ("mask", B, [3, 4])])
    y, mask = run(m, x)
    np.testing.assert_array_equal(y, x)
    assert mask.dtype == np.bool_ and mask.all()


@pytest.mark.parametrize("dtype", [np.int32, np.float32])
def test_mod_fmod_takes_the_sign_of_the_dividend(dtype):
    a = np.array([-7, 7, -7, 7, 5], dtype)
    b = np.array([3, -3, -3, 3, 5], dtype)
    t = I32 if dtype == np.int32 else F
    for fmod, want in ((1, np.fmod(a, b)), (0, np.mod(a, b))):
        if fmod == 0 and dtype == np.float32:
            continue  # ONNX requires fmod=1 for floats
        m = model([helper.make_node("Mod", ["a", "b"], ["y"], fmod=fmod)], [("a", t, [5]), ("b", t, [5])], [("y", t, [5])])
        np.testing.assert_array_equal(run(m, a, b)[0], want)


# ---- modes ---------------------------------------------------------------------------------------------------------------
def test_argmax_select_last_index():
    x = np.array([[1, 5, 5, 2], [7, 7, 0, 7]], np.float32)
    for op, want in (("ArgMax", [[2], [3]]), ("ArgMin", [[0], [2]])):
        m = model([helper.make_node(op, ["x"], ["y"], axis=1, select_last_index=1)], [("x", F, [2, 4])], [("y", I64, None)])
        np.testing.assert_array_equal(run(m, x)[0], want)


@pytest.mark.parametrize("mode", ["edge", "reflect", "wrap", "constant"])
def test_pad_modes_match_numpy(rng, mode):
    x = rng.standard_normal((3, 5)).astype(np.float32)
    pads = np.array([2, 1, 1, 4], np.int64)  # begins (axis 0, 1), then ends
    m = model([helper.make_node("Pad", ["x", "p"], ["y"], mode=mode)], [("x", F, [3, 5])], [("y", F, None)],
              initializers=[helper.make_tensor("p", I64, [4], pads)])  # fmt: skip
    (y,) = run(m, x)
    np.testing.assert_array_equal(y, np.pad(x, [(2, 1), (1, 4)], mode=mode))


@pytest.mark.parametrize("rank", [1, 3])
@pytest.mark.parametrize("op", ["MaxPool", "AveragePool"])
@pytest.mark.slow
def test_pooling_over_one_and_three_spatial_axes(rng, rank, op):
    shape = [2, 3] + [9, 8, 7][:rank]
    x = rng.standard_normal(shape).astype(np.float32)
    attrs = dict(kernel_shape=[3, 2, 2][:rank], strides=[2, 1, 2][:rank], pads=([1, 0, 1][:rank] + [0, 1, 1][:rank]))
    if op == "AveragePool":
        attrs["count_include_pad"] = 0
    m = model([helper.make_node(op, ["x"], ["y"], **attrs)], [("x", F, shape)], [("y", F, None)])
    np.testing.assert_allclose(run(m, x)[0], reference(m, x)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op,dtype,attrs", [
    ("MaxPool", np.float32, dict(kernel_shape=[3, 2], dilations=[2, 3], pads=[2, 1, 1, 2], strides=[1, 2])),
    ("AveragePool", np.float32, dict(kernel_shape=[3, 3], dilations=[2, 2], pads=[2, 2, 2, 2], count_include_pad=1)),
    ("AveragePool", np.float32, dict(kernel_shape=[2, 2], pads=[1, 0, 0, 1], ceil_mode=1, strides=[2, 2])),
    ("MaxPool", np.uint8, dict(kernel_shape=[5, 5], pads=[2, 2, 2, 2])),
])  # fmt: skip
@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")  # onnx's reference pads uint8 with -inf
def test_pooling_beyond_the_compiled_2d_pooling_is_built_from_slices(rng, op, dtype, attrs):
    """Dilations, wide or asymmetric padding with ceil mode, integers: still generated kernels."""
    x = (rng.standard_normal((2, 3, 9, 8)) * 50).astype(dtype)
    t = F if dtype == np.float32 else TensorProto.UINT8
    m = model([helper.make_node(op, ["x"], ["y"], **attrs)], [("x", t, [2, 3, 9, 8])], [("y", t, None)])
    compiled = tessera.onnx.compile(m)
    np.testing.assert_allclose(compiled(x)[0], reference(m, x)[0], rtol=1e-5, atol=1e-5)
    assert compiled.summary()["reference_ops"] == []


def test_maxpool_indices_output(rng):
    x = rng.standard_normal((2, 3, 5, 6)).astype(np.float32)
    node = helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[2, 3], strides=[2, 2], pads=[1, 1, 0, 1])
    m = model([node], [("x", F, [2, 3, 5, 6])], [("y", F, None), ("i", I64, None)])
    y, i = run(m, x)
    ry, ri = reference(m, x)
    np.testing.assert_array_equal(y, ry)
    np.testing.assert_array_equal(i, ri)
    np.testing.assert_array_equal(x.reshape(-1)[i], y)  # flat indices into the whole input


def test_layer_normalization_mean_and_inv_std_outputs(rng):
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    scale = rng.standard_normal(4).astype(np.float32)
    node = helper.make_node("LayerNormalization", ["x", "s"], ["y", "mean", "inv"], axis=-1, epsilon=1e-5)
    m = model([node], [("x", F, [2, 3, 4]), ("s", F, [4])], [("y", F, None), ("mean", F, None), ("inv", F, None)])
    y, mean, inv = run(m, x, scale)
    np.testing.assert_allclose(mean, x.mean(-1, keepdims=True), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(inv, 1 / np.sqrt(x.var(-1, keepdims=True) + 1e-5), rtol=1e-4)
    np.testing.assert_allclose(y, (x - mean) * inv * scale, rtol=1e-4, atol=1e-5)


# ---- values known at import time and at run time ---------------------------------------------------------------------
def test_shape_arithmetic_is_folded_at_import(rng):
    """Shape -> Neg -> Mod / And / Not / Squeeze / Range / Concat computing a Reshape target."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),                        # [6, 4]
        helper.make_node("Neg", ["s"], ["n"]),                          # [-6, -4]
        helper.make_node("Mod", ["n", "five"], ["m"]),                  # [4, 1]
        helper.make_node("Greater", ["m", "zero"], ["pos"]),
        helper.make_node("Not", ["pos"], ["npos"]),
        helper.make_node("And", ["pos", "npos"], ["none"]),             # [False, False]
        helper.make_node("Cast", ["none"], ["nz"], to=I64),
        helper.make_node("Range", ["zero_s", "three", "one_s"], ["r"]),  # [0, 1, 2]
        helper.make_node("ReduceSum", ["r"], ["rs"], keepdims=1),       # [3]
        helper.make_node("Squeeze", ["rs"], ["three2"]),
        helper.make_node("Unsqueeze", ["three2", "zero_v"], ["t"]),     # [3]
        helper.make_node("Add", ["nz", "m"], ["m2"]),                   # [4, 1]
        helper.make_node("Slice", ["m2", "zero_v", "one_v"], ["four"]),  # [4]
        helper.make_node("Concat", ["four", "t", "minus1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
    ]  # fmt: skip
    c = lambda n, v: helper.make_tensor(n, I64, np.shape(v), np.atleast_1d(v).tolist())  # noqa: E731
    inits = [c("five", 5), c("zero", 0), c("zero_s", 0), c("three", 3), c("one_s", 1), c("zero_v", [0]), c("one_v", [1]),
             c("minus1", [-1])]  # fmt: skip
    m = model(nodes, [("x", F, [6, 4])], [("y", F, None)], initializers=inits)
    graph = tessera.onnx.load(m)
    assert [op.kind for op in graph.operators] == ["reshape"]
    assert list(graph.operators[0].attrs["shape"]) == [4, 3, -1]
    x = rng.standard_normal((6, 4)).astype(np.float32)
    np.testing.assert_array_equal(run(m, x)[0], x.reshape(4, 3, 2))


def test_shape_like_graph_inputs_specialise_with_a_guard(rng, caplog):
    """Reshape's shape and ReduceSum's axes as graph inputs: load names them; compile builds
    one specialisation per distinct value, reuses it for equal values, rebuilds on a change."""
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("ReduceSum", ["r", "axes"], ["y"], keepdims=0)]
    m = model(nodes, [("x", F, [4, 6]), ("shape", I64, [3]), ("axes", I64, [1])], [("y", F, None)])
    with pytest.raises(ShapeInputError, match=r"shape") as info:
        tessera.onnx.load(m)
    assert info.value.inputs == ["shape"]
    compiled = tessera.onnx.compile(m)
    assert compiled.shape_inputs == ["shape"]  # axes is found once shape is known, at the first call
    x = rng.standard_normal((4, 6)).astype(np.float32)
    with caplog.at_level(logging.INFO, logger="tessera"):
        a = compiled(x, np.array([2, 3, 4], np.int64), np.array([1], np.int64))
        b = compiled(x, np.array([2, 3, 4], np.int64), np.array([1], np.int64))
        c = compiled(x, np.array([3, 8, 1], np.int64), np.array([0], np.int64))
    assert compiled.shape_inputs == ["shape", "axes"]
    assert compiled.specializations == 2
    assert caplog.text.count("specialised on") == 2
    np.testing.assert_allclose(a[0], x.reshape(2, 3, 4).sum(1), rtol=1e-6)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_allclose(c[0], x.reshape(3, 8, 1).sum(0), rtol=1e-6)


def test_shape_arithmetic_on_symbolic_sizes_compiles_once(rng):
    """n // 2, n % 2 and min(n, 6) of a symbolic n are sizes of tessera's algebra: one graph for every n."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Div", ["n", "two"], ["h"]), helper.make_node("Mod", ["n", "two"], ["r"]),
             helper.make_node("Add", ["r", "two"], ["two2"]),
             helper.make_node("Concat", ["h", "two2", "minus1"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["y"]),
             helper.make_node("Min", ["n", "six"], ["k"]),
             helper.make_node("Slice", ["x", "zero", "k", "zero"], ["z"])]  # fmt: skip
    c = lambda n, v: helper.make_tensor(n, I64, [1], [v])  # noqa: E731
    inits = [c("zero", 0), c("two", 2), c("minus1", -1), c("six", 6)]
    m = model(nodes, [("x", F, ["n", 6])], [("y", F, None), ("z", F, None)], initializers=inits)
    graph = tessera.onnx.load(m)
    assert [op.kind for op in graph.operators] == ["reshape", "slice"]
    assert str(graph.outputs[1].shape[0]) == "min(6, n)"
    compiled = tessera.onnx.compile(m)
    for n in (4, 8, 5, 4, 10):
        x = rng.standard_normal((n, 6)).astype(np.float32)
        y, z = compiled(x)
        np.testing.assert_array_equal(y, x.reshape(n // 2, n % 2 + 2, -1))
        np.testing.assert_array_equal(z, x[: min(n, 6)])
    assert not compiled.by_input_shapes and compiled.specializations == 1


def test_shape_arithmetic_beyond_the_size_algebra_specialises_on_input_shapes(rng):
    """A size that is not an integer expression (n cast to float, scaled, floored) makes compile
    specialise on the input shapes."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Cast", ["n"], ["nf"], to=F), helper.make_node("Mul", ["nf", "half"], ["hf"]),
             helper.make_node("Floor", ["hf"], ["hfl"]), helper.make_node("Cast", ["hfl"], ["h"], to=I64),
             helper.make_node("Concat", ["h", "minus1"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["y"])]  # fmt: skip
    c = lambda n, v: helper.make_tensor(n, I64, [1], [v])  # noqa: E731
    inits = [c("zero", 0), c("minus1", -1), helper.make_tensor("half", F, [1], [0.5])]
    m = model(nodes, [("x", F, ["n", 6])], [("y", F, None)], initializers=inits)
    compiled = tessera.onnx.compile(m)
    for n in (4, 8, 4):
        x = rng.standard_normal((n, 6)).astype(np.float32)
        np.testing.assert_array_equal(compiled(x)[0], x.reshape(n // 2, -1))
    assert compiled.by_input_shapes and compiled.specializations == 2


def test_clip_bounds_fed_at_run_time_need_no_specialisation(rng):
    m = model([helper.make_node("Clip", ["x", "lo", "hi"], ["y"])], [("x", F, [5]), ("lo", F, []), ("hi", F, [])],
              [("y", F, [5])])  # fmt: skip
    compiled = tessera.onnx.compile(m)
    assert compiled.shape_inputs == []
    x = rng.standard_normal(5).astype(np.float32)
    for lo, hi in ((-0.5, 0.5), (0.0, 2.0)):
        np.testing.assert_array_equal(compiled(x, np.float32(lo), np.float32(hi))[0], np.clip(x, lo, hi))
    assert compiled.specializations == 1


# ---- opsets, functions, control flow ---------------------------------------------------------------------------------
def test_old_opset_is_converted_with_its_semantics(rng):
    """Softmax-11 normalises over all axes from `axis` on (flattened), not only `axis`."""
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    m = model([helper.make_node("Softmax", ["x"], ["y"], axis=1)], [("x", F, [2, 3, 4])], [("y", F, [2, 3, 4])], opset=11)
    (y,) = run(m, x)
    e = np.exp(x.reshape(2, 12) - x.reshape(2, 12).max(1, keepdims=True))
    np.testing.assert_allclose(y, (e / e.sum(1, keepdims=True)).reshape(2, 3, 4), rtol=1e-5)


@pytest.mark.parametrize("op,attrs", [("Selu", {"alpha": 1.5}), ("ReduceL2", {"keepdims": 0}), ("PRelu", {}),
                                      ("Softsign", {}), ("Swish", {"alpha": 0.7})])  # fmt: skip
def test_ops_defined_by_onnx_functions_import_from_their_bodies(rng, op, attrs):
    x = rng.standard_normal((3, 4)).astype(np.float32)
    ins = [("x", F, [3, 4])] + ([("slope", F, [4])] if op == "PRelu" else [])
    args = [x] + ([rng.standard_normal(4).astype(np.float32)] if op == "PRelu" else [])
    m = model([helper.make_node(op, [n for n, _, _ in ins], ["y"], **attrs)], ins, [("y", F, None)], opset=24)
    graph = tessera.onnx.load(m)
    assert graph.operators and all(o.kind != op.lower() for o in graph.operators)
    np.testing.assert_allclose(run(m, *args)[0], reference(m, *args)[0], rtol=1e-5, atol=1e-6)


def test_loop_and_scan_are_unrolled(rng):
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond"], ["cond_out"]), helper.make_node("Add", ["acc", "x"], ["acc_out"]),
         helper.make_node("Mul", ["acc_out", "two"], ["scan_out"])],
        "body", [helper.make_tensor_value_info("i", I64, []), helper.make_tensor_value_info("cond", B, []),
                 helper.make_tensor_value_info("acc", F, [2])],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in (("cond_out", B, []), ("acc_out", F, [2]), ("scan_out", F, [2]))],
        initializer=[helper.make_tensor("two", F, [], [2.0])])  # fmt: skip
    loop = helper.make_node("Loop", ["n", "", "init"], ["final", "each"], body=body)
    m = model([loop], [("x", F, [2]), ("init", F, [2])], [("final", F, [2]), ("each", F, [3, 2])],
              initializers=[helper.make_tensor("n", I64, [], [3])])  # fmt: skip
    x, init = rng.standard_normal(2).astype(np.float32), rng.standard_normal(2).astype(np.float32)
    final, each = run(m, x, init)
    np.testing.assert_allclose(final, init + 3 * x, rtol=1e-6)
    np.testing.assert_allclose(each, 2 * (init + np.arange(1, 4)[:, None] * x), rtol=1e-6)


# ---- errors --------------------------------------------------------------------------------------------------------------
def test_unsupported_attribute_names_op_node_attribute_and_opset():
    m = model([helper.make_node("Cast", ["x"], ["y"], name="to_fp8", to=TensorProto.FLOAT8E4M3FN)], [("x", F, [2])],
              [("y", TensorProto.FLOAT8E4M3FN, [2])])  # fmt: skip
    with pytest.raises(UnsupportedError, match=r"Cast \(node 'to_fp8', opset 21\): attribute to=17"):
        tessera.onnx.load(m)


def test_errors_name_the_op_node_and_opset():
    """Every refusal of a node says which op, which node and which opset (and the attribute or
    output it is about)."""
    extra = model([helper.make_node("Relu", ["x"], ["y", "z"], name="r2")], [("x", F, [3])],
                  [("y", F, [3]), ("z", F, [3])])  # fmt: skip
    with pytest.raises(UnsupportedError, match=r"Relu \(node 'r2', opset 21\): output 1 \('z'\) is not supported"):
        tessera.onnx.load(extra)
    custom = model([helper.make_node("Bar", ["x"], ["y"], name="cd", domain="com.foo")], [("x", F, [3])], [("y", F, [3])])
    custom.opset_import.append(helper.make_opsetid("com.foo", 3))
    with pytest.raises(UnsupportedError, match=r"com.foo::Bar \(node 'cd', com.foo opset 3\) is not supported"):
        tessera.onnx.load(custom)
    unknown = model([helper.make_node("FooBar", ["x"], ["y"], name="fb")], [("x", F, [3])], [("y", F, [3])], opset=17)
    with pytest.raises(UnsupportedError, match=r"FooBar \(node 'fb', opset 17\) is not supported"):
        tessera.onnx.load(unknown)
    bad = model([helper.make_node("Add", ["x", "z"], ["y"], name="add1")], [("x", F, [3]), ("z", F, [4])], [("y", F, [3])])
    with pytest.raises(FileFormatError, match=r"Add \(node 'add1', opset 21\) is malformed.*ShapeError: add"):
        tessera.onnx.load(bad)
    pad = model([helper.make_node("Pad", ["x", "p"], ["y"], name="pad1", mode="foo")],
                [("x", F, [3]), ("p", TensorProto.INT64, [2])], [("y", F, None)])  # fmt: skip
    compiled = tessera.onnx.compile(pad, "cpu")  # the pads are a shape-like input: refused when they are known
    with pytest.raises(UnsupportedError, match=r"Pad \(node 'pad1', opset 21\): attribute mode='foo' is not supported"):
        compiled(np.ones(3, np.float32), np.array([1, 1]))


def test_an_attribute_no_rule_reads_is_refused_by_name():
    m = model([helper.make_node("Relu", ["x"], ["y"], name="r", bogus=1)], [("x", F, [2])], [("y", F, [2])])
    with pytest.raises(UnsupportedError, match=r"Relu \(node 'r', opset 21\): attribute bogus"):
        tessera.onnx.load(m)
    node = helper.make_node("Transpose", ["x"], ["y"], name="sm", bogus=1)  # an op with a rule and no ONNX function
    with pytest.raises(UnsupportedError, match=r"Transpose \(node .sm., opset 21\): attribute bogus=1 is not supported"):
        tessera.onnx.load(model([node], [("x", F, [2])], [("y", F, [2])]))


def test_loop_whose_condition_depends_on_data_is_refused_clearly():
    body = helper.make_graph(
        [helper.make_node("ReduceSum", ["acc"], ["s"], keepdims=0), helper.make_node("Less", ["s", "ten"], ["cond_out"]),
         helper.make_node("Add", ["acc", "acc"], ["acc_out"])],
        "body", [helper.make_tensor_value_info("i", I64, []), helper.make_tensor_value_info("cond", B, []),
                 helper.make_tensor_value_info("acc", F, [2])],
        [helper.make_tensor_value_info("cond_out", B, []), helper.make_tensor_value_info("acc_out", F, [2])],
        initializer=[helper.make_tensor("ten", F, [], [10.0])])  # fmt: skip
    m = model([helper.make_node("Loop", ["", "", "x"], ["y"], body=body, name="grow")], [("x", F, [2])], [("y", F, [2])])
    with pytest.raises(ShapeInputError, match=r"Loop \(node 'grow'.*Loop condition.*\['x'\]"):
        tessera.onnx.load(m)
