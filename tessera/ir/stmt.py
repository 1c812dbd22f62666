"""Statement nodes of the IR."""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.ir import text
from tessera.ir.expr import Expr, IRTypeError, Var, check_access
from tessera.ir.instructions import check_instruction
from tessera.ir.mapping import TaskMapping
from tessera.ir.types import REGISTER, SHARED, TensorType

# Loop kinds: how a `For` is executed.  SIMD: serial, but the iterations may run in vector lanes,
# and sum accumulators the body updates (`acc = acc + e`, acc declared outside) may be reassociated.
SERIAL, UNROLL, PARALLEL, SIMD = "serial", "unroll", "parallel", "simd"


class Stmt:
    """Base class of all statements."""

    # Python source line the statement came from (for error messages); 0 when synthetic.
    line: int = 0

    def __str__(self) -> str:
        return text.to_str("stmt", self)


@dataclass(eq=False)
class Evaluate(Stmt):
    """Evaluate an expression for its side effects (e.g. an intrinsic call)."""

    expr: Expr


@dataclass(eq=False)
class DeclareVar(Stmt):
    """Declare a scalar local variable, optionally initialised."""

    var: Var
    init: Expr | None = None


@dataclass(eq=False)
class Assign(Stmt):
    var: Var
    value: Expr


@dataclass(eq=False)
class Store(Stmt):
    """Write one element of a tensor or pointer; the value is converted to its type."""

    buffer: Var
    indices: tuple[Expr, ...]
    value: Expr

    def __post_init__(self) -> None:
        check_access(self.buffer, self.indices)


@dataclass(eq=False)
class DeclareBuffer(Stmt):
    """Declare a register or shared-memory tensor for the rest of the enclosing block."""

    var: Var

    def __post_init__(self) -> None:
        t = self.var.type
        if not isinstance(t, TensorType) or t.scope not in (REGISTER, SHARED):
            raise IRTypeError(f"DeclareBuffer needs a register or shared tensor, got {t}")


@dataclass(eq=False)
class For(Stmt):
    """for var in range(start, stop, step), executed as `kind` (serial/unroll/parallel)."""

    var: Var
    start: Expr
    stop: Expr
    step: Expr
    body: Stmt
    kind: str = SERIAL


@dataclass(eq=False)
class ForMapping(Stmt):
    """for vars in mapping.on(worker): the tasks a task mapping assigns to one worker.

    With `task_var` (from `for t, (i, j) in enumerate(m.on(w))`), t counts the worker's own
    tasks 0, 1, ...: the natural index into a register tensor that holds one value per task.
    Lowered by transforms.lower_task_mapping into ordinary loops and index arithmetic.
    """

    vars: tuple[Var, ...]
    mapping: TaskMapping
    worker: Expr
    body: Stmt
    task_var: Var | None = None


@dataclass(eq=False)
class If(Stmt):
    cond: Expr
    then_body: Stmt
    else_body: Stmt | None = None


@dataclass(eq=False)
class While(Stmt):
    cond: Expr
    body: Stmt


@dataclass(eq=False)
class Break(Stmt):
    pass


@dataclass(eq=False)
class Continue(Stmt):
    pass


@dataclass(eq=False)
class Return(Stmt):
    pass


@dataclass(eq=False)
class Instruction(Stmt):
    """A memory or tensor-core instruction (see tessera.ir.instructions for the list)."""

    name: str
    operands: tuple[Expr, ...]
    attrs: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        error = check_instruction(self.name, self.operands, self.attrs)
        if error:
            raise IRTypeError(error)


@dataclass(eq=False)
class Barrier(Stmt):
    """Synchronise the threads of a block (__syncthreads)."""


@dataclass(eq=False)
class Seq(Stmt):
    stmts: list[Stmt] = field(default_factory=list)


def seq(*stmts: Stmt) -> Stmt:
    """Build a sequence, flattening nested sequences and dropping empty ones."""
    out: list[Stmt] = []
    for s in stmts:
        if isinstance(s, Seq):
            out.extend(s.stmts)
        elif s is not None:
            out.append(s)
    return out[0] if len(out) == 1 else Seq(out)
