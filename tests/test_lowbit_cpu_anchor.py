"""lowbit_linear on the CPU: the row kernel (tessera.templates.lowbit.cpu_kernels.make_linear_rows) as the
graph's anchor for float32 activations, against the float64 numpy reference over weight types,
group sizes, zero points and odd sizes; its fused epilogue; and `torch.compile(tessera.quantize(
model), backend="tessera")` compiling whole on the CPU (no graph break, no numpy reference)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import tessera as ts
from tessera.backend.isa import vector_lanes
from tessera.eager.quantize import QuantizedLinear
from tessera.graph import GraphBuilder
from tessera.graph.compiler import compile_graph
from tessera.graph.opdefs.lowbit import dequantized_weight
from tessera.ir import dtypes
from tessera.quant.layout import pack_rows
from tessera.quant.quantize import quantize_weight

torch = pytest.importorskip("torch")
tb = importlib.import_module("tessera.frontend.torch.backend")
pytestmark = pytest.mark.skipif(vector_lanes() == 1, reason="the CPU low-bit kernel needs AVX2 or AVX-512")

# (weight type, group size (None: per output channel), zero points)
CASES = [("int1", 32, False), ("int3", 128, True), ("int3", None, False), ("int4", 32, False), ("int4", None, True),
         ("int8", 128, False), ("uint2", 32, True), ("uint6", None, True), ("e2m1", 32, None), ("e4m3", None, None),
         ("e3m2", 128, None), ("e5m2", 64, None),
         # whole fields and the leftover codes' pieces (row_segments), segments cut at group starts
         ("int7", 64, False), ("uint5", 32, True), ("e2m3", None, None), ("int6", 32, False)]  # fmt: skip


def _operands(rng, weight, group, zp, n, k):
    w = rng.standard_normal((n, k)) * 0.1
    consts, attrs = QuantizedLinear(quantize_weight(w, weight, group, zp)).graph_operands()
    return consts, attrs, dequantized_weight(*consts, attrs)


def _lowbit_graph(consts, attrs, m, epilogue=False):
    b = GraphBuilder("lowbit")
    x = b.input("x", [m, attrs["k"]])
    c = [b.constant(a) for a in consts]
    y = b.op("lowbit_linear", x, *c, **attrs)
    if epilogue:  # bias, GELU, a residual input: the anchor's epilogue
        r = b.input("r", [m, attrs["n"]])
        y = b.op("add", b.op("gelu", b.op("add", y, b.constant(np.linspace(-1, 1, attrs["n"], dtype=np.float32)))), r)
    b.output(y)
    return b.build()


@pytest.mark.parametrize("weight,group,zp", CASES, ids=[f"{w}-g{g}-{'z' if z else 'nz'}" for w, g, z in CASES])
@pytest.mark.slow
def test_cpu_lowbit_anchor_matches_the_reference(rng, weight, group, zp):
    n, k = (37, 300) if weight != "int8" else (20, 70)  # N, K not multiples of 16 nor 256
    consts, attrs, w = _operands(rng, weight, group, zp, n, k)
    for m in (1, 3, 17):
        compiled = compile_graph(_lowbit_graph(consts, attrs, m), "cpu")
        assert compiled.summary()["steps"] == {"anchor": 1}, compiled.summary()
        for _ in range(2):
            x = rng.standard_normal((m, k)).astype(np.float32)
            ref = x.astype(np.float64) @ w.T
            np.testing.assert_allclose(compiled(x)[0], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


@pytest.mark.slow
def test_cpu_lowbit_anchor_fuses_its_epilogue_and_takes_symbolic_rows(rng):
    consts, attrs, w = _operands(rng, "int4", 64, False, 40, 264)
    bias = np.linspace(-1, 1, 40)
    compiled = compile_graph(_lowbit_graph(consts, attrs, 5, epilogue=True), "cpu")
    summary = compiled.summary()
    assert summary["steps"] == {"anchor": 1} and summary["fused_ops"] == 3 and not summary["reference_ops"], summary
    x, r = rng.standard_normal((5, 264)).astype(np.float32), rng.standard_normal((5, 40)).astype(np.float32)
    h = x.astype(np.float64) @ w.T + bias
    ref = torch.nn.functional.gelu(torch.from_numpy(h)).numpy() + r
    np.testing.assert_allclose(compiled(x, r)[0], ref, rtol=1e-4, atol=1e-4)
    # rows as a size symbol: the anchor is built per size, never the reference, and the plans of
    # every size share one re-laid copy of the words
    compiled = compile_graph(_lowbit_graph(consts, attrs, "m"), "cpu")
    for m in (2, 7):
        x = rng.standard_normal((m, 264)).astype(np.float32)
        np.testing.assert_allclose(compiled(x)[0], x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-4)
    assert not compiled.summary()["reference_ops"]
    plans = [k.kernel.plan for step in compiled.steps if step.kind == "anchor" for k in step.prepared()]
    assert len(plans) == 2 and plans[0].constants[0] is plans[1].constants[0]
    assert not plans[0].constants[0].flags.writeable


@pytest.mark.parametrize("weight,group,zp", [("int4", 128, False), ("uint3", 64, True), ("e2m1", 32, None),
                                             ("e4m3", 128, None)])  # fmt: skip
@pytest.mark.slow
def test_decode_steps_decode_in_registers_on_several_workers(rng, monkeypatch, weight, group, zp):
    """Up to CPU_DECODE_ROWS rows of x the anchor runs make_linear_decode (no float32 copy of W),
    beyond them the row kernel; both against the reference, split over 3 workers (N = 1031 rows
    unevenly), K = 1100 ending in a part block, several calls with fresh inputs."""
    from tessera.templates.lowbit.plan_cpu import CPU_DECODE_ROWS

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    consts, attrs, w = _operands(rng, weight, group, zp, 1031, 1100)
    for m in (1, CPU_DECODE_ROWS, CPU_DECODE_ROWS + 1):
        compiled = compile_graph(_lowbit_graph(consts, attrs, m), "cpu")
        for _ in range(2):
            x = rng.standard_normal((m, 1100)).astype(np.float32)
            ref = x.astype(np.float64) @ w.T
            np.testing.assert_allclose(compiled(x)[0], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        plans = [k.kernel.plan for step in compiled.steps if step.kind == "anchor" for k in step.prepared()]
        assert len(plans) == 1 and plans[0].config[-1] == 3, plans
        names = [launch.func.name for launch in plans[0].launches]
        assert all(("_decode_" in name) == (m <= CPU_DECODE_ROWS) for name in names), names


@pytest.mark.parametrize("weight,group,k,kernel", [
    ("int5", 12, 300, None), ("int5", 384, 1000, None), ("int4", 100, 1000, None),  # groups straddling blocks
    ("uint3", 1, 40, None), ("int4", 4, 264, None),  # groups under 8 codes
    ("int6", None, 70, "decode"), ("e2m3", 512, 700, "decode"), ("uint2", 8, 300, "decode")])  # fmt: skip
@pytest.mark.slow
def test_group_sizes_the_row_layout_cannot_cut_run_on_the_reference(rng, caplog, weight, group, k, kernel):
    """The row-layout kernels cut their segments once for all 256-k blocks: groups that neither
    divide 256 nor are multiples of it start elsewhere in each block, so those layers run on the
    reference (logged), never on wrong scales, as do groups under 8 codes; the others at M = 1 on
    the kernel named."""
    zp = None if weight.startswith("e") else weight.startswith("u")
    consts, attrs, w = _operands(rng, weight, group, zp, 13, k)
    compiled = compile_graph(_lowbit_graph(consts, attrs, 1), "cpu")
    for _ in range(2):
        x = rng.standard_normal((1, k)).astype(np.float32)
        ref = x.astype(np.float64) @ w.T
        np.testing.assert_allclose(compiled(x)[0], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    steps = compiled.summary()["steps"]
    if kernel is None:
        assert steps == {"reference": 1} and "runs in its numpy reference" in caplog.text, steps
    else:
        assert steps == {"anchor": 1}, steps
        plans = [kk.kernel.plan for step in compiled.steps if step.kind == "anchor" for kk in step.prepared()]
        assert ("_decode_" in plans[0].launches[0].func.name) == (kernel == "decode")


@pytest.mark.parametrize("weight,group", [("int4", 16), ("uint5", 64), ("e2m1", None), ("e4m3", 32), ("int3", 12)])
@pytest.mark.slow
def test_eager_quantized_linear_on_the_cpu_runs_the_simd_kernels(rng, caplog, weight, group):
    """QuantizedLinear called outside torch.compile on CPU tensors: the anchor's kernels (decode
    rows and more), the reference kernel only for group sizes they do not take (logged once);
    several shapes and calls against the float64 product with the dequantised weight."""
    from tessera.eager import quantize as torch_quantize

    layer = torch.nn.Linear(300, 37, bias=True)
    q = ts.quantize(torch.nn.Sequential(layer), weight=weight, group_size=group)[0]
    w = torch.from_numpy(q.weight_q.dequantize()).double()
    torch_quantize._REFERENCE_LOGGED.clear()  # (logged once a process)
    for shape in ((1, 300), (3, 300), (2, 5, 300), (1, 1, 300), (0, 300)):
        for _ in range(2):
            x = torch.randn(*shape)
            with torch.no_grad():
                got = q(x)
            ref = x.double() @ w.T + q.bias.double()
            assert got.shape == (*shape[:-1], 37)
            torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()) if ref.numel() else 0.0)
    assert ("scalar reference kernel" in caplog.text) == (group == 12), caplog.text


@pytest.mark.parametrize("weight,decades", [("e4m3", 5), ("e2m3", 3), ("e5m2", 12)])
def test_subnormal_float_codes_decode_exactly_with_denormals_flushed(rng, weight, decades):
    """The decode kernel converts the wider floats through float16 (vcvtph2ps): subnormal codes
    keep their values when the thread flushes float32 denormals (torch.set_flush_denormal)."""
    t = dtypes.dtype(weight)
    # a wide range of magnitudes within each group: many codes land in the subnormal range
    q = quantize_weight(rng.standard_normal((11, 264)) * 10.0 ** rng.uniform(-decades, 0, (11, 264)), weight, 32)
    codes = q.codes.codes()
    exponent = (codes >> t.mantissa_bits) & ((1 << t.exponent_bits) - 1)
    assert ((exponent == 0) & (codes & ((1 << t.mantissa_bits) - 1) != 0)).sum() > 20
    consts, attrs = QuantizedLinear(q).graph_operands()
    w = dequantized_weight(*consts, attrs)
    compiled = compile_graph(_lowbit_graph(consts, attrs, 1), "cpu")
    x = rng.standard_normal((1, 264)).astype(np.float32)
    ref = x.astype(np.float64) @ w.T
    assert torch.set_flush_denormal(True), "this CPU cannot flush denormals"
    try:
        got = compiled(x)[0]
    finally:
        torch.set_flush_denormal(False)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_eager_quantized_linear_with_scales_the_kernels_cannot_hold_runs_the_reference(rng, caplog):
    """e2m1 weights this large need float16 scales past 65504 in the kernels' terms (the scale
    times 2**14): the layer still runs on the CPU, on the reference kernel, logged."""
    from tessera.eager import quantize as torch_quantize

    layer = torch.nn.Linear(64, 9, bias=False)
    with torch.no_grad():
        layer.weight.mul_(1e3)
    q = ts.quantize(torch.nn.Sequential(layer), weight="e2m1", group_size=32)[0]
    torch_quantize._REFERENCE_LOGGED.clear()
    w = torch.from_numpy(q.weight_q.dequantize()).double()
    for m in (1, 3):
        x = torch.randn(m, 64)
        with torch.no_grad():
            got = q(x)
        ref = x.double() @ w.T
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert "overflows float16" in caplog.text and "scalar reference kernel" in caplog.text


def test_e2m1_lookup_table_is_the_codecs_decode():
    """The decode kernel's e2m1 lanes hold the codec's magnitudes; the wider floats have none."""
    from tessera.quant.codecs import float_table
    from tessera.templates.lowbit.cpu_kernels import float_lanes_table

    t = dtypes.dtype("e2m1")
    assert float_lanes_table(t) == tuple(float_table(t)[:8])
    assert all(float_lanes_table(dtypes.dtype(n)) is None for n in ("e2m3", "e3m2", "e4m3", "e5m2", "int4"))


def test_row_layout_holds_every_code(rng):
    """Every width: the segments own each bit of a block's 8 * bits words once and name each of
    its 256 codes' bits once; whole fields for 7/8 of the codes where 32 % bits leaves a rest;
    the packer's words decode back (K padded with code 0)."""
    from tessera.templates.lowbit.cpu_kernels import row_segments

    for bits in range(1, 9):
        owned, named = np.zeros((8 * bits, 32), int), np.zeros((256, bits), int)
        for k0, length, pieces in row_segments(bits):
            for word, shift, width, low in pieces:
                owned[word : word + length, shift : shift + width] += 1
                named[k0 : k0 + length, low : low + width] += 1
        assert (owned == 1).all() and (named == 1).all(), bits
        whole = sum(length for _, length, pieces in row_segments(bits) if len(pieces) == 1)
        assert whole == 8 * bits * (32 // bits), bits
    for t in ("int1", "int3", "uint5", "int6", "int7", "e5m2"):
        dt = dtypes.dtype(t)
        u = rng.integers(0, 1 << dt.nbits, size=(3, 300)).astype(np.uint32)
        words = pack_rows(u, dt)
        assert words.shape == (3, 2 * 8 * dt.nbits)
        back = np.zeros((3, 2, 256), np.uint32)
        blocks = words.reshape(3, 2, -1)
        for k0, length, pieces in row_segments(dt.nbits):
            for word, shift, width, low in pieces:
                back[:, :, k0 : k0 + length] |= ((blocks[:, :, word : word + length] >> shift) & ((1 << width) - 1)) << low
        back = back.reshape(3, 512)
        assert np.array_equal(back[:, :300], u) and not back[:, 300:].any()


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("weight,group", [("int4", 32), ("uint3", None)])
@pytest.mark.slow
def test_quantized_llama_compiles_whole_on_the_cpu(weight, group):
    q = ts.quantize(_tiny_llama(), weight=weight, group_size=group, skip=["lm_head"])
    torch._dynamo.reset()
    compiled = torch.compile(q, backend="tessera")
    before = dict(tb.stats)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for seq in (7, 7, 7, 1):  # fresh inputs each call, then another size
            ids = torch.randint(0, 100, (1, seq), generator=gen)
            got, want = compiled(ids, use_cache=False).logits, q(ids, use_cache=False).logits
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert tb.stats["eager_nodes"] == before["eager_nodes"], "a node ran in torch (a graph break)"
    assert tb.stats["reference_ops"] == before["reference_ops"], "an operator ran on its numpy reference"
    graphs, segments = tb.stats["graphs"] - before["graphs"], tb.stats["segments"] - before["segments"]
    assert 1 <= graphs <= 2 and segments == graphs, (graphs, segments)  # one whole graph per size dynamo compiles


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.slow
def test_half_precision_activations_run_the_cpu_kernel_in_float32(dtype):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 40), torch.nn.ReLU(), torch.nn.Linear(40, 24))
    q = ts.quantize(model, weight="int4", group_size=32).to(dtype)
    torch._dynamo.reset()
    compiled = torch.compile(q, backend="tessera")
    before = dict(tb.stats)
    for m in (3, 1):
        x = torch.randn(m, 64, dtype=dtype)
        y = compiled(x)
        assert y.dtype == dtype
        torch.testing.assert_close(y.float(), q(x).float(), rtol=1e-2, atol=1e-2)
    assert tb.stats["eager_nodes"] == before["eager_nodes"] and tb.stats["reference_ops"] == before["reference_ops"]
