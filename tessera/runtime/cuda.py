"""CUDA runtime through cuda-python's driver bindings: context, memory, modules, launches.

tessera shares the device's primary context, the same one torch uses, so torch CUDA
tensors and tessera device arrays can be passed to the same kernels.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Sequence
from math import prod
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import ArgumentError, DeviceError
from tessera.ir.dtypes import DataType
from tessera.ir.func import Function, LaunchConfig
from tessera.ir.functor import written_buffers
from tessera.ir.types import TensorMapType
from tessera.runtime.args import bind, ctype_of, eval_dynamic_smem, eval_launch_dims, scalar_env
from tessera.runtime.lru import LRUCache
from tessera.runtime.tensor import ArrayView, numpy_dtype
from tessera.runtime.tensor_map import TensorMap


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


def is_available() -> bool:
    """True when a CUDA driver and at least one GPU are usable."""
    try:
        context()
        return True
    except DeviceError:
        return False


@functools.cache
def multiprocessor_count() -> int:
    """Streaming multiprocessors of GPU 0, from the driver (132 on an H200 SXM)."""
    driver = _driver()
    dev, _ = context()
    attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    return int(check(driver.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)"))


def synchronize() -> None:
    ensure_current()
    check(_driver().cuCtxSynchronize(), "cuCtxSynchronize (a kernel may have faulted)")


class DeviceArray:
    """A contiguous array in GPU memory, allocated with cuMemAlloc."""

    def __init__(self, shape: Sequence[int], dtype: DataType):
        ensure_current()
        self.shape, self.dtype = tuple(int(s) for s in shape), dtype
        self.nbytes = prod(self.shape) * dtype.nbytes
        self.ptr = int(check(_driver().cuMemAlloc(max(self.nbytes, 1)), "cuMemAlloc"))

    @staticmethod
    def from_numpy(arr: np.ndarray) -> DeviceArray:
        from tessera.runtime.tensor import as_view

        view = as_view(np.ascontiguousarray(arr))
        out = DeviceArray(arr.shape, view.dtype)
        check(_driver().cuMemcpyHtoD(out.ptr, view.ptr, out.nbytes), "cuMemcpyHtoD")
        return out

    def numpy(self) -> np.ndarray:
        out = np.empty(self.shape, dtype=numpy_dtype(self.dtype))
        ensure_current()
        check(_driver().cuMemcpyDtoH(out.ctypes.data, self.ptr, self.nbytes), "cuMemcpyDtoH")
        return out

    def __tessera_view__(self) -> ArrayView:
        return ArrayView(self.ptr, self.shape, self.dtype, "cuda", True, self)

    def __del__(self) -> None:
        ptr = getattr(self, "ptr", 0)
        if ptr:
            try:
                _driver().cuMemFree(ptr)
            except Exception:  # noqa: BLE001  (interpreter shutdown)
                pass

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype})"


def _plan_key(args: Sequence[Any]) -> tuple | None:
    """A hashable signature of torch-tensor/scalar arguments, or None for other arrays."""
    key = []
    for a in args:
        if isinstance(a, (int, float, bool)):
            key.append((type(a), a))
        elif isinstance(a, TensorMap):  # its bytes are copied into the plan's slot per call
            key.append(a.type)
        elif type(a).__name__ in ("Tensor", "Parameter") and type(a).__module__.startswith("torch"):
            key.append((a.shape, a.stride(), a.dtype, a.device))
        else:
            return None
    return tuple(key)


def plan_stream(args: Sequence[Any]) -> int:
    """torch's current stream on the first tensor's device."""
    import torch

    for a in args:
        if isinstance(a, torch.Tensor):
            return int(torch.cuda.current_stream(a.device).cuda_stream)
    return 0


# Launch plans kept per kernel (distinct argument signatures); least recently used go first.
PLAN_CACHE_SIZE = 256


class _Plan:
    """A checked launch of one argument signature: geometry and the arguments' C values.

    The argument slots that cuLaunchKernel reads are per thread (`local.slots`): the driver
    copies the values during the call, so one set per thread lets threads launch concurrently."""

    __slots__ = ("types", "values", "pointer_slots", "map_slots", "grid", "block", "smem", "local")

    def __init__(self, types: list[type], values: list[Any], pointer_slots: list[int], map_slots: list[int],
                 grid: tuple[int, int, int], block: tuple[int, int, int], smem: int):  # fmt: skip
        self.types, self.values, self.pointer_slots, self.map_slots = types, values, pointer_slots, map_slots
        self.grid, self.block, self.smem = grid, block, smem
        self.local = threading.local()

    def slots(self) -> tuple[list[Any], list[Any], int]:
        """This thread's (pointer slots, tensor-map slots, address of the argument array), the
        slots initialised to the checked values.  Hot callers read `local.slots` themselves."""
        try:
            return self.local.slots
        except AttributeError:
            slots = [ct(v) for ct, v in zip(self.types, self.values)]
            array = (ctypes.c_void_p * len(slots))(*[ctypes.addressof(v) for v in slots])
            self.local.keep = (slots, array)  # the array holds only addresses: keep both alive
            self.local.slots = ([slots[i] for i in self.pointer_slots], [slots[i] for i in self.map_slots],
                                ctypes.addressof(array))  # fmt: skip
            return self.local.slots


class CudaKernel:
    """A kernel loaded from a cubin; call it with device arrays or torch CUDA tensors.

    Launches may come from several threads at once (see _Plan)."""

    def __init__(self, func: Function, cubin: Path, name: str | None = None, launch: LaunchConfig | None = None):
        driver = _driver()
        ensure_current()
        self.func = func
        # The lowered kernel's configuration (passes may add a shared-memory pool).
        self.launch_config = launch or func.launch
        self.module = check(driver.cuModuleLoadData(cubin.read_bytes()), f"loading {cubin}")
        self.handle = check(driver.cuModuleGetFunction(self.module, (name or func.name).encode()), "cuModuleGetFunction")
        self.ctypes = [ctype_of(p.type) for p in func.all_params]
        self.written = written_buffers(func)
        self.smem_limit_set = 0
        self._smem_lock = threading.Lock()
        self.plans: LRUCache[_Plan] = LRUCache(PLAN_CACHE_SIZE)

    def launch(self, args: Sequence[Any], stream: int | None = None) -> None:
        """Validate, then launch on `stream` (default: torch's current stream, else stream 0).

        Calls whose arguments are all torch tensors and scalars reuse a plan keyed by the
        tensors' shapes, strides, dtypes and devices and the scalar values: only the data
        pointers are read per call, which keeps the host cost of a launch to a few µs."""
        key = _plan_key(args)
        plan = self.plans.get(key) if key is not None else None
        if plan is None:
            plan = self._plan(args)
            if key is not None:
                self.plans.put(key, plan)
        pointer_slots, map_slots, address = plan.slots()
        if key is not None:  # a cached plan: this call's pointers and tensor maps
            for slot, i in zip(pointer_slots, plan.pointer_slots):
                slot.value = args[i].data_ptr()
            for slot, i in zip(map_slots, plan.map_slots):
                slot.load(args[i].raw)
        if stream is None:
            stream = plan_stream(args) if key is not None else 0
        ensure_current()
        check(
            _driver().cuLaunchKernel(self.handle, *plan.grid, *plan.block, plan.smem, stream, address, 0),
            f"launching {self.func.name} grid={plan.grid} block={plan.block}",
        )

    def bind(self, args: Sequence[Any]) -> BoundLaunch:
        """Check `args` once and return a launcher for later calls whose arguments have the
        same shapes, dtypes, devices and scalar values: it takes only the array pointers and
        tensor maps (bytes), in parameter order, and skips all checking."""
        return BoundLaunch(self, self._plan(args))

    def _plan(self, args: Sequence[Any]) -> _Plan:
        """Full validation and launch geometry for one argument signature."""
        driver = _driver()
        values, _, views = bind(self.func, args, "cuda", self.written)
        launch = self.launch_config
        env = scalar_env(self.func, values)
        grid = eval_launch_dims(self.func, env, launch.grid)
        block = eval_launch_dims(self.func, env, launch.block)
        smem = eval_dynamic_smem(self.func, env, launch)
        if max(grid[1], grid[2]) > 65535 or grid[0] >= 2**31:
            raise ArgumentError(f"{self.func.name}: grid {grid} exceeds CUDA limits")
        if smem > 48 * 1024:
            with self._smem_lock:  # the attribute only grows, whatever order threads set it in
                if smem > self.smem_limit_set:
                    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                    check(driver.cuFuncSetAttribute(self.handle, attr, smem), "raising the dynamic shared memory limit")
                    self.smem_limit_set = smem
        map_slots = [i for i, p in enumerate(self.func.params) if isinstance(p.type, TensorMapType)]
        pointer_slots = [i for i, p in enumerate(self.func.params)
                         if not isinstance(p.type, (DataType, TensorMapType))]  # fmt: skip
        del views
        return _Plan(self.ctypes, values, pointer_slots, map_slots, grid, block, smem)


class BoundLaunch:
    """A launch of one kernel with a fixed argument signature (CudaKernel.bind).

    `launcher(pointers, maps, stream)` writes the arrays' device pointers and the tensor maps'
    bytes into this thread's argument slots and launches: a few µs of host time, no validation."""

    __slots__ = ("kernel", "plan", "local", "dims", "smem", "launch_fn", "success")

    def __init__(self, kernel: CudaKernel, plan: _Plan):
        self.kernel, self.plan, self.local, self.smem = kernel, plan, plan.local, plan.smem
        self.dims = (*plan.grid, *plan.block)
        driver = _driver()
        self.launch_fn, self.success = driver.cuLaunchKernel, driver.CUresult.CUDA_SUCCESS

    def __call__(self, pointers: Sequence[int], maps: Sequence[bytes] = (), stream: int = 0) -> None:
        try:
            pointer_slots, map_slots, address = self.local.slots
        except AttributeError:  # this thread's first launch
            pointer_slots, map_slots, address = self.plan.slots()
        for slot, p in zip(pointer_slots, pointers):
            slot.value = p
        for slot, m in zip(map_slots, maps):
            slot.load(m)
        result = self.launch_fn(self.kernel.handle, *self.dims, self.smem, stream, address, 0)
        if result[0] != self.success:
            check(result, f"launching {self.kernel.func.name}")
