"""Task mappings (Hidet): how a grid of tasks is assigned to a set of workers.

* ``spatial(4, 8)``: 32 workers, one task each (worker w gets task unravel(w)).
* ``repeat(2, 2)``: one worker that loops over 4 tasks.
* ``f * g``: f places tiles of shape g.task_shape, g places tasks inside each tile.
  Worker w runs g's worker ``w % g.num_workers`` inside f's worker ``w // g.num_workers``.

Inside a kernel, ``for i, j in m.on(thread_idx.x):`` iterates the tasks of one worker.
The pass transforms.lower_task_mapping turns that into loops and index arithmetic; the
methods here give the same semantics in plain Python (used by tests and tools).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import Any


@dataclass(frozen=True)
class MappingAtom:
    """One spatial or repeat mapping: shape and dimension order (ranks)."""

    kind: str  # "spatial" or "repeat"
    shape: tuple[int, ...]
    # ranks[d] is the position of dimension d in row-major order; (0, 1, ..) is row-major.
    ranks: tuple[int, ...]

    @property
    def num_workers(self) -> int:
        return prod(self.shape) if self.kind == "spatial" else 1

    @property
    def num_tasks(self) -> int:
        return 1 if self.kind == "spatial" else prod(self.shape)

    def dims_outer_to_inner(self) -> list[int]:
        """Dimensions ordered from slowest- to fastest-varying."""
        return sorted(range(len(self.shape)), key=lambda d: self.ranks[d])

    def unravel(self, index: int) -> tuple[int, ...]:
        coords = [0] * len(self.shape)
        for d in reversed(self.dims_outer_to_inner()):
            coords[d] = index % self.shape[d]
            index //= self.shape[d]
        return tuple(coords)

    def tasks(self, worker: int) -> list[tuple[int, ...]]:
        if self.kind == "spatial":
            return [self.unravel(worker)]
        return [self.unravel(i) for i in range(self.num_tasks)]


class TaskMapping:
    """A composition of spatial and repeat atoms, outermost first."""

    def __init__(self, atoms: Sequence[MappingAtom]):
        if not atoms:
            raise ValueError("a task mapping needs at least one atom")
        ranks = {len(a.shape) for a in atoms}
        if len(ranks) != 1:
            raise ValueError(f"cannot compose task mappings of different ranks: {[a.shape for a in atoms]}")
        self.atoms: tuple[MappingAtom, ...] = tuple(atoms)

    @property
    def rank(self) -> int:
        return len(self.atoms[0].shape)

    @property
    def task_shape(self) -> tuple[int, ...]:
        return tuple(prod(a.shape[d] for a in self.atoms) for d in range(self.rank))

    @property
    def num_workers(self) -> int:
        return prod(a.num_workers for a in self.atoms)

    @property
    def tasks_per_worker(self) -> int:
        return prod(a.num_tasks for a in self.atoms)

    def __mul__(self, other: TaskMapping) -> TaskMapping:
        if not isinstance(other, TaskMapping):
            return NotImplemented
        if other.rank != self.rank:
            raise ValueError(f"cannot compose a rank-{self.rank} mapping with a rank-{other.rank} mapping")
        return TaskMapping(self.atoms + other.atoms)

    def strides(self) -> list[tuple[int, ...]]:
        """For each atom, the per-dimension scale of its coordinates in the task grid."""
        out = []
        for k in range(len(self.atoms)):
            inner = self.atoms[k + 1 :]
            out.append(tuple(prod(a.shape[d] for a in inner) for d in range(self.rank)))
        return out

    def worker_strides(self) -> list[int]:
        """For each atom, how many workers the atoms inside it account for."""
        return [prod(a.num_workers for a in self.atoms[k + 1 :]) for k in range(len(self.atoms))]

    def worker_tasks(self, worker: int) -> list[tuple[int, ...]]:
        """The tasks of one worker, in iteration order (reference semantics)."""
        if not 0 <= worker < self.num_workers:
            raise IndexError(f"worker {worker} out of range for a mapping with {self.num_workers} workers")
        per_atom = []
        for atom, wstride in zip(self.atoms, self.worker_strides()):
            per_atom.append(atom.tasks((worker // wstride) % atom.num_workers))
        strides = self.strides()
        out = []
        for combo in itertools.product(*per_atom):
            out.append(tuple(sum(c[d] * s[d] for c, s in zip(combo, strides)) for d in range(self.rank)))
        return out

    def on(self, worker: Any) -> Any:
        """The tasks of `worker`.  With an int, a list; inside a kernel, a loop header."""
        if isinstance(worker, int):
            return self.worker_tasks(worker)
        raise TypeError("TaskMapping.on(expr) is only meaningful inside a tessera kernel's `for` loop")

    def __iter__(self):
        for w in range(self.num_workers):
            yield from self.worker_tasks(w)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TaskMapping) and self.atoms == other.atoms

    def __hash__(self) -> int:
        return hash(self.atoms)

    def __repr__(self) -> str:
        parts = []
        for a in self.atoms:
            r = "" if a.ranks == tuple(range(len(a.shape))) else f", ranks={list(a.ranks)}"
            parts.append(f"{a.kind}({', '.join(map(str, a.shape))}{r})")
        return " * ".join(parts)


def _atom(kind: str, shape: tuple[int, ...], ranks: Sequence[int] | None) -> TaskMapping:
    if not shape:
        raise ValueError(f"{kind}() needs at least one dimension")
    for s in shape:
        if not isinstance(s, int) or isinstance(s, bool) or s <= 0:
            raise ValueError(f"{kind}() dimensions must be positive ints, got {shape}")
    r = tuple(range(len(shape))) if ranks is None else tuple(ranks)
    if sorted(r) != list(range(len(shape))):
        raise ValueError(f"ranks must be a permutation of 0..{len(shape) - 1}, got {list(r)}")
    return TaskMapping([MappingAtom(kind, tuple(shape), r)])


def spatial(*shape: int, ranks: Sequence[int] | None = None) -> TaskMapping:
    """prod(shape) workers, one task each; worker w gets the task at row-major position w."""
    return _atom("spatial", shape, ranks)


def repeat(*shape: int, ranks: Sequence[int] | None = None) -> TaskMapping:
    """One worker that iterates all prod(shape) tasks in row-major order."""
    return _atom("repeat", shape, ranks)
