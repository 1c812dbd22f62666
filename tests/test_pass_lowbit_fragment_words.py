"""The lowbit_fragment_words pass and the register-A prefill plan it enables.

The pass appends to lowbit_linear the codes in mma's k order (tessera.ir.lowbit.FRAGMENT_SPAN),
only where the register-A kernel may run: an SM90 GPU, float16 x, rows past DECODE_MAX_M, and
$TESSERA_LOWBIT_PREFILL 'register', or 'auto' with tuning on.  The plan (tessera.templates.lowbit.plan._plan_register_a)
then reads those words and fuses the graph's epilogue into the kernel's stores: run here on
the host model (tests/cuda_on_host.py) at odd sizes.  GPU tier: tests/test_pass_lowbit_projections.py
compiles a block with TESSERA_LOWBIT_PREFILL=register."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from test_lowbit_gemm import _Source, close, product
from test_lowbit_prefill import random_case

import tessera as ts
from tessera.eager.quantize import QuantizedLinear
from tessera.errors import UnsupportedError
from tessera.graph import GraphBuilder
from tessera.ir import lowbit
from tessera.quant.layout import unpack_units
from tessera.quant.quantize import quantize_weight
from tessera.templates.lowbit import gemm_rs as rs
from tessera.templates.lowbit import gemm_rs_config as rs_config
from tessera.templates.lowbit.fragment_words import add_fragment_words

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")


def _graph(rng, rows, weight="int4", n=40, k=520, group=32, zp=False, dtype="float16"):
    consts, attrs = QuantizedLinear(quantize_weight(rng.standard_normal((n, k)) * 0.1, weight, group, zp)).graph_operands()
    b = GraphBuilder("lin")
    x = b.input("x", [rows, k], dtype)
    b.output(b.op("lowbit_linear", x, *(b.constant(c) for c in consts), **attrs))
    return b.build()


@pytest.fixture
def hopper(monkeypatch):
    """The pass's view of the GPU: an SM90 one (the CPU tier has none)."""
    import tessera.runtime.cuda as cuda

    monkeypatch.setattr(cuda, "device_properties", lambda: type("P", (), {"capability": (9, 0)})())
    monkeypatch.setenv("TESSERA_LOWBIT_PREFILL", "register")
    return monkeypatch


@pytest.mark.parametrize("weight,zp", [("int4", False), ("uint3", True), ("e2m1", None), ("int7", False), ("uint8", True)])
def test_fragment_words_hold_the_operators_codes(rng, hopper, weight, zp):
    """The fifth input is as many words, and unpacks in FRAGMENT_SPAN to the codes the words
    hold in the operator's span; the graph verifies and its reference is unchanged."""
    g = _graph(rng, "s", weight, n=40, k=520, zp=zp)
    op = g.operators[0]
    assert add_fragment_words(g, tune=False) == 1 and len(op.inputs) == 5  # (symbolic rows: may prefill)
    g.verify()
    a, words, fragment = op.attrs, op.inputs[1].data, op.inputs[4].data
    t = ts.dtype(a["wtype"])
    assert fragment.dtype == np.uint32 and fragment.shape == words.shape
    np.testing.assert_array_equal(unpack_units(fragment, t, a["n"], a["k"], lowbit.FRAGMENT_SPAN),
                                  unpack_units(words, t, a["n"], a["k"], a.get("span", 16)))  # fmt: skip


def test_the_pass_adds_words_only_where_the_register_a_kernel_may_run(rng, hopper):
    import tessera.runtime.cuda as cuda

    assert add_fragment_words(_graph(rng, 64), tune=False) == 0  # DECODE_MAX_M rows: the decode kernels only
    assert add_fragment_words(_graph(rng, 65), tune=False) == 1
    assert add_fragment_words(_graph(rng, 300, dtype="float32"), tune=False) == 0  # (the CPU's row kernel takes float32)
    g = _graph(rng, 300)
    assert add_fragment_words(g, tune=False) == 1 and add_fragment_words(g, tune=False) == 0  # once
    import tessera.templates.lowbit.fragment_words as pass_module

    for opt_in in (False, True):  # (AUTO_TUNES_IT: whether tuning under 'auto' may pick the kernel)
        hopper.setattr(pass_module, "AUTO_TUNES_IT", opt_in)
        for mode, tune, want in (("auto", False, 0), ("auto", True, int(opt_in)), ("", True, int(opt_in)),
                                 ("dequant", True, 0), ("fused", True, 0), ("register", False, 1)):  # fmt: skip
            hopper.setenv("TESSERA_LOWBIT_PREFILL", mode)
            assert add_fragment_words(_graph(rng, 300), tune) == want, (mode, tune, opt_in)
    hopper.setattr(cuda, "device_properties", lambda: type("P", (), {"capability": (8, 9)})())
    assert add_fragment_words(_graph(rng, 300), tune=True) == 0  # not Hopper


def test_the_opdef_checks_the_fifth_input(rng):
    """A fifth input must be uint32 words of the words' shape; the reference reads the words alone."""
    from tessera.graph.symbolic import ShapeError

    consts, attrs = QuantizedLinear(quantize_weight(rng.standard_normal((32, 256)) * 0.1, "int4", 32)).graph_operands()
    graphs = []
    for extra in ([], [consts[0]]):
        b = GraphBuilder("lin")
        x = b.input("x", [100, 256], "float16")
        if extra:
            with pytest.raises(ShapeError, match="fragment-order words must be uint32"):
                b.op("lowbit_linear", x, *(b.constant(c) for c in consts), b.constant(consts[0][:-4]), **attrs)
        b.output(b.op("lowbit_linear", x, *(b.constant(c) for c in [*consts, *extra]), **attrs))
        graphs.append(b.build())
    xs = rng.standard_normal((100, 256)).astype(np.float16)
    np.testing.assert_array_equal(graphs[0].run(xs)[0], graphs[1].run(xs)[0])


def test_a_register_a_prefill_needs_the_fragment_words():
    from tessera.templates.lowbit.plan import plan_lowbit_linear

    attrs = {"wtype": "int4", "n": 96, "k": 512, "group_size": 128, "has_bias": False, "span": 2}
    with pytest.raises(UnsupportedError, match="fifth input"):
        plan_lowbit_linear((300, 512), attrs, 96 * 512 // 8, (96, 4), (1, 1), None, False, rs.CONFIGS[0])


STREAM_K = rs_config.STREAM_K_CONFIGS[2]  # 128 tokens a tile: 300 rows of N=100 are 3 tiles, each cut in 5 shares


@needs_nvcc
@pytest.mark.slow
def test_register_a_anchor_run_on_the_host_matches_the_reference(rng, tmp_path):
    """plan_lowbit_linear past DECODE_MAX_M with a register-A config and the fifth input: x [2,
    150, K] through its tensor map, the words of the fifth input (with the word ring through
    theirs), residual + silu fused into the stores (the TMA-epilogue config runs the stmatrix
    one), N not a multiple of 8; without an epilogue, the TMA unit's stores where N % 8 == 0
    (zero points, the word ring) and the stmatrix ones where not; a stream-K config whose every
    tile is cut into shares (the epilogue applied once, by the share that completes the tile);
    two calls each."""
    from cuda_on_host import HostTensorMap, run_on_host

    from tessera import ops
    from tessera.ir import dtypes
    from tessera.templates.epilogue import Epilogue
    from tessera.templates.kernel import INPUT, OUTPUT, WORKSPACE
    from tessera.templates.lowbit.plan import plan_lowbit_linear

    cases, refs = [], []
    for name, group, bias, n, k, config, fused, out in (("int4", 64, False, 100, 520, rs.CONFIGS[0], True, "stmatrix"),
                                                        ("uint3", 32, True, 40, 264, rs.CONFIGS[3], False, "tma"),
                                                        ("e2m1", 128, False, 100, 264, rs.CONFIGS[0], False, "stmatrix"),
                                                        ("int5", 128, False, 100, 1032, STREAM_K, True, "stmatrix")):  # fmt: skip
        t = ts.dtype(name)
        c = random_case(rng, t, n, k, group, bias, lowbit.FRAGMENT_SPAN)
        lead, shape = (2, 150), (2, 150, n)
        acc, res = ops.placeholder(shape, "float32", "acc"), ops.placeholder(shape, "float16", "res")
        silu = ops.silu(ops.add(acc, ops.cast(res, dtypes.float32)))
        ep = Epilogue(acc, ops.cast(silu, dtypes.float16), [res]) if fused else None
        attrs = {"wtype": name, "n": n, "k": k, "group_size": group, "has_bias": bias, "span": 2}
        plan = plan_lowbit_linear((*lead, k), attrs, c["words"].size, c["scales"].shape, c["biases"].shape, ep, False,
                                  config, fragment=True)  # fmt: skip
        run = plan.config
        assert len(plan.launches) == 1 and not plan.temporaries and plan.num_inputs == 5
        assert run.epilogue == out and run.words == config.words and run.block_t == config.block_t
        launch = plan.launches[0]
        assert launch.slots[1] == (INPUT, 4) and plan.tensor_maps[1].operand == (INPUT, 4)
        assert plan.tensor_maps[2].operand == ((OUTPUT, 0) if out == "tma" else (WORKSPACE, 0))
        assert {launch.slots[8][1], launch.slots[9][1]} <= plan.zeroed and run.stream_k == (config is STREAM_K)
        params = [p.name for p in launch.func.params]
        assert params[:10] == ["A", "Wq", "S", "Z", "C", "tma_a", "tma_w", "tma_c", "P", "F"]
        m = 300
        for _ in range(2):  # fresh activations each call
            x = (rng.standard_normal((*lead, k)) * 0.5).astype(np.float16)
            r = rng.standard_normal(shape).astype(np.float16)
            wshape = rs.word_shape(c["words"].size, k, t.nbits)
            values = {"A": x, "Wq": c["words"], "S": c["scales"], "Z": c["biases"], "C": np.full(shape, np.nan, np.float16),
                      "tma_a": HostTensorMap("A", (1, m, k), (1, run.block_t, 64)),
                      "tma_w": HostTensorMap("Wq", wshape, (rs.ROWS // 16, 1, *wshape[2:]), swizzle=0),
                      # (with the stmatrix epilogue the plan's map of a workspace slab, never written)
                      "tma_c": HostTensorMap("C", (1, m, n) if out == "tma" else (1, run.block_t, 16),
                                             (1, run.block_t, 16), swizzle=0),
                      # (stream-K: the plan's zeroed sums and tickets, sized for its cut tiles)
                      "P": np.zeros(plan.workspaces[launch.slots[8][1]][0], np.float32),
                      "F": np.zeros(plan.workspaces[launch.slots[9][1]][0], np.uint32)}  # fmt: skip
            if fused:
                values[params[10]] = r
            cases.append((_Source(plan.source), values, "C", launch.func.launch.grid[0].value, 384))
            y = product(x.reshape(m, k), c["ref"]).reshape(shape)
            if fused:
                y = y.astype(np.float16).astype(np.float32) + r
                with np.errstate(over="ignore"):
                    y = y / (1 + np.exp(-y))
            refs.append((name, y))
    for (name, ref), got in zip(refs, run_on_host(tmp_path, cases)):
        assert not np.isnan(got).any() and close(got, ref) < 3e-3, name
