"""Peers of the `lowbit` suite that travel as wheels (DESIGN.md: carried in `.whl`, see the
device README): Humming (`humming-kernels` 0.1.19, the any-width weight-only kernels vLLM
ships).  Each adapter quantises the same fp16 weights with the peer's own round-to-nearest and
returns a zero-argument callable that runs the peer's GEMM on x, or None with the reason printed
once (a peer that is not installed or refuses a type is reported, never silently dropped).

Tilus 0.2.0's wheel ships the language, not a quantized matmul (that lives in its repository's
examples), so it is not run here; DESIGN.md gives its published numbers."""

from __future__ import annotations

import torch

# tessera weight type -> Humming's name (Humming stores signed integers as unsigned codes)
_HUMMING_TYPES = {"e2m1": "float4e2m1", "e2m3": "float6e2m3", "e3m2": "float6e3m2", "e4m3": "float8e4m3",
                  "e5m2": "float8e5m2"}  # fmt: skip
_REPORTED: set[str] = set()


def _report(key: str, message: str) -> None:
    if key not in _REPORTED:
        _REPORTED.add(key)
        print(message, flush=True)


def humming_type(tname: str) -> str:
    """Humming's dtype string for a tessera weight type name (int4 -> uint4, e4m3 -> float8e4m3)."""
    if tname in _HUMMING_TYPES:
        return _HUMMING_TYPES[tname]
    return "uint" + tname.removeprefix("u").removeprefix("int")


class HummingPeer:
    """One quantised Humming layer per (Humming type, group, N, K), reused across M and by the
    signed and unsigned tessera types of one width (Humming stores both as unsigned codes)."""

    def __init__(self) -> None:
        self.layers: dict[tuple, object] = {}

    def __call__(self, x: torch.Tensor, w: torch.Tensor, tname: str, group: int | None):
        try:
            from humming.layer import HummingLayer
        except Exception as exc:  # noqa: BLE001  (not installed, or its import fails)
            _report("import", f"humming unavailable: {type(exc).__name__}: {str(exc)[:160]}")
            return None
        n, k = w.shape
        key = (humming_type(tname), group, n, k)
        try:
            layer = self.layers.get(key)
            if layer is None:
                layer = HummingLayer(shape_n=n, shape_k=k, torch_dtype=torch.float16,
                                     weight_config={"dtype": humming_type(tname), "group_size": group or 0}).cuda()  # fmt: skip
                layer.load_from_unquantized(w.to(torch.float16))
                layer.transform()
                self.layers[key] = layer
            fn = lambda: layer(x)  # noqa: E731
            fn()
            torch.cuda.synchronize()
            return fn
        except Exception as exc:  # noqa: BLE001  (a type or shape the peer refuses)
            _report(f"{tname},{group}", f"humming refused w={tname} g={group}: {type(exc).__name__}: {str(exc)[:200]}")
            return None
