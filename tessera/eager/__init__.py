"""Eager, torch-facing entry points to the kernel templates, outside any compiled graph.

- `matmul.matmul(a, b)`: the tuned tensor-core GEMM on torch CUDA tensors;
- `attention.flash_attention(q, k, v)`: the SM90 flash-attention kernels;
- `quantize.quantize(model, ...)`, `QuantizedLinear`: low-bit weights for a torch model
  (`tessera.quantize`), whose linears run the low-bit kernels through `lowbit.py`.
"""
