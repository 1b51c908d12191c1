"""pysunspec2's own view of SunSpec registers, for tests: the reference our codecs are checked against.

Nothing here uses dimmer's codecs: models are pysunspec2 `Model` objects over raw bytes, and points are read with
pysunspec2's own decoding (`Point.value`, `Point.cvalue`).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from typing import Any

from sunspec2 import device as sunspec_device


def to_bytes(words: Sequence[int]) -> bytes:
    return struct.pack(f">{len(words)}H", *words)


def to_words(data: bytes) -> list[int]:
    return list(struct.unpack(f">{len(data) // 2}H", data))


def reference_model(model_id: int, words: Sequence[int] | None = None) -> Any:
    """A pysunspec2 Model of `model_id` over `words` (from its ID register on), or with no data."""
    if words is None:
        return sunspec_device.Model(model_id=model_id)
    return sunspec_device.Model(model_id=model_id, model_len=len(words) - 2, data=to_bytes(words))


def points(group: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every point of a pysunspec2 model or group, fixed groups flattened as `Group.Point`."""
    for name, p in group.points.items():
        yield prefix + name, p
    for gname, g in group.groups.items():
        subs = g if isinstance(g, list) else [g]
        for i, sub in enumerate(subs):
            label = gname if len(subs) == 1 else f"{gname}[{i}]"
            yield from points(sub, f"{prefix}{label}.")
