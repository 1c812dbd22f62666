"""Loading quantized checkpoints (GPTQ, AWQ, compressed-tensors) into a torch model's linears.

The formats' decoding lives in tessera.quant.checkpoints; this module swaps the layers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tessera.eager.quantize import QuantizedLinear
from tessera.errors import ArgumentError, UnsupportedError
from tessera.quant.checkpoints import (
    config_groups,
    from_awq,
    from_compressed_tensors,
    from_gptq,
    group_of,
    target_matches,
)


def load_quantized_linears(model: Any, state_dict: Mapping[str, Any], format: str, **options: Any) -> Any:
    """Replace, in place, the nn.Linear layers of `model` stored quantized in `state_dict` with
    QuantizedLinear layers; `<name>.bias` is kept when present.  Returns the model.

    * format "gptq" / "awq": layers with `<name>.qweight` (options: from_gptq's bits, zero_offset);
    * format "compressed-tensors": options `quantization_config` (the checkpoint's, or its whole
      config.json; required) and `weights_only` (default False: activation quantization is
      refused; True loads the quantized weights and keeps activations in float).  Each layer is
      matched to a config group by its targets (exact name, then "re:" patterns, then the class
      name "Linear"), layers in `ignore` are left alone, and every layer with `<name>.weight_scale`
      or `<name>.weight_packed` in the state dict must match a group."""
    if format not in ("gptq", "awq", "compressed-tensors"):
        raise ArgumentError(f"format must be 'gptq', 'awq' or 'compressed-tensors', got {format!r}")
    if format == "compressed-tensors":
        unknown = set(options) - {"quantization_config", "weights_only"}
        if unknown or "quantization_config" not in options:
            raise ArgumentError(f"format 'compressed-tensors' takes the options quantization_config (required) and "
                                f"weights_only, got {sorted(options)}")  # fmt: skip
        cfg = options["quantization_config"]
        if options.get("weights_only"):
            cfg = dict(cfg.get("quantization_config", cfg.get("compression_config", cfg)))
            cfg["config_groups"] = {k: {**v, "input_activations": None, "output_activations": None}
                                    for k, v in (cfg.get("config_groups") or {}).items()}  # fmt: skip
        groups, ignore = config_groups(cfg)
    loaded = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if not isinstance(child, torch.nn.Linear):
                continue
            if format == "compressed-tensors":
                if not any(f"{full}.{key}" in state_dict for key in ("weight_packed", "weight_scale")):
                    continue
                if any(target_matches(p, full, type(child).__name__) for p in ignore):
                    raise ArgumentError(
                        f"{full} is in quantization_config.ignore but the state dict holds it quantized"
                    )
                match = group_of(groups, full, type(child).__name__)
                local = {key[len(full) + 1 :]: v for key, v in state_dict.items()
                         if key.startswith(f"{full}.") and "." not in key[len(full) + 1 :]}  # fmt: skip
                try:
                    w = from_compressed_tensors(local, match[1], match[2])
                except (ArgumentError, UnsupportedError) as e:
                    raise type(e)(f"{full}: {e}") from e
            else:
                if f"{full}.qweight" not in state_dict:
                    continue
                get = lambda key, full=full: state_dict[f"{full}.{key}"]  # noqa: E731
                if format == "gptq":
                    w = from_gptq(get("qweight"), get("qzeros"), get("scales"), state_dict.get(f"{full}.g_idx"),
                                  **options)  # fmt: skip
                else:
                    w = from_awq(get("qweight"), get("qzeros"), get("scales"))
            if w.shape != (child.out_features, child.in_features):
                raise ArgumentError(f"{full}: checkpoint weight is {list(w.shape)} but the layer is "
                                    f"[{child.out_features}, {child.in_features}]")  # fmt: skip
            bias = state_dict.get(f"{full}.bias", child.bias)
            setattr(module, child_name, QuantizedLinear(w, torch.as_tensor(bias) if bias is not None else None))
            loaded += 1
    if not loaded:
        key = "weight_packed' or '<name>.weight_scale" if format == "compressed-tensors" else "qweight"
        raise ArgumentError(f"no layer of the model has '<name>.{key}' in the {format} state dict")
    return model
