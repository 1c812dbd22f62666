"""DLPack in and out: kernels and compiled graphs take any DLPack producer (numpy, torch,
cupy-alike objects that offer only __dlpack__), tessera's device arrays go out to torch.
The GPU side of the capsules is checked on the CPU with producers that describe device memory
(nothing reads it), and for real in the cuda tier."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import tessera as ts
from tessera import f32
from tessera.errors import ArgumentError
from tessera.runtime import dlpack
from tessera.runtime.tensor import as_view, view_of

torch = pytest.importorskip("torch")


class DlpackOnly:
    """A producer that offers nothing but DLPack (as jax, cupy or tensorflow arrays can)."""

    def __init__(self, inner):
        self.inner = inner

    def __dlpack__(self, **kwargs):
        return self.inner.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.inner.__dlpack_device__()


class Exported:
    """Memory described by tessera.runtime.dlpack.export: what DeviceArray hands out."""

    def __init__(self, ptr, shape, dt, device, owner):
        self.args = (ptr, shape, dt, device, 0, owner)

    def __dlpack__(self, **kwargs):
        return dlpack.export(*self.args)

    def __dlpack_device__(self):
        return (self.args[3], 0)


@ts.kernel
def axpy(a: f32["n"], x: f32["n"], out: f32["n"]):
    for i in ts.parallel(a.shape[0]):
        out[i] = a[i] * 2.0 + x[i]


@pytest.mark.slow
def test_kernels_take_dlpack_only_producers(rng):
    a, x = rng.standard_normal(29).astype(np.float32), rng.standard_normal(29).astype(np.float32)
    out = torch.empty(29)
    axpy(DlpackOnly(torch.from_numpy(a)), DlpackOnly(x), DlpackOnly(out))  # the output is written in place
    np.testing.assert_allclose(out.numpy(), a * 2 + x, rtol=1e-6)


@pytest.mark.slow
def test_export_goes_to_torch_and_numpy_without_copy(rng):
    for dt, np_dt in ((ts.float32, np.float32), (ts.int64, np.int64), (ts.boolean, np.bool_), (ts.float16, np.float16)):
        host = (rng.standard_normal((3, 1, 5)) * 10).astype(np_dt)
        live = len(dlpack._LIVE)
        t = torch.from_dlpack(Exported(host.ctypes.data, host.shape, dt, dlpack.CPU, host))
        assert tuple(t.shape) == host.shape and t.data_ptr() == host.ctypes.data
        np.testing.assert_array_equal(t.numpy(), host)
        assert np.from_dlpack(Exported(host.ctypes.data, host.shape, dt, dlpack.CPU, host)).ctypes.data == host.ctypes.data
        del t
        gc.collect()
        assert len(dlpack._LIVE) == live  # the consumers called the deleter; nothing leaks
    # bfloat16 has no numpy type but travels to torch.
    bits = torch.randn(7).to(torch.bfloat16)
    back = torch.from_dlpack(Exported(bits.data_ptr(), (7,), ts.bfloat16, dlpack.CPU, bits))
    assert torch.equal(back, bits)


def test_device_memory_through_dlpack_is_viewed_as_cuda():
    # A producer describing GPU memory (as cupy or jax on a GPU do): the view carries the device
    # pointer, shape, dtype and device; no byte is read here.
    owner = object()
    view = as_view(Exported(0x7F0000001000, (2, 3), ts.float16, dlpack.CUDA, owner))
    assert (view.ptr, view.shape, view.dtype, view.device, view.contiguous) == (0x7F0000001000, (2, 3), ts.float16,
                                                                                 "cuda", True)  # fmt: skip
    with pytest.raises(ArgumentError, match="DLPack device type 10"):
        view_of(Exported(0x1000, (2,), ts.float32, 10, owner), "kernel f: argument 'x'")  # ROCm


@pytest.mark.slow
def test_compiled_graph_takes_dlpack_and_its_outputs_leave_through_dlpack(rng):
    from tessera.graph import GraphBuilder
    from tessera.graph.compiler import compile_graph

    b = GraphBuilder("g")
    x = b.input("x", ["n", 6])
    b.output(b.op("softmax", b.op("mul", x, b.constant(np.float32(1.5)))))
    g = b.build()
    compiled = compile_graph(g, "cpu")
    xv = rng.standard_normal((5, 6)).astype(np.float32)
    (out,) = compiled(DlpackOnly(torch.from_numpy(xv)))
    np.testing.assert_allclose(out, g.run(xv)[0], rtol=1e-5, atol=1e-7)
    t = torch.from_dlpack(out)
    assert t.data_ptr() == out.ctypes.data
    with pytest.raises(ArgumentError, match="compiled for the CPU"):
        compiled(Exported(0x7F0000001000, (5, 6), ts.float32, dlpack.CUDA, object()))


@pytest.mark.cuda
def test_device_arrays_go_to_torch_and_come_back(rng):
    from tessera.runtime.cuda import DeviceArray

    host = rng.standard_normal((4, 33)).astype(np.float32)
    dev = DeviceArray.from_numpy(host)
    t = torch.from_dlpack(dev)
    assert t.is_cuda and t.data_ptr() == dev.ptr and torch.equal(t.cpu(), torch.from_numpy(host))
    t.mul_(2)  # shared memory: the device array sees it
    np.testing.assert_array_equal(dev.numpy(), host * 2)

    @ts.kernel(target="cuda")
    def add_one(x: f32["n"], y: f32["n"]):
        ts.attrs.grid = ts.ceil_div(x.shape[0], 128)
        ts.attrs.block = 128
        i = ts.block_idx.x * 128 + ts.thread_idx.x
        if i < x.shape[0]:
            y[i] = x[i] + 1.0

    x = torch.from_numpy(rng.standard_normal(1000).astype(np.float32)).cuda()
    y = torch.empty_like(x)
    add_one(DlpackOnly(x), DlpackOnly(y))  # through dlpack.consume, not torch's own path
    torch.cuda.synchronize()
    torch.testing.assert_close(y, x + 1)
