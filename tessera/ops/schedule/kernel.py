"""From compute DAG to kernel functions: inline, partition, schedule each kernel for a target."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tessera.ir import expr as E
from tessera.ir.compute import TensorNode, topological_order
from tessera.ir.func import CPU_KERNEL, CUDA_KERNEL, Function, LaunchConfig
from tessera.ops.schedule.buffers import Buffers, base_name, reads_to_loads, scalar_params
from tessera.ops.schedule.cpu import lower_cpu
from tessera.ops.schedule.cuda import lower_cuda
from tessera.ops.schedule.inline import inline_stages
from tessera.ops.schedule.partition import KernelPlan, partition
from tessera.ops.schedule.program import init_plan, is_program_body, lower_program


@dataclass(eq=False)
class KernelSpec:
    """One scheduled kernel: its IR function and how to call it.

    The function's parameters are `tensors` (in order: the tensors it reads, then the ones
    it writes) followed by the scalar parameters `scalars`, each paired with the expression
    over the shape symbols that gives its value.
    """

    name: str
    plan: KernelPlan
    func: Function
    tensors: list[TensorNode]
    scalars: list[tuple[E.Var, E.Expr]]
    schedule: str

    @property
    def writes(self) -> list[TensorNode]:
        return list(self.plan.stores)


def schedule_plan(plan: KernelPlan, target: str, name: str) -> KernelSpec:
    """Build the (unlowered) IR function of one kernel."""
    buffers = Buffers()
    for t in plan.stores:  # outputs first, so they keep their names
        buffers.var(t)
    if target not in ("cpu", "cuda"):
        raise ValueError(f"unknown target {target!r}; use 'cpu' or 'cuda'")
    if is_program_body(plan):
        body, launch, sched = lower_program(plan, buffers, target)
        kind = CPU_KERNEL if target == "cpu" else CUDA_KERNEL
    elif target == "cpu":
        body, launch, kind, sched = lower_cpu(plan, buffers), LaunchConfig(), CPU_KERNEL, "cpu"
    elif target == "cuda":
        body, launch, cuda_sched = lower_cuda(plan, buffers)
        kind, sched = CUDA_KERNEL, f"cuda-{cuda_sched.kind}{cuda_sched.threads}"
    else:
        raise ValueError(f"unknown target {target!r}; use 'cpu' or 'cuda'")
    body = reads_to_loads(body, buffers)
    scalars = scalar_params(body, buffers, [*launch.grid, *launch.block])
    written = [t for t in plan.stores]
    read = [t for t in buffers.params if t not in written]
    tensors = read + written
    params = [buffers.params[t] for t in tensors] + [v for v, _ in scalars]
    func = Function(name, params, body, kind, launch)
    return KernelSpec(name, plan, func, tensors, scalars, sched)


def schedule(outputs: Sequence[TensorNode], target: str, name: str = "op") -> list[KernelSpec]:
    """The kernels that compute `outputs`, in execution order (fusion by inlining and epilogues)."""
    outputs = list(outputs)
    order = topological_order(outputs)
    stages, values = inline_stages(order, outputs)
    plans = partition(stages, values, outputs)
    specs = []
    for k, p in enumerate(plans):
        kernel_name = f"{name}_{k}_{base_name(p.anchor.name)}"
        first = init_plan(p) if is_program_body(p) else None
        if first is not None:  # a program's initial values: an elementwise kernel before its tasks
            specs.append(schedule_plan(first, target, kernel_name + "_init"))
        specs.append(schedule_plan(p, target, kernel_name))
    return specs
