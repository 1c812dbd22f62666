"""The register-A low-bit prefill kernel's configurations (tessera.templates.lowbit.gemm_rs):
`RegisterAConfig` (tile, pipeline, epilogue, word path, cluster, stream-K), the sets that
tuning and the benchmarks try, and `problems`, why a config cannot serve some weights.  Apart
from the kernel's body, which is long enough on its own."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tessera.ir import lowbit
from tessera.ir.dtypes import DataType
from tessera.ir.instructions import DEQUANT_TYPES
from tessera.target import SM90, Architecture, Target
from tessera.templates.gemm.tma import BLOCK_K, GROUP_M
from tessera.transforms.plan_shared_memory import pool_layout

SPAN = lowbit.FRAGMENT_SPAN  # the words' k order this kernel reads
ROWS = 128  # weight rows per tile: two consumer warpgroups of 64, a 16-row unit per warp
CHUNK = 64  # tokens per epilogue pass through shared memory
STAGING = (8, CHUNK, 24)  # the epilogue's shared tile: per consumer warp, a chunk's tokens x its 16 rows (+8)
WORD_SLOTS = 2  # words="tma": 256-k blocks of a tile's weight words in shared memory (the next one and the one after)


@dataclass(frozen=True)
class RegisterAConfig:
    """Tokens per tile (wgmma's n), the ring's depth, the rasterisation's group of m tiles and
    the wgmmas each consumer leaves in flight while it dequantises the next step (1 or 3: two
    or four register buffers of A fragments)."""

    block_t: int = 256
    stages: int = 4
    group_m: int = GROUP_M
    in_flight: int = 1
    # how the accumulators leave: through a per-warp shared chunk by "stmatrix" or "scalar" stores
    # and then global stores, or "tma": each warp's whole 16-row slab by stmatrix into shared
    # memory, then one TMA store that drains while the next tile's wgmmas run (the synchronous
    # stores cost ~2.5 us a tile on the H200, all blocks writing at once: bench/results/...-tma-epilogue.md)
    epilogue: str = "stmatrix"
    words: str = "global"  # how the weight words reach the consumers: "global" loads or a "tma" ring in shared memory
    cluster: int = 1  # 2: pairs of blocks on adjacent weight tiles share each X stage, each loading half of it for both
    # the last, partial round's tiles shared out among all blocks by 256-k blocks (the H200 takes
    # as long for 1456 tiles as for 1584: 12 rounds of 132), and with fewer tiles than SMs (short
    # prompts) every tile (`grid`).  The shares add their sums into a zeroed float32 tile at the
    # L2 (reduce_add) and take a ticket; the share that completes the tile writes C.  The earlier
    # form, where a tile's first share waited for the others' sums and added them one after
    # another (~1.7 us each at 512 tokens), gained only where K was long
    # (bench/results/2026-11-28-h200-lowbit-model-prefill-register.md, ...-streamk.md)
    stream_k: bool = False

    def smem_bytes(self, bits: int = 8) -> int:
        """The kernel's shared pool as tessera.transforms.plan_shared_memory lays it out (X's stages swizzled)."""
        words = WORD_SLOTS * ROWS * 32 * bits if self.words == "tma" else 16  # ROWS / 16 units x bits x 512 bytes a slot
        staging = 8 * self.block_t * 16 * 2 if self.epilogue == "tma" else STAGING[0] * STAGING[1] * STAGING[2] * 2
        sizes = (self.stages * self.block_t * BLOCK_K * 2, 8 * self.stages, 8 * self.stages, staging, words,
                 8 * WORD_SLOTS, 8 * WORD_SLOTS, 32 if self.stream_k else 4)  # (declaration order)  # fmt: skip
        return pool_layout([(size, i == 0) for i, size in enumerate(sizes)])[1]

    def problems(self, target: Target | Architecture = SM90) -> list[str]:
        out = []
        if self.block_t not in (64, 128, 192, 256):
            out.append(f"block_t must be 64, 128, 192 or 256 tokens, got {self.block_t}")
        if self.stages < 2:
            out.append("a pipeline needs at least 2 stages")
        if self.cluster not in (1, 2):
            out.append(f"cluster must be 1 or 2 blocks, got {self.cluster}")
        if self.words not in ("global", "tma"):
            out.append(f"words must be 'global' or 'tma', got {self.words!r}")
        if self.epilogue not in ("stmatrix", "scalar", "tma"):
            out.append(f"epilogue must be 'stmatrix', 'scalar' or 'tma', got {self.epilogue!r}")
        if self.stream_k and self.cluster > 1:
            out.append("stream_k shares tiles between single blocks, not clusters")
        if self.in_flight not in (1, 3):
            out.append(f"in_flight must be 1 or 3 wgmmas (2 or 4 fragment buffers, a stage's 4 steps), got {self.in_flight}")
        if self.smem_bytes(1) > target.smem_per_block:
            out.append(f"{self.smem_bytes(1)} bytes of shared memory ({target.smem_per_block // 1024} KiB max)")
        return out

    def tiles(self, m: int, n: int) -> int:
        """Work items of the persistent schedule: tiles, or with a cluster the tile groups its
        blocks take together (one per block, the last group's partly past N)."""
        return -(-m // self.block_t) * -(-n // (ROWS * self.cluster))

    def grid(self, m: int, n: int, sms: int, k: int | None = None) -> int:
        """Thread blocks to launch: persistent, one per SM, at most one per tile (whole clusters);
        with stream_k, k given and fewer tiles than SMs (short prompts: one partial round), one
        per SM up to one per 256-k block, every tile's k shared out among them (`whole_tiles` 0)."""
        tiles, k_units = self.tiles(m, n), -(-(k or 0) // 256)
        if self.stream_k and tiles < sms and k_units > 1:
            return min(sms, tiles * k_units)
        return min(tiles, sms // self.cluster) * self.cluster

    def whole_tiles(self, m: int, n: int, k: int, sms: int) -> int:
        """Tiles the persistent schedule gives out whole (the kernel's `whole`): all of them, or
        with stream_k the full rounds only, when a partial round is left and its 256-k blocks
        give every block at least one (the rest are shared out by 256-k blocks: the H200 took as
        long for 1456 tiles as for 1584, 12 rounds of 132 blocks, bench/results/...-streamk.md)."""
        tiles, blocks = self.tiles(m, n), self.grid(m, n, sms, k)
        if blocks > tiles:  # short prompts: every tile cut (see grid)
            return 0
        whole = tiles // blocks * blocks
        if not self.stream_k or whole in (0, tiles) or (tiles - whole) * -(-k // 256) < blocks:
            return tiles
        return whole

    def cut_tiles(self, m: int, n: int, k: int, sms: int) -> int:
        """Tiles whose k the schedule shares between blocks (0 without stream_k, or where every
        tile is given out whole): what `workspace` is sized for."""
        return self.tiles(m, n) - self.whole_tiles(m, n, k, sms)

    def for_output(self, n: int) -> RegisterAConfig:
        """The config a launch with N = n runs: the TMA epilogue writes rows of out that start
        16-byte aligned, so with N % 8 != 0 the stmatrix one takes its place (the launch logs it;
        a caller that builds kernels ahead, as tuning does, builds this one)."""
        return dataclasses.replace(self, epilogue="stmatrix") if self.epilogue == "tma" and n % 8 else self

    def workspace(self, cut_tiles: int) -> tuple[int, int]:
        """float32 sums and uint32 tickets stream_k needs for `cut_tiles` tiles shared between
        blocks: a tile's sums, a ticket per consumer warp.  Both are zero at rest: the share
        that completes a tile zeroes them again."""
        return cut_tiles * 8 * 16 * self.block_t, cut_tiles * 8

    def __str__(self) -> str:
        flags = (f"_g{self.group_m}" if self.group_m != GROUP_M else "", f"_f{self.in_flight}" if self.in_flight != 1 else "",
                 {"stmatrix": "", "scalar": "_scalar", "tma": "_et"}[self.epilogue], "_wt" if self.words == "tma" else "",
                 f"_c{self.cluster}" if self.cluster > 1 else "", "_sk" if self.stream_k else "")  # fmt: skip
        return f"rs_{self.block_t}x{ROWS}_s{self.stages}" + "".join(flags)


# The first is the default.  in_flight 3: on the H200 the kernel slowed with the weights' bits
# (int1 536 us, int7 620 us at M=4096; cuBLAS 535), as if each step's dequantisation, begun only
# once the step before last had finished, sometimes left the tensor cores waiting; it won
# 3-5% for int7/int8/e4m3/uint4 and tied elsewhere (bench/results/*-lowbit-rs-153b8a6.jsonl).
# Tried and dropped there: the second consumer warpgroup trailing the first by 2 stages so
# that their epilogues overlap the other's wgmmas (no change).  The TMA epilogue's 64 KiB slab
# leaves room for 3 stages beside the word ring (4 with the global words): the H200 ran it 4%
# faster all the same (int4 571 / 569 us where the stmatrix epilogue took 596 / 590 at 4 stages,
# bench/results/2026-11-28-h200-lowbit-tma-epilogue.md).  The 128-token config serves small M.
CONFIGS = (RegisterAConfig(256, 4, epilogue="tma"), RegisterAConfig(128, 6), RegisterAConfig(256, 4, in_flight=3, epilogue="tma"),
           RegisterAConfig(256, 3, words="tma", epilogue="tma"),
           RegisterAConfig(256, 3, in_flight=3, words="tma", epilogue="tma"),
           # with the barriers packed (plan_shared_memory.pool_layout): a fifth stage with global
           # words, a fourth beside the word ring up to 4 bits (and the ring at all for int8, above);
           # on the H200 int8 s3_et_wt 575 us against s4_et 582, int4 s4_et_wt 555 against s5_et 557
           # and s4_et 562 (bench/results/2026-11-28-h200-lowbit-rs-32a63e3.md)
           RegisterAConfig(256, 5, epilogue="tma"), RegisterAConfig(256, 4, words="tma", epilogue="tma"))  # fmt: skip
# Correct on the H200 and, since the remote arrivals release at CTA scope (at cluster scope they
# compiled to MEMBAR.ALL.GPU, which waited for the consumers' prefetch loads: 1.7x slower), level
# with the same configs without a cluster (2026-11-28, bench/results/...-lowbit-rs-streamk.md):
# X's multicast saves nothing measurable, so they are not tuning candidates; bench/lowbit_rs.py times them.
CLUSTER_CONFIGS = (RegisterAConfig(256, 4, words="tma", cluster=2), RegisterAConfig(256, 5, in_flight=3, cluster=2))
# The default, a word-ring config and the 128-token one with stream_k (see the field): tuning
# candidates where every tile is cut (tessera.templates.lowbit.tune.stream_k_candidates), where they won up
# to 2x at 128 tokens; bench/lowbit_tail.py and bench/lowbit_rs_shapes.py time them.
STREAM_K_CONFIGS = (RegisterAConfig(256, 4, epilogue="tma", stream_k=True),
                    RegisterAConfig(256, 3, words="tma", epilogue="tma", stream_k=True), RegisterAConfig(128, 6, stream_k=True))  # fmt: skip


def scale_runs(group_size: int) -> tuple[int, int]:
    """(steps per scale run, runs per 256 k): in the fragment order step s covers k [16s, 16s +
    16) in every lane, so a run is the steps of one group."""
    spq = min(16, group_size // 16)
    return spq, 16 // spq


def problems(wtype: DataType, group_size: int, has_bias: bool, config: RegisterAConfig,
             target: Target | Architecture = SM90) -> list[str]:  # fmt: skip
    """Why the kernel cannot be built for these arguments (empty when it can)."""
    out = list(config.problems(target))
    limit = target.smem_per_block
    if config.words == "tma" and config.smem_bytes(wtype.nbits) > limit:
        out.append(f"{config.smem_bytes(wtype.nbits)} bytes of shared memory with {wtype}'s word ring ({limit // 1024} KiB max)")
    if wtype.name not in DEQUANT_TYPES:
        out.append(f"the register-A prefill kernel takes {', '.join(DEQUANT_TYPES)}, not {wtype}")
    if group_size % 16 or not (group_size % 256 == 0 or 256 % group_size == 0):
        out.append(f"group size {group_size}: the register-A kernel takes 16, 32, 64, 128 or multiples of 256")
    elif group_size == 16 and has_bias and config.block_t > 128 and wtype.nbits >= (4 if config.in_flight == 1 else 2):
        # (measured with -Xptxas -v: int4 spills 12 bytes, int6 124; with in_flight 3's two more
        # fragment buffers, uint2 8 and int3 32)
        out.append("groups of 16 with zero points: their 32 scale and zero-point registers spill next to "
                   f"{config.block_t // 2} accumulators; use block_t 128")  # fmt: skip
    return out
