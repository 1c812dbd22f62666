"""Loaders for quantized checkpoint formats: GPTQ (AutoGPTQ / GPTQModel), AWQ (AutoAWQ GEMM) and
compressed-tensors (llm-compressor / vLLM: pack-quantized, naive-quantized, int-quantized,
float-quantized).

GPTQ and AWQ store, per linear layer `<prefix>`, 4-bit codes packed eight to an int32 word, float16
scales [G, N] and packed zero points [G, N / 8], with W[n, k] = (q - z) * s for k in group g:
* GPTQ: `qweight` int32 [K / 8, N], value k = 8i + j of column n in bits 4j..4j+3 of word [i, n];
  `qzeros` int32 [G, N / 8], zero of column 8c + j in bits 4j.. of word [g, c], stored minus one
  in the original format (`zero_offset=1`; GPTQ v2 checkpoints store it as is: 0); `g_idx`
  int32 [K] (group of each input; only k // group_size, i.e. no act-order, is taken).
* AWQ: `qweight` int32 [K, N / 8] packing eight columns per word in the order 0, 2, 4, 6, 1, 3,
  5, 7 (nibble i holds column 8c + AWQ_ORDER[i]); `qzeros` the same over [G, N / 8].
Both give a QuantizedWeight of uint4 codes with zero points.

compressed-tensors (weights only; the quantization arguments come from the checkpoint's
`quantization_config`, see `compressed_tensors_args`) stores, per linear layer, q signed in
[-2**(b-1), 2**(b-1) - 1], W[n, k] = (q - z) * s, z = 0 when symmetric:
* pack-quantized: `weight_packed` int32 [N, ceil(K * b / 32)] with q + 2**(b-1) packed densely
  along k, element k in bits b*k.. of the row's little-endian bit stream (for b = 1, 2, 4, 8,
  32 / b per word, element 0 in the lowest bits); `weight_shape` [N, K]; `weight_zero_point`
  (asymmetric group / channel) int32 [ceil(N * b / 32), G] packed the same way along n (older
  versions: int8 [N, G] unpacked); b = 3, 5, 6, 7 are refused (the library changed their layout
  from 32 // b fields per word to dense packing between versions).
* naive-quantized / int-quantized: `weight` int8 [N, K] holding q, `weight_zero_point` int8.
* float-quantized: `weight` float8_e4m3fn [N, K] (no zero points), W = w * s.
`weight_scale` is [N, G] (group: G = ceil(K / group_size)), [N, 1] (channel) or [1] (tensor),
in float16, bfloat16 or float32; tessera keeps float16 scales, so float16 and bfloat16 scales
convert exactly and float32 ones round to the nearest float16 (a relative error <= 2**-11; scales
outside float16's normal range are refused).  `weight_g_idx`, when present, must be k //
group_size (no act-order groups).  Symmetric int weights give int<b> codes without zero points,
asymmetric ones uint<b> codes (q + 2**(b-1)) with zero points z + 2**(b-1); e4m3 weights give e4m3
codes (the float8_e4m3fn bits).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from tessera.errors import ArgumentError, UnsupportedError
from tessera.quant.packed import PackedTensor
from tessera.quant.quantize import QuantizedWeight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _np(a: Any, name: str) -> np.ndarray:
    if hasattr(a, "detach"):
        a = a.detach().cpu()
        if str(a.dtype) == "torch.bfloat16":
            a = a.float()  # exact
        elif str(a.dtype).startswith("torch.float8"):
            raise ArgumentError(f"checkpoint tensor '{name}' is {a.dtype}; only weights may be float8")
        a = a.numpy()
    a = np.asarray(a)
    if a.size == 0:
        raise ArgumentError(f"checkpoint tensor '{name}' is empty")
    return a


def _nibbles(words: np.ndarray) -> np.ndarray:
    """int32 words [..., W] -> their eight 4-bit fields [..., W, 8], lowest first."""
    u = words.astype(np.int64) & 0xFFFFFFFF
    return ((u[..., None] >> (4 * np.arange(8))) & 0xF).astype(np.int32)


def _check_scales(scales: np.ndarray, n: int, k: int) -> tuple[np.ndarray, int]:
    if scales.ndim != 2 or scales.shape[1] != n:
        raise ArgumentError(f"scales must be [groups, {n}], got {list(scales.shape)}")
    g = scales.shape[0]
    if k % g:
        raise ArgumentError(f"{k} inputs do not split into {g} groups of equal size")
    return scales.astype(np.float16), k // g


def from_gptq(qweight: Any, qzeros: Any, scales: Any, g_idx: Any = None, bits: int = 4,
              zero_offset: int = 1) -> QuantizedWeight:  # fmt: skip
    """A QuantizedWeight from GPTQ tensors (see the module docstring)."""
    if bits != 4:
        raise UnsupportedError(f"only 4-bit GPTQ checkpoints are supported, got bits={bits}")
    qw, qz, sc = _np(qweight, "qweight"), _np(qzeros, "qzeros"), _np(scales, "scales")
    if qw.ndim != 2 or qw.dtype not in (np.int32, np.uint32):
        raise ArgumentError(f"GPTQ qweight must be int32 [K / 8, N], got {qw.dtype} {list(qw.shape)}")
    k, n = qw.shape[0] * 8, qw.shape[1]
    sc, group = _check_scales(sc, n, k)
    codes = _nibbles(qw).transpose(0, 2, 1).reshape(k, n).T  # [N, K]
    if qz.shape != (sc.shape[0], n // 8):
        raise ArgumentError(f"GPTQ qzeros must be [{sc.shape[0]}, {n // 8}], got {list(qz.shape)}")
    zeros = (_nibbles(qz).reshape(sc.shape[0], n) + zero_offset).T  # [N, G]
    if g_idx is not None:
        gi = _np(g_idx, "g_idx").astype(np.int64)
        if gi.shape != (k,) or not np.array_equal(gi, np.arange(k) // group):
            raise UnsupportedError("GPTQ act-order checkpoints (g_idx other than k // group_size) are not supported "
                                   "yet; re-export without desc_act")  # fmt: skip
    if zeros.max() > 15:
        raise ArgumentError(f"GPTQ zero points exceed 15 with zero_offset={zero_offset}; is this a GPTQ v2 checkpoint "
                            "(zero_offset=0)?")  # fmt: skip
    return QuantizedWeight(PackedTensor.from_codes(codes, "uint4"), np.ascontiguousarray(sc.T), zeros.astype(np.int32),
                           group)  # fmt: skip


def from_awq(qweight: Any, qzeros: Any, scales: Any) -> QuantizedWeight:
    """A QuantizedWeight from AutoAWQ GEMM tensors (see the module docstring)."""
    qw, qz, sc = _np(qweight, "qweight"), _np(qzeros, "qzeros"), _np(scales, "scales")
    if qw.ndim != 2 or qw.dtype not in (np.int32, np.uint32):
        raise ArgumentError(f"AWQ qweight must be int32 [K, N / 8], got {qw.dtype} {list(qw.shape)}")
    k, n = qw.shape[0], qw.shape[1] * 8
    sc, group = _check_scales(sc, n, k)
    order = np.argsort(AWQ_ORDER)  # column j of a word sits in nibble order[j]

    def columns(words: np.ndarray) -> np.ndarray:
        nib = _nibbles(words)  # [rows, N / 8, 8] by nibble
        return nib[..., order].reshape(words.shape[0], -1)

    if qz.shape != (sc.shape[0], n // 8):
        raise ArgumentError(f"AWQ qzeros must be [{sc.shape[0]}, {n // 8}], got {list(qz.shape)}")
    codes = columns(qw).T  # [N, K]
    zeros = columns(qz).T  # [N, G]
    return QuantizedWeight(PackedTensor.from_codes(codes, "uint4"), np.ascontiguousarray(sc.T), zeros.astype(np.int32),
                           group)  # fmt: skip


# ---- compressed-tensors --------------------------------------------------------------------
CT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized", "float-quantized")
CT_STRATEGIES = ("group", "channel", "tensor")
CT_PACK_BITS = (1, 2, 4, 8)  # 32 % b == 0: every version of the library packs them the same way


def compressed_tensors_args(weights: Mapping[str, Any], format: str) -> dict[str, Any]:
    """The checked weight arguments of a compressed-tensors config group (its "weights" dict:
    num_bits, type, symmetric, strategy, group_size, dynamic, actorder, block_structure), or an
    UnsupportedError / ArgumentError naming the field and what is supported."""
    if format not in CT_FORMATS:
        raise UnsupportedError(f"compressed-tensors format {format!r} is not supported; supported: {list(CT_FORMATS)}")
    if not isinstance(weights, Mapping):
        raise ArgumentError(f"the quantization arguments must be a dict (a config group's 'weights'), got {weights!r}")
    bits = weights.get("num_bits", 8)
    kind = str(weights.get("type", "int"))
    symmetric = bool(weights.get("symmetric", True))
    strategy = str(weights.get("strategy") or "tensor")
    group_size = weights.get("group_size")
    if weights.get("dynamic", False):
        raise UnsupportedError(f"weights.dynamic={weights['dynamic']!r}: dynamic weight quantization stores no scales; "
                               "only static weights (dynamic=false) can be loaded")  # fmt: skip
    if strategy not in CT_STRATEGIES:
        raise UnsupportedError(f"weights.strategy={strategy!r} is not supported; supported: {list(CT_STRATEGIES)}")
    if kind not in ("int", "float"):
        raise UnsupportedError(f"weights.type={kind!r} is not supported; supported: 'int', 'float'")
    if not isinstance(bits, int) or isinstance(bits, bool):
        raise ArgumentError(f"weights.num_bits must be an int, got {bits!r}")
    if format == "float-quantized" or kind == "float":
        if kind != "float" or format not in ("float-quantized", "naive-quantized"):
            raise UnsupportedError(f"weights.type={kind!r} with format {format!r}: float weights are read from "
                                   "'float-quantized' (or 'naive-quantized') checkpoints only, int weights from the others")  # fmt: skip
        if bits != 8:
            raise UnsupportedError(f"weights.num_bits={bits} with type 'float' is not supported; supported: 8 (e4m3)")
        if not symmetric:
            raise UnsupportedError("weights.symmetric=false with type 'float' is not supported (float weights take no "
                                   "zero points)")  # fmt: skip
    elif format == "pack-quantized":
        if bits not in CT_PACK_BITS:
            raise UnsupportedError(f"weights.num_bits={bits} in pack-quantized is not supported; supported: "
                                   f"{list(CT_PACK_BITS)} (compressed-tensors changed how other widths are packed "
                                   "between versions)")  # fmt: skip
    elif not 1 <= bits <= 8:
        raise UnsupportedError(f"weights.num_bits={bits} is not supported; supported: 1..8")
    if strategy == "group":
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
            raise ArgumentError(f"weights.strategy='group' needs a positive weights.group_size, got {group_size!r}")
    actorder = weights.get("actorder")
    if actorder not in (None, False, "weight", "group", "static", True):
        raise UnsupportedError(f"weights.actorder={actorder!r} is not supported; supported: null, 'weight', 'group' "
                               "(with a weight_g_idx equal to k // group_size)")  # fmt: skip
    return {"num_bits": bits, "type": kind, "symmetric": symmetric, "strategy": strategy,
            "group_size": group_size if strategy == "group" else None, "actorder": actorder}  # fmt: skip


def _scales16(a: Any, name: str) -> np.ndarray:
    """float16 scales from float16 / bfloat16 (exact) or float32 / float64 (nearest) ones."""
    s = _np(a, name)
    if s.dtype.kind != "f":
        raise ArgumentError(f"'{name}' must be floating point, got {s.dtype}")
    s64 = s.astype(np.float64)
    with np.errstate(over="ignore"):
        s16 = s64.astype(np.float16)
    err = np.abs(s16.astype(np.float64) - s64)
    if not np.all(np.isfinite(s16)) or np.any(err > np.abs(s64) * 2.0**-11):
        bad = s64.reshape(-1)[
            np.flatnonzero(~np.isfinite(s16.reshape(-1)) | (err > np.abs(s64) * 2.0**-11).reshape(-1))[0]
        ]
        raise ArgumentError(f"'{name}' holds {bad!r}, outside float16's normal range: tessera keeps float16 scales "
                            "and would not load it exactly")  # fmt: skip
    return s16


def _unpack_words(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    """int32 words [R, W] -> the first `count` `bits`-bit fields of each row [R, count], lowest first."""
    per = 32 // bits
    u = words.astype(np.int64) & 0xFFFFFFFF
    f = (u[..., None] >> (bits * np.arange(per))) & ((1 << bits) - 1)
    return f.reshape(words.shape[0], -1)[:, :count].astype(np.int64)


def _local(tensors: Mapping[str, Any], key: str, what: str) -> Any:
    if key not in tensors:
        raise ArgumentError(f"the {what} checkpoint has no '{key}' tensor (has {sorted(tensors)})")
    return tensors[key]


def from_compressed_tensors(tensors: Mapping[str, Any], weights: Mapping[str, Any],
                            format: str = "pack-quantized") -> QuantizedWeight:  # fmt: skip
    """A QuantizedWeight from one layer's compressed-tensors tensors (`tensors` maps the local
    names weight_packed / weight / weight_shape / weight_scale / weight_zero_point / weight_g_idx
    to tensors) with the config group's `weights` arguments (see the module docstring)."""
    args = compressed_tensors_args(weights, format)
    bits, symmetric = args["num_bits"], args["symmetric"]
    offset = 1 << (bits - 1)
    if format == "pack-quantized":
        packed = _np(_local(tensors, "weight_packed", format), "weight_packed")
        if packed.ndim != 2 or packed.dtype not in (np.int32, np.uint32):
            raise ArgumentError(
                f"weight_packed must be int32 [N, K * {bits} / 32], got {packed.dtype} {list(packed.shape)}"
            )
        shape = _np(_local(tensors, "weight_shape", format), "weight_shape").reshape(-1)
        if shape.shape != (2,) or shape.dtype.kind not in "iu":
            raise ArgumentError(f"weight_shape must hold the two ints [N, K], got {shape.tolist()}")
        n, k = int(shape[0]), int(shape[1])
        if packed.shape != (n, -(-k * bits // 32)):
            raise ArgumentError(f"weight_packed of a [{n}, {k}] weight at {bits} bits must be [{n}, {-(-k * bits // 32)}], "
                                f"got {list(packed.shape)}")  # fmt: skip
        unsigned = _unpack_words(packed, bits, k)  # q + offset
    else:
        raw = _local(tensors, "weight", format)
        if args["type"] == "float":
            dt = str(getattr(raw, "dtype", ""))
            if dt == "torch.float8_e4m3fn":
                import torch

                raw = raw.detach().cpu().view(torch.uint8)
            elif dt.startswith("torch.") or np.asarray(raw).dtype != np.uint8:
                raise ArgumentError(
                    f"a float-quantized weight must be float8_e4m3fn (or its bits as uint8), got {dt or np.asarray(raw).dtype}"
                )
            codes = _np(raw, "weight")
            if codes.ndim != 2:
                raise ArgumentError(f"weight must be [N, K], got {list(codes.shape)}")
            n, k = codes.shape
            unsigned = None
        else:
            q = _np(raw, "weight")
            if q.ndim != 2 or q.dtype != np.int8:
                raise ArgumentError(f"an {format} weight must be int8 [N, K], got {q.dtype} {list(q.shape)}")
            if q.min() < -offset or q.max() >= offset:
                raise ArgumentError(f"weight values lie in [{q.min()}, {q.max()}], outside num_bits={bits}'s range "
                                    f"[{-offset}, {offset - 1}]; is num_bits right?")  # fmt: skip
            n, k = q.shape
            unsigned = q.astype(np.int64) + offset
    gs = args["group_size"] or k
    g = -(-k // gs)
    scale = _scales16(_local(tensors, "weight_scale", format), "weight_scale")
    if args["strategy"] == "tensor":
        if scale.size != 1:
            raise ArgumentError(f"weights.strategy='tensor' takes one weight_scale, got {list(scale.shape)}")
        scale = np.full((n, 1), scale.reshape(-1)[0], np.float16)
    elif args["strategy"] == "channel" and scale.shape == (n,):
        scale = scale.reshape(n, 1)
    if scale.shape != (n, g):
        raise ArgumentError(f"weight_scale must be [{n}, {g}] for weights.strategy={args['strategy']!r} "
                            f"(group_size {args['group_size']}), got {list(scale.shape)}")  # fmt: skip
    g_idx = tensors.get("weight_g_idx")
    if g_idx is not None:
        gi = _np(g_idx, "weight_g_idx").astype(np.int64).reshape(-1)
        if gi.shape != (k,) or not np.array_equal(gi, np.arange(k) // gs):
            raise UnsupportedError("weight_g_idx other than k // group_size (weights.actorder='group') is not supported "
                                   "yet; re-export with actorder='weight' or null")  # fmt: skip
    elif args["actorder"] in ("group", True):
        raise ArgumentError("weights.actorder='group' checkpoints carry weight_g_idx, but this layer has none")
    zp = tensors.get("weight_zero_point")
    zeros = None
    if zp is not None:
        z = _np(zp, "weight_zero_point")
        if z.dtype in (np.int32, np.uint32) and format == "pack-quantized" and args["strategy"] != "tensor" \
                and z.shape == (-(-n * bits // 32), g):  # fmt: skip
            zeros = _unpack_words(z.T, bits, n).T  # packed along n: z + offset
        else:
            if z.dtype.kind not in "iu":
                raise ArgumentError(f"weight_zero_point must be integer, got {z.dtype}")
            if args["strategy"] == "tensor" and z.size == 1:
                z = np.full((n, 1), z.reshape(-1)[0])
            elif args["strategy"] == "channel" and z.shape == (n,):
                z = z.reshape(n, 1)
            if z.shape != (n, g):
                raise ArgumentError(f"weight_zero_point must be [{n}, {g}] (or packed int32 "
                                    f"[{-(-n * bits // 32)}, {g}] in pack-quantized), got {list(z.shape)}")  # fmt: skip
            if z.min() < -offset or z.max() >= offset:
                raise ArgumentError(f"weight_zero_point values lie in [{z.min()}, {z.max()}], outside num_bits={bits}'s "
                                    f"range [{-offset}, {offset - 1}]")  # fmt: skip
            zeros = z.astype(np.int64) + offset
        if symmetric:
            if np.any(zeros != offset):
                raise ArgumentError(
                    "weights.symmetric=true but weight_zero_point is not all zero; is the config right?"
                )
            zeros = None
    elif not symmetric:
        raise ArgumentError("weights.symmetric=false but the layer has no weight_zero_point")
    if args["type"] == "float":
        if zeros is not None:
            raise ArgumentError("float weights take no weight_zero_point")
        return QuantizedWeight(PackedTensor.from_codes(codes, "e4m3"), scale, None, gs)
    if symmetric:  # int<b> codes: the two's-complement low bits of q
        return QuantizedWeight(PackedTensor.from_codes((unsigned - offset) & ((1 << bits) - 1), f"int{bits}"), scale,
                               None, gs)  # fmt: skip
    return QuantizedWeight(PackedTensor.from_codes(unsigned, f"uint{bits}"), scale, zeros.astype(np.int32), gs)


def config_groups(quantization_config: Mapping[str, Any]) -> tuple[list[tuple[list[str], dict, str]], list[str]]:
    """[(targets, weights, format)] of a compressed-tensors quantization_config, and its ignore list."""
    cfg = quantization_config
    if not isinstance(cfg, Mapping):
        raise ArgumentError(f"quantization_config must be a dict, got {type(cfg).__name__}")
    for outer in ("quantization_config", "compression_config"):  # a whole config.json
        if outer in cfg and "config_groups" not in cfg:
            cfg = cfg[outer]
    if cfg.get("quant_method", "compressed-tensors") != "compressed-tensors":
        raise ArgumentError(f"quantization_config.quant_method is {cfg['quant_method']!r}, not 'compressed-tensors'")
    groups = cfg.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ArgumentError("quantization_config has no config_groups")
    out = []
    for gname, group in groups.items():
        fmt = group.get("format") or cfg.get("format")
        for key in ("input_activations", "output_activations"):
            if group.get(key):
                raise UnsupportedError(f"config_groups.{gname}.{key} is set: activation quantization is not supported "
                                       "(only weight-only schemes such as W4A16 / W8A16); pass weights_only=True to "
                                       "load the quantized weights and keep activations in float")  # fmt: skip
        if group.get("weights") is None:
            raise UnsupportedError(f"config_groups.{gname}.weights is null: nothing to load")
        targets = group.get("targets") or []
        out.append((list(targets), dict(group["weights"]), fmt))
    return out, list(cfg.get("ignore") or [])


def target_matches(pattern: str, name: str, cls: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None or re.match(pattern[3:], cls) is not None
    return pattern in (name, cls)


def group_of(groups: list[tuple[list[str], dict, str]], name: str, cls: str) -> tuple[list[str], dict, str]:
    """The config group targeting layer `name` of class `cls`: an exact name first, then a "re:"
    pattern, then the class name."""
    for rank in (lambda p: p == name, lambda p: p.startswith("re:") and target_matches(p, name, cls), lambda p: p == cls):
        match = next((gr for gr in groups if any(rank(p) for p in gr[0])), None)
        if match:
            return match
    raise ArgumentError(f"{name} is quantized in the state dict but no config group targets it")
