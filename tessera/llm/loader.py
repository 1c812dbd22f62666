"""Load what the engine serves: a transformers causal LM with its tokenizer and generation defaults.

`model` is a local Hugging Face directory (config.json, model.safetensors or sharded safetensors
with their index, tokenizer files, generation_config.json) or a transformers model object.
Nothing is downloaded (local_files_only).  Either way the model's attention is switched to
tessera's paged attention (attention.ATTN_IMPLEMENTATION).  A directory quantized with GPTQ, AWQ
or compressed-tensors loads its low-bit weights as stored, and `quantization=` rounds a float
model's linears to a tessera weight type (tessera.llm.checkpoint says which values it takes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from tessera.eager.quantize import quantize
from tessera.errors import FileFormatError, UnsupportedError
from tessera.llm.attention import ATTN_IMPLEMENTATION
from tessera.llm.checkpoint import (
    check_quantization,
    checkpoint_quantization,
    load_quantized_checkpoint,
    parse_quantization,
)

log = logging.getLogger("tessera")

_DTYPES = {"float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
           "fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}  # fmt: skip
# generation_config.json fields that become the default SamplingParams (vLLM does the same).
_SAMPLING_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                      "repetition_penalty": "repetition_penalty"}  # fmt: skip
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class LoadedModel:
    model: transformers.PreTrainedModel
    tokenizer: Any  # a transformers tokenizer, or None
    name: str
    eos_token_ids: set[int]
    sampling_defaults: dict[str, Any] = field(default_factory=dict)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, config_dtype: torch.dtype | None) -> torch.dtype:
    """"auto": float32 on the CPU; on CUDA the checkpoint's half type, else bfloat16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        return config_dtype if config_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto', one of {sorted(_DTYPES)} or a torch.dtype, got {dtype!r}")
    return _DTYPES[dtype]


def load_model(model: str | Path | transformers.PreTrainedModel, tokenizer: Any = None, dtype: str | torch.dtype = "auto",
               device: torch.device | None = None, quantization: str | None = None,
               shard: Callable[[transformers.PreTrainedModel], object] | None = None) -> LoadedModel:  # fmt: skip
    """The model on `device` in its dtype with paged attention, its tokenizer and its EOS ids.

    shard: called on the model while it is still on the CPU (tensor parallelism keeps only its
    shard), before it moves to `device` and before quantization rounds its linears."""
    device = device or torch.device("cpu")
    if isinstance(model, str | Path):
        path = Path(model)
        if not (path / "config.json").is_file():
            raise FileFormatError(f"{path} is not a Hugging Face model directory (no config.json); "
                                  "tessera.llm downloads nothing, pass a local directory")  # fmt: skip
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        qcfg = checkpoint_quantization(config)
        method = check_quantization(quantization, qcfg)  # a conflict fails before the weights load
        weight = parse_quantization(quantization) if quantization is not None and method is None else None
        torch_dtype = resolve_dtype(dtype, device, getattr(config, "dtype", None))
        _check_cpu_dtype(method or quantization, device, torch_dtype)
        if method is not None:
            loaded = load_quantized_checkpoint(path, config, qcfg, method, torch_dtype, ATTN_IMPLEMENTATION)
        else:
            loaded = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=torch_dtype, attn_implementation=ATTN_IMPLEMENTATION, local_files_only=True)
        name = path.resolve().name
        if tokenizer is None and any((path / f).is_file() for f in _TOKENIZER_FILES):
            tokenizer = path
    elif isinstance(model, transformers.PreTrainedModel):
        check_quantization(quantization, None)
        weight = parse_quantization(quantization) if quantization is not None else None
        loaded = model
        loaded.set_attn_implementation(ATTN_IMPLEMENTATION)
        torch_dtype = resolve_dtype(dtype, device, loaded.dtype)
        name = type(model).__name__
        _check_cpu_dtype(quantization, device, torch_dtype)
    else:
        raise TypeError(f"model must be a model directory or a transformers PreTrainedModel, got {type(model).__name__}")
    if shard is not None:
        shard(loaded)
    loaded = loaded.to(device=device, dtype=torch_dtype).eval()
    if weight is not None:
        quantize(loaded, weight=weight[0], group_size=weight[1], skip=("lm_head",), inplace=True)
    if isinstance(tokenizer, str | Path):
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    return LoadedModel(loaded, tokenizer, name, _eos_token_ids(loaded, tokenizer), _sampling_defaults(loaded))


def _check_cpu_dtype(quantization: str | None, device: torch.device, dtype: torch.dtype) -> None:
    if quantization is not None and device.type != "cuda" and dtype != torch.float32:
        raise UnsupportedError(f"quantization={quantization!r} on the CPU needs dtype float32")


def _eos_token_ids(model: transformers.PreTrainedModel, tokenizer: Any) -> set[int]:
    """generation_config's EOS ids (what transformers' generate stops at), else config's, else the tokenizer's."""
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is not None:
            return {int(t) for t in (eos if isinstance(eos, list | tuple) else [eos])}
    return set()


def _sampling_defaults(model: transformers.PreTrainedModel) -> dict[str, Any]:
    generation_config = getattr(model, "generation_config", None)
    if generation_config is None:
        return {}
    given = generation_config.to_diff_dict()
    defaults = {ours: given[theirs] for theirs, ours in _SAMPLING_DEFAULTS.items() if given.get(theirs) is not None}
    if given.get("max_new_tokens") is not None:
        defaults["max_tokens"] = int(given["max_new_tokens"])
    return defaults
