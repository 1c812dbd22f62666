"""Saved compiled graphs (.tsr) are untrusted input: verified before anything is installed,
and complete: a fresh process with an empty cache and no compiler runs the model."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tessera.backend import cache
from tessera.errors import ArgumentError, FileFormatError
from tessera.graph import GraphBuilder
from tessera.graph.compiler import CompiledGraph, compile_graph, load_compiled
from tessera.tune import tuner


def _model(rng):
    """x -> linear(+bias) -> gelu -> layer_norm -> softmax, with a symbolic batch."""
    b = GraphBuilder("saved")
    x = b.input("x", ["batch", 12])
    w = b.constant(rng.standard_normal((20, 12)).astype(np.float32))
    h = b.op("gelu", b.op("linear", x, w, b.constant(rng.standard_normal(20).astype(np.float32))))
    h = b.op("layer_norm", h, b.constant(np.ones(20, np.float32)), b.constant(np.zeros(20, np.float32)))
    b.output(b.op("softmax", h))
    return b.build()


def _no_compiler_env(cache_dir: Path) -> dict[str, str]:
    return {**os.environ, "TESSERA_CACHE_DIR": str(cache_dir), "TESSERA_CC": "/nonexistent/bin/gcc",
            "TESSERA_NVCC": "/nonexistent/bin/nvcc", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # fmt: skip


def test_a_fresh_process_without_a_compiler_runs_the_saved_model(rng, tmp_path):
    compiled = compile_graph(_model(rng), "cpu")
    xv = rng.standard_normal((5, 12)).astype(np.float32)
    expected = compiled(xv)[0]
    path = tmp_path / "model.tsr"
    compiled.save(path)
    np.save(tmp_path / "x.npy", xv)
    np.save(tmp_path / "expected.npy", expected)
    script = textwrap.dedent(f"""
        import numpy as np
        from tessera.graph.compiler import load_compiled
        compiled = load_compiled({str(path)!r})
        summary = compiled.summary()
        assert summary["reference_ops"] == [] and summary["kernels"] >= 1, summary
        out = compiled(np.load({str(tmp_path / 'x.npy')!r}))[0]
        np.testing.assert_allclose(out, np.load({str(tmp_path / 'expected.npy')!r}), rtol=1e-6)
        print("ok", summary["kernels"])
    """)
    fresh = tmp_path / "fresh-cache"
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_no_compiler_env(fresh),
                         timeout=300)  # fmt: skip
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr[-3000:]
    assert "numpy reference" not in res.stderr


def _runs_from_its_file_without_a_compiler(compiled: CompiledGraph, xv: np.ndarray, anchors: int, tmp_path: Path) -> None:
    """Save `compiled`, load it in a fresh process with no compiler, and check it is `anchors`
    anchor steps giving this process's output on `xv`."""
    np.save(tmp_path / "x.npy", xv)
    np.save(tmp_path / "expected.npy", compiled(xv)[0])
    compiled.save(tmp_path / "model.tsr")
    script = textwrap.dedent(f"""
        import numpy as np
        from tessera.graph.compiler import load_compiled
        compiled = load_compiled({str(tmp_path / 'model.tsr')!r})
        assert compiled.summary()["steps"] == {{"anchor": {anchors}}}, compiled.summary()
        out = compiled(np.load({str(tmp_path / 'x.npy')!r}))[0]
        np.testing.assert_allclose(out, np.load({str(tmp_path / 'expected.npy')!r}), rtol=1e-6)
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=_no_compiler_env(tmp_path / "fresh-cache"), timeout=300)  # fmt: skip
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr[-3000:]


@pytest.mark.slow
def test_a_static_cpu_conv_model_runs_from_its_file_without_a_compiler(rng, tmp_path):
    """CPU anchors with constant weights (packed at plan time by a kernel the file must ship),
    a tuned convolution and the max-pool anchor, in a fresh process with no compiler."""
    from tessera.backend.isa import vector_lanes

    if vector_lanes() == 1:
        pytest.skip("the CPU anchors need AVX2 or AVX-512")
    b = GraphBuilder("convpool")
    x = b.input("x", [1, 3, 20, 22])
    w = b.constant(rng.standard_normal((16, 3, 3, 3)).astype(np.float32))
    h = b.op("relu", b.op("conv2d", x, w, b.constant(rng.standard_normal(16).astype(np.float32)), stride=[1, 1],
                          padding=[1, 1, 1, 1], dilation=[1, 1]))  # fmt: skip
    b.output(b.op("max_pool2d", h, kernel=[3, 3], stride=[2, 2], padding=[1, 1, 1, 1]))
    _runs_from_its_file_without_a_compiler(compile_graph(b.build(), "cpu"),
                                           rng.standard_normal((1, 3, 20, 22)).astype(np.float32), 2, tmp_path)  # fmt: skip


@pytest.mark.slow
def test_a_cpu_lowbit_model_runs_from_its_file_without_a_compiler(rng, tmp_path):
    """The CPU lowbit_linear anchor (its words re-laid at plan time, in numpy) with a fused bias
    and GELU, in a fresh process with no compiler."""
    from tessera.backend.isa import vector_lanes
    from tessera.eager.quantize import QuantizedLinear
    from tessera.quant.quantize import quantize_weight

    if vector_lanes() == 1:
        pytest.skip("the CPU anchors need AVX2 or AVX-512")
    consts, attrs = QuantizedLinear(quantize_weight(rng.standard_normal((24, 40)), "int3", 16)).graph_operands()
    b = GraphBuilder("lowbit")
    x = b.input("x", [3, 40])
    y = b.op("lowbit_linear", x, *(b.constant(c) for c in consts), **attrs)
    b.output(b.op("gelu", b.op("add", y, b.constant(rng.standard_normal(24).astype(np.float32)))))
    _runs_from_its_file_without_a_compiler(compile_graph(b.build(), "cpu"), rng.standard_normal((3, 40)).astype(np.float32),
                                           1, tmp_path)  # fmt: skip


def test_saved_tuning_records_are_installed(rng, tmp_path, monkeypatch):
    compiled = compile_graph(_model(rng), "cpu")
    compiled(rng.standard_normal((2, 12)).astype(np.float32))
    artifacts, _ = compiled.artifacts()
    full_key = tuner.record_key("gemm|test", "template v1")
    monkeypatch.setattr(compiled, "artifacts", lambda: (artifacts, [(full_key, "cfg-b")]))
    compiled.save(tmp_path / "m.tsr")
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "other-cache"))
    assert tuner.lookup(full_key) is None
    load_compiled(tmp_path / "m.tsr")
    assert tuner.lookup(full_key) == "cfg-b"


# ---- untrusted files ---------------------------------------------------------------------------------------


def _members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as z:
        return {n: z.read(n) for n in z.namelist()}


def _write(path: Path, members: list[tuple[str, bytes]]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about duplicate names, which one case wants
        with zipfile.ZipFile(path, "w") as z:
            for name, data in members:
                z.writestr(name, data)


def _tamper(members: dict[str, bytes], how: str) -> list[tuple[str, bytes]]:
    doc = json.loads(members["compiled.json"])
    art = doc["artifacts"][0]
    key = art["key"]
    so, c = f"artifacts/{key}/kernel.so", f"artifacts/{key}/kernel.c"
    out = dict(members)
    extra: list[tuple[str, bytes]] = []
    if how == "traversal_key":  # the key becomes a path: it must not leave the cache
        art["key"] = "../../../escaped"
        out[f"artifacts/{art['key']}/kernel.so"] = out.pop(so)
        out[f"artifacts/{art['key']}/kernel.c"] = out.pop(c)
    elif how == "traversal_member":
        out["artifacts/../../../escaped.so"] = b"\x7fELF"
    elif how == "absolute_member":
        out["/tmp/tessera-escaped.so"] = b"\x7fELF"
    elif how == "uppercase_key":
        art["key"] = key.upper()
        out[f"artifacts/{key.upper()}/kernel.so"] = out.pop(so)
        out[f"artifacts/{key.upper()}/kernel.c"] = out.pop(c)
    elif how == "tampered_artifact":
        out[so] = out[so][:-16] + bytes(16)
    elif how == "tampered_source":  # sha256 still right, but the key is not the source's
        out[c] = out[c] + b"\n/* changed */\n"
    elif how == "forged_identity":
        art["compiler"] = "gcc (forged) 99.0"
    elif how == "unlisted_member":
        out[f"artifacts/{key}/evil.so"] = b"\x7fELF"
    elif how == "missing_member":
        del out[so]
    elif how == "duplicate_member":
        extra.append(("compiled.json", b"{}"))
    elif how == "wrong_kind":
        art["kind"] = "cuda"
    elif how == "bad_options":
        doc["options"]["cuda_graph"] = "yes"
    elif how == "old_version":
        doc["version"] = 1
    elif how == "extra_field":
        art["path"] = "/usr/lib/libc.so.6"
    elif how == "bad_graph":
        graph = json.loads(out["graph.json"])
        graph["outputs"] = [999]
        out["graph.json"] = json.dumps(graph).encode()
    elif how == "constant_dtype":  # float64 data for float32 constants
        npz = np.load(io.BytesIO(out["constants.npz"]))
        blob = io.BytesIO()
        np.savez(blob, **{k: npz[k].astype(np.float64) for k in npz.files})
        out["constants.npz"] = blob.getvalue()
    if how not in ("not_json",):
        out["compiled.json"] = json.dumps(doc).encode()
    else:
        out["compiled.json"] = b"{not json"
    return list(out.items()) + extra


TAMPERINGS = ["traversal_key", "traversal_member", "absolute_member", "uppercase_key", "tampered_artifact",
              "tampered_source", "forged_identity", "unlisted_member", "missing_member", "duplicate_member",
              "wrong_kind", "bad_options", "old_version", "extra_field", "not_json", "bad_graph", "constant_dtype"]  # fmt: skip


@pytest.mark.parametrize("how", TAMPERINGS)
def test_a_tampered_file_is_refused_before_anything_is_installed(rng, tmp_path, monkeypatch, how):
    good = tmp_path / "good.tsr"
    compile_graph(_model(rng), "cpu").save(good)
    bad = tmp_path / "work" / "deep" / "bad.tsr"
    bad.parent.mkdir(parents=True)
    _write(bad, _tamper(_members(good), how))
    fresh = tmp_path / "work" / "deep" / "cache"
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(fresh))
    with pytest.raises(FileFormatError, match=str(bad).replace(".", r"\.")):
        load_compiled(bad)
    assert not fresh.exists() or not any(p.is_file() for p in fresh.rglob("*")), sorted(fresh.rglob("*"))
    assert not list(tmp_path.rglob("escaped*")) and not Path("/tmp/tessera-escaped.so").exists()


def test_a_good_file_installs_entries_under_keys_recomputed_from_their_source(rng, tmp_path, monkeypatch):
    path = tmp_path / "good.tsr"
    compile_graph(_model(rng), "cpu").save(path)
    doc = json.loads(_members(path)["compiled.json"])
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "fresh"))
    load_compiled(path)
    for art in doc["artifacts"]:
        identity = cache.Identity(art["kind"], art["compiler"], art["flags"], art["machine"])
        source = _members(path)[f"artifacts/{art['key']}/kernel.c"].decode()
        assert identity.key(source) == art["key"]
        installed = cache.lookup(art["key"], "kernel.so")
        assert installed is not None and cache.sha256_bytes(installed.read_bytes()) == art["sha256"]


@pytest.mark.parametrize("data", [b"not a zip at all", b""])
def test_unreadable_files_are_refused(tmp_path, data):
    path = tmp_path / "bad.tsr"
    path.write_bytes(data)
    with pytest.raises(FileFormatError, match="not a readable compiled-graph file"):
        load_compiled(path)


def test_bad_paths_are_named(rng, tmp_path):
    compiled = compile_graph(_model(rng), "cpu")
    with pytest.raises(ArgumentError, match="folder .*missing does not exist"):
        compiled.save(tmp_path / "missing" / "m.tsr")
    with pytest.raises(ArgumentError, match="not a file"):
        load_compiled(tmp_path)
    with pytest.raises(ArgumentError, match="no such file"):
        load_compiled(tmp_path / "absent.tsr")


def test_the_cache_refuses_keys_and_names_that_are_not_its_own(tmp_path):
    identity = cache.Identity("c", "gcc 1", "-O3", "cpu")
    for key in ("../../x", "ABCDEF" * 7, "a" * 39, "a" * 40 + "/", "/" + "a" * 39):
        with pytest.raises(ValueError, match="not an artifact cache key"):
            cache.lookup(key, "kernel.so")
    for name in ("../kernel.so", "/etc/passwd", ".hidden", "a/b", "meta.json", ""):
        with pytest.raises(ValueError, match="not a valid artifact file name"):
            cache.install(identity, name, "int x;", "kernel.so", b"\x7fELF")
        with pytest.raises(ValueError, match="not a valid artifact file name"):
            cache.install(identity, "kernel.c", "int x;", name, b"\x7fELF")
    assert not list(tmp_path.rglob("passwd"))


# ---- the GPU: anchors' artifacts and tuning records travel too ----------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("tune", [False, True])
def test_a_cuda_model_with_anchors_runs_from_its_file_without_nvcc(tmp_path, tune):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    b = GraphBuilder("anchored", device="cuda")
    x = b.input("x", [48, 64], "float16")
    w1 = b.constant((rng.standard_normal((128, 64)) * 0.1).astype(np.float16))
    h = b.op("gelu", b.op("linear", x, w1, b.constant(rng.standard_normal(128).astype(np.float16))))
    y = b.op("matmul", h, b.constant((rng.standard_normal((128, 96)) * 0.1).astype(np.float16)))
    b.output(b.op("softmax", b.op("relu", y)))
    compiled = compile_graph(b.build(), "cuda", tune=tune)
    assert compiled.summary()["steps"].get("anchor", 0) == 3  # two GEMMs and the softmax row kernel
    xv = rng.standard_normal((48, 64)).astype(np.float16)
    expected = compiled(torch.from_numpy(xv).cuda())[0].float().cpu().numpy()
    path = tmp_path / "anchored.tsr"
    compiled.save(path)
    doc = json.loads(_members(path)["compiled.json"])
    assert len(doc["artifacts"]) >= 3  # the anchors (and any fused group)
    assert bool(doc["tuning"]) == tune
    np.save(tmp_path / "x.npy", xv)
    np.save(tmp_path / "expected.npy", expected)
    script = textwrap.dedent(f"""
        import numpy as np, torch
        from tessera.graph.compiler import load_compiled
        compiled = load_compiled({str(path)!r})
        out = compiled(torch.from_numpy(np.load({str(tmp_path / 'x.npy')!r})).cuda())[0].float().cpu().numpy()
        np.testing.assert_allclose(out, np.load({str(tmp_path / 'expected.npy')!r}), rtol=1e-3, atol=1e-4)
        anchors = [s for s in compiled.steps if s.kind == "anchor"]
        assert all(hasattr(k, "kernel") for s in anchors for k in s.prepared()), "an anchor left its template"
        assert compiled.summary()["reference_ops"] == []
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=_no_compiler_env(tmp_path / "fresh-cache"), timeout=600)  # fmt: skip
    assert res.returncode == 0 and "ok" in res.stdout, res.stdout + res.stderr[-3000:]
