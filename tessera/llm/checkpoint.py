"""Low-bit weights for the engine: the `quantization=` argument and quantized checkpoint directories.

`quantization=` takes a tessera.quantize weight type (any of tessera.quant.WEIGHT_TYPES: int1..int8,
uint1..uint8, e2m1, e2m3, e3m2, e4m3, e5m2), optionally with its scale groups: "int4" (groups of
128 inputs, quantize's default), "int4:g64" (groups of 64), "int4:channel" (one scale per output
channel).  The float checkpoint is rounded to nearest at load time; lm_head stays float.

A Hugging Face directory whose config.json has a `quantization_config` with quant_method gptq,
awq or compressed-tensors is loaded as stored: the model is built on the meta device (no float
weights for the quantized linears), the quantized linears become QuantizedLinear layers through
tessera.eager.checkpoints.load_quantized_linears, and the other tensors (embeddings, norms,
lm_head) load in the engine's dtype.  There `quantization=` must be None or the checkpoint's method.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file

from tessera.eager.checkpoints import load_quantized_linears
from tessera.eager.quantize import QuantizedLinear
from tessera.errors import ArgumentError, FileFormatError, UnsupportedError
from tessera.quant import codecs

log = logging.getLogger("tessera")

CHECKPOINT_METHODS = ("gptq", "awq", "compressed-tensors")
DEFAULT_GROUP_SIZE = 128  # tessera.quantize's default


class QuantizationArgumentError(ArgumentError, ValueError):
    """A `quantization=` value tessera.llm cannot take: an unknown type or group suffix, or one
    that disagrees with the checkpoint's quantization_config."""


class UnsupportedQuantizationError(UnsupportedError, ValueError):
    """A checkpoint quantized with a method or bit width tessera cannot load (yet)."""


def parse_quantization(spec: str) -> tuple[str, int | None]:
    """"int4" -> ("int4", 128); "int4:g64" -> ("int4", 64); "int4:channel" -> ("int4", None)."""
    if not isinstance(spec, str):
        raise QuantizationArgumentError(f"quantization must be a string such as 'int4' or 'int4:g64', got {spec!r}")
    name, _, groups = spec.partition(":")
    try:
        codecs.weight_type(name)
    except ArgumentError as e:
        raise QuantizationArgumentError(f"quantization={spec!r}: {e}") from e
    if not groups:
        return name, DEFAULT_GROUP_SIZE
    if groups == "channel":
        return name, None
    if groups.startswith("g") and groups[1:].isdigit() and int(groups[1:]) > 0:
        return name, int(groups[1:])
    raise QuantizationArgumentError(f"quantization={spec!r}: the group suffix must be ':g<N>' (N > 0) or ':channel'")


def checkpoint_quantization(config: transformers.PretrainedConfig) -> dict[str, Any] | None:
    """The config's quantization_config as a dict (None when the checkpoint is not quantized)."""
    qcfg = getattr(config, "quantization_config", None)
    if qcfg is None:
        return None
    return dict(qcfg.to_dict() if hasattr(qcfg, "to_dict") else qcfg)


def check_quantization(quantization: str | None, qcfg: dict[str, Any] | None) -> str | None:
    """The checkpoint's method when it is one tessera loads and `quantization` agrees with it
    (None or the method's name); None for an unquantized checkpoint."""
    if qcfg is None:
        if quantization in CHECKPOINT_METHODS:
            raise QuantizationArgumentError(f"quantization={quantization!r} but the model's config has no quantization_config; "
                                            "pass a tessera weight type such as 'int4' to quantize a float checkpoint")  # fmt: skip
        return None
    method = str(qcfg.get("quant_method", "")).lower().replace("_", "-")
    if method not in CHECKPOINT_METHODS:
        raise UnsupportedQuantizationError(f"config.json's quantization_config has quant_method={method!r}; tessera "
                                           f"loads {list(CHECKPOINT_METHODS)}")  # fmt: skip
    if quantization is not None and quantization != method:
        raise QuantizationArgumentError(f"quantization={quantization!r} conflicts with the checkpoint, which is already "
                                        f"quantized with {method}; pass quantization=None (or {method!r})")  # fmt: skip
    if method in ("gptq", "awq"):
        if qcfg.get("bits", 4) != 4:
            raise UnsupportedQuantizationError(f"{method} checkpoints with bits={qcfg.get('bits')} are not supported; "
                                               "tessera loads 4-bit ones")  # fmt: skip
        if method == "awq" and (str(qcfg.get("version", "gemm")).lower() != "gemm" or qcfg.get("zero_point") is False):
            raise UnsupportedQuantizationError(f"AWQ version={qcfg.get('version')!r} zero_point={qcfg.get('zero_point')!r} "
                                               "is not supported; tessera loads GEMM checkpoints with zero points")  # fmt: skip
        if method == "gptq" and qcfg.get("desc_act"):
            raise UnsupportedQuantizationError("GPTQ act-order checkpoints (desc_act=true) are not supported yet; "
                                               "re-export without desc_act")  # fmt: skip
    return method


def _loader_options(method: str, qcfg: dict[str, Any]) -> dict[str, Any]:
    if method == "gptq":
        v2 = str(qcfg.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
        return {"bits": 4, "zero_offset": 0 if v2 else 1}  # v2 stores zero points as is, v1 minus one
    if method == "compressed-tensors":
        return {"quantization_config": qcfg}
    return {}


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, or of the shards model.safetensors.index.json lists."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileFormatError(f"{path} has no model.safetensors nor model.safetensors.index.json; quantized "
                              "checkpoints load from safetensors only")  # fmt: skip
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(path / f))
    return tensors


@contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory, no init) while
    buffers stay real: rotary inv_freq and the like are computed at construction, not stored.
    Like accelerate's init_empty_weights it patches nn.Module for the duration: modules another
    thread builds meanwhile get meta parameters too."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def load_quantized_checkpoint(path: Path, config: transformers.PretrainedConfig, qcfg: dict[str, Any], method: str,
                              dtype: torch.dtype, attn_implementation: str) -> transformers.PreTrainedModel:  # fmt: skip
    """The causal LM of a gptq / awq / compressed-tensors directory, on the CPU, with
    QuantizedLinear layers where the checkpoint holds quantized linears."""
    tensors = read_safetensors(path)
    with _parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    try:
        load_quantized_linears(model, tensors, method, **_loader_options(method, qcfg))
    except ArgumentError as e:  # a checkpoint that does not match its config or the model
        raise FileFormatError(f"{path}: {e}") from e
    except UnsupportedError as e:
        raise UnsupportedQuantizationError(f"{path}: {e}") from e
    quantized = tuple(f"{name}." for name, m in model.named_modules() if isinstance(m, QuantizedLinear))
    rest = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items() if not k.startswith(quantized)}
    _load_float_tensors(model, rest, path)
    model.eval()
    if (path / "generation_config.json").is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(path, local_files_only=True)
    return model


def _load_float_tensors(model: transformers.PreTrainedModel, tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """Load the unquantized tensors, tie lm_head to the embeddings where the config says so, and
    refuse a checkpoint that leaves any parameter unset."""
    expected = set(dict(model.named_parameters(remove_duplicate=False))) | set(dict(model.named_buffers()))
    unexpected = sorted(set(tensors) - expected)
    if unexpected:  # e.g. rotary inv_freq that older exports stored; transformers skips them too
        log.warning("%s: ignoring %d checkpoint tensors the model has no place for: %s", path, len(unexpected),
                    unexpected[:5])  # fmt: skip
    model.load_state_dict({k: v for k, v in tensors.items() if k in expected}, strict=False, assign=True)
    model.tie_weights()
    missing = sorted(name for name, p in model.named_parameters() if p.is_meta)
    if missing:
        raise FileFormatError(f"{path}: the checkpoint lacks {missing[:5]}")
