"""A readable, Python-like text form of the IR."""

from __future__ import annotations

from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir import text
from tessera.ir.func import Function
from tessera.ir.functor import IRVisitor

_PRECEDENCE = {
    "||": 1, "&&": 2, "|": 3, "^": 4, "&": 5, "==": 6, "!=": 6,
    "<": 7, "<=": 7, ">": 7, ">=": 7, "<<": 8, ">>": 8,
    "+": 9, "-": 9, "*": 10, "/": 10, "//": 10, "%": 10,
}  # fmt: skip


class IRPrinter(IRVisitor):
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.depth = 0

    # ---- expressions: return strings ----------------------------------------------
    def expr(self, e: E.Expr, parent_prec: int = 0) -> str:
        if isinstance(e, E.Binary):
            p = _PRECEDENCE[e.op]
            text = f"{self.expr(e.a, p)} {e.op} {self.expr(e.b, p + 1)}"
            return f"({text})" if p < parent_prec else text
        return self.visit(e)

    def visit_Var(self, e: E.Var) -> str:
        return e.name

    def visit_Const(self, e: E.Const) -> str:
        if e.type.is_bool:
            return "true" if e.value else "false"
        if e.type.is_float:
            return repr(float(e.value)) + ("" if e.type.name == "float32" else f"{e.type.short}")
        return str(e.value) + ("" if e.type.name == "int32" else e.type.short)

    def visit_HardwareIndex(self, e: E.HardwareIndex) -> str:
        return e.name

    def visit_Unary(self, e: E.Unary) -> str:
        return f"{e.op}{self.expr(e.a, 11)}"

    def visit_Cast(self, e: E.Cast) -> str:
        return f"cast({self.expr(e.value)}, {e.type})"

    def visit_Select(self, e: E.Select) -> str:
        return f"select({self.expr(e.cond)}, {self.expr(e.a)}, {self.expr(e.b)})"

    def visit_Call(self, e: E.Call) -> str:
        return f"{e.func}({', '.join(self.expr(a) for a in e.args)})"

    def visit_Load(self, e: E.Load) -> str:
        return f"{e.buffer.name}[{', '.join(self.expr(i) for i in e.indices)}]"

    def visit_Address(self, e: E.Address) -> str:
        return f"&{self.visit_Load(e)}"

    # ---- statements: append lines ---------------------------------------------------
    def emit(self, text: str) -> None:
        self.lines.append("    " * self.depth + text)

    def block(self, body: S.Stmt) -> None:
        self.depth += 1
        self.visit(body)
        self.depth -= 1

    def visit_Evaluate(self, s: S.Evaluate) -> None:
        self.emit(self.expr(s.expr))

    def visit_DeclareVar(self, s: S.DeclareVar) -> None:
        init = "" if s.init is None else f" = {self.expr(s.init)}"
        self.emit(f"{s.var.name}: {s.var.type}{init}")

    def visit_Assign(self, s: S.Assign) -> None:
        self.emit(f"{s.var.name} = {self.expr(s.value)}")

    def visit_Store(self, s: S.Store) -> None:
        self.emit(f"{s.buffer.name}[{', '.join(self.expr(i) for i in s.indices)}] = {self.expr(s.value)}")

    def visit_DeclareBuffer(self, s: S.DeclareBuffer) -> None:
        t = s.var.type
        self.emit(f"{s.var.name} = {t.scope}_tensor({t.dtype}, [{', '.join(self.expr(d) for d in t.shape)}])")

    def visit_For(self, s: S.For) -> None:
        kind = "" if s.kind == S.SERIAL else f"  # {s.kind}"
        self.emit(f"for {s.var.name} in range({self.expr(s.start)}, {self.expr(s.stop)}, {self.expr(s.step)}):{kind}")
        self.block(s.body)

    def visit_ForMapping(self, s: S.ForMapping) -> None:
        names = ", ".join(v.name for v in s.vars)
        if s.task_var is not None:
            self.emit(f"for {s.task_var.name}, ({names}) in enumerate(({s.mapping}).on({self.expr(s.worker)})):")
        else:
            self.emit(f"for {names} in ({s.mapping}).on({self.expr(s.worker)}):")
        self.block(s.body)

    def visit_If(self, s: S.If) -> None:
        self.emit(f"if {self.expr(s.cond)}:")
        self.block(s.then_body)
        if s.else_body is not None:
            self.emit("else:")
            self.block(s.else_body)

    def visit_While(self, s: S.While) -> None:
        self.emit(f"while {self.expr(s.cond)}:")
        self.block(s.body)

    def visit_Break(self, s: S.Break) -> None:
        self.emit("break")

    def visit_Continue(self, s: S.Continue) -> None:
        self.emit("continue")

    def visit_Return(self, s: S.Return) -> None:
        self.emit("return")

    def visit_Instruction(self, s: S.Instruction) -> None:
        args = [self.expr(x) for x in s.operands] + [f"{k}={v!r}" for k, v in s.attrs.items()]
        self.emit(f"{s.name}({', '.join(args)})")

    def visit_Barrier(self, s: S.Barrier) -> None:
        self.emit("syncthreads()")

    def visit_Seq(self, s: S.Seq) -> None:
        if not s.stmts:
            self.emit("pass")
        for x in s.stmts:
            self.visit(x)

    def function(self, f: Function) -> str:
        params = ", ".join(f"{p.name}: {p.type}" for p in f.params)
        hidden = "".join(f", {p.name}: {p.type}" for p in f.shape_params)
        self.emit(f"def {f.name}({params}{hidden}):  # {f.kind}")
        self.depth += 1
        if f.launch.grid:
            self.emit(f"# grid=({', '.join(map(self.expr, f.launch.grid))}) block=({', '.join(map(self.expr, f.launch.block))})")
        self.visit(f.body)
        self.depth -= 1
        return "\n".join(self.lines)


def expr_to_str(e: E.Expr) -> str:
    return IRPrinter().expr(e)


def stmt_to_str(s: S.Stmt) -> str:
    p = IRPrinter()
    p.visit(s)
    return "\n".join(p.lines)


def function_to_str(f: Function) -> str:
    return IRPrinter().function(f)


text.register("expr", expr_to_str)
text.register("stmt", stmt_to_str)
text.register("function", function_to_str)
