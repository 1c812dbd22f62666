"""Instruction counts of the low-bit decode kernels' machine code (issue 12), no GPU needed:
build each kernel for the configured arch with nvcc, disassemble it with `cuobjdump -sass` and
count the instructions of its main loop (the backward branch whose body holds the most HMMAs)
per HMMA and per weight unit (one warp's 16 x 256 tile; a pass of the loop computes
(stages or unroll, twice that with prefetch) * rows units).

    python3 bench/lowbit_sass.py                          # every type, the default configs at M=1 and 16
    python3 bench/lowbit_sass.py --types int4,e4m3 --ms 1 --all   # every candidate config too
    python3 bench/lowbit_sass.py --types int4 --ops       # the loop's opcode histogram
    python3 bench/lowbit_sass.py --prefill --types int4,int8   # the fused prefill kernel's dequantising loop

cuobjdump comes with the CUDA toolkit (or the `nvidia-cuda-cuobjdump` wheel); set
TESSERA_CUOBJDUMP to its path when it is not on PATH.  A proxy for issue cost only: it says
nothing of latency, memory or the tensor pipe.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tessera as ts  # noqa: E402
from tessera.kernels.lowbit_decode import DecodeConfig, make_decode  # noqa: E402
from tessera.quant import WEIGHT_TYPES  # noqa: E402

LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)([^;]*);")
N0, K0, SMS = 12288, 4096, 132


def cuobjdump() -> str:
    path = os.environ.get("TESSERA_CUOBJDUMP") or shutil.which("cuobjdump")
    if not path:
        sys.exit("cuobjdump is not on PATH: install the CUDA toolkit's (or pip's nvidia-cuda-cuobjdump) "
                 "and put it on PATH, or set TESSERA_CUOBJDUMP")  # fmt: skip
    return path


def instructions(cubin: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of every instruction in the cubin."""
    text = subprocess.run([cuobjdump(), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    return [(int(m[1], 16), m[2], m[3]) for m in map(LINE.match, text.splitlines()) if m]


def main_loop(code: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The body of the backward branch enclosing the most HMMAs (the shortest on ties)."""
    best, best_key = code, None
    for addr, op, args in code:
        target = re.search(r"0x([0-9a-f]+)", args) if op == "BRA" else None
        if target and int(target[1], 16) < addr:
            body = [c for c in code if int(target[1], 16) <= c[0] <= addr]
            key = (sum(c[1] == "HMMA" for c in body), -len(body))
            if best_key is None or key > best_key:
                best, best_key = body, key
    return best


def prefill_loop(code: list[tuple[int, str, str]]) -> list[tuple[int, str, str]]:
    """The fused prefill kernel's dequantising loop (256 k = four stages): the shortest
    backward-branch body holding all of its 16-byte shared stores."""
    best, best_key = code, None
    for addr, op, args in code:
        target = re.search(r"0x([0-9a-f]+)", args) if op == "BRA" else None
        if target and int(target[1], 16) < addr:
            body = [c for c in code if int(target[1], 16) <= c[0] <= addr]
            key = (sum(c[1] == "STS" and ".128" in c[2] for c in body), -len(body))
            if best_key is None or key > best_key:
                best, best_key = body, key
    return best


def prefill_counts(names: list[str], group: int, bias: bool) -> None:
    """Per buildable config of tessera.kernels.lowbit_gemm: the dequantising loop's instructions
    per 64-k stage (one warp; the tensor cores take ~1024 cycles per stage of a 256 x 128 tile
    at full rate), its shared stores, global loads and selects."""
    from tessera.kernels import lowbit_gemm

    print("type  config                              per stage  STS.128  LDG  SEL+PRMT")
    for name in names:
        t = ts.dtype(name)
        for c in lowbit_gemm.buildable_configs(t, group, bias and t.is_integer):
            loop = prefill_loop(instructions(lowbit_gemm.make_lowbit_gemm(t, group, bias and t.is_integer, c).build()))
            ops = collections.Counter(op for _, op, _ in loop)
            sts = sum(op == "STS" and ".128" in a for _, op, a in loop)
            print(f"{name:5} {str(c):36} {len(loop) / 4:9.0f}  {sts:7}  {ops['LDG']:3}  {ops['SEL'] + ops['PRMT']:8}",
                  flush=True)  # fmt: skip


def count(t: ts.DataType, group: int, bias: bool, config: DecodeConfig) -> dict:
    code = instructions(make_decode(t, group, bias, config, K0 % 256 == 0, config.span == 2 and group % 32 == 0).build())
    loop = main_loop(code)
    hmma = sum(op == "HMMA" for _, op, _ in loop)
    ops = collections.Counter(op for _, op, _ in loop)
    return {"total": len(code), "loop": len(loop), "hmma": hmma, "ops": ops}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default=",".join(t.name for t in WEIGHT_TYPES))
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--bias", action="store_true", help="with zero points (integer types)")
    ap.add_argument("--all", action="store_true", help="every candidate config, not only the default")
    ap.add_argument("--configs", default="", help="candidate names to count (DecodeConfig.candidates), e.g. reg,r16")
    ap.add_argument("--ops", action="store_true", help="print the main loop's opcode histogram")
    ap.add_argument("--prefill", action="store_true", help="count the fused prefill kernel (lowbit_gemm) instead")
    args = ap.parse_args()
    if args.prefill:
        prefill_counts(args.types.split(","), args.group, args.bias)
        return
    print("type  M   config                             loop  HMMA  per HMMA  per unit  (kernel total)")
    for name in args.types.split(","):
        t = ts.dtype(name)
        bias = args.bias and t.is_integer
        for m in (int(m) for m in args.ms.split(",")):
            cands = DecodeConfig.candidates(t.nbits, m, N0, K0, SMS)
            if args.configs:
                cands = {name: c for name, c in cands.items() if name in args.configs.split(",")}
            elif not args.all:
                cands = {"default": DecodeConfig.default(t.nbits, m, N0, K0, SMS)}
            for cname, c in cands.items():
                r = count(t, args.group, bias, c)
                units = (c.stages or c.unroll * (2 if c.prefetch else 1)) * c.rows  # units per pass of the main loop
                print(f"{name:5} {m:<3} {cname + ' ' + str(c):34} {r['loop']:5} {r['hmma']:5} "
                      f"{r['loop'] / max(r['hmma'], 1):8.1f}  {r['loop'] / units:8.0f}  ({r['total']})", flush=True)  # fmt: skip
                if args.ops:
                    print("    " + " ".join(f"{op} {n}" for op, n in r["ops"].most_common()))


if __name__ == "__main__":
    main()
