"""Kernels of a `Program` (tessera.ir.compute): an elementwise kernel writing its `init`
(when it has one), then its tasks, each a serial run of its statements: an OpenMP-parallel
loop over the tasks on the CPU, one CUDA thread per task (the tasks touch disjoint
elements, so neither needs atomics)."""

from __future__ import annotations

from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.compute import Program, program_parts, substitute_vars
from tessera.ir.func import LaunchConfig
from tessera.ops.schedule.buffers import Buffers
from tessera.ops.schedule.cpu import _parallel
from tessera.ops.schedule.loops import ceil_div, declare_coords, i32, index_var, numel
from tessera.ops.schedule.partition import KernelPlan

TASK_BLOCK = 128


def is_program_body(plan: KernelPlan) -> bool:
    """Whether `plan` runs a Program's tasks (its init kernel is an ordinary elementwise plan)."""
    return isinstance(plan.anchor, Program) and isinstance(plan.values[plan.anchor], S.Stmt)


def init_plan(plan: KernelPlan) -> KernelPlan | None:
    """The elementwise plan writing the program's initial values, or None without init."""
    init, _ = program_parts(plan.values[plan.anchor])
    if init is None:
        return None
    return KernelPlan(plan.anchor, {plan.anchor: init}, stores=[plan.anchor])


def lower_program(plan: KernelPlan, buffers: Buffers, target: str) -> tuple[S.Stmt, LaunchConfig, str]:
    """The body, launch configuration and schedule name of the kernel running the tasks."""
    node = plan.anchor
    assert isinstance(node, Program)
    _, body = program_parts(plan.values[node])
    body = substitute_vars(body, {node.out: buffers.var(node)})  # type: ignore[arg-type]  (statements too)
    extents = list(node.tasks)

    def task(coords: list[E.Expr]) -> S.Stmt:
        return substitute_vars(body, dict(zip(node.task_axes, coords)))  # type: ignore[arg-type]

    if target == "cpu":
        return _parallel(extents, task), LaunchConfig(), "cpu-program"
    total = numel(extents)
    flat = index_var("task")
    coords = [index_var(f"t{k}") for k in range(len(extents))]
    first = E.HardwareIndex("blockIdx.x") * i32(TASK_BLOCK) + E.HardwareIndex("threadIdx.x")
    stmt = S.seq(S.DeclareVar(flat, first),
                 S.If(E.Binary("<", flat, total), S.seq(*declare_coords(coords, flat, extents), task(coords))))  # fmt: skip
    return stmt, LaunchConfig((ceil_div(total, TASK_BLOCK),), (i32(TASK_BLOCK),)), f"cuda-program{TASK_BLOCK}"
