"""Compiled graphs on the GPU without torch: tessera DeviceArrays, DLPack in and out, CUDA
graphs through the driver (tessera.graph.compiler.memory.NativeMemory).

CPU tier: the option checks (DLPack itself: tests/test_dlpack.py).  GPU tier: an ONNX model run
with arrays="native" on several calls with fresh inputs of several kinds, and a subprocess in
which torch cannot be imported at all."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tessera.errors import ArgumentError

onnx = pytest.importorskip("onnx")


def test_arrays_option_is_checked():
    import tessera
    from tessera.graph.compiler.memory import choose_memory

    with pytest.raises(ArgumentError, match="arrays='numpy'"):
        choose_memory("cuda", "numpy")
    with pytest.raises(ArgumentError, match="option 'arrays' must be one of"):
        tessera.onnx.compile(_mlp_model(), "cpu", arrays="gpu")  # checked by the compile options


# ---- GPU tier --------------------------------------------------------------------------------

def _mlp_model(classes: int = 11, seed: int = 0) -> bytes:
    """x[batch, 3, 9, 9] -> Conv -> Relu -> Flatten -> Gemm -> Softmax, weights random."""
    from onnx import TensorProto, helper, numpy_helper

    r = np.random.default_rng(seed)
    w = numpy_helper.from_array(r.standard_normal((5, 3, 3, 3)).astype(np.float32) * 0.3, "w")
    b = numpy_helper.from_array(r.standard_normal(5).astype(np.float32), "b")
    fc = numpy_helper.from_array(r.standard_normal((5 * 7 * 7, classes)).astype(np.float32) * 0.05, "fc")
    fcb = numpy_helper.from_array(r.standard_normal(classes).astype(np.float32), "fcb")
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("Flatten", ["r"], ["f"]),
        helper.make_node("Gemm", ["f", "fc", "fcb"], ["g"]),
        helper.make_node("Softmax", ["g"], ["y"], axis=-1),
        helper.make_node("Identity", ["x"], ["x_out"]),  # an output no kernel writes
    ]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 9, 9])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", classes]),
         helper.make_tensor_value_info("x_out", TensorProto.FLOAT, ["batch", 3, 9, 9])],
        [w, b, fc, fcb])  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _reference(model: bytes, x: np.ndarray) -> list[np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(onnx.load_from_string(model)).run(None, {"x": x})


@pytest.mark.cuda
def test_native_arrays_on_fresh_inputs_of_every_kind(rng):
    torch = pytest.importorskip("torch")
    import tessera
    from tessera.runtime.cuda import DeviceArray

    model = _mlp_model()
    compiled = tessera.onnx.compile(model, "cuda", arrays="native")
    makers = [
        lambda x: x,                                   # host numpy: copied once
        lambda x: DeviceArray.from_numpy(x),           # tessera's own
        lambda x: torch.from_numpy(x).cuda(),          # DLPack / CUDA array interface producer
        lambda x: x,                                   # again: a replay
        lambda x: torch.from_numpy(x).cuda(),
        lambda x: DeviceArray.from_numpy(x),           # the batch-3 plan's second call: captured
    ]  # fmt: skip
    for i, make in enumerate(makers):
        batch = 1 if i < 4 else 3  # a new batch size makes a second plan
        x = rng.standard_normal((batch, 3, 9, 9)).astype(np.float32)
        y, x_out = compiled(make(x))
        assert isinstance(y, DeviceArray) and isinstance(x_out, DeviceArray)
        ref_y, ref_x = _reference(model, x)
        np.testing.assert_allclose(y.numpy(), ref_y, rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(x_out.numpy(), ref_x)
        np.testing.assert_allclose(torch.from_dlpack(y).cpu().numpy(), ref_y, rtol=1e-4, atol=1e-5)
    graph = compiled._compiled[()]
    assert graph.memory.kind == "native"
    # (batch 3 grew the shared arena, which drops the batch-1 plan: its buffers pointed into the old one)
    assert graph._plans and all(plan.cuda_graph is not None for plan in graph._plans.values())


@pytest.mark.cuda
def test_native_refuses_noncontiguous_cuda_input(rng):
    torch = pytest.importorskip("torch")
    import tessera

    compiled = tessera.onnx.compile(_mlp_model(), "cuda", arrays="native")
    x = torch.randn(9, 9, 3, 2, device="cuda").permute(3, 2, 0, 1)
    with pytest.raises(ArgumentError, match="not contiguous"):
        compiled(x)


@pytest.mark.cuda
def test_onnx_on_the_gpu_in_a_process_without_torch(tmp_path):
    """The whole GPU path -- compile, kernels, memory plan, CUDA graph replay -- with torch
    made unimportable."""
    (tmp_path / "model.onnx").write_bytes(_mlp_model())
    script = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # any import of torch now fails
        import numpy as np
        import onnx
        from onnx.reference import ReferenceEvaluator
        import tessera
        path = {str(tmp_path / "model.onnx")!r}
        compiled = tessera.onnx.compile(path, "cuda")
        ref = ReferenceEvaluator(onnx.load(path))
        rng = np.random.default_rng(7)
        for batch in (2, 2, 2, 5):
            x = rng.standard_normal((batch, 3, 9, 9)).astype(np.float32)
            y, _ = compiled(x)
            np.testing.assert_allclose(y.numpy(), ref.run(None, {{"x": x}})[0], rtol=1e-4, atol=1e-5)
        assert compiled._compiled[()].memory.kind == "native"
        print("NATIVE-OK")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert "NATIVE-OK" in done.stdout, done.stdout + done.stderr


@pytest.mark.cuda
def test_native_reference_step_with_rank0_output(rng):
    """Det of matrices of a symbolic size has no kernel: its numpy reference runs between
    device steps, and its rank-0 result is copied back to the device as rank 0."""
    from onnx import TensorProto, helper

    import tessera

    graph = helper.make_graph(
        [helper.make_node("Det", ["x"], ["d"]), helper.make_node("Mul", ["d", "d"], ["y"])], "det",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    compiled = tessera.onnx.compile(model, "cuda", arrays="native")
    for _ in range(3):
        x = rng.standard_normal((3, 3)).astype(np.float32)
        (y,) = compiled(x)
        assert y.shape == ()
        np.testing.assert_allclose(y.numpy(), np.linalg.det(x.astype(np.float64)) ** 2, rtol=1e-4)
