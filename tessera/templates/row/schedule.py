"""The schedule space of the row kernels (reduce.py, norm.py): `RowSchedule`.

Kept apart from the kernels so that reduce.py, norm.py and the dispatcher
(kinds.py) share it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.errors import UnsupportedError
from tessera.ir import dtypes
from tessera.ir.dtypes import DataType

REDUCTIONS = ("sum", "mean", "max", "min")
VECTOR_BYTES = 16
WARP = 32
FLOAT_TYPES = (dtypes.float16, dtypes.bfloat16, dtypes.float32)


@dataclass(frozen=True)
class RowSchedule:
    """How a row kernel maps the rows of x[R, C] onto threads.

    * `threads`: threads per block (a multiple of 32, at most 1024).
    * `lanes`: threads that share one row.  Either a power of two up to 32 — the block then
      holds threads // lanes rows and a row's partials meet through warp shuffles (the
      schedule for short rows: no shared memory, no barriers) — or equal to `threads`: one
      row per block, partials meet through `block_reduce`.
    * `vec`: elements per load.  1 gives element loads (any C); 16 bytes' worth (8 for
      float16/bfloat16, 4 for float32) gives one 16-byte vector load, which needs x's rows
      16-byte aligned: C % vec == 0 and a 16-byte aligned base pointer.
    * `per_thread`: loads a thread issues before it uses any of them (loads in flight).
      Load k of a thread covers elements [(lane + k * lanes) * vec, ... + vec), so adjacent
      lanes read adjacent chunks and each warp's loads coalesce.
    * `cached`: the row stays in registers (as float32) between its reduction and the write,
      so softmax and the norms read x once.  Such a kernel only handles rows with
      C <= capacity; the caller checks (kinds.py does).  Without it the kernel streams
      over the row in steps of lanes * per_thread loads, for any C, and softmax and the
      norms read the row twice.  Row reductions always stream: they read the row once.
    * `raw` (softmax, with `cached`): the row stays in registers as loaded, in x's dtype,
      rather than as float32 exponentials: half the registers for float16/bfloat16 rows, at
      the cost of evaluating each exponential twice (for the sum, then for the output).
    """

    threads: int = 256
    lanes: int = 256
    vec: int = 1
    per_thread: int = 4
    cached: bool = False
    raw: bool = False

    @property
    def rows_per_block(self) -> int:
        return self.threads // self.lanes

    @property
    def capacity(self) -> int:
        """The longest row (in elements) a cached kernel holds."""
        return self.lanes * self.per_thread * self.vec

    @property
    def block_combine(self) -> bool:
        """True when partials meet through block_reduce (one row per block, several warps)."""
        return self.lanes == self.threads and self.threads > WARP

    @property
    def shuffle_offsets(self) -> tuple[int, ...]:
        """shfl_xor distances that combine a row's lanes within a warp (none for block_reduce)."""
        if self.block_combine:
            return ()
        out, d = [], self.lanes // 2
        while d:
            out.append(d)
            d //= 2
        return tuple(out)

    def problems(self, dtype: DataType) -> list[str]:
        """Why this schedule cannot be built for `dtype` (empty when it can)."""
        out = []
        if dtype not in FLOAT_TYPES:
            out.append(f"row kernels take float16, bfloat16 or float32, not {dtype}")
        if self.threads % WARP or not WARP <= self.threads <= 1024:
            out.append(f"threads={self.threads}: a multiple of 32 between 32 and 1024")
        small = self.lanes <= WARP and self.lanes & (self.lanes - 1) == 0
        if not (small or self.lanes == self.threads):
            out.append(f"lanes={self.lanes}: a power of two up to 32, or equal to threads")
        if self.vec not in (1, VECTOR_BYTES // dtype.nbytes):
            out.append(f"vec={self.vec}: 1 or {VECTOR_BYTES // dtype.nbytes} ({VECTOR_BYTES} bytes of {dtype})")
        if not 1 <= self.per_thread <= 32:
            out.append(f"per_thread={self.per_thread}: between 1 and 32")
        if self.raw and not self.cached:
            out.append("raw=True caches the row as loaded: it needs cached=True")
        return out

    def __str__(self) -> str:
        return f"t{self.threads}_l{self.lanes}_v{self.vec}_p{self.per_thread}{'_c' if self.cached else ''}{'r' if self.raw else ''}"


# The schedule of the original kernels: one block of 256 threads per row, element loads.
SCALAR_BLOCK = RowSchedule()


def check_schedule(dtype: DataType, schedule: RowSchedule) -> None:
    problems = schedule.problems(dtype)
    if problems:
        raise UnsupportedError(f"row schedule {schedule} for {dtype}: {'; '.join(problems)}")
