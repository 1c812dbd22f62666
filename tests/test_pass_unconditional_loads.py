"""The unconditional_loads pass: no memory read of a CPU kernel sits in a conditional arm.

gcc 12.2 at -O3 turns such reads into masked vector loads with wrong masks in short inner loops,
on AVX2 and AVX-512 alike (docs/cpu_codegen.md); these tests hold on any x86-64 machine."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import tessera as ts
from tessera import f32, i32
from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.functor import IRVisitor
from tessera.transforms.pipeline import lower
from tessera.transforms.unconditional_loads import IndexBounds, unconditional_loads

SIZES = [1, 3, 5, 7, 13, 60, 67]


class _ConditionalReads(IRVisitor):
    """Loads found in Select arms, right operands of && / ||, or straight-line If branches."""

    def __init__(self) -> None:
        self.depth = 0
        self.found: list[E.Load] = []

    def conditional(self, node) -> None:
        self.depth += 1
        self.visit(node)
        self.depth -= 1

    def visit_Select(self, e: E.Select) -> None:
        self.visit(e.cond)
        self.conditional(e.a)
        self.conditional(e.b)

    def visit_Binary(self, e: E.Binary) -> None:
        self.visit(e.a)
        (self.conditional if e.op in ("&&", "||") else self.visit)(e.b)

    def visit_If(self, s: S.If) -> None:
        self.visit(s.cond)
        self.conditional(s.then_body)
        if s.else_body is not None:
            self.conditional(s.else_body)

    def visit_Load(self, e: E.Load) -> None:
        if self.depth:
            self.found.append(e)
        super().visit_Load(e)


def conditional_reads(func) -> list[E.Load]:
    finder = _ConditionalReads()
    finder.visit(func.body)
    return finder.found


@ts.kernel
def where_mul(a: f32["n"], s: f32["n"], y: f32["n"]):
    for i in range(a.shape[0]):
        y[i] = a[i] * s[i] if a[i] < 0.0 else a[i]


@ts.kernel
def fill_where(a: f32["r", "c"], m: i32["r", "c"], y: f32["r", "c"]):
    for i in range(a.shape[0]):
        for j in range(a.shape[1]):
            y[i, j] = 1.5 if m[i, j] % 2 == 1 and a[i, j] > 0.1 else a[i, j]


@ts.kernel
def shifted(a: f32["m"], y: f32["n"], k: i32):
    for i in range(y.shape[0]):
        y[i] = a[i - k] if i >= k and i - k < a.shape[0] else -1.0


@ts.kernel
def branch_reads(a: f32["n"], b: f32["n"], y: f32["n"]):
    for i in range(a.shape[0]):
        if a[i] > 0.0:
            y[i] = b[i] * 2.0
        else:
            y[i] = a[i]


@ts.kernel
def branch_local_guard(a: f32["n"], b: f32["m"], y: f32["n"]):
    for i in range(a.shape[0]):
        if a[i] > 0.0:
            t = a[i] * 2.0
            y[i] = b[i - 1] if t > 1.0 and i >= 1 and i - 1 < b.shape[0] else 0.0
        else:
            y[i] = 0.5


def test_a_read_under_a_guard_computed_in_the_branch_is_hoisted_clamped(rng):
    """b[i - 1]'s guard uses t, which only exists inside the branch; the clamped index needs no guard."""
    after = unconditional_loads(branch_local_guard.ir)
    assert conditional_reads(after) == [] and "b[min(max(i - 1, 0), m - 1)]" in str(after), str(after)
    lower(branch_local_guard.ir)  # verify rejects a read of t before its declaration
    a = rng.standard_normal(9).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    y = np.empty_like(a)
    branch_local_guard(a, b, y)
    i = np.arange(9)
    ok = (a * 2 > 1) & (i >= 1) & (i - 1 < 5)
    want = np.where(a > 0, np.where(ok, b[np.clip(i - 1, 0, 4)], 0.0), 0.5).astype(np.float32)
    np.testing.assert_array_equal(y, want)


def test_reads_leave_select_arms_logic_operands_and_branches():
    for k in (where_mul, fill_where, shifted, branch_reads):
        before = k.ir
        assert conditional_reads(before), k.ir.name  # the kernels do read conditionally
        after = unconditional_loads(before)
        assert conditional_reads(after) == [], str(after)


def test_reads_proven_in_bounds_keep_their_index():
    after = unconditional_loads(where_mul.ir)
    text = str(after)
    assert "s[i]" in text and "select(a[i] < 0.0, a[i] * s[i]" not in text
    assert "select(a[i] < 0.0, i, 0)" not in text  # no guard where the loop proves the index


def test_reads_not_proven_in_bounds_get_a_clamped_index():
    """Clamped without a condition: the address never depends on the guard."""
    text = str(unconditional_loads(shifted.ir))
    assert "a[min(max(i - k, 0), m - 1)]" in text and "select(i >= k && i - k < m, i - k" not in text, text


def test_clamps_drop_the_side_that_is_proven():
    @ts.kernel
    def ahead(a: f32["n"], y: f32["n"]):
        for i in range(a.shape[0]):
            y[i] = a[i + 1] if i + 1 < a.shape[0] else 0.0

    @ts.kernel
    def behind(a: f32["n"], y: f32["n"]):
        for i in range(a.shape[0]):
            y[i] = a[i - 1] if i >= 1 else 0.0

    assert "a[min(i + 1, n - 1)]" in str(unconditional_loads(ahead.ir))
    assert "a[max(i - 1, 0)]" in str(unconditional_loads(behind.ir))
    for kernel, want in ((ahead, lambda x: np.append(x[1:], 0)), (behind, lambda x: np.insert(x[:-1], 0, 0))):
        for n in (1, 2, 7):
            x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
            y = np.empty_like(x)
            kernel(x, y)
            np.testing.assert_array_equal(y, want(x).astype(np.float32))


def test_cuda_kernels_are_left_alone():
    @ts.kernel(target="cuda")
    def gpu_where(a: f32["n"], s: f32["n"], y: f32["n"]):
        ts.attrs.grid, ts.attrs.block = ts.ceil_div(a.shape[0], 128), 128
        i = ts.block_idx.x * 128 + ts.thread_idx.x
        if i < a.shape[0]:
            y[i] = a[i] * s[i] if a[i] < 0.0 else a[i]

    assert unconditional_loads(gpu_where.ir) is gpu_where.ir


def test_index_bounds_of_split_loops():
    n = E.Var("n", ts.int32)
    outer, inner = E.Var("outer", ts.int32), E.Var("inner", ts.int32)
    bounds = IndexBounds()
    bounds.loops[outer] = S.For(outer, E.Const(0, ts.int32), E.Binary("*", E.Const(4, ts.int32), n), E.Const(1, ts.int32), S.Seq([]))
    bounds.loops[inner] = S.For(inner, E.Const(0, ts.int32), E.Const(5, ts.int32), E.Const(1, ts.int32), S.Seq([]))
    four = E.Const(4, ts.int32)
    assert bounds.in_bounds(E.Binary("//", outer, four), n)
    assert bounds.in_bounds(E.Binary("%", outer, four), four)
    assert bounds.in_bounds(inner, E.Const(5, ts.int32))
    assert not bounds.in_bounds(inner, E.Const(4, ts.int32))
    assert not bounds.in_bounds(E.Binary("-", inner, E.Const(1, ts.int32)), E.Const(5, ts.int32))
    assert bounds.below(E.Binary("-", inner, E.Const(1, ts.int32)), E.Const(5, ts.int32))  # only the lower side fails
    assert not bounds.in_bounds(outer, n)
    m = E.Var("m", ts.int32)
    bounds.loops[outer] = S.For(outer, E.Const(0, ts.int32), E.Binary("*", m, n), E.Const(1, ts.int32), S.Seq([]))
    assert not bounds.in_bounds(E.Binary("//", outer, m), n)  # m could be 0 or negative
    bounds.positive_vars.add(m)  # a shape parameter: a dimension of a non-empty array
    assert bounds.in_bounds(E.Binary("//", outer, m), n) and bounds.in_bounds(E.Binary("%", outer, m), m)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.slow
def test_kernels_match_numpy(rng, n):
    a, s = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    y = np.empty_like(a)
    where_mul(a, s, y)
    np.testing.assert_array_equal(y, np.where(a < 0, a * s, a))
    branch_reads(a, s, y)
    np.testing.assert_array_equal(y, np.where(a > 0, s * np.float32(2), a))
    m = rng.integers(-5, 5, (n, 3)).astype(np.int32)
    a2 = rng.standard_normal((n, 3)).astype(np.float32)
    y2 = np.empty_like(a2)
    fill_where(a2, m, y2)
    np.testing.assert_array_equal(y2, np.where((m % 2 == 1) & (a2 > 0.1), np.float32(1.5), a2))
    for k in (0, 2, n):
        small = rng.standard_normal(max(1, n - k)).astype(np.float32)
        out = np.empty(n, np.float32)
        shifted(small, out, k)
        idx = np.arange(n) - k
        want = np.where((idx >= 0) & (idx < small.size), small[np.clip(idx, 0, small.size - 1)], -1.0)
        np.testing.assert_array_equal(out, want.astype(np.float32))


def test_lowered_pipeline_runs_the_pass():
    assert conditional_reads(lower(where_mul.ir)) == []


# ---- the C of compiled graphs -------------------------------------------------------------------------------------
def _arms(text: str, start: int) -> tuple[str, str]:
    """The two arms of the ternary whose '?' is at `start`."""
    depth, i, colon = 0, start + 1, -1
    while i < len(text):
        ch = text[i]
        if ch in "([":
            depth += 1
        elif ch in ")]":
            if depth == 0:
                break
            depth -= 1
        elif ch == "?" and depth == 0:
            depth += 100  # a nested ternary's ':' belongs to it
        elif ch == ":" and depth >= 100:
            depth -= 100
        elif ch == ":" and depth == 0 and colon < 0:
            colon = i
        elif ch in ";," and depth == 0:
            break
        i += 1
    return text[start + 1 : colon], text[colon + 1 : i]


def reads_in_conditional_arms(c_source: str) -> list[str]:
    """Ternary arms and right operands of && / || of the kernels' bodies that index memory."""
    bad = []
    for body in re.findall(r"\nvoid ts_kernel_\w+\([^)]*\) \{\n(.*?)\n\}", c_source, re.S):
        for m in re.finditer(r"\?", body):
            bad += [arm for arm in _arms(body, m.start()) if "[" in arm]
        for m in re.finditer(r"&&|\|\|", body):
            rest = body[m.end():]
            depth, i = 0, 0
            while i < len(rest) and not (depth == 0 and rest[i] in ");?,") and not (depth < 0):
                depth += rest[i] in "(["
                depth -= rest[i] in ")]"
                i += 1
            if "[" in rest[:i]:
                bad.append(rest[:i])
    return bad


def test_the_checker_sees_the_old_pattern():
    old = ("\nvoid ts_kernel_g(float* a_, float* b_, float* y_) {\n  for (int i = 0; i < 5; ++i) {\n"
           "    y_[i] = ((a_[i] < 0.0f) ? a_[i] * b_[i] : a_[i]);\n    y_[i] = (a_[i] > 0 && b_[i] > 0) ? 1.0f : 2.0f;\n"
           "    y_[i] = b_[(a_[i] > 0) ? i : 0];\n  }\n}")  # fmt: skip
    assert reads_in_conditional_arms(old) == [" a_[i] * b_[i] ", " a_[i]", " b_[i] > 0"]


torch = pytest.importorskip("torch")
import tessera.frontend.torch  # noqa: E402,F401  (registers the backend)

SELECTS = {
    "where_mul": lambda x, s: torch.where(x < 0, x * s, x),
    "masked_fill": lambda x, s: x.masked_fill(s > 0, 1.5),
    "where_amax": lambda x, s: torch.where(x == x.amax(-1, keepdim=True), s, x),
    "where_int": lambda x, s: torch.where((x * 10).to(torch.int32) % 2 == 1, x, s),
    "clamp": lambda x, s: torch.clamp(x, min=-0.2, max=0.3) + s,
    "prelu": lambda x, s: torch.where(x >= 0, x, x * s),
    "pad_cat": lambda x, s: torch.cat([torch.nn.functional.pad(x, (1, 2)), s], -1),
}
SHAPES = [(3, 4, 5), (2, 3, 7), (5, 13), (1, 9), (6, 9), (4, 1, 3), (1,)]


@pytest.mark.parametrize("name", sorted(SELECTS))
@pytest.mark.slow
def test_compiled_selects_match_torch_at_odd_shapes(name, cache_dir):
    """The issue's reproductions: silent wrong values at these shapes before the pass."""
    fn = SELECTS[name]
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="tessera")
    gen = torch.Generator().manual_seed(7)
    for shape in SHAPES:
        for _ in range(2):
            x, s = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
            with torch.no_grad():
                torch.testing.assert_close(compiled(x, s), fn(x, s), rtol=0, atol=0, msg=f"{name} {shape}")
    sources = [p.read_text() for p in Path(cache_dir).rglob("*.c")]
    assert sources
    for src in sources:
        assert reads_in_conditional_arms(src) == [], src
