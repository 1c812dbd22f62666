"""Tensor parallelism for tessera.llm: Megatron-style sharding (layers.py), rank 0's group of
worker processes (group.py) and the workers' entry point (worker.py).

Nothing is imported here: model_runner imports layers.py, and group.py imports model_runner."""
