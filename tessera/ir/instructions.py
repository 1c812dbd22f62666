"""Memory and tensor-core instructions: the operands and attributes each one takes.

An `Instruction` statement (tessera.ir.stmt) names one of these.  Operands are IR
expressions: `Address` nodes for memory operands, scalars otherwise.  Attributes are
compile-time Python values (byte counts, matrix counts, shapes).  `check` validates one use
and returns an error message, or None when it is well formed; the front end turns the
message into a KernelSyntaxError at the user's line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tessera.ir import dtypes
from tessera.ir.expr import Address, Const, Expr, Var
from tessera.ir.types import GLOBAL, REGISTER, SHARED, TensorMapType, TensorType, VectorType


@dataclass(frozen=True)
class InstructionSpec:
    name: str
    # One entry per operand: "addr" (an Address), "bool"/"int" (a scalar expression) or
    # "tmap" (a tensor-map parameter); a last entry "int*" takes zero or more integers.
    # The first "addr" operand is the one the instruction writes; any other it writes is in
    # shared memory (tma_load's mbarrier), never a parameter (functor.written_buffers).
    operands: tuple[str, ...]
    attrs: tuple[str, ...]
    gpu_only: bool
    check: Callable[[tuple[Expr, ...], dict[str, Any]], str | None]
    doc: str

    def kinds(self, count: int) -> tuple[str, ...] | None:
        """The kind of each of `count` operands, or None when the count does not fit."""
        if self.operands and self.operands[-1].endswith("*"):
            fixed = self.operands[:-1]
            if count < len(fixed):
                return None
            return fixed + (self.operands[-1][:-1],) * (count - len(fixed))
        return self.operands if count == len(self.operands) else None


def _bytes_of(a: Address) -> int:
    return a.type.dtype.nbytes


def _check_copy(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    dst, src = ops
    n = attrs["bytes"]
    if n not in (2, 4, 8, 16):
        return f"copy_vector moves 2, 4, 8 or 16 bytes, not {n!r}"
    if dst.type.dtype != src.type.dtype:
        return f"copy_vector needs the same element type on both sides, got {dst.type.dtype} and {src.type.dtype}"
    if n % _bytes_of(dst):
        return f"copy_vector of {n} bytes does not hold a whole number of {dst.type.dtype} elements"
    return None


def _check_cp_async(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    dst, src, _pred = ops
    if attrs["bytes"] not in (4, 8, 16):
        return f"copy_async moves 4, 8 or 16 bytes, not {attrs['bytes']!r}"
    if dst.scope != SHARED or src.scope != GLOBAL:
        return f"copy_async copies global memory into shared memory, got {src.scope} -> {dst.scope}"
    if dst.type.dtype != src.type.dtype:
        return f"copy_async needs the same element type on both sides, got {dst.type.dtype} and {src.type.dtype}"
    return None


def _pending_problem(name: str, n: Any) -> str | None:
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= 7:
        return f"{name}(n) needs a compile-time int n in 0..7 (groups left in flight), got {n!r}"
    return None


def _check_wait(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    return _pending_problem("copy_async_wait", attrs["pending"])


def _check_wgmma_wait(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    bad = _pending_problem("wgmma_wait", attrs["pending"])
    if bad:
        return bad
    for a in ops:
        if a.scope != REGISTER or a.type.dtype not in (dtypes.float32, dtypes.int32, dtypes.uint32):
            return ("wgmma_wait fences float32 or 32-bit integer register tensors (the accumulators it waited "
                    "for), each named by an element, acc[0]")  # fmt: skip
    return None


def _check_matrix_move(name: str, store: bool) -> Callable[[tuple[Expr, ...], dict[str, Any]], str | None]:
    """The check of ldmatrix (shared -> registers) or, with `store`, stmatrix (registers -> shared)."""
    verb, want = ("stores", (REGISTER, SHARED)) if store else ("loads", (SHARED, REGISTER))
    what = "a register tensor into shared memory" if store else "shared memory into a register tensor"

    def check(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
        dst, src = ops
        if attrs["num"] not in (1, 2, 4):
            return f"{name} {verb} 1, 2 or 4 matrices, not {attrs['num']!r}"
        if not isinstance(attrs["trans"], bool):
            return f"{name}'s trans= must be True or False"
        if (src.scope, dst.scope) != want:
            return f"{name} {verb} {what}, got {src.scope} -> {dst.scope}"
        if src.type.dtype.nbits != 16 or src.type.dtype != dst.type.dtype:
            return f"{name} moves 16-bit elements (float16/bfloat16), got {src.type.dtype} -> {dst.type.dtype}"
        return None

    return check


MMA_SHAPES = ("m16n8k16",)


def _check_mma(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    c, a, b = ops
    if attrs["shape"] not in MMA_SHAPES:
        return f"mma shape {attrs['shape']!r} is not supported; use one of {MMA_SHAPES}"
    if any(x.scope != REGISTER for x in ops):
        return "mma operands must be register tensors"
    if a.type.dtype not in (dtypes.float16, dtypes.bfloat16) or b.type.dtype != a.type.dtype:
        return f"mma multiplies float16 or bfloat16 fragments of one type, got {a.type.dtype} and {b.type.dtype}"
    if c.type.dtype != dtypes.float32:
        return f"mma accumulates in float32, got a {c.type.dtype} accumulator"
    return None


WGMMA_N = tuple(range(8, 257, 8))


def _check_wgmma(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    d, a, b = ops
    if attrs["n"] not in WGMMA_N:
        return f"wgmma n must be a multiple of 8 in 8..256, got {attrs['n']!r}"
    if not isinstance(attrs["trans_b"], bool):
        return "wgmma's trans_b= must be True or False"
    t = b.buffer.type
    if attrs["trans_b"] and isinstance(t, TensorType) and t.rank > 1:  # (passes flatten it after the check)
        # B [k, n] with n contiguous: the tile is [n / 64, k, 64] (64-column chunks of 128 bytes).
        ok = t.rank >= 3 and t.swizzle is not None
        if not ok or int(getattr(t.shape[-1], "value", 0)) != 64 or int(getattr(t.shape[-2], "value", 0)) % 16:
            return "wgmma with trans_b=True reads B from a shared tensor [..., n / 64, k, 64] (k a multiple of 16) with the 128-byte swizzle"
        if attrs["b_chunk_bytes"] != int(t.shape[-2].value) * 128:
            return f"wgmma's b_chunk_bytes must be the byte stride of B's 64-column chunks ({int(t.shape[-2].value) * 128})"
        if attrs["n"] > 64 and attrs["n"] % 64:
            return "wgmma with trans_b=True and n > 64 needs n a multiple of 64 (whole 64-column chunks)"
    if d.scope != REGISTER or d.type.dtype != dtypes.float32:
        return "wgmma accumulates into a float32 register tensor (n / 2 elements per thread)"
    if a.scope not in (SHARED, REGISTER) or b.scope != SHARED:
        return ("wgmma reads B from shared memory and A from shared memory (K-major tiles with the 128-byte "
                "swizzle) or from registers (a register tensor: 8 elements per thread, the m64k16 A fragment)")
    if a.type.dtype not in (dtypes.float16, dtypes.bfloat16) or b.type.dtype != a.type.dtype:
        return f"wgmma multiplies float16 or bfloat16 tiles of one type, got {a.type.dtype} and {b.type.dtype}"
    return None


DEQUANT_TYPES = ("int1", "int2", "int3", "int4", "int5", "int6", "int7", "int8", "uint1", "uint2", "uint3", "uint4",
                 "uint5", "uint6", "uint7", "uint8", "e2m1", "e2m3", "e3m2", "e4m3", "e5m2")  # fmt: skip


def _check_dequant(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    dst, src, scale, bias = ops
    t, start, count = attrs["wtype"], attrs["start"], attrs["count"]
    if not isinstance(t, dtypes.DataType) or t.name not in DEQUANT_TYPES:
        return f"dequant's wtype= must be one of {', '.join(DEQUANT_TYPES)}, got {t!r}"
    for name, v in (("start", start), ("count", count)):
        if not isinstance(v, int) or isinstance(v, bool) or v % 2:
            return f"dequant's {name}= must be an even compile-time int, got {v!r}"
    if not isinstance(attrs.get("raw", False), bool):
        return f"dequant's raw= must be a compile-time bool, got {attrs['raw']!r}"
    if attrs.get("raw") and (attrs["has_bias"] or attrs["has_scale"]):
        return "a raw dequant takes no scale or bias: its values are code + lowbit.raw_magic, the kernel subtracts"
    if not (0 <= start and 0 < count and start + count <= 128):
        return f"dequant reads values [start, start + count) of a 128-value unit, got start={start}, count={count}"
    if any(x.scope != REGISTER for x in ops):
        return "dequant's operands are register tensors (dst halves, src uint32 words, scale and bias halves)"
    if src.type.dtype != dtypes.uint32:
        return f"dequant reads packed uint32 words, got {src.type.dtype}"
    if dst.type.dtype != dtypes.float16 or scale.type.dtype != dtypes.float16 or bias.type.dtype != dtypes.float16:
        return "dequant writes float16 values and takes float16 scales and biases"
    return None


def _ok(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    return None


def _is_barrier(x: Expr) -> bool:
    return isinstance(x, Address) and x.scope == SHARED and x.type.dtype == dtypes.uint64


_BARRIER = "mbarriers are uint64 elements of a shared tensor, e.g. bars = ts.shared_tensor(u64, [stages]); bars[s]"


def _check_flag(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    flag = ops[0]
    if not isinstance(flag, Address) or flag.scope != GLOBAL or flag.type.dtype not in (dtypes.uint32, dtypes.int32):
        return "a flag is an element of a global uint32 or int32 tensor"
    return None


def _check_reduce_add(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    dst, src = ops
    if attrs["bytes"] not in (4, 8, 16):
        return f"reduce_add adds 4, 8 or 16 bytes (1, 2 or 4 float32), not {attrs['bytes']!r}"
    if not isinstance(dst, Address) or dst.scope != GLOBAL or not isinstance(src, Address) or src.scope != REGISTER:
        return "reduce_add adds registers into global memory: ts.reduce_add(P[i], acc[e], bytes=16)"
    if dst.type.dtype != dtypes.float32 or src.type.dtype != dtypes.float32:
        return f"reduce_add adds float32 to float32, got {src.type.dtype} -> {dst.type.dtype}"
    return None


def _check_ticket(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    counter, _add, old = ops
    problem = _check_flag((counter,), attrs)
    if problem:
        return "a ticket counter is an element of a global uint32 or int32 tensor"
    if not isinstance(old, Address) or old.scope != REGISTER or old.type.dtype != counter.type.dtype:
        return f"ticket writes the counter's old value into a {counter.type.dtype} register element"
    return None


def _check_mbarrier(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    if not _is_barrier(ops[0]):
        return _BARRIER
    return None


def _tma_copy_problem(name: str, dst: Expr, t: TensorMapType, bar: Expr) -> str | None:
    """What is wrong with a TMA load's destination and barrier (None when nothing is)."""
    if dst.scope != SHARED:
        return f"{name} writes shared memory, got a {dst.scope} destination"
    if dst.type.dtype != t.dtype:
        return f"{name}'s destination holds {dst.type.dtype} but the tensor map describes {t.dtype}"
    if not _is_barrier(bar):
        return f"{name} completes on an mbarrier: " + _BARRIER
    return None


def _check_tma_load(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    dst, tmap, bar, *coords = ops
    if not (isinstance(tmap, Var) and isinstance(tmap.type, TensorMapType)):
        return "tma_load's second operand must be a tensor-map parameter (annotated ts.tensor_map(dtype, box))"
    t: TensorMapType = tmap.type
    wrong = _tma_copy_problem("tma_load", dst, t, bar)
    if wrong:
        return wrong
    if t.im2col_rank:
        return "tma_load reads tiled maps; an im2col map (ts.tensor_map_im2col) is read by tma_load_im2col"
    if len(coords) != t.rank:
        return f"tma_load into a rank-{t.rank} tensor map takes {t.rank} coordinates (outermost first), got {len(coords)}"
    return None


def _check_tma_store(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    tmap, src, *coords = ops
    if not (isinstance(tmap, Var) and isinstance(tmap.type, TensorMapType)) or tmap.type.im2col_rank:
        return "tma_store's first operand must be a tiled tensor-map parameter (ts.tensor_map(dtype, box))"
    t: TensorMapType = tmap.type
    if src.scope != SHARED:
        return f"tma_store reads shared memory, got a {src.scope} source"
    if src.type.dtype != t.dtype:
        return f"tma_store's source holds {src.type.dtype} but the tensor map describes {t.dtype}"
    if len(coords) != t.rank:
        return f"tma_store through a rank-{t.rank} tensor map takes {t.rank} coordinates (outermost first), got {len(coords)}"
    return None


def _check_tma_store_wait(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    return _pending_problem("tma_store_wait", attrs["pending"])


def _check_tma_load_multicast(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    dst, tmap, bar, _mask, *coords = ops
    if not (isinstance(tmap, Var) and isinstance(tmap.type, TensorMapType)) or tmap.type.im2col_rank:
        return "tma_load_multicast's second operand must be a tiled tensor-map parameter (ts.tensor_map(dtype, box))"
    t: TensorMapType = tmap.type
    wrong = _tma_copy_problem("tma_load_multicast", dst, t, bar)
    if wrong:
        return wrong
    if len(coords) != t.rank:
        return (f"tma_load_multicast into a rank-{t.rank} tensor map takes the block mask and {t.rank} coordinates "
                f"(outermost first), got {len(coords)} coordinates")  # fmt: skip
    return None


def _check_tma_load_im2col(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    dst, tmap, bar, *coords = ops
    if not (isinstance(tmap, Var) and isinstance(tmap.type, TensorMapType) and tmap.type.im2col_rank):
        return "tma_load_im2col's second operand must be an im2col tensor-map parameter (ts.tensor_map_im2col)"
    t: TensorMapType = tmap.type
    wrong = _tma_copy_problem("tma_load_im2col", dst, t, bar)
    if wrong:
        return wrong
    if len(coords) != 2 * t.rank - 2:
        return (f"tma_load_im2col over a rank-{t.rank} tensor takes {t.rank} coordinates and {t.rank - 2} "
                f"window offsets (outermost first), got {len(coords)} values")  # fmt: skip
    return None


def _check_load_cluster(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    dst, src, _rank = ops
    if attrs["bytes"] not in (4, 8, 16):
        return f"load_cluster moves 4, 8 or 16 bytes, not {attrs['bytes']!r}"
    if dst.scope != REGISTER or src.scope != SHARED:
        return f"load_cluster reads another block's shared memory into registers, got {src.scope} -> {dst.scope}"
    if dst.type.dtype != src.type.dtype:
        return f"load_cluster needs the same element type on both sides, got {dst.type.dtype} and {src.type.dtype}"
    return None


def _check_setmaxnreg(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    regs, inc = attrs["regs"], attrs["increase"]
    if not isinstance(regs, int) or isinstance(regs, bool) or not 24 <= regs <= 256 or regs % 8:
        return f"setmaxnreg takes a compile-time register count in 24..256, a multiple of 8, got {regs!r}"
    if not isinstance(inc, bool):
        return "setmaxnreg's increase= must be True (raise the limit) or False (lower it)"
    return None


def _check_vstore(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    dst, value, *count = ops
    if not isinstance(value.type, VectorType):
        return f"vstore stores a vector (from vload, vfma, ...), got a value of type {value.type}"
    if dst.type.dtype != value.type.dtype:
        return f"vstore needs the vector's element type at the address, got {value.type} into {dst.type.dtype}"
    if dst.scope != GLOBAL and dst.scope != REGISTER:
        return f"vstore writes global or register tensors, not {dst.scope} ones"
    if len(count) > 1:
        return "vstore takes at most one count (how many leading lanes to store)"
    if count and isinstance(count[0], Const) and not 0 <= count[0].value <= value.type.lanes:
        return f"vstore's count must be in 0..{value.type.lanes}, got {count[0].value}"
    return None


def _check_prefetch(ops: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    if not isinstance(attrs["write"], bool):
        return "prefetch's write= must be True or False"
    if attrs["locality"] not in (0, 1, 2, 3):
        return f"prefetch's locality= is 0 (no reuse) .. 3 (keep in every cache level), got {attrs['locality']!r}"
    return None


INSTRUCTIONS: dict[str, InstructionSpec] = {
    s.name: s
    for s in (
        InstructionSpec("copy_vector", ("addr", "addr"), ("bytes",), False, _check_copy,
                        "copy `bytes` contiguous bytes (one vector load and store); both addresses aligned"),
        InstructionSpec("vstore", ("addr", "vec", "int*"), (), False, _check_vstore,
                        "store a vector's lanes at consecutive elements from the address (with a count: the "
                        "first `count` lanes only, nothing written past them); CPU only"),
        InstructionSpec("prefetch", ("addr",), ("write", "locality"), False, _check_prefetch,
                        "hint that the cache line holding the address will be read (or written) soon; CPU only"),
        InstructionSpec("copy_async", ("addr", "addr", "bool"), ("bytes",), True, _check_cp_async,
                        "cp.async global->shared; zero-fills the destination when the predicate is false"),
        InstructionSpec("copy_async_commit", (), (), True, _ok, "cp.async.commit_group"),
        InstructionSpec("copy_async_wait", (), ("pending",), True, _check_wait,
                        "cp.async.wait_group: wait until at most `pending` groups are in flight"),
        InstructionSpec("ldmatrix", ("addr", "addr"), ("num", "trans"), True, _check_matrix_move("ldmatrix", False),
                        "ldmatrix.sync.aligned.m8n8.x{num}[.trans].shared.b16; each lane gives one row address"),
        InstructionSpec("stmatrix", ("addr", "addr"), ("num", "trans"), True, _check_matrix_move("stmatrix", True),
                        "stmatrix.sync.aligned.m8n8.x{num}[.trans].shared.b16 (SM90): the warp's mma-fragment "
                        "registers (a 32-bit register of two 16-bit values per matrix) into 8 rows of 16 bytes "
                        "per matrix; each lane gives one row address, as for ldmatrix"),
        InstructionSpec("mma", ("addr", "addr", "addr"), ("shape",), True, _check_mma,
                        "mma.sync.aligned (row.col), float32 accumulate: c += a @ b on warp fragments"),
        InstructionSpec("wgmma", ("addr", "addr", "addr"), ("n", "trans_b", "b_chunk_bytes"), True, _check_wgmma,
                        "wgmma.mma_async m64n{n}k16 (SM90), float32 accumulate, A [64, 16] and B [n, 16] K-major "
                        "in shared memory laid out with Swizzle(3, 3, 3) in 1024-byte aligned 8-row groups; with "
                        "trans_b B is [k, n] (MN-major) stored as 64-column chunks b_chunk_bytes apart; A may be a "
                        "register tensor element (the thread's 8 A-fragment values, laid out like an m64n16 "
                        "accumulator: fragments.wgmma_m64_c(16), as flash attention feeds P from its scores)"),
        InstructionSpec("wgmma_fence", (), (), True, _ok, "wgmma.fence: order register accesses before wgmma"),
        InstructionSpec("wgmma_commit", (), (), True, _ok, "wgmma.commit_group"),
        InstructionSpec("wgmma_wait", ("addr*",), ("pending",), True, _check_wgmma_wait,
                        "wgmma.wait_group: wait until at most `pending` wgmma groups are in flight; the register "
                        "tensors named after `pending` (by an element) are fenced there, whole: the C++ compiler "
                        "may not read them earlier (it does not know the wait is what makes the wgmmas' results "
                        "final; without the fence it moved an epilogue's reads of the accumulators above it)"),
        InstructionSpec("fence_proxy_async", (), (), True, _ok,
                        "fence.proxy.async.shared::cta: make shared-memory writes visible to wgmma/TMA"),
        InstructionSpec("mbarrier_init", ("addr", "int"), (), True, _check_mbarrier,
                        "mbarrier.init: a barrier whose phase completes after `count` arrivals (and their bytes)"),
        InstructionSpec("fence_mbarrier_init", (), (), True, _ok,
                        "fence.mbarrier_init.release.cluster: make barrier inits visible (then syncthreads)"),
        InstructionSpec("mbarrier_arrive", ("addr",), (), True, _check_mbarrier, "mbarrier.arrive: one arrival"),
        InstructionSpec("mbarrier_arrive_expect_tx", ("addr", "int"), (), True, _check_mbarrier,
                        "mbarrier.arrive.expect_tx: one arrival, and the phase also waits for `bytes` of async copies"),
        InstructionSpec("mbarrier_wait", ("addr", "int"), (), True, _check_mbarrier,
                        "spin on mbarrier.try_wait.parity until the phase of parity `parity` (0/1) has completed"),
        InstructionSpec("tma_load", ("addr", "tmap", "addr", "int*"), (), True, _check_tma_load,
                        "cp.async.bulk.tensor (TMA) global->shared of one box at the given coordinates (outermost "
                        "first, zero-filled past the edges), completing `box_bytes` on the mbarrier"),
        InstructionSpec("tma_store", ("tmap", "addr", "int*"), (), True, _check_tma_store,
                        "cp.async.bulk.tensor (TMA) shared->global of one box at the given coordinates (outermost "
                        "first; the parts past the tensor's edges are not written), a bulk group of its own; "
                        "the thread issues it after fence_proxy_async and a barrier over the box's writers.  "
                        "The global tensor is written behind the kernel's back: the launcher passes its map"),
        InstructionSpec("tma_store_wait", (), ("pending",), True, _check_tma_store_wait,
                        "cp.async.bulk.wait_group.read: wait until at most `pending` of this thread's tma_store "
                        "groups may still read their shared source (which may then be overwritten; a block "
                        "waits for 0 before it exits, its shared memory being its stores' source)"),
        InstructionSpec("tma_load_multicast", ("addr", "tmap", "addr", "int", "int*"), (), True,
                        _check_tma_load_multicast,
                        "cp.async.bulk.tensor .multicast::cluster: one box (as tma_load) written at the same "
                        "shared-memory offset in every block of the cluster whose bit is set in the mask, each "
                        "block's mbarrier at the same offset completing its bytes"),
        InstructionSpec("mbarrier_arrive_cluster", ("addr", "int"), (), True, _check_mbarrier,
                        "mbarrier.arrive (release at CTA scope) on the barrier at the same shared-memory offset in "
                        "block `rank` of the cluster (mapa): one arrival there; it orders the block's own use of "
                        "a buffer before a peer's TMA overwrites it, not writes the peer will read (cluster_sync)"),
        InstructionSpec("signal_flag", ("addr", "int"), (), True, _check_flag,
                        "st.release.gpu of `value` to a global flag: the writes of every thread that met this "
                        "one at a barrier before it are visible to a thread of any block that waits for the "
                        "value (wait_flag); one thread signals, after its group's barrier"),
        InstructionSpec("wait_flag", ("addr", "int"), (), True, _check_flag,
                        "spin on ld.acquire.gpu of a global flag until it holds `value` (another block's "
                        "signal_flag); a barrier after it passes what the signal published to the group.  In a wgmma "
                        "kernel, after a wgmma_wait(0) of the accumulators read later: a spin ptxas must put its "
                        "own wait into serialises every wgmma (C7518)"),
        InstructionSpec("reduce_add", ("addr", "addr"), ("bytes",), True, _check_reduce_add,
                        "red.global.add.f32 (.v2, .v4 by `bytes`): adds consecutive float32 registers into global "
                        "memory at the L2, relaxed at GPU scope; concurrent adds from many blocks are exact in any "
                        "order only up to float32 rounding (the sum's order varies from run to run)"),
        InstructionSpec("ticket", ("addr", "int", "addr"), (), True, _check_ticket,
                        "atom.add.acq_rel.gpu: adds `add` to a global counter and writes its old value into a "
                        "register (release of the writes a barrier ordered before it, acquire of those released "
                        "by earlier tickets): the thread that sees the counter complete owns what the others made"),
        InstructionSpec("tma_load_im2col", ("addr", "tmap", "addr", "int*"), (), True, _check_tma_load_im2col,
                        "cp.async.bulk.tensor im2col mode: the map's `pixels` consecutive sliding-window positions "
                        "from coordinates (n, [d, h,] w, c) shifted by the window offsets ([d, h,] w), "
                        "`channels` channels each, zero-filled outside the tensor"),
        InstructionSpec("cluster_sync", (), (), True, _ok,
                        "barrier.cluster arrive (release) + wait (acquire): every thread of the thread-block "
                        "cluster (attrs.cluster) meets; earlier global and shared writes become visible"),
        InstructionSpec("load_cluster", ("addr", "addr", "int"), ("bytes",), True, _check_load_cluster,
                        "ld.shared::cluster: `bytes` from the same shared-memory offset in block `rank` of this "
                        "thread-block cluster (distributed shared memory) into registers"),
        InstructionSpec("named_barrier_sync", ("int", "int"), (), True, _ok,
                        "bar.sync id, threads: wait at named barrier `id` (1..15; 0 is syncthreads') until "
                        "`threads` threads (a multiple of 32) have arrived or synced there"),
        InstructionSpec("named_barrier_arrive", ("int", "int"), (), True, _ok,
                        "bar.arrive id, threads: count this warp at named barrier `id` without waiting (a "
                        "producer/consumer hand-off, e.g. warpgroups taking turns)"),
        InstructionSpec("syncwarp", (), (), True, _ok,
                        "__syncwarp(): the warp's lanes meet, and their shared-memory accesses are ordered"),
        InstructionSpec("dequant", ("addr", "addr", "addr", "addr"), ("wtype", "start", "count", "has_bias", "has_scale", "raw"), False,
                        _check_dequant,
                        "dst[i] = (u - bias[row]) * scale[row] for values [start, start + count) of a low-bit unit "
                        "(tessera.ir.lowbit: u the code, offset binary for signed ints, or a small float's value "
                        "* 2**-float_shift; without bias, signed ints subtract their offset); row = (value // 2) % 2; "
                        "raw=True: no scale or bias, dst = the half bits u + lowbit.raw_magic (the kernel subtracts)"),
        InstructionSpec("setmaxnreg", (), ("regs", "increase"), True, _check_setmaxnreg,
                        "setmaxnreg.inc/dec (SM90a): this warpgroup's register budget; needs attrs.min_blocks"),
    )
}  # fmt: skip


CPU_ONLY = frozenset({"vstore", "prefetch"})


def check_instruction(name: str, operands: tuple[Expr, ...], attrs: dict[str, Any]) -> str | None:
    """Validate one use; an error message or None."""
    spec = INSTRUCTIONS.get(name)
    if spec is None:
        return f"unknown instruction {name!r}; known: {sorted(INSTRUCTIONS)}"
    kinds = spec.kinds(len(operands))
    if kinds is None:
        return f"{name} takes {len(spec.operands)} operand(s), got {len(operands)}"
    for kind, op in zip(kinds, operands):
        if kind == "addr" and not isinstance(op, Address):
            return f"{name} takes tensor elements (addresses) as memory operands, e.g. buf[i, j]"
        if kind == "vec" and not isinstance(op.type, VectorType):
            return f"{name} takes a vector value there, got {op.type}"
        if kind == "tmap" and not (isinstance(op, Var) and isinstance(op.type, TensorMapType)):
            return f"{name} takes a tensor-map parameter (annotated ts.tensor_map(dtype, box)) as its map operand"
        if kind == "bool" and (isinstance(op, Address) or not op.dtype.is_bool):
            return f"{name}'s predicate must be a bool expression"
        if kind == "int" and (isinstance(op, Address) or not isinstance(op.type, dtypes.DataType) or not op.dtype.is_integer):
            return f"{name} takes integer values where it takes counts, byte counts, parities and coordinates"
    missing = set(spec.attrs) - set(attrs)
    extra = set(attrs) - set(spec.attrs)
    if missing or extra:
        return f"{name} takes attributes {list(spec.attrs)}, got {sorted(attrs)}"
    return spec.check(operands, attrs)
