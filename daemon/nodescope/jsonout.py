"""Plain JSON from the typed records (dataclasses, NamedTuples, enums, tuples, mappings)."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any


def plain(value: Any) -> Any:
    """Recursively turn typed records into JSON-ready values. Non-finite floats become None
    (JSON has no NaN)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, enum.Enum):
        return plain(value.value) if not isinstance(value.value, int) else value.name.lower()
    if isinstance(value, Sequence) and not isinstance(value, tuple | list | bytes):
        # A sequence of its own kind, e.g. records held as columns (one tuple per field),
        # is written as the items it gives, even when it is a dataclass too.
        return [plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return {name: plain(getattr(value, name)) for name in value._fields}
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = [plain(v) for v in value]
        return sorted(items, key=json.dumps) if isinstance(value, set | frozenset) else items
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, bytes):
        return value.hex()
    return str(value)


def dumps(value: Any) -> str:
    return json.dumps(plain(value), indent=2, sort_keys=False) + "\n"
