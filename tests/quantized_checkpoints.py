"""Tiny quantized Hugging Face checkpoint directories (GPTQ, AWQ, compressed-tensors) for the
tessera.llm tests, written with the formats' own layouts (tessera.quant.checkpoints' docstring).

`make_quantized_dir(path, method)` rounds every linear of a tiny tests/tiny_llm.py model but
lm_head to 4-bit codes, packs them as the method stores them, saves config.json with the
method's quantization_config next to the float tensors and the tokenizer, and returns the
reference: the same model whose linears carry the dequantised weights in float32.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from tiny_llm import make_model, train_tokenizer

from tessera.quant.checkpoints import AWQ_ORDER

GROUP = 32
METHODS = ("gptq", "awq", "compressed-tensors")


def _rtn(w: np.ndarray, group: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Round [N, K] to 4-bit codes q [N, K] with zeros z [N, G] and float16 scales s [N, G]:
    unsigned 0..15 around z in 1..15 (GPTQ stores z - 1), or signed -8..7 with z = 0."""
    n, k = w.shape
    wg = w.reshape(n, k // group, group)
    if symmetric:
        s = (np.abs(wg).max(-1) / 7).astype(np.float16)
        q = np.clip(np.round(wg / s[..., None].astype(np.float64)), -8, 7)
        return q.reshape(n, k).astype(np.int64), np.zeros(s.shape, np.int64), s
    lo, hi = np.minimum(wg.min(-1), 0), np.maximum(wg.max(-1), 0)
    s = ((hi - lo) / 15).astype(np.float16)
    z = np.clip(np.round(-lo / s.astype(np.float64)), 1, 15).astype(np.int64)
    q = np.clip(np.round(wg / s[..., None].astype(np.float64)) + z[..., None], 0, 15)
    return q.reshape(n, k).astype(np.int64), z, s


def dequantized(q: np.ndarray, z: np.ndarray, s: np.ndarray, group: int) -> torch.Tensor:
    cols = np.arange(q.shape[1]) // group
    return torch.from_numpy(((q - z[:, cols]) * s.astype(np.float64)[:, cols]).astype(np.float32))


def _words(fields: np.ndarray, bits: int = 4) -> torch.Tensor:
    """[R, C] unsigned fields -> int32 [R, C * bits / 32], field c in bits bits*c.. of its row's stream."""
    r, c = fields.shape
    per = 32 // bits
    shifts = (bits * np.arange(per)).astype(np.uint64)
    words = (fields.reshape(r, c // per, per).astype(np.uint64) << shifts).sum(-1)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32))


def _gptq(q: np.ndarray, z: np.ndarray, s: np.ndarray) -> dict[str, torch.Tensor]:
    k = q.shape[1]
    return {"qweight": _words(q).T.contiguous(), "qzeros": _words((z - 1).T), "scales": torch.from_numpy(s.T.copy()),
            "g_idx": torch.arange(k, dtype=torch.int32) // GROUP}  # fmt: skip


def _awq(q: np.ndarray, z: np.ndarray, s: np.ndarray) -> dict[str, torch.Tensor]:
    def interleave(cols: np.ndarray) -> np.ndarray:  # [R, N] -> nibble i of word c holds column 8c + AWQ_ORDER[i]
        return cols.reshape(cols.shape[0], -1, 8)[..., list(AWQ_ORDER)].reshape(cols.shape[0], -1)

    return {"qweight": _words(interleave(q.T)), "qzeros": _words(interleave(z.T)), "scales": torch.from_numpy(s.T.copy())}


def _compressed(q: np.ndarray, z: np.ndarray, s: np.ndarray) -> dict[str, torch.Tensor]:
    return {"weight_packed": _words(q + 8), "weight_shape": torch.tensor(list(q.shape)),
            "weight_scale": torch.from_numpy(s.copy())}  # fmt: skip


def quantization_config(method: str, bits: int = 4) -> dict:
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": GROUP, "desc_act": False, "sym": False,
                "checkpoint_format": "gptq"}  # fmt: skip
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    weights = {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
               "dynamic": False, "actorder": None}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}}}  # fmt: skip


def make_quantized_dir(path: Path, method: str, family: str = "llama", shards: int = 1, seed: int = 0,
                       **overrides) -> transformers.PreTrainedModel:  # fmt: skip
    """Write a `method` checkpoint of a tiny `family` model (tiny_config `overrides`) under `path`
    (in `shards` safetensors files with their index when > 1); returns the float reference model."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    model = make_model(family, len(tokenizer), seed, **overrides)
    reference = copy.deepcopy(model)
    pack = {"gptq": _gptq, "awq": _awq, "compressed-tensors": _compressed}[method]
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # as transformers saves it: lm_head is the embedding, stored once
        del tensors["lm_head.weight"]
    for name, module in reference.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            q, z, s = _rtn(module.weight.detach().numpy().astype(np.float64), GROUP, method == "compressed-tensors")
            with torch.no_grad():
                module.weight.copy_(dequantized(q, z, s, GROUP))
            del tensors[f"{name}.weight"]
            tensors.update({f"{name}.{key}": v.contiguous() for key, v in pack(q, z, s).items()})
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)] if shards > 1 else ["model.safetensors"]
    weight_map = {key: files[i * shards // len(names)] for i, key in enumerate(names)}
    for f in files:
        save_file({key: tensors[key] for key in names if weight_map[key] == f}, path / f, metadata={"format": "pt"})
    if shards > 1:
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config(method)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return reference.eval()
