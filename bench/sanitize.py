"""One small launch of each GPU kernel family, to run under compute-sanitizer:

    compute-sanitizer --tool memcheck python3 bench/sanitize.py
    compute-sanitizer --tool racecheck python3 bench/sanitize.py

Shapes are odd so the edge predicates and zero-fill paths run.  Prints one line per kernel
family and checks results against torch (a sanitizer run must also be a correct run)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tessera.kernels import reduce_ops  # noqa: E402
from tessera.kernels.gemm import GemmConfig  # noqa: E402
from tessera.kernels.gemm_sm90 import WgmmaConfig  # noqa: E402
from tessera.kernels.matmul import matmul  # noqa: E402


def check(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    err = float((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-30))
    print(f"{name:<28} max rel err {err:.1e}", flush=True)
    assert err < tol, (name, err)


def main() -> None:
    torch.manual_seed(0)
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
    x = torch.randn(37, 1003, device="cuda", dtype=torch.float16)
    w = torch.randn(1003, device="cuda", dtype=torch.float16)
    bias = torch.randn(1003, device="cuda", dtype=torch.float16)
    check("row sum", reduce_ops.row_reduce(x, "sum"), x.double().sum(-1), 1e-2)
    check("softmax", reduce_ops.softmax(x), torch.softmax(x.double(), -1), 1e-2)
    check("layer_norm", reduce_ops.layer_norm(x, w, bias, 1e-5),
          torch.nn.functional.layer_norm(x.double(), (1003,), w.double(), bias.double(), 1e-5), 1e-2)  # fmt: skip
    x8 = torch.randn(33, 4096, device="cuda", dtype=torch.float16)
    w8 = torch.randn(4096, device="cuda", dtype=torch.float16)
    check("rms_norm (vector)", reduce_ops.rms_norm(x8, w8, 1e-5),
          torch.nn.functional.rms_norm(x8.double(), (4096,), w8.double(), 1e-5), 1e-2)  # fmt: skip
    torch.cuda.synchronize()
    print("all kernels ran")


if __name__ == "__main__":
    main()
