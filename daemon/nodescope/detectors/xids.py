"""Xid critical errors by class: ``gpu_xid_<class>``, with the catalog's severity and action.

The ``nvml`` source counts Xids per GPU and code since it started (NVML Xid events, or the
kernel log where event sets are not supported: docs/datasources.md §1.6). A code whose count
grew between the source's two latest reads is a finding of its class's kind
(``gpu_xid_memory``, ``gpu_xid_nvlink``, ``gpu_xid_bus``, ``gpu_xid_firmware``,
``gpu_xid_thermal_power``, ``gpu_xid_engine``, ``gpu_xid_application``, ``gpu_xid_unknown``)
with subjects ``gpu`` (the index; ``bdf`` for a device NVML does not list) and ``xid``, the
severity the catalog gives the code (:mod:`nodescope.model.xid_catalog`, docs/xids.md) and a
message naming the code, its meaning, the GPU by index and address, the jobs that use it and
the operator's action. Application Xids (13, 31, 43, 45, ...) are the job's own faults: info,
which never pages.

The first read of the source has no read before it: every count in it is new (counts start
with the source, and the kernel log's first read is what the ring buffer still holds). A
count lower than the read before is a restarted source: all of it is new.

Xid 79 is ``gpu_fell_off_bus``'s (:mod:`nodescope.detectors.hotplug`), not reported here.

The finding holds while the latest pair of reads shows the increase; its alert rule
(:data:`RULES`: fires at once, resolves :data:`HOLD_SECONDS` after the last new Xid, both
settable per kind under ``[alerts.rules.gpu_xid_<class>]``) keeps it visible after that.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from nodescope.alerts import AlertRule
from nodescope.config import XidsSettings
from nodescope.detectors.common import grown_counts, jobs, jobs_of_gpus
from nodescope.detectors.hotplug import XID_FELL_OFF_BUS
from nodescope.detectors.kinds import FindingKind, actions
from nodescope.model.finding import Finding, Severity
from nodescope.model.nvml import NVML, NvmlData
from nodescope.model.snapshot import Snapshot
from nodescope.model.xid_catalog import (
    APPLICATION,
    BUS,
    CLASSES,
    ENGINE,
    FIRMWARE,
    KINDS,
    MEMORY,
    NVLINK,
    THERMAL_POWER,
    UNKNOWN,
    XidCatalog,
    kind_of,
)

#: Seconds an Xid alert stays firing after the last new Xid of its GPU and code.
HOLD_SECONDS = 300.0

#: One rule for every Xid kind: an Xid is an event, so its alert fires at once and is held.
RULES: Mapping[str, AlertRule] = MappingProxyType(
    {kind: AlertRule(for_seconds=0.0, resolve_after_seconds=HOLD_SECONDS) for kind in KINDS}
)

#: What an Xid of each class says, for the README's table of kinds.
_MEANINGS: Mapping[str, str] = MappingProxyType(
    {
        APPLICATION: "an Xid the application caused (its own fault, not the GPU's)",
        MEMORY: "an Xid of the GPU's memory: ECC errors and row remaps",
        NVLINK: "an Xid of an NVLink or chip-to-chip link",
        BUS: "an Xid of host-to-GPU transfers (Xid 79 is `gpu_fell_off_bus`)",
        FIRMWARE: "an Xid of the driver's firmware, the micro-controllers or GSP",
        THERMAL_POWER: "an Xid of the board's auxiliary power",
        ENGINE: "an engine exception or timeout, of the hardware, driver or application alike",
        UNKNOWN: "an Xid the catalog does not list: a new driver's code, to investigate",
    }
)

#: The remediation of each class, stated for every severity since the catalog gives a class
#: its severities code by code. An application's own Xid says the job failed, not the node:
#: it never drains, whatever severity a code of it gets.
_REMEDIATION: Mapping[str, Mapping[Severity, str]] = MappingProxyType(
    {
        xid_class: actions(
            critical="alert" if xid_class == APPLICATION else "drain",
            warning="alert",
            info="none",
        )
        for xid_class in CLASSES
    }
)


def specs(catalog: XidCatalog) -> tuple[FindingKind, ...]:
    """The spec of every class's kind; its severities are those the catalog gives the
    class's codes (an unlisted code's for ``unknown``)."""
    levels: dict[str, set[Severity]] = {c: set() for c in CLASSES}
    for info in catalog.entries.values():
        levels[info.xid_class].add(info.severity)
    levels[UNKNOWN].add(catalog.unknown_severity)
    return tuple(
        FindingKind(
            kind_of(xid_class),
            frozenset(levels[xid_class]),
            _REMEDIATION[xid_class],
            meaning=_MEANINGS[xid_class],
            signal="Xid events from an NVML event set, else `NVRM: Xid` lines of the kernel log",
            hardware="yes",
            alert=RULES[kind_of(xid_class)],
        )
        for xid_class in CLASSES
    )


_Key = tuple[int | None, str, int]


def _counts(data: NvmlData) -> dict[_Key, int]:
    return {(x.gpu, x.pci_address.lower(), x.xid): x.count for x in data.xids}


def new_xids(snapshot: Snapshot) -> dict[_Key, tuple[int, int]]:
    """(GPU index, address, code) -> (new Xids, Xids since the source started), for every
    code whose count grew between the ``nvml`` source's two latest reads."""
    return grown_counts(snapshot, NVML, _counts)


class XidDetector:
    """The Xid detector with the catalog it classifies by (read once by its owner)."""

    __slots__ = ("catalog",)

    def __init__(self, catalog: XidCatalog) -> None:
        self.catalog = catalog

    def __call__(
        self, previous: Snapshot | None, snapshot: Snapshot, settings: XidsSettings
    ) -> list[Finding]:
        if not settings.enabled:
            return []
        grown = new_xids(snapshot)
        if not grown:
            return []
        users: dict[str, set[str]] = {}
        # The job view of the cycle before as well: a fatal Xid may end the job's processes
        # before this cycle saw them.
        for snap in (previous, snapshot):
            if snap is None:
                continue
            for bdf, ids in jobs_of_gpus(jobs(snap)).items():
                users.setdefault(bdf.lower(), set()).update(ids)
        findings = []
        for (gpu, bdf, code), (added, total) in sorted(
            grown.items(), key=lambda kv: (kv[0][1], kv[0][2])
        ):
            if code == XID_FELL_OFF_BUS:
                continue
            info = self.catalog.lookup(code)
            subjects = {"xid": str(code)}
            if gpu is not None:
                subjects["gpu"] = str(gpu)
            else:
                subjects["bdf"] = bdf
            name = f"GPU {gpu} ({bdf})" if gpu is not None else f"GPU {bdf}"
            owners = sorted(users.get(bdf, ()))
            # In the message only: the identity is the GPU's and the code's.
            used = f", used by job {', '.join(owners)}" if owners else ""
            times = f" ×{added}" if added > 1 else ""
            findings.append(
                Finding(
                    info.kind,
                    info.severity,
                    subjects,
                    {
                        "xid": float(code),
                        "new_xids": float(added),
                        "xids_since_start": float(total),
                    },
                    f"Xid {code}{times} on {name}{used}: {info.name}"
                    f" ({info.xid_class.replace('_', '/')}); action: {info.action_text}",
                )
            )
        return findings
