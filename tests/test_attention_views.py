"""The GPU attention anchor reads q, k, v as head views of the QKV projection's output and writes
its output with the heads merged (`split_heads` / `merge_heads` taken into the anchor group), so
no copy runs around attention.

CPU tier: the partition planned for an H200 (the fused kernel's SM90 check simulated) and the
anchor's plumbing (which arrays, views and output layout reach the kernel), run through a
stand-in kernel that implements FlashAnchorKernel's documented contract in numpy.
GPU tier (`cuda`): the flash kernel itself on views and heads-last output against torch, and a
compiled graph against its reference."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.graph import GraphBuilder
from tessera.graph.compiler.partition import partition_for
from tessera.graph.lowering import lowering_error
from tessera.graph.passes import optimize
from tessera.graph.registry import get_op
from tessera.templates import chosen


def _block(batch, s, h, hk, d, dt="float16", own_q=False):
    """GPT-2 / Llama style: one QKV projection output x [B, S, (H + 2 Hk) D] (q apart when own_q),
    heads split, causal attention, heads merged, then an elementwise op."""
    b = GraphBuilder()
    x = b.input("x", [batch, s, (h + 2 * hk) * d], dt)
    q, k, v = b.op_multi("split", x, axis=-1, sizes=[h * d, hk * d, hk * d])
    if own_q:
        q = b.op("neg", q)
    heads = [b.op("permute", b.op("reshape", t, shape=[batch, s, n, d]), perm=[0, 2, 1, 3])
             for t, n in ((q, h), (k, hk), (v, hk))]  # fmt: skip
    att = b.op("scaled_dot_product_attention", *heads, causal=True)
    merged = b.op("reshape", b.op("permute", att, perm=[0, 2, 1, 3]), shape=[batch, s, h * d])
    b.output(b.op("mul", merged, merged))
    return optimize(b.build())


def _groups(graph, target="cuda"):
    return partition_for(graph, target, lowering_error)


@pytest.fixture
def hopper(monkeypatch):
    from tessera.templates.attention import plan as attention

    monkeypatch.setattr(attention, "_sm90", lambda: True)


@pytest.fixture
def pre_hopper(monkeypatch):
    """The partition as planned without an SM90 GPU, also on a machine that has one."""
    from tessera.templates.attention import plan as attention

    monkeypatch.setattr(attention, "_sm90", lambda: False)


def _attention_group(groups):
    return next(g for g in groups if g.kind == "anchor" and g.anchor.kind == "scaled_dot_product_attention")


def test_gpt2_block_reads_and_writes_heads_in_place(hopper):
    g = _block(1, 5, 2, 2, 64)
    group = _attention_group(_groups(g))
    assert [op.kind for op in group.members] == ["split_heads"] * 3 + ["scaled_dot_product_attention", "merge_heads"]
    assert group.inputs == g.inputs  # the projection's output itself: no copy before attention
    assert group.outputs[0].shape == (1, 5, 128)
    assert sum(1 for gr in _groups(g) if gr.kind == "fused") == 1  # only the final mul


def test_views_only_where_the_flash_kernel_takes_them(hopper):
    # grouped heads: q's packed rows are no single-stride view; k and v still are
    group = _attention_group(_groups(_block(1, 5, 4, 2, 64)))
    assert [op.kind for op in group.prologue] == ["split_heads"] * 2
    assert group.anchor.inputs[0] not in [op.outputs[0] for op in group.prologue]
    # batch 2: the heads of different batches are not one stride apart; the output merge still fuses
    group = _attention_group(_groups(_block(2, 5, 2, 2, 64)))
    assert group.prologue == [] and [op.kind for op in group.ops] == ["scaled_dot_product_attention", "merge_heads"]
    # a q computed from its piece (here negated) is viewed in the [B, S, H * D] result of that kernel
    group = _attention_group(_groups(_block(1, 5, 2, 2, 64, own_q=True)))
    assert len(group.prologue) == 3 and group.prologue[0].inputs[0].producer.kind == "neg"
    assert group.prologue[0].attrs["offset"] == 0
    # head dim 48: no fused kernel, no views; float32: no GPU template at all
    assert [op.kind for op in _attention_group(_groups(_block(1, 5, 2, 2, 48))).members] == ["scaled_dot_product_attention"]
    assert not any(gr.kind == "anchor" for gr in _groups(_block(1, 5, 2, 2, 64, dt="float32")))


def test_no_views_on_the_cpu_or_without_hopper(pre_hopper):
    g = _block(1, 5, 2, 2, 64)
    assert _attention_group(_groups(g)).prologue == []
    assert all(gr.prologue == [] for gr in _groups(g, "cpu"))


def _stand_in(q_shape, k_shape, v_shape, dtype, *, causal, scale, mask_shape, mask_dtype, tune, views, heads_last):
    """FlashAnchorKernel's contract in numpy: a view (first column, width) reads operand
    [b, s, first + h * D + d] of a [B, S, width] array; heads_last writes [B, S, H * D]."""
    sdpa = get_op("scaled_dot_product_attention").reference

    def kernel(inputs, out, extras):
        operands = []
        for a, view, (b, h, s, d) in zip(inputs, views, (q_shape, k_shape, v_shape)):
            if view is not None:
                first, width = view
                assert a.shape == (b, s, width)
                a = a[..., first : first + h * d].reshape(b, s, h, d).transpose(0, 2, 1, 3)
            assert a.shape == (b, h, s, d)
            operands.append(a)
        y = sdpa(operands, {"causal": causal, "scale": scale})[0]
        out[...] = y.transpose(0, 2, 1, 3).reshape(out.shape) if heads_last else y

    return kernel


@pytest.mark.parametrize("shape", [(1, 5, 2, 2, 64), (1, 7, 4, 2, 64), (2, 3, 2, 1, 80)])
def test_anchor_passes_views_and_layout_to_the_kernel(hopper, monkeypatch, rng, shape):
    from tessera.templates import attention

    monkeypatch.setattr(attention, "prepare_attention", _stand_in)
    g = _block(*shape)
    groups = _groups(g)
    group = _attention_group(groups)
    env = {}
    for _ in range(3):
        x = (rng.standard_normal(g.inputs[0].shape) * 0.5).astype(np.float16)
        env = {g.inputs[0]: x}
        for gr in groups:  # every other group through the references, the attention group through its anchor
            if gr is group:
                run = chosen(gr.anchor, "cuda").prepare(gr, {t: env[t].shape for t in gr.inputs}, tune=False)
                out = np.empty(gr.outputs[0].shape, np.float32)
                run([env[t] for t in gr.inputs], [out])
                env[gr.outputs[0]] = out
                continue
            for op in gr.members:
                for t, a in zip(op.outputs, op.opdef.reference([env[t] for t in op.inputs], op.attrs)):
                    env[t] = a
        np.testing.assert_allclose(env[g.outputs[0]], g.run(x)[0].astype(np.float32), rtol=2e-3, atol=2e-3)


# ---- GPU ------------------------------------------------------------------------------------------
def _needs_hopper():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the fused kernel needs an SM90 GPU")
    return torch


VIEW_CASES = [  # h, hk, s, d, causal, q read as a view
    (12, 12, 128, 64, True, True),  # GPT-2's attention at 128 tokens
    (12, 12, 77, 64, False, True),  # BERT-like, odd length
    (8, 2, 200, 80, True, False),  # grouped heads: q contiguous, k and v views
    (2, 2, 1000, 128, False, True),  # few heads, long: split-KV, the combine writes heads last
    (4, 1, 1, 96, False, False),  # one token
]


@pytest.mark.cuda
@pytest.mark.parametrize("h,hk,s,d,causal,q_view", VIEW_CASES)
def test_flash_kernel_reads_head_views_and_writes_heads_last(h, hk, s, d, causal, q_view):
    torch = _needs_hopper()
    from tessera.ir import dtypes
    from tessera.templates.attention.plan import FlashAnchorKernel

    width = (h + 2 * hk) * d + 8 * 8  # room after the heads: the views must stop at theirs
    kernel = FlashAnchorKernel((1, h, s, d), (1, hk, s, d), dtypes.float16, causal, d**-0.5, None, None,
                               views=[(0, width) if q_view else None, (h * d, width), ((h + hk) * d, width)],
                               heads_last=True)  # fmt: skip
    assert kernel.out_shape == (1, s, h * d)
    gen = torch.Generator(device="cuda").manual_seed(s)
    for call in range(3):
        base = torch.randn(s * width + 8, generator=gen, device="cuda").half()
        # the second call's x starts 2 bytes off 16: the kernel copies the views instead
        x = (base[1 : 1 + s * width] if call == 1 else base[: s * width]).view(1, s, width)
        q, k, v = (x[..., first : first + n * d].view(1, s, n, d).transpose(1, 2)
                   for first, n in ((0, h), (h * d, hk), ((h + hk) * d, hk)))  # fmt: skip
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal,
                                                               enable_gqa=h != hk)  # fmt: skip
        out = torch.full((1, s, h * d), float("nan"), device="cuda", dtype=torch.float16)
        kernel([x if q_view else q.contiguous(), x, x], out)
        got = out.view(1, s, h, d).transpose(1, 2).float()
        assert float((got - ref).abs().max() / ref.abs().max()) < 1e-2, call


@pytest.mark.cuda
def test_compiled_block_runs_attention_without_copies():
    torch = _needs_hopper()
    from tessera.graph.compiler import compile_graph

    g = _block(1, 128, 12, 12, 64)
    compiled = compile_graph(g, "cuda")
    rng = np.random.default_rng(0)
    for _ in range(3):  # the second call captures, the third replays
        x = (rng.standard_normal(g.inputs[0].shape) * 0.5).astype(np.float16)
        expected = g.run(x)[0].astype(np.float32)
        out = compiled(torch.from_numpy(x).cuda())[0].float().cpu().numpy()
        assert np.abs(out - expected).max() / np.abs(expected).max() < 1e-2
    assert [s.kind for s in compiled.steps] == ["anchor", "fused"]  # attention, then the final mul
    names = [name for s in compiled.steps if s.kind == "anchor" for r in s.prepared() for name in r.kernel.kernels]
    assert names and all(n.endswith("_bshd") for n in names)


@pytest.mark.parametrize("h,hk,s,d", [(12, 12, 128, 64), (8, 2, 37, 80), (1, 1, 1, 128)])
def test_tma_layouts_address_the_views(h, hk, s, d):
    """The strided maps address exactly the elements of the heads the graph's split_heads names:
    element (problem, row, col) of each map, at the operand's first column, is the view's element."""
    from tessera.templates.attention.launch import AttentionShape, operand_layout

    width = (h + 2 * hk) * d + 16
    x = np.arange(s * width).reshape(1, s, width)  # each element's address
    shape = AttentionShape(1, h, hk, s, s, d)
    for which, (first, heads) in enumerate(((0, h), (h * d, hk), ((h + hk) * d, hk))):
        if which == 0 and h != hk:
            continue
        view = x[..., first : first + heads * d].reshape(1, s, heads, d).transpose(0, 2, 1, 3)
        dims, strides = operand_layout(shape, which, width)
        assert dims == (heads, s, d)
        idx = np.indices(dims).reshape(3, -1)
        addresses = first + (idx * np.array(strides)[:, None]).sum(0)
        np.testing.assert_array_equal(addresses, view.reshape(-1))
        contiguous_dims, contiguous = operand_layout(shape, which, None)
        assert contiguous == (contiguous_dims[1] * d, d, 1)


def _hf_graph(family):
    """The optimized FlowGraph of a one-layer HF model (head dim 64) as the torch front end
    gives it on the GPU (dynamo's SDPA kept whole), traced on the CPU."""
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    from tessera.frontend.torch.backend import backend
    from tessera.frontend.torch.keep_attention import keep_attention_whole

    torch.manual_seed(0)
    if family == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=128, n_layer=1, n_head=2, vocab_size=64))
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=256, intermediate_size=96, num_hidden_layers=1,
                                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64))  # fmt: skip
    model = model.half().eval()
    collected = []

    def gpu_like(gm, example_inputs):
        keep_attention_whole(gm)
        return backend(gm, example_inputs, collect=collected, options={"executor": "reference"})

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(lambda ids: model(ids, use_cache=False).logits, backend=gpu_like)(torch.randint(0, 64, (1, 9)))
    (graph,) = [g for cg in collected for g in cg.graphs]
    return graph


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.slow
def test_transformers_attention_runs_on_head_views(hopper, family):
    """HF GPT-2 and Llama (grouped heads, rotary q and k) as the front end lowers them: no copy
    around attention is left to a kernel of its own (Llama's rotary embedding writes q and k)."""
    g = _hf_graph(family)
    kinds = g.summary()
    assert "expand" not in kinds and "permute" not in kinds  # no repeated kv heads, no head transposes
    groups = _groups(g)
    attention = _attention_group(groups)
    assert [op.kind for op in attention.ops] == ["scaled_dot_product_attention", "merge_heads"]
    assert len(attention.prologue) == (3 if family == "gpt2" else 1)  # Llama: v (q and k come rotated)
    rope = [gr for gr in groups if gr.kind == "fused" and any(op.kind == "split_heads" for op in gr.ops)]
    assert len(rope) == (0 if family == "gpt2" else 1) and all(len(gr.outputs) == 2 for gr in rope)
