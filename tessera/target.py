"""The CUDA target: the one home of the GPU facts schedules and checks are sized by.

`Architecture` holds what a compute capability fixes (shared memory per block and per SM,
registers, threads and blocks per SM); `ARCHITECTURES` is the one table of them.  `Target` is
one GPU: its name, SM count, L2 size and capability plus its architecture's limits.
`tessera.runtime.cuda.device_properties()` reads the target from the driver;
`PLANNING_TARGET` (an H200) stands in where no GPU is present.  Everything else takes a
target (or an architecture) from its caller; no other module spells a device number.

Imports only the standard library, so every layer may import it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ARCHITECTURES", "PLANNING_TARGET", "SM90", "Architecture", "Target", "architecture"]


@dataclass(frozen=True)
class Architecture:
    """The limits a compute capability fixes (CUDA programming guide, table of technical
    specifications per compute capability)."""

    name: str  # the nvcc target, "sm_90a"
    capability: tuple[int, int]
    smem_per_block: int  # bytes a block may use after raising its dynamic limit (the opt-in maximum)
    smem_per_sm: int  # bytes of shared memory one SM holds for all its resident blocks
    smem_reserved_per_block: int  # the driver's per-block reservation, counted against smem_per_sm
    registers_per_sm: int
    registers_per_thread: int  # the most one thread may be given
    register_granule: int  # registers are allocated per warp in multiples of this
    threads_per_sm: int
    blocks_per_sm: int


SM90 = Architecture("sm_90a", (9, 0), smem_per_block=227 * 1024, smem_per_sm=228 * 1024, smem_reserved_per_block=1024,
                    registers_per_sm=65536, registers_per_thread=255, register_granule=256, threads_per_sm=2048,
                    blocks_per_sm=32)  # fmt: skip

ARCHITECTURES: dict[tuple[int, int], Architecture] = {SM90.capability: SM90}


def architecture(capability: tuple[int, int]) -> Architecture | None:
    """The table's architecture of a compute capability (None for one it does not know)."""
    return ARCHITECTURES.get(tuple(capability))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Target:
    """One GPU as schedules see it: multiprocessors, shared memory per block (the opt-in maximum)
    and per SM, registers and threads per SM, L2 and the compute capability."""

    name: str
    sms: int
    smem_per_block: int  # bytes a block may use after raising its dynamic limit (227 KiB on Hopper)
    l2_bytes: int
    capability: tuple[int, int]
    smem_per_sm: int
    smem_reserved_per_block: int
    registers_per_sm: int
    registers_per_thread: int
    threads_per_sm: int
    blocks_per_sm: int
    from_driver: bool = True  # False: the planning stand-in (no GPU here)

    @classmethod
    def of(cls, arch: Architecture, name: str, sms: int, l2_bytes: int, from_driver: bool = True) -> Target:
        """A GPU of architecture `arch` with `sms` multiprocessors and `l2_bytes` of L2."""
        return cls(name, sms, arch.smem_per_block, l2_bytes, arch.capability, smem_per_sm=arch.smem_per_sm,
                   smem_reserved_per_block=arch.smem_reserved_per_block, registers_per_sm=arch.registers_per_sm,
                   registers_per_thread=arch.registers_per_thread, threads_per_sm=arch.threads_per_sm,
                   blocks_per_sm=arch.blocks_per_sm, from_driver=from_driver)  # fmt: skip


# Planning without a GPU (compile checks, saved plans made on a CPU machine) sizes schedules for
# the project's GPU, an H200 (132 SMs, 60 MiB of L2); any machine with a driver reads its own numbers.
PLANNING_TARGET = Target.of(SM90, "NVIDIA H200 (no GPU here: planning defaults)", sms=132, l2_bytes=60 << 20,
                            from_driver=False)  # fmt: skip
