"""compressed-tensors checkpoints (pack-quantized, naive-quantized, float-quantized) that the
tests write with their own packer, following the library's layout: signed values q offset by
2**(b-1), packed densely into int32 words along the input dimension (element 0 in the lowest
bits), asymmetric zero points packed the same way along the output dimension."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.eager.checkpoints import load_quantized_linears
from tessera.errors import ArgumentError, UnsupportedError
from tessera.quant.checkpoints import from_compressed_tensors

torch = pytest.importorskip("torch")


def _pack_rows(unsigned, bits):
    """[R, C] values < 2**bits -> int32 [R, ceil(C * bits / 32)]: field c in bits bits*c.. of the row."""
    r, c = unsigned.shape
    words = np.zeros((r, -(-c * bits // 32)), np.uint64)
    for col in range(c):
        words[:, col * bits // 32] |= unsigned[:, col].astype(np.uint64) << np.uint64(col * bits % 32)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32))


def _case(rng, n, k, bits, strategy, group_size, symmetric):
    """Signed codes q [N, K], zeros z [N, G] (signed, 0 when symmetric), bf16 scales [N, G]."""
    g = {"group": -(-k // (group_size or k)), "channel": 1, "tensor": 1}[strategy]
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = rng.integers(lo, hi + 1, size=(n, k))
    z = np.zeros((n, g), np.int64) if symmetric else rng.integers(lo, hi + 1, size=(n, g))
    s = torch.from_numpy(rng.uniform(0.01, 0.1, size=(n, g))).to(torch.bfloat16)
    if strategy == "tensor":
        z, s = z[:1, :1].repeat(n, 0), s[:1, :1].repeat(n, 1)
    return q, z, s


def _reference(q, z, s, k, group_size):
    cols = np.arange(k) // (group_size or k)
    return ((q - z[:, cols]) * s.double().numpy()[:, cols]).astype(np.float32)


def _args(bits, strategy, group_size, symmetric, kind="int"):
    return {"num_bits": bits, "type": kind, "symmetric": symmetric, "strategy": strategy,
            "group_size": group_size if strategy == "group" else None, "dynamic": False}  # fmt: skip


def _pack_quantized(q, z, s, bits, strategy, symmetric, packed_zeros=True):
    n, k = q.shape
    off = 1 << (bits - 1)
    t = {"weight_packed": _pack_rows(q + off, bits), "weight_shape": torch.tensor([n, k]),
         "weight_scale": s if strategy != "tensor" else s[:1, 0].clone()}  # fmt: skip
    if not symmetric:
        if strategy == "tensor":
            t["weight_zero_point"] = torch.tensor([int(z[0, 0])], dtype=torch.int8)
        elif packed_zeros:
            t["weight_zero_point"] = _pack_rows((z + off).T, bits).T.contiguous()
        else:  # older library versions: int8 [N, G]
            t["weight_zero_point"] = torch.from_numpy(z.astype(np.int8))
    return t


CASES = [(4, "group", 8), (4, "group", 44), (4, "channel", None), (4, "tensor", None), (8, "group", 22),
         (8, "channel", None), (2, "group", 11), (2, "channel", None)]  # fmt: skip


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits,strategy,group_size", CASES)
def test_pack_quantized_layer_is_bit_exact(rng, bits, strategy, group_size, symmetric):
    n, k = 19, 88  # N not a multiple of 8; K * bits not always a multiple of 32 (padded words)
    q, z, s = _case(rng, n, k, bits, strategy, group_size, symmetric)
    ref = _reference(q, z, s, k, group_size)
    for packed_zeros in (True, False) if not symmetric and strategy != "tensor" else (True,):
        t = _pack_quantized(q, z, s, bits, strategy, symmetric, packed_zeros)
        w = from_compressed_tensors(t, _args(bits, strategy, group_size, symmetric), "pack-quantized")
        assert w.shape == (n, k) and w.group_size == (group_size or k)
        assert w.dtype.name == (f"int{bits}" if symmetric else f"uint{bits}")
        assert (w.zeros is None) == symmetric
        assert np.array_equal(w.dequantize(), ref)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits,strategy,group_size", [(8, "channel", None), (8, "group", 16), (4, "group", 16)])
def test_naive_quantized_layer_is_bit_exact(rng, bits, strategy, group_size, symmetric):
    n, k = 13, 48
    q, z, s = _case(rng, n, k, bits, strategy, group_size, symmetric)
    t = {
        "weight": torch.from_numpy(q.astype(np.int8)),
        "weight_scale": s,
        "weight_zero_point": torch.from_numpy(z.astype(np.int8)),
    }  # fmt: skip (naive keeps zero points, even all 0)
    for fmt in ("naive-quantized", "int-quantized"):
        w = from_compressed_tensors(t, _args(bits, strategy, group_size, symmetric), fmt)
        assert np.array_equal(w.dequantize(), _reference(q, z, s, k, group_size))


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_float_quantized_fp8_layer(rng, strategy):
    n, k = 11, 40
    w8 = torch.from_numpy(rng.normal(size=(n, k)) * 50).to(torch.float8_e4m3fn)
    s32 = torch.from_numpy(rng.uniform(1e-3, 1e-2, size=(n, 1) if strategy == "channel" else (1,))).float()
    args = _args(8, strategy, None, True, kind="float")
    w = from_compressed_tensors({"weight": w8, "weight_scale": s32}, args, "float-quantized")
    assert w.dtype.name == "e4m3" and w.zeros is None
    assert np.array_equal(w.codes.numpy(), w8.double().numpy())  # the float8_e4m3fn bits are e4m3 codes
    ref = w8.double().numpy() * s32.double().numpy().reshape(-1, 1)
    assert np.allclose(w.dequantize(), ref, rtol=2.0**-11, atol=0)  # float32 scales round to float16
    s16 = s32.to(torch.float16)  # float16 scales: exact
    w = from_compressed_tensors({"weight": w8, "weight_scale": s16}, args, "float-quantized")
    assert np.array_equal(
        w.dequantize(), (w8.double().numpy() * s16.double().numpy().reshape(-1, 1)).astype(np.float32)
    )


def _config(fmt="pack-quantized", **weights):
    w = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16, "dynamic": False,
         "actorder": None, **weights}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w, "input_activations": None,
                                          "output_activations": None}}}  # fmt: skip


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(48, 37)
        self.down = torch.nn.Linear(37, 32, bias=False)
        self.lm_head = torch.nn.Linear(32, 9)

    def forward(self, x):
        return self.lm_head(self.down(torch.nn.functional.gelu(self.up(x))))


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.slow
def test_load_model_from_a_compressed_tensors_state_dict(rng, symmetric):
    """An llm-compressor-style W4A16 checkpoint (up and down quantized, lm_head ignored) loaded
    into a fresh model: the same outputs as torch Linear layers with the dequantised weights."""
    torch.manual_seed(0)
    model, dense = _Tiny(), {}
    state = {
        "lm_head.weight": model.lm_head.weight.detach().clone(),
        "lm_head.bias": model.lm_head.bias.detach().clone(),
    }
    for name, (n, k) in (("up", (37, 48)), ("down", (32, 37))):
        group = 16 if k % 16 == 0 else None
        strategy = "group" if group else "channel"
        q, z, s = _case(rng, n, k, 4, strategy, group, symmetric)
        dense[name] = torch.from_numpy(_reference(q, z, s, k, group))
        for key, v in _pack_quantized(q, z, s, 4, strategy, symmetric).items():
            state[f"{name}.{key}"] = v
    state["up.bias"] = torch.randn(37)
    cfg = _config(symmetric=symmetric)
    cfg["config_groups"]["group_1"] = {"targets": ["down"], "weights": {**cfg["config_groups"]["group_0"]["weights"],
                                                                         "strategy": "channel", "group_size": None}}  # fmt: skip
    load_quantized_linears(model, state, "compressed-tensors", quantization_config={"quantization_config": cfg})
    assert type(model.up).__name__ == type(model.down).__name__ == "QuantizedLinear"
    assert isinstance(model.lm_head, torch.nn.Linear)
    assert model.down.weight_q.group_size == 37 and model.up.weight_q.group_size == 16
    for _ in range(3):
        x = torch.randn(5, 48)
        h = torch.nn.functional.gelu(x @ dense["up"].T + state["up.bias"]) @ dense["down"].T
        expect = h @ state["lm_head.weight"].T + state["lm_head.bias"]
        assert torch.allclose(model(x), expect, rtol=1e-4, atol=1e-4)


def test_compressed_tensors_errors(rng):
    q, z, s = _case(rng, 8, 32, 4, "group", 16, True)
    t = _pack_quantized(q, z, s, 4, "group", True)
    ok = _args(4, "group", 16, True)
    with pytest.raises(UnsupportedError, match=r"num_bits=3 in pack-quantized .* supported: \[1, 2, 4, 8\]"):
        from_compressed_tensors(t, {**ok, "num_bits": 3}, "pack-quantized")
    with pytest.raises(UnsupportedError, match="strategy='block'"):
        from_compressed_tensors(t, {**ok, "strategy": "block"}, "pack-quantized")
    with pytest.raises(UnsupportedError, match="strategy='tensor_group'"):
        from_compressed_tensors(t, {**ok, "strategy": "tensor_group"}, "pack-quantized")
    with pytest.raises(UnsupportedError, match="dynamic"):
        from_compressed_tensors(t, {**ok, "dynamic": True}, "pack-quantized")
    with pytest.raises(UnsupportedError, match="format 'marlin-24'"):
        from_compressed_tensors(t, ok, "marlin-24")
    with pytest.raises(UnsupportedError, match="weight_g_idx"):
        from_compressed_tensors(
            {**t, "weight_g_idx": torch.arange(32) % 2}, {**ok, "actorder": "group"}, "pack-quantized"
        )
    with pytest.raises(ArgumentError, match="actorder='group'"):
        from_compressed_tensors(t, {**ok, "actorder": "group"}, "pack-quantized")
    w = from_compressed_tensors({**t, "weight_g_idx": torch.arange(32) // 16}, ok, "pack-quantized")  # identity g_idx
    assert np.array_equal(w.dequantize(), _reference(q, z, s, 32, 16))
    with pytest.raises(ArgumentError, match="symmetric=false but the layer has no weight_zero_point"):
        from_compressed_tensors(t, {**ok, "symmetric": False}, "pack-quantized")
    with pytest.raises(ArgumentError, match="group_size"):
        from_compressed_tensors(t, {**ok, "group_size": None}, "pack-quantized")
    with pytest.raises(ArgumentError, match=r"weight_scale must be \[8, 4\]"):
        from_compressed_tensors(t, {**ok, "group_size": 8}, "pack-quantized")
    with pytest.raises(ArgumentError, match="weight_packed of a"):
        from_compressed_tensors({**t, "weight_shape": torch.tensor([8, 48])}, ok, "pack-quantized")
    with pytest.raises(ArgumentError, match="outside float16's normal range"):
        from_compressed_tensors({**t, "weight_scale": t["weight_scale"].float() * 1e6}, ok, "pack-quantized")
    with pytest.raises(ArgumentError, match="not all zero"):
        from_compressed_tensors({**t, "weight_zero_point": torch.ones(8, 2, dtype=torch.int8)}, ok, "pack-quantized")
    with pytest.raises(ArgumentError, match="outside num_bits=4's range"):
        from_compressed_tensors({"weight": torch.full((8, 32), 9, dtype=torch.int8), "weight_scale": s},
                                ok, "naive-quantized")  # fmt: skip
    with pytest.raises(UnsupportedError, match="num_bits=4 with type 'float'"):
        from_compressed_tensors({}, {**ok, "type": "float"}, "float-quantized")
    with pytest.raises(UnsupportedError, match="symmetric=false with type 'float'"):
        from_compressed_tensors({}, {**ok, "type": "float", "num_bits": 8, "symmetric": False}, "float-quantized")
    # the model loader: config checks
    model = _Tiny()
    state = {f"up.{key}": v for key, v in _pack_quantized(*_case(rng, 37, 48, 4, "group", 16, True), 4, "group",
                                                           True).items()}  # fmt: skip
    cfg = _config()
    act = {**cfg, "config_groups": {"g": {**cfg["config_groups"]["group_0"],
                                          "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}}}  # fmt: skip
    with pytest.raises(UnsupportedError, match="input_activations is set: activation quantization"):
        load_quantized_linears(model, state, "compressed-tensors", quantization_config=act)
    load_quantized_linears(model, state, "compressed-tensors", quantization_config=act, weights_only=True)
    assert type(model.up).__name__ == "QuantizedLinear"
    with pytest.raises(ArgumentError, match="quantization_config \\(required\\)"):
        load_quantized_linears(_Tiny(), state, "compressed-tensors")
    with pytest.raises(ArgumentError, match="up: weight_scale must be"):
        load_quantized_linears(_Tiny(), state, "compressed-tensors", quantization_config=_config(group_size=8))
    with pytest.raises(ArgumentError, match="no config group targets it"):
        load_quantized_linears(_Tiny(), state, "compressed-tensors",
                               quantization_config={**cfg, "config_groups": {"g": {**cfg["config_groups"]["group_0"],
                                                                                   "targets": ["re:.*down"]}}})  # fmt: skip
    with pytest.raises(ArgumentError, match="in quantization_config.ignore"):
        load_quantized_linears(_Tiny(), state, "compressed-tensors", quantization_config={**cfg, "ignore": ["re:u.*"]})
    with pytest.raises(ArgumentError, match="no layer of the model"):
        load_quantized_linears(_Tiny(), {}, "compressed-tensors", quantization_config=cfg)
