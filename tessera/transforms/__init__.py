"""IR-to-IR passes, one per file, and the pipeline that orders them."""

from tessera.transforms.pipeline import PIPELINE, lower

__all__ = ["PIPELINE", "lower"]
