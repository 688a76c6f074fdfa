"""The typed name of a source's records.

Each source's record type is declared once, in ``model/``, beside a :class:`SourceKey` that
names the source. The collector files samples under ``key.name``; every consumer reads them
back with ``snapshot.latest(KEY)`` or ``snapshot.pair(KEY)``, so mypy knows the type of what it
gets and a consumer cannot ask for one source's records under another's type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SourceKey(Generic[T]):
    """``name``: the source's name in the config and the metrics; ``kind``: its record type."""

    name: str
    kind: type[T]

    def of(self, record: object) -> T | None:
        """``record`` when it is of this source's type, else ``None``."""
        return record if isinstance(record, self.kind) else None
