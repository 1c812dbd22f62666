"""Several threads launching the same kernel at once each get their own, correct result;
the CUDA launch-plan cache is a bounded LRU."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import tessera as ts
from tessera import f32, i32
from tessera.runtime.lru import LRUCache

THREADS, CALLS = 8, 40


@ts.kernel
def _affine(x: f32["n"], out: f32["n"], scale: f32, shift: i32):
    for i in ts.parallel(x.shape[0]):
        out[i] = x[i] * scale + shift


def _hammer(call, check) -> None:
    """Run `call(worker, k)` from THREADS threads CALLS times each, then `check` every result."""

    def worker(w: int) -> list:
        return [(k, call(w, k)) for k in range(CALLS)]

    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(worker, range(THREADS)))
    for w, res in enumerate(results):
        for k, value in res:
            check(w, k, value)


def test_cpu_kernel_from_many_threads():
    def call(w, k):
        n = 1000 + 37 * w + k  # different shapes, scalars and data in every call
        x = np.full(n, w + 1, np.float32)
        out = np.empty(n, np.float32)
        _affine(x, out, float(k), w * 1000 + k)
        return out

    def check(w, k, out):
        assert out.shape == (1000 + 37 * w + k,)
        np.testing.assert_array_equal(out, np.float32(w + 1) * k + (w * 1000 + k))

    _hammer(call, check)


def test_cpu_division_by_zero_status_is_per_call():
    """One thread's division by zero is reported to that call only."""

    @ts.kernel
    def div(a: i32["n"], b: i32["n"], q: i32["n"]):
        for i in range(a.shape[0]):
            q[i] = a[i] // b[i]

    def call(w, k):
        a = np.full(5000, 100, np.int32)
        b = np.full(5000, 1 + w, np.int32)
        if (w + k) % 3 == 0:
            b[k] = 0
        q = np.empty_like(a)
        try:
            div(a, b, q)
        except ZeroDivisionError:
            return "raised"
        return q

    def check(w, k, q):
        if (w + k) % 3 == 0:
            assert isinstance(q, str) and q == "raised"
        else:
            np.testing.assert_array_equal(q, 100 // (1 + w))

    _hammer(call, check)


def test_lru_cache_evicts_the_least_recently_used():
    c: LRUCache[int] = LRUCache(3)
    for k in range(3):
        c.put(k, k * 10)
    assert c.get(0) == 0  # 0 is now the most recent
    c.put(3, 30)
    assert 1 not in c and c.get(0) == 0 and c.get(2) == 20 and c.get(3) == 30 and len(c) == 3
    with pytest.raises(ValueError):
        LRUCache(0)


def test_lru_cache_from_many_threads():
    c: LRUCache[int] = LRUCache(16)

    def call(w, k):
        key = (w * CALLS + k) % 40
        got = c.get(key)
        if got is None:
            c.put(key, key * 2)
            got = key * 2
        return got, key

    def check(w, k, value):
        got, key = value
        assert got == key * 2

    _hammer(call, check)
    assert len(c) == 16


# ---- CUDA --------------------------------------------------------------------------------------------------------------


def _cuda_affine(x: f32["n"], out: f32["n"], scale: f32, shift: i32):
    ts.attrs.grid = ts.ceil_div(x.shape[0], 128)
    ts.attrs.block = 128
    i = ts.block_idx.x * 128 + ts.thread_idx.x
    if i < x.shape[0]:
        out[i] = x[i] * scale + shift


@pytest.mark.cuda
def test_cuda_kernel_from_many_threads():
    torch = pytest.importorskip("torch")
    k = ts.Kernel(_cuda_affine, "cuda")

    def call(w, j):
        n = 4096 + w  # one plan per thread (shape), shared by that thread's calls
        x = torch.full((n,), float(w + 1), device="cuda")
        out = torch.empty(n, device="cuda")
        k(x, out, 2.0, 7)  # the same scalars: the plan's slots are what threads would share
        torch.cuda.current_stream().synchronize()
        return out.cpu()

    def check(w, j, out):
        assert out.shape == (4096 + w,)
        assert bool((out == (w + 1) * 2.0 + 7).all())

    _hammer(call, check)

    def call_same_plan(w, j):
        x = torch.full((4096,), float(w * CALLS + j), device="cuda")
        out = torch.empty(4096, device="cuda")
        k(x, out, 1.0, 0)
        torch.cuda.current_stream().synchronize()
        return out.cpu()

    def check_same_plan(w, j, out):
        assert bool((out == w * CALLS + j).all()), (w, j)

    _hammer(call_same_plan, check_same_plan)


@pytest.mark.cuda
def test_cuda_bound_launch_from_many_threads():
    torch = pytest.importorskip("torch")
    k = ts.Kernel(_cuda_affine, "cuda").compile()
    n = 2048
    proto = torch.empty(n, device="cuda")
    bound = k.bind((proto, proto, 3.0, 1))

    def call(w, j):
        x = torch.full((n,), float(w * CALLS + j), device="cuda")
        out = torch.empty(n, device="cuda")
        bound([x.data_ptr(), out.data_ptr()], (), torch.cuda.current_stream().cuda_stream)
        torch.cuda.current_stream().synchronize()
        return out.cpu()

    def check(w, j, out):
        assert bool((out == (w * CALLS + j) * 3.0 + 1).all()), (w, j)

    _hammer(call, check)


@pytest.mark.cuda
def test_cuda_plan_cache_keeps_caching_past_its_capacity():
    torch = pytest.importorskip("torch")
    from tessera.runtime.cuda import PLAN_CACHE_SIZE, _plan_key

    k = ts.Kernel(_cuda_affine, "cuda").compile()
    x = torch.ones(256, device="cuda")
    out = torch.empty(256, device="cuda")
    for s in range(PLAN_CACHE_SIZE + 50):  # a new scalar value: a new plan each time
        k.launch((x, out, 1.0, s))
    assert len(k.plans) == PLAN_CACHE_SIZE
    assert _plan_key((x, out, 1.0, PLAN_CACHE_SIZE + 49)) in k.plans  # the newest plans are cached, the oldest evicted
    assert _plan_key((x, out, 1.0, 0)) not in k.plans
    k.launch((x, out, 2.0, 3))
    torch.cuda.synchronize()
    assert bool((out == 5).all())
