"""The kernel front end: error reporting (message and exact source line) and parsing features.

Each error case marks its offending line with a `# E:<tag>` comment; the expected line
number is found by scanning this file's text, independently of `inspect`.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest

import tessera as ts
from tessera import f32, i32, i64
from tessera.ir import expr as E
from tessera.ir.functor import IRVisitor

THIS_FILE = Path(__file__).resolve()
SOURCE_LINES = THIS_FILE.read_text().splitlines()


def marker_line(tag: str) -> int:
    """The 1-based line of this file that carries the comment `# E:<tag>` (exactly one)."""
    pattern = re.compile(rf"# E:{re.escape(tag)}(\s|$)")
    hits = [n for n, text in enumerate(SOURCE_LINES, 1) if pattern.search(text)]
    assert len(hits) == 1, f"marker {tag!r} found {len(hits)} times"
    return hits[0]


def check_error(err: ts.KernelSyntaxError, tag: str, *fragments: str) -> None:
    """The error names the problem and points at the marked line of this file."""
    text = str(err)
    for frag in fragments:
        assert frag in text, f"{frag!r} not in error message:\n{text}"
    assert err.line == marker_line(tag), f"reported line {err.line}, expected {marker_line(tag)}:\n{text}"
    assert Path(err.filename).resolve() == THIS_FILE
    # The rendered message quotes the offending source line.
    assert SOURCE_LINES[err.line - 1].strip().split("  #")[0] in text


def helper(x):
    """An ordinary Python function: fine at compile time, not callable on run-time values."""
    return x * 2


# ---- error cases: plain functions, turned into kernels inside the tests --------------------------


def k_missing_annotation(
    a: f32["n"],
    b,  # E:missing_annotation
):
    pass


def k_string_constant(a: f32["n"]):
    for i in range(a.shape[0]):
        a[i] = 1.0
    a[0] = "hello"  # E:string_constant


def k_slice_store(a: f32["n"]):
    a[1:3] = 0.0  # E:slice_store


def k_slice_load(a: f32["n"], b: f32["n"]):
    for i in range(a.shape[0]):
        b[i] = a[i:]  # E:slice_load


def k_unknown_name(a: f32["n"]):
    for i in range(a.shape[0]):
        if i > 2:
            for j in range(3):
                a[i] = a[j] + not_defined_anywhere  # E:unknown_name  # noqa: F821


def k_non_kernel_call(a: f32["n"]):
    for i in range(a.shape[0]):
        a[i] = helper(a[i])  # E:non_kernel_call


def k_float_to_int_var(a: f32["n"]):
    n: i32 = 0
    n = a[0]  # E:float_to_int_var  # noqa: F841


def k_float_to_int_implicit_var(a: f32["n"]):
    k = 3
    k = a[0] * 2.0  # E:float_to_int_implicit_var  # noqa: F841


def k_float_to_int_store(a: f32["n"], b: i32["n"]):
    for i in range(a.shape[0]):
        b[i] = a[i]  # E:float_to_int_store


def k_float_to_int_augassign(a: f32["n"], b: i32["n"]):
    for i in range(a.shape[0]):
        b[i] += a[i]  # E:float_to_int_augassign


def k_too_many_indices(a: f32["n"]):
    a[0, 1] = 1.0  # E:too_many_indices


def k_too_few_indices(a: f32["m", "n"], b: f32["m"]):
    for i in range(a.shape[0]):
        b[i] = a[i]  # E:too_few_indices


def k_float_index(a: f32["n"], b: f32["n"]):
    for i in range(a.shape[0]):
        b[i] = a[a[i]]  # E:float_index


def k_float_index_store(a: f32["n"], x: f32):
    a[x] = 1.0  # E:float_index_store


def k_thread_idx_cpu(a: f32["n"]):
    i = ts.thread_idx.x  # E:thread_idx_cpu
    a[i] = 1.0


def k_block_idx_cpu(a: f32["n"]):
    for i in range(a.shape[0]):
        a[i] = a[i] + ts.block_idx.y  # E:block_idx_cpu


def k_syncthreads_cpu(a: f32["n"]):
    a[0] = 1.0
    ts.syncthreads()  # E:syncthreads_cpu


def k_shared_tensor_cpu(a: f32["n"]):
    s = ts.shared_tensor(f32, [32])  # E:shared_tensor_cpu
    s[0] = a[0]


def k_cuda_without_attrs(a: f32["n"]):  # E:cuda_without_attrs
    i = ts.block_idx.x * 128 + ts.thread_idx.x
    if i < a.shape[0]:
        a[i] = 0.5


def k_cuda_without_grid(a: f32["n"]):  # E:cuda_without_grid
    ts.attrs.block = 128
    i = ts.block_idx.x * 128 + ts.thread_idx.x
    if i < a.shape[0]:
        a[i] = 0.5


def k_return_value(a: f32["n"]):
    x = a[0]
    return x  # E:return_value


def k_with(a: f32["n"]):
    with open("x"):  # E:with
        a[0] = 1.0


def k_try(a: f32["n"]):
    try:  # E:try
        a[0] = 1.0
    except ValueError:
        pass


def k_lambda(a: f32["n"]):
    f = lambda x: x  # E:lambda  # noqa: E731, F841


def k_import(a: f32["n"]):
    import os  # E:import  # noqa: F401


def k_list_comp(a: f32["n"]):
    for i in range(a.shape[0]):
        a[i] = sum([a[i] for _ in range(2)])  # E:list_comp


def k_mapping_unpack_too_many(a: f32[32]):
    for i, j, k in ts.spatial(4, 8).on(0):  # E:mapping_unpack_too_many
        a[i * 8 + j + k] = 1.0


REPEAT_4x8 = ts.repeat(4, 8)


def k_mapping_unpack_too_few(a: f32[32]):
    for t in REPEAT_4x8:  # E:mapping_unpack_too_few
        a[t] = 1.0


def k_grid_unpack(a: f32["n"]):
    for i, j in ts.grid(4):  # E:grid_unpack
        a[i + j] = 1.0


def k_parallel_in_cuda(a: f32["n"]):
    ts.attrs.grid = 1
    ts.attrs.block = 32
    for i in ts.parallel(a.shape[0]):  # E:parallel_in_cuda
        a[i] = 1.0


def k_attrs_on_cpu(a: f32["n"]):
    ts.attrs.grid = 4  # E:attrs_on_cpu
    a[0] = 1.0


def k_rebind_tensor(a: f32["n"], b: f32["n"]):
    a = b  # E:rebind_tensor  # noqa: F841


def k_tensor_as_value(a: f32["n"], b: f32["n"]):
    b[0] = a + 1.0  # E:tensor_as_value


def k_float_range(a: f32["n"], x: f32):
    for i in range(x):  # E:float_range
        a[i] = 1.0


def k_floordiv_float(a: f32["n"]):
    for i in range(a.shape[0]):
        a[i] = a[i] // 2.0  # E:floordiv_float


def k_int_cast_needed_var(a: f32["n"], x: i32):
    acc = 0
    for i in range(x):
        acc += a[i]  # E:int_cast_needed_var


def k_assign_loop_var(a: f32["n"]):
    for i in range(a.shape[0]):
        i = i - 5  # E:assign_loop_var
        a[i + 5] = 1.0


def k_augassign_loop_var(a: f32["n"]):
    for i in range(a.shape[0]):
        a[i] = 1.0
        i += 1  # E:augassign_loop_var


def k_assign_mapping_var(a: f32[32]):
    for i, j in ts.spatial(4, 8).on(0):
        j = j * 2  # E:assign_mapping_var
        a[i * 8 + j] = 1.0


def k_assign_shape_symbol(a: f32["n"]):
    n = a.shape[0]
    n -= 1  # E:assign_shape_symbol
    for i in range(n):
        a[i] = 1.0


CASES = [
    (k_missing_annotation, "cpu", "missing_annotation", ["'b'", "needs a type annotation"]),
    (k_string_constant, "cpu", "string_constant", ["string constant 'hello'", "not supported"]),
    (k_slice_store, "cpu", "slice_store", ["slices are not supported"]),
    (k_slice_load, "cpu", "slice_load", ["slices are not supported"]),
    (k_unknown_name, "cpu", "unknown_name", ["'not_defined_anywhere'", "not defined"]),
    (k_non_kernel_call, "cpu", "non_kernel_call", ["helper", "not a kernel function", "run-time values"]),
    (k_float_to_int_var, "cpu", "float_to_int_var", ["'n'", "int32", "float32", "cast"]),
    (k_float_to_int_implicit_var, "cpu", "float_to_int_implicit_var", ["'k'", "int32", "float32", "cast"]),
    (k_float_to_int_store, "cpu", "float_to_int_store", ["int32", "float32", "cast"]),
    (k_float_to_int_augassign, "cpu", "float_to_int_augassign", ["int32", "float32", "cast"]),
    (k_too_many_indices, "cpu", "too_many_indices", ["'a'", "rank 1", "2 indices"]),
    (k_too_few_indices, "cpu", "too_few_indices", ["'a'", "rank 2", "1 indices"]),
    (k_float_index, "cpu", "float_index", ["index into 'a'", "integer", "float32"]),
    (k_float_index_store, "cpu", "float_index_store", ["index into 'a'", "integer", "float32"]),
    (k_thread_idx_cpu, "cpu", "thread_idx_cpu", ["threadIdx.x", "only available in CUDA kernels"]),
    (k_block_idx_cpu, "cpu", "block_idx_cpu", ["blockIdx.y", "only available in CUDA kernels"]),
    (k_syncthreads_cpu, "cpu", "syncthreads_cpu", ["syncthreads()", "only available in CUDA kernels"]),
    (k_shared_tensor_cpu, "cpu", "shared_tensor_cpu", ["shared_tensor()", "only available in CUDA kernels"]),
    (k_cuda_without_attrs, "cuda", "cuda_without_attrs", ["attrs.grid", "attrs.block"]),
    (k_cuda_without_grid, "cuda", "cuda_without_grid", ["attrs.grid"]),
    (k_return_value, "cpu", "return_value", ["cannot return values"]),
    (k_with, "cpu", "with", ["`With` statements are not supported"]),
    (k_try, "cpu", "try", ["`Try` statements are not supported"]),
    (k_lambda, "cpu", "lambda", ["`Lambda` expressions are not supported"]),
    (k_import, "cpu", "import", ["`Import` statements are not supported"]),
    (k_list_comp, "cpu", "list_comp", ["`ListComp` expressions are not supported"]),
    (k_mapping_unpack_too_many, "cpu", "mapping_unpack_too_many", ["rank 2", "unpacks 3 names"]),
    (k_mapping_unpack_too_few, "cpu", "mapping_unpack_too_few", ["rank 2", "unpacks 1 names"]),
    (k_grid_unpack, "cpu", "grid_unpack", ["grid() has 1 dimensions", "unpacks 2 names"]),
    (k_parallel_in_cuda, "cuda", "parallel_in_cuda", ["parallel() loops are for CPU kernels"]),
    (k_attrs_on_cpu, "cpu", "attrs_on_cpu", ["CPU kernels do not use them"]),
    (k_rebind_tensor, "cpu", "rebind_tensor", ["cannot rebind tensor", "'a'"]),
    (k_tensor_as_value, "cpu", "tensor_as_value", ["'a'", "not a scalar value"]),
    (k_float_range, "cpu", "float_range", ["range() bounds must be integers", "float32"]),
    (k_floordiv_float, "cpu", "floordiv_float", ["'//' needs integer operands"]),
    (k_int_cast_needed_var, "cpu", "int_cast_needed_var", ["'acc'", "int32", "float32"]),
    (k_assign_loop_var, "cpu", "assign_loop_var", ["cannot assign to loop variable 'i'"]),
    (k_augassign_loop_var, "cpu", "augassign_loop_var", ["cannot assign to loop variable 'i'"]),
    (k_assign_mapping_var, "cpu", "assign_mapping_var", ["cannot assign to loop variable 'j'"]),
    (k_assign_shape_symbol, "cpu", "assign_shape_symbol", ["cannot assign to 'n'", "shape symbol"]),
]


@pytest.mark.parametrize("fn, target, tag, fragments", CASES, ids=[c[2] for c in CASES])
def test_error_message_and_line(fn, target, tag, fragments):
    with pytest.raises(ts.KernelSyntaxError) as info:
        ts.kernel(fn, target=target)
    check_error(info.value, tag, *fragments)
    assert info.value.kernel == fn.__name__


def test_errors_are_tessera_errors():
    with pytest.raises(ts.TesseraError):
        ts.kernel(k_with)


def test_error_line_with_decorator():
    """The decorator line must not shift the reported line."""
    with pytest.raises(ts.KernelSyntaxError) as info:

        @ts.kernel
        def k(a: f32["n"]):
            for i in range(a.shape[0]):
                a[i] = "nope"  # E:decorated

    check_error(info.value, "decorated", "'nope'")


def test_error_line_with_call_decorator_cuda():
    with pytest.raises(ts.KernelSyntaxError) as info:

        @ts.kernel(
            target="cuda",
        )
        def k(a: f32["n"]):
            ts.attrs.grid = ts.ceil_div(a.shape[0], 128)
            ts.attrs.block = 128
            i = ts.block_idx.x * 128 + ts.thread_idx.x
            if i < a.shape[0]:
                a[i] = a[i, 0]  # E:decorated_cuda

    check_error(info.value, "decorated_cuda", "rank 1", "2 indices")


def test_error_line_in_closure_kernel():
    def make(flag):
        @ts.kernel
        def k(a: f32["n"]):
            if flag:
                a[0] = 1.0
            else:
                a[0] = undefined_in_else  # E:closure_else  # noqa: F821

        return k

    make(True)  # the dead branch is not parsed
    with pytest.raises(ts.KernelSyntaxError) as info:
        make(False)
    check_error(info.value, "closure_else", "'undefined_in_else'")


def test_error_column_points_into_line():
    with pytest.raises(ts.KernelSyntaxError) as info:
        ts.kernel(k_return_value)
    err = info.value
    src = SOURCE_LINES[err.line - 1]
    assert src[err.col :].startswith("return x")


# ---- positive parsing ------------------------------------------------------------------------------


class _CallNames(IRVisitor):
    def __init__(self):
        self.names: list[str] = []

    def visit_Call(self, e: E.Call):
        self.names.append(e.func)
        super().visit_Call(e)


def call_names(func) -> list[str]:
    """Names of the intrinsic calls in a function's IR, in visiting order."""
    v = _CallNames()
    v.visit(func.body)
    return v.names


def make_branchy(flag: bool, scale: int):
    @ts.kernel
    def branchy(a: f32["n"], out: f32["n"]):
        for i in range(a.shape[0]):
            if flag:
                out[i] = a[i] * (scale * 2 + 1)
            else:
                out[i] = a[i] + 123.25

    return branchy


@pytest.mark.parametrize("flag", [True, False])
def test_compile_time_if_drops_dead_branch(flag, rng):
    k = make_branchy(flag, 3)
    text = str(k.ir)
    if flag:
        assert "7.0" in text and "123.25" not in text
    else:
        assert "123.25" in text and "7.0" not in text
    assert "if" not in text.split("\n", 1)[1]  # no run-time branch at all
    a = rng.uniform(-2, 2, 37).astype(np.float32)
    out = np.full_like(a, np.nan)
    k(a, out)
    np.testing.assert_allclose(out, a * 7 if flag else a + np.float32(123.25), rtol=1e-6)


def test_closure_ints_fold(rng):
    BLOCK = 16
    SHIFT = 3

    @ts.kernel
    def folded(a: i32["n"], out: i32["n"]):
        for i in range(BLOCK // 2 - 1):
            out[i] = a[i] + ((SHIFT * BLOCK - 1) + max(BLOCK, 5) * min(SHIFT, 2))

    text = str(folded.ir)
    assert "range(0, 7, 1)" in text
    assert str(3 * 16 - 1 + 16 * 2) in text
    assert "BLOCK" not in text and "SHIFT" not in text
    assert "max" not in text and "min" not in text  # compile-time max/min are folded, not intrinsics
    a = rng.integers(-100, 100, 11).astype(np.int32)
    out = np.full_like(a, -7777)
    folded(a, out)
    np.testing.assert_array_equal(out[:7], a[:7] + 79)
    np.testing.assert_array_equal(out[7:], -7777)


def test_shape_access(rng):
    @ts.kernel
    def rowsum(a: f32["m", "n"], out: f32["m"], c: f32[3, "n"]):
        for i in range(a.shape[0]):
            acc = 0.0
            for j in range(a.shape[1]):
                acc += a[i, j] * c[a.shape[0] - a.shape[0] + c.shape[0] - 1, j]
            out[i] = acc

    text = str(rowsum.ir)
    assert "range(0, m, 1)" in text and "range(0, n, 1)" in text
    assert [p.name for p in rowsum.ir.shape_params] == ["m", "n"]
    a = rng.uniform(-1, 1, (5, 13)).astype(np.float32)
    c = rng.uniform(-1, 1, (3, 13)).astype(np.float32)
    out = np.full(5, np.nan, np.float32)
    rowsum(a, out, c)
    np.testing.assert_allclose(out, a @ c[2], rtol=1e-5, atol=1e-6)


def test_while_break_continue(rng):
    @ts.kernel
    def collatz(start: i32["n"], steps: i32["n"], odd_steps: i32["n"]):
        for i in range(start.shape[0]):
            x = start[i]
            s = 0
            odd = 0
            while True:
                if x == 1:
                    break
                s += 1
                if x % 2 == 0:
                    x = x // 2
                    continue
                odd += 1
                x = 3 * x + 1
            steps[i] = s
            odd_steps[i] = odd

    def ref(x):
        s = odd = 0
        while x != 1:
            s += 1
            if x % 2 == 0:
                x //= 2
                continue
            odd += 1
            x = 3 * x + 1
        return s, odd

    start = rng.integers(1, 10_000, 23).astype(np.int32)
    steps = np.full_like(start, -1)
    odd = np.full_like(start, -1)
    collatz(start, steps, odd)
    expected = np.array([ref(int(x)) for x in start])
    np.testing.assert_array_equal(steps, expected[:, 0])
    np.testing.assert_array_equal(odd, expected[:, 1])
    text = str(collatz.ir)
    assert "while" in text and "break" in text and "continue" in text


def test_augmented_assign_on_elements(rng):
    @ts.kernel
    def aug(a: f32["n"], b: i64["n"], c: i32["n"]):
        for i in range(a.shape[0]):
            a[i] += 1.5
            a[i] *= 2.0
            a[i] -= a[i] / 4.0
            b[i] *= 3
            b[i] -= 7
            c[i] //= 3
            c[i] %= 5
            c[i] <<= 1
            c[i] ^= 1

    a = rng.uniform(-5, 5, 19).astype(np.float32)
    b = rng.integers(-(2**40), 2**40, 19).astype(np.int64)
    c = rng.integers(-1000, 1000, 19).astype(np.int32)
    ea = (a + np.float32(1.5)) * np.float32(2.0)
    ea = ea - ea / np.float32(4.0)
    eb = b * 3 - 7
    ec = (((c // 3) % 5) << 1) ^ 1
    aug(a, b, c)
    np.testing.assert_allclose(a, ea, rtol=1e-6)
    np.testing.assert_array_equal(b, eb)
    np.testing.assert_array_equal(c, ec)


def test_python_builtins_map_to_intrinsics(rng):
    @ts.kernel
    def pyfuncs(a: f32["n"], b: f32["n"], out: f32["n"]):
        for i in range(a.shape[0]):
            out[i] = max(a[i], b[i]) + min(a[i], 0.5) + math.exp(a[i]) + abs(b[i]) + math.sqrt(abs(a[i]))

    names = call_names(pyfuncs.ir)
    assert sorted(set(names)) == ["abs", "exp", "max", "min", "sqrt"]
    assert names.count("abs") == 2
    a = rng.uniform(-2, 2, 29).astype(np.float32)
    b = rng.uniform(-2, 2, 29).astype(np.float32)
    out = np.full_like(a, np.nan)
    pyfuncs(a, b, out)
    expected = np.maximum(a, b) + np.minimum(a, np.float32(0.5)) + np.exp(a) + np.abs(b) + np.sqrt(np.abs(a))
    np.testing.assert_allclose(out, expected, rtol=1e-5)


def test_tessera_intrinsics_and_casts_parse():
    @ts.kernel
    def k(a: f32["n"], b: i32["n"]):
        for i in range(a.shape[0]):
            b[i] = ts.cast(ts.max_(a[i], 0.0), i32) + int(a[i]) + ts.ceil_div(i, 4)
            a[i] = ts.select(b[i] > 0, ts.tanh(a[i]), ts.fma(a[i], 2.0, 1.0)) + a[i] ** 2

    names = call_names(k.ir)
    assert {"max", "tanh", "fma"} <= set(names)
    assert "pow" not in names  # x ** 2 becomes x * x


def test_bitcast_reads_the_same_bits_and_refuses_other_widths(rng):
    """ts.bitcast: float32 -> uint32 and back as numpy's view (negative zero, a float32
    subnormal, NaN's bits kept); a width mismatch is refused at the kernel's line."""

    @ts.kernel(target="cpu", name="bits_round_trip")
    def k(x: f32["n"], u: ts.uint32["n"], y: f32["n"]):
        for i in range(x.shape[0]):
            u[i] = ts.bitcast(x[i], ts.uint32)
            y[i] = ts.bitcast((u[i] & 0x807FFFFF) | 0x3F800000, f32)  # the mantissa and sign, exponent 0

    x = np.concatenate([rng.standard_normal(29), [-0.0, 1e-40, np.nan]]).astype(np.float32)
    u, y = np.zeros(x.size, np.uint32), np.zeros(x.size, np.float32)
    k(x, u, y)
    assert np.array_equal(u, x.view(np.uint32))
    assert np.array_equal(y.view(np.uint32), (x.view(np.uint32) & 0x807FFFFF) | 0x3F800000)
    with pytest.raises(ts.KernelSyntaxError, match="widths must match"):

        @ts.kernel
        def bad(a: f32["n"], b: i64["n"]):
            for i in range(a.shape[0]):
                b[i] = ts.bitcast(a[i], i64)


def test_docstring_and_pass_are_ignored():
    @ts.kernel
    def k(a: f32["n"]):
        """A docstring."""
        pass
        a[0] = 1.0

    assert k.__doc__ == "A docstring."
    assert "docstring" not in str(k.ir)


def test_cuda_kernel_parses_with_attrs():
    @ts.kernel(target="cuda")
    def k(a: f32["n"]):
        ts.attrs.grid = ts.ceil_div(a.shape[0], 128)
        ts.attrs.block = 128
        i = ts.block_idx.x * 128 + ts.thread_idx.x
        if i < a.shape[0]:
            a[i] = a[i] * 2.0

    assert len(k.ir.launch.grid) == 1 and len(k.ir.launch.block) == 1
    assert "threadIdx.x" in str(k.ir)


def test_integer_warp_max_shuffles_once_per_step():
    """Integer max compiles to `a > b ? a : b`; the shuffle must not sit inside it (divergent shuffle)."""
    import re

    @ts.kernel(target="cuda")
    def imax(x: ts.int32[32], y: ts.int32[1]):
        ts.attrs.grid = 1
        ts.attrs.block = 32
        m = ts.warp_reduce(x[ts.thread_idx.x], "max")
        if ts.thread_idx.x == 0:
            y[0] = m

    src = imax.source
    assert src.count("__shfl_xor_sync") == 5
    assert not re.search(r"\?[^;]*__shfl", src)
