"""tessera.llm with low-bit weights: GPTQ, AWQ and compressed-tensors checkpoint directories
loaded as stored, and `quantization=` types rounded at load time.  Greedy tokens must equal
transformers' generate on a float model whose linears carry the same dequantised weights."""

from __future__ import annotations

import copy
import json
import logging
import shutil

import pytest
import torch
import transformers
from quantized_checkpoints import METHODS, make_quantized_dir
from safetensors.torch import load_file, save_file
from tiny_llm import PROMPTS, make_model_dir

from tessera.eager.quantize import QuantizedLinear, quantize
from tessera.errors import FileFormatError, UnsupportedError
from tessera.llm import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0)


def reference_greedy(model: transformers.PreTrainedModel, model_dir, prompts=PROMPTS) -> list[list[int]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        generated = model.generate(ids, do_sample=False, max_new_tokens=GREEDY.max_tokens, pad_token_id=3)
        out.append(generated[0, ids.shape[1] :].tolist())
    return out


def engine_greedy(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """method -> (directory, float reference with the dequantised weights); GPTQ in two shards."""
    made = {}
    for method in METHODS:
        path = tmp_path_factory.mktemp(method)
        made[method] = (path, make_quantized_dir(path, method, shards=2 if method == "gptq" else 1))
    return made


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("float"), "llama")


@pytest.mark.parametrize("method", [pytest.param("gptq", marks=pytest.mark.slow), "awq",
                                    pytest.param("compressed-tensors", marks=pytest.mark.slow)])  # fmt: skip
def test_checkpoint_greedy_tokens_equal_the_dequantised_reference(checkpoints, method):
    path, reference = checkpoints[method]
    llm = LLM(path, device="cpu", enforce_eager=True)
    model = llm.engine.runner.model
    linears = {n: type(m) for n, m in model.named_modules() if isinstance(m, QuantizedLinear | torch.nn.Linear)}
    assert linears.pop("lm_head") is torch.nn.Linear
    assert len(linears) == 14 and set(linears.values()) == {QuantizedLinear}  # 2 layers x 7 projections
    assert not any(p.is_meta for p in model.parameters())
    expected = reference_greedy(reference, path)
    assert all(len(t) == GREEDY.max_tokens for t in expected)  # no early EOS: every prompt checks 16 tokens
    assert engine_greedy(llm) == expected
    assert engine_greedy(LLM(path, device="cpu", enforce_eager=True, quantization=method), PROMPTS[:1]) == expected[:1]


def test_tied_embeddings_checkpoint(tmp_path):
    """lm_head stored once, as the embedding (Llama-3.2-1B's layout): tied again after loading."""
    reference = make_quantized_dir(tmp_path, "awq", tie_word_embeddings=True)
    llm = LLM(tmp_path, device="cpu", enforce_eager=True)
    model = llm.engine.runner.model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert engine_greedy(llm, PROMPTS[:2]) == reference_greedy(reference, tmp_path, PROMPTS[:2])


def _dequantised_copy(model: transformers.PreTrainedModel, weight: str, group_size: int | None):
    """`model` with every linear but lm_head holding what tessera.quantize rounds it to, in float."""
    reference = quantize(copy.deepcopy(model), weight=weight, group_size=group_size, skip=("lm_head",))
    for module in list(reference.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, QuantizedLinear):
                linear = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                with torch.no_grad():
                    linear.weight.copy_(torch.from_numpy(child.weight_q.dequantize()))
                setattr(module, child_name, linear)
    return reference.eval()


TYPES = [("int4", "int4", 128), ("int8:channel", "int8", None),
         pytest.param("int4:g64", "int4", 64, marks=pytest.mark.slow),
         pytest.param("uint4:g32", "uint4", 32, marks=pytest.mark.slow),
         pytest.param("int3", "int3", 128, marks=pytest.mark.slow),
         pytest.param("e2m1:g32", "e2m1", 32, marks=pytest.mark.slow),
         pytest.param("e4m3:channel", "e4m3", None, marks=pytest.mark.slow)]  # fmt: skip


@pytest.mark.parametrize("spec,weight,group_size", TYPES)
def test_quantization_types_equal_the_dequantised_reference(float_dir, spec, weight, group_size):
    llm = LLM(float_dir, device="cpu", enforce_eager=True, quantization=spec)
    layer = llm.engine.runner.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, QuantizedLinear) and layer.weight_q.dtype.name == weight
    assert layer.weight_q.group_size == (group_size or layer.in_features)
    reference = _dequantised_copy(transformers.AutoModelForCausalLM.from_pretrained(float_dir), weight, group_size)
    expected = reference_greedy(reference, float_dir, PROMPTS[:3])
    assert engine_greedy(llm, PROMPTS[:3]) == expected


def _with_config(checkpoints, tmp_path, method: str, **changes) -> object:
    """A copy of the `method` checkpoint directory with its quantization_config changed."""
    path = shutil.copytree(checkpoints[method][0], tmp_path / method)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_bad_quantization_arguments_and_configs(checkpoints, float_dir, tmp_path):
    gptq = checkpoints["gptq"][0]
    with pytest.raises(ValueError, match="quantization='int4' conflicts with the checkpoint, which is already "
                                         "quantized with gptq"):  # fmt: skip
        LLM(gptq, device="cpu", quantization="int4")
    with pytest.raises(ValueError, match="quantization='awq' conflicts"):
        LLM(gptq, device="cpu", quantization="awq")
    with pytest.raises(ValueError, match="quantization='gptq' but the model's config has no quantization_config"):
        LLM(float_dir, device="cpu", quantization="gptq")
    with pytest.raises(ValueError, match="the group suffix must be"):
        LLM(float_dir, device="cpu", quantization="int4:g0")
    with pytest.raises(ValueError, match="'int9' is not a low-bit weight type"):
        LLM(float_dir, device="cpu", quantization="int9:g32")
    with pytest.raises(UnsupportedError, match="on the CPU needs dtype float32"):
        LLM(gptq, device="cpu", dtype="bfloat16")
    bad = [("gptq", {"bits": 8}, "gptq checkpoints with bits=8 are not supported"),
           ("gptq", {"desc_act": True}, "act-order"),
           ("awq", {"bits": 3}, "awq checkpoints with bits=3"),
           ("awq", {"version": "gemv"}, "AWQ version='gemv'"),
           ("compressed-tensors", {"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'")]  # fmt: skip
    for method, changes, message in bad:
        path = _with_config(checkpoints, tmp_path / str(len(message)), method, **changes)
        with pytest.raises(UnsupportedError, match=message) as info:
            LLM(path, device="cpu")
        assert isinstance(info.value, ValueError)
    # a config whose bits disagree with the stored tensors: the format loader's message, with the directory
    path = _with_config(checkpoints, tmp_path / "ct", "compressed-tensors")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileFormatError, match="weight_packed"):
        LLM(path, device="cpu")
    # weight-and-activation schemes (W8A8 and the like) are refused: the engine keeps activations in float
    path = _with_config(checkpoints, tmp_path / "w4a8", "compressed-tensors")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedError, match="activation quantization"):
        LLM(path, device="cpu")


def test_missing_and_extra_float_tensors(checkpoints, tmp_path, caplog):
    """A float tensor the checkpoint lacks is an error; one the model has no place for (rotary
    inv_freq of older exports) is skipped with a warning, as transformers does."""
    path = shutil.copytree(checkpoints["awq"][0], tmp_path / "awq")
    tensors = load_file(path / "model.safetensors")
    extra = "model.layers.0.self_attn.rotary_emb.inv_freq"
    save_file({**tensors, extra: torch.ones(8)}, path / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="tessera"):
        LLM(path, device="cpu", enforce_eager=True)
    assert extra in caplog.text
    del tensors["model.norm.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(FileFormatError, match=r"lacks \['model.norm.weight'\]"):
        LLM(path, device="cpu")
