"""ONNX's backend node tests through tessera: `tessera.onnx.compile(model, "cpu")` (the
importer, then `compile_graph`, specialised on shape-like inputs), one test per model.

    python3 bench/onnx_node_tests.py fetch              # the test data, into the cache (pip + PyPI)
    python3 bench/onnx_node_tests.py run [-j 2] [-k PATTERN] [--out DIR] [--target cuda]
    python3 bench/onnx_node_tests.py list               # what is run and what is excluded, and why

The test data (onnx/backend/test/data/node/*: a model.onnx and protobuf inputs and outputs per
test) is not in the onnx wheels; `fetch` downloads the onnx sdist that ships it and extracts
the node tests into `data_dir()`.  `$TESSERA_ONNX_NODE_DATA` names another copy.

A test passes when every output has the expected shape and dtype and is close to the expected
values with onnx's own tolerances (onnx.backend.test.runner: rtol 1e-3, atol 1e-7).  Each test
runs in a worker process (a crash or hang costs that test only); results go to
`<out>/<date>-<target>-onnx-node.jsonl` (one row per test) and `.md` (pass rate, failures by
cause).  `--target cuda` runs the same tests on the GPU (inputs copied there, outputs back).
The CPU-tier pytest (tests/test_onnx_node_suite.py) runs `CI_SUBSET` with the same machinery.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

ONNX_SDIST_VERSION = "1.22.0"  # the newest onnx sdist that ships the node test data (1.23's does not)
RTOL, ATOL = 1e-3, 1e-7
TEST_TIMEOUT_S = 300

# ---- what is excluded, and why ----------------------------------------------------------------------------------
# A test is excluded when its model uses one of these ops (the expanded forms included), a
# non-tensor input or output, a dtype below, or matches a name pattern.  Everything else counts.
EXCLUDED_OPS: dict[str, str] = {
    # Training: losses and optimizers are not part of inference graphs.
    **dict.fromkeys(["NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss", "Gradient", "Adagrad", "Adam",
                     "Momentum"], "training op"),  # fmt: skip
    # Sequences and optionals: tessera's graphs carry tensors only.
    **dict.fromkeys(["SequenceEmpty", "SequenceInsert", "SequenceLength", "SequenceMap", "SequenceAt",
                     "SequenceConstruct", "SequenceErase", "SplitToSequence", "ConcatFromSequence",
                     "Optional", "OptionalGetElement", "OptionalHasElement"], "sequence/optional values"),  # fmt: skip
    # Strings: no string tensors in tessera.
    **dict.fromkeys(["StringConcat", "StringNormalizer", "StringSplit", "RegexFullMatch", "TfIdfVectorizer"],
                    "string tensors"),  # fmt: skip
    # Random numbers: the expected outputs come from one generator's stream, not a semantics to match.
    **dict.fromkeys(["Bernoulli", "RandomUniformLike", "RandomNormalLike", "RandomUniform", "RandomNormal",
                     "Multinomial"], "random numbers (outputs are not reproducible across implementations)"),  # fmt: skip
    # Image decoding (JPEG/PNG/... bytes to pixels) is a codec, not a tensor computation.
    "ImageDecoder": "image codec",
}
EXCLUDED_DOMAINS = "non-default domain (ai.onnx.ml, ai.onnx.preview, ai.onnx.preview.training)"
# ONNX element types tessera does not compute with: strings, complex and the sub-byte and 8-bit
# float formats (declared in tessera.ir.dtypes, rejected by the backends).
EXCLUDED_ELEM_TYPES: dict[int, str] = {
    8: "string tensors", 14: "complex tensors", 15: "complex tensors",
    **dict.fromkeys([17, 18, 19, 20, 23, 24], "float8/float4 tensors (tessera does not compute with them yet)"),
    **dict.fromkeys([21, 22, 25, 26], "2-/4-bit integer tensors (tessera does not compute with them yet)"),
}  # fmt: skip
EXCLUDED_TESTS: dict[str, str] = {
    "test_training_dropout*": "training op (dropout in training mode draws random numbers)",
    "test_batchnorm_*training_mode*": "training op (batch statistics and running-stat updates)",
}

# Failures understood and accepted, with the reason (the report and the CPU tier read this).
KNOWN_FAILURES = {
    "test_dft_inverse": "the expected values carry complex64 FFT rounding (~1e-6), beyond atol 1e-7 near zero; "
                        "tessera's float64 DFT is closer to the exact transform",
    "test_dft_inverse_opset19": "as test_dft_inverse",
    "test_scan_sum": "opset 8's batched Scan: onnx.version_converter changes the model's inputs (drops the batch "
                     "axis); refused with that reason",
}  # fmt: skip

# The CPU tier's selection (ci_selection): these, one or two per op family, chosen to cover the
# importer's rules, the folding of shape arithmetic and the specialisation on shape-like inputs,
# plus every CI_STRIDE-th counted test -- about 300 tests, about 100 s in one process on 2 cores
# with a cold kernel cache (measured 2026-12-07; the whole suite is about 1400 tests).
CI_SUBSET = [
    "test_add_bcast", "test_mul_uint8", "test_div_int8", "test_pow_types_int32_float32", "test_mod_mixed_sign_int32",
    "test_mod_mixed_sign_float32", "test_and_bcast4v3d", "test_where_long_example", "test_cast_FLOAT_to_BFLOAT16", "test_cast_DOUBLE_to_FLOAT",
    "test_clip_default_inbounds", "test_relu", "test_selu", "test_prelu_broadcast", "test_gelu_tanh_2",
    "test_softmax_axis_0", "test_logsoftmax_negative_axis", "test_reduce_sum_keepdims_example",
    "test_reduce_mean_negative_axes_keepdims_random", "test_reduce_l2_do_not_keepdims_example",
    "test_argmax_negative_axis_keepdims_example_select_last_index", "test_top_k_same_values_2d", "test_top_k_uint64", "test_cumsum_1d_reverse_exclusive",
    "test_matmul_4d", "test_gemm_all_attributes", "test_conv_with_strides_padding", "test_convtranspose_pads",
    "test_maxpool_2d_pads", "test_maxpool_with_argmax_2d_precomputed_pads", "test_averagepool_2d_dilations",
    "test_averagepool_1d_default", "test_globalaveragepool", "test_batchnorm_example",
    "test_layer_normalization_4d_axis_negative_2", "test_layer_normalization_2d_axis0_expanded",
    "test_rms_normalization_3d_axis1_epsilon", "test_group_normalization_example", "test_instancenorm_example",
    "test_flatten_negative_axis1", "test_reshape_negative_extended_dims", "test_expand_dim_changed",
    "test_slice_neg_steps", "test_split_variable_parts_2d_opset18", "test_squeeze_negative_axes",
    "test_unsqueeze_three_axes", "test_transpose_all_permutations_3", "test_concat_3d_axis_negative_1",
    "test_gather_negative_indices", "test_gathernd_example_int32_batch_dim1", "test_scatter_elements_with_reduction_max",
    "test_scatternd_add", "test_tile_precomputed", "test_constant_pad_negative_axes", "test_edge_pad", "test_reflect_pad", "test_range_int32_type_negative_delta_expanded",
    "test_constantofshape_int_shape_zero", "test_tril_neg", "test_triu_one_row", "test_depthtospace_crd_mode_example",
    "test_resize_upsample_sizes_nearest", "test_resize_downsample_scales_linear", "test_einsum_batch_matmul",
    "test_attention_4d_gqa", "test_attention_3d_causal_expanded", "test_rotary_embedding",
    "test_dropout_default_mask", "test_shape_start_negative_1", "test_size_example", "test_sum_example",
    "test_mean_two_inputs", "test_not_2d", "test_reduce_max_empty_set", "test_lrn",
    "test_bitcast_float32_to_int32", "test_det_nd", "test_pow_types_int64_int64", "test_top_k_smallest",
    "test_scatter_elements_with_duplicate_indices", "test_scatternd_multiply",
]  # fmt: skip


CI_STRIDE = 6


def ci_selection(counted: list[str]) -> list[str]:
    """The CPU tier's tests among the counted ones: CI_SUBSET and every CI_STRIDE-th test."""
    pick = set(CI_SUBSET) | set(counted[::CI_STRIDE])
    return [n for n in counted if n in pick]


# ---- the data ------------------------------------------------------------------------------------------------------
def data_dir() -> Path:
    """Where the node tests are: $TESSERA_ONNX_NODE_DATA, else the cache `fetch` fills."""
    env = os.environ.get("TESSERA_ONNX_NODE_DATA")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "tessera" / f"onnx-{ONNX_SDIST_VERSION}-node-tests"


def missing_data_reason(root: Path | None = None) -> str | None:
    """None when the node tests are there, else what to do about it."""
    root = root or data_dir()
    if root.is_dir() and any(root.glob("test_*/model.onnx")):
        return None
    return (f"ONNX node test data not found at {root}: run `python3 bench/onnx_node_tests.py fetch` "
            f"(downloads the onnx {ONNX_SDIST_VERSION} sdist with pip) or set $TESSERA_ONNX_NODE_DATA")  # fmt: skip


def fetch(dest: Path, version: str = ONNX_SDIST_VERSION) -> int:
    """Download the onnx sdist with pip and extract onnx/backend/test/data/node/* into dest."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "onnx", f"onnx=={version}",
               "-d", tmp]  # fmt: skip
        subprocess.run(cmd, check=True)
        (sdist,) = Path(tmp).glob("onnx-*.tar.gz")
        prefix = f"onnx-{version}/onnx/backend/test/data/node/"
        staging = dest.with_name(dest.name + ".partial")
        staging.mkdir(parents=True, exist_ok=True)
        n = 0
        with tarfile.open(sdist) as tar:
            for member in tar:
                if member.isfile() and member.name.startswith(prefix) and ".." not in member.name:
                    rel = member.name[len(prefix) :]
                    target = staging / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]
                    n += 1
        if n == 0:
            raise SystemExit(f"the onnx {version} sdist has no node test data")
        if dest.exists():
            import shutil

            shutil.rmtree(dest)
        staging.rename(dest)
    return n


# ---- selection -----------------------------------------------------------------------------------------------------
def exclusion(model: Any, test: str) -> str | None:
    """Why a test is excluded, or None when it counts."""
    for pattern, why in EXCLUDED_TESTS.items():
        if fnmatch.fnmatch(test, pattern):
            return why
    return _graph_exclusion(model.graph)


def _graph_exclusion(graph: Any) -> str | None:
    """The exclusion reason of a graph or of any subgraph (control-flow bodies) inside it."""
    for vi in [*graph.input, *graph.output]:
        kind = vi.type.WhichOneof("value")
        if kind not in ("tensor_type", None):
            return "sequence/optional values"
        if kind == "tensor_type" and vi.type.tensor_type.elem_type in EXCLUDED_ELEM_TYPES:
            return EXCLUDED_ELEM_TYPES[vi.type.tensor_type.elem_type]
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            return EXCLUDED_DOMAINS
        if node.op_type in EXCLUDED_OPS:
            return EXCLUDED_OPS[node.op_type]
        for a in node.attribute:
            for sub in [a.g] if a.HasField("g") else list(a.graphs):
                why = _graph_exclusion(sub)
                if why:
                    return why
    return None


def op_under_test(model: Any, test: str) -> str:
    """The ONNX op a test is about: the single op of its model, else the ops it uses."""
    ops = sorted({n.op_type for n in model.graph.node})
    return ops[0] if len(ops) == 1 else "+".join(ops) if len(ops) <= 3 else f"{len(ops)} ops ({test})"


def list_tests(root: Path) -> list[tuple[str, str | None]]:
    import onnx

    out = []
    for d in sorted(root.glob("test_*")):
        if (d / "model.onnx").is_file():
            model = onnx.load(str(d / "model.onnx"), load_external_data=False)
            out.append((d.name, exclusion(model, d.name)))
    return out


# ---- one test ------------------------------------------------------------------------------------------------------
def _read_tensor(path: Path) -> np.ndarray:
    import onnx
    from onnx import numpy_helper

    t = onnx.TensorProto()
    t.ParseFromString(path.read_bytes())
    return numpy_helper.to_array(t)


def classify(exc: BaseException) -> str:
    """A failure's cause, for the report (from the error's type and message)."""
    from tessera.errors import CompilationError, UnsupportedError

    msg = str(exc)
    if isinstance(exc, UnsupportedError):
        if "is not supported by tessera" in msg or "is not supported" in msg and "ONNX op " in msg.split(":")[0]:
            return "unsupported op"
        if "opset" in msg:
            return "opset"
        if "known at import time" in msg or "must be a constant" in msg:
            return "shape-like input"
        return "unsupported attribute or mode"
    if isinstance(exc, CompilationError):
        return "compiler error"
    return f"error ({type(exc).__name__})"


def run_one(test_dir: Path, target: str = "cpu", arrays: str = "auto") -> dict[str, Any]:
    """Import, compile and run one node test; a row for the report."""
    import onnx

    import tessera.frontend.onnx as tonnx
    from tessera.graph.compiler import compile_graph

    row: dict[str, Any] = {"test": test_dir.name}
    t0 = time.perf_counter()
    model = onnx.load(str(test_dir / "model.onnx"))
    row["op"] = op_under_test(model, test_dir.name)
    row["opset"] = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    data = sorted(test_dir.glob("test_data_set_*"))
    try:
        if hasattr(tonnx, "compile"):
            run = tonnx.compile(model, target, **({"arrays": arrays} if target == "cuda" else {}))
        else:  # before the specialising wrapper existed
            graph = tonnx.load(model)
            compiled = compile_graph(graph, target)
            run = compiled
        for ds in data:
            inputs = [_read_tensor(ds / f"input_{i}.pb") for i in range(len(list(ds.glob("input_*.pb"))))]
            expected = [_read_tensor(ds / f"output_{i}.pb") for i in range(len(list(ds.glob("output_*.pb"))))]
            got = [_host(o) for o in run(*inputs)]
            problem = compare(expected, got)
            if problem:
                row.update(status="fail", cause=problem[0], detail=problem[1])
                break
        else:
            row.update(status="pass")
        summary = run.summary()
        # how the test ran: every operator compiled, folded away at import, or some in numpy references
        row["operators"] = summary.get("operators", 0)
        row["reference_ops"] = summary.get("reference_ops", [])
        row["specialized_on"] = summary.get("shape_inputs", [])
    except Exception as exc:  # noqa: BLE001  (every failure is a row of the report)
        row.update(status="fail", cause=classify(exc), detail=f"{type(exc).__name__}: {str(exc)[:400]}")
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def _host(a: Any) -> np.ndarray:
    if type(a).__module__.startswith("torch"):
        from tessera.ops.compiled import torch_to_numpy

        return torch_to_numpy(a)
    if hasattr(a, "__tessera_view__") and hasattr(a, "numpy"):  # a tessera DeviceArray
        return a.numpy()
    return np.asarray(a)


def compare(expected: list[np.ndarray], got: list[np.ndarray]) -> tuple[str, str] | None:
    """None when got matches expected the way onnx's backend runner checks it, else (cause, detail)."""
    if len(got) != len(expected):
        return "wrong result", f"{len(got)} outputs, expected {len(expected)}"
    for i, (e, g) in enumerate(zip(expected, got)):
        if g.shape != e.shape:
            return "wrong shape", f"output {i}: shape {g.shape}, expected {e.shape}"
        if g.dtype != e.dtype:
            return "wrong dtype", f"output {i}: dtype {g.dtype}, expected {e.dtype}"
        if e.dtype.name == "bfloat16":  # compare as float32 (numpy cannot test bfloat16 NaNs)
            e, g = e.astype(np.float32), g.astype(np.float32)
        if e.dtype.kind in "fc":
            ok = np.allclose(g, e, rtol=RTOL, atol=ATOL, equal_nan=True)
        else:
            ok = np.array_equal(g, e)
        if not ok:
            bad = np.argwhere(~np.isclose(g, e, rtol=RTOL, atol=ATOL, equal_nan=True)) if e.dtype.kind in "fc" \
                else np.argwhere(g != e)  # fmt: skip
            where = tuple(int(v) for v in bad[0]) if len(bad) and g.ndim else ()
            return "wrong result", f"output {i}: {len(bad)} of {e.size} differ, first at {where}: {g[where]!r} vs {e[where]!r}"
    return None


# ---- workers: one subprocess runs tests one by one; a crash or a hang costs one test ---------------------------------
def _worker() -> None:
    import logging

    logging.disable(logging.WARNING)  # reference steps log a warning each; the report says which ran
    target = os.environ.get("TESSERA_NODE_TEST_TARGET", "cpu")
    arrays = os.environ.get("TESSERA_NODE_TEST_ARRAYS", "auto")
    for line in sys.stdin:
        test_dir = Path(line.strip())
        print(json.dumps(run_one(test_dir, target, arrays)), flush=True)


def run_tests(root: Path, names: list[str], jobs: int = 1, timeout_s: float = TEST_TIMEOUT_S,
              progress: bool = True, target: str = "cpu", arrays: str = "auto") -> list[dict[str, Any]]:  # fmt: skip
    """Run the named tests in `jobs` worker processes on target; rows in the order of names."""
    import select

    pending = list(names)
    rows: dict[str, dict[str, Any]] = {}
    workers: list[dict[str, Any]] = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent.parent),
                                                        os.environ.get("PYTHONPATH", "")]),
               TESSERA_NODE_TEST_TARGET=target, TESSERA_NODE_TEST_ARRAYS=arrays)  # fmt: skip

    def start() -> dict[str, Any]:
        p = subprocess.Popen([sys.executable, __file__, "_worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=env)  # fmt: skip
        return {"proc": p, "test": None, "since": 0.0}

    def give(w: dict[str, Any]) -> None:
        if pending:
            w["test"], w["since"] = pending.pop(0), time.monotonic()
            w["proc"].stdin.write(str(root / w["test"]) + "\n")
            w["proc"].stdin.flush()
        else:
            w["test"] = None
            w["proc"].stdin.close()

    for _ in range(max(1, min(jobs, len(pending)))):
        w = start()
        workers.append(w)
        give(w)
    while any(w["test"] for w in workers):
        busy = [w for w in workers if w["test"]]
        ready, _, _ = select.select([w["proc"].stdout for w in busy], [], [], 1.0)
        for w in busy:
            line = w["proc"].stdout.readline() if w["proc"].stdout in ready else None
            lost = None
            if line:
                row = json.loads(line)
            elif line == "" or w["proc"].poll() is not None:
                lost = f"worker died (exit {w['proc'].wait()})"
            elif time.monotonic() - w["since"] > timeout_s:
                w["proc"].kill()
                w["proc"].wait()
                lost = f"timed out after {timeout_s:.0f} s"
            else:
                continue
            if lost:
                row = {"test": w["test"], "status": "fail", "cause": "crash" if "died" in lost else "timeout",
                       "detail": lost, "seconds": round(time.monotonic() - w["since"], 2)}  # fmt: skip
                w.update(start())
            rows[row["test"]] = row
            if progress:
                print(f"[{len(rows)}/{len(names)}] {row['test']}: {row['status']}"
                      + (f" ({row['cause']})" if row["status"] != "pass" else ""), file=sys.stderr, flush=True)  # fmt: skip
            give(w)
    for w in workers:
        w["proc"].wait()
    return [rows[n] for n in names if n in rows]


# ---- the report ----------------------------------------------------------------------------------------------------
def report(rows: list[dict[str, Any]], excluded: list[tuple[str, str]], header: dict[str, Any]) -> str:
    ran = [r for r in rows if r["status"] != "excluded"]
    passed = sum(r["status"] == "pass" for r in ran)
    lines = [f"# ONNX backend node tests on tessera's {header['target'].upper()} path ({header['date']})", "",
             f"- commit `{header['commit']}`, onnx {header['onnx']} (installed), node test data of onnx "
             f"{ONNX_SDIST_VERSION}; `{header['command']}`",
             f"- **{passed} / {len(ran)} pass ({100 * passed / max(1, len(ran)):.1f}%)**; {len(excluded)} tests excluded "
             "(below); a test passes when every output matches in shape, dtype and value (rtol 1e-3, atol 1e-7, "
             "onnx's own runner tolerances)", ""]  # fmt: skip
    ok = [r for r in ran if r["status"] == "pass"]
    ref = [r for r in ok if r.get("reference_ops")]
    folded = [r for r in ok if not r.get("operators") and not r.get("reference_ops")]
    spec = [r for r in ok if r.get("specialized_on")]
    lines += ["## How the passing tests ran", "",
              f"- {len(ok) - len(ref) - len(folded)} compiled entirely (generated C kernels for every operator)",
              f"- {len(folded)} folded to constants at import time (every value known then)",
              f"- {len(ref)} with some operators in their numpy reference (logged by compile_graph; below)",
              f"- {len(spec)} of them specialised on the values of shape-like inputs (tessera.onnx.compile)", ""]  # fmt: skip
    if ref:
        kinds = Counter(k.split(":")[0] for r in ref for k in r["reference_ops"])
        lines += ["| graph operator run in its numpy reference | tests | reason (one) |", "|---|---:|---|"]
        for kind, n in kinds.most_common():
            reason = next(k.split(": ", 1)[1] for r in ref for k in r["reference_ops"] if k.split(":")[0] == kind)
            lines.append(f"| {kind} | {n} | {reason.replace('|', '/')} |")
        lines.append("")
    causes = Counter(r["cause"] for r in ran if r["status"] != "pass")
    if causes:
        lines += ["## Failures by cause", "", "| cause | tests | examples |", "|---|---:|---|"]
        for cause, n in causes.most_common():
            ex = [r["test"] for r in ran if r.get("cause") == cause][:4]
            lines.append(f"| {cause} | {n} | {', '.join(ex)} |")
        lines += ["", "## Failing tests", "", "| test | cause | detail | known: why |", "|---|---|---|---|"]
        for r in ran:
            if r["status"] != "pass":
                detail = re.sub(r"\s+", " ", r.get("detail", ""))[:200].replace("|", "\\|")
                lines.append(f"| {r['test']} | {r['cause']} | {detail} | {KNOWN_FAILURES.get(r['test'], '')} |")
        lines.append("")
    if header.get("baseline"):
        lines += _baseline_section(header["baseline"], ran)
    why = Counter(reason for _, reason in excluded)
    lines += ["## Excluded", "", "| reason | tests |", "|---|---:|"]
    lines += [f"| {reason} | {n} |" for reason, n in why.most_common()]
    return "\n".join(lines) + "\n"


def _baseline_section(path: str, ran: list[dict[str, Any]]) -> list[str]:
    """Before/after against an earlier run's jsonl (the same tests counted)."""
    rows = {r["test"]: r for r in map(json.loads, Path(path).read_text().splitlines()) if r["status"] != "excluded"}
    names = [r["test"] for r in ran if r["test"] in rows]
    before = sum(rows[n]["status"] == "pass" for n in names)
    after = sum(r["status"] == "pass" for r in ran if r["test"] in rows)
    commit = next(iter(rows.values()), {}).get("commit", "?")
    lines = [f"## Compared with commit `{commit}` ({Path(path).name})", "",
             f"- the same {len(names)} tests: {before} passed then ({100 * before / max(1, len(names)):.1f}%), "
             f"{after} now ({100 * after / max(1, len(names)):.1f}%)", "",
             "| cause of failure then | tests |", "|---|---:|"]  # fmt: skip
    causes = Counter(rows[n]["cause"] for n in names if rows[n]["status"] != "pass")
    lines += [f"| {c} | {k} |" for c, k in causes.most_common()]
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["run", "fetch", "list", "_worker"])
    ap.add_argument("-j", "--jobs", type=int, default=1)
    ap.add_argument("-k", "--pattern", default=None, help="fnmatch pattern(s) of test names, comma-separated")
    ap.add_argument("--ci-subset", action="store_true", help="run the CPU tier's selection only")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--data", default=None, help="the node test folder (default: $TESSERA_ONNX_NODE_DATA or the cache)")
    ap.add_argument("--target", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--arrays", choices=["auto", "torch", "native"], default="auto",
                    help="with --target cuda: torch CUDA tensors or tessera's own device arrays (no torch)")
    ap.add_argument("--if-missing", action="store_true", help="fetch: only when the data is not there yet")
    ap.add_argument("--baseline", default=None, help="an earlier run's jsonl to compare with in the report")
    opts = ap.parse_args(argv)
    if opts.command == "_worker":
        _worker()
        return 0
    root = Path(opts.data) if opts.data else data_dir()
    if opts.command == "fetch":
        if opts.if_missing and missing_data_reason(root) is None:
            print(f"node test data already at {root}")
        else:
            print(f"{fetch(root)} files extracted into {root}")
        return 0
    reason = missing_data_reason(root)
    if reason:
        print(reason, file=sys.stderr)
        return 2
    tests = list_tests(root)
    if opts.command == "list":
        for name, why in tests:
            print(name, "-" if why is None else f"EXCLUDED: {why}")
        return 0
    chosen = [n for n, why in tests if why is None]
    if opts.ci_subset:
        chosen = ci_selection(chosen)
    if opts.pattern:
        pats = opts.pattern.split(",")
        chosen = [n for n in chosen if any(fnmatch.fnmatch(n, p) for p in pats)]
    excluded = [(n, why) for n, why in tests if why is not None]
    rows = run_tests(root, chosen, opts.jobs, target=opts.target, arrays=opts.arrays)
    import onnx
    from harness import current_commit

    date = datetime.date.today().isoformat()
    header = {"date": date, "commit": current_commit()[:12], "onnx": onnx.__version__, "baseline": opts.baseline, "target": opts.target, "arrays": opts.arrays,
              "command": "python3 bench/onnx_node_tests.py " + " ".join(argv if argv is not None else sys.argv[1:])}  # fmt: skip
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"{date}-{opts.target}-onnx-node.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({**r, "commit": header["commit"]}) + "\n")
        for n, why in excluded:
            f.write(json.dumps({"test": n, "status": "excluded", "cause": why, "commit": header["commit"]}) + "\n")
    text = report(rows, excluded, header)
    (out / f"{date}-{opts.target}-onnx-node.md").write_text(text)
    print(text.split("\n## Failing tests")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
