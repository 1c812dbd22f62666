"""Front ends: `tessera.frontend.torch` (the torch.compile backend) and `tessera.frontend.onnx`.

Neither is imported by `import tessera`; each imports its framework (torch, onnx) itself.
"""
