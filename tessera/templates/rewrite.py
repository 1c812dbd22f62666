"""IR rewrites that adapt a scheduled kernel template to one call site, from the outside.

* `specialize` binds a kernel's shape symbols (and chosen scalar parameters) to constants:
  the index arithmetic folds, and the kernel's tensor parameters get exact static shapes.
* `remap_operand` gives a tensor parameter the caller's own shape: every access
  `P[idx]` becomes `P'[f(idx)]`.  Broadcast batch dimensions, batch dimensions folded
  into rows and unravelled NCHW pixels then need no copy and no view at call time.
* `rename` gives a function a new name (one source holds several kernels).

They work on unlowered functions (multi-dimensional accesses), as the front end makes them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from tessera.errors import UnsupportedError
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.func import Function
from tessera.ir.functor import IRMutator, IRVisitor
from tessera.ir.types import GLOBAL, TensorType

IndexMap = Callable[..., Sequence[E.Expr]]


def param(func: Function, name: str) -> E.Var:
    """The parameter called `name`, or a clear error naming the parameters there are."""
    for p in func.params:
        if p.name == name:
            return p
    raise UnsupportedError(f"kernel '{func.name}' has no parameter '{name}' (it has {[p.name for p in func.params]})")


def i32(v: int) -> E.Const:
    return E.Const(int(v), dtypes.int32)


class _Subst(IRMutator):
    """Replace variables, and rebuild register/shared buffer declarations whose shapes use them."""

    def __init__(self, mapping: dict[E.Var, E.Expr]):
        self.mapping = mapping

    def visit_Var(self, e: E.Var) -> E.Expr:
        return self.mapping.get(e, e)


def specialize(func: Function, shapes: Mapping[str, Sequence[int | None]],
               scalars: Mapping[str, int | E.Expr] | None = None) -> Function:
    """`func` with its shape symbols bound from `shapes` (parameter name -> concrete shape)
    and the scalar parameters in `scalars` replaced by constants (or int32 expressions over the
    symbols left free) and dropped from the signature.

    A size of None leaves that dimension's symbol free: it stays a shape parameter, bound from
    the arrays at call time (a kernel generic in its row count).  Every other shape symbol must
    be bound; a constant dimension that disagrees, or a symbol bound to two values, raises
    UnsupportedError."""
    scalars = dict(scalars or {})
    values: dict[str, int] = {}
    free: set[str] = set()
    for name, shape in shapes.items():
        p = param(func, name)
        if not isinstance(p.type, TensorType) or len(shape) != p.type.rank:
            raise UnsupportedError(f"kernel '{func.name}': parameter '{name}' ({p.type}) cannot take shape {tuple(shape)}")
        for dim, size in zip(p.type.shape, shape):
            if size is None:
                if not isinstance(dim, E.Var):
                    raise UnsupportedError(f"kernel '{func.name}': '{name}' dimension {dim} cannot stay free")
                free.add(dim.name)
            elif isinstance(dim, E.Const):
                if dim.value != size:
                    raise UnsupportedError(f"kernel '{func.name}': '{name}' has static size {dim.value}, not {size}")
            elif values.setdefault(dim.name, int(size)) != size:
                raise UnsupportedError(f"kernel '{func.name}': shape symbol '{dim.name}' is bound to both "
                                       f"{values[dim.name]} and {size}")  # fmt: skip
    mapping: dict[E.Var, E.Expr] = {}
    kept = []
    for s in func.shape_params:
        if s.name in free and s.name not in values:
            kept.append(s)
        elif s.name not in values:
            raise UnsupportedError(f"kernel '{func.name}': shape symbol '{s.name}' is not bound by the given shapes")
        else:
            mapping[s] = i32(values[s.name])
    dropped = set()
    for name, v in scalars.items():
        p = param(func, name)
        if isinstance(p.type, TensorType) or not p.type.is_integer:
            raise UnsupportedError(f"kernel '{func.name}': '{name}' is not an integer scalar parameter")
        mapping[p] = v if isinstance(v, E.Expr) else E.Const(int(v), p.type)
        dropped.add(p)
    sub = _Subst(mapping)
    params: list[E.Var] = []
    for p in func.params:
        if p in dropped:
            continue
        if isinstance(p.type, TensorType):
            new = E.Var(p.name, replace(p.type, shape=tuple(sub.visit(d) if isinstance(d, E.Expr) else d for d in p.type.shape)))
            mapping[p] = new
            params.append(new)
        else:
            params.append(p)
    body = sub.visit(func.body)
    launch = replace(func.launch, grid=tuple(sub.visit(d) for d in func.launch.grid),
                     block=tuple(sub.visit(d) for d in func.launch.block),
                     dynamic_smem=None if func.launch.dynamic_smem is None else sub.visit(func.launch.dynamic_smem))  # fmt: skip
    return Function(func.name, params, body, func.kind, launch, kept, func.source_file, func.source_line)


class _Accesses(IRVisitor):
    """Count reads/address-takes and stores of one buffer."""

    def __init__(self, buffer: E.Var):
        self.buffer, self.reads, self.stores = buffer, 0, 0

    def visit_Load(self, e: E.Load) -> None:
        self.reads += e.buffer is self.buffer
        super().visit_Load(e)

    def visit_Address(self, e: E.Address) -> None:
        self.reads += e.buffer is self.buffer
        super().visit_Address(e)

    def visit_Store(self, s: S.Store) -> None:
        self.stores += s.buffer is self.buffer
        super().visit_Store(s)


def accesses(func: Function, buffer: E.Var) -> tuple[int, int]:
    """(reads and address-takes, stores) of `buffer` in `func`'s body."""
    v = _Accesses(buffer)
    v.visit(func.body)
    return v.reads, v.stores


class _Remap(IRMutator):
    def __init__(self, old: E.Var, new: E.Var, index_map: IndexMap):
        self.old, self.new, self.index_map = old, new, index_map

    def _indices(self, idx: tuple[E.Expr, ...]) -> tuple[E.Expr, ...]:
        out = tuple(E.as_expr(i) for i in self.index_map(*idx))
        if len(out) != self.new.type.rank:
            raise UnsupportedError(f"index map of '{self.old.name}' gives {len(out)} indices for a rank-{self.new.type.rank} tensor")
        return out

    def visit_Load(self, e: E.Load) -> E.Expr:
        if e.buffer is not self.old:
            return super().visit_Load(e)
        return E.Load(self.new, self._indices(tuple(self.visit(i) for i in e.indices)))

    def visit_Address(self, e: E.Address) -> E.Expr:
        if e.buffer is not self.old:
            return super().visit_Address(e)
        return E.Address(self.new, self._indices(tuple(self.visit(i) for i in e.indices)))


def remap_operand(func: Function, name: str, shape: Sequence[int], index_map: IndexMap) -> Function:
    """Parameter `name` becomes a tensor of `shape`; each access `name[i...]` reads
    `name[index_map(i...)]` instead.

    The caller guarantees that the map sends every index the kernel touches into the new
    shape and, for 16-byte vector accesses (cp.async), that the last index passes through
    unchanged over each vector (the last dimension stays contiguous)."""
    old = param(func, name)
    if not isinstance(old.type, TensorType) or old.type.scope != GLOBAL:
        raise UnsupportedError(f"kernel '{func.name}': '{name}' is not a global tensor parameter")
    reads, stores = accesses(func, old)
    if stores:
        raise UnsupportedError(f"kernel '{func.name}' writes '{name}'; only read-only operands can be remapped")
    if not reads:
        raise UnsupportedError(f"kernel '{func.name}' reads '{name}' without element accesses (e.g. through a TMA "
                               "descriptor); its operand cannot be remapped")  # fmt: skip
    new = E.Var(name, TensorType(old.type.dtype, tuple(i32(d) for d in shape), GLOBAL))
    body = _Remap(old, new, index_map).visit(func.body)
    params = [new if p is old else p for p in func.params]
    return Function(func.name, params, body, func.kind, func.launch, list(func.shape_params), func.source_file,
                    func.source_line)  # fmt: skip


def rename(func: Function, name: str) -> Function:
    return Function(name, func.params, func.body, func.kind, func.launch, list(func.shape_params), func.source_file,
                    func.source_line)  # fmt: skip


def unravel(flat: E.Expr, shape: Sequence[int | E.Expr]) -> list[E.Expr]:
    """Row-major indices of `flat` in `shape` (unit dimensions give 0; the outermost other one
    takes no modulo).  Sizes are ints, or int32 expressions of a kernel generic in them."""
    out: list[E.Expr] = []
    stride: int | E.Expr = 1
    for k in range(len(shape) - 1, -1, -1):
        d = shape[k]
        if _unit(d):
            out.append(i32(0))
        else:
            q = flat if _unit(stride) else flat // _size(stride)
            outermost = all(_unit(x) for x in shape[:k])
            out.append(q if outermost else q % _size(d))
        if not _unit(d):
            stride = d if _unit(stride) else stride * d
    return out[::-1]


def _unit(d: int | E.Expr) -> bool:
    return d == 1 if isinstance(d, int) else isinstance(d, E.Const) and d.value == 1


def _size(d: int | E.Expr) -> E.Expr:
    return i32(d) if isinstance(d, int) else d


def retype_operand(func: Function, name: str, shape: Sequence[int]) -> Function:
    """Parameter `name`, which the kernel reads only through a tensor map (TMA), takes the
    caller's `shape`: the caller's tensor is passed as it is (the map describes the layout the
    kernel reads; the caller guarantees that it is this tensor's row-major layout)."""
    old = param(func, name)
    if not isinstance(old.type, TensorType) or old.type.scope != GLOBAL:
        raise UnsupportedError(f"kernel '{func.name}': '{name}' is not a global tensor parameter")
    if accesses(func, old) != (0, 0):
        raise UnsupportedError(f"kernel '{func.name}' accesses '{name}' element by element; remap it instead")
    new = E.Var(name, TensorType(old.type.dtype, tuple(i32(d) for d in shape), GLOBAL))
    params = [new if p is old else p for p in func.params]
    return Function(func.name, params, func.body, func.kind, func.launch, list(func.shape_params), func.source_file,
                    func.source_line)  # fmt: skip
