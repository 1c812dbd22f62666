"""Where a compiled graph keeps its arrays: host numpy ("cpu"), torch CUDA tensors, or tessera's
own device arrays (GPU without torch).

The compiled graph talks to one `Memory`: it converts inputs, uploads constants, carves the
memory plan's arena into views, allocates outputs, copies, and captures/replays CUDA graphs.
Choosing the GPU memory (`arrays` option of compile_graph):
- "torch": torch CUDA tensors in and out, on torch's current stream and torch's CUDA graphs --
  what the torch.compile backend needs;
- "native": tessera DeviceArrays (DLPack and CUDA-array-interface capable) out, any CUDA
  array with DLPack or the CUDA array interface (torch, cupy, jax) or a host array in, on a
  stream of tessera's own, with CUDA graphs through the driver: no torch needed;
- "auto" (default): "torch" when torch with CUDA is importable, else "native".
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tessera.errors import ArgumentError, DeviceError
from tessera.ir import dtypes
from tessera.ir.dtypes import DataType, numpy_dtype
from tessera.ops.compiled import numpy_to_torch, torch_dtype, torch_to_numpy
from tessera.runtime.cuda import DeviceArray, use_stream
from tessera.runtime.cuda_graph import Stream, capture
from tessera.runtime.tensor import view_of

ARRAY_KINDS = ("auto", "torch", "native")


def choose_memory(target: str, arrays: str = "auto") -> Memory:
    """The Memory for `target` ("cpu"/"cuda") and the `arrays` option ("auto"/"torch"/"native")."""
    if arrays not in ARRAY_KINDS:
        raise ArgumentError(f"arrays={arrays!r}: expected one of {', '.join(ARRAY_KINDS)}")
    if target == "cpu":
        return HostMemory()
    if arrays == "auto":
        arrays = "torch" if _torch_cuda() else "native"
    if arrays == "torch":
        if not _torch_cuda():
            raise DeviceError("arrays='torch' needs torch with CUDA (torch.cuda.is_available() is False or torch is "
                              "not installed); use arrays='native' for tessera's own device arrays")  # fmt: skip
        return TorchMemory()
    return NativeMemory()


def _torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _from_dlpack_host(a: Any, name: str) -> np.ndarray:
    """A host DLPack producer's array as numpy (no copy); device memory is refused by name."""
    device = a.__dlpack_device__()[0] if hasattr(a, "__dlpack_device__") else 1
    if device != 1:  # kDLCPU
        raise ArgumentError(f"input {name!r}: the graph is compiled for the CPU, and this {type(a).__name__} is on "
                            f"DLPack device type {int(device)}; copy it to the host first")  # fmt: skip
    try:
        return np.from_dlpack(a)
    except (BufferError, RuntimeError, TypeError, ValueError) as exc:
        raise ArgumentError(f"input {name!r}: the graph is compiled for the CPU, and this {type(a).__name__} cannot "
                            f"be read as host memory through DLPack ({exc}); copy it to the host first") from None


def _view(a: Any) -> Any:
    return view_of(a, "array")


def _contiguous(a: np.ndarray) -> np.ndarray:
    """A C-contiguous array of the same shape (np.ascontiguousarray turns 0-d into 1-d)."""
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


class Memory:
    """The array operations a compiled graph needs; one subclass per kind of array."""

    kind = "abstract"
    captures = False  # whether run/replay through CUDA graphs is possible

    def input(self, a: Any, dt: DataType, name: str) -> Any:
        """`a` as an array this memory runs on, checked to have dtype `dt`."""
        raise NotImplementedError

    def constant(self, data: np.ndarray) -> Any:
        """A graph constant's array in this memory; `data` is read-only and shared by every copy
        of the graph (a memory that hands it to code that may write makes its own copy)."""
        raise NotImplementedError

    def arena(self, nbytes: int) -> Any:
        raise NotImplementedError

    def view(self, arena: Any, offset: int, shape: tuple[int, ...], dt: DataType) -> Any:
        raise NotImplementedError

    def empty(self, shape: tuple[int, ...], dt: DataType) -> Any:
        raise NotImplementedError

    def clone(self, a: Any) -> Any:
        raise NotImplementedError

    def copy_into(self, dst: Any, src: Any) -> None:
        raise NotImplementedError

    def address(self, a: Any) -> int:
        """Where array `a`'s data starts (a CUDA graph captures addresses)."""
        return _view(a).ptr

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around every run of the steps (e.g. to direct launches to the memory's stream)."""
        yield

    @contextlib.contextmanager
    def owned(self) -> Iterator[None]:
        """Around allocations that outlive the call (plans, constants)."""
        yield

    def capture(self, record: Callable[[], None]) -> Any:
        raise NotImplementedError

    def replay(self, graph: Any) -> None:
        raise NotImplementedError


class HostMemory(Memory):
    """numpy arrays on the host; torch CPU tensors are accepted as inputs."""

    kind = "cpu"

    def input(self, a: Any, dt: DataType, name: str) -> Any:
        if type(a).__module__.startswith("torch"):
            a = torch_to_numpy(a)
        elif not isinstance(a, np.ndarray) and hasattr(a, "__dlpack__"):  # cupy, jax... (zero-copy)
            a = _from_dlpack_host(a, name)
        a = _contiguous(np.asarray(a))
        if a.dtype != numpy_dtype(dt):
            raise ArgumentError(f"input {name!r} must be {dt.name}, got {a.dtype}")
        return a

    def constant(self, data: np.ndarray) -> Any:
        return np.array(data, order="C")  # writable and private: torch refuses read-only arrays

    def arena(self, nbytes: int) -> Any:
        return np.empty(max(nbytes, 1), np.uint8)

    def view(self, arena: Any, offset: int, shape: tuple[int, ...], dt: DataType) -> Any:
        count = int(np.prod(shape, dtype=np.int64))
        return np.frombuffer(arena, numpy_dtype(dt), count, offset).reshape(shape)

    def empty(self, shape: tuple[int, ...], dt: DataType) -> Any:
        return np.empty(shape, numpy_dtype(dt))

    def clone(self, a: Any) -> Any:
        return a.copy()

    def copy_into(self, dst: Any, src: Any) -> None:
        dst[...] = src

    def address(self, a: Any) -> int:
        return int(a.__array_interface__["data"][0])


class TorchMemory(Memory):
    """torch CUDA tensors, torch's current stream and torch's CUDA graphs."""

    kind = "torch"
    captures = True

    def __init__(self) -> None:
        import torch

        self._tensor = torch.Tensor
        self._dtypes: dict[DataType, Any] = {}  # tessera dtype -> torch dtype

    def input(self, a: Any, dt: DataType, name: str) -> Any:
        want = self._dtypes.get(dt)
        if type(a) is self._tensor and want is not None and a.dtype == want and a.is_cuda and a.is_contiguous():
            return a  # the usual call, checked cheaply (a decode step passes dozens of cache tensors)
        import torch

        self._dtypes.setdefault(dt, torch_dtype(dt))
        if not isinstance(a, torch.Tensor):
            a = torch.from_dlpack(a) if hasattr(a, "__dlpack__") else numpy_to_torch(_contiguous(np.asarray(a)))
        if a.device.type != "cuda":
            a = a.cuda()
        if a.dtype != torch_dtype(dt):
            raise ArgumentError(f"input {name!r} must be {dt.name}, got {a.dtype}")
        return a.contiguous()

    def constant(self, data: np.ndarray) -> Any:
        with warnings.catch_warnings():  # torch warns of a read-only array; .cuda() copies it before anything runs
            warnings.simplefilter("ignore", UserWarning)
            return numpy_to_torch(data).cuda()

    def arena(self, nbytes: int) -> Any:
        import torch

        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device="cuda")

    def view(self, arena: Any, offset: int, shape: tuple[int, ...], dt: DataType) -> Any:
        count = int(np.prod(shape, dtype=np.int64))
        return arena[offset: offset + count * dt.nbytes].view(torch_dtype(dt)).view(shape)

    def empty(self, shape: tuple[int, ...], dt: DataType) -> Any:
        import torch

        return torch.empty(shape, dtype=torch_dtype(dt), device="cuda")

    def clone(self, a: Any) -> Any:
        return a.clone()

    def copy_into(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def address(self, a: Any) -> int:
        return int(a.data_ptr())

    @contextlib.contextmanager
    def owned(self) -> Iterator[None]:
        # Long-lived buffers are normal tensors even under torch.inference_mode(): later calls
        # outside it copy into them, which torch refuses for inference tensors.
        import torch

        with torch.inference_mode(False):
            yield

    def capture(self, record: Callable[[], None]) -> Any:
        import torch

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm every launch plan off the capture
            record()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            record()
        return graph

    def replay(self, graph: Any) -> None:
        graph.replay()


class NativeMemory(Memory):
    """tessera DeviceArrays on a stream of the compiled graph's own; CUDA graphs through the
    driver.  Inputs: any CUDA array with DLPack or the CUDA array interface (read in place
    when contiguous), or host arrays (copied to the GPU)."""

    kind = "native"
    captures = True

    def __init__(self) -> None:
        self.stream = Stream()

    def input(self, a: Any, dt: DataType, name: str) -> Any:
        if type(a) is DeviceArray:
            view = a.__tessera_view__()
        elif isinstance(a, (np.ndarray, list, tuple, int, float, bool, np.generic)):
            a = _contiguous(np.asarray(a))
            if a.dtype != numpy_dtype(dt):
                raise ArgumentError(f"input {name!r} must be {dt.name}, got {a.dtype}")
            return DeviceArray.from_numpy(a)
        else:
            view = view_of(a, f"input {name!r}")
        if view.dtype != dt:
            raise ArgumentError(f"input {name!r} must be {dt.name}, got {view.dtype.name}")
        if view.device != "cuda":
            return DeviceArray.from_numpy(np.asarray(a))
        if not view.contiguous:
            raise ArgumentError(f"input {name!r} is a CUDA array that is not contiguous; pass a contiguous copy")
        return a if type(a) is DeviceArray else DeviceArray.wrap(view)

    def constant(self, data: np.ndarray) -> Any:
        return DeviceArray.from_numpy(data)

    def arena(self, nbytes: int) -> Any:
        return DeviceArray((max(nbytes, 1),), dtypes.uint8)

    def view(self, arena: Any, offset: int, shape: tuple[int, ...], dt: DataType) -> Any:
        return arena.view(offset, shape, dt)

    def empty(self, shape: tuple[int, ...], dt: DataType) -> Any:
        return DeviceArray(shape, dt, stream=self.stream)

    def clone(self, a: Any) -> Any:
        if type(a) is not DeviceArray:
            a = DeviceArray.wrap(a.__tessera_view__() if hasattr(a, "__tessera_view__") else _view(a))
        return a.clone(self.stream)

    def copy_into(self, dst: Any, src: Any) -> None:
        dst.copy_(src, self.stream.handle)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        with use_stream(self.stream.handle):
            yield

    def capture(self, record: Callable[[], None]) -> Any:
        with self.running():  # warm every launch plan off the capture
            record()
        return capture(self.stream, record)

    def replay(self, graph: Any) -> None:
        graph.replay(self.stream)
