"""Shared case selection for the low-bit GPU tests."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

from tessera.ir.dtypes import DataType
from tessera.quant import WEIGHT_TYPES

Item = TypeVar("Item")
Config = TypeVar("Config")


def rotated(items: Sequence[Item], configs: Sequence[Config], t: DataType,
            per_config: int = 2) -> Iterator[tuple[int, Config, Item]]:  # fmt: skip
    """(index, config, item) triples in which each config meets `per_config` of the items, evenly
    spaced and shifted by the weight type's position, so that across the types every config meets
    every item, and within a type every item meets a config when len(configs) * per_config covers
    them. The full product built ~150 kernels per type (nvcc time: minutes per type)."""
    shift = WEIGHT_TYPES.index(t)
    for j, config in enumerate(configs):
        picks = {(j + shift + r * len(items) // per_config) % len(items) for r in range(per_config)}
        for c in sorted(picks):
            yield j, config, items[c]
