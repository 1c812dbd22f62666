"""One small launch of each GPU kernel family, to run under compute-sanitizer:

    compute-sanitizer --tool memcheck --report-api-errors no python3 bench/sanitize.py
    compute-sanitizer --tool racecheck python3 bench/sanitize.py

(`--report-api-errors no`: cuda-bindings probes driver entry points with cuGetProcAddress,
and the misses it expects are reported as API errors; they are not kernel accesses.)

Shapes are odd so the edge predicates and zero-fill paths run.  Prints one line per kernel
family with the kernel the dispatcher chose, and checks results against torch (a sanitizer
run must also be a correct run).  The row-kernel families run first, then GEMM; a section that
raises is reported and the script exits non-zero after running the rest.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tessera.templates.row import kinds as reduce_ops  # noqa: E402

F = torch.nn.functional


def check(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    err = float((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))
    print(f"{name:<44} max rel err {err:.1e}", flush=True)
    assert err < tol, (name, err)


def _kernel(op: str, x: torch.Tensor) -> str:
    vector = (x.shape[-1] * x.element_size()) % 16 == 0 and x.data_ptr() % 16 == 0
    return reduce_ops.kernel_for(op, str(x.dtype), x.shape[-1], vector).ir.name


def row_kernels() -> None:
    h = torch.float16
    x = torch.randn(37, 1003, device="cuda", dtype=h)  # element loads (C % 8 != 0)
    w = torch.randn(1003, device="cuda", dtype=h)
    bias = torch.randn(1003, device="cuda", dtype=h)
    x8 = torch.randn(33, 4096, device="cuda", dtype=h)  # 16-byte loads, one row per block
    w8 = torch.randn(4096, device="cuda", dtype=h)
    b8 = torch.randn(4096, device="cuda", dtype=h)
    xs = torch.randn(45, 768, device="cuda", dtype=h)  # short rows: four rows per block
    xl = torch.randn(3, 40000, device="cuda", dtype=h)  # too long to cache: streaming
    cases: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = [
        ("sum", x, reduce_ops.row_reduce(x, "sum"), x.double().sum(-1)),
        ("max", x8, reduce_ops.row_reduce(x8, "max"), x8.double().amax(-1)),
        ("mean", xs, reduce_ops.row_reduce(xs, "mean"), xs.double().mean(-1)),
        ("softmax", x, reduce_ops.softmax(x), torch.softmax(x.double(), -1)),
        ("softmax", x8, reduce_ops.softmax(x8), torch.softmax(x8.double(), -1)),
        ("softmax", xs, reduce_ops.softmax(xs), torch.softmax(xs.double(), -1)),
        ("softmax", xl, reduce_ops.softmax(xl), torch.softmax(xl.double(), -1)),
        ("layernorm", x, reduce_ops.layer_norm(x, w, bias, 1e-5),
         F.layer_norm(x.double(), (1003,), w.double(), bias.double(), 1e-5)),
        ("layernorm", x8, reduce_ops.layer_norm(x8, w8, b8, 1e-5),
         F.layer_norm(x8.double(), (4096,), w8.double(), b8.double(), 1e-5)),
        ("rmsnorm", x8, reduce_ops.rms_norm(x8, w8, 1e-5), F.rms_norm(x8.double(), (4096,), w8.double(), 1e-5)),
        ("rmsnorm", xl, reduce_ops.rms_norm(xl, xl[0], 1e-5), F.rms_norm(xl.double(), (40000,), xl[0].double(), 1e-5)),
    ]  # fmt: skip
    for op, inp, out, ref in cases:
        check(f"{op} {tuple(inp.shape)} {_kernel(op, inp)}", out, ref, 1e-2)


def gemm_kernels() -> None:
    from tessera.eager.matmul import matmul
    from tessera.templates.gemm.mma import GemmConfig
    from tessera.templates.gemm.tma import TmaConfig
    from tessera.templates.gemm.wgmma import WgmmaConfig

    a = torch.randn(70, 136, device="cuda", dtype=torch.float16)
    b = torch.randn(136, 90, device="cuda", dtype=torch.float16)
    ref = a.double() @ b.double()
    check("gemm mma.sync", matmul(a, b, config=GemmConfig(64, 128, 32, 32, 64, 3)), ref, 3e-3)
    check("gemm mma.sync split-k", matmul(a, b, config=GemmConfig(16, 64, 64, 16, 16, 3, split_k=2)), ref, 3e-3)
    check("gemm scalar path", matmul(a[:, :135], b[:135], config=GemmConfig(64, 128, 32, 32, 64, 3)),
          a[:, :135].double() @ b[:135].double(), 3e-3)  # fmt: skip
    if torch.cuda.get_device_capability() == (9, 0):
        bt = b.t().contiguous()
        check("gemm wgmma", matmul(a, bt, b_layout="nk", config=WgmmaConfig(64, 128, 3)), ref, 3e-3)
        a8, b8 = a[:, :128].contiguous(), b[:128, :88].contiguous()  # TMA: rows of a multiple of 16 bytes
        ref8 = a8.double() @ b8.double()
        tma = [("tma", TmaConfig(128, 256, 3)), ("tma staged", TmaConfig(128, 64, 4, epilogue="staged")),
               ("tma split-k", TmaConfig(64, 64, 4, 1, split_k=2, persistent=False)),
               ("tma split-k cluster", TmaConfig(64, 64, 4, 1, split_k=2, persistent=False, split_reduce="cluster"))]
        for name, cfg in tma:
            check(f"gemm {name} nk", matmul(a8, b8.t().contiguous(), b_layout="nk", config=cfg), ref8, 3e-3)
            check(f"gemm {name} kn", matmul(a8, b8, config=cfg), ref8, 3e-3)


def main() -> None:
    torch.manual_seed(0)
    sections: list[tuple[str, Callable[[], None]]] = [("row kernels", row_kernels), ("gemm", gemm_kernels)]
    failed = []
    for name, run in sections:
        try:
            run()
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001  (report and go on: the other families still get checked)
            traceback.print_exc()
            failed.append(name)
    if failed:
        print(f"FAILED: {', '.join(failed)}")
        sys.exit(1)
    print("all kernels ran")


if __name__ == "__main__":
    main()
