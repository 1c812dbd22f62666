"""Bad inputs end in one clear error, never a dependency's traceback or a silently ignored
input: model files (`tessera run`, tessera.frontend.onnx.load, tessera.graph.load), command
arguments, broken compilers and target "cuda" on a machine without a GPU."""

from __future__ import annotations

import logging
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

import tessera as ts
from tessera.backend import build
from tessera.backend.build import build_c, build_cuda
from tessera.cli import main
from tessera.errors import ArgumentError, BrokenCompilerError, DeviceError, FileFormatError
from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402


def _onnx_bytes(nodes=None, outputs=("y",)) -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["batch", 4]) for o in outputs]
    nodes = nodes if nodes is not None else [helper.make_node("Relu", ["x"], ["y"], name="relu")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], outs), opset_imports=[helper.make_opsetid("", 17)])
    return model.SerializeToString()


@pytest.fixture
def files(tmp_path):
    """A good ONNX model, a saved compiled graph of it, and broken variants of both."""
    good = _onnx_bytes()
    f = {"good": tmp_path / "good.onnx", "tsr": tmp_path / "good.tsr"}
    f["good"].write_bytes(good)
    for name, data in {"junk.onnx": os.urandom(64) + b"\xff" * 8, "truncated.onnx": good[: len(good) // 2],
                       "empty.onnx": b"", "notes.txt": b"hello, not a model\n"}.items():  # fmt: skip
        (tmp_path / name).write_bytes(data)
        f[name] = tmp_path / name
    assert main(["run", str(f["good"]), "--device", "cpu", "--repeat", "1", "--save", str(f["tsr"])]) == 0
    with zipfile.ZipFile(f["tsr"]) as z:
        members = {n: z.read(n) for n in z.namelist()}
    for name, keep in {"missing_graph.tsr": lambda n: n != "graph.json",
                       "missing_artifact.tsr": lambda n: not n.endswith(".so"),
                       "missing_compiled.tsr": lambda n: n != "compiled.json"}.items():  # fmt: skip
        with zipfile.ZipFile(tmp_path / name, "w") as z:
            for n, d in members.items():
                if keep(n):
                    z.writestr(n, d)
        f[name] = tmp_path / name
    raw = f["tsr"].read_bytes()
    (tmp_path / "truncated.tsr").write_bytes(raw[: len(raw) // 2])
    corrupt = bytearray(raw)
    at = raw.index(b'"format"')  # inside graph.json: its CRC no longer matches
    corrupt[at + 2] ^= 0x20
    (tmp_path / "corrupt.tsr").write_bytes(bytes(corrupt))
    f["truncated.tsr"], f["corrupt.tsr"] = tmp_path / "truncated.tsr", tmp_path / "corrupt.tsr"
    f["dir"] = tmp_path
    np.save(tmp_path / "x3.npy", np.ones((3, 4), np.float32))
    np.save(tmp_path / "x64.npy", np.ones((3, 4)))
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    return f


def _run_fails(capsys, args: list[str], expected: str) -> None:
    assert main(["run", *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tessera run: ") and err.count("\n") == 1, err
    assert expected in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("name,expected", [
    ("junk.onnx", "not an ONNX model"), ("truncated.onnx", "not an ONNX model"), ("empty.onnx", "not an ONNX model"),
    ("notes.txt", "not an ONNX model"), ("dir", "not a file"), ("missing_graph.tsr", "missing member graph.json"),
    ("missing_artifact.tsr", "missing member artifacts/"), ("missing_compiled.tsr", "missing member compiled.json"),
    ("truncated.tsr", "compiled"), ("corrupt.tsr", "Bad CRC-32"),
])  # fmt: skip
@pytest.mark.slow
def test_run_refuses_a_bad_model_file_in_one_line(files, capsys, name, expected):
    _run_fails(capsys, [str(files[name]), "--device", "cpu"], expected)


@pytest.mark.parametrize("args,expected", [
    (["--dim", "btach=8"], "no symbolic size 'btach' (its sizes: batch)"),
    (["--input", "{x3}", "--input", "{x3}"], "2 --input files given, but the model takes 1 input(s): x"),
    (["--dim", "batch=5", "--input", "{x3}"], "--dim batch=5 contradicts --input"),
    (["--input", "{x64}"], "float64 data, but input 'x' is float32"),
    (["--input", "{obj}"], "not a readable .npy file"),
    (["--input", "{missing}"], "not a readable .npy file"),
    (["--dim", "batch=x"], "name=positive integer"),
    (["--dim", "batch=2", "--dim", "batch=3"], "given twice"),
    (["--repeat", "0"], "--repeat must be at least 1"),
    (["--save", "{missing}/model.tsr"], "does not exist"),
])  # fmt: skip
@pytest.mark.slow
def test_run_refuses_inputs_it_would_ignore(files, capsys, args, expected):
    d = files["dir"]
    paths = {"x3": d / "x3.npy", "x64": d / "x64.npy", "obj": d / "obj.npy", "missing": d / "missing"}
    _run_fails(capsys, [str(files["good"]), "--device", "cpu", *[a.format(**paths) for a in args]], expected)


@pytest.mark.slow
def test_run_refuses_a_device_the_saved_graph_was_not_compiled_for(files, capsys):
    _run_fails(capsys, [str(files["tsr"]), "--device", "cuda"], "was compiled for cpu; --device cuda cannot apply")


@pytest.mark.slow
def test_run_takes_sizes_from_the_files(files, capsys):
    assert main(["run", str(files["good"]), "--device", "cpu", "--repeat", "1", "--input", str(files["dir"] / "x3.npy"),
                 "--dim", "batch=3"]) == 0  # fmt: skip
    assert "shape (3, 4)" in capsys.readouterr().out


@pytest.mark.slow
def test_onnx_load_refuses_bad_files(files):
    from tessera.frontend import onnx as tessera_onnx

    for name in ("junk.onnx", "truncated.onnx", "empty.onnx", "notes.txt"):
        with pytest.raises(FileFormatError, match="not an ONNX model"):
            tessera_onnx.load(files[name])
    with pytest.raises(FileFormatError, match="not an ONNX model"):
        tessera_onnx.load(files["truncated.onnx"].read_bytes())
    with pytest.raises(ArgumentError, match="no such file"):
        tessera_onnx.load(files["dir"] / "missing.onnx")
    with pytest.raises(ArgumentError, match="takes a path, bytes or an onnx.ModelProto"):
        tessera_onnx.load(42)
    undefined = _onnx_bytes([helper.make_node("Relu", ["nope"], ["y"], name="relu")])
    with pytest.raises(FileFormatError, match="node 'relu' \\(Relu\\) needs 'nope'"):
        tessera_onnx.load(undefined)
    with pytest.raises(FileFormatError, match="a graph output needs 'z'"):
        tessera_onnx.load(_onnx_bytes(outputs=("z",)))


@pytest.mark.slow
def test_graph_load_refuses_bad_files(files):
    from tessera.graph import load

    for name, expected in [("missing_graph.tsr", "missing member graph.json"), ("corrupt.tsr", "Bad CRC-32"),
                           ("junk.onnx", "not a readable tessera graph file")]:  # fmt: skip
        with pytest.raises(FileFormatError, match=expected):
            load(files[name])


# ---- compilers that are not compilers ----------------------------------------------------------------------


def _scale(a: ts.f32["n"]):
    for i in ts.grid(a.shape[0]):
        a[i] = a[i] * 2.0


def test_a_compiler_that_writes_nothing_is_named(monkeypatch, cache_dir):
    monkeypatch.setenv("TESSERA_CC", "true")
    k = ts.Kernel(_scale)
    with pytest.raises(BrokenCompilerError, match="produced no output") as info:
        k.build()
    text = str(info.value)
    assert "/true" in text and "TESSERA_CC" in text
    assert Path(info.value.source_path).read_text() == k.source_full and info.value.source_path in text
    monkeypatch.setenv("TESSERA_NVCC", "true")
    with pytest.raises(BrokenCompilerError, match="nvcc .*true.* produced no output.*TESSERA_NVCC"):
        build_cuda('extern "C" __global__ void k() {}\n')


def test_a_compiler_that_cannot_run_is_named(monkeypatch, tmp_path, cache_dir):
    fake = tmp_path / "gcc"
    fake.write_bytes(b"\x00\x01 not an executable format")
    fake.chmod(0o755)
    monkeypatch.setenv("TESSERA_CC", str(fake))
    build.compiler_version.cache_clear()
    with pytest.raises(BrokenCompilerError, match="could not be run"):
        build_c("int f(void) { return 1; }\n")
    build.compiler_version.cache_clear()


def _relu_graph():
    b = GraphBuilder("g")
    b.output(b.op("relu", b.input("x", ["batch", 4])))
    return b.build()


@pytest.mark.parametrize("value", ["true", "/nonexistent/bin/gcc"])
def test_compile_graph_stops_on_a_broken_compiler_instead_of_falling_back(monkeypatch, caplog, value, cache_dir):
    monkeypatch.setenv("TESSERA_CC", value)
    with caplog.at_level(logging.WARNING, logger="tessera"), pytest.raises((BrokenCompilerError, ts.CompilerNotFoundError)):
        compile_graph(_relu_graph(), "cpu")
    assert "numpy reference" not in caplog.text


def test_without_a_compiler_a_kernel_already_built_is_used(monkeypatch, cache_dir):
    path = build_c("int twice(int x) { return 2 * x; }\n")
    monkeypatch.setenv("TESSERA_CC", "/nonexistent/bin/gcc")
    assert build_c("int twice(int x) { return 2 * x; }\n") == path
    with pytest.raises(ts.CompilerNotFoundError, match="no prebuilt kernel.so"):
        build_c("int thrice(int x) { return 3 * x; }\n")
    monkeypatch.setattr(build, "_cpu_model", lambda: "model name : another CPU")
    with pytest.raises(ts.CompilerNotFoundError, match="no prebuilt"):  # -march=native code of another machine
        build_c("int twice(int x) { return 2 * x; }\n")


def test_compile_graph_for_cuda_without_a_gpu_refuses_up_front(caplog):
    from tessera.runtime import cuda

    if cuda.is_available():
        pytest.skip("this machine has a GPU")
    with caplog.at_level(logging.INFO, logger="tessera"), pytest.raises(DeviceError, match="needs a CUDA GPU"):
        compile_graph(_relu_graph(), "cuda")
    assert caplog.text == ""


def _reshape_model(tmp_path) -> Path:
    """y = Reshape(x, shape): the target shape is a graph input (a shape-like input)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 6])
    shape = helper.make_tensor_value_info("shape", TensorProto.INT64, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Relu", ["r"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [x, shape], [y]), opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "reshape.onnx"
    path.write_bytes(model.SerializeToString())
    return path


@pytest.mark.slow
def test_run_specialises_on_shape_like_inputs(tmp_path, capsys):
    """`tessera run` compiles ONNX models with tessera.onnx.compile: a shape fed as an input works."""
    path = _reshape_model(tmp_path)
    np.save(tmp_path / "x.npy", np.arange(-12, 18, dtype=np.float32).reshape(5, 6))
    for target in ([3, 10], [-1, 2]):
        np.save(tmp_path / "shape.npy", np.array(target, np.int64))
        tsr = tmp_path / f"r{target[1]}.tsr"
        assert main(["run", str(path), "--device", "cpu", "--repeat", "2", "--input", str(tmp_path / "x.npy"),
                     "--input", str(tmp_path / "shape.npy"), "--save", str(tsr)]) == 0  # fmt: skip
        out = capsys.readouterr().out
        expected = (3, 10) if target[0] == 3 else (15, 2)
        assert f"shape {expected}" in out and "specialised on the values of shape" in out, out
        assert "max 17" in out and "min 0" in out  # relu of -12..17
        from tessera.graph.compiler import load_compiled

        saved = load_compiled(tsr)  # the specialisation the calls ran: the shape is a constant of it
        assert saved(np.ones((5, 6), np.float32))[0].shape == expected


def test_run_refuses_to_invent_shape_like_inputs(tmp_path, capsys):
    path = _reshape_model(tmp_path)
    np.save(tmp_path / "x.npy", np.ones((5, 6), np.float32))
    _run_fails(capsys, [str(path), "--device", "cpu", "--input", str(tmp_path / "x.npy")],
               "input(s) shape give shapes, axes or sizes")
