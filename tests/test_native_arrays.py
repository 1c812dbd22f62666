"""Compiled graphs on the GPU without torch: tessera DeviceArrays, DLPack in and out, CUDA
graphs through the driver (tessera.graph.compiler.memory.NativeMemory).

CPU tier: the DLPack exporter/importer and the option checks.  GPU tier: an ONNX model run
with arrays="native" on several calls with fresh inputs of several kinds, and a subprocess in
which torch cannot be imported at all."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tessera.errors import ArgumentError
from tessera.ir import dtypes
from tessera.runtime import dlpack

onnx = pytest.importorskip("onnx")


class _HostProducer:
    """A DLPack producer over a numpy array, as a third-party array library would be."""

    def __init__(self, a: np.ndarray, dt=dtypes.float32):
        self.a, self.dt = a, dt

    def __dlpack__(self, stream=None, **_):
        return dlpack.export(self.a.ctypes.data, self.a.shape, self.dt, dlpack.CPU, 0, self.a)

    def __dlpack_device__(self):
        return dlpack.CPU, 0


def test_export_is_read_in_place_by_numpy_and_keeps_the_owner_alive(rng):
    a = rng.standard_normal((3, 5)).astype(np.float32)
    expected = a.copy()
    b = np.from_dlpack(_HostProducer(a))
    assert b.ctypes.data == a.ctypes.data
    del a
    gc.collect()
    np.testing.assert_array_equal(b, expected)  # the capsule's owner kept the memory
    del b
    gc.collect()
    assert not dlpack._live  # the consumer's deleter released it


def test_unconsumed_capsule_is_released():
    capsule = _HostProducer(np.ones(4, np.float32)).__dlpack__()
    assert dlpack._live
    del capsule
    gc.collect()
    assert not dlpack._live


def test_export_to_torch_rank0_and_bf16(rng):
    torch = pytest.importorskip("torch")
    x = np.array(2.5, np.float32)
    assert torch.from_dlpack(_HostProducer(x)).item() == 2.5
    import ml_dtypes

    h = rng.standard_normal(7).astype(ml_dtypes.bfloat16)
    t = torch.from_dlpack(_HostProducer(h, dtypes.bfloat16))
    assert t.dtype == torch.bfloat16
    np.testing.assert_array_equal(t.float().numpy(), h.astype(np.float32))


def test_import_reads_shape_dtype_and_strides():
    torch = pytest.importorskip("torch")
    x = torch.arange(12, dtype=torch.int16).reshape(3, 4)
    ptr, shape, dt, device, contiguous, _ = dlpack.import_view(x)
    assert (ptr, shape, dt, device, contiguous) == (x.data_ptr(), (3, 4), dtypes.int16, "cpu", True)
    _, shape, _, _, contiguous, _ = dlpack.import_view(x.t())
    assert shape == (4, 3) and not contiguous


def test_import_refuses_what_kernels_cannot_read():
    torch = pytest.importorskip("torch")
    with pytest.raises(ArgumentError, match="not supported"):
        dlpack.import_view(torch.zeros(2, dtype=torch.complex64))


def test_arrays_option_is_checked():
    import tessera
    from tessera.graph.compiler.memory import choose_memory

    with pytest.raises(ArgumentError, match="arrays='numpy'"):
        choose_memory("cuda", "numpy")
    with pytest.raises(ArgumentError, match="arrays='gpu'"):
        tessera.onnx.compile(_mlp_model(), "cpu", arrays="gpu")


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
    assert all(plan.cuda_graph is not None for plan in graph._plans.values())


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
    """Det has no kernel: its numpy reference runs between device steps, and its rank-0
    result is copied back to the device as rank 0."""
    from onnx import TensorProto, helper

    import tessera

    graph = helper.make_graph(
        [helper.make_node("Det", ["x"], ["d"]), helper.make_node("Mul", ["d", "d"], ["y"])], "det",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    compiled = tessera.onnx.compile(model, "cuda", arrays="native")
    for _ in range(3):
        x = rng.standard_normal((3, 3)).astype(np.float32)
        (y,) = compiled(x)
        assert y.shape == ()
        np.testing.assert_allclose(y.numpy(), np.linalg.det(x.astype(np.float64)) ** 2, rtol=1e-4)
