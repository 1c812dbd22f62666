"""CUDA runtime through cuda-python's driver bindings: context, memory, modules, launches.

tessera shares the device's primary context, the same one torch uses, so torch CUDA
tensors and tessera device arrays can be passed to the same kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Iterator, Sequence
from math import prod
from pathlib import Path
from typing import Any

import numpy as np

from tessera import settings
from tessera.errors import ArgumentError, DeviceError
from tessera.ir.dtypes import DataType, numpy_dtype
from tessera.ir.func import Function, LaunchConfig
from tessera.ir.functor import instruction_names, written_buffers
from tessera.ir.types import TensorMapType
from tessera.runtime import dlpack
from tessera.runtime.args import bind, ctype_of, eval_dynamic_smem, eval_launch_dims, scalar_env
from tessera.runtime.driver import _driver, check, context, ensure_current
from tessera.runtime.lru import LRUCache
from tessera.runtime.tensor import ArrayView, as_view, view_of
from tessera.runtime.tensor_map import TensorMap
from tessera.target import PLANNING_TARGET, SM90, Target, architecture


def is_available() -> bool:
    """True when a CUDA driver and at least one GPU are usable."""
    try:
        context()
        return True
    except DeviceError:
        return False


# The GPU as schedules see it (tessera.target); the old name stays for callers.
DeviceProperties = Target
PLANNING_DEVICE = PLANNING_TARGET


@functools.cache
def device_properties() -> Target:
    """GPU 0's target from the driver; PLANNING_TARGET when no GPU or driver is present."""
    try:
        dev, _ = context()
    except DeviceError:
        return PLANNING_TARGET
    driver = _driver()
    attr = driver.CUdevice_attribute

    def get(a: Any) -> int:
        return int(check(driver.cuDeviceGetAttribute(a, dev), "cuDeviceGetAttribute"))

    raw = check(driver.cuDeviceGetName(256, dev), "cuDeviceGetName")
    name = (raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)).split("\x00")[0].strip()
    capability = (get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR), get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
    arch = architecture(capability)
    return Target(
        name, get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
        get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN), get(attr.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
        capability, smem_per_sm=get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
        smem_reserved_per_block=get(attr.CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK),
        registers_per_sm=get(attr.CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR),
        registers_per_thread=arch.registers_per_thread if arch else SM90.registers_per_thread,
        threads_per_sm=get(attr.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR),
        blocks_per_sm=get(attr.CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR),
    )  # fmt: skip


def multiprocessor_count() -> int:
    """Streaming multiprocessors of GPU 0 (device_properties().sms)."""
    return device_properties().sms


def synchronize() -> None:
    ensure_current()
    check(_driver().cuCtxSynchronize(), "cuCtxSynchronize (a kernel may have faulted)")


class DeviceArray:
    """A C-contiguous array in GPU memory: owned (allocated with cuMemAlloc, freed when
    dropped) or a view of memory someone else owns (`view`, `wrap`), which keeps its base alive.

    It speaks DLPack and the CUDA array interface, so torch, cupy and jax read it in place
    (`torch.from_dlpack(a)`); `numpy()` copies it to the host."""

    def __init__(self, shape: Sequence[int], dtype: DataType, *, ptr: int | None = None, base: Any = None,
                 stream: Any = None):  # fmt: skip
        """A new array (`ptr` None), allocated ordered on `stream` (a cuda_graph.Stream: fast
        reuse from the driver's pool, freed in stream order too) or with cuMemAlloc; or a view
        of `ptr`, which `base` owns."""
        ensure_current()
        self.shape, self.dtype = tuple(int(s) for s in shape), dtype
        self.nbytes = prod(self.shape) * dtype.nbytes
        self.base, self._stream = base, None
        if ptr is not None:
            self.ptr, self._owned = int(ptr), False
        elif stream is not None:
            _keep_pool_memory()
            self.ptr = int(check(_driver().cuMemAllocAsync(max(self.nbytes, 1), stream.handle), "cuMemAllocAsync"))
            self._owned, self._stream = True, stream
        else:
            self.ptr = int(check(_driver().cuMemAlloc(max(self.nbytes, 1)), "cuMemAlloc"))
            self._owned = True
        self.device_id = int(check(_driver().cuCtxGetDevice(), "cuCtxGetDevice"))

    @staticmethod
    def from_numpy(arr: np.ndarray) -> DeviceArray:
        view = as_view(np.ascontiguousarray(arr))
        out = DeviceArray(arr.shape, view.dtype)
        check(_driver().cuMemcpyHtoD(out.ptr, view.ptr, out.nbytes), "cuMemcpyHtoD")
        return out

    @staticmethod
    def wrap(view: ArrayView) -> DeviceArray:
        """A DeviceArray over a contiguous CUDA array someone else owns (`view.owner`)."""
        if view.device != "cuda" or not view.contiguous:
            raise ArgumentError(f"DeviceArray.wrap needs a contiguous CUDA array, got a {view.device} array"
                                f"{'' if view.contiguous else ' that is not contiguous'}")  # fmt: skip
        return DeviceArray(view.shape, view.dtype, ptr=view.ptr, base=view.owner)

    # ---- the array surface the runtime and the graph executor use --------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def device(self) -> str:
        return "cuda"

    def data_ptr(self) -> int:
        return self.ptr

    def view(self, offset: int, shape: Sequence[int], dtype: DataType) -> DeviceArray:
        """The array of `shape` and `dtype` starting `offset` bytes into this one."""
        nbytes = prod(shape) * dtype.nbytes
        if offset < 0 or offset + nbytes > max(self.nbytes, 1) and nbytes:
            raise ArgumentError(f"a view of {nbytes} bytes at offset {offset} exceeds the {self.nbytes}-byte array")
        return DeviceArray(shape, dtype, ptr=self.ptr + offset, base=self)

    def reshape(self, *shape: Any) -> DeviceArray:
        """The same memory as another shape; one size may be -1 (inferred, as numpy does)."""
        dims = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        if dims.count(-1) == 1:
            known = prod(d for d in dims if d != -1)
            if known > 0 and prod(self.shape) % known == 0:
                dims = tuple(prod(self.shape) // known if d == -1 else d for d in dims)
        if prod(dims) != prod(self.shape) or any(d < 0 for d in dims):
            raise ArgumentError(f"cannot reshape an array of shape {list(self.shape)} to {list(dims)}")
        return DeviceArray(dims, self.dtype, ptr=self.ptr, base=self)

    def copy_(self, src: Any, stream: int = 0) -> DeviceArray:
        """Copy `src` (a CUDA array of the same shape and dtype, or a host array) into self,
        ordered on `stream` for device sources."""
        if isinstance(src, np.ndarray) and not src.flags.c_contiguous:
            src = np.ascontiguousarray(src).reshape(src.shape)  # (ascontiguousarray makes 0-d 1-d)
        view = view_of(src, "copy source")
        if view.shape != self.shape or view.dtype != self.dtype:
            raise ArgumentError(f"copy of a {view.dtype}{list(view.shape)} array into a {self.dtype}{list(self.shape)} one")
        if not view.contiguous:
            raise ArgumentError("copy source must be contiguous")
        ensure_current()
        if view.device == "cuda":
            check(_driver().cuMemcpyDtoDAsync(self.ptr, view.ptr, self.nbytes, stream), "cuMemcpyDtoDAsync")
        else:
            check(_driver().cuMemcpyHtoD(self.ptr, view.ptr, self.nbytes), "cuMemcpyHtoD")
        return self

    def clone(self, stream: Any = None) -> DeviceArray:
        """A copy in new memory, allocated and copied in order on `stream` (a
        cuda_graph.Stream; None: cuMemAlloc and the legacy stream)."""
        out = DeviceArray(self.shape, self.dtype, stream=stream)
        return out.copy_(self, stream.handle if stream is not None else 0)

    def numpy(self) -> np.ndarray:
        out = np.empty(self.shape, dtype=numpy_dtype(self.dtype))
        ensure_current()
        check(_driver().cuMemcpyDtoH(out.ctypes.data, self.ptr, self.nbytes), "cuMemcpyDtoH")
        return out

    def __tessera_view__(self) -> ArrayView:
        return ArrayView(self.ptr, self.shape, self.dtype, "cuda", True, self)

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None, copy: Any = None) -> Any:
        """A DLPack capsule of this array (`torch.from_dlpack(a)`, `cupy.from_dlpack(a)`): no copy,
        the consumer keeps this array alive.  Work queued on it is finished first (the
        consumer's stream then sees the data)."""
        if copy:
            raise ArgumentError("DeviceArray.__dlpack__(copy=True): tessera shares its memory; copy on the consumer's side")
        if dl_device is not None and tuple(dl_device) != self.__dlpack_device__():
            raise ArgumentError(f"DeviceArray.__dlpack__: the array is on {self.__dlpack_device__()}, not {dl_device}")
        # tessera's streams are blocking: the legacy stream (1) waits for them; others do not.
        if stream not in (None, -1, 1):
            synchronize()
        return dlpack.export(self.ptr, self.shape, self.dtype, dlpack.CUDA, self.device_id, self)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (dlpack.CUDA, self.device_id)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": self.shape, "typestr": numpy_dtype(self.dtype).str, "data": (self.ptr, False),
                "version": 3, "strides": None}  # fmt: skip

    def __del__(self) -> None:
        if getattr(self, "_owned", False) and self.ptr:
            try:
                if self._stream is not None:
                    _driver().cuMemFreeAsync(self.ptr, self._stream.handle)
                else:
                    _driver().cuMemFree(self.ptr)
            except Exception:  # noqa: BLE001  (interpreter shutdown)
                pass

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype})"


@functools.cache
def _keep_pool_memory() -> None:
    """Let the device's default memory pool (cuMemAllocAsync) keep freed memory for reuse
    instead of returning it to the driver at every synchronisation (its default threshold
    is 0), which would make each call's output allocation a fresh driver allocation.  The
    setting belongs to this process."""
    driver = _driver()
    dev, _ = context()
    pool = check(driver.cuDeviceGetDefaultMemPool(dev), "cuDeviceGetDefaultMemPool")
    threshold = driver.cuuint64_t(2**64 - 1)
    check(driver.cuMemPoolSetAttribute(pool, driver.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, threshold),
          "cuMemPoolSetAttribute")  # fmt: skip


_TORCH_TENSOR_TYPES: set[type] = set()  # torch.Tensor and nn.Parameter, as _plan_key meets them


def _plan_key(args: Sequence[Any]) -> tuple | None:
    """A hashable signature of torch-tensor/scalar arguments, or None for other arrays."""
    key = []
    for a in args:
        t = type(a)
        if t in _TORCH_TENSOR_TYPES:
            key.append((a.shape, a.stride(), a.dtype, a.device))
        elif isinstance(a, (int, float, bool)):
            key.append((t, a))
        elif isinstance(a, TensorMap):  # its bytes are copied into the plan's slot per call
            key.append(a.type)
        elif t.__name__ in ("Tensor", "Parameter") and t.__module__.startswith("torch"):
            _TORCH_TENSOR_TYPES.add(t)
            key.append((a.shape, a.stride(), a.dtype, a.device))
        elif type(a) is DeviceArray:  # contiguous by construction
            key.append((a.shape, a.dtype))
        else:
            return None
    return tuple(key)


_stream_scope = threading.local()


@contextlib.contextmanager
def use_stream(stream: int) -> Iterator[None]:
    """Launches in this thread without an explicit stream go to `stream` (a CUstream handle as
    an int) inside the block: how torch-free callers order kernels on their own stream."""
    previous = getattr(_stream_scope, "stream", None)
    _stream_scope.stream = stream
    try:
        yield
    finally:
        _stream_scope.stream = previous


def current_stream(args: Sequence[Any] = ()) -> int:
    """The stream a launch without an explicit one uses: the innermost `use_stream` block's,
    else torch's current stream on the first torch tensor's device, else the legacy stream 0."""
    scoped = getattr(_stream_scope, "stream", None)
    if scoped is not None:
        return scoped
    for a in args:
        if type(a).__module__.startswith("torch") and hasattr(a, "device"):
            return torch_stream(a)
    return 0


def torch_stream(t: Any) -> int:
    """torch's current stream on CUDA tensor t's device, as a raw handle: by the accessor
    Inductor's generated code uses where torch has it (torch.cuda.current_stream builds a
    Stream object, ~10 us of host time a launch on the H200 machine)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(t.get_device()))
    return int(torch.cuda.current_stream(t.device).cuda_stream)


# Launch plans kept per kernel (distinct argument signatures); least recently used go first.
PLAN_CACHE_SIZE = 256


@functools.cache
def programmatic_launch() -> bool:
    """Whether kernels launch with programmatic stream serialization (programmatic dependent
    launch, SM90+): the next kernel in the stream may be scheduled while its predecessor
    runs, which hides most of the gap between dependent kernels (also inside CUDA graphs).
    Safe because every kernel tessera generates executes griddepcontrol.wait before it
    touches memory (backend/codegen_cuda.py: ts_grid_dependency_sync).  $TESSERA_PDL=0
    turns it off; it is read once, with the device query (cache_clear() reads it again)."""
    if not settings.pdl():
        return False
    props = device_properties()
    return props.from_driver and props.capability >= SM90.capability


def launches_programmatically(func: Function) -> bool:
    """Whether `func` launches with programmatic stream serialization: when `programmatic_launch`
    is on, every kernel but the warp-specialised ones (setmaxnreg: one persistent block per SM).
    With the attribute, back-to-back launches of those ran 100-400x slower on the H200, the GPU
    idle (M=4096 GEMMs, tessera's fp16 TMA GEMM and the register-A low-bit kernel: 110-300 ms a
    call instead of 0.7 ms, whether the kernel let its dependents launch at its start or only
    at its exit; bench/results/2026-11-28-h200-lowbit-power.md); at hundreds of us a call they
    have no launch gap worth hiding."""
    return programmatic_launch() and "setmaxnreg" not in instruction_names(func)


def _launch_config(plan: _Plan, stream: int) -> Any:
    """The cuLaunchKernelEx configuration of a plan on a stream (programmatic serialization on)."""
    driver = _driver()
    cfg = driver.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = plan.grid
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = plan.block
    cfg.sharedMemBytes, cfg.hStream = plan.smem, stream
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1
    cfg.attrs, cfg.numAttrs = [attr], 1
    return cfg


def _launch(handle: Any, plan: _Plan, stream: int, address: int) -> Any:
    """Launch `handle` with plan's geometry; the driver's result tuple."""
    if plan.configs is None:
        return _driver().cuLaunchKernel(handle, *plan.grid, *plan.block, plan.smem, stream, address, 0)
    cfg = plan.configs.get(stream)
    if cfg is None:  # one configuration per stream: setting hStream per call costs µs
        cfg = plan.configs[stream] = _launch_config(plan, stream)
    return _driver().cuLaunchKernelEx(cfg, handle, address, 0)


class _Plan:
    """A checked launch of one argument signature: geometry and the arguments' C values.

    The argument slots that cuLaunchKernel reads are per thread (`local.slots`): the driver
    copies the values during the call, so one set per thread lets threads launch concurrently."""

    __slots__ = ("types", "values", "pointer_slots", "map_slots", "grid", "block", "smem", "local", "configs")

    def __init__(self, types: list[type], values: list[Any], pointer_slots: list[int], map_slots: list[int],
                 grid: tuple[int, int, int], block: tuple[int, int, int], smem: int, programmatic: bool):  # fmt: skip
        self.types, self.values, self.pointer_slots, self.map_slots = types, values, pointer_slots, map_slots
        self.grid, self.block, self.smem = grid, block, smem
        self.local = threading.local()
        self.configs: dict[int, Any] | None = {} if programmatic else None  # stream -> launch config

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
        self.programmatic = launches_programmatically(func)
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
            stream = current_stream(args)
        ensure_current()
        check(_launch(self.handle, plan, stream, address), f"launching {self.func.name} grid={plan.grid} block={plan.block}")

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
        return _Plan(self.ctypes, values, pointer_slots, map_slots, grid, block, smem, self.programmatic)


class BoundLaunch:
    """A launch of one kernel with a fixed argument signature (CudaKernel.bind).

    `launcher(pointers, maps, stream)` writes the arrays' device pointers and the tensor maps'
    bytes into this thread's argument slots and launches: a few µs of host time, no validation."""

    __slots__ = ("kernel", "plan", "local", "success")

    def __init__(self, kernel: CudaKernel, plan: _Plan):
        self.kernel, self.plan, self.local = kernel, plan, plan.local
        self.success = _driver().CUresult.CUDA_SUCCESS

    def __call__(self, pointers: Sequence[int], maps: Sequence[bytes] = (), stream: int = 0) -> None:
        try:
            pointer_slots, map_slots, address = self.local.slots
        except AttributeError:  # this thread's first launch
            pointer_slots, map_slots, address = self.plan.slots()
        for slot, p in zip(pointer_slots, pointers):
            slot.value = p
        for slot, m in zip(map_slots, maps):
            slot.load(m)
        result = _launch(self.kernel.handle, self.plan, stream, address)
        if result[0] != self.success:
            check(result, f"launching {self.kernel.func.name}")
