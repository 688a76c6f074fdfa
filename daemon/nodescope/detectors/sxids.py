"""NVSwitch SXids: ``nvswitch_sxid_fatal`` and ``nvswitch_sxid_nonfatal``.

The ``sxid`` source counts the kernel log's SXids per NVSwitch, code and link since it
started (:mod:`nodescope.sources.sxid`, docs/sxid.md). A count that grew between the
source's two latest reads is a finding with subjects ``nvswitch`` (the switch's PCI address)
and ``sxid`` (the code), one per switch and code whatever the links: the message names the
links, the code and the driver's text.

* ``nvswitch_sxid_fatal`` (critical): the driver said ``Fatal``. The switch stops forwarding
  on that port and the jobs whose traffic crosses it fail or hang; the switch and the GPUs
  behind it need a reset (a fabric manager restart, or a reboot of the node), so the action
  is to drain the node.
* ``nvswitch_sxid_nonfatal`` (warning): the driver said ``Non-fatal``, or neither word (a
  line such as ``26007, SOE EXTERR``: the severity is then not known, and the message says
  so). Watch the link; a count that keeps growing is a link to have checked.

As for Xids (:mod:`nodescope.detectors.xids`), the first read of the source counts
everything it holds as new (the kernel log's first read returns what the ring buffer still
holds, so an SXid from before the daemon started is reported once), and a count lower than
the read before is a restarted source: all of it is new. A previous sample that makes no
pair proves nothing new.

The finding holds while the latest pair of reads shows the increase; its alert rule
(:data:`RULES`) fires at once and is held: a fatal SXid leaves the switch unusable until it
is reset, and nothing in the kernel log says when that happened, so its alert stays
:data:`FATAL_HOLD_SECONDS` after the last new one. The detector has no switch of its own:
``[sources.sxid] enabled = false`` turns the source, and so the findings, off.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from nodescope.alerts import AlertRule
from nodescope.detectors.common import grown_counts
from nodescope.detectors.kinds import FindingKind, actions, severities
from nodescope.model.finding import Finding, Severity
from nodescope.model.snapshot import Snapshot
from nodescope.model.sxid import SXID, SxidCount, SxidData

FATAL = "nvswitch_sxid_fatal"
NONFATAL = "nvswitch_sxid_nonfatal"
KINDS = (FATAL, NONFATAL)

#: Seconds a fatal SXid's alert stays firing after the last new one of its switch and code.
FATAL_HOLD_SECONDS = 1800.0
#: Seconds a non-fatal SXid's alert stays firing after the last new one.
HOLD_SECONDS = 300.0

#: An SXid is an event: its alert fires at once and is held.
RULES: Mapping[str, AlertRule] = MappingProxyType(
    {
        FATAL: AlertRule(for_seconds=0.0, resolve_after_seconds=FATAL_HOLD_SECONDS),
        NONFATAL: AlertRule(for_seconds=0.0, resolve_after_seconds=HOLD_SECONDS),
    }
)

_SXID_SIGNAL = "`SXid` lines of the `nvidia-nvswitch` driver in the kernel log (`/dev/kmsg`)"
_SXID_HARDWARE = "yes, on NVSwitch systems: the driver's only report of a switch error"

SPECS = (
    FindingKind(
        FATAL,
        severities(Severity.CRITICAL),
        actions(critical="drain"),
        meaning="an NVSwitch reported a fatal error: the switch and its GPUs need a reset",
        signal=_SXID_SIGNAL,
        hardware=_SXID_HARDWARE,
        alert=RULES[FATAL],
    ),
    FindingKind(
        NONFATAL,
        severities(Severity.WARNING),
        actions(warning="alert"),
        meaning="an NVSwitch reported a non-fatal error (or one whose severity it did not state)",
        signal=_SXID_SIGNAL,
        hardware=_SXID_HARDWARE,
        alert=RULES[NONFATAL],
    ),
)

FATAL_ACTION = (
    "drain the node: the NVSwitch and the GPUs behind it need a reset"
    " (fabric manager restart or node reboot)"
)
NONFATAL_ACTION = "watch the link; if the count keeps growing, have the link checked"

_Key = tuple[str, int, int | None]


def _key(count: SxidCount) -> _Key:
    return (count.nvswitch.lower(), count.sxid, count.link)


def _counts(data: SxidData) -> dict[_Key, int]:
    return {_key(c): c.count for c in data.counts}


def new_sxids(snapshot: Snapshot) -> list[tuple[SxidCount, int]]:
    """(count, new SXids) of every (switch, code, link) whose count grew between the ``sxid``
    source's two latest reads, in the source's order."""
    grown = grown_counts(snapshot, SXID, _counts)
    latest = snapshot.latest(SXID)
    if latest is None:
        return []
    by_key = {_key(c): c for c in latest.counts}
    return [(by_key[key], added) for key, (added, _) in grown.items()]


@dataclass
class _Group:
    """The grown counts of one switch, code and kind."""

    counts: list[tuple[SxidCount, int]] = field(default_factory=list)

    @property
    def added(self) -> int:
        return sum(added for _, added in self.counts)

    @property
    def total(self) -> int:
        return sum(count.count for count, _ in self.counts)


def _links(counts: list[tuple[SxidCount, int]]) -> str:
    links = sorted({c.link for c, _ in counts if c.link is not None})
    if not links:
        return ""
    word = "link" if len(links) == 1 else "links"
    return f" {word} {', '.join(str(link) for link in links)}"


def detect(previous: Snapshot | None, snapshot: Snapshot, settings: None = None) -> list[Finding]:
    groups: dict[tuple[str, str, int], _Group] = {}
    for count, added in new_sxids(snapshot):
        kind = FATAL if count.fatal else NONFATAL
        groups.setdefault((kind, count.nvswitch.lower(), count.sxid), _Group()).counts.append(
            (count, added)
        )
    findings = []
    for (kind, bdf, code), group in sorted(groups.items()):
        # The latest text of the link with the most new SXids says what happened.
        latest = max(group.counts, key=lambda ca: ca[1])[0]
        added = group.added
        times = f" ×{added}" if added > 1 else ""
        if kind == FATAL:
            severity, word, action = Severity.CRITICAL, "fatal", FATAL_ACTION
        elif any(c.fatal is None for c, _ in group.counts):
            severity, word, action = Severity.WARNING, "severity not stated", NONFATAL_ACTION
        else:
            severity, word, action = Severity.WARNING, "non-fatal", NONFATAL_ACTION
        text = f": {latest.message}" if latest.message else ""
        findings.append(
            Finding(
                kind,
                severity,
                {"nvswitch": bdf, "sxid": str(code)},
                {
                    "sxid": float(code),
                    "new_sxids": float(added),
                    "sxids_since_start": float(group.total),
                },
                f"SXid {code}{times} ({word}) on NVSwitch {bdf} ({latest.device})"
                f"{_links(group.counts)}{text}; action: {action}",
            )
        )
    return findings


__all__ = [
    "FATAL",
    "FATAL_ACTION",
    "FATAL_HOLD_SECONDS",
    "HOLD_SECONDS",
    "KINDS",
    "NONFATAL",
    "NONFATAL_ACTION",
    "RULES",
    "detect",
    "new_sxids",
]
