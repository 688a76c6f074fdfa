"""Records a parser skipped, by reason: one bad record never takes its source down.

A process name, a cgroup file or a port attribute is input any user (or an odd driver) can
make malformed. Parsers skip such a record and note why in a :class:`SkipTally`; the source
freezes it into its record's ``skipped`` field (a :class:`Skipped`). The collector adds those
to per-source totals (``nodescope_source_records_skipped_total{source,reason}``) and logs the
first example of each reason, rate-limited.

Reasons are short constants chosen by the parser (``"stat_unparsable"``), never text taken
from the input, so the label set stays bounded whatever the input holds. The example — the
path or the record that was skipped — is kept escaped and cut short, and only for the log.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

#: Characters of an example kept for the log: enough to find the record, never a whole
#: hostile payload.
EXAMPLE_CHARS = 160


def _escaped(detail: str) -> str:
    """``detail`` as one printable line: a user-made name may hold newlines and escapes."""
    text = repr(detail[: EXAMPLE_CHARS * 2])[1:-1]
    return text if len(text) <= EXAMPLE_CHARS else text[:EXAMPLE_CHARS] + "…"


@dataclass(frozen=True, slots=True)
class Skipped:
    """What one run of a source skipped: counts per reason and one example of each.

    The mappings are plain dicts that nothing writes after :meth:`SkipTally.freeze` (a
    ``MappingProxyType`` would keep records that hold a ``Skipped`` from being copied or
    turned into dicts by :func:`dataclasses.asdict`)."""

    counts: Mapping[str, int] = field(default_factory=dict)
    examples: Mapping[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.counts)

    def __add__(self, other: Skipped) -> Skipped:
        if not other:
            return self
        if not self:
            return other
        tally = SkipTally()
        tally.merge(self)
        tally.merge(other)
        return tally.freeze()


#: A run that skipped nothing; shared, as it is immutable.
NOTHING_SKIPPED = Skipped()


class SkipTally:
    """The mutable builder a parser fills while it reads one input."""

    __slots__ = ("_counts", "_examples")

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._examples: dict[str, str] = {}

    def skip(self, reason: str, example: str = "") -> None:
        """Count one skipped record; ``reason`` is a constant, ``example`` says which."""
        count = self._counts.get(reason)
        if count is None:
            self._counts[reason] = 1
            self._examples[reason] = _escaped(example)
        else:
            self._counts[reason] = count + 1

    def merge(self, skipped: Skipped) -> None:
        for reason, count in skipped.counts.items():
            if reason not in self._counts:
                self._counts[reason] = 0
                self._examples[reason] = skipped.examples.get(reason, "")
            self._counts[reason] += count

    def __bool__(self) -> bool:
        return bool(self._counts)

    def freeze(self) -> Skipped:
        if not self._counts:
            return NOTHING_SKIPPED
        return Skipped(dict(self._counts), dict(self._examples))
