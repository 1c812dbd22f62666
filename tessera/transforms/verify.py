"""Check that a function is well formed: every variable is defined before use, in scope,
and statements fit the target.  Run after the front end and after every pass in tests."""

from __future__ import annotations

from tessera.errors import TesseraError
from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.func import CPU_KERNEL, Function
from tessera.ir.functor import IRVisitor
from tessera.ir.instructions import INSTRUCTIONS


class VerifyError(TesseraError):
    """The IR is malformed: a bug in a pass or in the front end."""


class Verifier(IRVisitor):
    def __init__(self, func: Function):
        self.func = func
        self.scopes: list[set[E.Var]] = [set(func.all_params)]
        self.loops = 0

    def fail(self, msg: str) -> None:
        raise VerifyError(f"malformed IR in '{self.func.name}': {msg}")

    def defined(self, v: E.Var) -> bool:
        return any(v in s for s in self.scopes)

    def visit_Var(self, e: E.Var) -> None:
        if not self.defined(e):
            self.fail(f"variable '{e.name}' is used outside the scope that defines it")

    def visit_HardwareIndex(self, e: E.HardwareIndex) -> None:
        if self.func.kind == CPU_KERNEL:
            self.fail(f"{e.name} used in a CPU kernel")

    def scoped(self, body: S.Stmt, *vars_: E.Var) -> None:
        self.scopes.append(set(vars_))
        self.visit(body)
        self.scopes.pop()

    def visit_DeclareVar(self, s: S.DeclareVar) -> None:
        if s.init is not None:
            self.visit(s.init)
        self.scopes[-1].add(s.var)

    def visit_Assign(self, s: S.Assign) -> None:
        self.visit_Var(s.var)
        self.visit(s.value)

    def visit_DeclareBuffer(self, s: S.DeclareBuffer) -> None:
        self.scopes[-1].add(s.var)

    def visit_For(self, s: S.For) -> None:
        for e in (s.start, s.stop, s.step):
            self.visit(e)
        self.loops += 1
        self.scoped(s.body, s.var)
        self.loops -= 1

    def visit_ForMapping(self, s: S.ForMapping) -> None:
        self.visit(s.worker)
        self.loops += 1
        self.scoped(s.body, *s.vars, *([s.task_var] if s.task_var is not None else []))
        self.loops -= 1

    def visit_While(self, s: S.While) -> None:
        self.visit(s.cond)
        self.loops += 1
        self.scoped(s.body)
        self.loops -= 1

    def visit_If(self, s: S.If) -> None:
        self.visit(s.cond)
        self.scoped(s.then_body)
        if s.else_body is not None:
            self.scoped(s.else_body)

    def visit_Break(self, s: S.Break) -> None:
        if not self.loops:
            self.fail("break outside a loop")

    def visit_Continue(self, s: S.Continue) -> None:
        if not self.loops:
            self.fail("continue outside a loop")

    def visit_Instruction(self, s: S.Instruction) -> None:
        if self.func.kind == CPU_KERNEL and INSTRUCTIONS[s.name].gpu_only:
            self.fail(f"GPU instruction {s.name} in a CPU kernel")
        for x in s.operands:
            self.visit(x)

    def visit_Barrier(self, s: S.Barrier) -> None:
        if self.func.kind == CPU_KERNEL:
            self.fail("barrier in a CPU kernel")


def verify(func: Function) -> Function:
    """Raise VerifyError if `func` is malformed; return it unchanged otherwise."""
    Verifier(func).visit(func.body)
    return func
