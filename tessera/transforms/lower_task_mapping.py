"""Lower `for ... in mapping.on(worker)` into loops and index arithmetic.

For a composition of atoms a_0 * a_1 * ... (outermost first), worker w runs atom k's worker
(w // W_k) % workers(a_k), where W_k is the number of workers of the atoms inside a_k.
A task's coordinate in dimension d is sum_k coord_k[d] * S_k[d] with S_k[d] the product of
the inner atoms' extents.  Spatial atoms contribute index arithmetic computed once per
worker; repeat atoms contribute loops, in atom order, so the iteration order matches
TaskMapping.worker_tasks exactly.
"""

from __future__ import annotations

from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.func import Function
from tessera.ir.functor import IRMutator, IRVisitor
from tessera.ir.mapping import MappingAtom

# Repeat loops with at most this many tasks per worker are unrolled (register-array indices
# then become constants on the GPU).
UNROLL_LIMIT = 64


def _const(v: int) -> E.Const:
    return E.Const(v, dtypes.int32)


def _unravel(index: E.Expr, atom: MappingAtom, outermost_known: bool) -> list[E.Expr]:
    """Coordinates of `index` in atom.shape, honouring the atom's dimension order."""
    coords: list[E.Expr] = [_const(0)] * len(atom.shape)
    order = atom.dims_outer_to_inner()
    inner = 1
    for pos in range(len(order) - 1, -1, -1):
        d = order[pos]
        c = index if inner == 1 else E.Binary("//", index, _const(inner))
        if not (pos == 0 and outermost_known):
            c = E.Binary("%", c, _const(atom.shape[d]))
        coords[d] = c
        inner *= atom.shape[d]
    return coords


class LowerTaskMapping(IRMutator):
    def visit_ForMapping(self, s: S.ForMapping) -> S.Stmt:
        body = self.visit(s.body)
        m = s.mapping
        strides, wstrides = m.strides(), m.worker_strides()
        terms: list[list[E.Expr]] = [[] for _ in range(m.rank)]
        prologue: list[S.Stmt] = []
        loops: list[tuple[E.Var, int]] = []
        base = s.vars[0].name
        for k, atom in enumerate(m.atoms):
            if atom.kind == "spatial":
                w = s.worker if wstrides[k] == 1 else E.Binary("//", s.worker, _const(wstrides[k]))
                # The outermost atom's worker index needs no modulo: workers are < num_workers.
                coords = _unravel(w, atom, outermost_known=(k == 0 or atom.num_workers == 1))
            else:
                coords = [_const(0)] * m.rank
                for d in atom.dims_outer_to_inner():
                    if atom.shape[d] == 1:
                        continue
                    v = E.Var(f"{base}_r{k}_{d}", dtypes.int32)
                    loops.append((v, atom.shape[d]))
                    coords[d] = v
            for d in range(m.rank):
                if atom.shape[d] > 1:
                    term = coords[d] if strides[k][d] == 1 else E.Binary("*", coords[d], _const(strides[k][d]))
                    terms[d].append(term)
        # Spatial parts are hoisted out of the repeat loops.
        spatial_vars: list[list[E.Expr]] = [[] for _ in range(m.rank)]
        for d in range(m.rank):
            fixed = [t for t in terms[d] if not _uses_any(t, [v for v, _ in loops])]
            moving = [t for t in terms[d] if t not in fixed]
            if fixed and loops:
                sv = E.Var(f"{s.vars[d].name}_base", dtypes.int32)
                prologue.append(S.DeclareVar(sv, _sum(fixed)))
                spatial_vars[d] = [sv] + moving
            else:
                spatial_vars[d] = fixed + moving
        decls = [S.DeclareVar(v, _sum(spatial_vars[d])) for d, v in enumerate(s.vars)]
        if s.task_var is not None:  # row-major position among this worker's tasks
            t: E.Expr = _const(0)
            for v, extent in loops:
                t = E.Binary("+", E.Binary("*", t, _const(extent)), v)
            decls.append(S.DeclareVar(s.task_var, t))
        inner: S.Stmt = S.seq(*decls, body)
        kind = S.UNROLL if m.tasks_per_worker <= UNROLL_LIMIT else S.SERIAL
        for v, extent in reversed(loops):
            inner = S.For(v, _const(0), _const(extent), _const(1), inner, kind)
        out = S.seq(*prologue, inner)
        out.line = s.line
        return out


def _sum(terms: list[E.Expr]) -> E.Expr:
    if not terms:
        return _const(0)
    out = terms[0]
    for t in terms[1:]:
        out = E.Binary("+", out, t)
    return out


def _uses_any(e: E.Expr, vars_: list[E.Var]) -> bool:
    found = False

    class Finder(IRVisitor):
        def visit_Var(self, v: E.Var) -> None:
            nonlocal found
            found = found or any(v is x for x in vars_)

    Finder().visit(e)
    return found


def lower_task_mapping(func: Function) -> Function:
    return LowerTaskMapping().mutate_function(func)
