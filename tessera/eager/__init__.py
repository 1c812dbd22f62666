"""Eager, torch-facing entry points to the kernel templates, outside any compiled graph.

- `matmul.matmul(a, b)`: the tuned tensor-core GEMM on torch CUDA tensors;
- `attention.flash_attention(q, k, v)`: the SM90 flash-attention kernels;
- `paged_attention.paged_attention(...)`, `write_kv_cache(...)`: attention over tessera.llm's
  block-paged KV cache (CPU and CUDA kernels of templates/paged_attention);
- `quantize.quantize(model, ...)`, `QuantizedLinear`: low-bit weights for a torch model
  (`tessera.quantize`), whose linears run the low-bit kernels through `lowbit.py`.
"""
