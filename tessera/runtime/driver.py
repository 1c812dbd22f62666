"""The CUDA driver through cuda-python's bindings: loading them, checking results, GPU 0's
primary context.  The runtime's modules (cuda, tensor_map, cuda_graph) all go through here;
cuda-python is imported on first use, so importing this module needs no GPU and no driver."""

from __future__ import annotations

import functools
from typing import Any

from tessera.errors import DeviceError


def _driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise DeviceError(f"cuda-python is not installed ({exc}); `pip install cuda-bindings`") from None
    return driver


def check(result: Any, what: str) -> Any:
    """Unpack a cuda-python (err, *values) tuple, raising DeviceError on failure."""
    driver = _driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        _, desc = driver.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else name
        desc = desc.decode() if isinstance(desc, bytes) else desc
        raise DeviceError(f"{what} failed: {name}: {desc}")
    return rest[0] if len(rest) == 1 else tuple(rest) if rest else None


@functools.cache
def context() -> tuple[Any, Any]:
    """(device, primary context) of GPU 0, made current on first use."""
    driver = _driver()
    try:
        (err,) = driver.cuInit(0)
    except Exception as exc:  # noqa: BLE001  (driver library missing)
        raise DeviceError(f"no CUDA driver could be loaded: {exc}. Run CPU kernels (target='cpu') on this machine.") from None
    if err != driver.CUresult.CUDA_SUCCESS:
        raise DeviceError(f"cuInit failed ({err}); is there a GPU? Run CPU kernels (target='cpu') instead.")
    count = check(driver.cuDeviceGetCount(), "cuDeviceGetCount")
    if count == 0:
        raise DeviceError("no CUDA device found; run CPU kernels (target='cpu') instead")
    dev = check(driver.cuDeviceGet(0), "cuDeviceGet")
    ctx = check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return dev, ctx


def ensure_current() -> None:
    _, ctx = context()
    check(_driver().cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
