"""Functions and modules: the units that backends compile."""

from __future__ import annotations

from dataclasses import dataclass, field

from tessera.ir import text
from tessera.ir.expr import Expr, Var
from tessera.ir.stmt import Stmt

CPU_KERNEL, CUDA_KERNEL = "cpu_kernel", "cuda_kernel"
TARGETS = {"cpu": CPU_KERNEL, "cuda": CUDA_KERNEL}


@dataclass
class LaunchConfig:
    """How a CUDA kernel is launched; expressions may use the kernel's scalar parameters."""

    grid: tuple[Expr, ...] = ()
    block: tuple[Expr, ...] = ()
    dynamic_smem: Expr | None = None
    # Minimum resident blocks per SM for __launch_bounds__ (0: no launch bounds).
    min_blocks: int = 0
    # Bytes of shared tensors placed in dynamic shared memory (set by plan_shared_memory).
    shared_pool: int = 0
    # Thread-block cluster shape (SM90 __cluster_dims__); () for no clusters.  The grid must
    # be a multiple of it.
    cluster: tuple[int, ...] = ()


@dataclass(eq=False)
class Function:
    """A kernel: parameters, a body and, for CUDA, its launch configuration.

    `params` are in call order.  Tensor parameters whose shapes use names that are not
    explicit parameters get hidden int32 parameters appended (`shape_params`), which the
    runtime fills from the arguments' shapes.
    """

    name: str
    params: list[Var]
    body: Stmt
    kind: str = CPU_KERNEL
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    shape_params: list[Var] = field(default_factory=list)
    source_file: str = "<unknown>"
    source_line: int = 0
    # Integer scalar parameters that size a tensor parameter, so at least 1 at run time (the
    # runtime refuses empty arrays).  Set by flatten_buffers, which drops the tensor shapes;
    # code generation needs no guard for a division by them.
    size_params: frozenset[Var] = frozenset()

    @property
    def all_params(self) -> list[Var]:
        """Parameters as the generated function declares them (hidden shape params last)."""
        return self.params + self.shape_params

    def with_body(self, body: Stmt) -> Function:
        return Function(self.name, self.params, body, self.kind, self.launch, self.shape_params, self.source_file,
                        self.source_line, self.size_params)  # fmt: skip

    def __str__(self) -> str:
        return text.to_str("function", self)


@dataclass
class Module:
    """A compilation unit: kernels for one target."""

    target: str
    functions: list[Function] = field(default_factory=list)

    def __str__(self) -> str:
        return "\n\n".join(str(f) for f in self.functions)
